"""Settings of the HTTP server (the engine's own settings are ``KVBoostSettings``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

#: Requests the server holds at once unless told otherwise (decoding, waiting for a place in
#: the engine's batch, or prefilling).
DEFAULT_MAX_PENDING = 64


class ServerSettings(BaseModel):
    """How the server answers; the defaults of each request's generation parameters.

    The generation fields (``max_new_tokens`` ... ``reuse``) fill what a request leaves out,
    under the names :func:`kvboost_rag.integration.call_params` reads.

    Attributes:
        model_names: Names requests may give as ``model``; the first is the one ``/v1/models``
            lists first. Empty: the engine's model name.
        api_key: When set, every ``/v1`` request needs ``Authorization: Bearer <api_key>``.
        max_pending: Requests held at once (queued in the engine or running); one more gets a
            429 with ``Retry-After``.
        retry_after_seconds: ``Retry-After`` of a 429 or 503.
        max_body_bytes: Largest request body; a larger one gets a 413.
        warm_batch_size: Documents per ``warm_documents`` call of ``POST /v1/documents``.
        max_new_tokens: Tokens generated when a request sets no ``max_tokens``.
        temperature: Temperature when a request sets none (1.0, as the OpenAI API).
        top_p: Nucleus mass when a request sets none.
        repetition_penalty: Repetition penalty when a request sets none.
        seed: Sampling seed when a request sets none.
        stop: Stop strings when a request sets none.
        reuse: Whether requests read and write the cache unless they say otherwise.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_names: tuple[str, ...] = ()
    api_key: str | None = None
    max_pending: int = Field(DEFAULT_MAX_PENDING, ge=1)
    retry_after_seconds: int = Field(1, ge=0)
    max_body_bytes: int = Field(32 * 1024 * 1024, ge=1024)
    warm_batch_size: int = Field(16, ge=1)
    max_new_tokens: int = Field(256, ge=1)
    temperature: float = Field(1.0, ge=0.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, ge=1.0, allow_inf_nan=False)
    seed: int | None = None
    stop: tuple[str, ...] | None = None
    reuse: bool = True
