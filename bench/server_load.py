"""Load bench of ``kvboost-rag serve``: many clients at once, clients that hang up, and open
streams while other requests prefill or a corpus warms.

The server runs as a new user runs it (``kvboost-rag serve``, default settings, the embedded
model unless ``--model``) in a process of its own, or ``--url`` names one already running.
Requests are RAG chat completions: a system prompt with ``--docs`` documents of Python's
reference (``--doc-chars`` characters each) and a question, greedy, ``--tokens`` new tokens,
every other one streamed. A pool of documents is warmed first through ``POST /v1/documents``
(ingest); the requests take their documents from it. Printed in one run:

1. **Rounds.** The same ``--requests`` requests one after another, then all at once: wall
   time, generated tokens per second, time to first token p50/p99 (streamed requests, from the
   request to its first content piece), the longest pause between two pieces of one stream,
   and how many concurrent answers equal their one-at-a-time answers.
2. **Hang-ups.** A probe request alone on the idle server (after one untimed run of it), then
   ``--requests`` streaming clients that hang up right after their first event (``--hang-up-after``
   seconds: a client reading it), and the probe
   at once after them: its time against its idle time. Then a round with clients hanging up:
   the ``--requests`` requests at once beside as many clients that hang up after their first
   event (the same figures as 1, for the requests that stay).
3. **Streams beside prompt work.** First, on the idle server, a request whose ``--docs``
   documents are new (never warmed): its time to first token and to its last token. Then
   ``--streams`` streams kept open (one restarts when one ends), their decode step measured as
   the median gap between pieces; a request of the same shape (``--docs`` other new documents)
   is sent beside them, and, later, ``--warm-docs`` new documents warm through
   ``POST /v1/documents``. The longest gap between two pieces of one stream during each,
   against the step, and the new request's times against its idle twin's.

Run: ``python bench/server_load.py`` (about 5 minutes on a 2-core CPU); ``--out FILE`` writes
the table too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rag_bench import code_version, machine_line, percentile

from kvboost_rag.corpus import python_reference_documents

SYSTEM = ("You are a precise assistant for Python programmers. Answer the question using only the reference "
          "documents below, and keep the answer short.")
#: Pieces arriving this close together came from one decode step (a step can accept drafts).
SAME_STEP_S = 0.004


@dataclass
class Reply:
    """One request as its client saw it."""

    text: str = ""
    sent: float = 0.0
    first: float | None = None
    done: float | None = None
    arrivals: list[float] = field(default_factory=list)
    tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    document_hit_tokens: int = 0
    prefix_hit_tokens: int = 0
    status: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.sent

    @property
    def longest_pause(self) -> float:
        """Longest gap between two content pieces (seconds; 0 with fewer than two)."""
        return max((b - a for a, b in zip(self.arrivals, self.arrivals[1:])), default=0.0)

    def read_event(self, event: dict[str, Any]) -> None:
        """Take one streamed event: its content piece (timed), the usage it reports and
        kvboost-rag's counts of prompt tokens read from stored documents and by an exact prefix hit."""
        usage = event.get("usage") or {}
        if usage:
            self.prompt_tokens = usage.get("prompt_tokens", self.prompt_tokens)
            self.tokens = usage.get("completion_tokens", self.tokens)
            self.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        figures = event["choices"][0].get("kvboost") if event.get("choices") else None
        if figures:
            self.document_hit_tokens = figures.get("content_hit_tokens", 0)
            self.prefix_hit_tokens = figures.get("prefix_hit_tokens", 0)
        content = event["choices"][0]["delta"].get("content") if event.get("choices") else None
        if content:
            now = time.perf_counter()
            self.first = self.first or now
            self.arrivals.append(now)
            self.text += content

    def step_pairs(self) -> list[tuple[float, float]]:
        """When two consecutive decode steps of this stream arrived (pieces of one step merged)."""
        steps = [t for i, t in enumerate(self.arrivals) if i == 0 or t - self.arrivals[i - 1] > SAME_STEP_S]
        return list(zip(steps, steps[1:]))

    def gaps(self) -> list[float]:
        """Gaps between decode steps of this stream."""
        return [b - a for a, b in self.step_pairs()]


