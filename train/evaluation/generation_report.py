"""The generation run's report: scores per entry and size (mean ± std over seeds) beside each score's noise floor,
the published predictions read against them, and a plot of each score against size.

``results.json`` holds, per entry, each seed's scores at each size (``scores[seed][size]``), its training time and
loss curve; the run's floors (``floor[size]``: the reference set's first half against its second, the scorer's
accuracy on real images); the command, config and reference protocol. A run over several seeds is the union of its
seeds' files (``combine``).

A prediction (``Prediction``) names entries best first for one score; each implied pair is tested as the
classifier's orderings are (``train.evaluation.orderings``): the claimed better entry's mean advantage against twice
the standard error of the difference over seeds (Welch's): *agrees* beyond it in the claimed direction, *reversed*
beyond it the other way, a *tie* within it; *untested* with fewer than two seeds of either entry.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path
from typing import Any

from .report import duration, stat
from .scores import SCORE_NAMES

LOWER_IS_BETTER = {"fid": True, "patch_fid": True, "accuracy": False}
TITLES = {"fid": "FID (whole image, scorer features)", "patch_fid": "patch FID (crops of the training size)",
          "accuracy": "class accuracy of the conditional samples (%)"}  # fmt: skip


@dataclass(frozen=True)
class Prediction:
    """A published claim: ``entries`` best first on ``score`` above the training size."""

    source: str
    entries: tuple[str, ...]
    score: str = "fid"


PREDICTIONS: tuple[Prediction, ...] = (
    Prediction("DyPE (Issachar et al. 2025): DyPE-YaRN over YaRN over NTK over none, for a RoPE DiT",
               ("rope2d+yarn+dype", "rope2d+yarn", "rope2d+ntk", "rope2d")),
    Prediction("DyPE: DyPE-NTK over NTK", ("rope2d+ntk+dype", "rope2d+ntk")),
    Prediction("FiT / Lumina-Next: 2D RoPE with NTK over sin-cos", ("rope2d+ntk", "sincos2d")),
    Prediction("FiT / Lumina-Next: 2D RoPE with NTK over DiT's own (interpolating) sin-cos", ("rope2d+ntk", "dit")),
    Prediction("classifier (docs/resolution.md): LookHere over axial RoPE", ("lookhere2d", "rope2d")),
    Prediction("classifier (docs/resolution.md): iRPE over axial RoPE", ("irpe2d", "rope2d")),
    Prediction("classifier: the learned table over axial RoPE", ("learned2d", "rope2d")),
)  # fmt: skip


def values(results: dict[str, Any], entry: str, score: str, size: int) -> list[float]:
    """The entry's per-seed values of ``score`` at ``size`` (seeds that have it)."""
    per_seed = results["schemes"][entry]["scores"]
    return [s[str(size)][score] for s in per_seed.values() if str(size) in s]


def cell(vals: list[float]) -> str:
    return "—" if not vals else stat(vals)


def format_scores(results: dict[str, Any]) -> str:
    """Markdown: one table per score, one row per entry, one column per size, the floor as the first row."""
    sizes, train = results["sizes"], results["train_size"]
    head = " | ".join(f"{s} px ({s / train:.2g}x)" for s in sizes)
    out = []
    for score in SCORE_NAMES:
        better = "lower" if LOWER_IS_BETTER[score] else "higher"
        lines = [f"**{TITLES[score]}**, {better} is better", "", f"| entry | {head} |",
                 "| --- |" + " --- |" * len(sizes)]  # fmt: skip
        floor = " | ".join(f"{results['floor'][str(s)][score]:.1f}" for s in sizes)
        lines.append(f"| *floor: real against real* | {floor} |")
        for name in results["schemes"]:
            lines.append(f"| `{name}` | " + " | ".join(cell(values(results, name, score, s)) for s in sizes) + " |")
        out.append("\n".join(lines))
    return "\n\n".join(out)


def _se(a: list[float], b: list[float]) -> float | None:
    if len(a) < 2 or len(b) < 2:
        return None
    return math.sqrt(statistics.variance(a) / len(a) + statistics.variance(b) / len(b))


