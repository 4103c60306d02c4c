"""The C allocator's arenas capped for the process (``malloc_arenas``): threads that allocate
after the cap share the capped arenas (counted from glibc's own ``malloc_info`` report), the
environment's ``MALLOC_ARENA_MAX`` wins, and the engine sets the cap from its settings."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from pydantic import ValidationError

import kvboost_rag.engine as engine_module
from kvboost_rag import KVBoostSettings
from kvboost_rag.malloc_arenas import ARENA_ENV, _glibc, limit_malloc_arenas

glibc_only = pytest.mark.skipif(_glibc() is None, reason="arenas are capped on glibc only")

# Eight threads alive at once each allocate from the C heap, then the process reports its
# arenas: glibc gives a thread without one a new arena while fewer than the cap exist.
_COUNT_ARENAS = textwrap.dedent(
    """
    import ctypes, re, sys, tempfile, threading
    from kvboost_rag.malloc_arenas import limit_malloc_arenas
    cap = int(sys.argv[1])
    capped = limit_malloc_arenas(cap) if cap else False
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.fopen.restype = ctypes.c_void_p
    libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    together = threading.Barrier(9)  # the eight and this thread
    def allocate():
        libc.malloc(4096)
        together.wait()  # all eight alive: none can take an arena another one left
        together.wait()
    threads = [threading.Thread(target=allocate) for _ in range(8)]
    for thread in threads:
        thread.start()
    together.wait()
    with tempfile.NamedTemporaryFile(suffix=".xml") as report:
        stream = libc.fopen(report.name.encode(), b"w")
        libc.malloc_info(0, stream)
        libc.fclose(stream)
        arenas = len(re.findall(r"<heap nr=", open(report.name).read()))
    together.wait()
    for thread in threads:
        thread.join()
    print(capped, arenas)
    """
)


def _arenas(cap: int, env: dict[str, str] | None = None) -> tuple[bool, int]:
    environment = {key: value for key, value in os.environ.items() if key != ARENA_ENV}
    done = subprocess.run(
        [sys.executable, "-c", _COUNT_ARENAS, str(cap)], check=False, env={**environment, **(env or {})},
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    capped, arenas = done.stdout.split()
    return capped == "True", int(arenas)


@glibc_only
def test_threads_after_the_cap_share_the_capped_arenas():
    capped, arenas = _arenas(2)
    assert capped and 1 <= arenas <= 2, arenas
    uncapped, arenas_by_default = _arenas(0)
    assert not uncapped and arenas_by_default >= 5, arenas_by_default  # what the cap prevents


@glibc_only
def test_the_environments_cap_wins():
    capped, arenas = _arenas(2, {ARENA_ENV: "4"})
    assert not capped and 3 <= arenas <= 4, arenas


def test_a_cap_below_one_is_refused():
    with pytest.raises(ValueError, match="at least 1"):
        limit_malloc_arenas(0)
    with pytest.raises(ValidationError):
        KVBoostSettings(malloc_arenas=0)


@pytest.mark.parametrize(("setting", "expected"), [({}, [2]), ({"malloc_arenas": 6}, [6]), ({"malloc_arenas": None}, [])])
def test_the_engine_caps_the_arenas_from_its_settings(make_engine, monkeypatch, setting, expected):
    calls: list[int] = []
    monkeypatch.setattr(engine_module, "limit_malloc_arenas", calls.append)
    make_engine(**setting)
    assert calls == expected
