"""Redis tier: entries shared by several serving machines through one Redis server.

Values are the same checksummed bytes the disk tier writes
(:mod:`kvboost_rag.storage.serialization`), stored under ``key_prefix + key``. Capacity is
the server's business: entries get a TTL when one is configured, and otherwise the server's
``maxmemory`` policy evicts them.

Redis is an accelerator, never a dependency of an answer: a connection error or timeout makes
a get a miss and a put a skipped write, logs a warning (at most one per
``warn_interval_seconds``, with the count of failures in between), and pauses the tier for
``backoff_seconds`` so a dead server does not cost a connect timeout on every call. Nothing
here raises to the caller. Corrupt entries are deleted, with warnings rate-limited the same way.

A shared server is written to by other processes: with ``secret_key`` every entry is
authenticated with HMAC-SHA256, and one without a valid MAC under that key is a miss and is
deleted.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

from kvboost_rag.log_limits import RateLimitedLogger
from kvboost_rag.storage.base import StorageTier, StoredEntry
from kvboost_rag.storage.serialization import (
    CorruptPayloadError,
    deserialize_entry,
    serialize_entry,
)

logger = logging.getLogger(__name__)

DEFAULT_KEY_PREFIX = "kvboost:"
#: Seconds ``used_bytes`` reuses its last measurement (it scans the server's keys).
USAGE_CACHE_SECONDS = 5.0
_SCAN_BATCH = 500


def _import_redis() -> Any:
    try:
        import redis
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the Redis tier needs the 'redis' package: pip install 'kvboost-rag[redis]'"
        ) from exc
    return redis


class RedisTier(StorageTier):
    """Entries stored in Redis.

    Args:
        url: ``redis://host:port/db`` (also ``rediss://`` and ``unix://``).
        ttl_seconds: Expiry of each written entry (refreshed on rewrite); ``None`` leaves
            eviction to the server's ``maxmemory`` policy.
        key_prefix: Prefix added to every key (keys passed in are already namespaced by the
            model fingerprint).
        socket_timeout: Seconds to wait for a connection or a reply before treating the
            server as unavailable.
        backoff_seconds: After a connection failure, seconds during which the tier answers
            misses and skips writes without contacting the server.
        warn_interval_seconds: At most one warning of each kind (connection, server error,
            corrupt entry) per this many seconds.
        secret_key: Authenticate entries with HMAC-SHA256 under this key; entries without a
            valid MAC under it are misses and are deleted.

    Raises:
        ImportError: The ``redis`` package is not installed.
        ValueError: Bad ``ttl_seconds`` or an empty ``key_prefix``.
    """

    name = "redis"

    def __init__(
        self,
        url: str,
        ttl_seconds: int | None = None,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        *,
        socket_timeout: float = 2.0,
        backoff_seconds: float = 5.0,
        warn_interval_seconds: float = 30.0,
        secret_key: bytes | None = None,
    ) -> None:
        if ttl_seconds is not None and ttl_seconds <= 0:
            raise ValueError(f"ttl_seconds must be positive or None, got {ttl_seconds}")
        if not key_prefix:
            raise ValueError("key_prefix must not be empty (clear() deletes every key under it)")
        redis = _import_redis()
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.url = url
        self.ttl_seconds = ttl_seconds
        self.key_prefix = key_prefix
        self.backoff_seconds = backoff_seconds
        self.warn_interval_seconds = warn_interval_seconds
        self._secret_key = secret_key
        self._warnings = RateLimitedLogger(logger, warn_interval_seconds, noun="failures")
        # One immediate retry covers a pooled connection the server closed; no sleeping.
        self._client = redis.Redis.from_url(
            url,
            socket_timeout=socket_timeout,
            socket_connect_timeout=socket_timeout,
            retry=Retry(NoBackoff(), 1),
        )
        self._unavailable = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)
        self._redis_error = redis.exceptions.RedisError
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._usage: tuple[float, int] | None = None
        #: Calls that found the server unavailable (including calls skipped while backing off).
        self.errors = 0

    # -- StorageTier -------------------------------------------------------------------------

    def get(self, key: str) -> StoredEntry | None:
        data = self._call("get", lambda: self._client.get(self._name(key)))
        if data is None:
            return None
        try:
            return deserialize_entry(data, expected_key=key, secret_key=self._secret_key)
        except CorruptPayloadError as exc:
            self._warnings.warning("corrupt", "redis tier: corrupt entry %s (%s); deleting it", key[:12], exc)
            self.delete(key)
            return None

    def put(self, key: str, entry: StoredEntry) -> list[str]:
        """Write ``entry``; pins are ignored here (the server's TTL/eviction decides).

        Returns:
            Always ``[]``: the server evicts on its own and does not report it.
        """
        data = serialize_entry(entry, key=key, secret_key=self._secret_key)
        self._call("set", lambda: self._client.set(self._name(key), data, ex=self.ttl_seconds))
        return []

    def delete(self, key: str) -> None:
        self._call("delete", lambda: self._client.delete(self._name(key)))

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, str):
            return False
        return bool(self._call("exists", lambda: self._client.exists(self._name(key))))

    def keys(self) -> Iterator[str]:
        names = self._call("scan", self._scan_names) or []
        start = len(self.key_prefix)
        return iter([name[start:].decode() for name in names])

    def keys_with_prefix(self, prefix: str) -> Iterator[str]:
        """Keys starting with ``prefix``, filtered by the server (``SCAN MATCH``)."""
        names = self._call("scan", lambda: self._scan_names(prefix)) or []
        start = len(self.key_prefix)
        return iter([name[start:].decode() for name in names])

    def clear(self) -> None:
        """Delete every key under this tier's prefix (other keys on the server are untouched)."""

        def run() -> None:
            names = self._scan_names()
            for i in range(0, len(names), _SCAN_BATCH):
                self._client.delete(*names[i : i + _SCAN_BATCH])

        self._call("clear", run)
        with self._lock:
            self._usage = None

    @property
    def used_bytes(self) -> int:
        """Bytes of the values under this tier's prefix (measured at most every few seconds)."""
        now = time.monotonic()
        with self._lock:
            cached = self._usage
        if cached is not None and now - cached[0] < USAGE_CACHE_SECONDS:
            return cached[1]

        def measure() -> int:
            names = self._scan_names()
            total = 0
            for i in range(0, len(names), _SCAN_BATCH):
                pipe = self._client.pipeline(transaction=False)
                for name in names[i : i + _SCAN_BATCH]:
                    pipe.strlen(name)
                total += sum(pipe.execute())
            return total

        measured = self._call("strlen", measure)
        if measured is None:
            return cached[1] if cached is not None else 0
        with self._lock:
            self._usage = (now, measured)
        return measured

    def close(self) -> None:
        try:
            self._client.close()
        except self._redis_error as exc:  # pragma: no cover - closing a dead connection
            logger.debug("redis tier: error on close: %s", exc)

    # -- internals ---------------------------------------------------------------------------

    def _name(self, key: str) -> str:
        return self.key_prefix + key

    def _scan_names(self, prefix: str = "") -> list[bytes]:
        pattern = _glob_escape(self.key_prefix + prefix) + "*"
        return list(self._client.scan_iter(match=pattern, count=_SCAN_BATCH))

    def _call(self, op: str, fn: Any) -> Any:
        """Run ``fn`` against the server; ``None`` when it is unavailable or errs."""
        now = time.monotonic()
        with self._lock:
            if now < self._down_until:
                self.errors += 1
                return None
        try:
            return fn()
        except self._unavailable as exc:
            with self._lock:
                self.errors += 1
                self._down_until = time.monotonic() + self.backoff_seconds
            self._warnings.warning(
                "unavailable",
                "redis tier unavailable (%s at %s): %s; serving without it for %g s",
                op,
                self._safe_url(),
                exc,
                self.backoff_seconds,
            )
        except self._redis_error as exc:
            with self._lock:
                self.errors += 1
            self._warnings.warning("error", "redis tier: %s failed: %s", op, exc)
        return None

    def _safe_url(self) -> str:
        """The URL without credentials."""
        scheme, sep, rest = self.url.partition("://")
        return f"{scheme}{sep}{rest.rpartition('@')[2]}" if sep else self.url


def _glob_escape(text: str) -> str:
    """Escape Redis glob metacharacters."""
    return "".join("\\" + ch if ch in "*?[]\\" else ch for ch in text)
