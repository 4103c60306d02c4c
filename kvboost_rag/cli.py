"""The ``kvboost-rag`` command: ``kvboost-rag warm SOURCE ...`` warms a corpus into a shared store;
``kvboost-rag serve`` serves the model over an OpenAI-compatible HTTP API.

Examples::

    kvboost-rag warm docs/ --redis-url redis://10.0.0.5:7000/0 --kv-cache-bits 8
    kvboost-rag warm corpus.jsonl --redis-url redis://127.0.0.1:7000/0 --workers 4 --model ./Llama-3.1-8B
    kvboost-rag warm corpus.jsonl --disk-cache-dir /mnt/shared/kv --json
    kvboost-rag warm corpus.jsonl --server http://127.0.0.1:8000
    kvboost-rag serve --model ./Qwen2.5-1.5B-Instruct --redis-url redis://10.0.0.5:7000/0 --port 8000

Progress goes to stderr, one line per batch; the final report to stdout (``--json`` for a JSON
object). The exit status is 1 when a document failed, 0 otherwise. Run it again after a kill:
documents already stored are skipped. With ``--server`` the documents go to a running server's
``POST /v1/documents`` and are warmed by its engine into its store.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

logger = logging.getLogger("kvboost_rag.cli")


def _setting(text: str) -> tuple[str, Any]:
    """``name=value`` with a JSON value (a bare word stays a string)."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--set takes name=value, got {text!r}")
    try:
        return name, json.loads(value)
    except json.JSONDecodeError:
        return name, value


