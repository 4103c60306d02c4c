"""Soak of the OpenAI-compatible server under storage faults: a slow disk tier, a Redis tier
paused for writes, concurrent clients and clients that hang up.

What it measures (issue 54, "nothing lost or held under faults"): the server runs in this
process (uvicorn in a thread, :class:`kvboost_rag.server.BackgroundServer`) over an engine on
the embedded model with default settings except two tiers made to misbehave:

- a disk tier (``disk_cache_dir``: every entry written through) whose every ``put`` sleeps
  ``--disk-put-ms`` (50 ms) first;
- a Redis tier (``redis_url``, a local ``redis-server``) paused for writes
  (``CLIENT PAUSE <ms> WRITE``) for ``--pause-ms`` every ``--pause-every`` seconds.

A pool of documents of Python's reference (``pydoc_data.topics``) is warmed first through
``POST /v1/documents``; ``--requests`` RAG chat requests (system prompt, ``--docs`` documents
of the pool in random order, or ``--docs`` to ``--max-docs`` of them for requests of different
lengths, a question; greedy, ``--tokens`` new tokens) are answered one at a time first (the
reference). Then rounds run until ``--minutes`` have passed: ``--clients``
clients at once, most repeating one of the reference requests (about half streamed), a share
(``--novel-share``) sending new prompts that name new documents in ``documents`` (stored after
the answer: the writes that meet the faults), a share (``--hang-up-share``) sending new prompts
of pool documents streamed and hanging up after their first ``--hang-up-events`` events, and
``--warm-per-round`` new documents warmed through the server beside them. After each round it
prints: elapsed seconds, the process's resident memory once the engine is idle (``VmRSS``), the memory tier's bytes
(``cache_stats().memory_bytes``: it grows as new documents are stored), entries staged,
documents known, requests answered, answers equal to their one-at-a-time answer, clients that
hung up, requests lost. ``--novel-share 0 --warm-per-round 0`` makes a steady workload (nothing
new to store after the first rounds), where resident memory should stay flat. At the end,
after ``engine.flush()``:

- resident memory at the end against after round 1 (target: within 5%), also less the
  memory tier's bytes, and against after round 2 (a steady load: within 2%);
- entries left staged (target 0);
- every document ``POST /v1/documents`` acknowledged (not in its ``failures``) found by the
  engine (``is_document_warm``), by a new prompt (its K/V loaded: ``content_hit_tokens``), and
  by fresh engines over the disk folder alone and over Redis alone (what each tier holds);
- answers of the concurrent rounds equal to the one-at-a-time answers (greedy).

The memory figures come from ``engine.cache_stats()`` and, read live before it flushes, the
write-back's holders (:func:`memory_figures`); it and :class:`SlowDiskPuts` (the tier stack,
``internals(engine).tiers``, :mod:`kvboost_rag.dev.internals`) are the only places that read the engine's internals.

Run (torch on ``--threads`` threads, 2 by default)::

    python bench/fault_soak.py --quick                       # smoke check, about a minute
    python bench/fault_soak.py --minutes 3 --out bench/results/fault_soak.md

Needs ``redis-server`` and ``redis-cli`` (Debian's ``redis-server`` package) and the server's
extras (``pip install 'kvboost-rag[server,redis]'``).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

logger = logging.getLogger("fault_soak")

SYSTEM = ("You are a precise assistant for Python programmers. Answer the question using only the reference "
          "documents below, and keep the answer short.")
QUESTIONS = (
    "What do these documents say about statement number {i}?",
    "Which exceptions can be raised here, and when? (question {i})",
    "Summarize the key rule of these documents in one sentence. ({i})",
    "Give a short example that follows these rules ({i}).",
)
#: Settings of ``--quick``: a smoke check of the whole path in about a minute.
QUICK = {"minutes": 0.3, "docs": 2, "doc_chars": 500, "pool": 8, "requests": 12, "tokens": 16,
         "pause_every": 6.0, "pause_ms": 2000, "warm_per_round": 1}


# ---------------------------------------------------------------------- figures of the process
def rss_mib() -> float:
    """Resident memory of this process (``VmRSS`` of ``/proc/self/status``), in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def idle_rss_mib(engine: Any, timeout: float = 10.0) -> float:
    """Resident memory once the engine is idle: its loop's thread has ended (and handed the C
    heaps' free memory back, :mod:`kvboost_rag.c_heap`), or after ``timeout`` seconds. Read
    at once, the figure would depend on whether the sample fell before or after that."""
    from kvboost_rag.dev.internals import internals

    loop, deadline = internals(engine).loop, time.monotonic() + timeout
    while loop.active and time.monotonic() < deadline:
        time.sleep(0.05)
    return rss_mib()


