"""Redis servers and Redis Clusters on loopback ports, for tests, benchmarks and trying things.

Uses the ``redis-server`` and ``redis-cli`` binaries (Debian's ``redis-server`` package;
``.ci/install-redis.sh`` installs it). Every server runs in the foreground of a child process,
in a folder of its own, bound to 127.0.0.1. A cluster is created with
``redis-cli --cluster create`` and configured the way the Redis tier's docs recommend
(``cluster-require-full-coverage no``, so losing a shard leaves the others serving).

Command line (``scripts/redis_cluster.sh`` wraps it)::

    python -m kvboost_rag.dev.redis_local cluster --masters 3   # prints the URL, runs until Ctrl-C
    python -m kvboost_rag.dev.redis_local server                # one plain server
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

#: Seconds to wait for a server to answer PING, or a cluster to report ``cluster_state:ok``.
START_TIMEOUT_SECONDS = 20.0
#: Cluster nodes consider a silent peer failed after this many milliseconds.
DEFAULT_NODE_TIMEOUT_MS = 1000


class RedisNotAvailableError(RuntimeError):
    """``redis-server`` or ``redis-cli`` is missing, or a server or cluster did not start."""


def find_binary(name: str) -> str:
    """Path of ``redis-server`` or ``redis-cli``.

    Raises:
        RedisNotAvailableError: Not on ``PATH`` nor in ``/usr/bin`` or ``/usr/sbin``.
    """
    found = shutil.which(name) or next(
        (path for path in (f"/usr/bin/{name}", f"/usr/sbin/{name}") if os.access(path, os.X_OK)), None
    )
    if found is None:
        raise RedisNotAvailableError(f"no {name} binary (install Debian's redis-server: bash .ci/install-redis.sh)")
    return found


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _port_range() -> range:
    """Ports this process picks from: 20000-49999, split into disjoint parts among the
    pytest-xdist workers of one run (``PYTEST_XDIST_WORKER=gwN``), so workers never race for
    the same port."""
    low, high = 20000, 50000
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if worker.startswith("gw") and worker[2:].isdigit() and count.isdigit() and int(count) > 0:
        size = (high - low) // int(count)
        low += int(worker[2:]) % int(count) * size
        high = low + size
    return range(low, high)


def free_port(cluster_bus: bool = False) -> int:
    """A free loopback port (and, with ``cluster_bus``, its cluster bus port ``port + 10000``)."""
    ports = _port_range()
    for _ in range(200):
        port = random.choice(ports)
        if _port_free(port) and (not cluster_bus or _port_free(port + 10000)):
            return port
    raise RedisNotAvailableError("found no free loopback port")


def _server_pid(port: int, timeout: float = 0.3) -> int | None:
    """Process id of the Redis server answering on ``port`` (``INFO server``), else ``None``."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.sendall(b"INFO server\r\n")
            reply = b""
            while b"process_id:" not in reply or not reply.split(b"process_id:", 1)[1].count(b"\r\n"):
                data = sock.recv(4096)
                if not data:
                    return None
                reply += data
    except OSError:
        return None
    digits = reply.split(b"process_id:", 1)[1].split(b"\r\n", 1)[0]
    return int(digits) if digits.isdigit() else None


@dataclass
class LocalRedis:
    """One ``redis-server`` child process on 127.0.0.1.

    Attributes:
        port: Its port.
        folder: Its working folder (cluster config, append-only file).
        args: Extra ``redis-server`` arguments it was started with.
    """

    port: int
    folder: Path
    args: list[str] = field(default_factory=list)
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>/0``."""
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        """Start (or restart, with the same folder and port) and wait until it answers PING.

        Raises:
            RedisNotAvailableError: No binary, or it did not answer in time.
        """
        if self.running:
            return
        command = [find_binary("redis-server"), "--port", str(self.port), "--bind", "127.0.0.1"]
        command += ["--dir", str(self.folder), "--daemonize", "no", "--loglevel", "warning", *self.args]
        log = open(self.folder / "server.log", "ab")  # noqa: SIM115 - the child keeps it
        try:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        finally:
            log.close()
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        # Ours answers: another process's server on a port taken meanwhile is not taken for it.
        while _server_pid(self.port) != self.process.pid:
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop(kill=True)
                tail = (self.folder / "server.log").read_text(errors="replace")[-400:]
                raise RedisNotAvailableError(f"redis-server did not start on 127.0.0.1:{self.port}: {tail.strip()}")
            time.sleep(0.05)

    def stop(self, kill: bool = False) -> None:
        """Stop the server: SIGKILL with ``kill`` (a lost machine), else a clean SIGTERM."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self.process = None


def _server_args(persistent: bool, maxmemory: int | None, policy: str) -> list[str]:
    args = ["--save", ""]
    # fsync on every write: a killed shard comes back with every entry it acknowledged.
    args += ["--appendonly", "yes", "--appendfsync", "always"] if persistent else ["--appendonly", "no"]
    if maxmemory is not None:
        args += ["--maxmemory", str(maxmemory), "--maxmemory-policy", policy]
    return args


def start_server(
    *, persistent: bool = False, maxmemory: int | None = None, policy: str = "allkeys-lru", folder: Path | None = None
) -> LocalRedis:
    """Start one plain Redis server on a free loopback port.

    Args:
        persistent: Keep an append-only file (fsync always), so a restart keeps the data.
        maxmemory: Bytes the server may use before it evicts with ``policy``.
        policy: ``maxmemory-policy`` (``allkeys-lru`` suits a cache).
        folder: Working folder (default: a new temporary one).
    """
    folder = Path(folder or tempfile.mkdtemp(prefix="kvboost-redis-"))
    return _start_on_a_free_port(folder, _server_args(persistent, maxmemory, policy), cluster_bus=False)