def messages(docs: list[str], question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM + "\n\n" + "\n\n".join(docs)}, {"role": "user", "content": question}]


async def chat(
    session: httpx.AsyncClient, body: dict[str, Any], hang_up: float | None = None, reply: Reply | None = None
) -> Reply:
    """One chat completion; streamed ones record when each content piece arrived (in ``reply``
    as they come, when given). ``hang_up``: seconds after the first event the client leaves."""
    reply = reply or Reply()
    reply.sent = time.perf_counter()
    if not body.get("stream"):
        response = await session.post("/chat/completions", json=body)
        reply.done, reply.status = time.perf_counter(), response.status_code
        data = response.json()
        reply.text = data["choices"][0]["message"]["content"] or ""
        reply.tokens = data["usage"]["completion_tokens"]
        return reply
    async with session.stream("POST", "/chat/completions", json=body) as response:
        reply.status = response.status_code
        if response.status_code != 200:
            await response.aread()
            reply.text = response.text[:200]
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if hang_up is not None:
                await asyncio.sleep(hang_up)
                break  # the first event came: this client leaves
            reply.read_event(json.loads(line[6:]))
    reply.done = time.perf_counter()
    return reply


def body(model: str, msgs: list[dict[str, str]], tokens: int, stream: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"model": model, "messages": msgs, "max_tokens": tokens, "temperature": 0.0, "stream": stream}
    if stream:
        out["stream_options"] = {"include_usage": True}
    return out


def round_figures(replies: list[Reply], wall: float) -> dict[str, float]:
    """Throughput, TTFT p50/p99 of the streamed replies, longest pause of a stream."""
    streamed = [r for r in replies if r.arrivals]
    ttfts = [r.ttft * 1000 for r in streamed if r.ttft is not None]
    pauses = [g for r in streamed for g in r.gaps()]
    return {"wall_s": wall, "tokens_per_s": sum(r.tokens for r in replies) / wall,
            "ttft_p50_ms": percentile(ttfts, 0.5) if ttfts else float("nan"),
            "ttft_p99_ms": percentile(ttfts, 0.99) if ttfts else float("nan"),
            "longest_pause_ms": max(pauses) * 1000 if pauses else float("nan")}


class Bench:
    """The workload and the client session of one run."""

    def __init__(self, args: argparse.Namespace, url: str, model: str) -> None:
        self.args, self.url, self.model = args, url, model
        corpus = python_reference_documents(max_chars=args.doc_chars)
        rng = random.Random(args.seed)
        rng.shuffle(corpus)
        self.pool = corpus[: args.pool]
        fresh = args.pool + args.docs
        self.fresh = corpus[args.pool : fresh]  # never warmed: the request sent beside the streams
        self.fresh_idle = corpus[fresh : fresh + args.docs]  # never warmed: its twin on the idle server
        rest = corpus[fresh + args.docs :] or corpus
        self.warm_docs = [rest[i % len(rest)][: args.warm_chars] + f"\n(copy {i})" for i in range(args.warm_docs)]
        self.rng = rng

    def request(self, i: int, stream: bool, tokens: int | None = None) -> dict[str, Any]:
        docs = self.rng.sample(self.pool, self.args.docs)
        question = f"Question {i}: what do these documents say about statement number {i}?"
        return body(self.model, messages(docs, question), tokens or self.args.tokens, stream)

    def session(self, clients: int) -> httpx.AsyncClient:
        limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=0)
        return httpx.AsyncClient(base_url=self.url, timeout=1200, limits=limits)


async def rounds(bench: Bench, requests: list[dict[str, Any]]) -> dict[str, Any]:
    """Scenario 1: one after another, then all at once."""
    async with bench.session(len(requests)) as session:
        start = time.perf_counter()
        alone = [await chat(session, b) for b in requests]
        sequential = time.perf_counter() - start
        start = time.perf_counter()
        together = await asyncio.gather(*[chat(session, b) for b in requests])
        concurrent = time.perf_counter() - start
    same = sum(a.text == t.text for a, t in zip(alone, together))
    return {"alone": alone, "sequential": round_figures(alone, sequential),
            "concurrent": round_figures(together, concurrent), "same": same, "speedup": sequential / concurrent,
            "lost": sum(r.status != 200 for r in together)}