def memory_figures(engine: Any) -> dict[str, Any]:
    """What the engine holds now (read live, before ``cache_stats()`` flushes the queued
    writes), then documents known and the memory tier's bytes from ``cache_stats()``.

    Args:
        engine: The engine.

    Returns:
        ``staged_entries``, ``lent_bytes`` (K/V buffers lent to requests or held by their
        write-backs), ``idle_buffer_bytes`` (K/V buffers the host pool keeps for the next
        requests), ``queued_bytes`` (both write-back queues), ``arena_bytes``,
        ``documents``, ``memory_tier_bytes`` (``memory_bytes``: the memory tier's entries and
        indexes), ``stats_ms`` (how long ``cache_stats()`` took: it waits for queued writes)
        and the ``memory.*`` items of ``cache_stats().memory`` after it.
    """
    from kvboost_rag.dev.internals import internals
    from kvboost_rag.results import KVMemory

    parts = internals(engine)
    live = parts.cache.memory_account(KVMemory())
    pool = parts.host_buffers
    figures: dict[str, Any] = {
        "staged_entries": live.staged_entries,
        "lent_bytes": 0 if pool is None else pool.lent_bytes,
        "idle_buffer_bytes": 0 if pool is None else pool.idle_bytes,
        "queued_bytes": live.copy_queue_bytes + live.write_queue_bytes,
        "arena_bytes": live.arena_bytes,
    }
    start = time.perf_counter()
    stats = engine.cache_stats()
    figures.update({"stats_ms": (time.perf_counter() - start) * 1000, "documents": stats.documents,
                    "memory_tier_bytes": stats.memory_bytes})
    figures.update({f"memory.{name}": value for name, value in stats.memory.model_dump().items() if name != "limits"})
    return figures


class WarningCount(logging.Handler):
    """Counts the library's warnings (a slow or paused tier logs them) and keeps the first few."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count, self.first = 0, []

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1
        if len(self.first) < 5:
            self.first.append(f"{record.name}: {record.getMessage()[:200]}")


# ---------------------------------------------------------------------- the faults
class SlowDiskPuts:
    """Every ``put`` of the engine's disk tier sleeps ``delay`` seconds first.

    Args:
        engine: The engine; its tier stack (``internals(engine).tiers``) must hold a disk tier.
        delay: Seconds added to each put.

    Raises:
        SystemExit: No disk tier, or one that only takes what memory evicts.
    """

    def __init__(self, engine: Any, delay: float) -> None:
        from kvboost_rag.dev.internals import internals

        disks = [tier for tier in internals(engine).tiers if tier.name == "disk"]
        if not disks or disks[0].spill_only:
            raise SystemExit("no write-through disk tier in the engine's tier stack (disk_cache_dir set?)")
        self.tier, self.delay, self.calls = disks[0], delay, 0
        self._lock = threading.Lock()
        original = self.tier.put

        def slow_put(key: str, entry: Any) -> list[str]:
            time.sleep(self.delay)
            with self._lock:
                self.calls += 1
            return original(key, entry)

        self.tier.put = slow_put


class RedisPauser:
    """A thread that pauses a Redis server's writers (``CLIENT PAUSE ms WRITE``) every
    ``every`` seconds until stopped.

    Args:
        port: The server's port on 127.0.0.1.
        every: Seconds between the starts of two pauses.
        pause_ms: Milliseconds each pause lasts.
    """

    def __init__(self, port: int, every: float, pause_ms: int) -> None:
        from kvboost_rag.dev.redis_local import find_binary

        self.command = [find_binary("redis-cli"), "-p", str(port), "CLIENT", "PAUSE", str(pause_ms), "WRITE"]
        self.every, self.pause_ms, self.pauses, self.failed = every, pause_ms, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="redis-pauser", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every / 2 if self.pauses == 0 else self.every):
            done = subprocess.run(self.command, capture_output=True, text=True, timeout=10)
            if done.returncode == 0 and "OK" in done.stdout:
                self.pauses += 1
            else:
                self.failed += 1
                logger.warning("CLIENT PAUSE failed: %s %s", done.stdout.strip(), done.stderr.strip())

    def start(self) -> RedisPauser:
        """Start pausing (the first pause after ``every / 2`` seconds)."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop pausing, and wait until the last pause is over."""
        self._stop.set()
        self._thread.join()
        time.sleep(self.pause_ms / 1000)


