"""Hostile clients beside open streams: does ``kvboost-rag serve`` refuse them at once, and do
the streams keep their pace?

The target (issue 73): with 10^5 stop strings, a 1 MB stop string, 1,000 documents in one
request or 300 unauthenticated 30 MiB uploads sent beside 4 open streams, every hostile
request gets a 4xx within a second and the streams' longest pause is no longer than without
them.

The server runs as a user runs it (``kvboost-rag serve --api-key KEY``, default settings, the
embedded model, loopback only, its cache in a temporary folder), started by
``server_load.start_server``. A pool of documents is warmed first (``POST /v1/documents``).

* **Phase A (baseline).** ``--streams`` greedy RAG chat streams (``--stream-tokens`` tokens
  each, one restarting when one ends: ``server_load._keep_streaming``) for ``--window``
  seconds; the decode step (median gap between two pieces of one stream, over ``--settle``
  seconds before the window) and the longest gap during the window (``server_load.beside``).
* **Phase B (hostile).** The same streams for the same window while, authenticated, every
  ``window / --repeats`` seconds one of each is sent, one after another: a chat request with
  10^5 stop strings, one with a single 1 MB stop string, one with 1,000 documents in the
  ``documents`` field, one with ``seed: 2**64``; and, from the window's start, 300
  unauthenticated ``POST /v1/documents`` over raw sockets, ``--upload-concurrency`` at once,
  each declaring ``Content-Length: 31457280`` (30 MiB) and sending its head and the first
  64 KiB of body, then reading the status line (the server must answer 401 without reading
  the body). Each hostile request's status and latency (send start to status line) is kept.

Printed: per hostile kind the count, statuses, latency p50/max and how many came within 1 s;
the streams' step, longest pause and p99 pause in both phases and the ratio. The exit code is
1 when a hostile request got no 4xx or took more than 1 s.

Run: ``python bench/hostile_clients.py [--out FILE] [--threads 2]`` (about 2 minutes on a
2-core CPU).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rag_bench import code_version, machine_line, percentile
from server_load import Bench, beside, engine_checkout, messages, start_server

from kvboost_rag.corpus import python_reference_documents

API_KEY = "hostile-clients-bench-key"
UPLOAD_BYTES = 30 * 1024 * 1024
FIRST_BODY_BYTES = 64 * 1024
#: A hostile request must be answered with a 4xx within this many seconds.
DEADLINE_S = 1.0
KINDS = {
    "stops": "10^5 stop strings",
    "long_stop": "one 1 MB stop string",
    "documents": "1,000 documents in `documents`",
    "seed": "`seed: 2**64`",
    "upload": "unauthenticated 30 MiB `POST /v1/documents` (raw socket, 64 KiB sent)",
}


@dataclass
class Outcome:
    """One hostile request: its kind, the status it got (0: none) and when."""

    kind: str
    status: int
    latency_s: float


class AuthBench(Bench):
    """``server_load``'s workload, its sessions sending the API key."""

    def session(self, clients: int) -> httpx.AsyncClient:
        client = super().session(clients)
        client.headers["Authorization"] = f"Bearer {API_KEY}"
        return client


def hostile_bodies(model: str) -> dict[str, bytes]:
    """The JSON bodies of the authenticated hostile chat requests, encoded once."""
    msgs = messages(["The pass statement does nothing."], "What does pass do?")
    base: dict[str, Any] = {"model": model, "messages": msgs, "max_tokens": 16, "temperature": 0.0}
    docs = python_reference_documents(max_chars=400)
    bodies = {
        "stops": {**base, "stop": [f"stop string {i}" for i in range(100_000)]},
        "long_stop": {**base, "stop": "x" * 1_000_000},
        "documents": {**base, "documents": [f"{docs[i % len(docs)]} ({i})" for i in range(1000)]},
        "seed": {**base, "seed": 2**64},
    }
    return {kind: json.dumps(value).encode() for kind, value in bodies.items()}


async def json_request(session: httpx.AsyncClient, kind: str, content: bytes) -> Outcome:
    """One hostile chat request; latency from the send to the response's head."""
    start = time.perf_counter()
    try:
        request = session.build_request("POST", "/chat/completions", content=content,
                                        headers={"Content-Type": "application/json"}, timeout=30)
        response = await session.send(request, stream=True)
        latency = time.perf_counter() - start
        await response.aclose()
        return Outcome(kind, response.status_code, latency)
    except httpx.HTTPError:
        return Outcome(kind, 0, time.perf_counter() - start)


