"""``python -m train --jobs N``: every (seed, trained entry) pair trained in a process of its own, then the
report assembled in the calling process from the finished runs; ``--entries`` runs a part of a config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from train.__main__ import main as train_main
from train.testing import TINY, _merge

SCHEMES = ["rope2d", "nope", "rope2d+linear"]
JOBS = ["rope2d", "rope2d+linear"]  # --jobs: one trained entry per seed (each child starts torch and timm anew)


def write_config(tmp_path: Path, name: str, **sections: object) -> Path:
    path = tmp_path / f"{name}.yaml"
    config = _merge(TINY, {"out_dir": str(tmp_path / name), "schemes": SCHEMES, "seeds": [0, 1], **sections})
    path.write_text(yaml.safe_dump(config))
    return path


def per_seed(run: Path) -> dict[str, dict]:
    data = json.loads((run / "results.json").read_text())
    return {name: {seed: r["accuracy"] for seed, r in entry["per_seed"].items()}
            for name, entry in data["schemes"].items()}


def test_jobs_train_each_seed_and_entry_apart_and_report_what_one_process_reports(tmp_path: Path, capsys) -> None:
    assert train_main(["--config", str(write_config(tmp_path, "one", schemes=JOBS)), "--quiet"]) == 0
    capsys.readouterr()
    assert train_main(["--config", str(write_config(tmp_path, "two", schemes=JOBS)), "--quiet", "--jobs", "2"]) == 0
    out = capsys.readouterr().out
    for seed in (0, 1):  # the trained entry, in a process of its own per seed
        assert f"seed {seed} rope2d: training in a process of its own" in out
        assert f"seed {seed} rope2d: trained" in out
        assert (tmp_path / "two" / f"seed_{seed}" / "rope2d" / "checkpoint.pt").exists()
    assert "seed 0 rope2d+linear: training" not in out  # evaluation only: the report's run evaluates it
    assert per_seed(tmp_path / "two") == per_seed(tmp_path / "one")
    assert "--jobs 2" in (tmp_path / "two" / "results.md").read_text()
    for seed in (0, 1):  # each seed's report is the assembling run's, with every entry
        assert list(json.loads((tmp_path / "two" / f"seed_{seed}" / "results.json").read_text())["schemes"]) == JOBS


def test_a_training_started_by_jobs_leaves_the_report_alone(tmp_path: Path) -> None:
    """A child of --jobs trains its entry and writes its files, but not the run folder's report: a committed report
    of the whole run is not replaced by one entry's while the other entries train."""
    from train.__main__ import parallel_jobs
    from train.experiment.loading import load_config

    path = write_config(tmp_path, "kids", schemes=JOBS)
    jobs = parallel_jobs(str(path), [], load_config(str(path), []))
    assert all("--no-report" in args for _, args in jobs)
    label, args = jobs[0]
    assert label == "seed 0 rope2d" and train_main(args[2:]) == 0  # what the child runs after "python -m train"
    seed_dir = tmp_path / "kids" / "seed_0"
    assert (seed_dir / "rope2d" / "checkpoint.pt").exists() and (seed_dir / "rope2d" / "eval.json").exists()
    assert not (seed_dir / "results.json").exists() and not (seed_dir / "results.md").exists()


def test_entries_run_a_part_of_the_config(tmp_path: Path) -> None:
    path = write_config(tmp_path, "part", seeds=None)
    assert train_main(["--config", str(path), "--quiet", "--entries", "rope2d+linear"]) == 0
    data = json.loads((tmp_path / "part" / "results.json").read_text())
    assert list(data["schemes"]) == ["rope2d", "rope2d+linear"]  # the evaluation-only entry brings its base
    assert not (tmp_path / "part" / "nope").exists()


@pytest.mark.parametrize(("args", "message"), [(["--jobs", "0"], "--jobs must be >= 1, got 0"),
                                               (["--entries", "rope3d"], "--entries rope3d: not entries")])
def test_bad_jobs_and_entries_are_refused(tmp_path: Path, capsys, args: list[str], message: str) -> None:
    assert train_main(["--config", str(write_config(tmp_path, "bad")), *args]) == 2
    assert message in capsys.readouterr().err


def test_key_value_after_entries_is_an_override(tmp_path: Path, capsys) -> None:
    """``--entries rope2d train.epochs=0``: the override is applied (and refused as a bad value), not taken for an
    entry's name."""
    path = str(write_config(tmp_path, "mixed"))
    assert train_main(["--config", path, "--entries", "rope2d", "train.epochs=0"]) == 2
    err = capsys.readouterr().err
    assert "epochs" in err and "not entries" not in err, err
    assert train_main(["--config", path, "--entries", "rope3d", "train.epochs=1"]) == 2
    assert "--entries rope3d: not entries" in capsys.readouterr().err