async def hang_ups(bench: Bench, requests: list[dict[str, Any]], alone: list[Reply]) -> dict[str, Any]:
    """Scenario 2: a probe's time after clients hung up, and a round beside clients hanging up."""
    count = len(requests)
    probe = bench.request(900, stream=False)
    leavers = [bench.request(1000 + i, stream=True) for i in range(count)]
    async with bench.session(2 * count) as session:
        await chat(session, probe)  # untimed: what its first run stores is stored before it is timed
        idle = await chat(session, probe)
        await asyncio.gather(*[chat(session, b, hang_up=bench.args.hang_up_after) for b in leavers])
        after = await chat(session, probe)
        others = [bench.request(2000 + i, stream=True) for i in range(count)]
        start = time.perf_counter()
        leaving = [chat(session, b, hang_up=bench.args.hang_up_after) for b in others]
        both = await asyncio.gather(*[chat(session, b) for b in requests], *leaving)
        wall = time.perf_counter() - start
    staying = list(both[:count])
    idle_s, after_s = idle.done - idle.sent, after.done - after.sent
    return {"idle_s": idle_s, "after_s": after_s, "ratio": after_s / idle_s, "same_answer": after.text == idle.text,
            "round": round_figures(staying, wall), "same": sum(a.text == s.text for a, s in zip(alone, staying)),
            "lost": sum(r.status != 200 for r in staying)}


async def _keep_streaming(bench: Bench, session: httpx.AsyncClient, replies: list[Reply], stop: asyncio.Event, k: int) -> None:
    """One of the open streams: a long answer, restarted when it ends, until ``stop``."""
    i = 0
    while not stop.is_set():
        docs = bench.pool[(3 * k + i) % len(bench.pool) :][: bench.args.docs] or bench.pool[: bench.args.docs]
        msgs = messages(docs, "List every statement these documents describe, each with a long explanation.")
        reply = Reply()
        replies.append(reply)
        task = asyncio.ensure_future(chat(session, body(bench.model, msgs, bench.args.stream_tokens, True), reply=reply))
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        task.cancel()
        i += 1


async def beside(bench: Bench, work: Any) -> dict[str, float]:
    """Scenario 3: ``work(session)`` (returns when it ends) while ``--streams`` streams stay open.

    The decode step is the median gap between pieces over ``--settle`` seconds once every
    stream decodes (each has sent a few pieces) and before ``work`` starts."""
    replies: list[Reply] = []
    stop = asyncio.Event()
    streams = bench.args.streams
    async with bench.session(streams + 4) as session:
        keepers = [asyncio.ensure_future(_keep_streaming(bench, session, replies, stop, k)) for k in range(streams)]
        while len(replies) < streams or any(len(r.arrivals) < 5 for r in replies[-streams:]):
            await asyncio.sleep(0.05)
        before = time.perf_counter()
        await asyncio.sleep(bench.args.settle)
        start = time.perf_counter()
        extra = await work(session)
        end = time.perf_counter()
        stop.set()
        await asyncio.gather(*keepers, return_exceptions=True)
    steps = [b - a for r in replies for a, b in r.step_pairs() if a >= before and b <= start]
    during = [b - a for r in replies for a, b in r.step_pairs() if b > start and a < end]
    step = statistics.median(steps) if steps else float("nan")
    longest = max(during) if during else float("nan")
    p99 = percentile(during, 0.99) if during else float("nan")
    return {"step_ms": step * 1000, "longest_ms": longest * 1000, "p99_ms": p99 * 1000, "ratio": longest / step,
            "gaps": len(during), "work_s": end - start, **extra}


async def new_request(bench: Bench, session: httpx.AsyncClient, docs: list[str] | None = None) -> dict[str, float]:
    """A request whose documents were never warmed (``docs``, default the one sent beside the
    streams); its time to first token and to its last piece."""
    msgs = messages(docs or bench.fresh, "What do these documents say about the statements they describe?")
    reply = await chat(session, body(bench.model, msgs, bench.args.new_tokens, True))
    done = float("nan") if reply.done is None else reply.done - reply.sent
    return {"new_ttft_s": reply.ttft or float("nan"), "new_total_s": done}


