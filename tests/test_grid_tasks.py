"""Grid tasks: generated from a seed, labels that follow each task's rule (checked cell by cell against
plain per-image reference rules read back from the pixels), balanced classes, the canvas protocol drawing a
new image at the evaluation grid, the shuffled-label control, and a tiny end-to-end run."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from train import grid_report
from train.config.sections import ConfigError
from train.data.datasets import DataError
from train.data.grid_tasks import (
    COUNT_MAX,
    COUNT_RADIUS,
    DIRECTIONS,
    GLYPH,
    LOOKUP_OFFSETS,
    NAMES,
    PLACEMENT_REGIONS,
    generate,
)
from train.data.loaders import EvalLoader
from train.data.sources import build_data
from train.data.transforms import normalize, resize
from train.experiment.run import run_experiment
from train.runtime.process import Dist
from train.testing import tiny_config

ART = {  # the glyphs, written out again: the decoder below must not share the generator's bank
    "hbar": "....########....", "vbar": ".##..##..##..##.", "diag": "##..###..###..##",
    "anti": "..##.######.##..", "solid": "#" * 16, "ring": "#####..##..#####",
}


def decode(image: torch.Tensor) -> list[list[str | None]]:
    """uint8 [1, H, W] -> the glyph name of every 4 x 4 cell (None: empty); fails on any other pattern."""
    pix = image[0].numpy()
    g = pix.shape[0] // 4
    out: list[list[str | None]] = []
    for y in range(g):
        row: list[str | None] = []
        for x in range(g):
            cell = pix[4 * y : 4 * y + 4, 4 * x : 4 * x + 4]
            block = "".join("#" if v == 255 else "." if v == 0 else "?" for v in cell.flat)
            if block == "." * 16:
                row.append(None)
                continue
            names = [n for n, art in ART.items() if art == block]
            assert len(names) == 1, f"cell ({y}, {x}) is not a glyph: {block}"
            row.append(names[0])
        out.append(row)
    return out


def where(cells: list[list[str | None]], name: str) -> list[tuple[int, int]]:
    return [(y, x) for y, row in enumerate(cells) for x, c in enumerate(row) if c == name]


CONTENT = ["hbar", "vbar", "diag", "anti"]


def lookup_label(cells: list[list[str | None]]) -> int:
    (marker, (my, mx)), = [(m, p) for m in ("solid", "ring") for p in where(cells, m)]
    dy, dx = {"solid": (2, 2), "ring": (-1, 3)}[marker]
    return CONTENT.index(cells[my + dy][mx + dx])  # type: ignore[arg-type]


def direction_label(cells: list[list[str | None]]) -> int:
    ((ay, ax),), ((by, bx),) = where(cells, "solid"), where(cells, "ring")
    degrees = math.degrees(math.atan2(ay - by, bx - ax)) % 360  # counter-clockwise from east, up = north
    return int(((degrees + 22.5) % 360) // 45)  # E covers (-22.5, 22.5), NE (22.5, 67.5), ...


def placement_label(cells: list[list[str | None]]) -> int:
    ((y, x),) = where(cells, "solid")
    g, r = len(cells), PLACEMENT_REGIONS
    return math.floor(r * (y + 0.5) / g) * r + math.floor(r * (x + 0.5) / g)


def count_label(cells: list[list[str | None]]) -> int:
    ((y, x),) = where(cells, "solid")
    near = [(cy, cx) for cy, row in enumerate(cells) for cx, c in enumerate(row)
            if c is not None and 0 < (cy - y) ** 2 + (cx - x) ** 2 <= COUNT_RADIUS**2]
    return len(near)


RULES = {"grid_lookup": lookup_label, "grid_direction": direction_label, "grid_placement": placement_label,
         "grid_count": count_label}


def test_reference_rules_match_the_module_constants() -> None:
    assert LOOKUP_OFFSETS == {NAMES.index("solid") + 1: (2, 2), NAMES.index("ring") + 1: (-1, 3)}
    assert DIRECTIONS[0] == "E" and DIRECTIONS[2] == "N" and GLYPH == 4


@pytest.mark.parametrize("task", list(RULES))
@pytest.mark.parametrize("grid", [8, 13])
def test_labels_follow_the_task_rule_read_back_from_the_pixels(task: str, grid: int) -> None:
    images, labels = generate(task, grid=grid, per_class=6, seed=3)
    assert images.shape == (len(labels), 1, grid * 4, grid * 4) and images.dtype == torch.uint8
    assert torch.bincount(labels).tolist() == [6] * (int(labels.max()) + 1)  # balanced
    for image, label in zip(images, labels.tolist(), strict=True):
        assert RULES[task](decode(image)) == label


def test_count_task_keeps_distractors_outside_the_radius_and_lookup_fills_the_grid() -> None:
    images, _ = generate("grid_count", grid=16, per_class=20, seed=0)
    far = 0
    for image in images:
        cells = decode(image)
        ((y, x),) = where(cells, "solid")
        far += sum(c is not None and (cy - y) ** 2 + (cx - x) ** 2 > COUNT_RADIUS**2
                   for cy, row in enumerate(cells) for cx, c in enumerate(row))
    assert far > 0  # distractors exist, and the rule above counted only the near ones
    images, labels = generate("grid_count", grid=8, per_class=400, seed=1)  # the total says nothing about the label
    total = (images.view(len(images), 8, 4, 8, 4).amax(dim=(2, 4)) > 0).sum(dim=(1, 2)).float() - 1  # glyphs
    means = [total[labels == k].mean().item() for k in range(COUNT_MAX + 1)]
    assert max(means) - min(means) < 0.6, means
    images, _ = generate("grid_lookup", grid=8, per_class=5, seed=0)
    assert all(sum(c is None for row in decode(im) for c in row) == 0 for im in images)


def test_generation_is_a_function_of_the_seed() -> None:
    a = generate.__wrapped__("grid_direction", grid=8, per_class=4, seed=5)
    b = generate.__wrapped__("grid_direction", grid=8, per_class=4, seed=5)
    c = generate.__wrapped__("grid_direction", grid=8, per_class=4, seed=6)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def grid_config(tmp_path: Path, dataset: str = "grid_direction", **data: object):
    return tiny_config(tmp_path, data={"dataset": dataset, "img_size": 32, "train_per_class": 5,
                                       "val_per_class": 3, **data},
                       eval={"sizes": [32, 48, 64], "batch_size": 7, "protocols": ["resize", "canvas"]})


def test_canvas_protocol_draws_a_new_image_at_the_evaluation_grid(tmp_path: Path) -> None:
    cfg = grid_config(tmp_path)
    data = build_data(cfg.data)
    assert data.num_classes == 8 and data.in_chans == 1 and len(data.train) == 40 and len(data.val) == 24
    loader = EvalLoader(data, cfg.data, cfg.eval, seed=0, dist=Dist(), patch_size=4)
    big_images, big_labels = generate("grid_direction", grid=16, per_class=3, seed=1)
    canvas = list(loader.batches("canvas", 64))
    x, y = torch.cat([b.x for b in canvas]), torch.cat([b.y for b in canvas])
    assert torch.equal(x, normalize(big_images.float() / 255, data.mean, data.std)) and torch.equal(y, big_labels)
    for image, label in zip(big_images, big_labels.tolist(), strict=True):  # the rule holds at the new grid
        assert direction_label(decode(image)) == label
    # resize: the training-grid image scaled, same labels; at the training size both protocols agree
    resized = torch.cat([b.x for b in loader.batches("resize", 64)])
    assert torch.allclose(resized, normalize(resize(data.val.images.float() / 255, 64), data.mean, data.std))
    same = [torch.cat([b.x for b in loader.batches(p, 32)]) for p in ("resize", "canvas")]
    assert torch.equal(same[0], same[1])


def test_shuffled_control_permutes_the_training_labels_only(tmp_path: Path) -> None:
    true = build_data(grid_config(tmp_path, "grid_lookup", train_per_class=200).data)
    control = build_data(grid_config(tmp_path, "grid_lookup_shuffled", train_per_class=200).data)
    assert torch.equal(control.train.images, true.train.images)
    assert torch.equal(control.train.labels.sort().values, true.train.labels.sort().values)
    agree = (control.train.labels == true.train.labels).float().mean().item()
    assert 0.15 < agree < 0.35  # 4 classes: a permutation independent of the images agrees about 1 in 4
    assert torch.equal(control.val.labels, true.val.labels) and control.classes == true.classes


def test_grid_task_settings_that_would_change_the_answer_are_refused(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no augmentation.*accepted: none"):
        build_data(grid_config(tmp_path, augment="flip").data)
    # 30 px is whole 2 px patches but not whole 4 px cells: refused when the config is read, and by
    # build_data for settings that never went through a config
    with pytest.raises(ConfigError, match=r"data\.img_size: grid tasks draw 4 px cells.*multiples of 4 px, got 30"):
        tiny_config(tmp_path, data={"dataset": "grid_count", "img_size": 30}, model={"patch_size": 2},
                    eval={"sizes": [30]})
    with pytest.raises(DataError, match="multiples of 4 px, got 30"):
        build_data(dataclasses.replace(grid_config(tmp_path, "grid_count").data, img_size=30))
    with pytest.raises(DataError, match="classes are fixed"):
        build_data(grid_config(tmp_path, num_classes=2).data)
    with pytest.raises(ConfigError, match="grid_lookup"):  # the choices are listed
        grid_config(tmp_path, "grid_nothing")


def test_tiny_grid_run_reports_every_size_and_protocol(tmp_path: Path) -> None:
    cfg = grid_config(tmp_path, "grid_lookup", train_per_class=10)
    result = run_experiment(cfg, log=lambda msg: None)
    acc = result.schemes["rope2d"].accuracy
    assert set(acc) == {"resize", "canvas"} and all(set(v) == {32, 48, 64} for v in acc.values())
    assert acc["resize"][32] == acc["canvas"][32]  # the training grid: one image set
    assert "drawn by the grid_lookup rule" in (tmp_path / "results.md").read_text()
    assert np.isfinite(result.schemes["rope2d"].train.train_loss)


def test_tiny_quick_config_reports_across_tasks_with_the_control(tmp_path: Path) -> None:
    out = tmp_path / "report"
    tiny = [f"out_dir={tmp_path / 'runs'}", "data.train_per_class=16", "data.val_per_class=2", "train.batch_size=32",
            "train.epochs=1", "eval.scales=[1,2]", "model.depth=1", "model.embed_dim=16",
            "schemes=[rope2d,nope,rope2d+linear]"]
    assert grid_report.main(["--config", "configs/grid_tasks_quick.yaml", "--out", str(out), "--quiet", *tiny,
                             "--tasks", "grid_lookup", "grid_placement", "grid_lookup_shuffled"]) == 0
    md = (out / "results.md").read_text()
    assert "### grid_placement (16 classes, chance 6.2)" in md and "| rope2d+linear |" in md
    def seconds(task: str, name: str) -> float:
        return json.loads((tmp_path / "runs" / task / "results.json").read_text())["schemes"][name]["train"]["seconds"]

    trained = sum(seconds(t, n) for t in ("grid_lookup", "grid_placement") for n in ("rope2d", "nope"))
    trained += seconds("grid_lookup_shuffled", "rope2d")
    assert f"as recorded when each was trained: {trained / 60:.1f} min)" in md
    control = md.split("### grid_lookup_shuffled")[1].split("##")[0]
    assert "| rope2d |" in control and "| nope |" not in control  # the control trains --control-schemes only
    headline = md.split("## headline")[1]
    assert "| lookup 8 / 16 |" in headline and "placement 8 / 16 |" in headline and "lookup_shuffled" not in headline
    assert "| chance | 25.0 | 6.2 |" in headline
    saved = json.loads((out / "results.json").read_text())
    assert set(saved) == {"grid_lookup", "grid_placement", "grid_lookup_shuffled"}
    assert saved["grid_placement"]["sizes"] == [32, 64] and (out / "accuracy.png").stat().st_size > 0


def test_parallel_jobs_train_the_same_models_as_one_process(tmp_path: Path) -> None:
    """``--jobs 2`` trains each task in a process of its own; the report (reusing those runs) holds the same
    accuracies as a sequential run, and names the option in its command."""
    tiny = ["data.train_per_class=8", "data.val_per_class=2", "train.batch_size=16", "train.epochs=1",
            "eval.scales=[1,2]", "model.depth=1", "model.embed_dim=16", "schemes=[rope2d,nope]"]  # fmt: skip
    reports = {}
    for jobs in (1, 2):
        out = tmp_path / f"report{jobs}"
        args = ["--config", "configs/grid_tasks_quick.yaml", "--tasks", "grid_lookup", "grid_direction", "--out",
                str(out), "--quiet", "--jobs", str(jobs), f"out_dir={tmp_path / f'runs{jobs}'}", *tiny]  # fmt: skip
        assert grid_report.main(args) == 0
        reports[jobs] = json.loads((out / "results.json").read_text())
    for task in ("grid_lookup", "grid_direction"):
        for name in ("rope2d", "nope"):
            assert reports[2][task]["schemes"][name]["accuracy"] == reports[1][task]["schemes"][name]["accuracy"]
    assert "--jobs 2" in (tmp_path / "report2" / "results.md").read_text()
    assert grid_report.main(["--config", "configs/grid_tasks_quick.yaml", "--jobs", "0"]) == 2
