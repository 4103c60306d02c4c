#!/usr/bin/env bash
# Install Debian's redis-server (and redis-cli, from redis-tools) for the Redis tier tests
# (tests/test_storage_redis.py, tests/test_storage_redis_cluster.py).
# The tests start and stop their own server on a free loopback port; this script only makes
# the binary available. A failure is reported; under CI=true it is fatal (CI must not pass with
# the Redis tests skipped), elsewhere those tests then skip with a reason.
set -u

if { command -v redis-server >/dev/null 2>&1 || [ -x /usr/bin/redis-server ]; } \
    && { command -v redis-cli >/dev/null 2>&1 || [ -x /usr/bin/redis-cli ]; }; then
    echo "install-redis: $(redis-server --version 2>/dev/null || /usr/bin/redis-server --version)"
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        SUDO="sudo -n"
    else
        echo "install-redis: not root and no sudo; redis tests will be skipped" >&2
        [ "${CI:-}" = "true" ] && exit 1
        exit 0
    fi
fi

export DEBIAN_FRONTEND=noninteractive
if $SUDO apt-get install -y -q --no-install-recommends redis-server redis-tools >/tmp/install-redis.log 2>&1 \
    || { $SUDO apt-get update -q >>/tmp/install-redis.log 2>&1 \
         && $SUDO apt-get install -y -q --no-install-recommends redis-server redis-tools >>/tmp/install-redis.log 2>&1; }; then
    echo "install-redis: installed $(redis-server --version)"
else
    echo "install-redis: could not install redis-server (see /tmp/install-redis.log); redis tests will be skipped" >&2
    tail -n 5 /tmp/install-redis.log >&2 || true
    [ "${CI:-}" = "true" ] && exit 1
fi
exit 0
