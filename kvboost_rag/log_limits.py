"""Warnings that repeat on every call are logged once, then at most once per interval."""

from __future__ import annotations

import logging
import threading
import time

#: Seconds between two records of the same rate-limited warning.
DEFAULT_INTERVAL_SECONDS = 60.0


class RateLimitedLog:
    """One warning site: the first record is logged, repeats at most once per interval,
    each with the number of repeats it stood for.

    Args:
        logger: Where records go.
        interval: Seconds between two records.
    """

    def __init__(self, logger: logging.Logger, interval: float = DEFAULT_INTERVAL_SECONDS) -> None:
        self._logger = logger
        self._interval = interval
        self._last: float | None = None
        self._suppressed = 0
        self._lock = threading.Lock()

    def warning(self, message: str, *args: object) -> bool:
        """Log ``message % args`` unless the last record is more recent than the interval.

        Returns:
            Whether a record was emitted.
        """
        now = time.monotonic()
        with self._lock:
            if self._last is not None and now - self._last < self._interval:
                self._suppressed += 1
                return False
            suppressed, self._suppressed, self._last = self._suppressed, 0, now
        if suppressed:
            message = f"{message} (%d similar warnings in the last %.0f s not shown)"
            args = (*args, suppressed, self._interval)
        self._logger.warning(message, *args)
        return True
