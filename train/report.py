"""Run outputs: results.json, results.md (accuracy and change from the training resolution per protocol),
accuracy.png (accuracy against resolution, one line per scheme, one panel per protocol)."""

from __future__ import annotations

import json
from pathlib import Path

from .results import Accuracy, RunResult

PROTOCOL_TITLES = {
    "resize": "resize: image resized to the evaluation size (more tokens, same content)",
    "canvas": "canvas: image kept at training scale on a larger background (only the grid grows)",
}


def _size_header(size: int, train_size: int | None) -> str:
    if train_size is None:
        return f"{size} px"
    scale = size / train_size
    return f"{size} px ({scale:.2g}x{', train' if size == train_size else ''})"


def format_tables(rows: dict[str, Accuracy], protocols: list[str], sizes: list[int], train_size: int | None) -> str:
    """Markdown: per protocol, top-1 accuracy per scheme x size, and the change from the training size."""
    out: list[str] = []
    header = "| scheme | " + " | ".join(_size_header(s, train_size) for s in sizes) + " |"
    rule = "| --- |" + " ---: |" * len(sizes)
    for protocol in protocols:
        out += [f"### {PROTOCOL_TITLES.get(protocol, protocol)}", "", "Top-1 accuracy (%):", "", header, rule]
        for name, acc in rows.items():
            cells = [f"{acc[protocol][s]:.1f}" if s in acc.get(protocol, {}) else "–" for s in sizes]
            out.append(f"| {name} | " + " | ".join(cells) + " |")
        if train_size is not None and train_size in sizes:
            out += ["", f"Change from the training resolution ({train_size} px), points:", "", header, rule]
            for name, acc in rows.items():
                base = acc[protocol][train_size]
                cells = [f"{acc[protocol][s] - base:+.1f}" if s != train_size else "0" for s in sizes]
                out.append(f"| {name} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def best_summary(results: RunResult) -> list[str]:
    """One line per protocol: the best scheme at the largest size, against learned2d and nope."""
    top, lines = max(results.sizes), []
    for protocol in results.protocols:
        accs = {name: acc[protocol][top] for name, acc in results.accuracies().items()}
        best = max(accs, key=lambda n: accs[n])
        refs = [f"{ref} {accs[ref]:.1f}" for ref in ("learned2d", "nope") if ref in accs]
        lines.append(f"{protocol} at {top} px: best {best} {accs[best]:.1f}" + (f" (vs {', '.join(refs)})"
                                                                               if refs else ""))
    return lines


def plot(results: RunResult, path: Path) -> None:
    """Accuracy against evaluation size: one panel per protocol, one line per scheme."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    protocols, sizes, train = results.protocols, results.sizes, results.train_size
    colors = colormaps["tab20" if len(results.schemes) > 10 else "tab10"]
    fig = Figure(figsize=(5.2 * len(protocols) + 2.2, 4.4))
    axes = fig.subplots(1, len(protocols), squeeze=False, sharey=True)
    for ax, protocol in zip(axes[0], protocols, strict=True):
        for i, (name, r) in enumerate(results.schemes.items()):
            ys = [r.accuracy[protocol][s] for s in sizes]
            style = "--" if r.scheme.base else "-"
            ax.plot(sizes, ys, style, marker="o", markersize=3.5, label=name, color=colors(i % colors.N))
        ax.axvline(train, color="grey", lw=0.8, ls=":")
        ax.set_title(protocol)
        ax.set_xlabel(f"evaluation size (px), trained at {train}")
        ax.set_xticks(sizes)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("top-1 accuracy (%)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=8, frameon=False)
    fig.suptitle(f"{results.name}: accuracy against resolution (dashed: evaluation-only variants)")
    fig.tight_layout(rect=(0, 0, 1 - 2.0 / fig.get_figwidth(), 1))
    fig.savefig(path, dpi=120)


def write_outputs(results: RunResult, run_dir: Path) -> str:
    """Write results.json, results.md and accuracy.png into the run folder; returns the markdown."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "results.json").write_text(json.dumps(results.to_json(), indent=2))
    tables = format_tables(results.accuracies(), results.protocols, results.sizes, results.train_size)
    notes = [
        f"# {results.name}",
        "",
        f"Trained at {results.train_size} px; every scheme with the same model, data order, seed and schedule. "
        f"Evaluated on {results.eval_images} validation images. Canvas: {results.canvas}.",
        "",
        *([f"Made by `{results.command}` in {results.wall_seconds:.0f} s ({results.device}, "
           f"{results.processes} process(es)).", ""] if results.command else []),
        "",
    ]
    extra = [f"- {line}" for line in best_summary(results)]
    train_rows = ["| scheme | train seconds | final train loss | val acc (train size) |",
                  "| --- | ---: | ---: | ---: |"]
    for name, r in results.schemes.items():
        t = r.train
        if t:
            val = "–" if t.val_acc is None else f"{t.val_acc:.1f}"
            train_rows.append(f"| {name} | {t.seconds:.0f} | {t.train_loss:.4f} | {val} |")
    md = "\n".join(notes) + tables + "\n" + "\n".join(extra) + "\n\n" + "\n".join(train_rows) + "\n"
    (run_dir / "results.md").write_text(md)
    plot(results, run_dir / "accuracy.png")
    return tables + "\n" + "\n".join(extra)
