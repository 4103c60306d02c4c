"""Rate-limited warnings, and tiers that do not flood the log with repeats."""

from __future__ import annotations

import logging

import pytest

from kvboost_rag.cache.storage import DiskTier
from kvboost_rag.cache.storage.disk import SUFFIX
from kvboost_rag.log_limits import MAX_KINDS, RateLimitedLogger, forget_all

LOGGER = logging.getLogger("kvboost_rag.tests.log_limits")


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER.name]


def test_first_warning_logged_then_repeats_suppressed_and_counted(caplog):
    clock = _Clock()
    limited = RateLimitedLogger(LOGGER, interval_seconds=10.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger=LOGGER.name):
        assert limited.warning("corrupt", "bad entry %s", "a1") is True
        assert not any(limited.warning("corrupt", "bad entry %s", f"b{i}") for i in range(99))
        clock.now += 10.0
        assert limited.warning("corrupt", "bad entry %s", "c1") is True
        assert limited.warning("corrupt", "bad entry %s", "c2") is False
    assert _messages(caplog) == ["bad entry a1", "bad entry c1 (99 similar warnings not logged)"]


def test_forget_all_lets_every_live_limiter_log_again(caplog):
    limiters = [RateLimitedLogger(LOGGER, interval_seconds=1e9) for _ in range(2)]
    with caplog.at_level(logging.WARNING, logger=LOGGER.name):
        assert all(limited.warning("k", "first") for limited in limiters)
        assert not any(limited.warning("k", "again") for limited in limiters)
        forget_all()
        assert all(limited.warning("k", "after") for limited in limiters)
    assert _messages(caplog) == ["first", "first", "after", "after"]


def test_kinds_are_limited_separately(caplog):
    limited = RateLimitedLogger(LOGGER, interval_seconds=60.0, noun="failures", clock=_Clock())
    with caplog.at_level(logging.WARNING, logger=LOGGER.name):
        for _ in range(10):
            limited.warning("read", "cannot read")
            limited.warning("corrupt", "corrupt")
    assert _messages(caplog) == ["cannot read", "corrupt"]


def test_memory_is_bounded():
    limited = RateLimitedLogger(LOGGER, interval_seconds=60.0, clock=_Clock())
    for i in range(MAX_KINDS * 3):
        limited.warning(f"kind-{i}", "x")
    assert len(limited._kinds) == MAX_KINDS


def test_negative_interval_is_rejected():
    with pytest.raises(ValueError, match="interval_seconds"):
        RateLimitedLogger(LOGGER, interval_seconds=-1)


def test_a_thousand_corrupt_disk_entries_log_a_handful_of_warnings(tmp_path, caplog):
    tier = DiskTier(tmp_path, max_bytes=10**7)
    for i in range(1000):
        (tmp_path / f"k{i}{SUFFIX}").write_bytes(b"not an entry %d" % i)
    with caplog.at_level(logging.WARNING, logger="kvboost_rag.cache.storage"):
        assert all(tier.get(f"k{i}") is None for i in range(1000))
    assert not list(tmp_path.glob(f"*{SUFFIX}"))  # every one deleted
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert 1 <= len(warnings) <= 3
