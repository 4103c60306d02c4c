"""Server benchmark: the HTTP layer's own cost, llama.cpp's server beside it, and a bounded load.

Embedded model (or ``--model PATH``; ``--model tiny`` for a smoke run), RAG prompts as in
``bench/reuse_bench.py`` (plain text: the system prompt, ``--docs`` shuffled documents, a
question), documents prewarmed and the system prompt warmed before anything is timed.

1. **TTFT, in process against the server.** Each prompt runs once through ``KVBoost.stream``
   in this process and once as a streamed ``POST /v1/completions`` to the server (uvicorn on
   loopback, same engine, same thread), alternating which goes first. TTFT is wall time from
   the call (the HTTP request) to the first non-empty text piece reaching the caller. The
   HTTP layer's own cost is, per request, the client's TTFT less the engine's own
   ``ttft_ms`` that the server reports for that request (``kvboost`` in the last chunk).
2. **llama.cpp's server** (``--llamacpp-python PY`` starts ``python -m llama_cpp.server`` of
   that interpreter on the embedded model's GGUF with ``--cache true``; ``--llamacpp-url``
   uses one already running), the same prompts streamed to its ``/v1/completions`` with
   ``cache_prompt`` set, after one request on the system prompt (its prefix cache's warm).
3. **Load** (``--load-requests``, ``--load-clients``): that many short streamed chat requests
   (the system prompt, two documents, a question), at most ``--load-clients`` at once: p50/p95
   TTFT, generated tokens per second of wall time, requests lost.

Run: ``python bench/server_bench.py --threads 1 --out bench/results/server.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from batch_bench import load_engine
from llamacpp_system import embedded_gguf
from rag_bench import code_version, machine_line, percentile
from reuse_bench import SYSTEM_PROMPT, build_prompts

from kvboost_rag import KVBoost
from kvboost_rag.server import BackgroundServer, ServerSettings

MODEL = "bench"


def in_process_ttft(engine: KVBoost, prompt: str, new_tokens: int) -> float:
    """ms from ``stream()`` to its first non-empty piece (the stream then runs to its end)."""
    start = time.perf_counter()
    first = None
    for piece in engine.stream(prompt, max_new_tokens=new_tokens, temperature=0.0):
        if piece and first is None:
            first = time.perf_counter()
    return ((first or time.perf_counter()) - start) * 1000


def events(response: httpx.Response) -> Iterator[dict[str, Any]]:
    """The JSON events of a streamed OpenAI response."""
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


def served_ttft(client: httpx.Client, url: str, prompt: str, new_tokens: int, model: str) -> tuple[float, float | None]:
    """Client TTFT of one streamed completion (ms), and the engine's own ``ttft_ms`` when the
    server reports it."""
    body = {"model": model, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0.0, "stream": True,
            "cache_prompt": True}
    start = time.perf_counter()
    first, engine_ms = None, None
    with client.stream("POST", f"{url}/completions", json=body) as response:
        response.raise_for_status()
        for event in events(response):
            for choice in event.get("choices", []):
                if choice.get("text") and first is None:
                    first = time.perf_counter()
                engine_ms = choice.get("kvboost", {}).get("ttft_ms", engine_ms)
    return ((first or time.perf_counter()) - start) * 1000, engine_ms


def compare(engine: KVBoost, url: str, prompts: list[str], new_tokens: int) -> dict[str, list[float]]:
    """Part 1: every prompt in process and through the server, alternating the order."""
    rows: dict[str, list[float]] = {"in_process": [], "server": [], "engine_in_server": [], "http_layer": []}
    with httpx.Client(timeout=600) as client:
        for i, prompt in enumerate(prompts):
            order = ("in", "server") if i % 2 == 0 else ("server", "in")
            for side in order:
                if side == "in":
                    rows["in_process"].append(in_process_ttft(engine, prompt, new_tokens))
                else:
                    total, engine_ms = served_ttft(client, url, prompt, new_tokens, MODEL)
                    rows["server"].append(total)
                    rows["engine_in_server"].append(engine_ms or 0.0)
                    rows["http_layer"].append(total - (engine_ms or 0.0))
    return rows


def llamacpp_rows(args: argparse.Namespace, prompts: list[str]) -> tuple[list[float], str]:
    """Part 2: llama.cpp's server on the same prompts; its TTFTs and a description."""
    process = None
    url = args.llamacpp_url
    if url is None:
        port = 8765
        command = [args.llamacpp_python, "-m", "llama_cpp.server", "--model", str(embedded_gguf()), "--n_ctx", "8192",
                   "--n_threads", str(args.threads), "--n_threads_batch", str(args.threads), "--cache", "true",
                   "--port", str(port), "--model_alias", MODEL]
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}/v1"
    try:
        with httpx.Client(timeout=600) as client:
            _wait_for(client, url)
            served_ttft(client, url, SYSTEM_PROMPT + "\n\n", 1, MODEL)  # its prefix cache's warm
            ttfts = [served_ttft(client, url, prompt, args.new_tokens, MODEL)[0] for prompt in prompts]
    finally:
        if process is not None:
            process.terminate()
            process.wait(timeout=30)
    if process is None:
        return ttfts, f"server at {args.llamacpp_url}"
    version = subprocess.run([args.llamacpp_python, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                             capture_output=True, text=True).stdout.strip()
    return ttfts, f"llama-cpp-python {version} server, --cache true, {args.threads} thread(s), {embedded_gguf().name}"


def _wait_for(client: httpx.Client, url: str, seconds: float = 120.0) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            if client.get(f"{url}/models").status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"no server answered at {url}")
        time.sleep(0.5)