async def warm_corpus(bench: Bench, session: httpx.AsyncClient) -> dict[str, float]:
    """``--warm-docs`` new documents warmed through ``POST /v1/documents``."""
    response = await session.post("/documents", json=bench.warm_docs)
    response.raise_for_status()
    return {"warmed": float(response.json()["warmed"])}


def start_server(
    args: argparse.Namespace, cache_dir: Path, extra: tuple[str, ...] = ()
) -> tuple[subprocess.Popen, str]:
    """``kvboost-rag serve`` in a process of its own (its disk tier in ``cache_dir``);
    ``extra``: more ``serve`` options (``--api-key KEY``, ``--threads N``)."""
    command = [sys.executable, "-c", "import sys; from kvboost_rag.cli import main; sys.exit(main())", "serve",
               "--port", str(args.port), "--log-level", "warning", *extra]
    if args.model:
        command += ["--model", args.model]
    for setting in args.set:
        command += ["--set", setting]
    env = {**os.environ, "KVBOOST_RAG_KV_CACHE": str(cache_dir)}
    # Started in the cache folder: ``python -c`` puts the working directory first on the path,
    # and the server must import the kvboost_rag this bench's environment names.
    process = subprocess.Popen(command, env=env, cwd=cache_dir)
    url = f"http://127.0.0.1:{args.port}/v1"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(url.removesuffix("/v1") + "/health", timeout=5).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        if process.poll() is not None:
            raise SystemExit(f"the server exited with {process.returncode}")
        time.sleep(0.5)
    process.terminate()
    raise SystemExit("the server did not answer within 300 s")


async def run_all(args: argparse.Namespace, url: str) -> dict[str, Any]:
    model = httpx.get(f"{url}/models", timeout=30).json()["data"][0]["id"]
    bench = Bench(args, url, model)
    async with bench.session(1) as session:
        (await session.post("/documents", json=bench.pool)).raise_for_status()  # ingest
    requests = [bench.request(i, stream=i % 2 == 0) for i in range(args.requests)]
    out: dict[str, Any] = {}
    if "rounds" in args.parts:
        out["rounds"] = await rounds(bench, requests)
    if "hang-ups" in args.parts:
        alone = out["rounds"]["alone"] if "rounds" in out else [Reply()] * len(requests)
        out["hang_ups"] = await hang_ups(bench, requests, alone)
    if "beside" in args.parts:
        async with bench.session(1) as session:
            out["idle_request"] = await new_request(bench, session, bench.fresh_idle)
        out["new_request"] = await beside(bench, lambda session: new_request(bench, session))
        out["warm"] = await beside(bench, lambda session: warm_corpus(bench, session))
    return out


def _row(name: str, figures: dict[str, float], same: str, lost: int) -> str:
    return (f"| {name} | {figures['wall_s']:.1f} | {figures['tokens_per_s']:.1f} | {figures['ttft_p50_ms']:.0f} | "
            f"{figures['ttft_p99_ms']:.0f} | {figures['longest_pause_ms']:.0f} | {same} | {lost} |")


def engine_checkout() -> str:
    """Where the kvboost_rag this process (and the server it starts) imports lives, and its
    git revision (the server may run another checkout than the bench's: ``PYTHONPATH``)."""
    import kvboost_rag

    root = Path(kvboost_rag.__file__).resolve().parents[1]
    return f"{root} at {code_version(root, ('kvboost_rag',))}"


