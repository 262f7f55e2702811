"""``python -m train.orderings docs/fmnist_native/results.json --sizes 24 28``: the literature's orderings of
2D schemes above the training resolution (``train.evaluation.orderings.CLAIMS``) checked against a run's
per-seed accuracies, printed as a markdown table (docs/resolution.md holds it). A grid report's results.json (one
run per task) is read with ``--task``: ``python -m train.orderings docs/grid_tasks/far --task grid_count
--protocol canvas --sizes 128 256``. A generation run's (``task: generation``) is read against its predictions
(``train.evaluation.generation_report.PREDICTIONS``, the same two-standard-error rule) at every size above its
training size, or at ``--sizes``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .evaluation.generation_report import format_predictions
from .evaluation.orderings import CLAIMS, check, convergence_note, format_checks
from .evaluation.results import RunResult


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m train.orderings", description=__doc__.split("\n\n")[0])
    p.add_argument("results", help="a run's results.json, or the run folder that holds it")
    p.add_argument("--sizes", type=int, nargs="+", help="evaluation sizes (px) to check at (required but for a "
                   "generation run, whose sizes above training are the default)")
    p.add_argument("--protocol", default="resize", help="the protocol the accuracies were measured under")
    p.add_argument("--task", help="the task to read from a grid report's results.json (python -m train.grid_report)")
    p.add_argument("--claims", nargs="+", choices=list(CLAIMS),
                   help="which published orderings (default: every one of which the run trains two schemes)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    path = Path(args.results)
    path = path / "results.json" if path.is_dir() else path
    try:
        data = json.loads(path.read_text())
        if data.get("task") == "generation":
            return _generation(data, args.sizes)
        if not args.sizes:
            raise ValueError("give --sizes (the evaluation sizes to check at)")
        results = RunResult.from_json(_run_of(data, args.task))
        names = args.claims or [n for n, c in CLAIMS.items() if sum(s in results.schemes for s in c.schemes) >= 2]
        checks = [check(results, CLAIMS[name], args.protocol, size) for name in names for size in args.sizes]
    except (OSError, ValueError) as e:
        print(f"error: cannot read {path}: {e}", file=sys.stderr)
        return 2
    except KeyError as e:
        print(f"error: {e.args[0]}", file=sys.stderr)
        return 2
    seeds = len(results.seeds) or 1
    test = ("a pair agrees when its gap exceeds twice its standard error over seeds" if seeds > 1 else
            "one seed: the standard error over seeds is undefined, so no pair is tested (agrees or reversed); "
            "the gaps are one seed's")  # fmt: skip
    print(f"{results.name}: trained at {results.train_size} px, {seeds} seed(s), protocol {args.protocol}; {test}\n")
    print(format_checks(checks, results.train_size))
    note = convergence_note(checks)
    if note:
        print(f"\n{note}")
    skipped = [f"{c.source} ({', '.join(c.schemes)})" for n, c in CLAIMS.items() if n not in names]
    if skipped:
        print(f"\nnot checked, the run trains fewer than two of their schemes: {'; '.join(skipped)}")
    return 0


def _generation(results: dict, sizes: list[int] | None) -> int:
    """A generation run's predictions, each read at each size."""
    if sizes:
        unknown = [s for s in sizes if s not in results["sizes"]]
        if unknown:
            raise KeyError(f"{results['name']} has no samples at {unknown} px (sizes: {results['sizes']})")
        results = results | {"sizes": [s for s in results["sizes"] if s in sizes or s <= results["train_size"]]}
    seeds = len(results["seeds"])
    print(f"{results['name']}: trained at {results['train_size']} px, {seeds} seed(s); a pair agrees when its gap "
          "exceeds twice its standard error over seeds\n")
    print(format_predictions(results))
    return 0


def _run_of(data: dict, task: str | None) -> dict:
    """A run's results: the file's own, or one task's of a grid report (a results.json per task, by task name)."""
    if "schemes" in data:
        if task is not None:
            raise ValueError(f"--task {task}: this is one run's results, not a grid report's")
        return data
    if task is None or task not in data:
        given = "give --task" if task is None else f"no task {task!r}"
        raise ValueError(f"a grid report's results (one run per task): {given}; its tasks: {', '.join(data)}")
    return data[task]


if __name__ == "__main__":
    sys.exit(main())