def _add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The store and model arguments ``warm`` and ``serve`` share (the cache namespace)."""
    store = parser.add_argument_group("store (the serving replicas' settings)")
    store.add_argument("--redis-url", help="Redis, any Redis Cluster node, or redis+sentinel:// URL")
    store.add_argument("--redis-cluster", action=argparse.BooleanOptionalAction, default=None,
                       help="state that the URL is (or is not) a cluster node instead of asking the server")
    store.add_argument("--redis-ttl-seconds", type=int, default=None)
    store.add_argument("--disk-cache-dir", type=Path, default=None, help="disk tier folder (shared storage)")
    store.add_argument("--secret-key-env", metavar="VAR", help="environment variable holding cache_secret_key")
    model = parser.add_argument_group("model")
    model.add_argument("--model", help="local model folder (default: the embedded SmolLM2-135M-Instruct)")
    model.add_argument("--engine-factory", metavar="MODULE:FUNCTION",
                       help="callable building the engine from the settings (instead of --model)")
    model.add_argument("--kv-cache-bits", type=int, choices=[4, 8], default=None)
    model.add_argument("--warm-prefix", help="system prompt documents are warmed behind (as in serving)")
    model.add_argument("--chunk-size", type=int, default=None)
    model.add_argument("--set", dest="settings", type=_setting, action="append", default=[], metavar="NAME=VALUE",
                       help="any other KVBoostSettings field (JSON value), repeatable")
    model.add_argument("--threads", type=int, default=None, help="torch CPU threads (per worker)")


def _add_serve_parser(commands: Any) -> None:
    serve = commands.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    _add_engine_arguments(serve)
    http = serve.add_argument_group("server")
    http.add_argument("--host", default="127.0.0.1", help="interface to bind (default: loopback only)")
    http.add_argument("--port", type=int, default=8000)
    http.add_argument("--api-key", default=os.environ.get("KVBOOST_RAG_API_KEY"),
                      help="require 'Authorization: Bearer KEY' (default: $KVBOOST_RAG_API_KEY)")
    http.add_argument("--served-model-name", action="append", metavar="NAME",
                      help="model name clients send, repeatable (default: the model folder's name)")
    http.add_argument("--max-pending", type=int, default=64,
                      help="requests held at once (decoding or queued); more get a 429 with Retry-After")
    http.add_argument("--max-tokens", type=int, default=256, help="max_tokens of requests that set none")
    http.add_argument("--temperature", type=float, default=1.0, help="temperature of requests that set none")
    http.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvboost-rag", description="kvboost-rag tools")
    commands = parser.add_subparsers(dest="command", required=True)
    warm = commands.add_parser("warm", help="warm a corpus into a shared store (Redis, Redis Cluster, disk folder)")
    warm.add_argument("source", help="folder of text files (.txt, .md, .rst) or a .jsonl file")
    warm.add_argument("--server", metavar="URL",
                      help="warm through a running kvboost-rag server (http://host:port) into its store, "
                           "instead of loading the model here")
    warm.add_argument("--api-key", default=os.environ.get("KVBOOST_RAG_API_KEY"),
                      help="the server's API key (default: $KVBOOST_RAG_API_KEY)")
    _add_engine_arguments(warm)
    run = warm.add_argument_group("run")
    run.add_argument("--workers", type=int, default=1, help="workers (Ray actors); 1 runs in this process")
    run.add_argument("--batch-size", type=int, default=16)
    run.add_argument("--backend", choices=["auto", "local", "ray"], default="auto")
    run.add_argument("--ray-address", help="running Ray cluster (default: start a local one)")
    run.add_argument("--text-field", default="text", help="JSONL field holding the text")
    run.add_argument("--json", action="store_true", help="print the final report as JSON")
    _add_serve_parser(commands)
    return parser


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    settings: dict[str, Any] = {"disk_cache_dir": args.disk_cache_dir}
    for name in ("redis_url", "redis_cluster", "redis_ttl_seconds", "kv_cache_bits", "warm_prefix", "chunk_size"):
        if getattr(args, name) is not None:
            settings[name] = getattr(args, name)
    if args.secret_key_env:
        secret = os.environ.get(args.secret_key_env)
        if not secret:
            raise SystemExit(f"kvboost-rag {args.command}: ${args.secret_key_env} is not set")
        settings["cache_secret_key"] = secret
    settings.update(dict(args.settings))
    if settings["disk_cache_dir"] is not None:
        settings["disk_cache_dir"] = str(settings["disk_cache_dir"])
    return settings


def _progress(report: Any) -> None:
    logger.info(
        "progress %d/%d documents: %d computed, %d stored already, %d failed, %.1f s",
        report.done, report.documents, report.computed, report.skipped, len(report.failures), report.seconds,
    )


def warm_command(args: argparse.Namespace) -> int:
    from kvboost_rag.errors import InvalidInputError

    try:
        report = _warm_through_server(args) if args.server else _warm_here(args)
    except InvalidInputError as exc:
        raise SystemExit(f"kvboost-rag warm: {exc}") from None
    for failure in report.failures:
        logger.warning("failed: %s: %s", failure.doc_id, failure.error)
    sys.stdout.write((json.dumps(report.to_dict()) if args.json else report.summary()) + "\n")
    return 1 if report.failures else 0


def _warm_here(args: argparse.Namespace) -> Any:
    from kvboost_rag.config import KVBoostSettings
    from kvboost_rag.warm_job import EngineSpec, warm_corpus

    settings = _settings(args)
    KVBoostSettings(**settings)  # a bad setting fails here, not in every worker
    spec = EngineSpec(model=args.model, settings=settings, factory=args.engine_factory, threads=args.threads)
    return warm_corpus(
        args.source, spec, workers=args.workers, batch_size=args.batch_size, backend=args.backend,
        ray_address=args.ray_address, text_field=args.text_field, on_progress=_progress,
    )


def _warm_through_server(args: argparse.Namespace) -> Any:
    from kvboost_rag.server.warm_client import warm_through_server

    engine_side = [name for name in ("redis_url", "disk_cache_dir", "model", "engine_factory", "warm_prefix")
                   if getattr(args, name) is not None]
    if engine_side or args.settings:
        raise SystemExit(f"kvboost-rag warm --server: the server's own model and store are used; drop "
                         f"{['--' + n.replace('_', '-') for n in engine_side] or ['--set']}")
    return warm_through_server(args.source, args.server, api_key=args.api_key, batch_size=args.batch_size,
                               text_field=args.text_field, on_progress=_progress)


def serve_command(args: argparse.Namespace) -> int:
    from kvboost_rag.config import KVBoostSettings

    try:
        from kvboost_rag.server.run import serve_command as run_server
    except ImportError as exc:
        raise SystemExit(f"kvboost-rag serve needs the server extra: pip install 'kvboost-rag[server]' ({exc})") from None
    settings = _settings(args)
    KVBoostSettings(**settings)  # a bad setting fails before the model loads
    return run_server(args, settings)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``kvboost-rag`` console script."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    for noisy in ("httpx", "transformers", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    raise SystemExit(serve_command(args) if args.command == "serve" else warm_command(args))


if __name__ == "__main__":
    main()