def _round_lines(args: argparse.Namespace, out: dict[str, Any]) -> list[str]:
    n, rounds_, hang = args.requests, out.get("rounds"), out.get("hang_ups")
    lines = ["| round | wall s | tokens/s | TTFT p50 ms | TTFT p99 ms | longest pause ms | answers as alone | not 200 |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    if rounds_:
        lines += [_row("one after another", rounds_["sequential"], "-", 0),
                  _row(f"{n} at once", rounds_["concurrent"], f"{rounds_['same']}/{n}", rounds_["lost"])]
    if hang:
        same = f"{hang['same']}/{n}" if rounds_ else "-"
        lines.append(_row(f"{n} at once beside {n} clients hanging up", hang["round"], same, hang["lost"]))
    lines.append("")
    if rounds_:
        lines += [f"Concurrent round {rounds_['speedup']:.2f}x faster than one after another.", ""]
    if hang:
        lines += [f"A request after {n} streaming clients hung up {args.hang_up_after * 1000:.0f} ms after their first "
                  f"event: {hang['after_s']:.2f} s against "
                  f"{hang['idle_s']:.2f} s on the idle server ({hang['ratio']:.2f}x; same answer: {hang['same_answer']}).",
                  ""]
    return lines


def _beside_lines(args: argparse.Namespace, out: dict[str, Any]) -> list[str]:
    if "new_request" not in out:
        return []
    new, warm, idle = out["new_request"], out["warm"], out["idle_request"]
    header = [f"| {args.streams} open streams beside | decode step ms | longest pause ms | ratio | p99 pause ms | gaps "
              "| work s |", "|---|---:|---:|---:|---:|---:|---:|"]
    rows = [(f"a request of {args.docs} new documents (TTFT {new['new_ttft_s']:.2f} s)", new),
            (f"{args.warm_docs} documents warming through the server", warm)]
    table = [f"| {name} | {f['step_ms']:.0f} | {f['longest_ms']:.0f} | {f['ratio']:.2f} | {f['p99_ms']:.0f} | "
             f"{f['gaps']} | {f['work_s']:.1f} |" for name, f in rows]
    twin = [
        "",
        f"The request of {args.docs} new documents ({args.new_tokens} new tokens) beside the streams: first token "
        f"{new['new_ttft_s']:.2f} s, answer {new['new_total_s']:.2f} s; the same shape of request (other new "
        f"documents) on the idle server: {idle['new_ttft_s']:.2f} s, {idle['new_total_s']:.2f} s "
        f"({new['new_ttft_s'] / idle['new_ttft_s']:.2f}x and {new['new_total_s'] / idle['new_total_s']:.2f}x its idle "
        "time).",
    ]
    return header + table + twin


def report(args: argparse.Namespace, machine: str, out: dict[str, Any]) -> str:
    """The Markdown report."""
    lines = ["# kvboost-rag server under load", "", f"Command: `python bench/server_load.py {' '.join(sys.argv[1:])}`",
             "", f"Machine: {machine}; load average at the end {', '.join(f'{x:.2f}' for x in os.getloadavg())}", "",
             f"Code: bench {code_version()}; the server's kvboost_rag: {engine_checkout()}", "",
             f"{args.requests} RAG chat requests of {args.docs} documents ({args.doc_chars} characters each, from a pool "
             f"of {args.pool} warmed through `POST /v1/documents`), greedy, {args.tokens} new tokens, every other one "
             "streamed. TTFT and pauses: streamed requests, as their client saw them.", "",
             *_round_lines(args, out), *_beside_lines(args, out)]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a server already running (http://host:port/v1); default: start one")
    parser.add_argument("--model", help="model folder for the server (default: the embedded model)")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="an engine setting")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--docs", type=int, default=6, help="documents per request")
    parser.add_argument("--doc-chars", type=int, default=1400)
    parser.add_argument("--pool", type=int, default=24, help="documents warmed at ingest")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--stream-tokens", type=int, default=400)
    parser.add_argument("--new-tokens", type=int, default=8, help="new tokens of the request of new documents")
    parser.add_argument("--hang-up-after", type=float, default=0.05,
                        help="seconds a client that hangs up waits after its first event (reading it)")
    parser.add_argument("--warm-docs", type=int, default=100)
    parser.add_argument("--warm-chars", type=int, default=400)
    parser.add_argument("--settle", type=float, default=3.0,
                        help="seconds the open streams' decode step is measured, once they all decode")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--parts", type=lambda text: text.split(","), default=["rounds", "hang-ups", "beside"],
                        help="comma-separated: rounds, hang-ups, beside (default: all)")
    parser.add_argument("--out", type=Path)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> str:
    import tempfile

    args = parse_args(argv)
    machine = machine_line()
    with tempfile.TemporaryDirectory() as cache_dir:
        process, url = (None, args.url) if args.url else start_server(args, Path(cache_dir))
        try:
            out = asyncio.run(run_all(args, url))
        finally:
            if process is not None:
                process.terminate()
                process.wait(timeout=60)
    text = report(args, machine, out)
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return text


if __name__ == "__main__":
    main()