def _start_on_a_free_port(folder: Path, args: list[str], cluster_bus: bool, tries: int = 5) -> LocalRedis:
    """Start a server on a free port, on another one if a process took it meanwhile."""
    for _ in range(tries - 1):
        server = LocalRedis(free_port(cluster_bus=cluster_bus), folder, list(args))
        try:
            server.start()
            return server
        except RedisNotAvailableError:
            if _port_free(server.port):
                raise  # it failed for another reason than a taken port
            logger.info("port %d was taken before redis-server bound it; trying another", server.port)
    server = LocalRedis(free_port(cluster_bus=cluster_bus), folder, list(args))
    server.start()
    return server


@dataclass
class LocalCluster:
    """A Redis Cluster of master nodes on loopback ports (no replicas).

    Attributes:
        nodes: The masters, in creation order (slots split evenly over them).
        folder: Parent folder of the nodes' folders.
    """

    nodes: list[LocalRedis]
    folder: Path

    @property
    def url(self) -> str:
        """URL of the first node (any node's URL reaches the whole cluster)."""
        return self.nodes[0].url

    def kill(self, index: int) -> None:
        """SIGKILL one master: its slots become unreachable."""
        self.nodes[index].stop(kill=True)

    def restart(self, index: int) -> None:
        """Start a killed master again with its config and data, and wait for the cluster."""
        self.nodes[index].start()
        wait_for_cluster(self.nodes)

    def stop(self) -> None:
        """Stop every node and remove the folder."""
        for node in self.nodes:
            node.stop()
        shutil.rmtree(self.folder, ignore_errors=True)


def _cluster_info(port: int) -> dict[str, str]:
    cli = find_binary("redis-cli")
    done = subprocess.run([cli, "-p", str(port), "cluster", "info"], capture_output=True, text=True, timeout=5)
    pairs = (line.split(":", 1) for line in done.stdout.splitlines() if ":" in line)
    return {key.strip(): value.strip() for key, value in pairs}


def wait_for_cluster(nodes: Sequence[LocalRedis], timeout: float = START_TIMEOUT_SECONDS) -> None:
    """Wait until every running node reports ``cluster_state:ok`` and sees all slots assigned.

    Raises:
        RedisNotAvailableError: Not within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while True:
        infos = [_cluster_info(node.port) for node in nodes if node.running]
        if infos and all(i.get("cluster_state") == "ok" and i.get("cluster_slots_ok") == "16384" for i in infos):
            return
        if time.monotonic() > deadline:
            raise RedisNotAvailableError(f"cluster not ready after {timeout:g} s: {infos}")
        time.sleep(0.1)


def start_cluster(
    masters: int = 3,
    *,
    persistent: bool = True,
    maxmemory: int | None = None,
    policy: str = "allkeys-lru",
    node_timeout_ms: int = DEFAULT_NODE_TIMEOUT_MS,
    folder: Path | None = None,
) -> LocalCluster:
    """Start ``masters`` Redis servers in cluster mode and join them into one cluster.

    Args:
        masters: Master nodes (at least 3, Redis Cluster's minimum).
        persistent: Each node keeps an append-only file, so a killed node restarts with its data.
        maxmemory: Per-node memory bound; the node evicts with ``policy`` beyond it.
        policy: ``maxmemory-policy``.
        node_timeout_ms: ``cluster-node-timeout``.
        folder: Parent folder (default: a new temporary one).

    Raises:
        RedisNotAvailableError: Missing binaries, or the cluster did not form.
    """
    if masters < 3:
        raise ValueError(f"a Redis Cluster needs at least 3 masters, got {masters}")
    cli = find_binary("redis-cli")
    parent = Path(folder or tempfile.mkdtemp(prefix="kvboost-redis-cluster-"))
    args = _server_args(persistent, maxmemory, policy)
    args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
    args += ["--cluster-node-timeout", str(node_timeout_ms), "--cluster-require-full-coverage", "no"]
    nodes: list[LocalRedis] = []
    cluster = LocalCluster(nodes, parent)
    try:
        for i in range(masters):
            node_folder = parent / f"node{i}"
            node_folder.mkdir(parents=True, exist_ok=True)
            nodes.append(_start_on_a_free_port(node_folder, args, cluster_bus=True))
        addresses = [f"127.0.0.1:{node.port}" for node in nodes]
        command = [cli, "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise RedisNotAvailableError(f"redis-cli --cluster create failed: {(done.stdout + done.stderr)[-400:]}")
        wait_for_cluster(nodes)
    except BaseException:
        cluster.stop()
        raise
    logger.info("Redis Cluster of %d masters at %s", masters, ", ".join(n.url for n in nodes))
    return cluster


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> None:
    """Start a local cluster (or server), print its URL, and keep it until interrupted."""
    parser = argparse.ArgumentParser(description="Local Redis Cluster or server on loopback ports")
    parser.add_argument("kind", choices=["cluster", "server"])
    parser.add_argument("--masters", type=int, default=3)
    parser.add_argument("--maxmemory", type=int, default=None, help="bytes per node (evicts allkeys-lru beyond)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.kind == "cluster":
        handle: LocalCluster | LocalRedis = start_cluster(args.masters, maxmemory=args.maxmemory)
    else:
        handle = start_server(maxmemory=args.maxmemory)
    logger.info("ready: %s  (Ctrl-C stops it)", handle.url)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        handle.stop()


if __name__ == "__main__":
    main()
