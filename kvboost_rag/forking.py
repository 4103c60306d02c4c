"""Fork safety: what the engine's threads leave behind is made afresh in a forked child.

A process forked from one that ran the engine (gunicorn ``--preload``, a prefork worker pool,
multiprocessing's ``fork`` start method) inherits its memory but only the thread that forked:
the engine loop's thread, the write-back's workers and the async bridges' pool of threads do not
exist in the child, while the objects that started them still say they run (a request there
would wait for ever), and a lock or a condition one of those threads held stays held.

Each object that starts threads registers here (:func:`register`); around every ``os.fork``
(``os.register_at_fork``):

- before the fork, in the parent: each registered object's ``_before_fork()``, where it has one, runs (the
  write-back's workers finish the writes queued so far, within
  :data:`~kvboost_rag.cache.write_worker.FORK_FLUSH_SECONDS`, so the child inherits them done
  and no tier lock held by a write in progress);
- in the child: each one's ``_after_fork_in_child()`` runs: fresh locks, no thread, nothing of
  the parent's in-flight work (its callers are not in the child); the next request starts a
  fresh thread as the first one did.

Work in flight at the fork is the parent's alone: fork while the engine is idle (after a
request, as a preloading server does), and never after CUDA was used (CUDA does not survive a
fork).
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from typing import Protocol

logger = logging.getLogger(__name__)


class ForkAware(Protocol):
    """An object that starts threads and is reset in a forked child."""


    def _after_fork_in_child(self) -> None:
        """Called in the child just after a fork: forget the parent's threads and locks."""


_registered: weakref.WeakSet[ForkAware] = weakref.WeakSet()
_registered_lock = threading.Lock()


def register(obj: ForkAware) -> None:
    """Reset ``obj`` around every fork from now on (held weakly: a dropped object is not kept)."""
    with _registered_lock:
        _registered.add(obj)


def registered() -> list[ForkAware]:
    """The objects reset around a fork now (for tests and diagnostics)."""
    with _registered_lock:
        return list(_registered)


def _before_fork() -> None:
    for obj in registered():
        prepare = getattr(obj, "_before_fork", None)  # optional: most objects have nothing to prepare
        if prepare is None:
            continue
        try:
            prepare()
        except Exception:  # noqa: BLE001 - a fork must go on; the child resets what it can
            logger.warning("preparing %s for a fork failed", type(obj).__name__, exc_info=True)


def _after_fork_in_child() -> None:
    global _registered_lock
    _registered_lock = threading.Lock()  # the parent's may have been held by another thread
    for obj in list(_registered):
        try:
            obj._after_fork_in_child()
        except Exception:  # noqa: BLE001 - the others are still reset
            logger.warning("resetting %s after a fork failed", type(obj).__name__, exc_info=True)


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
