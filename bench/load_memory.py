"""Resident memory of an engine after loading, before any K/V is stored, per decode setting.

Each setting loads in a fresh process (``KVBoost.from_pretrained`` with ``captured_steps="off"``,
the CPU's eager decode): resident memory (``VmRSS``, with its anonymous and file-backed parts
from ``/proc/self/status``) against the model's float32 parameter bytes, and the decode kernel's
weight copy (``SmallRowLinears.copy_bytes``). Linux only.

With ``--starts N`` each setting loads N times, each in a fresh process: a row per start, then
whether every start chose the same kernel (the choice is a rule, never a timing).

Run: ``python -u bench/load_memory.py`` (``--model PATH``, several allowed; default the
embedded model and the Qwen 0.5B folder when present; ``--settings off packed int8 defaults``;
``--starts 10``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

SETTINGS = {
    "off": {"decode_weights": "model", "small_row_kernels": "off"},
    "packed": {"decode_weights": "model", "small_row_kernels": "packed"},
    "int8": {"decode_weights": "int8"},
    "defaults": {},
}


def _status() -> dict[str, int]:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
            fields[name] = int(value.split()[0]) * 1024
    return fields


def measure(model: str | None, settings: dict) -> dict:
    """In this process: load, then the figures."""
    import torch

    from kvboost_rag import KVBoost
    from kvboost_rag.dev.internals import internals

    torch.set_num_threads(2)
    engine = KVBoost.from_pretrained(model, show_progress=False, captured_steps="off", **settings)
    params = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    return {
        "model": engine.model_name, "settings": settings, "kernel": engine.small_row_kernel,
        "params": params, "copy": internals(engine).adapter.small_rows.copy_bytes, **_status(),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", default=None)
    parser.add_argument("--settings", nargs="+", choices=tuple(SETTINGS), default=list(SETTINGS))
    parser.add_argument("--starts", type=int, default=1, help="loads per setting, each in a fresh process")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the child: JSON of (model, settings)
    args = parser.parse_args(argv)
    if args.one is not None:
        model, settings = json.loads(args.one)
        print(json.dumps(measure(model, settings)))
        return
    models: list[str | None] = list(args.model) if args.model else [None]
    qwen = Path.home() / ".cache/kvboost-rag/models/qwen2.5-coder-0.5b-instruct"
    if not args.model and qwen.exists():
        models.append(str(qwen))
    print("| model | settings | kernel | float32 params MB | copy MB | resident MB (anon + file) | resident / params |")
    print("|---|---|---|---:|---:|---|---:|")
    for model in models:
        for settings in (SETTINGS[name] for name in args.settings):
            kernels = [_start_row(model, settings) for _ in range(args.starts)]
            if args.starts > 1:
                same = "the same kernel" if len(set(kernels)) == 1 else "DIFFERENT kernels"
                print(f"| {args.starts} starts | {', '.join(f'{k}={v}' for k, v in settings.items()) or 'defaults'} | "
                      f"{same}: {', '.join(sorted(set(kernels)))} | | | | |", flush=True)


def _start_row(model: str | None, settings: dict) -> str:
    """Loads once in a fresh process, prints its row and returns the kernel it chose."""
    out = subprocess.run(
        [sys.executable, __file__, "--one", json.dumps([model, settings])], capture_output=True, text=True, check=True
    ).stdout.strip().splitlines()[-1]
    r = json.loads(out)
    mb = 1e6
    print(
        f"| {r['model']} | {', '.join(f'{k}={v}' for k, v in settings.items()) or 'defaults'} | {r['kernel']} | "
        f"{r['params'] / mb:.0f} | {r['copy'] / mb:.0f} | {r['VmRSS'] / mb:.0f} ({r['RssAnon'] / mb:.0f} + "
        f"{r['RssFile'] / mb:.0f}) | {r['VmRSS'] / r['params']:.2f} |",
        flush=True,
    )
    return r["kernel"]

if __name__ == "__main__":
    main()
