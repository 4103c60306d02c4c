"""Scripts run as ``python SCRIPT ARGS`` runs them, each in a process forked from one that has
already imported what they all import (torch, transformers, the engine, both frameworks).

Each script still gets a process of its own: ``sys.argv`` and ``sys.path[0]`` as the
interpreter sets them, ``__name__ == "__main__"``, its own stdout and stderr, and the
interpreter's usual exit (``atexit`` handlers, non-daemon threads joined). What it saves is the
~7 s of imports every fresh interpreter pays, once per script. The parent imports modules only
(no tensor work, no thread), so forking it is safe.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_PARENT = r"""
import json, os, runpy, sys, threading
import torch, transformers.models.llama.modeling_llama, kvboost_rag.engine, kvboost_rag.corpus
import langchain_kvboost, langchain_core.vectorstores, llama_index.llms.kvboost, llama_index.core
from transformers import AutoModelForCausalLM, AutoTokenizer
assert threading.active_count() == 1, threading.enumerate()  # nothing running: safe to fork
print("ready", flush=True)
for line in sys.stdin:
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:
        for fd, path in ((1, job["stdout"]), (2, job["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        sys.argv, sys.path[0] = [job["script"], *job["args"]], os.path.dirname(job["script"])
        os.chdir(job["cwd"])
        runpy.run_path(job["script"], run_name="__main__")
        sys.exit(0)  # SystemExit and errors leave by the interpreter's own exit, as in `python SCRIPT`
    print(pid, flush=True)
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""


class ForkedScripts:
    """One parent process that forks a child per script run."""

    def __init__(self, env: dict[str, str]) -> None:
        self._parent = subprocess.Popen(
            [sys.executable, "-c", _PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
        )
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._parent.stdout, selectors.EVENT_READ)
        self._pending = b""  # read from the parent, not yet split into lines
        try:
            assert self._line(300) == "ready", "the parent process did not start"
        except BaseException:
            self._parent.kill()
            raise
        self._dir = tempfile.TemporaryDirectory(prefix="kvboost-scripts-")

    def run(self, script: Path, args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
        """Run ``script`` with ``args`` in a forked child; its exit status, stdout and stderr."""
        out, err = Path(self._dir.name, "stdout"), Path(self._dir.name, "stderr")
        job = {"script": str(script), "args": args, "cwd": str(cwd), "stdout": str(out), "stderr": str(err)}
        self._parent.stdin.write(json.dumps(job).encode() + b"\n")
        self._parent.stdin.flush()
        pid = int(self._line(30))
        try:
            code = int(self._line(timeout))
        except TimeoutError:
            os.kill(pid, signal.SIGKILL)
            self._line(30)  # the killed child's status, so that the next run reads its own
            raise
        return subprocess.CompletedProcess([str(script), *args], code, out.read_text(), err.read_text())

    def close(self) -> None:
        """End the parent process and remove the output files."""
        self._parent.stdin.close()
        self._parent.wait(timeout=30)
        self._dir.cleanup()

    def _line(self, timeout: float) -> str:
        """The parent's next line (read unbuffered: a buffered reader could hold a line that
        ``select`` then never reports)."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._pending:
            if not self._selector.select(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"no answer from the script's process within {timeout} s")
            chunk = os.read(self._parent.stdout.fileno(), 4096)
            if not chunk:
                raise RuntimeError(f"the scripts' parent process ended ({self._parent.wait()})")
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return line.decode().strip()