async def load(url: str, prompts: list[list[dict[str, str]]], clients: int, new_tokens: int) -> dict[str, Any]:
    """Part 3: streamed chat requests, ``clients`` at once."""
    gate = asyncio.Semaphore(clients)
    ttfts: list[float] = []
    tokens, lost = 0, 0

    async def one(session: httpx.AsyncClient, messages: list[dict[str, str]]) -> None:
        nonlocal tokens, lost
        body = {"model": MODEL, "messages": messages, "max_tokens": new_tokens, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True}}
        async with gate:
            start = time.perf_counter()
            first, done = None, False
            async with session.stream("POST", "/chat/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        event = json.loads(line[6:])
                        if event["choices"] and event["choices"][0]["delta"].get("content") and first is None:
                            first = time.perf_counter()
                        tokens += (event.get("usage") or {}).get("completion_tokens", 0)
            lost += 0 if done and response.status_code == 200 else 1
            ttfts.append(((first or time.perf_counter()) - start) * 1000)

    start = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=clients)) as session:
        await asyncio.gather(*[one(session, m) for m in prompts])
    wall = time.perf_counter() - start
    return {"requests": len(prompts), "lost": lost, "wall_s": wall, "tokens": tokens, "ttfts": ttfts}


def load_prompts(pool: list[str], count: int, seed: int) -> list[list[dict[str, str]]]:
    """Short chat requests: the system prompt, two documents of the pool, a question."""
    rng = random.Random(seed)
    return [[{"role": "system", "content": SYSTEM_PROMPT + "\n\n" + "\n\n".join(rng.sample(pool, 2))},
             {"role": "user", "content": f"Question {i}: which statement do these documents describe?"}]
            for i in range(count)]


def report(args: argparse.Namespace, engine: KVBoost, machine: str, rows: dict[str, list[float]],
           llamacpp: tuple[list[float], str] | None, loaded: dict[str, Any] | None) -> str:
    """The Markdown report (``machine``: :func:`machine_line` at the start)."""
    lines = ["# kvboost-rag server benchmark", "", f"Command: `python bench/server_bench.py {' '.join(sys.argv[1:])}`",
             "", f"Machine: {machine}", "", f"Code: {code_version()}", "",
             f"Model: {engine.model_name}; {len(rows['server'])} RAG prompts of {args.docs} documents "
             f"({args.doc_chars} characters each), documents and system prompt prewarmed; greedy, "
             f"{args.new_tokens} new tokens; TTFT = wall time from the call to the first text piece.", "",
             "| path | p50 TTFT ms | p95 TTFT ms |", "|---|---:|---:|"]
    names = {"in_process": "in process (`KVBoost.stream`)", "server": "server (`POST /v1/completions`, streamed)",
             "engine_in_server": "engine's own TTFT inside the server", "http_layer": "HTTP layer (server less engine)"}
    for key, name in names.items():
        lines.append(f"| {name} | {percentile(rows[key], 0.5):.1f} | {percentile(rows[key], 0.95):.1f} |")
    if llamacpp is None:
        lines.append("| llama.cpp server | not run | not run |")
    else:
        ttfts, what = llamacpp
        lines.append(f"| llama.cpp: {what} | {percentile(ttfts, 0.5):.1f} | {percentile(ttfts, 0.95):.1f} |")
    if loaded is not None:
        ttfts = loaded["ttfts"]
        lines += ["", f"Load: {loaded['requests']} streamed chat requests, {args.load_clients} at once, "
                  f"{args.load_tokens} new tokens each.", "",
                  "| requests | lost | p50 TTFT ms | p95 TTFT ms | generated tokens/s | wall s |",
                  "|---:|---:|---:|---:|---:|---:|",
                  f"| {loaded['requests']} | {loaded['lost']} | {percentile(ttfts, 0.5):.0f} | "
                  f"{percentile(ttfts, 0.95):.0f} | {loaded['tokens'] / loaded['wall_s']:.1f} | {loaded['wall_s']:.1f} |"]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model folder, 'tiny', or the embedded model (default)")
    parser.add_argument("--threads", type=int, default=1, help="torch (and llama.cpp) CPU threads")
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--docs", type=int, default=4, help="documents per RAG prompt")
    parser.add_argument("--doc-chars", type=int, default=1000)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--llamacpp-python", help="a Python with llama-cpp-python[server]: starts its server")
    parser.add_argument("--llamacpp-url", help="an OpenAI-compatible llama.cpp server already running (…/v1)")
    parser.add_argument("--load-requests", type=int, default=200)
    parser.add_argument("--load-clients", type=int, default=32)
    parser.add_argument("--load-tokens", type=int, default=16)
    parser.add_argument("--out", type=Path, help="write the report here too")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> str:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    machine = machine_line()
    engine = load_engine(args.model)
    triples, pool = build_prompts(args.prompts, args.docs, args.doc_chars, args.seed)
    prompts = [prompt for prompt, _, _ in triples]
    engine.warm(SYSTEM_PROMPT)
    engine.warm_documents(pool, show_progress=False)
    settings = ServerSettings(model_names=(MODEL,), temperature=0.0, max_pending=max(64, args.load_clients))
    with BackgroundServer(engine, settings) as server:
        in_process_ttft(engine, prompts[0], args.new_tokens)  # untimed: first-call costs out of the way
        rows = compare(engine, server.url, prompts, args.new_tokens)
        llamacpp = llamacpp_rows(args, prompts) if args.llamacpp_python or args.llamacpp_url else None
        requests = load_prompts(pool, args.load_requests, args.seed) if args.load_requests else []
        loaded = asyncio.run(load(server.url, requests, args.load_clients, args.load_tokens)) if requests else None
    text = report(args, engine, machine, rows, llamacpp, loaded)
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return text


if __name__ == "__main__":
    main()
