"""PNG plots of the RAG benchmark (matplotlib, Agg backend: no display needed).

- ``ttft_vs_prompt_length.png``: TTFT against prompt tokens, one line per system, for the
  RAG prompts and the chat turns.
- ``quality_vs_recompute_ratio.png``: first-token KL, top-1, greedy agreement and exact match
  of kvboost-rag's selective, CacheBlend and attention repair against the recompute ratio.
- ``speed_quality_frontier.png``: median speedup against mean first-token KL per system, for
  the RAG prompts and the chat turns.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

#: KL values at or below this are drawn at this floor on log axes (exact methods).
KL_FLOOR = 1e-6

_STYLE = {
    "baseline": {"linestyle": "-", "linewidth": 2.4},
    "pypi": {"linestyle": "-.", "linewidth": 1.8},
    "kvboost-rag": {"linestyle": "-", "linewidth": 1.5},
    "adapter": {"linestyle": ":", "linewidth": 1.8},
}


def _systems(records: Sequence[Any]) -> list[str]:
    return list(dict.fromkeys(r.system for r in records))


def system_color(record: Any, ratios: Sequence[float]) -> Any:
    """One hue per kind of system, darker for larger recompute ratios."""
    if record.family == "baseline":
        return "black" if "full prefill" in record.system else "dimgray"
    if record.family == "pypi":
        return "tab:red"
    if record.family == "adapter":
        return "tab:purple" if "langchain" in record.system else "tab:brown"
    if record.strategy == "none":
        return "tab:olive"
    shade = 0.45 + 0.5 * (sorted(ratios).index(record.ratio) + 1) / max(len(ratios), 1)
    maps = {"selective": "Oranges", "cacheblend": "Blues", "attention": "Greens"}
    return plt.get_cmap(maps.get(record.strategy, "Greys"))(shade)


def plot_ttft_vs_length(records: Sequence[Any], path: Path) -> Path:
    """TTFT (s) against prompt tokens per system; one panel per workload."""
    workloads = [w for w in ("rag", "chat") if any(r.workload == w for r in records)]
    titles = {"rag": "RAG: system prompt + k shuffled documents", "chat": "Multi-turn chat (history grows)"}
    fig, axes = plt.subplots(1, len(workloads), figsize=(7.5 * len(workloads), 5.5), squeeze=False)
    names = _systems(records)
    ratios = sorted({r.ratio for r in records if r.family == "kvboost-rag" and r.strategy != "none"})
    for ax, workload in zip(axes[0], workloads):
        for name in names:
            rs = sorted(
                (r for r in records if r.system == name and r.workload == workload), key=lambda r: r.prompt_tokens
            )
            if not rs:
                continue
            style = _STYLE.get(rs[0].family, {})
            ax.plot(
                [r.prompt_tokens for r in rs],
                [r.ttft_ms / 1000 for r in rs],
                marker="o",
                markersize=3.5,
                color=system_color(rs[0], ratios),
                label=name,
                **style,
            )
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("time to first token (s)")
        ax.set_yscale("log")
        ax.set_title(titles[workload])
        ax.grid(True, which="both", alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def _ratio_points(summary: Sequence[dict[str, Any]], strategy: str) -> list[dict[str, Any]]:
    """kvboost-rag rows of ``strategy`` by ratio, with the no-repair row as ratio 0."""
    rows = [r for r in summary if r["family"] == "kvboost-rag"]
    none = [{**r, "ratio": 0.0} for r in rows if r["strategy"] == "none"]
    return none + sorted((r for r in rows if r["strategy"] == strategy), key=lambda r: r["ratio"])


def plot_quality_vs_ratio(
    summary: Sequence[dict[str, Any]], qa_summary: Sequence[dict[str, Any]], reference: str, path: Path
) -> Path:
    """Quality of kvboost-rag repair strategies against the recompute ratio.

    Args:
        summary: RAG workload rows (KL, top-1, greedy agreement).
        qa_summary: Rows of the workload whose exact match is shown (QA prompts when run).
        reference: Name of the full-prefill row.
        path: PNG to write.
    """
    fig, (ax_kl, ax_agree) = plt.subplots(1, 2, figsize=(12, 4.8))
    for strategy, color in (("selective", "tab:orange"), ("cacheblend", "tab:blue"), ("attention", "tab:green")):
        points = _ratio_points(summary, strategy)
        qa_points = _ratio_points(qa_summary, strategy)
        x = [100 * p["ratio"] for p in points]
        kl_mean = [max(p["kl_mean"] or 0.0, KL_FLOOR) for p in points]
        kl_median = [max(p["kl_median"] or 0.0, KL_FLOOR) for p in points]
        ax_kl.plot(x, kl_mean, marker="o", color=color, label=f"{strategy}: mean KL")
        ax_kl.plot(x, kl_median, marker="x", linestyle="--", color=color, label=f"{strategy}: median KL")
        ax_agree.plot(x, [p["top1"] for p in points], marker="o", color=color, label=f"{strategy}: top-1")
        greedy = [p["greedy"] for p in points]
        ax_agree.plot(x, greedy, marker="s", linestyle="--", color=color, label=f"{strategy}: greedy agree")
        exact = [p["exact"] for p in qa_points]
        qa_x = [100 * p["ratio"] for p in qa_points]
        ax_agree.plot(qa_x, exact, marker="^", linestyle=":", color=color, label=f"{strategy}: exact match (QA)")
    ref = next((r for r in qa_summary if r["system"] == reference), None)
    if ref is not None:
        ax_agree.axhline(ref["exact"], color="black", linewidth=1, label="full prefill: exact match (QA)")
    ax_kl.set_yscale("log")
    ax_kl.set_xlabel("recompute ratio (% of cached document tokens); 0 = no repair")
    ax_kl.set_ylabel("first-token KL vs full prefill")
    ax_agree.set_xlabel("recompute ratio (%)")
    ax_agree.set_ylabel("share")
    ax_agree.set_ylim(-0.05, 1.05)
    for ax in (ax_kl, ax_agree):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Quality against recompute ratio (KL, top-1, greedy: RAG prompts)")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def plot_frontier(summaries: dict[str, Sequence[dict[str, Any]]], path: Path) -> Path:
    """Median speedup against mean first-token KL, one point per system with logits, per workload."""
    titles = {"rag": "RAG prompts", "chat": "Multi-turn chat"}
    workloads = [w for w in ("rag", "chat") if summaries.get(w)]
    fig, axes = plt.subplots(1, len(workloads), figsize=(6.5 * len(workloads), 5.2), squeeze=False)
    ratios = sorted(
        {
            r["ratio"]
            for rows in summaries.values()
            for r in rows
            if r["family"] == "kvboost-rag" and r["strategy"] != "none"
        }
    )
    markers = {"baseline": "s", "pypi": "D", "kvboost-rag": "o", "adapter": "^"}
    for ax, workload in zip(axes[0], workloads):
        for row in summaries[workload]:
            if row["kl_mean"] is None:
                continue
            ax.scatter(
                row["speedup"],
                max(row["kl_mean"], KL_FLOOR),
                color=system_color(SimpleNamespace(**row), ratios),
                marker=markers.get(row["family"], "o"),
                s=55,
                zorder=3,
                label=row["system"],
            )
        ax.set_xscale("log")
        ax.set_yscale("log")
        speedup_format = FuncFormatter(lambda value, _: f"{value:g}x")
        ax.xaxis.set_major_formatter(speedup_format)
        ax.xaxis.set_minor_formatter(speedup_format)
        ax.tick_params(axis="x", which="minor", labelsize=7)
        ax.set_xlabel("median TTFT speedup over full prefill (log scale)")
        ax.set_ylabel(f"mean first-token KL vs full prefill (exact drawn at {KL_FLOOR:g})")
        ax.set_title(f"{titles[workload]}: lower right is better")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle("Speed / quality frontier")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def write_plots(
    records: Sequence[Any], summaries: dict[str, Sequence[dict[str, Any]]], out: Path, reference: str
) -> list[Path]:
    """All three plots into ``out``; returns their paths.

    Args:
        records: Per-prompt records of every system.
        summaries: Workload (``"rag"``, ``"chat"``) -> per-system summary rows.
        out: Output folder.
        reference: Name of the full-prefill row.
    """
    out.mkdir(parents=True, exist_ok=True)
    return [
        plot_ttft_vs_length(records, out / "ttft_vs_prompt_length.png"),
        plot_quality_vs_ratio(
            summaries["rag"], summaries.get("qa") or summaries["rag"], reference, out / "quality_vs_recompute_ratio.png"
        ),
        plot_frontier(summaries, out / "speed_quality_frontier.png"),
    ]
