"""Connecting the Redis tier: one server, a Redis Cluster, or a master watched by Sentinel.

Which one a URL names:

- ``redis://``, ``rediss://`` (TLS) or ``unix://``: one server, or any node of a Redis Cluster.
  With ``cluster=None`` (the default) the server is asked (``INFO cluster``) and a cluster
  node gets redis-py's cluster client (:class:`redis.cluster.RedisCluster`), which learns the
  slot map from that node, sends each command to the shard owning its key and follows
  ``MOVED``/``ASK`` redirections and failovers. ``cluster=True`` or ``False`` skips the question.
- ``redis+sentinel://[user:password@]host:port[,host:port...]/service_name[/db]`` (or
  ``rediss+sentinel://``): the current master of ``service_name`` as the Sentinels report it
  (redis-py's :class:`redis.sentinel.Sentinel`), found again after a failover.

Valkey speaks the same protocol and works through the same clients. Every connection uses
bounded socket timeouts and at most one immediate retry, so a dead node costs one timeout,
never a hang.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
#: Name standing for "the whole tier" (one server, or a connection not made yet).
WHOLE_TIER = "*"


def import_redis() -> Any:
    """The ``redis`` package.

    Raises:
        ImportError: Not installed, naming the extra that brings it.
    """
    try:
        import redis
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("the Redis tier needs the 'redis' package: pip install 'kvboost-rag[redis]'") from exc
    return redis


def is_sentinel_url(url: str) -> bool:
    """Whether ``url`` names a master through Sentinel."""
    return url.partition("://")[0].lower() in SENTINEL_SCHEMES


@dataclass
class RedisConnection:
    """A connected client and how to reach each of its nodes.

    Attributes:
        client: ``redis.Redis`` or ``redis.cluster.RedisCluster``.
        cluster: Whether ``client`` is the cluster client.
    """

    client: Any
    cluster: bool

    def node_of(self, name: str) -> str:
        """``host:port`` of the primary owning ``name``'s slot (:data:`WHOLE_TIER` off-cluster)."""
        if not self.cluster:
            return WHOLE_TIER
        return str(self.client.get_node_from_key(name).name)

    def primaries(self) -> list[tuple[str, Any]]:
        """``(node name, plain client of that node)`` for each primary (one pair off-cluster)."""
        if not self.cluster:
            return [(WHOLE_TIER, self.client)]
        return [(node.name, self.client.get_redis_connection(node)) for node in self.client.get_primaries()]

    def close(self) -> None:
        self.client.close()


def connect(url: str, *, cluster: bool | None = None, socket_timeout: float = 2.0) -> RedisConnection:
    """Connect to what ``url`` names (see the module docstring).

    Args:
        url: ``redis://``, ``rediss://``, ``unix://`` or ``redis+sentinel://`` URL.
        cluster: ``True``: a Redis Cluster node; ``False``: one server; ``None``: ask the server.
        socket_timeout: Seconds for a connection or a reply.

    Raises:
        redis.exceptions.RedisError: The server (or every Sentinel) cannot be reached.
        ValueError: A Sentinel URL without hosts or service name, or ``cluster=True`` with one.
    """
    redis = import_redis()
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    timeouts = {"socket_timeout": socket_timeout, "socket_connect_timeout": socket_timeout}
    if is_sentinel_url(url):
        if cluster:
            raise ValueError("a Sentinel URL names one master, not a cluster (redis_cluster must not be True)")
        return RedisConnection(_sentinel_master(url, timeouts, Retry(NoBackoff(), 1)), cluster=False)
    if cluster is None:
        probe = redis.Redis.from_url(url, retry=Retry(NoBackoff(), 0), **timeouts)
        try:
            cluster = int(probe.info("cluster").get("cluster_enabled", 0)) == 1
        finally:
            probe.close()
    if cluster:
        from redis.cluster import RedisCluster

        client = RedisCluster.from_url(url, retry=Retry(NoBackoff(), 1), require_full_coverage=False, **timeouts)
        return RedisConnection(client, cluster=True)
    return RedisConnection(redis.Redis.from_url(url, retry=Retry(NoBackoff(), 1), **timeouts), cluster=False)


def _sentinel_master(url: str, timeouts: dict[str, float], retry: Any) -> Any:
    """Client of the master ``url`` names through its Sentinels."""
    from redis.sentinel import Sentinel

    parts = urlsplit(url)
    hosts = []
    for address in parts.netloc.rpartition("@")[2].split(","):
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"Sentinel address {address!r} must be host:port")
        hosts.append((host.strip("[]"), int(port)))
    path = [piece for piece in parts.path.split("/") if piece]
    if not path:
        raise ValueError("a redis+sentinel:// URL needs the service name as its path: .../mymaster[/db]")
    service, db = path[0], int(path[1]) if len(path) > 1 else 0
    auth = {}
    if parts.password is not None:
        auth["password"] = unquote(parts.password)
    if parts.username:
        auth["username"] = unquote(parts.username)
    ssl = {"ssl": True} if parts.scheme.lower().startswith("rediss") else {}
    sentinel = Sentinel(hosts, sentinel_kwargs=dict(timeouts), **timeouts)
    return sentinel.master_for(service, db=db, retry=retry, **auth, **ssl, **timeouts)


def safe_url(url: str) -> str:
    """``url`` without credentials (for logs)."""
    scheme, sep, rest = url.partition("://")
    return f"{scheme}{sep}{rest.rpartition('@')[2]}" if sep else url
