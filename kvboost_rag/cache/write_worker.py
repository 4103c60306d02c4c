"""One thread that runs the cache's writes in the order they were queued.

The write-back of a prompt (copying its new chunks into host memory, putting them into the
memory, disk and Redis tiers, serializing and authenticating them there) runs here, after the
call that computed them has returned. What a later request needs to see at once is staged in
the tier stack before a job is queued (:meth:`~kvboost_rag.cache.storage.TieredStore.stage`);
the jobs only make it durable.

The thread is a one-worker :class:`concurrent.futures.ThreadPoolExecutor`: jobs run one at a
time, first queued first run, and at interpreter exit Python lets the queue run out and joins
the thread before it tears anything down (a thread still freeing tensors while the interpreter
finalizes aborts the process). :meth:`WriteWorker.flush` waits until every job queued before it
has run and let go of its memory (warming, ``clear_cache``, tests, shutdown). A job that fails
is logged and counted; the next one runs. Queued bytes are bounded: a submit waits while the
jobs queued before it hold more than ``max_queued_bytes`` (a slow tier then slows its writers
down instead of filling memory).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from kvboost_rag.log_limits import RateLimitedLogger

logger = logging.getLogger(__name__)
_warnings = RateLimitedLogger(logger)

#: A queued write: runs on the worker thread, returns nothing.
Job = Callable[[], None]
#: Name of the worker thread.
THREAD_NAME = "kvboost-write-back"

_on_worker = threading.local()


#: Scheduling niceness of the worker thread (and the threads its torch ops start): its copies
#: and serialization yield the cores to the engine loop's passes while both want them.
BACKGROUND_NICENESS = 10


def _run_in_background() -> None:
    """Lower the calling thread's scheduling priority (Linux, where niceness is per thread; a
    no-op elsewhere or when not allowed)."""
    native_id = getattr(threading, "get_native_id", None)
    if native_id is None or not hasattr(os, "setpriority"):
        return
    try:
        os.setpriority(os.PRIO_PROCESS, native_id(), BACKGROUND_NICENESS)
    except OSError:
        logger.debug("could not lower the write-back thread's priority", exc_info=True)


class WriteWorker:
    """Runs queued jobs on one thread, in order.

    Args:
        max_queued_bytes: Bytes the queued jobs may hold before a submit waits (one job is
            always taken when none is queued).
    """

    def __init__(self, max_queued_bytes: int) -> None:
        self.max_queued_bytes = max_queued_bytes
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=THREAD_NAME, initializer=_run_in_background)
        self._state = threading.Condition()
        self._queued_bytes = 0
        self._outstanding = 0  # jobs submitted and not finished
        self._submitted = 0  # jobs submitted so far (a flush waits for those before it)
        self._closed = False
        #: Jobs that raised.
        self.errors = 0
        #: Jobs run so far.
        self.completed = 0

    def on_worker(self) -> bool:
        """Whether the calling thread is running a job of this worker."""
        return getattr(_on_worker, "worker", None) is self

    def submit(self, job: Job, nbytes: int = 0) -> None:
        """Queue ``job`` (run on the worker thread after every job queued before it).

        Args:
            job: What to run.
            nbytes: Bytes it holds until it ran (counted against ``max_queued_bytes``).

        Raises:
            RuntimeError: The worker was closed (or the interpreter is exiting).
        """
        if self.on_worker():  # a job queuing more work runs it in place: the queue is behind it
            job()
            return
        with self._state:
            if self._closed:
                raise RuntimeError("the cache's write-back worker is closed")
            while self._outstanding and self._queued_bytes + nbytes > self.max_queued_bytes:
                self._state.wait()
            self._queued_bytes += nbytes
            self._outstanding += 1
            self._submitted += 1
        try:
            self._executor.submit(self._run, [job], nbytes)  # the list is emptied before the job counts as done
        except BaseException:
            self._finished(nbytes, failed=False)
            raise

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every job queued before this call has run (jobs queued meanwhile are not
        waited for, so a flush ends under a steady load); whether they all did within
        ``timeout`` seconds (``None``: no limit). From a job itself, returns at once."""
        if self.on_worker():
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._state:
            target = self._submitted
            while self.completed < target:  # one thread runs the jobs in order
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._state.wait(left)
        return True

    @property
    def idle(self) -> bool:
        """Whether no job is queued or running."""
        with self._state:
            return not self._outstanding

    def close(self, timeout: float | None = None) -> bool:
        """Run what is queued, then stop the thread; later submits raise. Whether the queue
        emptied within ``timeout`` seconds."""
        done = self.flush(timeout)
        with self._state:
            self._closed = True
        self._executor.shutdown(wait=done)
        return done

    def _run(self, box: list[Job], nbytes: int) -> None:
        """Run the job in ``box`` on the worker thread; its memory is let go of before it
        counts as done."""
        _on_worker.worker = self
        failed = False
        try:
            box.pop()()
        except Exception as error:  # noqa: BLE001 - one failed write must not stop the others
            failed = True
            _warnings.warning("write-back-failed", "a cache write failed: %s: %s", type(error).__name__, error)
            logger.debug("the failed cache write", exc_info=error)
            del error  # its traceback holds the job's frames
        finally:
            _on_worker.worker = None
            self._finished(nbytes, failed)

    def _finished(self, nbytes: int, failed: bool) -> None:
        with self._state:
            self._queued_bytes -= nbytes
            self._outstanding -= 1
            self.completed += 1
            self.errors += failed
            self._state.notify_all()