# ---------------------------------------------------------------------- the clients
@dataclass
class Reply:
    """One request as its client saw it."""

    text: str = ""
    status: int = 0
    events: int = 0
    hung_up: bool = False
    error: str = ""
    figures: dict[str, Any] = field(default_factory=dict)

    @property
    def lost(self) -> bool:
        """The request was answered with an error (a client that hung up is not lost)."""
        return not self.hung_up and (self.status != 200 or bool(self.error))


def chat_body(model: str, messages: list[dict[str, str]], tokens: int, stream: bool) -> dict[str, Any]:
    """A greedy chat completion request."""
    return {"model": model, "messages": messages, "max_tokens": tokens, "temperature": 0.0, "stream": stream}


def rag_messages(docs: list[str], question: str, system: str = SYSTEM) -> list[dict[str, str]]:
    """System prompt with the documents, then the question."""
    return [{"role": "system", "content": system + "\n\n" + "\n\n".join(docs)}, {"role": "user", "content": question}]


async def _read_stream(response: httpx.Response, reply: Reply, hang_up_after: int | None) -> None:
    """Read a stream's events into ``reply``; leave after ``hang_up_after`` content events."""
    async for line in response.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        if "error" in event:
            reply.error = str(event["error"].get("message", event["error"]))[:200]
            continue
        for choice in event.get("choices", []):
            reply.text += choice.get("delta", {}).get("content") or ""
            reply.figures = choice.get("kvboost") or reply.figures
        reply.events += 1
        if hang_up_after is not None and reply.events >= hang_up_after:
            reply.hung_up = True
            return  # leaving the block closes the connection: the client hung up


async def chat(session: httpx.AsyncClient, body: dict[str, Any], hang_up_after: int | None = None) -> Reply:
    """One chat completion, streamed or not; with ``hang_up_after``, the client closes the
    connection after that many events."""
    reply = Reply()
    try:
        if not body["stream"]:
            response = await session.post("/chat/completions", json=body)
            reply.status = response.status_code
            data = response.json()
            if response.status_code != 200:
                reply.error = str(data.get("error", data))[:200]
                return reply
            choice = data["choices"][0]
            reply.text, reply.figures = choice["message"]["content"] or "", choice.get("kvboost") or {}
            return reply
        async with session.stream("POST", "/chat/completions", json=body) as response:
            reply.status = response.status_code
            await _read_stream(response, reply, hang_up_after)
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
        reply.error = f"{type(exc).__name__}: {exc}"[:200]
    return reply


async def warm(session: httpx.AsyncClient, docs: dict[str, str]) -> list[str]:
    """Warm ``docs`` (id -> text) through ``POST /v1/documents``; the ids it acknowledged
    (every one sent unless the call failed or names it in ``failures``)."""
    try:
        response = await session.post("/documents", json={"documents": [{"id": k, "text": v} for k, v in docs.items()]})
    except httpx.HTTPError as exc:
        logger.warning("POST /v1/documents failed: %s", exc)
        return []
    if response.status_code != 200:
        logger.warning("POST /v1/documents answered %d: %s", response.status_code, response.text[:200])
        return []
    report = response.json()
    failed = {failure["id"] for failure in report.get("failures", [])}
    skipped = report.get("empty", 0) + report.get("oversized", 0)
    if skipped:
        logger.warning("POST /v1/documents skipped %d documents (empty or oversized)", skipped)
    return [doc_id for doc_id in docs if doc_id not in failed]


