"""The Ray Serve recipe (examples/ray_serve_replicas.py): 2 replicas over a Redis Cluster store
each answer from the documents a warm job stored (tiny random model, local Ray)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.redis
def test_every_replica_hits_the_documents_the_warm_job_stored():
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError:
        pytest.skip("Ray Serve is not installed: pip install 'kvboost-rag[ray]'")
    from kvboost_rag.dev.redis_local import RedisNotAvailableError, find_binary

    try:
        find_binary("redis-server"), find_binary("redis-cli")
    except RedisNotAvailableError as exc:
        pytest.skip(str(exc))
    paths = [str(ROOT), str(ROOT / "examples"), *sys.path]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    command = [sys.executable, str(ROOT / "examples" / "ray_serve_replicas.py"), "--tiny", "--json"]
    command += ["--replicas", "2", "--warm-workers", "1", "--docs", "24", "--new-tokens", "2"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300, start_new_session=True)
    assert done.returncode == 0, done.stderr[-3000:]
    # Ray's own shutdown lines may follow on stdout: the figures are the JSON line.
    figures = json.loads(next(line for line in done.stdout.splitlines() if line.startswith('{"warm_report"')))
    assert figures["warm_report"]["computed"] == 24 and figures["warm_report"]["failures"] == []
    replicas = figures["replicas"]
    assert len(replicas) == 2, replicas
    for row in replicas.values():
        assert row["documents_known"] == 24
        assert row["content_hit_tokens"] > 0 and row["redis_hits"] > 0
