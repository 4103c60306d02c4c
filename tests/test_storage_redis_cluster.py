"""Redis tier against a real 3-master Redis Cluster on loopback ports.

The cluster is started by :mod:`kvboost_rag.dev.redis_local` (``redis-server`` in cluster mode and
``redis-cli --cluster create``; ``.ci/install-redis.sh`` installs both). Tests that lose a
shard start a cluster of their own.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator

import pytest
import torch

from kvboost_rag.cache.storage import StoredEntry, build_store, deserialize_entry
from kvboost_rag.cache.storage.redis_tier import RedisTier
from kvboost_rag.config import KVBoostSettings
from kvboost_rag.dev.redis_local import (
    LocalCluster,
    RedisNotAvailableError,
    start_cluster,
    start_server,
)

redis = pytest.importorskip("redis", reason="the 'redis' client is not installed: pip install 'kvboost-rag[redis]'")

pytestmark = pytest.mark.redis


def _cluster(**kwargs) -> LocalCluster:
    try:
        return start_cluster(3, **kwargs)
    except RedisNotAvailableError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    """A 3-master cluster shared by the tests that leave it whole."""
    started = _cluster()
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture
def prefix() -> str:
    return f"kvboost-test:{uuid.uuid4().hex[:8]}:"


def _node_clients(cluster: LocalCluster) -> list[redis.Redis]:
    return [redis.Redis(host="127.0.0.1", port=node.port, socket_timeout=2) for node in cluster.nodes]


def _entry(fill: float, tokens: int = 4) -> StoredEntry:
    return StoredEntry(tensors={"keys": torch.full((2, 2, tokens, 8), fill)}, metadata={"fill": str(fill)})


def _holder(cluster: LocalCluster, name: str) -> int:
    """Index of the node that holds ``name``."""
    held = [i for i, client in enumerate(_node_clients(cluster)) if any(client.scan_iter(match=name, count=1000))]
    assert len(held) == 1, f"{name} held by nodes {held}"
    return held[0]


def test_any_node_reaches_the_whole_cluster_and_entries_spread(cluster, prefix):
    writer = RedisTier(cluster.nodes[1].url, key_prefix=prefix)
    keys = [f"{i:04x}" * 4 for i in range(60)]
    for i, key in enumerate(keys):
        writer.put(key, _entry(float(i)))
    assert writer.is_cluster is True and writer.errors == 0
    per_node = [sum(1 for _ in c.scan_iter(match=prefix + "*")) for c in _node_clients(cluster)]
    assert sum(per_node) == 60 and min(per_node) >= 10, per_node

    reader = RedisTier(cluster.nodes[2].url, key_prefix=prefix, cluster=True)  # stated, not asked
    assert sorted(reader.keys()) == sorted(keys)
    assert all(reader.get(key).metadata["fill"] == str(float(i)) for i, key in enumerate(keys))
    assert reader.used_bytes == writer.bytes_written > 0
    reader.clear()
    assert list(writer.keys()) == [] and sum(c.dbsize() for c in _node_clients(cluster)) == 0


def test_the_parts_of_a_large_entry_share_one_shard(cluster, prefix):
    tier = RedisTier(cluster.url, key_prefix=prefix, part_bytes=4096)
    entry = _entry(0.5, tokens=200)  # ~13 kB serialized: 4 parts of 4 kB
    tier.put("big", entry)
    nodes = _node_clients(cluster)
    names = [name.decode() for client in nodes for name in client.scan_iter(match=prefix + "*")]
    parts = len(names) - 1
    assert parts >= 3 and tier.bytes_written > 3 * 4096
    assert sorted(names) == sorted([tier.redis_name("big")] + [tier.redis_name("big") + f":{i}" for i in range(1, parts + 1)])
    assert len({nodes[0].cluster("keyslot", name) for name in names}) == 1
    assert len({_holder(cluster, name) for name in names}) == 1
    loaded = tier.get("big")
    assert loaded is not None and torch.equal(loaded.tensors["keys"], entry.tensors["keys"])
    assert list(tier.keys()) == ["big"]
    tier.delete("big")
    assert sum(c.dbsize() for c in nodes) == 0


def test_a_missing_part_is_a_miss_and_the_entry_goes(cluster, prefix, caplog):
    tier = RedisTier(cluster.url, key_prefix=prefix, part_bytes=4096)
    tier.put("big", _entry(0.5, tokens=200))
    name = tier.redis_name("big") + ":2"
    _node_clients(cluster)[_holder(cluster, name)].delete(name)  # as maxmemory eviction would
    with caplog.at_level(logging.WARNING, logger="kvboost_rag.cache.storage.redis_tier"):
        assert tier.get("big") is None
    assert "corrupt entry" in caplog.text and list(tier.keys()) == []


def test_ttl_secret_key_and_namespaces_hold_on_the_cluster(cluster, prefix):
    secret = b"the-shared-secret-key"
    tier = RedisTier(cluster.url, ttl_seconds=30, key_prefix=prefix, secret_key=secret)
    tier.put("k1", _entry(1.0))
    name = tier.redis_name("k1")
    node = _node_clients(cluster)[_holder(cluster, name)]
    assert 0 < node.ttl(name) <= 30
    assert deserialize_entry(node.get(name), expected_key="k1", secret_key=secret).metadata == {"fill": "1.0"}
    other_namespace = RedisTier(cluster.url, key_prefix=prefix + "other:", secret_key=secret)
    assert other_namespace.get("k1") is None and list(other_namespace.keys()) == []
    unkeyed_writer = RedisTier(cluster.url, key_prefix=prefix)
    unkeyed_writer.put("k2", _entry(2.0))
    assert tier.get("k2") is None  # no valid MAC under the key: a miss, deleted
    assert unkeyed_writer.get("k2") is None
    tier.clear()


def test_cluster_memory_is_bounded_by_maxmemory(cluster, prefix):
    nodes = _node_clients(cluster)
    previous = [client.config_get("maxmemory*") for client in nodes]
    try:
        for client in nodes:
            used = int(client.info("memory")["used_memory"])
            client.config_set("maxmemory-policy", "allkeys-lru")
            client.config_set("maxmemory", str(used + 3_000_000))
        tier = RedisTier(cluster.url, key_prefix=prefix)
        for i in range(48):
            tier.put(f"big{i}", _entry(0.0, tokens=4096))  # ~0.5 MB each, 24 MB in all
        present = [i for i in range(48) if f"big{i}" in tier]
        assert 0 < len(present) < 48 and 47 in present
        assert tier.errors == 0  # evictions are the servers' business, never a failed write
        assert all(int(c.info("stats")["evicted_keys"]) > 0 for c in nodes)
        tier.clear()
    finally:
        for client, config in zip(nodes, previous):
            client.config_set("maxmemory", config["maxmemory"])
            client.config_set("maxmemory-policy", config["maxmemory-policy"])


def test_a_plain_server_is_not_taken_for_a_cluster(prefix):
    try:
        server = start_server()
    except RedisNotAvailableError as exc:
        pytest.skip(str(exc))
    try:
        tier = RedisTier(server.url, key_prefix=prefix)
        tier.put("k1", _entry(1.0))
        assert tier.is_cluster is False and tier.get("k1") is not None
    finally:
        server.stop()


def test_losing_a_shard_turns_its_entries_into_misses_and_hits_resume(prefix, caplog):
    """A shard is killed mid-run: its entries miss (fast), the others keep hitting; once it is
    back (with its append-only file) every entry hits again."""
    lost = _cluster()
    try:
        tier = RedisTier(lost.url, key_prefix=prefix, socket_timeout=0.5, backoff_seconds=0.5)
        keys = [f"{i:04x}" * 4 for i in range(30)]
        for i, key in enumerate(keys):
            tier.put(key, _entry(float(i)))
        on_lost = {key for key in keys if _holder(lost, tier.redis_name(key)) == 2}
        assert 0 < len(on_lost) < len(keys)

        lost.kill(2)
        with caplog.at_level(logging.WARNING, logger="kvboost_rag.cache.storage.redis_tier"):
            start = time.perf_counter()
            for _ in range(3):
                found = {key for key in keys if tier.get(key) is not None}
                assert found == set(keys) - on_lost
                assert tier.put("during-outage", _entry(9.0)) == []
            listed = set(tier.keys())  # the reachable shards are listed
            assert listed >= set(keys) - on_lost and not listed & on_lost
            elapsed = time.perf_counter() - start
        assert elapsed < 5.0, f"lookups with a shard down took {elapsed:.1f} s"
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert 1 <= len(warnings) <= 3 and "shard 127.0.0.1:" in warnings[0].getMessage()

        lost.restart(2)
        time.sleep(0.6)  # past the backoff
        assert all(tier.get(key) is not None for key in keys)
        tier.put("after", _entry(3.0))
        assert tier.get("after") is not None
    finally:
        lost.stop()


# -- two processes over the cluster, through the engine ----------------------------------------

_WRITER = textwrap.dedent(
    """
    import json, sys, torch
    torch.set_num_threads(1)
    from kvboost_rag import KVBoost
    from kvboost_rag.corpus import python_reference_documents
    from kvboost_rag.dev.testing import tiny_model, tiny_tokenizer
    engine = KVBoost.from_model(tiny_model("llama"), tiny_tokenizer(), chunk_size=32, show_progress=False,
                                disk_cache_dir=None, redis_url=sys.argv[1])
    docs = python_reference_documents(max_chars=400)[:12]
    results = engine.warm_documents(docs)
    print(json.dumps({"tokens": sum(r.num_tokens for r in results), "kept": [r.kept_in for r in results]}))
    """
)


def test_a_second_process_finds_every_document_another_warmed(cluster, make_engine):
    """The issue's scenario: one process warms 12 documents through node 0; a process pointed
    at node 2 finds all of them (records included) and hits their tokens."""
    from kvboost_rag.corpus import python_reference_documents

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*sys.path])}
    done = subprocess.run(
        [sys.executable, "-c", _WRITER, cluster.nodes[0].url], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    written = json.loads(done.stdout.strip().splitlines()[-1])
    assert all("redis" in kept for kept in written["kept"])
    nodes = _node_clients(cluster)
    assert all(client.dbsize() > 0 for client in nodes), "every shard holds entries"

    docs = python_reference_documents(max_chars=400)[:12]
    reader = make_engine(disk_cache_dir=None, redis_url=cluster.nodes[2].url)
    try:
        stats = reader.cache_stats()
        assert stats.documents == 12 and stats.documents_by_tier["redis"] == 12
        results = reader.warm_documents(docs)
        assert all(r.new_tokens == 0 for r in results)
        assert sum(r.cached_tokens for r in results) == written["tokens"]
        prompt = "You are a careful assistant.\n\n" + "\n\n".join(docs[3:8][::-1]) + "\n\nQuestion: Why?\nAnswer:"
        result = reader.generate(prompt, max_new_tokens=2)
        assert result.documents_found == 5 and result.content_hit_tokens > 0
        assert reader.cache_stats().tiers["redis"]["hits"] > 0
    finally:
        reader.clear_cache()
    assert sum(client.dbsize() for client in nodes) == 0


def test_build_store_passes_the_cluster_flag(cluster):
    store = build_store(KVBoostSettings(disk_cache_dir=None, redis_url=cluster.url, redis_cluster=True))
    tier = store.tiers[-1]
    assert isinstance(tier, RedisTier) and tier.cluster is True
    store.close()


def test_a_master_through_sentinel(prefix, tmp_path):
    """``redis+sentinel://`` finds the master a Sentinel watches (Sentinel runs as
    ``redis-server <config> --sentinel``, from the same Debian package)."""
    from kvboost_rag.dev.redis_local import find_binary, free_port

    try:
        master = start_server()
    except RedisNotAvailableError as exc:
        pytest.skip(str(exc))
    port = free_port()
    config = tmp_path / "sentinel.conf"
    config.write_text(f"port {port}\nbind 127.0.0.1\nsentinel monitor themaster 127.0.0.1 {master.port} 1\n")
    sentinel = subprocess.Popen([find_binary("redis-server"), str(config), "--sentinel"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        probe = redis.Redis(port=port, socket_timeout=0.5)
        deadline = time.monotonic() + 10
        while True:
            try:
                if probe.ping():
                    break
            except redis.exceptions.ConnectionError:
                assert time.monotonic() < deadline, "the Sentinel did not start"
                time.sleep(0.1)
        tier = RedisTier(f"redis+sentinel://127.0.0.1:{port}/themaster", key_prefix=prefix)
        tier.put("k1", _entry(1.0))
        assert tier.is_cluster is False and tier.get("k1") is not None
        assert redis.Redis(port=master.port).exists(tier.redis_name("k1")) == 1
    finally:
        sentinel.terminate()
        sentinel.wait(timeout=10)
        master.stop()