# ---------------------------------------------------------------------- the workload
@dataclass
class RoundRow:
    """What one round did, and the figures sampled after it."""

    number: int
    elapsed_s: float
    wall_s: float
    rss_mib: float
    figures: dict[str, Any]
    answered: int
    same: int
    compared: int
    hung_up: int
    lost: int
    warmed: int
    pauses: int
    disk_puts: int


class Soak:
    """The engine, its server, the faults and the workload of one run.

    Args:
        args: The command line.
        engine: The engine the server serves.
        url: The server's OpenAI base URL.
        disk: The slowed disk tier.
        redis_port: The Redis server's port (its writers are paused now and then).
    """

    def __init__(self, args: argparse.Namespace, engine: Any, url: str, disk: SlowDiskPuts, redis_port: int) -> None:
        from kvboost_rag.corpus import python_reference_documents

        self.args, self.engine, self.url, self.disk, self.redis_port = args, engine, url, disk, redis_port
        self.model = engine.model_name
        corpus = python_reference_documents(max_chars=args.doc_chars)
        corpus = [doc for doc in corpus if len(doc) >= args.doc_chars // 2]  # no stubs
        self.rng = random.Random(args.seed)
        self.rng.shuffle(corpus)
        self.pool = corpus[: args.pool]
        self.spare = corpus[args.pool :] or corpus  # new texts of the rounds (each made unique)
        self.acked: dict[str, str] = {}  # documents POST /v1/documents acknowledged: id -> text
        self.requests = [
            rag_messages(self.rng.sample(self.pool, self.rng.randint(args.docs, max(args.docs, args.max_docs or 0))),
                         QUESTIONS[i % len(QUESTIONS)].format(i=i))
            for i in range(args.requests)
        ]
        self.reference: list[str] = []
        self.rows: list[RoundRow] = []
        self.pauser: RedisPauser | None = None
        self.new_texts = 0

    def session(self, clients: int) -> httpx.AsyncClient:
        """A client session; no kept-alive connections, so a client that leaves closes its own."""
        limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=0)
        return httpx.AsyncClient(base_url=self.url, timeout=httpx.Timeout(1200.0), limits=limits)

    def new_text(self) -> str:
        """A document no client sent before: the next spare text of the corpus behind a first
        line that makes it unique (at its start, so no chunk of it was stored before, even when
        the spare texts come round again)."""
        self.new_texts += 1
        return f"(soak document {self.new_texts})\n{self.spare[self.new_texts % len(self.spare)]}"

    def next_warm_batch(self, number: int) -> dict[str, str]:
        """New documents to warm beside round ``number`` (ids name the round)."""
        return {f"round{number}-doc{k}": self.new_text() for k in range(self.args.warm_per_round)}

    async def ingest_and_reference(self) -> float:
        """Warm the pool, then answer every request one at a time (non-streamed); seconds taken
        by the reference answers."""
        async with self.session(1) as session:
            docs = {f"pool-doc{k}": text for k, text in enumerate(self.pool)}
            for doc_id in await warm(session, docs):
                self.acked[doc_id] = docs[doc_id]
            start = time.perf_counter()
            for messages in self.requests:
                reply = await chat(session, chat_body(self.model, messages, self.args.tokens, stream=False))
                if reply.lost:
                    raise SystemExit(f"a reference request failed: {reply.status} {reply.error}")
                self.reference.append(reply.text)
        return time.perf_counter() - start

    def novel_body(self, number: int, k: int, stream: bool, new_docs: int) -> dict[str, Any]:
        """A prompt no client sent before: ``--docs`` documents in random order, ``new_docs`` of
        them new texts named in the request's ``documents`` field (stored after the answer, as a
        RAG request's newly retrieved documents are), the others from the pool."""
        args = self.args
        new = [self.new_text() for _ in range(new_docs)]
        docs = self.rng.sample(self.pool, args.docs - len(new)) + new
        self.rng.shuffle(docs)
        body = chat_body(self.model, rag_messages(docs, f"Round {number}, client {k}: explain these."), args.tokens,
                         stream)
        if new:
            body["documents"] = new
        return body

    def clients_of_round(self, number: int) -> list[tuple[int | None, dict[str, Any], int | None]]:
        """Round ``number``'s clients: (reference index or ``None``, body, events before hanging
        up or ``None``). Hang-ups and ``--novel-share`` send new prompts; the others repeat a
        reference request, about half of them streamed. Only the novel clients' prompts hold
        new documents: with ``--novel-share 0 --warm-per-round 0`` nothing new is stored after
        the first rounds (a steady workload)."""
        args = self.args
        leaving = round(args.clients * args.hang_up_share)
        novel = round(args.clients * args.novel_share)
        clients: list[tuple[int | None, dict[str, Any], int | None]] = []
        for k in range(args.clients - leaving - novel):
            i = self.rng.randrange(len(self.requests))
            clients.append((i, chat_body(self.model, self.requests[i], args.tokens, self.rng.random() < 0.5), None))
        new_docs = args.docs // 2
        clients += [(None, self.novel_body(number, k, self.rng.random() < 0.5, new_docs), None) for k in range(novel)]
        clients += [(None, self.novel_body(number, novel + k, True, 0), args.hang_up_events) for k in range(leaving)]
        return clients

    async def run_round(self, number: int, soak_start: float) -> RoundRow:
        """One round: the clients at once and a warm of new documents beside them; then the
        figures."""
        clients = self.clients_of_round(number)
        batch = self.next_warm_batch(number)
        start = time.perf_counter()
        async with self.session(len(clients) + 1) as session:
            replies, acked = await asyncio.gather(
                asyncio.gather(*[chat(session, body, hang_up_after=leave) for _, body, leave in clients]),
                warm(session, batch) if batch else asyncio.sleep(0, result=[]),
            )
        wall = time.perf_counter() - start
        self.acked.update({doc_id: batch[doc_id] for doc_id in acked})
        for reply in replies:
            if reply.lost:
                logger.warning("round %d: a request was lost: %s %s", number, reply.status, reply.error)
        compared = [(i, r) for (i, _, _), r in zip(clients, replies) if i is not None and not r.lost]
        figures = await asyncio.to_thread(memory_figures, self.engine)
        rss = await asyncio.to_thread(idle_rss_mib, self.engine)
        return RoundRow(
            number=number, elapsed_s=time.perf_counter() - soak_start, wall_s=wall, rss_mib=rss,
            figures=figures, answered=sum(not r.lost and not r.hung_up for r in replies),
            same=sum(r.text == self.reference[i] for i, r in compared), compared=len(compared),
            hung_up=sum(r.hung_up for r in replies), lost=sum(r.lost for r in replies), warmed=len(acked),
            pauses=self.pauser.pauses if self.pauser else 0, disk_puts=self.disk.calls,
        )

    async def rounds(self) -> None:
        """Rounds until ``--minutes`` have passed (at least ``--min-rounds``), the Redis tier
        paused for writes now and then meanwhile; a line per round."""
        self.pauser = RedisPauser(self.redis_port, self.args.pause_every, self.args.pause_ms).start()
        start = time.perf_counter()
        print(ROW_HEADER)
        try:
            number = 1
            while number <= self.args.min_rounds or time.perf_counter() - start < self.args.minutes * 60:
                row = await self.run_round(number, start)
                self.rows.append(row)
                print(row_line(row), flush=True)
                number += 1
        finally:
            self.pauser.stop()


