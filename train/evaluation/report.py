"""Run outputs: results.json, results.md (accuracy and change from the training resolution per protocol,
fine-tune-at-target), accuracy.png (accuracy against resolution, one line per scheme, one panel per
protocol, fine-tuned accuracy as stars). Over several seeds, cells read mean ± sample std and the plot
draws mean ± std bands and error bars. The training table says per trained entry whether it had converged
(``train.evaluation.convergence``)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from .convergence import NOT_CHECKED, rule_text, verdict_cell
from .results import Accuracy, RunResult, SchemeResult, convergences, lr_window_of_config, within_of_config

PROTOCOL_TITLES = {
    "resize": "resize: image resized to the evaluation size (more tokens, same content)",
    "canvas": "canvas: image kept at training scale on a larger background (only the grid grows)",
    "zoom": "zoom: the same scene drawn on more pixels (every cell larger; the grid of cells unchanged)",
}


def _size_header(size: int, train_size: int | None) -> str:
    if train_size is None:
        return f"{size} px"
    scale = size / train_size
    return f"{size} px ({scale:.2g}x{', train' if size == train_size else ''})"


def stat(values: list[float], sign: str = "") -> str:
    """One value as ``71.5``; several (seeds) as ``71.5 ± 0.8`` (mean ± sample std)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return f"{mean:{sign}.1f}"
    return f"{mean:{sign}.1f} ± {statistics.stdev(values):.1f}"


def seed_tables(r: SchemeResult) -> list[Accuracy]:
    """The entry's zero-shot table per seed (one table for a single-seed run)."""
    return [s.accuracy for s in r.per_seed.values()] or [r.accuracy]


