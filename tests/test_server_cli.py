"""``kvboost-rag serve`` and ``kvboost-rag warm --server`` as commands: a server process on the
tiny model, its API key, a corpus warmed through it, and a clean stop on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvboost_rag.cli import build_parser, main

FACTORY = "kvboost_rag.dev.testing:tiny_engine"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "KVBOOST_RAG_API_KEY": "k3y"}


def _wait_for_health(base: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while True:
        assert process.poll() is None, process.stderr.read() if process.stderr else "the server exited"
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.2)


def test_serve_warm_through_it_and_stop_on_sigterm(tmp_path, docs):
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "kvboost_rag.cli", "serve", "--engine-factory", FACTORY, "--chunk-size", "32",
               "--threads", "1", "--port", str(port), "--served-model-name", "tiny", "--log-level", "warning",
               "--max-tokens", "4", "--temperature", "0"]
    process = subprocess.Popen(command, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_health(base, process)
        body = {"model": "tiny", "messages": [{"role": "user", "content": "What does pass do?"}]}
        assert httpx.post(f"{base}/v1/chat/completions", json=body).status_code == 401
        reply = httpx.post(f"{base}/v1/chat/completions", json=body, headers={"Authorization": "Bearer k3y"})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] <= 4
        source = tmp_path / "corpus.jsonl"
        source.write_text("".join(json.dumps({"id": f"d{i}", "text": t}) + "\n" for i, t in enumerate(docs[:4])))
        warm = subprocess.run([sys.executable, "-m", "kvboost_rag.cli", "warm", str(source), "--server", base, "--json"],
                              env=_env(), capture_output=True, text=True, timeout=120)
        assert warm.returncode == 0, warm.stderr[-2000:]
        report = json.loads(warm.stdout)
        assert report["computed"] == 4 and report["backend"] == "server" and report["failures"] == []
        kept = httpx.get(f"{base}/v1/documents", headers={"Authorization": "Bearer k3y"}).json()
        assert kept["documents"] == 4
        process.send_signal(signal.SIGTERM)
        # uvicorn stops gracefully, then exits by the signal it caught (the conventional status).
        assert process.wait(timeout=60) in (0, -signal.SIGTERM)
        assert "Traceback" not in process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_warm_through_a_server_uses_its_store_only():
    with pytest.raises(SystemExit, match="drop"):
        main(["warm", "corpus.jsonl", "--server", "http://127.0.0.1:9", "--redis-url", "redis://127.0.0.1:7000/0"])


def test_the_engine_and_the_warm_client_import_no_server_stack():
    code = ("import sys, kvboost_rag, kvboost_rag.cli, kvboost_rag.server.warm_client; "
            "print(sorted(m for m in ('fastapi', 'uvicorn', 'starlette') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr[-2000:]


def test_deploy_recipes_run_the_serve_command():
    deploy = Path(__file__).resolve().parents[1] / "examples" / "deploy"
    entrypoint = next(line for line in (deploy / "Dockerfile").read_text().splitlines() if line.startswith("ENTRYPOINT"))
    unit = next(line for line in (deploy / "kvboost-rag.service").read_text().splitlines() if line.startswith("ExecStart="))
    for argv in (json.loads(entrypoint.removeprefix("ENTRYPOINT ")), unit.removeprefix("ExecStart=").split()):
        assert Path(argv[0]).name == "kvboost-rag"
        args = build_parser().parse_args(argv[1:])
        assert args.command == "serve" and args.host == "0.0.0.0" and args.port == 8000
