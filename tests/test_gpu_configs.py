"""The GPU configs, dry-run on the CPU: every entry of each ImageNet config builds, trains one step and is evaluated
at a few sizes, with the config's own model family, schemes, options, augmentation and precision; only the sizes shrink
(a generated image folder, a narrower and shallower model, one step) and compile is off (a CPU compile of each entry
would take minutes)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from train.__main__ import main as train_main
from train.experiment.loading import load_config
from train.testing import make_image_folder

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("image*.yaml"))
FAR_EXTRAPOLATORS = {"lookhere2d", "fire2d", "irpe2d", "pape2d"}


def dry_run_overrides(root: Path, out_dir: Path) -> list[str]:
    return [f"data.root={root}", "data.img_size=32", "data.workers=0", "data.num_classes=null",
            "data.class_file=null", "model.patch_size=8", "model.embed_dim=96", "model.depth=1",
            "train.epochs=1", "train.batch_size=8", "train.compile=false", "train.checkpoint_every=0",
            "eval.sizes=[24,32,48]", "eval.batch_size=8", "threads=1", "progress=false", f"out_dir={out_dir}"]


def test_the_gpu_configs_train_the_far_extrapolators_and_the_tmlr_shape() -> None:
    by_name = {p.stem: load_config(p) for p in CONFIGS}
    for name in ("imagenet100_vits16", "imagenet100_vits16_128", "imagenet100_vitt16_tmlr"):
        assert FAR_EXTRAPOLATORS <= {s.name for s in by_name[name].schemes}, name
    tmlr = by_name["imagenet100_vitt16_tmlr"]
    assert tmlr.model.name == "vit_tiny_patch16_224" and tmlr.data.img_size == 224 and max(tmlr.eval.sizes) == 1024


@pytest.mark.parametrize("config", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_a_gpu_config_dry_runs_every_entry_on_the_cpu(config: Path, tmp_path: Path) -> None:
    root = make_image_folder(tmp_path / "data", classes=2, per_class=4, size=40)
    out = tmp_path / "run"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert train_main(["--config", str(config), *dry_run_overrides(root, out), "--quiet"]) == 0
    # LookHere's entries take head counts its field groups divide (no group left without heads)
    assert not [w for w in caught if "lookhere2d" in str(w.message)], [str(w.message) for w in caught]
    results = json.loads((out / "results.json").read_text())
    entries = {s.name for s in load_config(config).schemes}
    assert set(results["schemes"]) == entries
    for name, entry in results["schemes"].items():
        assert set(entry["accuracy"]["resize"]) == {"24", "32", "48"}, name