async def upload(host: str, port: int, timeout: float) -> Outcome:
    """One unauthenticated 30 MiB upload: the head and 64 KiB of body, then the status line."""
    head = (f"POST /v1/documents HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {UPLOAD_BYTES}\r\n\r\n").encode()
    start = time.perf_counter()
    writer = None
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
        writer.write(head + b"[" + b" " * (FIRST_BODY_BYTES - 1))
        await asyncio.wait_for(writer.drain(), timeout)
        line = await asyncio.wait_for(reader.readline(), timeout)
        latency = time.perf_counter() - start
        parts = line.split()
        return Outcome("upload", int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0, latency)
    except (OSError, asyncio.TimeoutError):
        return Outcome("upload", 0, time.perf_counter() - start)
    finally:
        if writer is not None:
            writer.close()


async def uploads(url: str, count: int, at_once: int) -> list[Outcome]:
    """``count`` unauthenticated uploads, ``at_once`` in flight at a time."""
    address = httpx.URL(url)
    gate = asyncio.Semaphore(at_once)

    async def one() -> Outcome:
        async with gate:
            return await upload(address.host, address.port or 80, timeout=10.0)

    return list(await asyncio.gather(*[one() for _ in range(count)]))


async def paced_requests(
    session: httpx.AsyncClient, bodies: dict[str, bytes], window: float, repeats: int
) -> list[Outcome]:
    """Every ``window / repeats`` seconds, one request of each JSON kind, one after another."""
    outcomes: list[Outcome] = []
    start = time.perf_counter()
    for i in range(repeats):
        await asyncio.sleep(max(0.0, start + i * window / repeats - time.perf_counter()))
        for kind, content in bodies.items():
            outcomes.append(await json_request(session, kind, content))
    return outcomes


Work = Callable[[httpx.AsyncClient], Awaitable[dict[str, Any]]]


def hostile_work(args: argparse.Namespace, url: str, bodies: dict[str, bytes]) -> Work:
    """Phase B's work for ``beside``: the hostile requests, and the rest of the window."""

    async def work(session: httpx.AsyncClient) -> dict[str, Any]:
        start = time.perf_counter()
        sent = await asyncio.gather(paced_requests(session, bodies, args.window, args.repeats),
                                    uploads(url, args.uploads, args.upload_concurrency))
        await asyncio.sleep(max(0.0, start + args.window - time.perf_counter()))
        return {"outcomes": [o for group in sent for o in group]}

    return work


def quiet_work(window: float) -> Work:
    """Phase A's work for ``beside``: nothing, for the window."""

    async def work(session: httpx.AsyncClient) -> dict[str, Any]:
        await asyncio.sleep(window)
        return {}

    return work


async def run_all(args: argparse.Namespace, url: str) -> dict[str, Any]:
    """Warm the pool, then phase A and phase B."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600) as client:
        model = (await client.get("/models")).json()["data"][0]["id"]
    bench = AuthBench(args, url, model)
    async with bench.session(1) as session:
        (await session.post("/documents", json=bench.pool)).raise_for_status()
    bodies = hostile_bodies(model)
    baseline = await beside(bench, quiet_work(args.window))
    hostile = await beside(bench, hostile_work(args, url, bodies))
    return {"baseline": baseline, "hostile": hostile, "outcomes": hostile.pop("outcomes"),
            "body_bytes": {kind: len(content) for kind, content in bodies.items()}}


def kind_rows(outcomes: list[Outcome], body_bytes: dict[str, int]) -> list[str]:
    """The table of hostile requests, one row per kind."""
    lines = ["| hostile request | body sent | count | statuses | latency p50 ms | latency max ms | 4xx within 1 s |",
             "|---|---:|---:|---|---:|---:|---:|"]
    for kind, name in KINDS.items():
        mine = [o for o in outcomes if o.kind == kind]
        if not mine:
            continue
        ms = [o.latency_s * 1000 for o in mine]
        statuses = ", ".join(f"{s or 'none'} x{n}" for s, n in sorted(Counter(o.status for o in mine).items()))
        ok = sum(400 <= o.status < 500 and o.latency_s <= DEADLINE_S for o in mine)
        size = f"{body_bytes[kind] / 1e6:.2f} MB" if kind in body_bytes else "64 KiB of 30 MiB"
        lines.append(f"| {name} | {size} | {len(mine)} | {statuses} | {statistics.median(ms):.1f} | "
                     f"{max(ms):.1f} | {ok}/{len(mine)} |")
    return lines


def stream_rows(args: argparse.Namespace, out: dict[str, Any]) -> list[str]:
    """The table of the open streams' pauses, without and with the hostile requests."""
    a, b = out["baseline"], out["hostile"]
    lines = [f"| {args.streams} open streams, {args.window:.0f} s window | decode step ms | longest pause ms | "
             "p99 pause ms | longest / step | gaps |", "|---|---:|---:|---:|---:|---:|"]
    for name, f in (("A: no hostile requests", a), ("B: hostile requests beside", b)):
        lines.append(f"| {name} | {f['step_ms']:.1f} | {f['longest_ms']:.0f} | {f['p99_ms']:.0f} | "
                     f"{f['ratio']:.2f} | {f['gaps']} |")
    ratio = b["longest_ms"] / a["longest_ms"]
    verdict = "no longer" if ratio <= 1.0 else "LONGER"
    lines += ["", f"Longest pause with the hostile requests / without: {ratio:.2f} ({verdict} than without them); "
              f"p99 pause {b['p99_ms'] / a['p99_ms']:.2f}, decode step {b['step_ms'] / a['step_ms']:.2f}."]
    return lines


