"""One thread that runs the cache's writes in the order they were queued.

The write-back of a prompt (copying its new chunks into host memory, putting them into the
memory, disk and Redis tiers, serializing and authenticating them there) runs here, after the
call that computed them has returned. What a later request needs to see at once is staged in
the tier stack before a job is queued (:meth:`~kvboost_rag.cache.storage.TieredStore.stage`);
the jobs only make it durable.

- **Order.** Jobs run one at a time on one thread, in the order their submits were admitted;
  admission and queuing happen under one lock, so :meth:`WriteWorker.flush` waits for exactly
  the jobs queued before it (by any thread) and not for those queued meanwhile.
- **A bound, first come first served.** A submit waits while the jobs queued before it hold
  more than ``max_queued_bytes``, in arrival order: a large job is admitted once the queue has
  room for it, and later small ones wait behind it instead of passing it for ever. One job is
  always admitted when none is queued; a job that holds no bytes never waits.
- **Failures.** A job that raises is logged (rate-limited) and counted; the next one runs.
- **Exit.** The thread ends once the queue has been empty for :data:`LINGER_SECONDS`, and
  starts again on the next submit. It is a daemon, so a wedged tier cannot hold the exit up for
  ever: at interpreter exit, once the threads that are no daemons (the engine loop, the
  requests' threads) have ended, every worker's queue is flushed within
  :data:`EXIT_FLUSH_SECONDS` in all; what is still queued then is dropped and a warning says
  how many writes and bytes. The worker is closed there: a submit that finds it closed, or no
  thread can be started (the interpreter is finalizing), runs its job on the caller's thread:
  a call that finishes while the script exits still gets its answer and its write is done.
- **Fork.** Before a fork the queue is flushed (within :data:`FORK_FLUSH_SECONDS`); in the
  child the worker forgets the parent's thread and lock (:mod:`kvboost_rag.forking`): a write
  the parent's thread was running is the parent's, the rest run on a fresh thread.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kvboost_rag import forking
from kvboost_rag.log_limits import RateLimitedLogger
from kvboost_rag.openmp_workers import release_idle_workers

logger = logging.getLogger(__name__)
_warnings = RateLimitedLogger(logger)

#: A queued write: runs on the worker thread, returns nothing.
Job = Callable[[], None]
#: Name of the worker thread.
THREAD_NAME = "kvboost-write-back"
#: Seconds the thread waits for a next job once the queue is empty before it ends.
LINGER_SECONDS = 0.5

#: Seconds interpreter exit waits, for every worker together, for the writes still queued
#: (a wedged tier must not hold the exit up for ever); what is left then is dropped, with a
#: warning that says how much.
EXIT_FLUSH_SECONDS = 10.0
#: Seconds a fork waits for each worker's queued writes (the child then inherits them done).
FORK_FLUSH_SECONDS = 5.0

#: Scheduling niceness of the worker thread (and the threads its torch ops start): its copies
#: and serialization yield the cores to the engine loop's passes while both want them.
BACKGROUND_NICENESS = 10

#: The worker whose job this thread runs (``worker``), so work asked for from inside a job
#: (the index charge) runs there at once instead of queueing behind itself; thread-local
#: because it says which thread this is, not a parameter of a call.
_on_worker = threading.local()
#: Every live worker, for the flush at exit.
_workers: weakref.WeakSet[WriteWorker] = weakref.WeakSet()


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


@dataclass
class _Queued:
    """A job in the queue: what runs and the bytes it holds until it ran."""

    job: Job | None
    nbytes: int


class WriteWorker:
    """Runs queued jobs on one thread, in order.

    Args:
        max_queued_bytes: Bytes the queued jobs may hold before a submit waits (one job is
            always taken when none is queued).
        name: Name of its thread.
    """

    def __init__(self, max_queued_bytes: int, name: str = THREAD_NAME) -> None:
        self.max_queued_bytes, self.name = max_queued_bytes, name
        self._state = threading.Condition()
        self._queue: deque[_Queued] = deque()
        self._arrivals: deque[object] = deque()  # submits waiting for room, first come first
        self._thread: threading.Thread | None = None
        self._queued_bytes = 0  # of the jobs in the queue (the first one runs until it is popped)
        self._done_queued = 0  # queued jobs run so far, in queue order
        self._closed = False
        #: Jobs that raised.
        self.errors = 0
        #: Jobs run so far (on the thread or, once closed, on their callers').
        self.completed = 0
        _workers.add(self)
        forking.register(self)

    def on_worker(self) -> bool:
        """Whether the calling thread is running a job of this worker."""
        return getattr(_on_worker, "worker", None) is self

    @property
    def queued_bytes(self) -> int:
        """Bytes the jobs queued and not yet finished hold."""
        with self._state:
            return self._queued_bytes

    def submit(self, job: Job, nbytes: int = 0) -> None:
        """Queue ``job`` (run on the worker thread after every job queued before it).

        Waits, in arrival order, while the queue holds more than ``max_queued_bytes``. Runs
        ``job`` at once on the calling thread when called from a job (the queue is behind it),
        when the worker is closed, or when no thread can be started (interpreter exit).

        Args:
            job: What to run.
            nbytes: Bytes it holds until it ran (counted against ``max_queued_bytes``).
        """
        if self.on_worker():
            job()
            return
        ticket = object()
        with self._state:
            self._arrivals.append(ticket)
            try:
                while nbytes and not self._closed and not self._admits(ticket, nbytes):
                    self._state.wait()
            finally:
                self._arrivals.remove(ticket)
                self._state.notify_all()
            if not self._closed and self._ensure_thread():
                self._queue.append(_Queued(job, nbytes))
                self._queued_bytes += nbytes
                self._state.notify_all()
                return
        failed = self._call(job)  # closed, or no thread at interpreter exit: on this thread
        with self._state:
            self.completed += 1
            self.errors += failed

    def _admits(self, ticket: object, nbytes: int) -> bool:
        """Whether ``ticket`` is first in line and its job fits (or nothing is queued)."""
        if self._arrivals[0] is not ticket:
            return False
        return not self._queue or self._queued_bytes + nbytes <= self.max_queued_bytes

    def _ensure_thread(self) -> bool:
        """Start the thread if it is not running (under the lock); whether one runs."""
        if self._thread is not None:
            return True
        thread = threading.Thread(target=self._serve, name=self.name, daemon=True)  # bounded at exit
        try:
            thread.start()
        except RuntimeError:  # the interpreter is finalizing: no new thread
            return False
        self._thread = thread
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every job queued before this call has run (jobs queued meanwhile are not
        waited for, so a flush ends under a steady load); whether they all did within
        ``timeout`` seconds (``None``: no limit). From a job itself, returns at once."""
        if self.on_worker():
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._state:
            target = self._done_queued + len(self._queue)
            while self._done_queued < target:  # one thread runs the queued jobs in order
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._state.wait(left)
        return True

    @property
    def idle(self) -> bool:
        """Whether no job is queued or running."""
        with self._state:
            return not self._queue

    def close(self, timeout: float | None = None) -> bool:
        """Run what is queued; later submits run their jobs on their callers' threads. Whether
        the queue emptied within ``timeout`` seconds."""
        done = self.flush(timeout)
        with self._state:
            self._closed = True
            self._state.notify_all()
        return done

    @property
    def pending(self) -> tuple[int, int]:
        """Jobs queued or running now, and the bytes they hold."""
        with self._state:
            return len(self._queue), self._queued_bytes

    # ------------------------------------------------------------------ fork and exit
    def _before_fork(self) -> None:
        """Finish the queued writes before a fork (bounded), so the child inherits them done."""
        if not self.flush(FORK_FLUSH_SECONDS):
            _warnings.warning("fork-flush", "forking with cache writes still queued on %s: the child leaves them to the parent", self.name)

    def _after_fork_in_child(self) -> None:
        """In a forked child: the parent's thread is gone and its lock may be held. A job it
        was running is the parent's (counted done here); the others wait for a fresh thread,
        started at once."""
        self._state = threading.Condition()
        self._arrivals.clear()  # the submits waiting for room were the parent's threads
        self._thread = None
        if self._queue and self._queue[0].job is None:  # running in the parent when it forked
            taken = self._queue.popleft()
            self._queued_bytes -= taken.nbytes
            self._done_queued += 1
        if self._queue and not self._closed:
            with self._state:
                self._ensure_thread()

    def flush_at_exit(self, timeout: float) -> tuple[int, int]:
        """Flush within ``timeout`` seconds and close; the jobs and bytes left behind."""
        done = self.close(max(0.0, timeout))
        return (0, 0) if done else self.pending

    # ------------------------------------------------------------------ the thread
    def _serve(self) -> None:
        """The worker thread: run queued jobs until the queue stayed empty a while."""
        _run_in_background()
        while True:
            with self._state:
                if not self._queue:
                    release_idle_workers()  # idle: its OpenMP workers would slow the engine loop's
                    if not self._state.wait_for(lambda: self._queue, LINGER_SECONDS):
                        self._thread = None
                        return
                queued = self._queue[0]
            job, queued.job = queued.job, None
            assert job is not None
            failed = self._call(job)
            del job  # its references go before it counts as done
            with self._state:
                self._queue.popleft()
                self._queued_bytes -= queued.nbytes
                self._done_queued += 1
                self.completed += 1
                self.errors += failed
                self._state.notify_all()

    def _call(self, job: Job) -> bool:
        """Run ``job`` as one of this worker's; whether it raised (logged, rate-limited)."""
        _on_worker.worker = self
        try:
            job()
            return False
        except Exception as error:  # noqa: BLE001 - one failed write must not stop the others
            _warnings.warning("write-back-failed", "a cache write failed: %s: %s", type(error).__name__, str(error))
            if logger.isEnabledFor(logging.DEBUG):
                logger.debug("the failed cache write", exc_info=error)
            del error  # its traceback holds the job's frames (and their memory)
            return True
        finally:
            _on_worker.worker = None


def flush_all_at_exit(timeout: float | None = None) -> tuple[int, int]:
    """Flush every live worker within ``timeout`` seconds in all (``None``:
    :data:`EXIT_FLUSH_SECONDS`) and close it; what none ran then is dropped (its threads are
    daemons), with a warning. Runs at interpreter exit, after the threads that are no daemons
    ended.

    Returns:
        The jobs and the bytes dropped.
    """
    deadline = time.monotonic() + (EXIT_FLUSH_SECONDS if timeout is None else timeout)
    jobs = nbytes = 0
    for worker in list(_workers):
        left_jobs, left_bytes = worker.flush_at_exit(deadline - time.monotonic())
        jobs, nbytes = jobs + left_jobs, nbytes + left_bytes
    if jobs:
        logger.warning(
            "exiting with %d cache writes (%d bytes) not done after %.1f s: they are dropped (a slow or wedged tier)",
            jobs, nbytes, EXIT_FLUSH_SECONDS if timeout is None else timeout,
        )
    return jobs, nbytes


atexit.register(flush_all_at_exit)  # after the threads that are no daemons were joined
