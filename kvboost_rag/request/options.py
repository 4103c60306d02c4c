"""Per-call options of ``generate`` and ``stream``: one validated object for both.

Bad values raise :class:`~kvboost_rag.errors.InvalidInputError` naming the field and what it
accepts: no silent coercion of ``True`` to 1, ``"word"`` to a list of characters, or NaN to a
temperature.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kvboost_rag.errors import InvalidInputError
from kvboost_rag.request.constraint import OutputConstraint


class GenerationOptions(BaseModel):
    """How one prompt is decoded and whether the cache is used.

    Attributes:
        max_new_tokens: Upper bound on generated tokens (an integer >= 1).
        temperature: 0 for greedy decoding, else the softmax temperature (finite, >= 0).
        top_p: Nucleus sampling mass in (0, 1].
        repetition_penalty: Above 1, lowers the logits of tokens this call already generated
            (the transformers rule; prompt tokens are not penalized, so answers may quote the
            documents). Small models loop less inside constrained strings with about 1.2.
        seed: Seed of the sampling generator (reproducible sampling), in the range torch's
            generators take (-2**63 to 2**64 - 1).
        stop: Strings that end the output; it is cut before the first one. A single string
            is one stop string.
        reuse: ``False`` runs full prefill through the same code path (the baseline) and
            neither reads nor writes the cache.
        documents: Texts the caller knows are in the prompt: cut on their boundaries and
            stored for next time even if never warmed.
        return_logits: Fill ``GenerationResult.first_token_logits`` and ``step_logits``.
        constraint: What the output must match (a JSON schema or a grammar; see
            :class:`~kvboost_rag.request.constraint.OutputConstraint`); a dict is read as its fields.
            Decoding masks every token that would leave the match and, as the tokens left
            reach what closing the output takes, allows only tokens that leave room to close
            it, so the output is valid at any ``max_new_tokens`` from the constraint's minimum
            up; a smaller budget is an ``InvalidInputError`` naming the minimum, before any
            prefill. (A grammar whose closing the engine cannot plan, such as a pattern it
            cannot satisfy byte by byte, is not closed: ``finish_reason`` ``"length"`` then
            means the budget cut it.) Needs ``kvboost-rag[constrained]``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    max_new_tokens: int = Field(128, ge=1)
    temperature: float = Field(0.0, ge=0.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    repetition_penalty: float = Field(1.0, ge=1.0, allow_inf_nan=False)
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stop: tuple[str, ...] = ()
    reuse: bool = True
    documents: tuple[str, ...] = ()
    return_logits: bool = False
    constraint: OutputConstraint | None = None

    @field_validator("constraint", mode="before")
    @classmethod
    def _constraint_from_dict(cls, value: Any) -> Any:
        # Strict mode takes model instances only; a dict of its fields is also accepted.
        return OutputConstraint(**value) if isinstance(value, Mapping) else value

    @field_validator("stop", mode="before")
    @classmethod
    def _one_string_is_one_stop(cls, value: Any) -> Any:
        if value is None:
            return ()
        if isinstance(value, str):
            return (value,)
        return tuple(value) if isinstance(value, list) else value

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if any(not s for s in value):
            raise ValueError("stop strings must be non-empty")
        return value

    @field_validator("documents", mode="before")
    @classmethod
    def _documents_are_a_list(cls, value: Any) -> Any:
        if value is None:
            return ()
        if isinstance(value, str):
            raise ValueError("documents must be a list of strings, not one string: pass [text]")
        return tuple(value) if isinstance(value, (list, tuple)) else value

    @field_validator("documents")
    @classmethod
    def _drop_empty_documents(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(d for d in value if d)

    @classmethod
    def resolve(cls, options: GenerationOptions | None, overrides: Mapping[str, Any]) -> GenerationOptions:
        """``options`` (or the defaults) with ``overrides`` applied, validated.

        Raises:
            InvalidInputError: A value the engine cannot use; the message names the field.
        """
        if options is not None and not isinstance(options, GenerationOptions):
            raise InvalidInputError(f"options must be a GenerationOptions, got {type(options).__name__}")
        values = {**(dict(options) if options is not None else {}), **overrides}
        try:
            return cls(**values)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or 'options'}: {err['msg']} (got {err.get('input')!r})"
                for err in exc.errors()
            )
            raise InvalidInputError(f"invalid generation options: {problems}") from None
