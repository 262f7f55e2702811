"""README's pretrained-model recipe command runs end to end (tiny: a few hundred images, one epoch)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.pretrained_rope import RECIPES, main


def test_the_recipe_trains_exports_reloads_patches_and_evaluates(tmp_path: Path) -> None:
    out = tmp_path / "out"
    overrides = [
        f"out_dir={tmp_path / 'run'}", "threads=1", "progress=false", "data.train_per_class=20",
        "data.val_per_class=10", "model.depth=1", "train.epochs=1", "train.batch_size=50",
    ]  # fmt: skip
    assert main(["--config", "configs/pretrained_rope_fmnist.yaml", "--out", str(out), *overrides]) == 0
    report = json.loads((out / "results.json").read_text())
    assert list(report["accuracy"]) == [name for name, _ in RECIPES]
    assert report["sizes"] == [32, 48, 64] and report["images"] == 100
    # patching inherits timm's RoPE: the same predictions as timm's own model at every size
    assert report["inherited_vs_timm_max_abs_logit_difference"] <= 1e-5
    own, inherited = (report["accuracy"][name] for name, _ in RECIPES[:2])
    assert own == inherited
    assert (tmp_path / "run" / "timm" / "weights.pth").exists()
    assert "| + yarn + log-n |" in (out / "results.md").read_text()
