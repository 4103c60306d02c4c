"""Warming many documents at once, as both integrations' ingest prewarmers do.

:func:`prewarm_texts` takes the texts documents will have in prompts and

* skips empty texts, repeats, texts the engine already holds and texts longer than
  ``max_document_tokens`` (a warning names each oversized one and the fix);
* hands the rest to ``KVBoost.warm_documents`` in batches of ``batch_size`` (the engine runs
  several documents through the model per forward pass);
* isolates failures: when the engine refuses a batch, its documents are warmed one by one, so
  one bad document costs only itself; each failure is logged and reported in
  :attr:`PrewarmStats.failures`;
* counts what happened in a :class:`PrewarmStats`.

:func:`texts_to_warm` is the selection step alone, for the retrieval warmers that queue
retrieved documents for background warming.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from kvboost_rag.cancellation import ambient
from kvboost_rag.errors import KVBoostError, PromptTooLongError, RequestCancelled
from kvboost_rag.warming.counts import DocumentFailure, WarmCounts

if TYPE_CHECKING:
    from kvboost_rag.engine import KVBoost

logger = logging.getLogger(__name__)

#: Documents per ``warm_documents`` call.
DEFAULT_BATCH_SIZE = 16

#: Document counts from which a progress bar is shown when ``show_progress`` is left unset.
DEFAULT_PROGRESS_MIN_DOCUMENTS = 64

#: How the oversized warning tells the user to fix it, unless the caller names its splitter.
DEFAULT_SPLIT_HINT = "split documents smaller before prewarming them"


#: What one prewarm run did: the one counts type of every warm path
#: (:class:`~kvboost_rag.warming.counts.WarmCounts`; ``warmed``, ``already_warm``, ``new_tokens``
#: and ``elapsed_ms`` read ``computed``, ``skipped``, ``computed_tokens`` and ``seconds``).
PrewarmStats = WarmCounts


def default_max_document_tokens(engine: KVBoost, llm: Any = None) -> int:
    """The longest document worth warming: what a prompt of ``llm`` can hold.

    Args:
        engine: The engine documents are warmed in.
        llm: The framework LLM that answers (its ``context_window`` when it has one, less its
            ``max_new_tokens``), or ``None`` (or the engine itself) for the model's window.

    Returns:
        A token count of at least 1.
    """
    if llm is None or llm is engine:
        return int(engine.context_window)
    window = getattr(llm, "context_window", None) or engine.context_window
    return max(1, int(window) - int(getattr(llm, "max_new_tokens", 0) or 0))


def check_max_document_tokens(engine: KVBoost, limit: int) -> int:
    """``limit`` when the model can hold a document that long.

    Raises:
        ValueError: ``limit`` is below 1 or above the model's context window.
    """
    if limit > engine.context_window:
        raise ValueError(
            f"max_document_tokens={limit} exceeds the model's context window ({engine.context_window}); "
            "use at most that"
        )
    if limit < 1:
        raise ValueError(f"max_document_tokens must be >= 1, got {limit}")
    return limit


def _select(
    engine: KVBoost,
    texts: Sequence[str],
    labels: Sequence[str],
    limit: int | None,
    stats: PrewarmStats,
    split_hint: str,
    oversized_level: int,
) -> list[tuple[str, str]]:
    """The (label, text) pairs to warm; counts and reports what is skipped."""
    seen: set[str] = set()
    chosen: list[tuple[str, str]] = []
    for label, text in zip(labels, texts):
        if not text or text.isspace():
            stats.empty += 1
            continue
        if text in seen:
            stats.duplicates += 1
            continue
        seen.add(text)
        _stop_if_cancelled()  # each check below tokenizes the text
        if engine.is_document_warm(text):
            stats.skipped += 1
            continue
        if limit is not None:
            n_tokens = engine.count_tokens(text)
            if n_tokens > limit:
                error = f"{n_tokens} tokens, more than max_document_tokens={limit}"
                stats.oversized += 1
                stats.failures.append(DocumentFailure(label, f"oversized: {error}"))
                logger.log(
                    oversized_level,
                    "prewarm: %s has %s; not warmed. To warm it, %s (pieces of about %d tokens leave "
                    "room for several in one prompt).",
                    label,
                    error,
                    split_hint,
                    max(1, limit // 4),
                )
                continue
        chosen.append((label, text))
    if stats.empty:
        logger.info("prewarm: skipped %d document(s) without text", stats.empty)
    return chosen


def texts_to_warm(engine: KVBoost, texts: Sequence[str], max_document_tokens: int | None = None) -> list[str]:
    """The texts worth warming: distinct, not empty, not warm yet, not longer than the limit.

    A read-only check (nothing is warmed); oversized texts are logged at debug level.

    Args:
        engine: The engine documents would be warmed in.
        texts: Document texts exactly as prompts hold them.
        max_document_tokens: Longest text worth warming; ``None`` for no limit.

    Returns:
        The texts, in first-seen order.
    """
    labels = [f"document {i}" for i in range(len(texts))]
    chosen = _select(engine, texts, labels, max_document_tokens, PrewarmStats(), DEFAULT_SPLIT_HINT, logging.DEBUG)
    return [text for _, text in chosen]


def _stop_if_cancelled() -> None:
    """Raise :class:`RequestCancelled` once the call's ambient cancellation (an async bridge's,
    :mod:`kvboost_rag.integration.async_stream`) is set."""
    cancellation = ambient()
    if cancellation is not None:
        cancellation.check()


def _warm_batch(engine: KVBoost, batch: list[tuple[str, str]], stats: PrewarmStats) -> None:
    """Warm ``batch``; when the engine refuses it, warm each document alone."""
    try:
        results = engine.warm_documents([text for _, text in batch], show_progress=False)
    except RequestCancelled:
        raise  # the caller is gone: no document is warmed one by one
    except KVBoostError as exc:
        if len(batch) > 1:
            logger.debug("prewarm: a batch of %d failed (%s); warming its documents one by one", len(batch), exc)
            for item in batch:
                _warm_batch(engine, [item], stats)
            return
        label, text = batch[0]
        if isinstance(exc, PromptTooLongError):  # too long behind the warm prefix
            stats.oversized += 1
        else:
            stats.failed += 1
        stats.failures.append(DocumentFailure(label, f"{type(exc).__name__}: {exc}"))
        logger.warning("prewarm: %s (%d chars) was not warmed: %s", label, len(text), exc)
        return
    for result in results:
        stats.results.append(result)
        stats.tokens += result.num_tokens
        if result.already_warm:
            stats.skipped += 1
        else:
            stats.computed += 1
            stats.computed_tokens += result.new_tokens


def prewarm_texts(
    engine: KVBoost,
    texts: Sequence[str],
    *,
    labels: Sequence[str] | None = None,
    max_document_tokens: int | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    show_progress: bool | None = None,
    progress_min_documents: int = DEFAULT_PROGRESS_MIN_DOCUMENTS,
    progress_unit: str = "doc",
    split_hint: str = DEFAULT_SPLIT_HINT,
) -> PrewarmStats:
    """Warm documents, each failure isolated (see the module doc).

    Args:
        engine: The engine to warm in.
        texts: Document texts exactly as prompts will hold them.
        labels: How logs and failures name each document (default ``"document <i>"``).
        max_document_tokens: Longest document warmed; ``None`` for no limit (the engine warms
            a longer one up to its context window).
        batch_size: Documents per ``warm_documents`` call.
        show_progress: Show a progress bar over the documents; ``None`` shows one from
            ``progress_min_documents`` documents to warm up.
        progress_min_documents: See ``show_progress``.
        progress_unit: The bar's unit (``"doc"``, ``"node"``).
        split_hint: What the oversized warning tells the user to do.

    Returns:
        The counts, the engine's results and the failures of this run.

    Raises:
        ValueError: ``labels`` of another length than ``texts``, or ``batch_size`` or
            ``progress_min_documents`` below 1.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if progress_min_documents < 1:
        raise ValueError(f"progress_min_documents must be >= 1, got {progress_min_documents}")
    if labels is None:
        labels = [f"document {i}" for i in range(len(texts))]
    elif len(labels) != len(texts):
        raise ValueError(f"got {len(labels)} labels for {len(texts)} texts")
    started = time.perf_counter()
    stats = PrewarmStats(documents=len(texts))
    chosen = _select(engine, texts, labels, max_document_tokens, stats, split_hint, logging.WARNING)
    show = len(chosen) >= progress_min_documents if show_progress is None else show_progress
    # The bar counts documents (not batches); the engine batches each call through the model.
    with tqdm(total=len(chosen), desc="warming documents", unit=progress_unit, disable=not show) as bar:
        for i in range(0, len(chosen), batch_size):
            batch = chosen[i : i + batch_size]
            _stop_if_cancelled()
            _warm_batch(engine, batch, stats)
            bar.update(len(batch))
    stats.seconds = time.perf_counter() - started
    logger.info("prewarm: %s", stats.summary())
    return stats