def verdict(results: dict[str, Any], p: Prediction, size: int) -> str:
    """``agrees`` / ``reversed`` / ``unresolved`` / ``untested`` for the prediction at ``size``, with its pairs."""
    present = [e for e in p.entries if e in results["schemes"] and values(results, e, p.score, size)]
    if len(present) < 2:
        return "not run"
    sign = -1.0 if LOWER_IS_BETTER[p.score] else 1.0
    said, states = [], []
    for hi, lo in combinations(present, 2):
        a, b = values(results, hi, p.score, size), values(results, lo, p.score, size)
        gap = sign * (statistics.fmean(a) - statistics.fmean(b))  # > 0: the claimed better one is better
        se = _se(a, b)
        state = "untested" if se is None else "agrees" if gap > 2 * se else "reversed" if gap < -2 * se else "tie"
        states.append(state)
        said.append(f"{hi} vs {lo}: {gap:+.1f}" + ("" if se is None else f" ± {2 * se:.1f}") + f" ({state})")
    if "reversed" in states:
        overall = "no"
    elif all(s == "agrees" for s in states):
        overall = "yes"
    elif all(s == "untested" for s in states):
        overall = "untested (one seed)"
    else:
        overall = "unresolved (ties)"
    return f"{overall}: " + "; ".join(said)