def failures(outcomes: list[Outcome]) -> list[Outcome]:
    """Hostile requests that got no 4xx, or got it after the deadline."""
    return [o for o in outcomes if not (400 <= o.status < 500) or o.latency_s > DEADLINE_S]


def report(args: argparse.Namespace, machine: str, out: dict[str, Any]) -> str:
    """The Markdown report."""
    outcomes = out["outcomes"]
    bad = failures(outcomes)
    lines = ["# Hostile clients beside open streams", "",
             f"Command: `python bench/hostile_clients.py {' '.join(sys.argv[1:])}`", "",
             f"Machine: {machine}; load average at the end {', '.join(f'{x:.2f}' for x in os.getloadavg())}", "",
             f"Code: bench {code_version()}; the server's kvboost_rag: {engine_checkout()}", "",
             f"`kvboost-rag serve --api-key KEY --threads {args.threads}`, default settings, the embedded model. "
             f"{args.streams} greedy RAG chat streams of {args.docs} warmed documents ({args.doc_chars} characters "
             f"each), {args.stream_tokens} tokens, one restarting when one ends. Phase B sends, every "
             f"{args.window / args.repeats:.1f} s, one of each authenticated JSON request; from its start "
             f"{args.uploads} unauthenticated uploads, {args.upload_concurrency} at once. Latency: send start to "
             "the response's status line.", "",
             *kind_rows(outcomes, out["body_bytes"]), "", *stream_rows(args, out), "",
             f"Hostile requests without a 4xx within {DEADLINE_S:.0f} s: {len(bad)} of {len(outcomes)}."]
    lines += [f"- {KINDS[o.kind]}: status {o.status or 'none'} after {o.latency_s * 1000:.0f} ms" for o in bad[:20]]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8766)
    parser.add_argument("--threads", type=int, default=2, help="the server's torch threads (serve --threads)")
    parser.add_argument("--window", type=float, default=20.0, help="seconds of each phase")
    parser.add_argument("--settle", type=float, default=4.0,
                        help="seconds the decode step is measured before each window, once every stream decodes")
    parser.add_argument("--repeats", type=int, default=10, help="requests of each JSON kind in phase B")
    parser.add_argument("--uploads", type=int, default=300)
    parser.add_argument("--upload-concurrency", type=int, default=50)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--stream-tokens", type=int, default=128)
    parser.add_argument("--docs", type=int, default=6, help="documents per stream's prompt")
    parser.add_argument("--doc-chars", type=int, default=1400)
    parser.add_argument("--pool", type=int, default=24, help="documents warmed first")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    # What server_load's Bench and start_server read besides these.
    args.model, args.set, args.warm_docs, args.warm_chars = None, [], 0, 400
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    machine = machine_line()
    with tempfile.TemporaryDirectory() as cache_dir:
        extra = ("--api-key", API_KEY, "--threads", str(args.threads))
        process, url = start_server(args, Path(cache_dir), extra)
        try:
            out = asyncio.run(run_all(args, url))
        finally:
            process.terminate()
            process.wait(timeout=60)
    text = report(args, machine, out)
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return 1 if failures(out["outcomes"]) else 0


if __name__ == "__main__":
    sys.exit(main())
