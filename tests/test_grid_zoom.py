"""The zoom protocol and scale augmentation of the grid tasks: the same scenes drawn on more pixels (every
cell larger, the grid of cells unchanged), and training scenes drawn at several zooms (data.zooms), read
back from the pixels by nearest-neighbour subsampling and checked against the task rules."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_grid_tasks import RULES, decode  # the rules, read back from the pixels

from train.config.sections import ConfigError
from train.data.grid_tasks import generate, render, scenes
from train.data.loaders import EvalLoader
from train.data.sources import build_data
from train.data.transforms import normalize
from train.engine.checkpoint import fingerprint
from train.experiment.run import run_experiment
from train.runtime.process import Dist
from train.testing import tiny_config


def zoom_config(tmp_path: Path, dataset: str = "grid_direction", zooms: list[int] | None = None,
                protocols: list[str] | None = None, sizes: list[int] | None = None, **data: object):
    return tiny_config(tmp_path, data={"dataset": dataset, "img_size": 32, "train_per_class": 6,
                                       "val_per_class": 3, "zooms": zooms or [1], **data},
                       eval={"sizes": sizes or [32, 64], "batch_size": 7, "protocols": protocols or ["zoom", "canvas"]})


def test_a_cell_of_4_z_px_is_the_glyph_repeated_z_times_per_axis() -> None:
    cells, _ = scenes("grid_lookup", grid=6, per_class=2, seed=0)
    small = render(cells)
    for z in (2, 3):
        expected = small.repeat_interleave(z, dim=2).repeat_interleave(z, dim=3)
        assert torch.equal(render(cells, 4 * z), expected)


@pytest.mark.parametrize("task", list(RULES))
def test_zoom_draws_the_validation_scenes_of_the_training_grid_larger(tmp_path: Path, task: str) -> None:
    cfg = zoom_config(tmp_path, task)
    data = build_data(cfg.data)
    loader = EvalLoader(data, cfg.data, cfg.eval, seed=0, dist=Dist(), patch_size=4)
    batches = list(loader.batches("zoom", 64))
    x, y = torch.cat([b.x for b in batches]), torch.cat([b.y for b in batches])
    assert x.shape[-2:] == (64, 64) and torch.equal(y, data.val.labels)
    # every second pixel of the zoomed image is the training-size image: the same scenes, cells of 8 px
    assert torch.equal(x[..., ::2, ::2], normalize(data.val.images.float() / 255, data.mean, data.std))
    assert torch.equal(x[..., ::2, :], x[..., 1::2, :]) and torch.equal(x[..., ::2], x[..., 1::2])
    at_train = [torch.cat([b.x for b in loader.batches(p, 32)]) for p in ("zoom", "canvas", "resize")]
    assert torch.equal(at_train[0], at_train[1]) and torch.equal(at_train[0], at_train[2])


def test_training_zooms_split_the_images_evenly_and_keep_every_rule(tmp_path: Path) -> None:
    data = build_data(zoom_config(tmp_path, "grid_count", zooms=[1, 2], train_per_class=7).data)
    images, labels = data.train.images, data.train.labels
    assert images.shape == (21, 1, 32, 32)
    one, two = generate("grid_count", grid=8, per_class=4, seed=0), generate("grid_count", grid=4, per_class=3,
                                                                             seed=0, cell=8)
    assert torch.equal(images, torch.cat([one[0], two[0]])) and torch.equal(labels, torch.cat([one[1], two[1]]))
    for image, label in zip(images[12:], labels[12:].tolist(), strict=True):  # zoom 2: a 4 x 4 scene, 8 px cells
        assert RULES["grid_count"](decode(image[:, ::2, ::2])) == label
    assert torch.bincount(labels).tolist() == [7, 7, 7]


def test_zoom_settings_are_checked_when_the_config_is_read(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="zoom draws the same scenes.*resize, which is the same protocol"):
        tiny_config(tmp_path, eval={"protocols": ["zoom"]})
    with pytest.raises(ConfigError, match="data.zooms draws generated scenes.*rrc_flip"):
        tiny_config(tmp_path, data={"zooms": [1, 2]})
    with pytest.raises(ConfigError, match=r"data\.zooms: distinct positive integers"):
        zoom_config(tmp_path, zooms=[1, 1])
    with pytest.raises(ConfigError, match="zoom 3 draws 12 px cells, which do not tile data.img_size 32"):
        zoom_config(tmp_path, zooms=[1, 3])
    with pytest.raises(ConfigError, match="zoom 4 draws grid_lookup scenes of 2 x 2 cells.*at least 4 x 4"):
        zoom_config(tmp_path, "grid_lookup", zooms=[1, 4])  # 2 x 2 cells cannot hold the lookup's offsets
    with pytest.raises(ConfigError, match="eval size 44 px .*zoom protocol.*multiples of 8 px"):
        zoom_config(tmp_path, sizes=[32, 44], protocols=["zoom"])
    zoom_config(tmp_path, sizes=[32, 48], protocols=["zoom"])  # 6 px cells: drawn, nearest neighbour


def test_the_fingerprint_holds_zooms_only_when_set(tmp_path: Path) -> None:
    plain, zoomed = zoom_config(tmp_path), zoom_config(tmp_path, zooms=[1, 2])
    assert "zooms" not in fingerprint(plain, plain.schemes[0])["data"]
    assert fingerprint(zoomed, zoomed.schemes[0])["data"]["zooms"] == [1, 2]


def test_tiny_run_reports_the_zoom_protocol(tmp_path: Path) -> None:
    result = run_experiment(zoom_config(tmp_path, "grid_lookup", zooms=[1, 2], train_per_class=12), log=lambda m: None)
    acc = result.schemes["rope2d"].accuracy
    assert set(acc) == {"zoom", "canvas"} and acc["zoom"][32] == acc["canvas"][32]
    assert "zoom: the same scene drawn on more pixels" in (tmp_path / "results.md").read_text()
