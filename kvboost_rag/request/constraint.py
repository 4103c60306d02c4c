"""What a call asks the generated text to match: a JSON schema or a grammar (validated here,
compiled for decoding by :mod:`kvboost_rag.decode.constrained`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator, model_validator


class OutputConstraint(BaseModel):
    """What the generated text must match. Set exactly one field.

    Attributes:
        json_schema: A JSON schema (a dict); the output is one JSON value valid for it.
        grammar: A Lark grammar in llguidance's dialect; ``%json { schema }`` embeds a JSON
            schema as a rule.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    json_schema: dict[str, Any] | None = None
    grammar: str | None = None

    @field_validator("json_schema")
    @classmethod
    def _serializable(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            try:
                json.dumps(value)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"json_schema must be JSON-serializable: {exc}") from None
        return value

    @model_validator(mode="after")
    def _exactly_one(self) -> OutputConstraint:
        if (self.json_schema is None) == (self.grammar is None):
            raise ValueError("set exactly one of json_schema and grammar")
        if self.grammar is not None and not self.grammar.strip():
            raise ValueError("grammar is empty")
        return self

    @classmethod
    def from_json_schema(cls, schema: Mapping[str, Any]) -> OutputConstraint:
        """A constraint to one JSON value valid for ``schema``."""
        return cls(json_schema=dict(schema))

    @classmethod
    def any_json_object(cls) -> OutputConstraint:
        """A constraint to one JSON object of any shape (JSON mode)."""
        return cls(json_schema={"type": "object"})