def format_predictions(results: dict[str, Any]) -> str:
    sizes = [s for s in results["sizes"] if s > results["train_size"]]
    lines = ["| prediction | score | size | verdict: gaps of the claimed better entry (± 2 SE) |",
             "| --- | --- | --- | --- |"]  # fmt: skip
    for p in PREDICTIONS:
        for size in sizes:
            lines.append(f"| {p.source} | {p.score} | {size} px | {verdict(results, p, size)} |")
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    """Each score against size: one panel per score, one line per entry (mean, std band), the floor dotted."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    sizes, train = results["sizes"], results["train_size"]
    names = list(results["schemes"])
    colors = colormaps["tab20" if len(names) > 10 else "tab10"]
    fig = Figure(figsize=(15.5, 4.4))
    axes = fig.subplots(1, len(SCORE_NAMES))
    for ax, score in zip(axes, SCORE_NAMES, strict=True):
        for i, name in enumerate(names):
            per = [values(results, name, score, s) for s in sizes]
            kept = [(s, v) for s, v in zip(sizes, per, strict=True) if v]
            if not kept:
                continue
            xs = [s for s, _ in kept]
            ys = [statistics.fmean(v) for _, v in kept]
            err = [statistics.stdev(v) if len(v) > 1 else 0.0 for _, v in kept]
            style = "--" if results["schemes"][name].get("base") else "-"
            ax.plot(xs, ys, style, marker="o", markersize=3.5, label=name, color=colors(i % colors.N))
            ax.fill_between(xs, [y - e for y, e in zip(ys, err, strict=True)],
                            [y + e for y, e in zip(ys, err, strict=True)], color=colors(i % colors.N), alpha=0.12,
                            lw=0)  # fmt: skip
        ax.plot(sizes, [results["floor"][str(s)][score] for s in sizes], ":", color="black", lw=1, label="floor")
        ax.axvline(train, color="grey", lw=0.8, ls=":")
        ax.set_title(TITLES[score], fontsize=9)
        ax.set_xlabel(f"sample size (px), trained at {train}")
        ax.set_xticks(sizes)
        ax.grid(alpha=0.3)
        if LOWER_IS_BETTER[score]:
            ax.set_yscale("log")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=8, frameon=False)
    seeds = len(results["seeds"])
    over = f"mean ± std over {seeds} seeds; " if seeds > 1 else ""
    fig.suptitle(f"{results['name']}: scores against sample size ({over}dashed: inference settings of a trained entry)",
                 fontsize=9)  # fmt: skip
    fig.tight_layout(rect=(0, 0, 1 - 2.0 / fig.get_figwidth(), 1))
    fig.savefig(path, dpi=110)


FIGURE_ENTRIES: tuple[str, ...] = ("dit", "rope2d", "rope2d+yarn+dype", "lookhere2d")  # the figure's rows, if run
FIGURE_CLASS = 9  # ankle boot: a shape whose repetition or stretching shows at a glance
GRID_COLUMNS, GRID_PADDING = 8, 1  # the sample grids' layout (``save_image(nrow=8, padding=1)``)


def sample_strip(path: Path, size: int, row: int, count: int = 4) -> Any:
    """The first ``count`` samples of class ``row`` from a saved sample grid, side by side, as an array."""
    from matplotlib.image import imread

    grid = imread(path)
    step = size + GRID_PADDING
    top = GRID_PADDING + row * step
    cells = [grid[top : top + size, GRID_PADDING + c * step : GRID_PADDING + c * step + size] for c in range(count)]
    strip = [cells[0]]
    for cell in cells[1:]:
        strip += [grid[top : top + size, :1] * 0 + 1, cell]  # a white column between samples
    import numpy as np

    return np.concatenate(strip, axis=1)


def class_figure(results: dict[str, Any], run_dir: Path, path: Path) -> list[str]:
    """One class generated at every size by up to three entries (``FIGURE_ENTRIES`` that have sample grids, seed
    ``results["seeds"][0]``): rows entries, columns sizes. Returns the entries drawn (none: no figure)."""
    from matplotlib.figure import Figure

    seed = results["seeds"][0]
    folder = run_dir / f"seed_{seed}" if (run_dir / f"seed_{seed}").is_dir() else run_dir
    sizes = results["sizes"]
    rows = [e for e in FIGURE_ENTRIES if all((folder / e / f"samples_{s}.png").is_file() for s in sizes)][:3]
    if not rows:
        return []
    fig = Figure(figsize=(2.3 * len(sizes) * 1.4, 1.25 * len(rows) + 0.6))
    axes = fig.subplots(len(rows), len(sizes), squeeze=False)
    for r, entry in enumerate(rows):
        for c, size in enumerate(sizes):
            ax = axes[r][c]
            ax.imshow(sample_strip(folder / entry / f"samples_{size}.png", size, FIGURE_CLASS), cmap="gray")
            ax.set_xticks([])
            ax.set_yticks([])
            if r == 0:
                ax.set_title(f"{size} px ({size / results['train_size']:.0f}x)", fontsize=9)
            if c == 0:
                ax.set_ylabel(entry, fontsize=8)
    fig.suptitle(f"{results['name']}: class {FIGURE_CLASS} (ankle boot), the first four samples of seed {seed}, "
                 f"trained at {results['train_size']} px", fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return rows


def combine(runs: list[dict[str, Any]], *, command: str | None) -> dict[str, Any]:
    """One report of several seeds' results (each seed's ``scores`` and training records merged per entry)."""
    first = runs[0]
    merged = {k: v for k, v in first.items() if k != "schemes"} | {"command": command, "schemes": {}}
    merged["seeds"] = sorted({s for r in runs for s in r["seeds"]})
    for r in runs:
        for name, entry in r["schemes"].items():
            into = merged["schemes"].setdefault(name, {"base": entry.get("base"), "scores": {}, "train_seconds": {},
                                                       "loss": {}})  # fmt: skip
            for key in ("scores", "train_seconds", "loss"):
                into[key].update(entry.get(key, {}))
    return merged


def write_report(results: dict[str, Any], run_dir: Path) -> str:
    """results.json, results.md and scores.png in ``run_dir``; returns the markdown tables."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    trained = sum(v or 0.0 for e in results["schemes"].values() for v in e.get("train_seconds", {}).values())
    tables = format_scores(results)
    seeds = ", ".join(map(str, results["seeds"]))
    md = [f"# {results['name']}", "",
          f"Made by `{results['command']}`; seeds {seeds}; {duration(trained)} of training summed over the entries "
          "and seeds.", "", f"Reference images: {results['reference']}", "",
          f"Each score compares {results['images']} samples per size with {results['reference_images']} test images "
          "at that size; the floor compares as many real images of the other half of the test set.", "",
          tables, "", "## Predictions", "", format_predictions(results), "",
          "Sample grids: `<entry>/samples_<size>.png` (one row per class).", ""]  # fmt: skip
    (run_dir / "results.md").write_text("\n".join(md))
    plot(results, run_dir / "scores.png")
    class_figure(results, run_dir, run_dir / "classes.png")
    return tables
