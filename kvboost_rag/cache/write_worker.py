"""One thread that runs the cache's writes in the order they were queued.

The write-back of a prompt (copying its new chunks into host memory, putting them into the
memory, disk and Redis tiers, serializing and authenticating them there) runs here, after the
call that computed them has returned. What a later request needs to see at once is staged in
the tier stack before a job is queued (:meth:`~kvboost_rag.cache.storage.TieredStore.stage`);
the jobs only make it durable.

Jobs run one at a time, first queued first run. :meth:`WriteWorker.flush` waits until every job
queued before it has run (warming, ``clear_cache``, tests, shutdown; at interpreter exit the
queue is flushed too). A job that fails is logged and counted; the next one runs. Queued bytes
are bounded: a submit waits while the jobs queued before it hold more than ``max_queued_bytes``
(a slow tier then slows its writers down instead of filling memory).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable

from kvboost_rag.log_limits import RateLimitedLogger

logger = logging.getLogger(__name__)
_warnings = RateLimitedLogger(logger)

#: A queued write: runs on the worker thread, returns nothing.
Job = Callable[[], None]
#: Seconds the thread waits for a job before it ends (the next submit starts another).
IDLE_SECONDS = 5.0


class WriteWorker:
    """Runs queued jobs on one daemon thread, started on the first submit.

    Args:
        max_queued_bytes: Bytes the queued jobs may hold before a submit waits (one job is
            always taken when none is queued).
        name: Name of the thread.
    """

    def __init__(self, max_queued_bytes: int, name: str = "kvboost-write-back") -> None:
        self.max_queued_bytes = max_queued_bytes
        self._name = name
        self._jobs: deque[tuple[Job, int]] = deque()
        self._state = threading.Condition()
        self._queued_bytes = 0
        self._running = 0  # jobs taken off the queue and not finished
        self._thread: threading.Thread | None = None
        self._closed = False
        self._exit_hook = False
        #: Jobs that raised.
        self.errors = 0
        #: Jobs run so far.
        self.completed = 0

    def on_worker(self) -> bool:
        """Whether the calling thread is the worker."""
        return threading.current_thread() is self._thread

    def submit(self, job: Job, nbytes: int = 0) -> None:
        """Queue ``job`` (run on the worker thread after every job queued before it).

        Args:
            job: What to run.
            nbytes: Bytes it holds until it ran (counted against ``max_queued_bytes``).

        Raises:
            RuntimeError: The worker was closed.
        """
        if self.on_worker():  # a job queuing more work runs it in place: the queue is behind it
            job()
            return
        with self._state:
            if self._closed:
                raise RuntimeError("the cache's write-back worker is closed")
            while self._jobs and self._queued_bytes + nbytes > self.max_queued_bytes:
                self._state.wait()
            self._jobs.append((job, nbytes))
            self._queued_bytes += nbytes
            self._start()
            self._state.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every job queued so far has run; whether they all did within ``timeout``
        seconds (``None``: no limit). From the worker thread itself, returns at once."""
        if self.on_worker():
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._state:
            while self._jobs or self._running:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._state.wait(left)
        return True

    @property
    def idle(self) -> bool:
        """Whether no job is queued or running."""
        with self._state:
            return not self._jobs and not self._running

    def close(self, timeout: float | None = None) -> bool:
        """Run what is queued, then stop the thread; later submits raise. Whether the queue
        emptied within ``timeout`` seconds."""
        done = self.flush(timeout)
        with self._state:
            self._closed = True
            self._state.notify_all()
        return done

    def _start(self) -> None:
        """Start the thread (called with the state lock held)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=_serve, args=(self,), name=self._name, daemon=True)
        self._thread.start()
        if not self._exit_hook:
            self._exit_hook = True
            atexit.register(_flush_at_exit, weakref.ref(self))

    def _next(self) -> Job | None:
        """The next job (waits for one); ``None`` once closed and empty, or idle for
        :data:`IDLE_SECONDS` (the thread then ends)."""
        with self._state:
            deadline = time.monotonic() + IDLE_SECONDS
            while not self._jobs and not self._closed and time.monotonic() < deadline:
                self._state.wait(deadline - time.monotonic())
            if not self._jobs:
                self._thread = None
                return None
            job, nbytes = self._jobs.popleft()
            self._queued_bytes -= nbytes
            self._running += 1
            self._state.notify_all()
            return job

    def _run(self, job: Job) -> None:
        try:
            job()
        except Exception as error:  # noqa: BLE001 - one failed write must not stop the others
            self.errors += 1
            _warnings.warning("write-back-failed", "a cache write failed: %s: %s", type(error).__name__, error)
            logger.debug("the failed cache write", exc_info=error)
        finally:
            with self._state:
                self._running -= 1
                self.completed += 1
                self._state.notify_all()


def _serve(worker: WriteWorker) -> None:
    """The worker thread: runs jobs until its worker is closed or idle."""
    while (job := worker._next()) is not None:
        worker._run(job)
        del job


def _flush_at_exit(owner: weakref.ref[WriteWorker]) -> None:
    """At interpreter exit: what was queued reaches the tiers (within a minute)."""
    worker = owner()
    if worker is not None and not worker.flush(timeout=60):
        logger.warning("cache writes still queued at exit were not finished within 60 s")
