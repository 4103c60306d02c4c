"""Warming documents on a worker thread without delaying answers.

The engine loop shares each step between the answers being generated and prompt work such as a
warm, so a warm running while an answer is generated slows the answer down. :class:`BackgroundWarmer`
therefore

* keeps one bounded, de-duplicated queue of document texts (the oldest are dropped beyond
  ``max_pending``; a text already queued is not queued twice);
* hands queued documents that an answer's prompt already contains to that answer
  (:meth:`BackgroundWarmer.claim`), which passes them to ``generate(documents=...)``: the
  engine stores their K/V from the prefill the answer does anyway, at no extra model cost;
* warms what is left only while no answer is in flight and none has been for
  ``idle_seconds``, one document at a time, so an answer that starts meanwhile shares the
  engine loop's steps with at most one document's warm;
* closes cleanly: :meth:`BackgroundWarmer.close` either finishes the queue or drops it, and
  waits for a warm in progress. Its thread is no daemon: at interpreter exit the queue is
  dropped and a warm in progress finishes (its writes with it) before the interpreter tears
  anything down, instead of a thread frozen in the middle of a write.

It needs only the engine's public API (``warm_documents``), so both framework integrations
use it: the LangChain retrieval callback and the LlamaIndex retrieval event handler.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Iterable
from typing import Protocol

from kvboost_rag.results import WarmResult


class DocumentWarmer(Protocol):
    """What the background warmer warms with (the engine has it)."""

    def warm_documents(self, texts: Iterable[str], show_progress: bool | None = None) -> list[WarmResult]: ...

    def is_document_warm(self, text: str) -> bool: ...


logger = logging.getLogger(__name__)


def _close_at_exit(warmer: BackgroundWarmer) -> None:
    """At interpreter exit, before threads are joined, close ``warmer`` (dropping its queue)
    so its thread ends after the warm in progress; the warmer is not kept alive for it."""
    reference = weakref.ref(warmer)

    def close() -> None:
        alive = reference()
        if alive is not None:
            alive.close(timeout=0)

    try:
        threading._register_atexit(close)  # type: ignore[attr-defined]  # runs before threads are joined
    except RuntimeError:  # the interpreter is exiting already
        warmer.close(timeout=0)


class BackgroundWarmer:
    """A queue of documents warmed on a thread of its own while the engine is idle.

    Args:
        engine: The engine to warm documents on.
        idle_seconds: Quiet time after the last answer (or submission) before warming starts.
        max_pending: Queue bound; the oldest entries are dropped beyond it.

    Raises:
        ValueError: ``idle_seconds`` is negative or ``max_pending`` below 1.

    Example:
        .. code-block:: python

            warmer = BackgroundWarmer(engine)
            warmer.submit(retrieved_texts)
            warmer.answer_started()            # no warm starts while an answer runs
            try:
                docs = warmer.claim(prompt)
                engine.generate(prompt, documents=docs or None)
            finally:
                warmer.answer_finished()
            warmer.wait_idle(timeout=30)
            warmer.close()
    """

    def __init__(self, engine: DocumentWarmer, idle_seconds: float = 0.5, max_pending: int = 4096) -> None:
        if idle_seconds < 0:
            raise ValueError(f"idle_seconds must be >= 0, got {idle_seconds}")
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self._engine = engine
        self._idle_seconds = float(idle_seconds)
        self._max_pending = max_pending
        self._pending: OrderedDict[str, None] = OrderedDict()
        self._cond = threading.Condition()
        self._active_answers = 0
        self._last_activity = time.monotonic()
        self._warming = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self.warmed_documents = 0
        """Documents whose K/V this warmer computed (already-warm ones not counted)."""
        self.claimed_documents = 0
        """Documents handed to an answer's prompt by :meth:`claim`."""
        self.failed_documents = 0
        """Documents the engine refused (logged as warnings)."""
        self.dropped_documents = 0
        """Documents dropped because the queue was full."""

    @property
    def engine(self) -> DocumentWarmer:
        """The engine documents are warmed on."""
        return self._engine

    @property
    def pending(self) -> int:
        """Documents queued and not yet warmed or claimed."""
        with self._cond:
            return len(self._pending)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (later submissions are ignored)."""
        with self._cond:
            return self._closed

    def submit(self, texts: Iterable[str]) -> int:
        """Queue documents for warming.

        Empty and whitespace-only texts are skipped, and so are texts already queued.

        Args:
            texts: Document texts exactly as prompts will contain them.

        Returns:
            How many were newly queued (0 once closed).
        """
        added = 0
        with self._cond:
            if self._closed:
                return 0
            for text in texts:
                if text and not text.isspace() and text not in self._pending:
                    self._pending[text] = None
                    added += 1
            while len(self._pending) > self._max_pending:
                dropped, _ = self._pending.popitem(last=False)
                self.dropped_documents += 1
                logger.debug("background warm queue full; dropped a %d-char document", len(dropped))
            self._last_activity = time.monotonic()
            if added:
                self._ensure_worker()
                self._cond.notify_all()
        return added

    def claim(self, prompt: str) -> list[str]:
        """Take the queued documents that ``prompt`` contains whole.

        Args:
            prompt: The prompt an answer is about to be generated from.

        Returns:
            The claimed texts (removed from the queue), in queue order.
        """
        with self._cond:
            claimed = [text for text in self._pending if text in prompt]
            for text in claimed:
                del self._pending[text]
            self.claimed_documents += len(claimed)
            if claimed:
                self._cond.notify_all()
        return claimed

    def answer_started(self) -> None:
        """Mark an answer in flight: no warm starts until it finishes."""
        with self._cond:
            self._active_answers += 1
            self._last_activity = time.monotonic()

    def answer_finished(self) -> None:
        """Mark an answer done; warming may resume after ``idle_seconds``."""
        with self._cond:
            self._active_answers = max(0, self._active_answers - 1)
            self._last_activity = time.monotonic()
            self._cond.notify_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until the queue is empty and no warm is running.

        Args:
            timeout: Seconds to wait at most; ``None`` waits as long as it takes.

        Returns:
            ``True`` if the warmer went idle, ``False`` on timeout.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._pending or self._warming:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
        return True

    def close(self, timeout: float | None = 5.0, drain: bool = False) -> None:
        """Stop the worker. Later submissions are ignored.

        Args:
            timeout: Seconds to wait for the worker (for the queue too, with ``drain``);
                ``None`` waits as long as it takes.
            drain: Warm what is still queued first (under the usual idle rule) instead of
                dropping it.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        if drain:
            self.wait_idle(timeout)
        with self._cond:
            self._closed = True
            if self._pending:
                logger.debug("background warmer closed with %d document(s) still queued", len(self._pending))
            self._pending.clear()
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def _ensure_worker(self) -> None:
        """Start the worker thread unless it runs. Caller holds the lock."""
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="kvboost-background-warm", daemon=False)
            self._thread.start()
            _close_at_exit(self)

    def _next_text(self) -> str | None:
        """Wait until warming may start; pop the next document (``None`` once closed)."""
        with self._cond:
            while True:
                if self._closed:
                    return None
                if self._pending and self._active_answers == 0:
                    quiet = time.monotonic() - self._last_activity
                    if quiet >= self._idle_seconds:
                        text, _ = self._pending.popitem(last=False)
                        self._warming = True
                        return text
                    self._cond.wait(self._idle_seconds - quiet)
                else:
                    self._cond.wait()

    def _run(self) -> None:
        while True:
            text = self._next_text()
            if text is None:
                return
            computed = failed = False
            try:
                # A document already warm costs the engine a lookup, nothing more.
                results = self._engine.warm_documents([text], show_progress=False)
                computed = any(not result.already_warm for result in results)
            except Exception:  # noqa: BLE001 - a failed warm must never reach the answer path
                failed = True
                logger.warning("background warm of a %d-char document failed", len(text), exc_info=True)
            finally:
                with self._cond:
                    self.warmed_documents += int(computed)
                    self.failed_documents += int(failed)
                    self._warming = False
                    self._cond.notify_all()
