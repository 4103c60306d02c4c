"""Settings of the HTTP server (the engine's own settings are ``KVBoostSettings``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

#: Requests the server holds at once unless told otherwise (decoding, waiting for a place in
#: the engine's batch, or prefilling).
DEFAULT_MAX_PENDING = 64

#: The seeds requests may give: the signed 64-bit range (the OpenAI API's int64; torch's generators
#: take it, and nothing past 2**64-1 or below -2**63).
SEED_MIN = -(2**63)
SEED_MAX = 2**63 - 1


class RequestLimits(BaseModel):
    """Bounds on what one request may ask for; a request over one gets a 400 naming it.

    Each bound caps work a client could otherwise make unbounded: stop strings are scanned at
    every decoded token, each prompt and each document is tokenized, prefilled and stored,
    tools and schemas are compiled. The body bound (``ServerSettings.max_body_bytes``) caps
    the rest.

    Attributes:
        max_stop_sequences: Stop strings per request (4, as the OpenAI API).
        max_stop_chars: Characters of one stop string.
        max_prompts: Prompts per ``/v1/completions`` request.
        max_request_documents: Documents one generation request names (its ``documents``
            field and its content parts marked ``cache_control``, together).
        max_warm_documents: Documents per ``POST /v1/documents`` call.
        max_logit_bias_entries: Entries of ``logit_bias`` (300, as the OpenAI API; the server
            refuses a non-empty one anyway, after this bound).
        max_tools: Tools per chat request (128, as the OpenAI API).
        max_schema_bytes: Bytes of one tool's definition or of ``response_format``, as JSON.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_stop_sequences: int = Field(4, ge=1)
    max_stop_chars: int = Field(256, ge=1)
    max_prompts: int = Field(64, ge=1)
    max_request_documents: int = Field(64, ge=0)
    max_warm_documents: int = Field(1024, ge=1)
    max_logit_bias_entries: int = Field(300, ge=0)
    max_tools: int = Field(128, ge=0)
    max_schema_bytes: int = Field(64 * 1024, ge=256)


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
        max_connections: Connections (and requests) uvicorn holds at once; one more gets a
            503 from uvicorn itself (``limit_concurrency``). Keep it above ``max_pending``.
        keep_alive_seconds: Seconds an idle keep-alive connection stays open
            (``timeout_keep_alive``).
        limits: Bounds on each request's inputs (:class:`RequestLimits`).
        warm_batch_size: Documents per ``warm_documents`` call of ``POST /v1/documents``.
        max_new_tokens: Tokens generated when a request sets no ``max_tokens``.
        max_tokens_limit: Largest ``max_tokens`` (or ``max_completion_tokens``) a request may ask;
            more is a 400, and ``/openapi.json`` gives it as the field's ``maximum``. ``None``: no
            bound (the engine stops at the context window).
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
    max_connections: int = Field(1024, ge=1)
    keep_alive_seconds: int = Field(5, ge=1)
    limits: RequestLimits = RequestLimits()
    warm_batch_size: int = Field(16, ge=1)
    max_new_tokens: int = Field(256, ge=1)
    max_tokens_limit: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, ge=1.0, allow_inf_nan=False)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: tuple[str, ...] | None = None
    reuse: bool = True
