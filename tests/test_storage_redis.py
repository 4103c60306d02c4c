"""Redis tier against a real redis-server on loopback, and its behaviour when Redis is down.

The fixture starts ``redis-server`` (Debian package ``redis-server``; ``.ci/install-redis.sh``
installs it) on a free 127.0.0.1 port with persistence off, and stops it afterwards. Set
``KVBOOST_TEST_REDIS_URL`` to use an already running server instead. Tests that need a server
skip, saying why, only when none can be started.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from kvboost_rag.cache.codec import KVBlock, decode_block, encode_block
from kvboost_rag.cache.storage import (
    MemoryTier,
    StoredEntry,
    TieredStore,
    build_store,
    deserialize_entry,
    serialize_entry,
)
from kvboost_rag.cache.storage.redis_tier import RedisTier
from kvboost_rag.config import KVBoostSettings

redis = pytest.importorskip("redis", reason="the 'redis' client is not installed: pip install 'kvboost-rag[redis]'")

pytestmark = pytest.mark.redis

LAYOUT = (2, 2, 8)


@dataclass
class RedisServer:
    """A redis-server process this test module started (or an external URL)."""

    url: str
    port: int
    process: subprocess.Popen[bytes] | None

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _start_redis(port: int | None = None) -> RedisServer:
    """Start redis-server on loopback; ``pytest.skip`` with the reason if that is impossible."""
    binary = shutil.which("redis-server") or next(
        (path for path in ("/usr/bin/redis-server", "/usr/sbin/redis-server") if os.access(path, os.X_OK)), None
    )
    if binary is None:
        pytest.skip("no redis-server binary on PATH (install Debian's redis-server: .ci/install-redis.sh)")
    port = port or _free_port()
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    args += ["--daemonize", "no", "--protected-mode", "yes", "--loglevel", "warning"]
    try:
        process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    except OSError as exc:
        pytest.skip(f"cannot run {binary}: {exc}")
    server = RedisServer(url=f"redis://127.0.0.1:{port}/0", port=port, process=process)
    client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.2)
    deadline = time.monotonic() + 10
    while True:
        try:
            if client.ping():
                client.close()
                return server
        except redis.exceptions.ConnectionError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            server.stop()
            output = process.stdout.read().decode(errors="replace") if process.stdout else ""
            pytest.skip(f"redis-server did not start on 127.0.0.1:{port}: {output.strip()[-300:]}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    """URL of a live Redis server for this module."""
    external = os.environ.get("KVBOOST_TEST_REDIS_URL")
    if external:
        yield external
        return
    server = _start_redis()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def tier(redis_url: str) -> Iterator[RedisTier]:
    """A tier with its own key prefix, cleaned up afterwards."""
    tier = RedisTier(redis_url, key_prefix=f"kvboost-test:{uuid.uuid4().hex[:8]}:")
    yield tier
    tier.clear()
    tier.close()


@pytest.fixture
def raw(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def _entry(fill: float, tokens: int = 4) -> StoredEntry:
    return StoredEntry(tensors={"keys": torch.full((2, 2, tokens, 8), fill)}, metadata={"fill": str(fill)})


def _block_entry(fingerprint: str = "fp-a", bits: int | None = None) -> StoredEntry:
    gen = torch.Generator().manual_seed(0)
    shape = (2, 2, 12, 8)
    block = KVBlock(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen), torch.arange(12), 0)
    return encode_block(block, fingerprint=fingerprint, bits=bits, group_size=8)


# -- against a live server -------------------------------------------------------------------


@pytest.mark.parametrize("bits", [None, 8, 4])
def test_round_trip(tier, bits):
    entry = _block_entry(bits=bits)
    assert tier.put("abc123", entry) == []
    assert "abc123" in tier and "def456" not in tier
    loaded = tier.get("abc123")
    assert loaded is not None and loaded.metadata == entry.metadata
    assert all(torch.equal(loaded.tensors[k], entry.tensors[k]) for k in entry.tensors)
    block = decode_block(loaded, fingerprint="fp-a", expected_layout=LAYOUT)
    assert block.num_tokens == 12
    assert tier.get("def456") is None


def test_values_are_the_disk_format_under_the_prefix(tier, raw):
    entry = _entry(1.5)
    tier.put("k1", entry)
    stored = deserialize_entry(raw.get(tier.redis_name("k1")), expected_key="k1")
    assert stored.metadata == entry.metadata and torch.equal(stored.tensors["keys"], entry.tensors["keys"])
    assert list(tier.keys()) == ["k1"]
    assert tier.used_bytes == raw.strlen(tier.redis_name("k1"))


def test_ttl_is_set_and_entries_expire(redis_url, raw):
    tier = RedisTier(redis_url, ttl_seconds=1, key_prefix=f"kvboost-test:{uuid.uuid4().hex[:8]}:")
    tier.put("k1", _entry(1.0))
    assert 0 < raw.pttl(tier.redis_name("k1")) <= 1000
    time.sleep(1.1)
    assert tier.get("k1") is None and "k1" not in tier


def test_no_ttl_leaves_eviction_to_the_server(tier, raw):
    tier.put("k1", _entry(1.0))
    assert raw.ttl(tier.redis_name("k1")) == -1


def test_server_eviction_turns_into_misses(tier, raw):
    previous = raw.config_get("maxmemory*")
    baseline = int(raw.info("memory")["used_memory"])
    try:
        raw.config_set("maxmemory-policy", "allkeys-lru")
        raw.config_set("maxmemory", str(baseline + 4_000_000))
        big = _entry(0.0, tokens=4096)  # ~0.5 MB serialized
        for i in range(16):
            tier.put(f"big{i}", big)  # the server evicts older ones; puts never raise
        present = [i for i in range(16) if tier.get(f"big{i}") is not None]
        assert 0 < len(present) < 16
        assert 15 in present  # the latest write survives
    finally:
        raw.config_set("maxmemory", previous["maxmemory"])
        raw.config_set("maxmemory-policy", previous["maxmemory-policy"])


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage", "other_key"])
def test_corrupt_value_is_a_miss_and_is_deleted(tier, raw, caplog, damage):
    name = tier.redis_name("k1")
    tier.put("k1", _block_entry())
    data = bytearray(raw.get(name))
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
    elif damage == "truncate":
        data = data[:-9]
    elif damage == "garbage":
        data = bytearray(b"\x80\x04not a kv entry")
    else:
        data = bytearray(serialize_entry(_block_entry(), key="k2"))
    raw.set(name, bytes(data))
    with caplog.at_level(logging.WARNING, logger="kvboost_rag.cache.storage.redis_tier"):
        assert tier.get("k1") is None
    assert "corrupt entry" in caplog.text
    assert raw.exists(name) == 0
    tier.put("k1", _block_entry())
    assert tier.get("k1") is not None


def test_delete_and_clear_touch_only_this_prefix(tier, raw):
    raw.set("unrelated-key", b"keep me")
    try:
        tier.put("k1", _entry(1.0))
        tier.put("k2", _entry(2.0))
        tier.delete("k1")
        assert sorted(tier.keys()) == ["k2"]
        tier.clear()
        assert list(tier.keys()) == [] and tier.used_bytes == 0
        assert raw.get("unrelated-key") == b"keep me"
    finally:
        raw.delete("unrelated-key")


def test_two_stores_share_entries_through_redis(redis_url, tier):
    """Two serving processes: one warms, the other hits in Redis and promotes to memory."""
    writer = TieredStore([MemoryTier(10**6), tier])
    writer.put("doc1", _block_entry())
    reader_memory = MemoryTier(10**6)
    reader = TieredStore([reader_memory, RedisTier(redis_url, key_prefix=tier.key_prefix)])
    entry = reader.get("doc1")
    assert entry is not None and "doc1" in reader_memory
    decode_block(entry, fingerprint="fp-a", expected_layout=LAYOUT)
    reader.get("doc1")
    assert reader.stats()["redis"]["hits"] == 1 and reader.stats()["memory"]["hits"] == 1


def test_build_store_with_a_live_redis(redis_url, raw, tmp_path):
    store = build_store(KVBoostSettings(disk_cache_dir=tmp_path, redis_url=redis_url, redis_ttl_seconds=30))
    redis_tier = store.tiers[2]
    try:
        store.put("doc2", _entry(3.0))
        assert "doc2" in redis_tier and 0 < raw.ttl(redis_tier.redis_name("doc2")) <= 30
    finally:
        redis_tier.delete("doc2")
        store.close()


@pytest.mark.parametrize("writer_key", [None, b"another-secret-key-b"], ids=["no-key", "other-key"])
def test_secret_key_rejects_and_deletes_entries_not_authenticated_with_it(redis_url, tier, raw, writer_key):
    key = b"the-shared-secret-key"
    if writer_key is not None:
        RedisTier(redis_url, key_prefix=tier.key_prefix, secret_key=writer_key).put("k1", _block_entry())
    else:
        tier.put("k1", _block_entry())
    keyed = RedisTier(redis_url, key_prefix=tier.key_prefix, secret_key=key)
    assert keyed.get("k1") is None
    assert raw.exists(tier.redis_name("k1")) == 0
    keyed.put("k1", _block_entry())
    assert keyed.get("k1") is not None
    assert deserialize_entry(raw.get(tier.redis_name("k1")), expected_key="k1", secret_key=key).metadata


def test_build_store_passes_the_secret_key_to_redis(redis_url, tier, raw):
    store = build_store(KVBoostSettings(redis_url=redis_url, cache_secret_key="the-shared-secret-key"))
    redis_tier = store.tiers[-1]
    try:
        store.put("doc3", _entry(1.0))
        data = raw.get(redis_tier.redis_name("doc3"))
        assert deserialize_entry(data, expected_key="doc3", secret_key=b"the-shared-secret-key").metadata
    finally:
        redis_tier.delete("doc3")
        store.close()


def test_a_thousand_corrupt_values_log_a_handful_of_warnings(tier, raw, caplog):
    pipe = raw.pipeline(transaction=False)
    for i in range(1000):
        pipe.set(tier.redis_name(f"k{i}"), b"garbage %d" % i)
    pipe.execute()
    with caplog.at_level(logging.WARNING, logger="kvboost_rag.cache.storage.redis_tier"):
        assert all(tier.get(f"k{i}") is None for i in range(1000))
    assert list(tier.keys()) == []
    assert 1 <= len([r for r in caplog.records if r.levelno >= logging.WARNING]) <= 3


def test_server_going_away_and_coming_back(caplog):
    server = _start_redis()
    tier = RedisTier(server.url, key_prefix="kvboost-test:restart:", backoff_seconds=0.2, socket_timeout=0.5)
    try:
        tier.put("k1", _entry(1.0))
        assert tier.get("k1") is not None
        server.stop()
        with caplog.at_level(logging.WARNING, logger="kvboost_rag.cache.storage.redis_tier"):
            assert tier.get("k1") is None
            assert tier.put("k2", _entry(2.0)) == []
        assert tier.errors >= 2 and "unavailable" in caplog.text
        restarted = _start_redis(server.port)
        try:
            time.sleep(0.25)  # past the backoff
            tier.put("k3", _entry(3.0))
            assert tier.get("k3") is not None
        finally:
            restarted.stop()
    finally:
        server.stop()
        tier.close()


# -- no server -------------------------------------------------------------------------------


@pytest.fixture
def dead_url() -> str:
    """A loopback port nothing listens on."""
    return f"redis://127.0.0.1:{_free_port()}/0"


def test_connection_errors_are_misses_never_exceptions(dead_url, caplog):
    tier = RedisTier(dead_url, socket_timeout=0.5)
    with caplog.at_level(logging.WARNING, logger="kvboost_rag.cache.storage.redis_tier"):
        start = time.perf_counter()
        for _ in range(50):
            assert tier.get("k1") is None
            assert tier.put("k1", _entry(1.0)) == []
            assert "k1" not in tier
            tier.delete("k1")
        assert list(tier.keys()) == []
        assert tier.used_bytes == 0
        tier.clear()
        elapsed = time.perf_counter() - start
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, "connection warnings must be rate-limited"
    assert "unavailable" in warnings[0].getMessage() and dead_url in warnings[0].getMessage()
    assert tier.errors >= 200
    assert elapsed < 2.0  # backing off: no connect attempt per call


def test_warning_is_repeated_after_the_interval_with_a_count(dead_url, caplog):
    tier = RedisTier(dead_url, backoff_seconds=0.0, warn_interval_seconds=0.2)
    with caplog.at_level(logging.WARNING, logger="kvboost_rag.cache.storage.redis_tier"):
        for _ in range(5):
            tier.get("k")
        time.sleep(0.25)
        tier.get("k")
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and "4 similar failures not logged" in messages[1]


def test_credentials_are_not_logged(caplog):
    port = _free_port()
    tier = RedisTier(f"redis://user:s3cret@127.0.0.1:{port}/0")
    with caplog.at_level(logging.WARNING, logger="kvboost_rag.cache.storage.redis_tier"):
        tier.get("k")
    assert "s3cret" not in caplog.text and f"127.0.0.1:{port}" in caplog.text


def test_store_with_a_dead_redis_still_serves_from_memory_and_disk(dead_url, tmp_path):
    store = build_store(KVBoostSettings(disk_cache_dir=tmp_path, redis_url=dead_url))
    store.put("k1", _entry(1.0))
    fresh = build_store(KVBoostSettings(disk_cache_dir=tmp_path, redis_url=dead_url))
    assert fresh.get("k1") is not None and fresh.stats()["disk"]["hits"] == 1
    assert fresh.get("missing") is None


def test_invalid_arguments():
    with pytest.raises(ValueError, match="ttl_seconds"):
        RedisTier("redis://127.0.0.1:1/0", ttl_seconds=0)
    with pytest.raises(ValueError, match="key_prefix"):
        RedisTier("redis://127.0.0.1:1/0", key_prefix="")


# -- through the engine ----------------------------------------------------------------------


@pytest.fixture
def one_thread():
    """Tiny models run fastest on one intra-op thread (and much faster on a busy machine)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _prompt(docs: list[str]) -> str:
    return "You are a careful assistant.\n\n" + "\n\n".join(docs) + "\n\nQuestion: What does it say?\nAnswer:"


