"""Data: Fashion-MNIST idx reading, folder subsetting without copies, corrupt files, eval protocols,
multi-resolution training sizes."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest
import torch

from train.config.sections import ConfigError, DataConfig, ExperimentConfig, TrainConfig
from train.data.datasets import CorruptImageError, DataBundle, DataError
from train.data.loaders import EvalLoader, TrainLoader, train_sizes
from train.data.sources import build_data, find_fashion_mnist, read_idx
from train.data.transforms import canvas_offsets, place_on_canvas
from train.experiment.loading import config_from_dict
from train.runtime.process import Dist
from train.testing import TINY, make_image_folder


def train_loader(data: DataBundle, cfg: ExperimentConfig) -> TrainLoader:
    return TrainLoader(data, cfg.data, batch_size=cfg.train.batch_size, seed=cfg.seed, dist=Dist())


def eval_loader(data: DataBundle, cfg: ExperimentConfig, dist: Dist | None = None) -> EvalLoader:
    return EvalLoader(data, cfg.data, cfg.eval, seed=cfg.seed, dist=dist or Dist(), patch_size=4)


def folder_cfg(root: Path, **data: object) -> DataConfig:
    return config_from_dict({**TINY, "data": {"dataset": "folder", "root": str(root), "img_size": 8,
                                              "mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25], **data}}).data


def test_fashion_mnist_subset_is_balanced_and_in_file_order() -> None:
    bundle = build_data(DataConfig(train_per_class=30, val_per_class=5, num_classes=4))
    assert bundle.classes == ["T-shirt/top", "Trouser", "Pullover", "Dress"]
    assert bundle.train.images.shape == (120, 1, 28, 28) and bundle.train.images.dtype == torch.uint8
    assert torch.bincount(bundle.train.labels).tolist() == [30, 30, 30, 30]
    assert torch.bincount(bundle.val.labels).tolist() == [5, 5, 5, 5]
    # the first 30 of each class, in file order: the first training image is the file's first image of its class
    full = build_data(DataConfig(train_per_class=None, val_per_class=1))
    first_trouser = int(torch.nonzero(full.train.labels == 1)[0])
    assert torch.equal(bundle.train.images[int(torch.nonzero(bundle.train.labels == 1)[0])],
                       full.train.images[first_trouser])


def test_fashion_mnist_class_names_select_and_relabel() -> None:
    bundle = build_data(DataConfig(classes=["Bag", "Sneaker"], train_per_class=3, val_per_class=2))
    assert bundle.classes == ["Bag", "Sneaker"] and sorted(bundle.train.labels.tolist()) == [0, 0, 0, 1, 1, 1]
    with pytest.raises(DataError, match="unknown class.*Sock.*available: T-shirt/top"):
        build_data(DataConfig(classes=["Sock"]))


def test_missing_fashion_mnist_says_how_to_install(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="apt-get install dataset-fashion-mnist"):
        find_fashion_mnist(str(tmp_path))


def test_truncated_idx_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / "train-images-idx3-ubyte.gz"
    with gzip.open(path, "wb") as f:
        f.write(bytes([0, 0, 8, 3]) + (10).to_bytes(4, "big") + (28).to_bytes(4, "big") * 2 + b"\0" * 100)
    with pytest.raises(DataError, match=r"train-images-idx3-ubyte\.gz is truncated"):
        read_idx(path)


def test_folder_subsetting_by_count_list_file_and_per_class(tmp_path: Path) -> None:
    root = make_image_folder(tmp_path / "tree", classes=4, per_class=5, size=8)
    bundle = build_data(folder_cfg(root, num_classes=3, train_per_class=2))
    assert bundle.classes == ["class_0", "class_1", "class_2"] and len(bundle.train) == 6 and len(bundle.val) == 15
    # no copies: the samples are the original files of the tree
    assert all(Path(p).is_relative_to(root / "train") and Path(p).is_file() for p, _ in bundle.train.samples)
    assert [Path(p).name for p, y in bundle.train.samples if y == 0] == ["img_0.png", "img_1.png"]
    listing = tmp_path / "classes.txt"
    listing.write_text("# two classes\nclass_3\nclass_1\n")
    bundle = build_data(folder_cfg(root, class_file=str(listing), val_per_class=1))
    assert bundle.classes == ["class_3", "class_1"] and bundle.num_classes == 2
    assert {Path(p).parent.name: y for p, y in bundle.val.samples} == {"class_3": 0, "class_1": 1}
    assert len(bundle.val) == 2
    with pytest.raises(DataError, match="num_classes=9 but only 4"):
        build_data(folder_cfg(root, num_classes=9))


def _corrupt_tree(tmp_path: Path) -> tuple[Path, Path]:
    root = make_image_folder(tmp_path / "tree", classes=2, per_class=4, size=8)
    bad = root / "train" / "class_1" / "img_2.png"
    bad.write_bytes(b"this is not a png")
    truncated = root / "val" / "class_0" / "img_1.png"
    truncated.write_bytes(truncated.read_bytes()[:30])
    return root, bad


def test_corrupt_images_are_skipped_and_counted(tmp_path: Path) -> None:
    root, bad = _corrupt_tree(tmp_path)
    cfg = config_from_dict({**TINY, "data": {"dataset": "folder", "root": str(root), "img_size": 8},
                            "train": {"batch_size": 4}, "eval": {"sizes": [8, 16]}})
    data = build_data(cfg.data)
    loader = train_loader(data, cfg)
    batches = list(loader.epoch(0))
    assert len(batches) == 2
    assert [p for b in batches for p in b.skipped] == [str(bad)]
    assert sum(len(b.y) for b in batches) == 7 and all(b.x.shape[1:] == (3, 8, 8) for b in batches)
    ev = eval_loader(data, cfg)
    for protocol in ("resize", "canvas"):
        got = list(ev.batches(protocol, 16))
        assert sum(len(b.skipped) for b in got) == 1 and sum(len(b.y) for b in got) == 7
        assert all(b.x.shape[-2:] == (16, 16) for b in got)


def test_corrupt_image_error_mode_names_the_file(tmp_path: Path) -> None:
    root, bad = _corrupt_tree(tmp_path)
    cfg = config_from_dict({**TINY, "data": {"dataset": "folder", "root": str(root), "img_size": 8,
                                             "on_corrupt": "error"}, "train": {"batch_size": 4}})
    loader = train_loader(build_data(cfg.data), cfg)
    with pytest.raises(CorruptImageError, match=rf"cannot read image {bad}.*data\.on_corrupt=skip"):
        list(loader.epoch(0))


def test_canvas_places_the_image_at_training_scale_on_the_patch_grid() -> None:
    x = torch.rand(2, 1, 8, 8)
    offs = canvas_offsets(2, 8, 18, position="center", snap=4, gen=None)
    assert offs.tolist() == [[4, 4], [4, 4]]  # room 10 -> centre 5 -> snapped to the patch grid
    out = place_on_canvas(x, 18, offs, (0.0,))
    assert out.shape == (2, 1, 18, 18) and torch.equal(out[:, :, 4:12, 4:12], x)
    assert out.sum() == x.sum()  # everything else is background
    crop = place_on_canvas(x, 4, canvas_offsets(2, 8, 4, position="center", snap=1, gen=None), (0.0,))
    assert torch.equal(crop, x[:, :, 2:6, 2:6])  # smaller than training: a centre crop at training scale
    rand = canvas_offsets(100, 8, 24, position="random", snap=4, gen=torch.Generator().manual_seed(0))
    assert set(rand.flatten().tolist()) <= {0, 4, 8, 12, 16} and len(set(rand.flatten().tolist())) > 2


def test_eval_protocols_on_fashion_mnist() -> None:
    cfg = config_from_dict({**TINY, "eval": {"sizes": [20, 56], "max_images": 30}})
    data = build_data(cfg.data)
    ev = eval_loader(data, cfg)
    assert len(ev) == 30
    (resized,) = list(ev.batches("resize", 56))
    (canvas,) = list(ev.batches("canvas", 56))
    (train,) = list(ev.batches("resize", 28))
    assert resized.x.shape == canvas.x.shape == (30, 1, 56, 56) and torch.equal(resized.y, canvas.y)
    background = (0.0 - data.mean[0]) / data.std[0]
    assert torch.allclose(canvas.x[:, :, 12:40, 12:40], train.x)  # centred (offset 14 snapped to 12)
    assert torch.allclose(canvas.x[:, :, :12], torch.full_like(canvas.x[:, :, :12], background))
    assert not torch.allclose(resized.x[:, :, 12:40, 12:40], train.x)  # resize changes the content
    # DDP shards are disjoint and cover the subset
    shards = [eval_loader(data, cfg, Dist(r, 2)) for r in (0, 1)]
    ys = torch.cat([b.y for s in shards for b in s.batches("resize", 20)])
    assert sorted(ys.tolist()) == sorted(train.y.tolist())


def test_folder_augmentation_is_a_function_of_seed_epoch_and_index(tmp_path: Path) -> None:
    import numpy as np

    root = make_image_folder(tmp_path / "tree", classes=2, per_class=4, size=16)
    cfg = config_from_dict({**TINY, "data": {"dataset": "folder", "root": str(root), "img_size": 12,
                                             "augment": "crop_flip", "auto_augment": "rand-m9-mstd0.5"},
                            "train": {"batch_size": 4}})
    data = build_data(cfg.data)
    runs = []
    for global_seed in (1, 2):  # whatever the process's global RNGs (RandAugment draws from numpy's)
        np.random.seed(global_seed)
        torch.manual_seed(global_seed)
        runs.append([b.x for b in train_loader(data, cfg).epoch(0)])
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))
    other_epoch = [b.x for b in train_loader(data, cfg).epoch(1)]
    assert not all(torch.equal(a, b) for a, b in zip(runs[0], other_epoch, strict=True))


def test_multires_size_is_a_function_of_seed_epoch_step_shared_by_every_rank() -> None:
    cfg = config_from_dict({**TINY, "train": {"batch_size": 20, "sizes": [16, 20, 28]}})
    data = build_data(cfg.data)
    sizes = train_sizes(cfg.train, 28, 4)

    def loader(dist: Dist, drawn: list[int] | None = sizes) -> TrainLoader:
        return TrainLoader(data, cfg.data, batch_size=20, seed=cfg.seed, dist=dist, sizes=drawn)

    single, ranks = loader(Dist()), [loader(Dist(r, 2)) for r in (0, 1)]
    plan = [single.size_at(e, s) for e in range(3) for s in range(len(single))]
    assert set(plan) == {16, 20, 28}  # 30 draws reach every size
    assert all(plan == [r.size_at(e, s) for e in range(3) for s in range(len(r))] for r in ranks)
    fixed = loader(Dist(), None)  # the single-resolution loader: same images in the same order
    for b, f, *halves in zip(single.epoch(1), fixed.epoch(1), *(r.epoch(1) for r in ranks), strict=True):
        assert b.x.shape[-1] == single.size_at(1, b.step) and f.x.shape[-1] == 28
        assert torch.equal(b.y, f.y) and torch.equal(torch.cat([h.y for h in halves]), b.y)
        assert all(h.x.shape == (10, 1, b.x.shape[-1], b.x.shape[-1]) for h in halves)
    assert [b.x.shape[-1] for b in single.epoch(2, start_step=4)] == plan[24:]  # a resumed epoch draws the same


def test_multires_sizes_come_from_the_set_or_every_patch_multiple_of_the_range() -> None:
    tc = TrainConfig
    assert train_sizes(tc(size_range=[14, 28]), 28, 4) == [16, 20, 24, 28]
    assert train_sizes(tc(sizes=[28, 16, 16]), 28, 4) == [16, 28] and train_sizes(tc(), 28, 4) == [28]
    with pytest.raises(ConfigError, match=r"train\.sizes \[18\] are not multiples of the patch size 4"):
        train_sizes(tc(sizes=[16, 18]), 28, 4)
    with pytest.raises(ConfigError, match="holds no multiple of the patch size 4"):
        train_sizes(tc(size_range=[13, 15]), 28, 4)


def test_rrc_flip_crops_inside_the_image_within_the_area_range_and_never_upsizes_the_batch() -> None:
    from train.data.transforms import resized_crop_batch, resized_crop_boxes

    for lo, hi in ((0.35, 1.0), (0.08, 0.2)):
        boxes = resized_crop_boxes(500, 28, 28, torch.Generator().manual_seed(0), (lo, hi))
        areas = [bh * bw / 28**2 for _, _, bh, bw in boxes]
        assert all(t >= 0 and left >= 0 and t + bh <= 28 and left + bw <= 28 for t, left, bh, bw in boxes)
        assert lo - 0.05 <= min(areas) < lo + 0.05 and hi - 0.1 < max(areas) < hi + 0.05  # covered, rounding aside
    x = torch.rand(4, 1, 28, 28)
    out = resized_crop_batch(x, 20, torch.Generator().manual_seed(1), (0.35, 1.0))
    assert out.shape == (4, 1, 20, 20) and 0.0 <= out.min() and out.max() <= 1.0
    cfg = config_from_dict({**TINY, "data": {"augment": "rrc_flip", "train_per_class": 4}, "train": {"batch_size": 8}})
    data = build_data(cfg.data)
    first, again = (list(train_loader(data, cfg).epoch(0)) for _ in range(2))
    assert all(torch.equal(a.x, b.x) and a.x.shape[-1] == 28 for a, b in zip(first, again, strict=True))


def test_crop_scale_reaches_both_loaders_and_enters_the_fingerprint_only_when_set(tmp_path: Path) -> None:
    from train.engine.checkpoint import fingerprint

    base = {**TINY, "data": {"augment": "rrc_flip", "train_per_class": 4}, "train": {"batch_size": 8}}
    default, deit = (config_from_dict({**base, "data": {**base["data"], **extra}})
                     for extra in ({}, {"crop_scale": [0.08, 1.0]}))
    data = build_data(default.data)
    mild, wide = ([b.x for b in train_loader(data, cfg).epoch(0)] for cfg in (default, deit))
    assert not any(torch.equal(a, b) for a, b in zip(mild, wide, strict=True))  # the tensor loader's crops
    root = make_image_folder(tmp_path / "tree", classes=2, per_class=4, size=16)
    folder = config_from_dict({**TINY, "data": {"dataset": "folder", "root": str(root), "img_size": 12,
                                                "augment": "crop_flip", "crop_scale": [0.08, 0.5]},
                               "train": {"batch_size": 4}})
    folder_data = build_data(folder.data)
    next(iter(train_loader(folder_data, folder).epoch(0)))
    crops = [t for t in folder_data.train.transform.transforms if hasattr(t, "scale")]  # timm's RandomResizedCrop
    assert [c.scale for c in crops] == [(0.08, 0.5)]
    assert "crop_scale" not in fingerprint(default, default.schemes[0])["data"]  # earlier runs keep theirs
    assert fingerprint(deit, deit.schemes[0])["data"]["crop_scale"] == [0.08, 1.0]
    for bad in ([0.0, 1.0], [0.5, 0.4], [0.5], [0.1, 1.5]):
        with pytest.raises(ConfigError, match="data.crop_scale"):
            config_from_dict({**base, "data": {**base["data"], "crop_scale": bad}})