def format_tables(rows: dict[str, list[Accuracy]], protocols: list[str], sizes: list[int],
                  train_size: int | None) -> str:
    """Markdown: per protocol, top-1 accuracy per scheme x size, and the change from the training size.

    ``rows`` holds each scheme's table per seed; several seeds give mean ± std cells (the change's std is
    that of each seed's own change)."""
    out: list[str] = []
    header = "| scheme | " + " | ".join(_size_header(s, train_size) for s in sizes) + " |"
    rule = "| --- |" + " ---: |" * len(sizes)
    for protocol in protocols:
        out += [f"### {PROTOCOL_TITLES.get(protocol, protocol)}", "", "Top-1 accuracy (%):", "", header, rule]
        for name, tables in rows.items():
            cells = [stat([t[protocol][s] for t in tables]) if s in tables[0].get(protocol, {}) else "–"
                     for s in sizes]
            out.append(f"| {name} | " + " | ".join(cells) + " |")
        if train_size is not None and train_size in sizes:
            out += ["", f"Change from the training resolution ({train_size} px), points:", "", header, rule]
            for name, tables in rows.items():
                cells = [stat([t[protocol][s] - t[protocol][train_size] for t in tables], "+")
                         if s != train_size else "0" for s in sizes]
                out.append(f"| {name} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def format_finetune(results: RunResult) -> str:
    """Markdown: zero-shot and fine-tuned accuracy at the target size, per trained scheme."""
    ft = results.config.get("finetune", {})
    size, train = ft.get("size"), results.train_size
    tuned = {name: r for name, r in results.schemes.items() if r.finetuned}
    if size is None or not tuned:
        return ""
    out = [f"### fine-tune at target: {ft['steps']} steps on training images resized to {size} px, "
           "then evaluated there (resize)", "",
           f"| scheme | {train} px (train), zero-shot | {size} px, zero-shot | {size} px, fine-tuned | gain, points |",
           "| --- | ---: | ---: | ---: | ---: |"]
    for name, r in tuned.items():
        seeds = list(r.per_seed.values())
        zero = [s.accuracy for s in seeds] or [r.accuracy]
        after = [s.finetuned["resize"][size] for s in seeds] or [r.finetuned["resize"][size]]
        at_train = stat([z["resize"][train] for z in zero]) if train in zero[0].get("resize", {}) else "–"
        if size in zero[0].get("resize", {}):
            before, gain = stat([z["resize"][size] for z in zero]), stat(
                [a - z["resize"][size] for a, z in zip(after, zero, strict=True)], "+")
        else:
            before = gain = "–"
        out.append(f"| {name} | {at_train} | {before} | {stat(after)} | {gain} |")
    return "\n".join(out) + "\n"


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
    """Accuracy against evaluation size: one panel per protocol, one line per scheme (mean ± std band over
    seeds), fine-tuned accuracy at the target size as a star with its error bar (resize panel)."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    protocols, sizes, train = results.protocols, results.sizes, results.train_size
    colors = colormaps["tab20" if len(results.schemes) > 10 else "tab10"]
    fig = Figure(figsize=(5.2 * len(protocols) + 2.2, 4.4))
    axes = fig.subplots(1, len(protocols), squeeze=False, sharey=True)
    for ax, protocol in zip(axes[0], protocols, strict=True):
        for i, (name, r) in enumerate(results.schemes.items()):
            color = colors(i % colors.N)
            ys = [r.accuracy[protocol][s] for s in sizes]
            style = "--" if r.scheme.base else "-"
            ax.plot(sizes, ys, style, marker="o", markersize=3.5, label=name, color=color)
            if r.accuracy_std:
                err = [r.accuracy_std[protocol][s] for s in sizes]
                ax.fill_between(sizes, [y - e for y, e in zip(ys, err, strict=True)],
                                [y + e for y, e in zip(ys, err, strict=True)], color=color, alpha=0.12, lw=0)
            if protocol == "resize" and r.finetuned:
                (size, acc), = r.finetuned["resize"].items()
                std = r.finetuned_std.get("resize", {}).get(size, 0.0)
                ax.errorbar([size], [acc], yerr=[std], fmt="*", markersize=9, capsize=3, color=color)
        ax.axvline(train, color="grey", lw=0.8, ls=":")
        ax.set_title(protocol)
        ax.set_xlabel(f"evaluation size (px), trained at {train}")
        ax.set_xticks(sizes)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("top-1 accuracy (%)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=8, frameon=False)
    seeds = f"mean ± std over {len(results.seeds)} seeds; " if len(results.seeds) > 1 else ""
    tuned = "; stars: fine-tuned at the target size" if any(r.finetuned for r in results.schemes.values()) else ""
    fig.suptitle(f"{results.name}: accuracy against resolution\n({seeds}dashed: evaluation-only variants{tuned})",
                 fontsize=9)
    fig.tight_layout(rect=(0, 0, 1 - 2.0 / fig.get_figwidth(), 1))
    fig.savefig(path, dpi=120)


def within_of(results: RunResult) -> float:
    """The convergence tolerance (points) the run was configured with."""
    return within_of_config(results.config)


def compute_seconds(results: RunResult) -> float:
    """Training plus fine-tuning time summed over every entry and seed: what the comparison cost. (The wall
    time of the call that wrote the report is not: a resumed run's last call only finds the entries done.)"""
    total = 0.0
    for r in results.schemes.values():
        if r.per_seed:
            total += sum((s.train_seconds or 0.0) + (s.finetune_seconds or 0.0) for s in r.per_seed.values())
        else:
            total += (r.train.seconds if r.train is not None else 0.0) + (r.finetune_seconds or 0.0)
    return total


def duration(seconds: float) -> str:
    """``4 s``, ``12 min 5 s``, ``2 h 49 min``."""
    s = round(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"


def write_outputs(results: RunResult, run_dir: Path) -> str:
    """Write results.json, results.md and accuracy.png into the run folder; returns the markdown."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "results.json").write_text(json.dumps(results.to_json(), indent=2))
    rows = {name: seed_tables(r) for name, r in results.schemes.items()}
    tables = format_tables(rows, results.protocols, results.sizes, results.train_size)
    finetune = format_finetune(results)
    if finetune:
        tables += "\n" + finetune
    train_cfg = results.config.get("train", {})
    sizes = train_cfg.get("sizes") or train_cfg.get("size_range")
    seeds = results.seeds or [results.config.get("seed", 0)]
    multires = {name: r for name, r in results.schemes.items() if r.scheme.sizes}
    augmented = {name: r for name, r in results.schemes.items() if r.scheme.augment}
    notes = [
        f"# {results.name}",
        "",
        f"Trained at {results.train_size} px"
        + (f" (multi-resolution: one size per step from {sizes} px, none above {results.train_size})" if sizes else "")
        + "; every scheme with the same model, data order, seed and schedule. "
        + (f"Seeds {', '.join(map(str, seeds))}: cells are mean ± sample std over seeds. " if len(seeds) > 1
           else f"Seed {seeds[0]}. ")
        + f"Evaluated on {results.eval_images} validation images. Canvas: {results.canvas}.",
        "",
        *([f"Evaluated weights: the EMA of the training weights (timm ModelEmaV3, decay {train_cfg['ema_decay']}"
           f"{', with its warm-up' if train_cfg.get('ema_warmup') else ''}), also for the val acc column and the "
           "fine-tune phase's start.", ""] if train_cfg.get("ema") else []),
        *([f"Multi-resolution entries (one size per step, none above {results.train_size} px): "
           + ", ".join(f"{name} {r.scheme.sizes}" for name, r in multires.items()) + ".", ""] if multires else []),
        *([f"Entries with their own augmentation (data.augment: {results.config['data']['augment']}): "
           + ", ".join(f"{name} {r.scheme.augment}" for name, r in augmented.items()) + ".", ""] if augmented else []),
        *([f"Made by `{results.command}` ({results.device}, {results.processes} process(es)): "
           f"{duration(compute_seconds(results))} of training and fine-tuning, summed over the entries"
           f"{' and seeds' if len(seeds) > 1 else ''}.", ""] if results.command else []),
        "",
    ]
    extra = [f"- {line}" for line in best_summary(results)]
    first = f" (seed {seeds[0]})" if len(seeds) > 1 else ""
    within = within_of(results)
    train_rows = [f"| scheme | train seconds{first} | fine-tune seconds{first} | final train loss{first} | "
                  "val acc (train size) | converged (gain over the last fifth ± noise) |",
                  "| --- | ---: | ---: | ---: | ---: | --- |"]
    unchecked = False
    for name, r in results.schemes.items():
        t = r.train
        if t:
            val = "–" if t.val_acc is None else f"{t.val_acc:.1f}"
            ft = "–" if r.finetune_seconds is None else f"{r.finetune_seconds:.0f}"
            verdicts = convergences(r, within)
            unchecked = unchecked or None in verdicts
            train_rows.append(f"| {name} | {t.seconds:.0f} | {ft} | {t.train_loss:.4f} | {val} | "
                              f"{verdict_cell(verdicts)} |")
    rule = rule_text(within, lr_window_of_config(results.config))
    train_rows += ["", f"{rule}." + (f" –: {NOT_CHECKED}." if unchecked else "")]
    md = "\n".join(notes) + tables + "\n" + "\n".join(extra) + "\n\n" + "\n".join(train_rows) + "\n"
    (run_dir / "results.md").write_text(md)
    plot(results, run_dir / "accuracy.png")
    return tables + "\n" + "\n".join(extra)
