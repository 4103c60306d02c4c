#!/usr/bin/env bash
# Start a local Redis Cluster (3 masters on free loopback ports, cluster-require-full-coverage
# no, append-only files) and keep it until Ctrl-C; prints the URL of a node. Needs Debian's
# redis-server and redis-cli (bash .ci/install-redis.sh). Extra arguments go to
# `python -m kvboost_rag.dev.redis_local cluster` (--masters N, --maxmemory BYTES).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
exec "$PYTHON" -m kvboost_rag.dev.redis_local cluster "$@"
