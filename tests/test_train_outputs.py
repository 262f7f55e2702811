"""End to end: the run folder's files, the evaluate entry point, evaluation-only variants and DroPE."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from PIL import Image

import vispos
from train.__main__ import main as train_main
from train.evaluate import main as evaluate_main
from train.evaluation.results import RunResult
from train.experiment.run import run_experiment
from train.testing import tiny_config

Run = tuple[Path, RunResult]
SCHEMES = ["learned2d", "rope2d", "rope2d+yarn", {"name": "rope2d_drope", "pos": "rope2d", "drope": 0.4}]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    out = tmp_path_factory.mktemp("run")
    return out, run_experiment(tiny_config(out, schemes=SCHEMES, model={"embed_dim": 48, "num_heads": 3},
                                          train={"checkpoint_every": 0}))


def test_results_json_has_every_scheme_protocol_and_size(run: Run) -> None:
    out, results = run
    saved = json.loads((out / "results.json").read_text())
    assert saved == json.loads(json.dumps(results.to_json()))
    assert saved["sizes"] == [20, 28, 40] and saved["protocols"] == ["resize", "canvas"] and saved["train_size"] == 28
    assert list(saved["schemes"]) == ["learned2d", "rope2d", "rope2d+yarn", "rope2d_drope"]
    for r in saved["schemes"].values():
        assert set(r["accuracy"]) == {"resize", "canvas"}
        for acc in r["accuracy"].values():
            assert set(acc) == {"20", "28", "40"} and all(0.0 <= v <= 100.0 for v in acc.values())
        # the training size is the same image under both protocols
        assert r["accuracy"]["resize"]["28"] == r["accuracy"]["canvas"]["28"]
    assert saved["schemes"]["rope2d+yarn"]["train"] is None and saved["schemes"]["rope2d+yarn"]["base"] == "rope2d"
    assert len(saved["schemes"]["rope2d"]["train"]["history"]) == 2


def test_eval_only_variant_shares_training_and_differs_only_beyond_it(run: Run) -> None:
    _, results = run
    plain, yarn = results.schemes["rope2d"].accuracy, results.schemes["rope2d+yarn"].accuracy
    for protocol in ("resize", "canvas"):
        assert yarn[protocol][28] == plain[protocol][28] and yarn[protocol][20] == plain[protocol][20]
    assert not (Path(run[0]) / "rope2d+yarn" / "checkpoint.pt").exists()


def test_results_md_png_and_csv(run: Run) -> None:
    out, results = run
    md = (out / "results.md").read_text()
    assert md.count("Top-1 accuracy (%):") == 2 and md.count("Change from the training resolution") == 2
    assert "### resize" in md and "### canvas" in md and "28 px (1x, train)" in md
    rows = [ln for ln in md.splitlines() if ln.startswith("| rope2d+yarn |")]
    assert len(rows) == 4  # accuracy and change, per protocol
    acc = results.schemes["learned2d"].accuracy["canvas"]
    assert f"| learned2d | {acc[20]:.1f} | {acc[28]:.1f} | {acc[40]:.1f} |" in md
    with Image.open(out / "accuracy.png") as img:
        assert img.format == "PNG" and img.size[0] > 1.8 * img.size[1]  # two panels side by side
    with open(out / "rope2d" / "log.csv") as f:
        log = list(csv.DictReader(f))
    assert [r["epoch"] for r in log] == ["1", "2"] and all(float(r["train_loss"]) > 0 for r in log)
    assert {"train_loss", "train_acc", "val_acc", "lr"} <= set(log[0])
    with open(out / "rope2d_drope" / "log.csv") as f:
        assert [r["drope"] for r in csv.DictReader(f)] == ["False", "True"]


def test_drope_model_is_evaluated_without_positions(run: Run) -> None:
    out, results = run
    ck = torch.load(out / "rope2d_drope" / "checkpoint.pt", weights_only=True)
    assert [r["drope"] for r in ck["history"]] == [False, True]  # 40% of 10 steps: epoch 2 without positions
    # re-evaluating the checkpoint (which switches positions off) reproduces the run's numbers exactly
    args = ["--checkpoint", str(out / "rope2d_drope" / "checkpoint.pt"), "--sizes", "20", "28", "40", "--quiet",
            "--out", str(out / "re.json")]
    assert evaluate_main(args) == 0
    again = json.loads((out / "re.json").read_text())["accuracy"]["rope2d_drope"]
    assert again == results.to_json()["schemes"]["rope2d_drope"]["accuracy"]


def test_evaluate_entry_point_reproduces_and_extends(run: Run, capsys: pytest.CaptureFixture) -> None:
    out, results = run
    args = ["--checkpoint", str(out / "rope2d" / "checkpoint.pt"), "--sizes", "28", "40", "56", "--quiet",
            "--scaling", "yarn", "--out", str(out / "yarn.json")]
    assert evaluate_main(args) == 0
    printed = capsys.readouterr().out
    assert "| rope2d+yarn |" in printed and "56 px (2x)" in printed
    acc = json.loads((out / "yarn.json").read_text())["accuracy"]["rope2d+yarn"]
    for protocol in ("resize", "canvas"):
        assert acc[protocol]["40"] == results.schemes["rope2d+yarn"].accuracy[protocol][40]
        assert "56" in acc[protocol]


@pytest.mark.parametrize("content", [b"iabcdefg", b"garbage\x00\x01 not a checkpoint", b""])
def test_evaluate_names_a_file_that_is_not_a_checkpoint(content: bytes, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture) -> None:
    bad = tmp_path / "bad.pt"
    bad.write_bytes(content)
    assert evaluate_main(["--checkpoint", str(bad), "--sizes", "28", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"cannot load checkpoint {bad}: not a file the trainer wrote" in err
    assert "weights_only" not in err  # not torch's advice to load untrusted pickles


def test_variant_really_switches_scaling_on(run: Run) -> None:
    from train.config.sections import SchemeConfig
    from train.engine.models import build_model, configure_eval

    out, _ = run
    cfg = tiny_config(out, schemes=SCHEMES, model={"embed_dim": 48, "num_heads": 3})
    model = build_model(cfg.model, cfg.scheme("rope2d"), img_size=28, num_classes=10, in_chans=1, seed=cfg.seed)
    model.load_state_dict(torch.load(out / "rope2d" / "checkpoint.pt", weights_only=True)["model"])
    model.eval()
    x = torch.randn(2, 1, 56, 56)
    before = model(x)
    configure_eval(model, SchemeConfig(name="v", base="rope2d", scaling="yarn"), (7, 7))
    assert model.vispos_cfg["scaling"]["scaling"] == "yarn"
    assert not torch.allclose(before, model(x))
    vispos.configure(model, scaling=None)
    torch.testing.assert_close(before, model(x))


def test_rerun_reuses_finished_work(run: Run, tmp_path: Path) -> None:
    out, results = run
    cfg_path = tmp_path / "c.yaml"
    import yaml

    cfg_path.write_text(yaml.safe_dump(json.loads((out / "results.json").read_text())["config"]))
    before = (out / "rope2d" / "checkpoint.pt").stat().st_mtime_ns
    assert train_main(["--config", str(cfg_path), "--quiet"]) == 0
    assert (out / "rope2d" / "checkpoint.pt").stat().st_mtime_ns == before  # nothing retrained
    assert json.loads((out / "results.json").read_text())["schemes"]["rope2d"]["accuracy"] == \
        results.to_json()["schemes"]["rope2d"]["accuracy"]
    assert f"Made by `python -m train --config {cfg_path} --quiet`" in (out / "results.md").read_text()


def test_folder_dataset_run_with_randaugment_and_mixup(tmp_path: Path) -> None:
    from train.testing import make_image_folder

    root = make_image_folder(tmp_path / "tree", classes=3, per_class=6, size=20)
    (root / "train" / "class_2" / "img_5.png").write_bytes(b"broken")
    cfg = tiny_config(
        tmp_path / "run", schemes=["alibi2d", "learned2d+rope2d"],
        data={"dataset": "folder", "root": str(root), "img_size": 16, "augment": "crop_flip",
              "auto_augment": "rand-m9-mstd0.5", "train_per_class": None, "val_per_class": None},
        model={"embed_dim": 32, "num_heads": 2},
        train={"epochs": 2, "batch_size": 6, "mixup": 0.8, "cutmix": 1.0, "label_smoothing": 0.1,
               "checkpoint_every": 0},
        eval={"sizes": [12, 16, 24], "canvas_position": "random"},
    )
    results = run_experiment(cfg)
    assert results.sizes == [12, 16, 24] and results.eval_images == 18
    for name in ("alibi2d", "learned2d+rope2d"):
        r = results.schemes[name]
        assert r.train is not None and r.train.skipped_images == 2  # the broken file, once per epoch
        assert all(0.0 <= v <= 100.0 for acc in r.accuracy.values() for v in acc.values())
    assert results.schemes["learned2d+rope2d"].scheme.pos == ["learned2d", "rope2d"]
    assert (tmp_path / "run" / "alibi2d" / "log.csv").read_text().count("\n") == 3


def test_results_json_round_trips_to_the_typed_results(run: Run) -> None:
    _, results = run  # (the file itself may be rewritten by the rerun test; its content is checked above)
    again = RunResult.from_json(json.loads(json.dumps(results.to_json())))
    assert again == results
    assert again.schemes["rope2d+yarn"].train is None and again.schemes["rope2d+yarn"].scheme.base == "rope2d"
    assert sorted(again.schemes["rope2d"].accuracy["canvas"]) == [20, 28, 40]  # sizes are ints in memory
    assert again.schemes["rope2d"].train is not None and len(again.schemes["rope2d"].train.history) == 2


def test_reports_draw_without_pyplot(run: Run, tmp_path: Path) -> None:
    """Both report modules use matplotlib's Figure API: no pyplot, no global backend switch."""
    import subprocess
    import sys

    import train

    script = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from benchmarks.seq1d.__main__ import main\n"
        "from train.evaluation.report import write_outputs\n"
        "from train.evaluation.results import RunResult\n"
        "write_outputs(RunResult.from_json(json.loads(Path(sys.argv[1]).read_text())), Path(sys.argv[2]))\n"
        "assert main(['--config', sys.argv[3], 'out_dir=' + sys.argv[2] + '/seq1d']) == 0\n"
        "assert 'matplotlib.pyplot' not in sys.modules, 'pyplot was imported'\n"
    )
    seq1d = tmp_path / "seq1d.yaml"
    seq1d.write_text(json.dumps({"name": "t", "progress": False, "schemes": ["rope"],
                                 "model": {"dim": 16, "depth": 1, "heads": 2},
                                 "train": {"length": 16, "steps": 2, "batch_size": 4},
                                 "eval": {"multiples": [1, 2], "samples": 5, "batch_size": 8}}))
    done = subprocess.run([sys.executable, "-c", script, str(run[0] / "results.json"), str(tmp_path), str(seq1d)],
                          cwd=Path(train.__file__).parents[1], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    for name in ("accuracy.png", "seq1d/accuracy.png", "seq1d/loss.png", "seq1d/passkey_depth.png"):
        assert (tmp_path / name).stat().st_size > 0


def test_seeds_finetune_and_multires_run(tmp_path: Path) -> None:
    """Per-seed runs in seed_<k>/, mean ± std on top; fine-tuned weights beside, never over, the zero-shot ones."""
    import statistics

    sections = {"schemes": ["learned2d", {"name": "rope2d", "pos": "rope2d", "augment": "rrc_flip"}, "rope2d+linear"],
                "train": {"sizes": [16, 20, 28]}, "eval": {"sizes": [28, 40]}}
    finetune = {"size": 40, "steps": 3, "batch_size": 20}
    results = run_experiment(tiny_config(tmp_path / "many", **sections, seeds=[0, 1], finetune=finetune))
    alone = run_experiment(tiny_config(tmp_path / "one", **sections, seed=1))  # seed 1 alone, no fine-tune
    saved = json.loads((tmp_path / "many" / "results.json").read_text())
    assert saved == json.loads(json.dumps(results.to_json())) and saved["seeds"] == [0, 1]
    assert RunResult.from_json(saved) == results
    for name, r in results.schemes.items():
        assert set(r.per_seed) == {0, 1} and r.per_seed[1].accuracy == alone.schemes[name].accuracy
        for protocol, by_size in r.accuracy.items():
            for size, mean in by_size.items():
                values = [r.per_seed[s].accuracy[protocol][size] for s in (0, 1)]
                assert mean == statistics.fmean(values) and r.accuracy_std[protocol][size] == statistics.stdev(values)
    # fine-tune-at-target for trained entries only, evaluated at the target size
    assert results.schemes["rope2d+linear"].finetuned == {}
    for name in ("learned2d", "rope2d"):
        r = results.schemes[name]
        assert list(r.finetuned) == ["resize"] and list(r.finetuned["resize"]) == [40]
        assert set(r.per_seed[0].finetuned["resize"]) == {40} and r.finetune_seconds is not None
    seed1 = tmp_path / "many" / "seed_1" / "rope2d"
    zero_shot = torch.load(seed1 / "checkpoint.pt", weights_only=True)["model"]
    tuned = torch.load(seed1 / "finetuned.pt", weights_only=True)["model"]
    untouched = torch.load(tmp_path / "one" / "rope2d" / "checkpoint.pt", weights_only=True)["model"]
    tensors = [k for k, v in zero_shot.items() if torch.is_tensor(v)]
    assert all(torch.equal(zero_shot[k], untouched[k]) for k in tensors)  # the checkpoint is the zero-shot model
    assert not all(torch.equal(zero_shot[k], tuned[k]) for k in tensors)
    saved_cfg = {name: torch.load(tmp_path / "one" / name / "checkpoint.pt", weights_only=True)["config"]
                 for name in ("learned2d", "rope2d")}
    augments = {name: c["data"]["augment"] for name, c in saved_cfg.items()}
    assert augments == {"learned2d": "none", "rope2d": "rrc_flip"}  # the recipe's own augmentation
    md = (tmp_path / "many" / "results.md").read_text()
    acc = results.schemes["learned2d"]
    assert "Seeds 0, 1: cells are mean ± sample std" in md and "multi-resolution: one size per step" in md
    assert f"| learned2d | {acc.accuracy['resize'][28]:.1f} ± {acc.accuracy_std['resize'][28]:.1f} |" in md
    assert "### fine-tune at target: 3 steps on training images resized to 40 px" in md
    assert md.count("| rope2d+linear |") == 4  # no fine-tune row for an evaluation-only entry
    # a rerun reuses every seed's training and fine-tuning
    before = (seed1 / "finetuned.pt").stat().st_mtime_ns
    again = run_experiment(tiny_config(tmp_path / "many", **sections, seeds=[0, 1], finetune=finetune))
    assert (seed1 / "finetuned.pt").stat().st_mtime_ns == before
    assert all((a.accuracy, a.accuracy_std, a.finetuned, a.finetuned_std) == (b.accuracy, b.accuracy_std, b.finetuned,
               b.finetuned_std) for a, b in zip(again.schemes.values(), results.schemes.values(), strict=True))
