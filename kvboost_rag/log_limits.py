"""Rate-limited warnings: a problem that repeats on every call is logged, not flooded.

A corrupt entry, an unreachable tier or a rejected file can recur thousands of times a minute.
:class:`RateLimitedLogger` logs the first warning of each *kind* (a short key chosen by the
caller, such as ``"corrupt-entry"``), then at most one per ``interval_seconds`` for that kind,
adding how many were suppressed in between.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable

#: Default seconds between two warnings of the same kind.
DEFAULT_INTERVAL_SECONDS = 60.0
#: Kinds remembered at once; the least recently logged kind is forgotten beyond this.
MAX_KINDS = 256


#: Every live limiter, for :func:`forget_all` (weak: a dropped limiter is not kept alive).
_LIMITERS: weakref.WeakSet[RateLimitedLogger] = weakref.WeakSet()


def forget_all() -> None:
    """Make every live :class:`RateLimitedLogger` forget what it logged, so the next warning
    of each kind is logged again (test suites call it between tests, so one test's warnings
    do not silence another's)."""
    for limiter in list(_LIMITERS):
        limiter.forget()


class RateLimitedLogger:
    """Logs each kind of warning at most once per interval, with a count of suppressed repeats.

    Args:
        logger: Where the warnings go.
        interval_seconds: Minimum seconds between two records of the same kind.
        noun: What the suppressed count counts, in the suffix
            ``" (N similar <noun> not logged)"``.
        clock: Monotonic clock (tests pass a fake one).

    Safe to call from several threads.
    """

    def __init__(
        self,
        logger: logging.Logger,
        interval_seconds: float = DEFAULT_INTERVAL_SECONDS,
        *,
        noun: str = "warnings",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if interval_seconds < 0:
            raise ValueError(f"interval_seconds must not be negative, got {interval_seconds}")
        self.logger = logger
        self.interval_seconds = interval_seconds
        self.noun = noun
        self._clock = clock
        self._lock = threading.Lock()
        # kind -> (time of the last record, repeats suppressed since)
        self._kinds: OrderedDict[str, tuple[float, int]] = OrderedDict()
        _LIMITERS.add(self)

    def forget(self) -> None:
        """Forget every kind logged so far (and the repeats suppressed since)."""
        with self._lock:
            self._kinds.clear()

    def warning(self, kind: str, msg: str, *args: object) -> bool:
        """Log ``msg % args`` at WARNING unless a ``kind`` warning was logged within the interval.

        Args:
            kind: Groups repeats of one problem (keep it free of per-call details).
            msg: ``%``-style format string, as for :meth:`logging.Logger.warning`.
            *args: Its arguments.

        Returns:
            Whether a record was emitted.
        """
        now = self._clock()
        with self._lock:
            last = self._kinds.get(kind)
            if last is not None and now - last[0] < self.interval_seconds:
                self._kinds[kind] = (last[0], last[1] + 1)
                return False
            suppressed = last[1] if last is not None else 0
            self._kinds[kind] = (now, 0)
            self._kinds.move_to_end(kind)
            while len(self._kinds) > MAX_KINDS:
                self._kinds.popitem(last=False)
        if suppressed:
            msg = f"{msg} ({suppressed} similar {self.noun} not logged)"
        self.logger.warning(msg, *args)
        return True
