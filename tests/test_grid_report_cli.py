"""``python -m train.grid_report``'s command line and what the docs say about its committed reports: overrides
anywhere on the line, progress while ``--jobs`` trains, the quick run's docs quoting its report."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from train import grid_report
from train.evaluation.results import RunResult

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/grid_tasks_quick.yaml"


@pytest.mark.parametrize("option", ["--tasks", "--control-schemes"])
def test_an_override_after_a_list_option_is_an_override_not_a_name(option: str) -> None:
    names = ["grid_lookup"] if option == "--tasks" else ["nope"]
    args = grid_report._parse(["--config", CONFIG, "train.epochs=1", option, *names, "model.depth=1", "--jobs", "2",
                               "seed=3"])  # fmt: skip
    assert args.overrides == ["train.epochs=1", "model.depth=1", "seed=3"]  # in the order written
    assert (args.tasks if option == "--tasks" else args.control_schemes) == names
    assert args.jobs == 2


def test_an_unknown_task_is_still_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        grid_report._parse(["--config", CONFIG, "--tasks", "grid_lokup", "train.epochs=1"])
    err = capsys.readouterr().err
    assert "grid_lokup" in err and "grid_lookup" in err


def test_parallel_jobs_print_each_tasks_progress(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--jobs 2``: the trainer's lines of each task come through (prefixed with the task), not only a line
    once a task has finished."""
    tiny = ["data.train_per_class=8", "data.val_per_class=2", "train.batch_size=16", "train.epochs=1",
            "eval.scales=[1]", "model.depth=1", "model.embed_dim=16", "schemes=[nope]"]  # fmt: skip
    args = ["--config", CONFIG, f"out_dir={tmp_path / 'runs'}", *tiny, "--tasks", "grid_lookup", "grid_direction",
            "--out", str(tmp_path / "report"), "--quiet", "--jobs", "2"]  # fmt: skip
    assert grid_report.main(args) == 0
    out = capsys.readouterr().out
    for task in ("grid_lookup", "grid_direction"):
        assert f"{task}: training in a process of its own" in out
        assert re.search(rf"^{task}: \[nope\] epoch 1/1", out, flags=re.M), out[:2000]
        assert re.search(rf"^{task}: \[nope\] accuracy at", out, flags=re.M)
        assert f"{task}: trained" in out


def test_docs_state_how_the_committed_quick_report_was_made() -> None:
    """docs/grid_tasks.md and README quote the quick report's own header: its command and its training time
    (summed over the entries as recorded when each was trained: a report that reused finished runs took a few
    seconds of wall time, which says nothing of the comparison's cost)."""
    header = (ROOT / "docs/grid_tasks/quick/results.md").read_text().splitlines()[2]
    command = re.match(r"Made by `([^`]+)` in \d+ s", header).group(1)
    minutes = re.search(r"as recorded when each was trained: (\d+\.\d) min\)", header).group(1)
    docs = (ROOT / "docs/grid_tasks.md").read_text()
    readme = (ROOT / "README.md").read_text()
    config = (ROOT / CONFIG).read_text()
    jobs = re.search(r"--jobs \d+", command)
    for text in (docs, readme, config):
        quick = [line for line in text.splitlines() if "grid_tasks_quick" in line or "quick config" in line]
        assert quick, "the quick run is described"
        for line in quick:  # a quick-run line names --jobs only when the report was made with it
            assert jobs is not None or "--jobs" not in line, line
        assert "7.5 min" not in text and "7 min 29 s" not in text
    assert f"{minutes} min" in docs and f"{minutes} min" in readme
    assert command.removeprefix("python ") in docs


def test_the_report_names_the_command_that_makes_it_again() -> None:
    """Tasks and control entries are named where they are not the defaults (a report of two tasks must not read as
    one of every task)."""
    plain = grid_report._parse(["--config", CONFIG, "--out", "r", "--jobs", "2", "seed=3"])
    assert grid_report.report_command(plain) == (
        f"python -m train.grid_report --config {CONFIG} --out r --jobs 2 seed=3")
    chosen = grid_report._parse(["--config", CONFIG, "--tasks", "grid_lookup", "grid_count", "--control-schemes",
                                 "nope", "--quiet", "train.epochs=1"])  # fmt: skip
    assert grid_report.report_command(chosen) == (
        f"python -m train.grid_report --config {CONFIG} --tasks grid_lookup grid_count --control-schemes nope "
        "train.epochs=1")


@pytest.mark.parametrize("report", sorted(str(p.parent.relative_to(ROOT / "docs/grid_tasks"))
                                          for p in (ROOT / "docs/grid_tasks").rglob("results.json")))
def test_committed_report_is_what_the_generator_writes(report: str) -> None:
    """Each committed grid report is format_report of its results.json, and the command in its header is the one
    that makes it again: the tasks it holds, named where they are not the config's default."""
    folder = ROOT / "docs/grid_tasks" / report
    md = (folder / "results.md").read_text()
    command, seconds = re.match(r"Made by `([^`]+)` in (\d+) s", md.splitlines()[2]).groups()
    results = {task: RunResult.from_json(r) for task, r in json.loads((folder / "results.json").read_text()).items()}
    args = grid_report._parse(shlex.split(command)[3:])
    assert args.tasks == list(results) and grid_report.report_command(args) == command
    assert grid_report.format_report(results, command, float(seconds)) == md
