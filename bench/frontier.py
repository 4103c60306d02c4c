"""The repair's speed/quality frontier from saved ``reuse_bench.py --out`` runs.

Reads one or more ``.json`` files written by ``bench/reuse_bench.py --out PATH`` and writes a
markdown table (per run and row: speedup against full prefill, median first-token KL, top-1,
identical 32-token answers, median first differing token) and a plot of median KL and
identical answers against speedup, one panel per run.

Run: ``python bench/frontier.py bench/results/repair_2threads_*.json --out bench/results/repair_frontier_2threads``
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any


def summarize(rows: dict[str, dict[str, list[float]]]) -> list[dict[str, Any]]:
    """One summary per row of a run (full prefill left out)."""
    out = []
    for name, vals in rows.items():
        if name == "full prefill":
            continue
        out.append(
            {
                "name": name,
                "speedup": statistics.median(vals["speedup"]),
                "cpu_speedup": statistics.median(vals["cpu_speedup"]),
                "median_kl": statistics.median(vals["kl"]),
                "top1": statistics.mean(vals["top1"]),
                "identical": sum(vals["identical"]),
                "prompts": len(vals["identical"]),
                "first_diff": statistics.median(vals["first_diff"]),
                "recomputed": statistics.mean(vals["ratio"]),
            }
        )
    return out


def table(runs: list[tuple[str, list[dict[str, Any]]]]) -> list[str]:
    """Markdown lines: one table per run."""
    lines: list[str] = []
    for label, summary in runs:
        lines += [
            f"### {label}",
            "",
            "| row | recomputed | speedup (median per prompt) | CPU-time speedup | median KL | top-1 | "
            "identical 32-token answers | first difference (median) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for row in sorted(summary, key=lambda r: -r["cpu_speedup"]):
            lines.append(
                f"| {row['name']} | {row['recomputed']:.2f} | {row['speedup']:.2f}x | {row['cpu_speedup']:.2f}x | "
                f"{row['median_kl']:.4f} | "
                f"{row['top1']:.2f} | {row['identical']:.0f}/{row['prompts']} | {row['first_diff']:.0f} |"
            )
        lines.append("")
    return lines


def short_label(header: str) -> str:
    """``corpus, template`` from a run's header line."""
    fields = dict(part.split("=", 1) for part in header.split() if "=" in part)
    template = "chat" if fields.get("chat") == "True" else "plain"
    return f"{fields.get('corpus', '?')}, {template}, {fields.get('prompt_tokens(median)', '?')} tokens"


def plot(runs: list[tuple[str, list[dict[str, Any]]]], path: Path) -> None:
    """Median KL (log) and identical answers against the CPU-time speedup, one column per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(runs), figsize=(4.8 * len(runs), 7), squeeze=False)
    for col, (label, summary) in enumerate(runs):
        top, bottom = axes[0][col], axes[1][col]
        for row in summary:
            kl = max(row["median_kl"], 1e-5)
            x = row["cpu_speedup"]
            top.scatter(x, kl)
            top.annotate(row["name"], (x, kl), fontsize=6)
            share = row["identical"] / row["prompts"]
            bottom.scatter(x, share)
            bottom.annotate(row["name"], (x, share), fontsize=6)
        top.set_yscale("log")
        top.axhline(0.01, color="grey", linestyle=":")
        top.axvline(4.0, color="grey", linestyle=":")
        bottom.axhline(0.5, color="grey", linestyle=":")
        bottom.axvline(4.0, color="grey", linestyle=":")
        top.set_title(short_label(label), fontsize=9)
        bottom.set_ylim(-0.05, 1.05)
        top.set_ylabel("median first-token KL")
        bottom.set_ylabel("identical 32-token answers")
        bottom.set_xlabel("TTFT speedup vs full prefill (CPU time)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="reuse_bench --out .json files")
    parser.add_argument("--out", type=Path, required=True, help="writes OUT.md and OUT.png")
    args = parser.parse_args(argv)
    runs = []
    for path in args.runs:
        data = json.loads(path.read_text())
        runs.append((data["header"], summarize(data["rows"])))
    lines = table(runs)
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    plot(runs, args.out.with_suffix(".png"))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
