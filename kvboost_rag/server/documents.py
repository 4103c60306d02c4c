"""Documents: warming them at ingest (``POST /v1/documents``) and counting those kept.

A prompt's documents are found by content wherever they land, with no markers, once warmed.
A request can also name them (``documents`` in the body, or content parts marked
``cache_control``; see :func:`kvboost_rag.server.generation.engine_params`): they are cut on
their boundaries and stored even if never warmed.

``POST /v1/documents`` takes a JSON list of texts, ``{"documents": [text or {"id", "text"}]}``,
or a JSONL upload (``Content-Type: application/jsonl`` or ``application/x-ndjson``, one
``{"id", "text"}`` object per line) and warms them as the integrations' prewarmers do
(:func:`kvboost_rag.integration.prewarm_texts`: empty, repeated, already-warm and oversized
documents skipped, a failing one isolated), into the engine's tiers: memory, and the disk
folder or Redis (Cluster) other replicas read.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from kvboost_rag.integration import prewarm_texts
from kvboost_rag.server.admission import Slot
from kvboost_rag.server.errors import bad_request
from kvboost_rag.server.generation import CLIENT_CLOSED, unless_disconnected
from kvboost_rag.server.internals import call_in_thread
from kvboost_rag.server.limits import check_count
from kvboost_rag.server.schemas import WarmDocument, WarmRequest
from kvboost_rag.server.state import ServerState, server_state

router = APIRouter()

#: Content types read as JSONL (one document object per line).
JSONL_TYPES = ("application/jsonl", "application/x-ndjson", "application/jsonlines", "application/x-jsonlines")


def _check_document_count(documents: list[Any], limit: int) -> None:
    """Refuse more than ``limit`` documents in one call (``max_warm_documents``)."""
    check_count("documents", documents, limit, "max_warm_documents", "documents")


def _jsonl_documents(body: bytes, text_field: str, limit: int) -> list[WarmDocument]:
    """One document per non-empty line of a JSONL upload (at most ``limit``).

    Raises:
        APIError: A line that is not a JSON object with a string ``text_field``; more than
            ``limit`` non-empty lines (refused before any is parsed).
    """
    lines = body.decode("utf-8", errors="replace").splitlines()
    _check_document_count([line for line in lines if line.strip()], limit)
    documents: list[WarmDocument] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise bad_request(f"line {number} of the upload is not JSON ({exc.msg})", "body") from None
        if not isinstance(row, dict) or not isinstance(row.get(text_field), str):
            raise bad_request(f"line {number} of the upload needs a string field {text_field!r}", "body")
        documents.append(WarmDocument(id=str(row.get("id", f"line {number}")), text=row[text_field]))
    return documents


def _json_documents(body: bytes, limit: int) -> list[WarmDocument]:
    """The documents of a JSON body: a list of texts, or ``{"documents": [...]}``.

    Raises:
        APIError: Invalid JSON, another shape, or more than ``limit`` documents.
    """
    try:
        data = json.loads(body or b"null")
    except json.JSONDecodeError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc.msg}") from None
    except UnicodeDecodeError as exc:  # json.loads guesses UTF-8, -16 or -32 from the bytes
        raise bad_request(f"the request body is not valid JSON text: {exc.reason} at byte {exc.start}") from None
    listed = data if isinstance(data, list) else data.get("documents") if isinstance(data, dict) else None
    if isinstance(listed, list):
        _check_document_count(listed, limit)
    try:
        request = WarmRequest.model_validate({"documents": data} if isinstance(data, list) else data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        raise bad_request(f"give a list of texts or {{'documents': [...]}}: {problems}", "documents") from None
    return [d if isinstance(d, WarmDocument) else WarmDocument(text=d) for d in request.documents]


async def read_documents(request: Request, limit: int) -> list[WarmDocument]:
    """The documents of a warm request, JSON or JSONL by its content type (at most ``limit``).

    Raises:
        APIError: A body that is not such a list, or more than ``limit`` documents.
    """
    body = await request.body()
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type in JSONL_TYPES:
        return _jsonl_documents(body, request.query_params.get("text_field", "text"), limit)
    return _json_documents(body, limit)


def _report(stats: Any) -> dict[str, Any]:
    """The counts of a warm as this endpoint names them (a prewarm run's names)."""
    failures = [{"id": f.doc_id, "error": f.error} for f in stats.failures]
    counts = {
        "documents": stats.documents,
        "warmed": stats.warmed,
        "already_warm": stats.already_warm,
        "duplicates": stats.duplicates,
        "empty": stats.empty,
        "oversized": stats.oversized,
        "failed": stats.failed,
        "new_tokens": stats.new_tokens,
        "elapsed_ms": stats.elapsed_ms,
    }
    return {"object": "kvboost.warm", **counts, "failures": failures}


@router.post("/v1/documents")
async def warm_documents(request: Request, state: ServerState = Depends(server_state)) -> Response:
    """Warm documents now; the counts come back (``warmed``, ``already_warm``, ``failed``, ...).

    A client that disconnects first cancels the warm: its queued prefills leave the engine
    loop, the one running stops at the loop's next step, and no further batch starts
    (documents already computed stay stored).
    """
    documents = await read_documents(request, state.settings.limits.max_warm_documents)
    texts = [d.text for d in documents]
    labels = [d.id or f"document {i}" for i, d in enumerate(documents)]

    async def warm(slot: Slot) -> tuple[Any, bool]:
        work = call_in_thread(
            prewarm_texts,
            state.engine,
            texts,
            labels=labels,
            max_document_tokens=state.engine.context_window,
            batch_size=state.settings.warm_batch_size,
            show_progress=False,
        )
        finished, stats = await unless_disconnected(work, request)
        return (stats if finished else None), False

    stats = await state.admission.within(warm)
    if stats is None:
        return Response(status_code=CLIENT_CLOSED)
    return JSONResponse(_report(stats))


@router.get("/v1/documents")
async def kept_documents(state: ServerState = Depends(server_state)) -> dict[str, Any]:
    """How many documents the engine keeps, in all and per tier."""
    stats = await call_in_thread(state.engine.cache_stats)
    return {"object": "kvboost.documents", "documents": stats.documents, "by_tier": stats.documents_by_tier,
            "evicted": stats.documents_evicted}