def test_second_engine_reuses_documents_another_engine_stored_in_redis(make_engine, docs, redis_url, one_thread):
    """Two serving machines sharing one prewarmed corpus through Redis."""
    try:
        writer = make_engine(redis_url=redis_url)
        writer.warm_documents(docs[:3])
        prompt = _prompt(docs[:3][::-1])
        expected = writer.generate(prompt, max_new_tokens=6)
        assert writer.flush(timeout=60)  # its prefix chunks in Redis too

        reader = make_engine(redis_url=redis_url)
        assert all(r.new_tokens == 0 for r in reader.warm_documents(docs[:3]))
        result = reader.generate(prompt, max_new_tokens=6)
        assert result.content_hit_tokens == expected.content_hit_tokens > 0
        assert result.token_ids == expected.token_ids
        assert reader.cache_stats().tiers["redis"]["hits"] > 0
    finally:
        RedisTier(redis_url).clear()


def test_engine_with_redis_down_still_answers(make_engine, docs, dead_url, one_thread, caplog):
    engine = make_engine(redis_url=dead_url)
    prompt = _prompt(docs[:2])
    with caplog.at_level(logging.WARNING, logger="kvboost_rag.cache.storage.redis_tier"):
        engine.warm_documents(docs[:2])
        result = engine.generate(prompt, max_new_tokens=6)
    assert "unavailable" in caplog.text
    assert result.content_hit_tokens > 0  # the memory tier still serves
    assert result.token_ids == engine.generate(prompt, max_new_tokens=6).token_ids


