"""The memory plan's frontier: real tokens/s against the GPU memory budget, from a bench_train.py result.

usage: python bench/plot_frontier.py bench/results/train-h200.json docs/img/frontier.png
Prints the table the README shows and writes the plot (matplotlib, Agg).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def frontier(result: dict) -> list[dict]:
    """(budget, tokens/s, peak, predicted peak, plan) per budget, smallest first: the sweep's budget entries and the
    defaults (the whole card)."""
    # a budget's first entry only: *_noskip turns a lever off for a side-by-side baseline, *_repeat runs a plan again
    runs = [v for k, v in result.get("pipeline_variants", {}).items()
            if k.startswith("budget") and not k.split("/")[0].endswith(("_noskip", "_repeat"))]
    runs.append(result["pipeline"])
    # offloaded layers (tried, slower than recomputing, reverted) are not a plan the code makes
    runs = [r for r in runs if not (r.get("plan") or {}).get("offload_layers")]
    return sorted(({"budget_gib": r["budget_gib"], "real_tokens_per_s": r["real_tokens_per_s"],
                    "peak_allocated_gib": r["peak_allocated_gib"], "predicted_peak_gib": r["predicted_peak_gib"],
                    "plan": r["plan"]} for r in runs if r.get("budget_gib")), key=lambda r: r["budget_gib"])


def table(rows: list[dict], reference: dict | None) -> str:
    lines = ["| GPU memory budget | real tokens/s | peak allocated (predicted) | the plan chose |", "|---|---|---|---|"]
    for r in rows:
        p = r["plan"]
        mlp_only = p.get("recompute_mlp_layers") or 0  # results before the MLP-only mode have none
        kept = 32 - p["recompute_layers"] - mlp_only  # the 8B shape's 32 layers
        where = ", inputs on the host" if p["offload_activations"] else ""
        where += ", MLP in chunks" if p.get("chunk_recomputed") else ""
        where += f", {mlp_only} MLP-only" if mlp_only else ""
        tables = "tables on the host" if p["offload_embeddings"] else "tables on the GPU"
        lines.append(f"| {r['budget_gib']:g} GiB | {r['real_tokens_per_s']:,.0f} | {r['peak_allocated_gib']:.2f} GiB "
                     f"({r['predicted_peak_gib']:.2f}) | packs of {p['tokens']:,}, {p['recompute_layers']} layers "
                     f"recomputed{where}, {kept} kept, {tables} |")
    if reference:
        tps, peak = reference["real_tokens_per_s"], reference["peak_allocated_gib"]
        lines.append(f"| reference recipe | {tps:,.0f} | {peak:.2f} GiB | micro-batch 1 x 4, q/k/v/o, every layer "
                     "recomputed |")
    return "\n".join(lines)


def plot(rows: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot([r["budget_gib"] for r in rows], [r["real_tokens_per_s"] for r in rows], marker="o")
    for r in rows:
        ax.annotate(f"{r['real_tokens_per_s']:,.0f}", (r["budget_gib"], r["real_tokens_per_s"]),
                    textcoords="offset points", xytext=(4, -12), fontsize=8)
    ax.set_xscale("log")
    ax.set_xticks([r["budget_gib"] for r in rows], [f"{r['budget_gib']:g}" for r in rows])
    ax.set_xlabel("speed.gpu_memory_budget_gb (GiB, log scale)")
    ax.set_ylabel("real tokens/s")
    ax.set_title("Llama-3.1-8B shape, one H200: train_adapter's memory plan", fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png)


if __name__ == "__main__":
    result = json.loads(Path(sys.argv[1]).read_text())
    rows = frontier(result)
    print(table(rows, result.get("reference")))
    plot(rows, Path(sys.argv[2]))
