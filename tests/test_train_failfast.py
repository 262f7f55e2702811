"""Bad input fails before training, in one `error:` line; `train.evaluate` evaluates what it can and names what
failed. (Ctrl-C and the progress lines of a running process: tests/test_train_process.py.)"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import vispos
from train.__main__ import main as train_main
from train.config.sections import ConfigError
from train.evaluate import main as evaluate_main
from train.experiment.loading import config_from_dict
from train.experiment.run import run_experiment
from train.testing import TINY, _merge, tiny_config
from train.testing import write_tiny_config as write_config


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return lines[0]


# ---------------------------------------------------------------------------------------------------
# 1. every config error when the config is read


def scaled(pos: str) -> list[Any]:
    return [pos, {"name": f"{pos}+yarn", "base": pos, "scaling": "yarn"}]


READ_TIME_ERRORS = [
    # a scaling on an entry without RoPE (trained or evaluation-only): the registry's scalable flag
    ({"schemes": [{"name": "r", "pos": "relbias2d", "scaling": "yarn"}]},
     r"schemes\[r\]: scaling 'yarn' .*relbias2d has none to stretch \(scalable: rope2d"),
    ({"schemes": scaled("relbias2d")}, r"schemes\[relbias2d\+yarn\]: scaling 'yarn' .*relbias2d has none"),
    ({"schemes": scaled("timm")}, r"timm has none to stretch"),
    ({"schemes": ["alibi2d", {"name": "a+logn", "base": "alibi2d", "log_n_attention": True}, "timm",
                  {"name": "t+logn", "base": "timm", "log_n_attention": True}]},
     r"schemes\[t\+logn\]: vispos.configure failed: no vispos positional scheme"),
    # options the scheme does not accept: the registry's option list
    ({"schemes": [{"name": "r", "pos": "rope2d", "options": {"thetaa": 10.0}}]},
     r"schemes\[r\]: option\(s\) thetaa not accepted by rope2d; accepted: .*theta"),
    ({"schemes": [{"name": "a", "pos": "alibi2d", "options": {"theta": 10.0}}]},
     r"option\(s\) theta not accepted by alibi2d; accepted: inherit"),
    # values the scheme refuses (found by building the model on the meta device)
    ({"schemes": [{"name": "r", "pos": "rope2d", "options": {"layout": "diagonal"}}]},
     r"schemes\[r\]: vispos.patch failed: .*diagonal"),
    ({"train": {"lr": -1}}, r"train\.lr must be > 0, got -1"),
    ({"train": {"min_lr": 1.0}}, r"train\.min_lr must be in \[0, train\.lr=0\.002\]"),
    ({"train": {"weight_decay": -0.1}}, r"train\.weight_decay must be >= 0"),
    ({"train": {"grad_clip": 0.0}}, r"train\.grad_clip must be > 0, or null"),
    ({"train": {"label_smoothing": 1.0}}, r"train\.label_smoothing must be in \[0, 1\)"),
    ({"train": {"mixup": 0.8, "batch_size": 41}}, r"train\.batch_size must be even with mixup"),
    ({"train": {"log_every": -1}}, r"train\.log_every must be >= 0"),
    ({"data": {"img_size": 30}}, r"data\.img_size=30 must be a multiple of the patch size 4 .* e\.g\. 28"),
    ({"data": {"img_size": 2}}, r"data\.img_size=2 must be a multiple of the patch size 4"),
    ({"data": {"crop_pct": 0.0}}, r"data\.crop_pct must be in \(0, 1\]"),
    ({"data": {"mean": [0.5, 0.5, 0.5], "std": [0.2, 0.2, 0.2]}}, r"fashion_mnist images have 1 channel"),
    ({"data": {"mean": [0.5], "std": [0.0]}}, r"data\.std must be > 0"),
    ({"data": {"classes": ["Trouser", "Sock"]}}, r"data: unknown class\(es\) Sock; available: T-shirt/top"),
    ({"data": {"num_classes": 11}}, r"data\.num_classes=11 but only 10 classes"),
    ({"data": {"dataset": "folder", "root": "/nonexistent", "auto_augment": "rand-x9"}},
     r"data\.auto_augment 'rand-x9' is not a timm augmentation string"),
    ({"finetune": {"size": 30}}, r"finetune\.size=30 must be a multiple of the patch size 4, e\.g\. 28 or 32"),
    ({"finetune": {"size": 32, "lr": 0.0}}, r"finetune\.lr must be > 0"),
    ({"eval": {"sizes": [28, 30]}}, r"eval sizes \[30\] are not positive multiples of the patch size 4"),
    ({"eval": {"canvas_fill": 2.0}}, r"eval\.canvas_fill must be in \[0, 1\]"),
    ({"train": {"sizes": [16, 18]}}, r"train\.sizes \[18\] are not multiples of the patch size 4"),
    ({"model": {"num_heads": 3}}, r"model: timm\.create_model\(.*failed: dim should be divisible by num_heads"),
    ({"model": {"name": "vit_nonexistent"}}, r"model: timm\.create_model\('vit_nonexistent'.*Unknown model"),
    ({"model": {"drop_path_rate": 1.5}}, r"model\.drop_path_rate must be in \[0, 1\)"),
    ({"model": {"depth": 0}}, r"model\.depth must be >= 1"),
    ({"threads": 0}, r"threads must be >= 1"),
    ({"debug": {"stop_after_steps": 0}}, r"debug\.stop_after_steps must be >= 1"),
    # timm rates through model.kwargs (timm's PatchDropout asserts without a message)
    ({"model": {"kwargs": {"patch_drop_rate": 1.5}}},
     r"model\.kwargs\.patch_drop_rate must be a number in \[0, 1\), got 1\.5"),
    ({"model": {"kwargs": {"attn_drop_rate": -0.1}}}, r"model\.kwargs\.attn_drop_rate must be a number in \[0, 1\)"),
    # a grid task drawn at an evaluation grid its rule cannot draw (canvas protocol), or trained on one
    ({"data": {"dataset": "grid_lookup", "img_size": 32}, "eval": {"sizes": [12, 32]}},
     r"eval size 12 px .*grid_lookup needs a grid larger than its offsets \[\(2, 2\), \(-1, 3\)\]: at least 4 x 4 "
     r"cells \(16 px\), got 12 px \(3 x 3 cells\)"),
    ({"data": {"dataset": "grid_lookup_shuffled", "img_size": 32}, "eval": {"sizes": None, "scales": [0.25, 1]}},
     r"eval size 8 px .*grid_lookup_shuffled needs a grid larger than its offsets"),
    ({"data": {"dataset": "grid_direction", "img_size": 32}, "eval": {"sizes": [4]}},
     r"eval size 4 px .*grid_direction needs two distinct cells .*got 4 px \(1 x 1 cells\)"),
    ({"data": {"dataset": "grid_placement", "img_size": 32}, "eval": {"sizes": [12]}},
     r"grid_placement needs one cell per region \(4 per axis\): at least 4 x 4 cells"),
    ({"data": {"dataset": "grid_count", "img_size": 8}}, r"data\.img_size: grid_count needs a marker's 8 neighbours"),
    ({"data": {"dataset": "grid_count", "img_size": 24}, "eval": {"sizes": [24, 30]}, "model": {"patch_size": 6}},
     r"eval size 30 px .*grid tasks draw 4 px cells, so image sizes are positive multiples of 4 px, got 30"),
]


@pytest.mark.parametrize(("sections", "match"), READ_TIME_ERRORS)
def test_config_errors_are_found_when_the_config_is_read(sections: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        config_from_dict(_merge(TINY, sections))


@pytest.mark.parametrize("name", [n for n in vispos.list_encodings(ndim=2)])
def test_every_2d_scheme_passes_the_readers_meta_device_build(name: str) -> None:
    # reading a config builds every entry on the meta device (models.preflight): a scheme whose constructor
    # computes on the default device (a .item() on a meta tensor) would stop the trainer before it starts
    cfg = config_from_dict(_merge(TINY, {"schemes": [name], "out_dir": "unused"}))
    assert [s.name for s in cfg.schemes] == [name]


def test_a_grid_task_evaluated_by_resizing_only_may_go_below_its_grid() -> None:
    """The resize protocol resizes the training images (nothing drawn at the evaluation grid)."""
    cfg = config_from_dict(_merge(TINY, {"data": {"dataset": "grid_lookup", "img_size": 32},
                                         "eval": {"sizes": [12, 32], "protocols": ["resize"]}}))
    assert cfg.eval.sizes == [12, 32]


def test_reading_a_config_leaves_the_global_rng_alone() -> None:
    before = torch.get_rng_state()
    config_from_dict(_merge(TINY, {"schemes": ["learned2d", "rope2d", "rope2d+yarn", "relbias2d"]}))
    assert torch.equal(before, torch.get_rng_state())


@pytest.mark.parametrize(("override", "match"), [
    ("train.lr=-1", r"train\.lr must be > 0"),
    ("data.img_size=30", r"data\.img_size=30 must be a multiple of the patch size 4"),
    ("finetune.size=30", r"finetune\.size=30 must be a multiple of the patch size 4"),
    ("eval.sizes=[28,", r"override 'eval\.sizes=\[28,': '\[28,' is not a YAML value .*expected list of int"),
    ("schemes=[relbias2d,relbias2d+yarn]", r"relbias2d has none to stretch"),
    ("=3", r"override '=3': no key before '='"),
])
def test_cli_config_errors_are_one_line_and_exit_2_before_training(override: str, match: str, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture) -> None:
    assert train_main(["--config", str(write_config(tmp_path)), override]) == 2
    captured = capsys.readouterr()
    line = one_error_line(captured.err)
    assert re.search(match, line), line
    assert not (tmp_path / "run").exists()  # nothing was trained, not even the run folder made


def test_cli_names_what_it_expects_for_a_folder_or_missing_config(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture) -> None:
    assert train_main(["--config", str(tmp_path)]) == 2
    assert "is a folder; give a YAML file" in one_error_line(capsys.readouterr().err)
    assert train_main(["--config", str(tmp_path / "nope.yaml")]) == 2
    assert "does not exist" in one_error_line(capsys.readouterr().err)


def test_a_batch_larger_than_the_data_fails_before_any_scheme_trains(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture) -> None:
    # 200 training images: the fine-tune batch cannot be 400, and that is known before the first scheme trains
    path = write_config(tmp_path, schemes=["rope2d", "nope"], finetune={"size": 32, "batch_size": 400})
    assert train_main(["--config", str(path)]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "batch size 400 (train.batch_size / finetune.batch_size) is larger than the 200 training images" in line
    assert not (tmp_path / "run" / "rope2d" / "checkpoint.pt").exists()


# ---------------------------------------------------------------------------------------------------
# 2. train.evaluate: bad input named, every checkpoint it can evaluated


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("run")
    run_experiment(tiny_config(out, schemes=["learned2d", "rope2d"], train={"epochs": 1, "checkpoint_every": 0}))
    return out


def evaluate(*args: str) -> int:
    return evaluate_main(["--sizes", "28", "40", "--protocols", "resize", "--quiet", *args])


def test_evaluate_writes_what_it_could_and_names_what_failed(trained: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "acc.json"
    learned, rope = trained / "learned2d" / "checkpoint.pt", trained / "rope2d" / "checkpoint.pt"
    assert evaluate("--checkpoint", str(learned), str(rope), "--scaling", "yarn", "--out", str(out)) == 2
    captured = capsys.readouterr()
    assert "| rope2d+yarn |" in captured.out  # the one that could be evaluated is printed and written
    saved = json.loads(out.read_text())
    assert list(saved["accuracy"]) == ["rope2d+yarn"] and set(saved["accuracy"]["rope2d+yarn"]["resize"]) == {
        "28", "40"}
    assert list(saved["failed"]) == [str(learned)] and "learned2d has none to stretch" in saved["failed"][str(learned)]
    assert "Traceback" not in captured.err
    assert f"error: 1 of 2 checkpoint(s) not evaluated: {learned}" in captured.err


def test_evaluate_accepts_scheme_and_run_folders(trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "acc.json"
    assert evaluate("--checkpoint", str(trained / "rope2d"), "--out", str(out)) == 0
    one = json.loads(out.read_text())["accuracy"]
    assert evaluate("--checkpoint", str(trained), "--out", str(out)) == 0
    both = json.loads(out.read_text())["accuracy"]
    assert list(both) == ["learned2d", "rope2d"] and both["rope2d"] == one["rope2d"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert evaluate("--checkpoint", str(empty)) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"error: {empty} is a folder without checkpoint.pt (nor scheme folders holding one); give a "
                   "checkpoint file, a scheme folder (runs/NAME/SCHEME) or a run folder (runs/NAME)",
                   f"error: 1 of 1 checkpoint(s) not evaluated: {empty}"]


@pytest.mark.parametrize("case", ["missing", "no_config", "directory_file"])
def test_evaluate_names_a_bad_checkpoint(case: str, trained: Path, tmp_path: Path,
                                         capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "ck.pt"
    expected = f"checkpoint {path} does not exist"
    if case == "no_config":
        ck = torch.load(trained / "rope2d" / "checkpoint.pt", weights_only=True)
        del ck["config"]
        torch.save(ck, path)
        expected = f"{path} has no config entry"
    elif case == "directory_file":  # a folder named like a file
        path.mkdir()
        expected = f"{path} is a folder without checkpoint.pt"
    assert evaluate("--checkpoint", str(path)) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err and "KeyError" not in err


def test_evaluate_warns_about_non_finite_weights(trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    ck = torch.load(trained / "rope2d" / "checkpoint.pt", weights_only=True)
    ck["model"]["head.weight"][0, 0] = float("nan")
    path = tmp_path / "nan.pt"
    torch.save(ck, path)
    assert evaluate("--checkpoint", str(path)) == 0
    warnings = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("warning:")]
    assert warnings == [f"warning: {path} holds non-finite weights (1 tensors, e.g. head.weight); "
                        "its accuracies are not meaningful"]
    assert evaluate("--checkpoint", str(trained / "rope2d" / "checkpoint.pt")) == 0
    assert "warning" not in capsys.readouterr().err