def test_fresh_engine_over_the_same_redis_finds_stored_documents(make_engine, docs, redis_url):
    first = make_engine(redis_url=redis_url, warm_prefix="You are a careful assistant.")
    try:
        first.warm_documents(docs[:3])
        restarted = make_engine(redis_url=redis_url, warm_prefix="You are a careful assistant.")
        assert restarted.cache_stats().documents == 3
        prompt = "You are a careful assistant.\n\n" + "\n\n".join(docs[2::-1]) + "\n\nQuestion: Why?\nAnswer:"
        result = restarted.generate(prompt, max_new_tokens=2)
        assert result.documents_found == 3 and result.content_hit_tokens > 0
        assert restarted.cache_stats().tiers["redis"]["hits"] > 0
    finally:
        first.clear_cache()


def test_a_corpus_larger_than_memory_stays_whole_in_redis(make_engine, redis_url):
    """Documents worth 3x the memory tier: memory evicts them whole, Redis keeps every one."""
    from rag_prompts import SYSTEM_PROMPT, rag_prompt
    from test_corpus_eviction import DOCS, _budgeted, check_agreement

    engine = _budgeted(make_engine, 3, disk_cache_dir=None, redis_url=redis_url)
    try:
        engine.warm(SYSTEM_PROMPT + "\n\n")
        results = engine.warm_documents(DOCS)
        assert all("redis" in r.kept_in for r in results)
        stats = engine.cache_stats()
        assert stats.documents == len(DOCS) and stats.documents_evicted == 0
        assert stats.documents_by_tier["redis"] == len(DOCS) > stats.documents_by_tier["memory"]
        check_agreement(engine, memory_only=False)
        demoted = [d for d, r in zip(DOCS[2:], results[2:]) if "memory" not in r.kept_in][:4]
        result = engine.generate(rag_prompt(demoted), max_new_tokens=1)
        assert result.documents_found == len(demoted) and result.content_hit_tokens > 0
    finally:
        engine.clear_cache()
