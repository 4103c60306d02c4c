"""Redis tier: entries shared by several serving machines through Redis or a Redis Cluster.

Values are the same checksummed bytes the disk tier writes
(:mod:`kvboost_rag.cache.storage.serialization`), laid out as :mod:`~kvboost_rag.cache.storage.redis_layout`
describes (``key_prefix{key}``: a hash tag keeps an entry's keys on one cluster shard). The URL
can name one server, any node of a Redis Cluster, or a master through Sentinel
(:mod:`~kvboost_rag.cache.storage.redis_connect`). Capacity is the server's business: entries get a
TTL when one is configured, and otherwise the servers' ``maxmemory`` policy evicts them.

Redis is an accelerator, never a dependency of an answer: a connection error or timeout makes
a get a miss and a put a skipped write, logs a warning (at most one per
``warn_interval_seconds``, with the count of failures in between), and pauses the unreachable
part for ``backoff_seconds``, so a dead server does not cost a connect timeout on every call.
On a cluster that part is the one shard: entries on the other shards keep hitting, and the
shard's entries hit again once it is back (or once the cluster has failed over to its
replica). Nothing here raises to the caller. Corrupt entries are deleted, with warnings
rate-limited the same way.

A shared server is written to by other processes: with ``secret_key`` every entry is
authenticated with HMAC-SHA256, and one without a valid MAC under that key is a miss and is
deleted.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from kvboost_rag.cache.storage.base import StorageTier, StoredEntry
from kvboost_rag.cache.storage.redis_connect import (
    WHOLE_TIER,
    RedisConnection,
    connect,
    import_redis,
    safe_url,
)
from kvboost_rag.cache.storage.redis_layout import (
    DEFAULT_PART_BYTES,
    PARTS_HEADER_BYTES,
    check_prefix,
    entry_name,
    key_of_name,
    part_names,
    parts_header,
    split_value,
)
from kvboost_rag.cache.storage.serialization import (
    CorruptPayloadError,
    deserialize_entry,
    serialize_entry,
)
from kvboost_rag.log_limits import RateLimitedLogger

logger = logging.getLogger(__name__)

DEFAULT_KEY_PREFIX = "kvboost:"
#: Seconds ``used_bytes`` reuses its last measurement (it scans the server's keys).
USAGE_CACHE_SECONDS = 5.0
_SCAN_BATCH = 500
_T = TypeVar("_T")


class RedisTier(StorageTier):
    """Entries stored in Redis, a Redis Cluster, or a Sentinel-managed master.

    Args:
        url: ``redis://host:port/db`` (also ``rediss://``, ``unix://``; any node of a cluster)
            or ``redis+sentinel://host:port[,host:port]/service[/db]``.
        ttl_seconds: Expiry of each written entry (refreshed on rewrite); ``None`` leaves
            eviction to the server's ``maxmemory`` policy.
        key_prefix: Prefix added to every key (keys passed in are already namespaced by the
            model fingerprint); no braces.
        cluster: ``True``/``False``: the URL names a Redis Cluster node / one server; ``None``:
            ask the server when first connecting (``INFO cluster``).
        socket_timeout: Seconds to wait for a connection or a reply before treating the
            server (or shard) as unavailable.
        backoff_seconds: After a connection failure, seconds during which the tier answers
            misses and skips writes for the unreachable server or shard without contacting it.
        warn_interval_seconds: At most one warning of each kind (connection, server error,
            corrupt entry) per this many seconds.
        secret_key: Authenticate entries with HMAC-SHA256 under this key; entries without a
            valid MAC under it are misses and are deleted.
        part_bytes: Largest value stored under one Redis key; larger entries are stored in
            parts on the same shard.

    Raises:
        ImportError: The ``redis`` package is not installed.
        ValueError: Bad ``ttl_seconds``, ``part_bytes`` or ``key_prefix``.
    """

    name = "redis"

    def __init__(
        self,
        url: str,
        ttl_seconds: int | None = None,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        *,
        cluster: bool | None = None,
        socket_timeout: float = 2.0,
        backoff_seconds: float = 5.0,
        warn_interval_seconds: float = 30.0,
        secret_key: bytes | None = None,
        part_bytes: int = DEFAULT_PART_BYTES,
    ) -> None:
        if ttl_seconds is not None and ttl_seconds <= 0:
            raise ValueError(f"ttl_seconds must be positive or None, got {ttl_seconds}")
        if part_bytes < 1024:
            raise ValueError(f"part_bytes must be at least 1024, got {part_bytes}")
        check_prefix(key_prefix)
        redis = import_redis()
        self.url = url
        self.ttl_seconds = ttl_seconds
        self.key_prefix = key_prefix
        self.cluster = cluster
        self.socket_timeout = socket_timeout
        self.backoff_seconds = backoff_seconds
        self.warn_interval_seconds = warn_interval_seconds
        self.part_bytes = part_bytes
        self._secret_key = secret_key
        self._warnings = RateLimitedLogger(logger, warn_interval_seconds, noun="failures")
        # RedisClusterException: no node of the cluster answered, or a slot has no node.
        self._unavailable = (
            redis.exceptions.ConnectionError,
            redis.exceptions.TimeoutError,
            redis.exceptions.RedisClusterException,
            OSError,
        )
        self._redis_error = redis.exceptions.RedisError
        self._lock = threading.Lock()
        self._connection: RedisConnection | None = None
        #: Server or shard (``host:port``; :data:`WHOLE_TIER` for all) -> end of its backoff.
        self._down_until: dict[str, float] = {}
        self._usage: tuple[float, int] | None = None
        #: Calls that found the server or shard unavailable (including calls skipped while backing off).
        self.errors = 0
        #: Bytes this tier wrote (values, parts and headers).
        self.bytes_written = 0

    # -- StorageTier -------------------------------------------------------------------------

    def get(self, key: str) -> StoredEntry | None:
        name = self.redis_name(key)
        data = self._call("get", name, lambda client: self._read(client, name))
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
        name = self.redis_name(key)
        head, parts = split_value(serialize_entry(entry, key=key, secret_key=self._secret_key), self.part_bytes)

        def write(client: Any) -> bool:
            if not parts:
                return bool(client.set(name, head, ex=self.ttl_seconds))
            pipe = client.pipeline(transaction=True)  # one slot (hash tag): allowed on a cluster
            for part_name, part in zip(part_names(name, len(parts)), parts):
                pipe.set(part_name, part, ex=self.ttl_seconds)
            pipe.set(name, head, ex=self.ttl_seconds)
            pipe.execute()
            return True

        if self._call("set", name, write):
            with self._lock:
                self.bytes_written += len(head) + sum(len(part) for part in parts)
        return []

    def delete(self, key: str) -> None:
        name = self.redis_name(key)

        def remove(client: Any) -> int:
            header = parts_header(client.getrange(name, 0, PARTS_HEADER_BYTES - 1) or b"")
            names = [name, *part_names(name, header[0])] if header else [name]
            return int(client.delete(*names))

        self._call("delete", name, remove)

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, str):
            return False
        name = self.redis_name(key)
        return bool(self._call("exists", name, lambda client: client.exists(name)))

    def keys(self) -> Iterator[str]:
        return self.keys_with_prefix("")

    def keys_with_prefix(self, prefix: str) -> Iterator[str]:
        """Keys starting with ``prefix``, filtered by the servers (``SCAN MATCH`` on each
        reachable shard)."""
        keys = []
        for names in self._per_shard("scan", lambda client: self._scan(client, prefix)):
            keys += [k for k in (key_of_name(self.key_prefix, n.decode()) for n in names) if k is not None]
        return iter(keys)

    def clear(self) -> None:
        """Delete every key under this tier's prefix on every reachable shard (other keys on
        the servers are untouched)."""

        def run(client: Any) -> None:
            names = self._scan(client)
            for i in range(0, len(names), _SCAN_BATCH):
                pipe = client.pipeline(transaction=False)  # one DEL per key: keys span slots
                for name in names[i : i + _SCAN_BATCH]:
                    pipe.delete(name)
                pipe.execute()

        self._per_shard("clear", run)
        with self._lock:
            self._usage = None

    @property
    def used_bytes(self) -> int:
        """Bytes of the values under this tier's prefix on the reachable shards (measured at
        most every few seconds)."""
        now = time.monotonic()
        with self._lock:
            cached = self._usage
        if cached is not None and now - cached[0] < USAGE_CACHE_SECONDS:
            return cached[1]

        def measure(client: Any) -> int:
            names = self._scan(client)
            total = 0
            for i in range(0, len(names), _SCAN_BATCH):
                pipe = client.pipeline(transaction=False)
                for name in names[i : i + _SCAN_BATCH]:
                    pipe.strlen(name)
                total += sum(pipe.execute())
            return total

        measured = self._per_shard("strlen", measure)
        if not measured:
            return cached[1] if cached is not None else 0
        with self._lock:
            self._usage = (now, sum(measured))
        return sum(measured)

    def close(self) -> None:
        with self._lock:
            connection, self._connection = self._connection, None
        if connection is None:
            return
        try:
            connection.close()
        except self._redis_error as exc:  # pragma: no cover - closing a dead connection
            logger.debug("redis tier: error on close: %s", exc)

    # -- what it runs on ---------------------------------------------------------------------

    @property
    def is_cluster(self) -> bool | None:
        """Whether the tier talks to a Redis Cluster (``None`` until it has connected)."""
        connection = self._connection
        return None if connection is None else connection.cluster

    def redis_name(self, key: str) -> str:
        """The Redis name entry ``key`` is stored under (``key_prefix{key}``)."""
        return entry_name(self.key_prefix, key)

    # -- internals ---------------------------------------------------------------------------

    def _connect(self) -> RedisConnection:
        with self._lock:
            if self._connection is None:
                self._connection = connect(self.url, cluster=self.cluster, socket_timeout=self.socket_timeout)
            return self._connection

    def _read(self, client: Any, name: str) -> bytes | None:
        data = client.get(name)
        header = parts_header(data) if data is not None else None
        if header is None:
            return data
        count, total = header
        parts = client.mget(part_names(name, count))
        if any(part is None for part in parts):
            # A part expired or was evicted apart from the others: a miss, the rest goes.
            return b""
        joined = b"".join(parts)
        return joined if len(joined) == total else b""

    def _scan(self, client: Any, prefix: str = "") -> list[bytes]:
        pattern = _glob_escape(self.redis_name(prefix)[:-1]) + "*"
        return list(client.scan_iter(match=pattern, count=_SCAN_BATCH))

    def _backing_off(self, node: str, now: float) -> bool:
        with self._lock:
            if now < self._down_until.get(WHOLE_TIER, 0.0) or now < self._down_until.get(node, 0.0):
                self.errors += 1
                return True
        return False

    def _call(self, op: str, name: str, fn: Callable[[Any], _T]) -> _T | None:
        """Run ``fn(client)`` for the entry stored under ``name``; ``None`` when the server or
        the shard owning ``name`` is unavailable or errs."""
        if self._backing_off(WHOLE_TIER, time.monotonic()):
            return None
        node = WHOLE_TIER
        try:
            connection = self._connect()
            node = connection.node_of(name)
            if self._backing_off(node, time.monotonic()):
                return None
            return fn(connection.client)
        except self._unavailable as exc:
            self._failed(op, node, exc)
        except self._redis_error as exc:
            with self._lock:
                self.errors += 1
            self._warnings.warning("error", "redis tier: %s failed: %s", op, exc)
        return None

    def _per_shard(self, op: str, fn: Callable[[Any], _T]) -> list[_T]:
        """``fn(client)`` on each reachable primary; shards that fail are skipped."""
        if self._backing_off(WHOLE_TIER, time.monotonic()):
            return []
        try:
            shards = self._connect().primaries()
        except self._unavailable as exc:
            self._failed(op, WHOLE_TIER, exc)
            return []
        except self._redis_error as exc:
            self._warnings.warning("error", "redis tier: %s failed: %s", op, exc)
            return []
        results = []
        for node, client in shards:
            if self._backing_off(node, time.monotonic()):
                continue
            try:
                results.append(fn(client))
            except self._unavailable as exc:
                self._failed(op, node, exc)
            except self._redis_error as exc:
                self._warnings.warning("error", "redis tier: %s failed on %s: %s", op, node, exc)
        return results

    def _failed(self, op: str, node: str, exc: BaseException) -> None:
        with self._lock:
            self.errors += 1
            self._down_until[node] = time.monotonic() + self.backoff_seconds
        where = safe_url(self.url) if node == WHOLE_TIER else f"shard {node} of {safe_url(self.url)}"
        self._warnings.warning(
            "unavailable",
            "redis tier unavailable (%s at %s): %s; serving without it for %g s",
            op,
            where,
            exc,
            self.backoff_seconds,
        )


def _glob_escape(text: str) -> str:
    """Escape Redis glob metacharacters."""
    return "".join("\\" + ch if ch in "*?[]\\" else ch for ch in text)