ROW_HEADER = ("| round | elapsed s | round s | RSS MiB | memory tier MiB | arena MiB | lent MiB | idle buffers MiB | queued MiB | staged "
              "| documents | stats ms | answered | same as alone "
              "| hung up | lost | warmed | Redis pauses | disk puts |\n"
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def row_line(row: RoundRow) -> str:
    """A round as a Markdown table row."""
    f = row.figures
    return (f"| {row.number} | {row.elapsed_s:.1f} | {row.wall_s:.1f} | {row.rss_mib:.0f} | "
            f"{f['memory_tier_bytes'] / 2**20:.0f} | {f['arena_bytes'] / 2**20:.0f} | {f['lent_bytes'] / 2**20:.0f} | "
            f"{f['idle_buffer_bytes'] / 2**20:.0f} | {f['queued_bytes'] / 2**20:.0f} | {f['staged_entries']} | "
            f"{f['documents']} | {f['stats_ms']:.0f} | {row.answered} | {row.same}/{row.compared} | {row.hung_up} | "
            f"{row.lost} | {row.warmed} | {row.pauses} | {row.disk_puts} |")


# ---------------------------------------------------------------------- after the rounds
async def found_by_prompts(soak: Soak) -> int:
    """Acknowledged documents whose K/V a new prompt loads: each alone behind a system prompt
    no earlier prompt began with (so no prefix hit covers it), one new token; found when the
    prompt finds the document and loads some of its tokens (``content_hit_tokens``)."""
    found = 0
    async with soak.session(1) as session:
        for k, (doc_id, text) in enumerate(soak.acked.items()):
            system = f"Check {k} of the soak: answer from this document."
            body = chat_body(soak.model, rag_messages([text], "What is it about?", system), 1, stream=False)
            reply = await chat(session, body)
            figures = reply.figures
            if figures.get("documents_found", 0) >= 1 and figures.get("content_hit_tokens", 0) > 0:
                found += 1
            else:
                logger.warning("document %s not loaded by a new prompt: %s %s", doc_id, reply.error, figures)
    return found


def found_by_fresh_engine(texts: list[str], **settings: Any) -> int:
    """Documents among ``texts`` a fresh engine over one tier (``settings``) finds stored
    (``is_document_warm``: their records and every chunk; reads only)."""
    from kvboost_rag import KVBoost

    engine = KVBoost.from_pretrained(small_row_kernels="off", captured_steps="off", show_progress=False, **settings)
    try:
        return sum(engine.is_document_warm(text) for text in texts)
    finally:
        del engine
        gc.collect()


def settle(soak: Soak) -> dict[str, Any]:
    """``engine.flush()``, then what is left: staged entries, resident memory, documents the
    engine holds (``is_document_warm``)."""
    start = time.perf_counter()
    flushed = soak.engine.flush(timeout=soak.args.flush_timeout)
    flush_s = time.perf_counter() - start
    gc.collect()
    figures = memory_figures(soak.engine)
    texts = list(soak.acked.values())
    return {"flushed": flushed, "flush_s": flush_s, "rss_mib": idle_rss_mib(soak.engine), "figures": figures,
            "engine_found": sum(soak.engine.is_document_warm(text) for text in texts),
            "tiers": soak.engine.cache_stats().tiers}


# ---------------------------------------------------------------------- the report
def _summary_rows(soak: Soak, end: dict[str, Any], checks: dict[str, Any], warnings: WarningCount) -> list[str]:
    """The end-of-run checks as Markdown table rows (check, value, target)."""
    rows, acked = soak.rows, len(soak.acked)
    first, ratio = rows[0].rss_mib, end["rss_mib"] / rows[0].rss_mib
    second = rows[min(1, len(rows) - 1)].rss_mib
    tier_first, tier_end = rows[0].figures["memory_tier_bytes"] / 2**20, end["figures"]["memory_tier_bytes"] / 2**20
    rest_first, rest_end = first - tier_first, end["rss_mib"] - tier_end
    same, compared = sum(r.same for r in rows), sum(r.compared for r in rows)
    pauser = soak.pauser
    memory = {k: v for k, v in end["figures"].items() if k.startswith("memory.")}
    lines = [
        f"| resident memory after round 1 / at the end | {first:.0f} / {end['rss_mib']:.0f} MiB ({ratio:.3f}x) | "
        "within 5% |",
        f"| ... less the memory tier's bytes ({tier_first:.0f} / {tier_end:.0f} MiB) | {rest_first:.0f} / "
        f"{rest_end:.0f} MiB ({rest_end / rest_first:.3f}x) | - |",
        f"| resident memory after round 2 / at the end | {second:.0f} / {end['rss_mib']:.0f} MiB "
        f"({end['rss_mib'] / second:.3f}x) | within 2% (a steady load) |",
        f"| entries staged after `flush()` | {end['figures']['staged_entries']} (flush {end['flush_s']:.2f} s, "
        f"returned {end['flushed']}) | 0 |",
        f"| documents acknowledged by `POST /v1/documents`, found by the engine | {end['engine_found']}/{acked} "
        "| all |",
        f"| ... loaded by a new prompt (content hit) | {checks['prompt_found']}/{acked} | all |",
        f"| ... found by a fresh engine over the disk folder alone | {checks['disk_found']}/{acked} | all |",
        f"| ... found by a fresh engine over Redis alone | {checks['redis_found']}/{acked} | - (Redis errors are "
        "skipped by design) |",
        f"| answers equal to their one-at-a-time answer | {same}/{compared} | all |",
        f"| requests lost (error or not 200) | {sum(r.lost for r in rows)} | 0 |",
        f"| clients that hung up | {sum(r.hung_up for r in rows)} | - |",
        f"| disk puts, each slowed {soak.args.disk_put_ms} ms | {soak.disk.calls} | - |",
        f"| Redis write pauses of {soak.args.pause_ms} ms (failed to pause) | {pauser.pauses} ({pauser.failed}) | - |",
        f"| library warnings logged | {warnings.count} | - |",
    ]
    lines += [f"| `cache_stats().{name}` after `flush()` | {value} | - |" for name, value in memory.items()]
    return lines


def doc_range(args: argparse.Namespace) -> str:
    """Documents per repeated request: ``--docs``, or ``--docs``-``--max-docs``."""
    return f"{args.docs}-{args.max_docs}" if (args.max_docs or 0) > args.docs else str(args.docs)


def report(soak: Soak, end: dict[str, Any], checks: dict[str, Any], warnings: WarningCount, head: list[str]) -> str:
    """The Markdown report: how it ran, a row per round, the checks at the end."""
    args = soak.args
    leaving, novel = round(args.clients * args.hang_up_share), round(args.clients * args.novel_share)
    compared = args.clients - leaving - novel
    lines = [
        "# Soak of the server under storage faults (issue 54)", "",
        f"Command: `python bench/fault_soak.py {' '.join(sys.argv[1:])}`", "", *head, "",
        f"{args.clients} clients at once per round: {compared} repeat one of {args.requests} RAG chat requests of "
        f"{doc_range(args)} documents ({args.doc_chars} characters at most, from a pool of {args.pool} warmed through "
        f"`POST /v1/documents`), about half streamed; {novel} send new prompts whose {args.docs // 2} new documents "
        f"are named in `documents` (stored after the answer); {leaving} send new prompts of pool documents streamed "
        "and hang up after "
        f"{args.hang_up_events} events. Greedy, {args.tokens} new tokens; {args.warm_per_round} new documents warmed "
        f"beside each round. Faults: every disk put slowed {args.disk_put_ms} ms; Redis paused for writes "
        f"{args.pause_ms} ms every {args.pause_every:g} s. Times: {checks['times']}.", "",
        ROW_HEADER, *[row_line(row) for row in soak.rows], "",
        "After each round: arena, lent buffers, queued write-backs and staged entries read live, then `documents` and "
        "the memory tier from `cache_stats()` (`stats ms`: its wait for queued writes).",
        "", "| check | value | target |", "|---|---|---|", *_summary_rows(soak, end, checks, warnings), "",
    ]
    if warnings.first:
        lines += ["First library warnings:", "", *[f"- `{w}`" for w in warnings.first], ""]
    return "\n".join(lines)


def head_lines(args: argparse.Namespace, engine: Any) -> list[str]:
    """Machine, code and settings lines of the report."""
    import kvboost_rag
    from rag_bench import code_version, machine_line

    root = Path(kvboost_rag.__file__).resolve().parents[1]
    return [f"Machine: {machine_line()}", "",
            f"Code: bench {code_version()}; kvboost_rag {root} at {code_version(root, ('kvboost_rag',))}", "",
            f"Engine: {engine.model_name}, default settings but `disk_cache_dir` (a temporary folder) and `redis_url` "
            f"(a local redis-server); torch threads: {args.threads}; server in process (uvicorn in a thread)."]


# ---------------------------------------------------------------------- running it
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (``--quick`` makes :data:`QUICK`'s sizes the defaults)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"a smoke check of about a minute: {QUICK}")
    parser.add_argument("--minutes", type=float, default=3.0, help="rounds start until this long has passed")
    parser.add_argument("--min-rounds", type=int, default=2, help="rounds run at least")
    parser.add_argument("--clients", type=int, default=12, help="clients at once in a round")
    parser.add_argument("--hang-up-share", type=float, default=0.25, help="share of the clients that hang up")
    parser.add_argument("--novel-share", type=float, default=0.25,
                        help="share of the clients that send new prompts naming new documents (not compared)")
    parser.add_argument("--hang-up-events", type=int, default=2, help="events a leaving client reads first")
    parser.add_argument("--requests", type=int, default=24, help="distinct requests with a one-at-a-time answer")
    parser.add_argument("--docs", type=int, default=4, help="documents per request")
    parser.add_argument("--max-docs", type=int,
                        help="each repeated request takes --docs to this many documents (requests of different "
                             "lengths; default: --docs each)")
    parser.add_argument("--doc-chars", type=int, default=1200, help="characters per document at most")
    parser.add_argument("--pool", type=int, default=16, help="documents warmed before the rounds")
    parser.add_argument("--warm-per-round", type=int, default=2, help="new documents warmed beside each round")
    parser.add_argument("--tokens", type=int, default=40, help="new tokens per answer")
    parser.add_argument("--disk-put-ms", type=int, default=50, help="milliseconds added to every disk put")
    parser.add_argument("--pause-every", type=float, default=20.0, help="seconds between Redis write pauses")
    parser.add_argument("--pause-ms", type=int, default=3000, help="milliseconds each Redis write pause lasts")
    parser.add_argument("--flush-timeout", type=float, default=300.0, help="seconds the final flush may take")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="also write the Markdown report here")
    if parser.parse_args(argv).quick:
        parser.set_defaults(**QUICK)  # sizes given on the command line still win
    return parser.parse_args(argv)


def run(args: argparse.Namespace, redis_url: str, redis_port: int, disk_dir: str, warnings: WarningCount) -> str:
    """Build the engine and its server, soak it, check what is left; the report."""
    from kvboost_rag import KVBoost
    from kvboost_rag.server import BackgroundServer

    start = time.perf_counter()
    engine = KVBoost.from_pretrained(disk_cache_dir=disk_dir, redis_url=redis_url, show_progress=False)
    disk = SlowDiskPuts(engine, args.disk_put_ms / 1000)
    server = BackgroundServer(engine).start()
    soak = Soak(args, engine, server.url, disk, redis_port)
    times = {"load": time.perf_counter() - start}
    try:
        times["reference answers"] = asyncio.run(soak.ingest_and_reference())
        print(f"reference: {len(soak.reference)} answers one at a time in {times['reference answers']:.1f} s; "
              f"{len(soak.acked)} documents acknowledged; torch threads {args.threads}", flush=True)
        start = time.perf_counter()
        asyncio.run(soak.rounds())
        times["rounds"] = time.perf_counter() - start
        start = time.perf_counter()
        end = settle(soak)
        checks: dict[str, Any] = {"prompt_found": asyncio.run(found_by_prompts(soak))}
    finally:
        server.stop()
    texts = list(soak.acked.values())
    checks["disk_found"] = found_by_fresh_engine(texts, disk_cache_dir=disk_dir, redis_url=None)
    checks["redis_found"] = found_by_fresh_engine(texts, disk_cache_dir=None, redis_url=redis_url)
    times["checks"] = time.perf_counter() - start
    checks["times"] = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in times.items())
    return report(soak, end, checks, warnings, head_lines(args, engine))


def main(argv: list[str] | None = None) -> str:
    """Run the soak; print the report (and write it to ``--out``)."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import torch

    from kvboost_rag.dev.redis_local import start_server

    torch.set_num_threads(args.threads)
    warnings = WarningCount()
    logging.getLogger("kvboost_rag").addHandler(warnings)
    redis = start_server()
    disk_dir = tempfile.mkdtemp(prefix="fault-soak-disk-")
    try:
        text = run(args, redis.url, redis.port, disk_dir, warnings)
    finally:
        redis.stop()
        shutil.rmtree(redis.folder, ignore_errors=True)
        shutil.rmtree(disk_dir, ignore_errors=True)
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return text


if __name__ == "__main__":
    main()
