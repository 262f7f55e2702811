"""Outputs: results.json, markdown tables in the seeds' format (scheme x length), PNG plots."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from matplotlib import colormaps
from matplotlib.figure import Figure

METRICS = {"exact": "whole answer exact", "token": "per answer token"}


def pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.0f}%"


def row_label(name: str, row: dict[str, Any]) -> str:
    if row["kind"] == "trained" and row["pos"] == "learned1d":
        return f"{name} (out_of_range={row['options'].get('out_of_range', 'error')})"
    if row["kind"] == "trained" and row["drope"]:
        return f"{name} ({row['pos']}, positions off for the last {100 * row['drope']:.0f}% of steps)"
    if row.get("scaling"):
        factor = row["scaling_options"].get("factor", "len/L" if row["scaling"] != "longrope" else None)
        return f"{name} (factor {factor})" if factor is not None else name
    return name


def markdown_table(results: dict[str, Any], task: str) -> str:
    """One task: a row per scheme, a column per evaluated length (the first is the training length)."""
    lengths, multiples = results["lengths"], results["multiples"]
    head = ["scheme"] + [f"{n} ({m}x{', train' if m == 1 else ''})" for n, m in zip(lengths, multiples, strict=True)]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for name, row in results["tasks"][task]["rows"].items():
        cells = [pct(row["accuracy"][str(n)]) for n in lengths]
        lines.append("| " + " | ".join([row_label(name, row), *cells]) + " |")
    return "\n".join(lines)


def markdown(results: dict[str, Any]) -> str:
    cfg = results["config"]
    parts = [
        f"# seq1d: {cfg['name']}",
        "",
        f"Trained at L = {results['train_length']} tokens for {cfg['train']['steps']} steps "
        f"(batch {cfg['train']['batch_size']}, seed {cfg['seed']}), model dim {cfg['model']['dim']}, "
        f"depth {cfg['model']['depth']}, {cfg['model']['heads']} heads; evaluated on "
        f"{cfg['eval']['samples']} fixed sequences per length. Wall time {results['wall_seconds']:.0f} s.",
    ]
    for task, data in results["tasks"].items():
        parts += ["", f"## {task} (accuracy, {METRICS[data['metric']]})", "", markdown_table(results, task)]
        if data.get("longrope"):
            lr = data["longrope"]
            how = (
                f"searched over {lr['tried']} candidates at lengths {lr['search_lengths']}"
                if lr["searched"]
                else "given"
            )
            parts += ["", f"LongRoPE factors ({how}): " + ", ".join(f"{v:.2f}" for v in lr["long_factors"])]
    return "\n".join(parts) + "\n"


COLORS = [*(colormaps["tab10"](i) for i in range(10)), "black", "gold", "magenta", "saddlebrown"]  # 14 lines


def extension_rows(rows: dict[str, Any]) -> list[str]:
    """Rows of the right-hand panel: every base with evaluation-only variants, its variants, and DroPE runs."""
    bases = {row["base"] for row in rows.values() if row["base"]}
    return [n for n, row in rows.items() if n in bases or row["base"] or row["drope"]]


def plot_accuracy(results: dict[str, Any], path: Path) -> None:
    """Accuracy against length per task: the trained schemes (left), extension methods and DroPE (right)."""
    tasks = list(results["tasks"])
    fig = Figure(figsize=(13, 4.6 * len(tasks)))
    axes = fig.subplots(len(tasks), 2, squeeze=False)
    lengths = results["lengths"]
    for (left, right), task in zip(axes, tasks, strict=True):
        rows = results["tasks"][task]["rows"]
        panels = (
            (left, [n for n, r in rows.items() if r["kind"] == "trained"], "schemes as trained"),
            (right, extension_rows(rows), "extension methods at evaluation, DroPE"),
        )
        for ax, names, title in panels:
            for i, name in enumerate(names):
                row = rows[name]
                ys = [math.nan if row["accuracy"][str(n)] is None else 100 * row["accuracy"][str(n)] for n in lengths]
                style = "-" if row["kind"] == "trained" else "--"
                ax.plot(lengths, ys, style, marker="o", ms=3, color=COLORS[i % len(COLORS)], label=name)
            ax.axvline(results["train_length"], color="grey", lw=0.8, ls=":")
            ax.set_xscale("log", base=2)
            ax.set_xticks(lengths, [str(n) for n in lengths])
            ax.set_ylim(-3, 103)
            ax.set_xlabel("sequence length (tokens; dotted: training length)")
            ax.set_ylabel("accuracy (%)")
            ax.set_title(f"{task}: {title}")
            ax.grid(alpha=0.3)
            if names:
                ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_depth_heatmaps(results: dict[str, Any], path: Path) -> None:
    """Passkey: depth x length accuracy, one small heat map per row."""
    rows = results["tasks"]["passkey"]["rows"]
    lengths = results["lengths"]
    cols = 5
    nrows = math.ceil(len(rows) / cols)
    fig = Figure(figsize=(2.6 * cols, 2.5 * nrows))
    axes = fig.subplots(nrows, cols, squeeze=False)
    for ax in axes.flat[len(rows) :]:
        ax.axis("off")
    for ax, (name, row) in zip(axes.flat, rows.items(), strict=False):
        depths = list(row["by_depth"][str(lengths[0])])
        grid = [
            [math.nan if row["by_depth"][str(n)][d] is None else 100 * row["by_depth"][str(n)][d] for n in lengths]
            for d in depths
        ]
        ax.imshow(grid, vmin=0, vmax=100, cmap="RdYlGn", aspect="auto")
        for r, values in enumerate(grid):
            for c, v in enumerate(values):
                ax.text(c, r, "–" if math.isnan(v) else f"{v:.0f}", ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], fontsize=7)
        ax.set_yticks(range(len(depths)), [f"{float(d):.2f}" for d in depths], fontsize=7)
        ax.set_title(name, fontsize=8)
    fig.supxlabel("sequence length")
    fig.supylabel("key depth (0: start, 1: next to the question)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_loss(results: dict[str, Any], path: Path) -> None:
    """Training loss curves of the trained schemes (DroPE's jump when positions are dropped shows here)."""
    tasks = list(results["tasks"])
    fig = Figure(figsize=(5.5 * len(tasks), 4))
    axes = fig.subplots(1, len(tasks), squeeze=False)
    for ax, task in zip(axes[0], tasks, strict=True):
        for name, row in results["tasks"][task]["rows"].items():
            if row["kind"] == "trained":
                steps, losses = zip(*row["train"]["curve"], strict=True)
                ax.plot(steps, losses, label=name)
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel("answer loss")
        ax.set_title(task)
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_outputs(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """results.json, results.md and the PNGs; returns the written paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "results.json", out_dir / "results.md", out_dir / "accuracy.png", out_dir / "loss.png"]
    tmp = paths[0].with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=1))
    tmp.replace(paths[0])
    paths[1].write_text(markdown(results))
    plot_accuracy(results, paths[2])
    plot_loss(results, paths[3])
    if "passkey" in results["tasks"]:
        paths.append(out_dir / "passkey_depth.png")
        plot_depth_heatmaps(results, paths[-1])
    return paths
