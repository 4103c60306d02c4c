"""``kvboost-rag warm SOURCE --server URL``: a corpus warmed by a running server, into its store.

The documents are read here (a folder of text files or a JSONL file, as the local warm job
reads them) and sent to the server's ``POST /v1/documents`` in batches; its engine warms them
into its tiers (memory, and the disk folder or Redis Cluster other replicas read). The counts
come back as the local job's :class:`~kvboost_rag.warm_job.WarmReport`. Standard library only:
no server dependencies on the machine that sends.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from kvboost_rag.errors import InvalidInputError
from kvboost_rag.server.internals import (
    DocumentFailure,
    SourceDocument,
    WarmReport,
    read_source,
)

logger = logging.getLogger(__name__)

#: Attempts per batch while the server answers 429 or 503.
RETRIES = 10

#: Seconds one batch may take on the server.
BATCH_TIMEOUT = 3600.0


def documents_url(server: str) -> str:
    """``http://host:port/v1/documents`` of a server given as ``http://host:port`` (with or
    without ``/v1``)."""
    base = server.rstrip("/")
    base = base[: -len("/v1")] if base.endswith("/v1") else base
    return f"{base}/v1/documents"


def _post(url: str, body: dict[str, Any], api_key: str | None) -> dict[str, Any]:
    """POST ``body`` as JSON; retries while the server is busy.

    Raises:
        InvalidInputError: The server refused the batch, or could not be reached.
    """
    data = json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    for attempt in range(RETRIES):
        request = urllib.request.Request(url, data=data, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=BATCH_TIMEOUT) as response:  # noqa: S310 - the user's URL
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode("utf-8", errors="replace")
            if exc.code in (429, 503) and attempt + 1 < RETRIES:
                wait = float(exc.headers.get("Retry-After") or 1)
                logger.info("the server is busy (%d); retrying in %.0f s", exc.code, wait)
                time.sleep(wait)
                continue
            raise InvalidInputError(f"{url} answered {exc.code}: {detail}") from None
        except urllib.error.URLError as exc:
            raise InvalidInputError(f"cannot reach {url}: {exc.reason}") from None
    raise InvalidInputError(f"{url} stayed busy after {RETRIES} attempts")


def _count(report: WarmReport, counts: dict[str, Any]) -> None:
    """Add one batch's counts (the server's prewarm report) to ``report``."""
    report.computed += int(counts["warmed"])
    report.skipped += int(counts["already_warm"]) + int(counts["duplicates"]) + int(counts["empty"])
    report.computed_tokens += int(counts["new_tokens"])
    report.failures.extend(DocumentFailure(f["id"], f["error"]) for f in counts["failures"])


def warm_through_server(
    source: Any,
    server: str,
    *,
    api_key: str | None = None,
    batch_size: int = 16,
    text_field: str = "text",
    on_progress: Callable[[WarmReport], None] | None = None,
) -> WarmReport:
    """Warm a corpus through a running server.

    Args:
        source: A folder of text files, a JSONL file, or anything the local warm job reads.
        server: The server's URL (``http://host:port``).
        api_key: The server's API key.
        batch_size: Documents per request.
        text_field: The JSONL field holding each text.
        on_progress: Called with the report after each batch.

    Returns:
        The counts (``computed``: warmed now; ``skipped``: warm already, repeated or empty).

    Raises:
        InvalidInputError: An unreadable source, or a server that refused a batch.
    """
    if batch_size < 1:
        raise InvalidInputError(f"batch_size must be >= 1, got {batch_size}")
    started = time.perf_counter()
    documents: list[SourceDocument] = read_source(source, text_field)
    report = WarmReport(documents=len(documents), backend="server", workers=1)
    url = documents_url(server)
    for i in range(0, len(documents), batch_size):
        batch = documents[i : i + batch_size]
        counts = _post(url, {"documents": [{"id": d.doc_id, "text": d.text} for d in batch]}, api_key)
        _count(report, counts)
        report.seconds = time.perf_counter() - started
        if on_progress is not None:
            on_progress(report)
    report.seconds = time.perf_counter() - started
    return report
