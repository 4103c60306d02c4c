"""Faults injected into the tiers under concurrent requests: nothing lost, nothing held.

As SQLite's test suite injects a fault at every I/O call in turn, the memory and disk tiers are
wrapped so that every ``EVERY``-th call of theirs (one offset per round, so that over the rounds
every call in turn fails) raises an exception of some kind, or sleeps. Eight threads ask exact
prefix-reuse prompts (a shared beginning, one of a few documents, a question) and a ninth warms
documents, all at once. After each round, with the faults off:

- every call returned, and every answer's first-token logits equal full prefill's (an entry
  served for a key it was not computed for would not);
- no entry is staged, every lent buffer went back and its bytes are no longer counted, and
  both write-back queues are empty;
- every document a warm reported as kept is warm after ``flush``;
- ``clear_cache`` leaves no entry and gives the arena's memory back.

Further tests: a blocked tier holds no lent buffer (its writes wait as counted host copies);
``clear_cache`` while a write is inside a tier puts nothing back; a write-back refused at
submit leaves its answer, nothing staged and the buffers back; a request finishing in a thread
the script never joined still gets its answer and its write at exit.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from rag_prompts import SYSTEM_PROMPT


from kvboost_rag.cache.codec import KVBlock, entry_in_place
from kvboost_rag.cache.storage import DiskTier, MemoryTier, TieredStore
from kvboost_rag.cache.storage.base import TierWriteError
from kvboost_rag.corpus import python_reference_documents
from kvboost_rag.dev.threads import wait_for
from kvboost_rag.prefill.prefiller import SPARE_ROWS
from kvboost_rag.results import KVMemory

DOCS = python_reference_documents(max_chars=260)[:40]
PREFIX_DOCS = DOCS[:4]
QUESTIONS = ("What is it?", "Name one rule.", "Give an example.")
PROMPTS = [f"{SYSTEM_PROMPT}\n\n{doc}\n\nQuestion: {q}\nAnswer:" for doc in PREFIX_DOCS for q in QUESTIONS]
#: Every EVERY-th call of a wrapped tier faults (from the round's offset).
EVERY = 5
#: Methods of a tier the faults are injected into.
METHODS = ("get", "put", "put_many", "delete", "__contains__", "keys", "keys_with_prefix", "pin", "reserve")
ATOL = 1e-4


class InjectedFault(Exception):
    """A failure no tier expects."""


class Faults:
    """Every ``every``-th call (counted over every wrapped method) from ``offset`` raises
    ``error`` or sleeps ``sleep`` seconds, while ``on``."""

    def __init__(self, every: int, offset: int, error: Exception | None = None, sleep: float = 0.0) -> None:
        self.every, self.offset, self.error, self.sleep = every, offset, error, sleep
        self.on, self.calls, self.injected = True, 0, 0
        self._lock = threading.Lock()

    def hit(self) -> None:
        with self._lock:
            n, self.calls = self.calls, self.calls + 1
            fault = self.on and n % self.every == self.offset
            self.injected += fault
        if fault and self.sleep:
            time.sleep(self.sleep)
        elif fault and self.error is not None:
            raise type(self.error)(*self.error.args)  # a fresh one: no traceback kept here


def inject(tier, faults: Faults, methods: tuple[str, ...] = METHODS) -> None:
    """Make ``tier`` (keeping its class, for the store's checks) call ``faults.hit()`` first in
    each of ``methods``."""
    cls = type(tier)

    def wrapped(name: str):
        original = getattr(cls, name)

        def method(self, *args, **kwargs):
            faults.hit()
            return original(self, *args, **kwargs)

        return method

    tier.__class__ = type(f"Faulty{cls.__name__}", (cls,), {m: wrapped(m) for m in methods if hasattr(cls, m)})


def _references(engine) -> dict[str, torch.Tensor]:
    return {p: engine.generate(p, max_new_tokens=1, reuse=False, return_logits=True).first_token_logits for p in PROMPTS}


def _ask(engine, thread: int) -> list[tuple[str, torch.Tensor]]:
    """Three prompts of the thread's own rotation, streamed and not."""
    answers = []
    for i in range(3):
        prompt = PROMPTS[(thread * 3 + i) % len(PROMPTS)]
        if (thread + i) % 2:
            stream = engine.stream(prompt, max_new_tokens=3, return_logits=True)
            assert "".join(stream) is not None and stream.result is not None
            result = stream.result
        else:
            result = engine.generate(prompt, max_new_tokens=3, return_logits=True)
        answers.append((prompt, result.first_token_logits))
    return answers


def _round(engine, faults: Faults, warm_docs: list[str]) -> tuple[list[tuple[str, torch.Tensor]], list]:
    with ThreadPoolExecutor(9) as pool:
        asked = [pool.submit(_ask, engine, t) for t in range(8)]
        warmed = pool.submit(engine.warm_documents, warm_docs, False)
        answers = [answer for future in asked for answer in future.result(timeout=300)]
        warms = warmed.result(timeout=300)
    faults.on = False
    return answers, warms


def _assert_settled(engine, references, answers, warm_docs, warms) -> None:
    cache = engine._cache
    assert engine.flush(timeout=120)
    assert cache._store.staged_count == 0
    for prompt, logits in answers:
        assert torch.allclose(logits, references[prompt], atol=ATOL, rtol=0), (logits - references[prompt]).abs().max()
    memory = engine.cache_stats().memory
    assert memory.batch_buffers_bytes == 0 and engine._requests.memory.host_buffers.lent_bytes == 0
    assert memory.copy_queue_bytes == 0 and memory.write_queue_bytes == 0 and memory.staged_entries == 0
    for doc, warm in zip(warm_docs, warms):
        if warm.kept_in:
            assert engine.is_document_warm(doc), warm
    engine.clear_cache()
    after = engine.cache_stats().memory
    assert after.arena_used_bytes == 0 and after.arena_bytes == 0 and len(cache._store.memory_tier) == 0


FAULT_KINDS = [
    pytest.param(InjectedFault("injected"), 0.0, id="unexpected-error"),
    pytest.param(OSError(28, "No space left on device"), 0.0, id="os-error"),
    pytest.param(None, 0.02, id="slow-call"),
]


@pytest.mark.parametrize(("error", "sleep"), FAULT_KINDS)
def test_every_tier_call_in_turn_fails_under_concurrent_requests_and_nothing_is_lost_or_held(
    make_engine, tmp_path, error, sleep
):
    rounds = 0
    for offset in range(EVERY):
        engine = make_engine("llama", disk_cache_dir=tmp_path / f"kv{offset}", max_batch_size=8)
        references = _references(engine)
        faults = Faults(EVERY, offset, error=error, sleep=sleep)
        for tier in engine._cache._store.tiers:
            inject(tier, faults)
        warm_docs = DOCS[8 + 4 * offset : 12 + 4 * offset]
        answers, warms = _round(engine, faults, warm_docs)
        assert faults.injected > 0 and len(answers) == 24
        _assert_settled(engine, references, answers, warm_docs, warms)
        rounds += 1
    assert rounds == EVERY


def test_a_blocked_tier_holds_no_lent_buffer_and_its_writes_are_counted_where_they_wait(make_engine, tmp_path):
    """Every disk put waits at a gate: twelve calls at once all return, the copier copies
    their chunks and every lent buffer goes back while the writer is still held up (before,
    a queued write kept a request's whole buffers); the copies waiting are counted in the
    writer's queue, and once the gate opens they reach the disk."""
    engine = make_engine("llama", disk_cache_dir=tmp_path / "kv", max_batch_size=8)
    disk = next(t for t in engine._cache._store.tiers if isinstance(t, DiskTier))
    gate, original = threading.Event(), DiskTier.put
    disk.put = lambda key, entry: (gate.wait(120), original(disk, key, entry))[1]
    try:
        prompts = [f"{SYSTEM_PROMPT}\n\n{DOCS[20 + i]}\n\nQuestion: {i}?\nAnswer:" for i in range(12)]
        with ThreadPoolExecutor(12) as pool:
            results = list(pool.map(lambda p: engine.generate(p, max_new_tokens=2), prompts))
        assert all(r.generated_tokens for r in results)
        assert engine._cache.copier.flush(timeout=120)
        memory = engine._cache.memory_account(KVMemory())
        assert engine._requests.memory.host_buffers.lent_bytes == 0 and engine._places.held_bytes == 0
        assert not engine._cache.writer.idle and memory.write_queue_bytes > 0 and memory.copy_queue_bytes == 0
    finally:
        gate.set()
    assert engine.flush(timeout=120) and len(disk) > 0 and engine._cache._store.staged_count == 0


def test_behind_a_blocked_tier_lent_buffers_never_exceed_the_bytes_the_limits_allow(make_engine, tmp_path):
    """The write-back's queues shrunk to a pair of buffers, the batch's bytes to two pairs, every
    disk put held at a gate, twelve requests at once: sampled all along, the lent buffers never
    exceed the batch's bytes (lent buffers are counted until they are back: before, a finished
    request's buffers stopped being counted before the copier took them, and while the
    copier's queue was full or a lookup still read them, new requests were admitted against
    their bytes)."""
    prompts = [f"{SYSTEM_PROMPT}\n\n{DOCS[20 + i]}\n\nQuestion: {i}?\nAnswer:" for i in range(12)]
    probe = make_engine("llama")
    longest = max(probe.count_tokens(p) for p in prompts) + 2 + SPARE_ROWS
    pair = probe._requests.memory.reserved_bytes(longest)  # every prompt here fits one
    engine = make_engine("llama", disk_cache_dir=tmp_path / "kv", max_batch_size=8, max_batch_cache_bytes=2 * pair)
    engine.warm(SYSTEM_PROMPT)  # the shared beginning is stored before: no lookup views a lent buffer
    engine.flush(timeout=60)
    cache = engine._cache
    cache.copier.max_queued_bytes = cache.writer.max_queued_bytes = pair
    disk = next(t for t in cache._store.tiers if isinstance(t, DiskTier))
    gate, original = threading.Event(), DiskTier.put
    disk.put = lambda key, entry: (gate.wait(120), original(disk, key, entry))[1]
    lent: list[int] = []
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.is_set():
            lent.append(engine._requests.memory.host_buffers.lent_bytes)
            time.sleep(0.0005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        with ThreadPoolExecutor(12) as pool:
            futures = [pool.submit(engine.generate, p, max_new_tokens=2) for p in prompts]
            wait_for(lambda: engine._loop.waiting > 0 and not cache.writer.idle, bound=60)
            time.sleep(1.0)  # what is admitted behind the blocked tier is admitted by now
            gate.set()
            results = [f.result(timeout=120) for f in futures]
    finally:
        gate.set()
        sampling.set()
        sampler.join(10)
    assert all(r.generated_tokens for r in results)
    assert pair < max(lent) <= engine.settings.max_batch_cache_bytes, max(lent)
    assert engine.flush(timeout=120) and engine._requests.memory.host_buffers.lent_bytes == 0 and engine._places.held_bytes == 0


def _entry(value: float) -> object:
    keys = torch.full((2, 1, 4, 8), value)
    return entry_in_place(KVBlock(keys, keys.clone(), torch.arange(4), 0), fingerprint="f")


def test_clear_while_a_write_is_inside_a_tier_puts_nothing_back():
    """The memory tier's put of a staged entry waits at a gate; a clear from another thread
    waits for it, then removes it: no entry is left, none staged."""
    memory = MemoryTier(1 << 20)
    store = TieredStore([memory])
    entered, gate = threading.Event(), threading.Event()
    original = MemoryTier.put

    def gated_put(self, key, entry):
        entered.set()
        assert gate.wait(60)
        return original(self, key, entry)

    memory.put = gated_put.__get__(memory)
    staged = _entry(1.0)
    store.stage("k", staged)
    writer = threading.Thread(target=store.put_staged, args=("k", staged, staged))
    writer.start()
    assert entered.wait(60)
    cleared = threading.Thread(target=store.clear)
    cleared.start()
    cleared.join(0.2)
    assert cleared.is_alive()  # the clear waits for the write inside the tier
    gate.set()
    writer.join(60)
    cleared.join(60)
    assert len(memory) == 0 and store.staged_count == 0
    assert not store.put_staged("k", staged, staged)  # cleared: never put back


def test_a_tier_raising_at_put_leaves_nothing_staged_and_the_others_take_the_entry(tmp_path):
    memory, disk = MemoryTier(1 << 20), DiskTier(tmp_path, 1 << 20)
    store = TieredStore([memory, disk])
    inject(memory, Faults(1, 0, error=InjectedFault("put")), methods=("put",))
    staged = _entry(2.0)
    store.stage("key1", staged)
    with pytest.raises(TierWriteError, match="memory tier: InjectedFault"):
        store.put_staged("key1", staged, staged)
    assert store.staged_count == 0 and "key1" in disk and "key1" not in memory


def test_a_write_back_refused_at_submit_leaves_its_answer_nothing_staged_and_the_buffers_back(make_engine, monkeypatch):
    engine = make_engine("llama")
    references = _references(engine)

    def refuse(job, nbytes=0):
        raise InjectedFault("no room")

    monkeypatch.setattr(engine._cache.copier, "submit", refuse)
    result = engine.generate(PROMPTS[0], max_new_tokens=3, return_logits=True)
    assert result.generated_tokens == 3
    assert engine._cache._store.staged_count == 0 and engine._requests.memory.host_buffers.lent_bytes == 0
    assert engine.cache_stats().memory.batch_buffers_bytes == 0
    monkeypatch.undo()
    again = engine.generate(PROMPTS[0], max_new_tokens=1, return_logits=True)
    assert again.prefix_hit_tokens == 0  # nothing of the refused write was kept
    assert torch.allclose(again.first_token_logits, references[PROMPTS[0]], atol=ATOL, rtol=0)


EXIT_SCRIPT = """
import sys, threading
from kvboost_rag.dev.testing import tiny_engine
engine = tiny_engine("llama", disk_cache_dir=sys.argv[1], chunk_size=32, show_progress=False)
out = open(sys.argv[2], "w")
prompt = "Some shared beginning of a prompt, long enough for a chunk or two of tokens. " * 4 + "Q?"

def ask():
    result = engine.generate(prompt, max_new_tokens=4)
    out.write(f"{result.generated_tokens}\\n")
    out.flush()

threading.Thread(target=ask).start()  # never joined: the script ends at once
"""


@pytest.mark.slow
def test_a_request_finishing_while_the_script_exits_gets_its_answer_and_its_write(tmp_path):
    folder, answer = tmp_path / "kv", tmp_path / "answer.txt"
    script = tmp_path / "exit.py"
    script.write_text(textwrap.dedent(EXIT_SCRIPT))
    done = subprocess.run([sys.executable, str(script), str(folder), str(answer)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert answer.read_text().strip() == "4"
    assert "RuntimeError" not in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert any(folder.rglob("*.kv*")) or sum(1 for p in folder.rglob("*") if p.is_file()) > 0
