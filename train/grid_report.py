"""``python -m train.grid_report --config configs/grid_tasks_quick.yaml``: one config run on every grid task,
then one report across the tasks.

Each task is the config with ``data.dataset`` set to it, run by the trainer as any other config (its run
folder ``runs/<name>/<task>`` holds the usual results.md, results.json, accuracy.png and checkpoints; a
rerun reuses finished schemes). The shuffled-label control runs the lookup images with permuted training
labels, for the entries named by ``--control-schemes`` only. ``--jobs N`` trains N tasks at once, each in
a process of its own (one core each with the configs' ``threads: 1``). The report (``--out``) holds results.md (the
task x scheme table per protocol, at every evaluation grid), results.json (every task's results) and
accuracy.png (accuracy against grid size, one panel per task, one row per protocol).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .config.sections import ConfigError
from .data.datasets import DataError
from .data.grid_tasks import CONTROLS, GLYPH, classes_of
from .evaluation.convergence import NOT_CHECKED, rule_text, verdict_cell
from .evaluation.report import seed_tables, stat, within_of
from .evaluation.results import RunResult, convergences, lr_window_of_config
from .experiment.loading import load_config
from .experiment.run import run_experiment
from .runtime.jobs import run_jobs

TASKS: tuple[str, ...] = ("grid_lookup", "grid_direction", "grid_placement", "grid_count")
PROTOCOL_ORDER = ("canvas", "zoom", "resize")


class _NamesAndOverrides(argparse.Action):
    """``--tasks`` / ``--control-schemes``: names, up to the next option; a ``KEY=VALUE`` word among them is a
    config override (names never hold ``=``), kept for the overrides instead of being read as a name."""

    def __init__(self, *args: Any, accepted: tuple[str, ...] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.accepted = accepted  # the names allowed (None: any)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:  # fmt: skip
        names = [v for v in values if "=" not in v]
        namespace.moved_overrides = [*getattr(namespace, "moved_overrides", []), *(v for v in values if "=" in v)]
        if not names:
            raise argparse.ArgumentError(self, "expected at least one name before the KEY=VALUE overrides")
        unknown = [n for n in names if self.accepted is not None and n not in self.accepted]
        if unknown:
            raise argparse.ArgumentError(self, f"unknown {', '.join(unknown)}; accepted: {', '.join(self.accepted)}")
        setattr(namespace, self.dest, names)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m train.grid_report", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="YAML experiment config (configs/grid_tasks*.yaml)")
    tasks = [*TASKS, *CONTROLS]
    p.add_argument("--tasks", nargs="+", default=tasks, action=_NamesAndOverrides, accepted=tasks,
                   metavar="TASK",
                   help=f"tasks to run (default: all; accepted: {', '.join(tasks)})")
    p.add_argument("--control-schemes", nargs="+", default=["rope2d"], action=_NamesAndOverrides, metavar="ENTRY",
                   help="entries trained on a control task (default: rope2d, which learns the lookup)")
    p.add_argument("--out", default=None, help="report folder (default: the run folder runs/<name>)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--jobs", type=int, default=1,
                   help="train the tasks in this many processes at once (one core each at threads: 1), then report")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="config overrides for every task (anywhere on the line, also after --tasks)")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = p.parse_intermixed_args(argv)
    # the overrides in the order written (a later one wins), wherever they stood
    args.overrides = sorted([*args.overrides, *getattr(args, "moved_overrides", [])], key=argv.index)
    vars(args).pop("moved_overrides", None)
    return args


# the longest tasks first, so that parallel jobs finish together (counting trains on twice the images)
COST_ORDER: tuple[str, ...] = ("grid_count", "grid_lookup", "grid_direction", "grid_placement", *CONTROLS)


def run_parallel(args: argparse.Namespace) -> None:
    """Train every task of ``args`` in ``args.jobs`` processes at once (``python -m train.grid_report`` on one
    task each, its report in a scratch folder); each task's runs land in its run folder, where the report
    that follows reuses them. Raises if a task fails, naming it and the end of its output."""
    order = sorted(args.tasks, key=COST_ORDER.index)
    with tempfile.TemporaryDirectory() as scratch:
        jobs = [(task, ["-m", "train.grid_report", "--config", args.config, "--tasks", task, "--control-schemes",
                        *args.control_schemes, "--out", str(Path(scratch) / task), "--quiet", *args.overrides])
                for task in order]
        run_jobs(jobs, args.jobs, lambda text: print(text, flush=True))


def run_tasks(args: argparse.Namespace) -> tuple[dict[str, RunResult], Path]:
    """Run the config on each task; returns the results per task and the parent run folder."""
    results: dict[str, RunResult] = {}
    run_dir: Path | None = None
    quiet = ["progress=false"] if args.quiet else []
    for task in args.tasks:
        base = load_config(args.config, [*args.overrides, *quiet])
        run_dir = base.run_dir
        extra = [f"data.dataset={task}", f"name={base.name}_{task}", f"out_dir={base.run_dir / task}"]
        if task in CONTROLS:
            entries = [s.name for s in base.schemes if s.name in args.control_schemes]
            if not entries:
                raise ConfigError(f"--control-schemes {args.control_schemes}: none is an entry of {args.config}")
            extra.append(f"schemes=[{','.join(entries)}]")
        cfg = load_config(args.config, [*args.overrides, *quiet, *extra])
        words = ["python -m train --config", args.config, *args.overrides, *extra]
        results[task] = run_experiment(cfg, command=" ".join(shlex.quote(w) if " " in w else w for w in words))
    assert run_dir is not None
    return results, run_dir


def _cell(r: RunResult, scheme: str, protocol: str, size: int) -> str:
    return stat([t[protocol][size] for t in seed_tables(r.schemes[scheme])])


def training_seconds(results: dict[str, RunResult]) -> float:
    """Training time summed over every task, trained entry and seed (as recorded when each was trained, so a
    report assembled from reused runs still states what they cost; evaluation not included)."""
    total = 0.0
    for r in results.values():
        for entry in r.schemes.values():
            if entry.per_seed:
                total += sum(s.train_seconds or 0.0 for s in entry.per_seed.values())
            elif entry.train is not None:
                total += entry.train.seconds
    return total


def report_command(args: argparse.Namespace) -> str:
    """The command that makes this report again: the config, the tasks and control entries where not the defaults,
    the report folder, the jobs and the overrides."""
    defaults = _parse(["--config", args.config])
    controls = args.control_schemes != defaults.control_schemes
    words = ["python -m train.grid_report --config", args.config,
             *(["--tasks", *args.tasks] if args.tasks != defaults.tasks else []),
             *(["--control-schemes", *args.control_schemes] if controls else []),
             *(["--out", args.out] if args.out else []), *([f"--jobs {args.jobs}"] if args.jobs > 1 else []),
             *args.overrides]  # fmt: skip
    return " ".join(words)


def format_report(results: dict[str, RunResult], command: str, seconds: float) -> str:
    """Markdown: per protocol, one table per task (scheme x grid), the convergence of every trained entry, then
    the headline table."""
    first = next(iter(results.values()))
    seeds = first.seeds
    trained = training_seconds(results)
    lines = [
        "# Grid tasks: accuracy against grid size",
        "",
        f"Made by `{command}` in {seconds:.0f} s ({first.device}; training, summed over entries and seeds as "
        f"recorded when each was trained: {trained / 60:.1f} min). Trained at a {first.train_size // GLYPH} x "
        f"{first.train_size // GLYPH} grid ({first.train_size} px, {GLYPH} px cells = patches)"
        + (f", scenes also drawn at zooms {zooms[1:]} (cells of {GLYPH} x zoom px) on the same pixels; "
           if len(zooms := first.config.get("data", {}).get("zooms", [1])) > 1 else "; ")
        + (f"mean ± sample std over seeds {', '.join(map(str, seeds))}; " if len(seeds) > 1 else f"seed {seeds[0]}; ")
        + "top-1 %. canvas: a new image drawn by the task's rule at the evaluation grid (same cell size, more "
        "cells); zoom: the validation scenes of the training grid drawn on more pixels (larger cells, same "
        "cells); resize: the training-grid image resized (same content, larger cells, bicubic). Columns: "
        "patches per side.",
        "",
    ]
    for protocol in PROTOCOL_ORDER:
        if protocol not in first.protocols:
            continue
        lines += [f"## {protocol}", ""]
        for task, r in results.items():
            chance = 100.0 / len(classes_of(task))
            head = [f"{s // GLYPH}x{s // GLYPH}{' (train)' if s == r.train_size else ''}" for s in r.sizes]
            lines += [f"### {task} ({len(classes_of(task))} classes, chance {chance:.1f})", "",
                      "| scheme | " + " | ".join(head) + " |", "| --- |" + " ---: |" * len(head)]
            for name in r.schemes:
                lines.append(f"| {name} | " + " | ".join(_cell(r, name, protocol, s) for s in r.sizes) + " |")
            lines.append("")
    lines += format_convergence(results)
    tasks = [t for t in results if t not in CONTROLS]
    if "canvas" in first.protocols and tasks:
        sizes = first.sizes
        shown = [first.train_size, *[s for s in sizes if s != first.train_size][-2:]]  # training, 2x and 4x
        grids = " / ".join(str(s // GLYPH) for s in shown)
        cols = [f"{t.removeprefix('grid_')} {grids}" for t in tasks]
        lines += ["## headline: canvas, the training grid and the two largest grids (cells per side)", "",
                  "| scheme | " + " | ".join(cols) + " |", "| --- |" + " --- |" * len(cols)]
        for name in first.schemes:
            cells = [" / ".join(_cell(results[t], name, "canvas", s) for s in shown) if name in results[t].schemes
                     else "–" for t in tasks]  # fmt: skip
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        chance = [f"{100.0 / len(classes_of(t)):.1f}" for t in tasks]
        lines.append("| chance | " + " | ".join(chance) + " |")
        lines.append("")
    return "\n".join(lines)


def learnt_cell(r: RunResult, task: str, name: str) -> str:
    """Whether the entry learnt the task at the training grid: above chance by more than three standard errors
    of a chance-level accuracy on the evaluation images. ``yes (97.5)``; over seeds ``2/3 (mean 71.0)``."""
    values = [t[r.protocols[0]][r.train_size] for t in seed_tables(r.schemes[name])]
    p = 1.0 / len(classes_of(task))
    bar = 100.0 * (p + 3 * (p * (1 - p) / max(r.eval_images, 1)) ** 0.5)
    if len(values) == 1:
        return f"{'yes' if values[0] > bar else 'no'} ({values[0]:.1f})"
    return f"{sum(v > bar for v in values)}/{len(values)} (mean {statistics.fmean(values):.1f})"


def format_convergence(results: dict[str, RunResult]) -> list[str]:
    """Markdown lines: per task, each trained entry's convergence verdict and whether it learnt the task above
    chance at the training grid, then the two rules."""
    within = within_of(next(iter(results.values())))
    lines = ["## convergence", "", "| task | scheme | converged (gain over the last fifth ± noise) | learnt (training "
             "grid) |", "| --- | --- | --- | --- |"]
    unchecked = False
    for task, r in results.items():
        for name, entry in r.schemes.items():
            verdicts = convergences(entry, within_of(r))
            if verdicts:
                unchecked = unchecked or None in verdicts
                lines.append(f"| {task} | {name} | {verdict_cell(verdicts)} | {learnt_cell(r, task, name)} |")
    rule = rule_text(within, lr_window_of_config(next(iter(results.values())).config))
    lines += ["", f"{rule}." + (f" –: {NOT_CHECKED}." if unchecked else "") + " Learnt: top-1 at the "
              "training grid above chance by more than three standard errors of a chance-level accuracy on the "
              "evaluation images.", ""]
    return lines


def plot(results: dict[str, RunResult], path: Path) -> None:
    """Accuracy against grid size: one column per task, one row per protocol; chance as a grey line."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    first = next(iter(results.values()))
    protocols = [p for p in PROTOCOL_ORDER if p in first.protocols]
    names = list(dict.fromkeys(n for r in results.values() for n in r.schemes))
    colors = colormaps["tab20" if len(names) > 10 else "tab10"]
    fig = Figure(figsize=(3.3 * len(results) + 1.8, 3.0 * len(protocols) + 0.6))
    axes = fig.subplots(len(protocols), len(results), squeeze=False, sharey=True)
    for row, protocol in enumerate(protocols):
        for col, (task, r) in enumerate(results.items()):
            ax = axes[row][col]
            grids = [s // GLYPH for s in r.sizes]
            for name, entry in r.schemes.items():
                ys = [entry.accuracy[protocol][s] for s in r.sizes]
                color = colors(names.index(name) % colors.N)
                ax.plot(grids, ys, "--" if entry.scheme.base else "-", marker="o", markersize=3, color=color,
                        label=name)
                if entry.accuracy_std:
                    err = [entry.accuracy_std[protocol][s] for s in r.sizes]
                    ax.fill_between(grids, [y - e for y, e in zip(ys, err, strict=True)],
                                    [y + e for y, e in zip(ys, err, strict=True)], color=color, alpha=0.12, lw=0)
            ax.axhline(100.0 / len(classes_of(task)), color="grey", lw=0.8, ls=":")
            ax.set_xscale("log", base=2)
            ax.set_xticks(grids, [str(g) for g in grids])
            ax.minorticks_off()
            ax.set_title(f"{task.removeprefix('grid_')} ({protocol})", fontsize=9)
            ax.grid(alpha=0.3)
            if row == len(protocols) - 1:
                ax.set_xlabel(f"grid (cells per side), trained at {r.train_size // GLYPH}")
        axes[row][0].set_ylabel("top-1 accuracy (%)")
    handles, labels = [], []
    for ax in axes.flat:
        for h, label in zip(*ax.get_legend_handles_labels(), strict=True):
            if label not in labels:
                handles.append(h)
                labels.append(label)
    fig.legend(handles, labels, loc="center right", fontsize=8, frameon=False)
    seeds = f"mean ± std over {len(first.seeds)} seeds; " if len(first.seeds) > 1 else ""
    fig.suptitle(f"grid tasks: accuracy against grid size ({seeds}dashed: evaluation-only; dotted: chance)",
                 fontsize=9)
    fig.tight_layout(rect=(0, 0, 1 - 1.6 / fig.get_figwidth(), 1))
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    start = time.time()
    if args.jobs < 1:
        print(f"error: --jobs must be at least 1, got {args.jobs}", file=sys.stderr)
        return 2
    try:
        if args.jobs > 1:
            load_config(args.config, args.overrides)  # a bad config fails here, before any process starts
            run_parallel(args)
        results, run_dir = run_tasks(args)
    except (ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else run_dir
    out.mkdir(parents=True, exist_ok=True)
    md = format_report(results, report_command(args), time.time() - start)
    (out / "results.md").write_text(md)
    (out / "results.json").write_text(json.dumps({t: r.to_json() for t, r in results.items()}, indent=1))
    plot(results, out / "accuracy.png")
    print(md)
    print(f"\nwritten: {out}/results.md, results.json, accuracy.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
