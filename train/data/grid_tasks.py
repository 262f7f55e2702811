"""Position tasks on a grid of glyphs, generated from a seed: datasets whose label needs where things are.

An image is a G x G grid of cells of ``GLYPH`` x ``GLYPH`` pixels (4 px: one cell per patch of a patch-4
ViT), each cell empty or holding one glyph of a fixed bank. A task is a rule that draws the cells and the
label; the same rule draws at any grid size, so a larger test image holds more tokens at the training
scale. Labels are balanced: every class gets exactly ``per_class`` images. Rows grow downwards; offsets
are (dy, dx) in cells.

- ``grid_lookup`` (2D passkey): every cell holds one of 4 content glyphs except one marker; the label is
  the glyph at the marker's fixed offset, ``LOOKUP_OFFSETS``: (+2, +2) from a solid marker, (-1, +3)
  from a ring marker (both diagonal: neither offset lies on an axis). Only the offset tells the target
  cell from the others of its kind: how many cells hold each glyph is independent of the label.
- ``grid_direction``: a solid and a ring marker among sparse distractor glyphs; the label is the direction
  from the solid to the ring marker in 8 sectors of 45 degrees centred on E, NE, N, NW, W, SW, S, SE
  (N is up; the diagonal sectors are half the classes).
- ``grid_placement``: one solid marker among sparse distractors; the label is which of
  ``PLACEMENT_REGIONS`` x ``PLACEMENT_REGIONS`` equal regions of the image holds it (absolute position,
  in units of the image side).
- ``grid_count``: one solid marker, 0-2 content glyphs within Euclidean distance ``COUNT_RADIUS`` cells of
  it (1.5: its 8 neighbours) and distractors only farther away, as many as make the total number of
  glyphs independent of the label; the label is that number (distance without direction).
- ``grid_lookup_shuffled``: the lookup task's images with their training labels permuted once (a control:
  nothing to learn, so validation accuracy stays at chance); validation labels are the true ones.

Test large: the canvas protocol evaluates a grid task on images drawn by the same rule at the evaluation
grid (``TensorImages.at_size``), not on a training-size image padded with background: padding would put
the objects in the centre of an empty frame (another task: no distractors, and the placement label no
longer the marker's region). At a larger grid the markers may be farther apart than any training pair
(direction) and the lookup has more distractors; the offsets the labels depend on are unchanged.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from ..runtime.seeds import mix_seed
from .datasets import DataBundle, DataError, TensorImages

GLYPH = 4  # pixels per cell side
_ART: dict[str, tuple[str, ...]] = {  # 4 x 4 glyphs, '#' = on
    "hbar": ("....", "####", "####", "...."),
    "vbar": (".##.", ".##.", ".##.", ".##."),
    "diag": ("##..", "###.", ".###", "..##"),
    "anti": ("..##", ".###", "###.", "##.."),
    "solid": ("####", "####", "####", "####"),
    "ring": ("####", "#..#", "#..#", "####"),
}
NAMES: tuple[str, ...] = tuple(_ART)
EMPTY = 0  # cell value of an empty cell; glyph k of NAMES is cell value k + 1
CONTENT: tuple[int, ...] = tuple(NAMES.index(n) + 1 for n in ("hbar", "vbar", "diag", "anti"))
SOLID, RING = NAMES.index("solid") + 1, NAMES.index("ring") + 1
BANK = np.zeros((len(NAMES) + 1, GLYPH, GLYPH), dtype=np.uint8)  # [glyphs + 1, 4, 4], row 0 empty
for _k, _rows in enumerate(_ART.values()):
    BANK[_k + 1] = [[255 * (c == "#") for c in row] for row in _rows]

LOOKUP_OFFSETS: dict[int, tuple[int, int]] = {SOLID: (2, 2), RING: (-1, 3)}  # marker -> (dy, dx) of the answer
DIRECTIONS: tuple[str, ...] = ("E", "NE", "N", "NW", "W", "SW", "S", "SE")
PLACEMENT_REGIONS = 4  # regions per axis
COUNT_RADIUS = 1.5  # cells, Euclidean: the 8 neighbours
COUNT_MAX = 2
DISTRACTORS = 0.15  # fraction of the free cells holding a content glyph (direction, placement, count)

Cells = np.ndarray  # [N, G, G] int64 cell values (EMPTY, or a glyph's value)


def render(cells: Cells, cell: int = GLYPH) -> Tensor:
    """Cell values [N, G, G] -> uint8 images [N, 1, G * cell, G * cell]: each glyph drawn on ``cell`` x ``cell``
    pixels (nearest neighbour from its 4 x 4 art: exact at multiples of 4)."""
    n, g, _ = cells.shape
    idx = np.arange(cell) * GLYPH // cell
    pix = BANK[:, idx][:, :, idx][cells]  # [N, G, G, cell, cell]
    pix = pix.transpose(0, 1, 3, 2, 4).reshape(n, g * cell, g * cell)  # [N, G*cell, G*cell]
    return torch.from_numpy(np.ascontiguousarray(pix)).unsqueeze(1)


def balanced_labels(rng: np.random.Generator, classes: int, per_class: int) -> np.ndarray:
    """[classes * per_class] labels, each class exactly ``per_class`` times, in random order."""
    return rng.permutation(np.repeat(np.arange(classes), per_class))


def _distractors(rng: np.random.Generator, cells: Cells, free: np.ndarray) -> None:
    """Put random content glyphs on a ``DISTRACTORS`` fraction of the cells where ``free`` [N, G, G] holds."""
    on = free & (rng.random(cells.shape) < DISTRACTORS)
    cells[on] = np.asarray(CONTENT)[rng.integers(0, len(CONTENT), cells.shape)][on]


def lookup_cells(rng: np.random.Generator, labels: np.ndarray, grid: int) -> Cells:
    """Every cell a content glyph; one marker; the glyph at the marker's offset is CONTENT[label].

    The glyphs are drawn independently of the label (redrawn where one of the 4 is missing), and the answer is
    put in place by swapping the target cell's glyph with a random cell holding CONTENT[label]: the number of
    each glyph, all that a model without positions sees, says nothing about the label."""
    n = len(labels)
    content = np.asarray(CONTENT)
    markers = np.asarray(list(LOOKUP_OFFSETS))[rng.integers(0, len(LOOKUP_OFFSETS), n)]
    off = np.asarray([LOOKUP_OFFSETS[m] for m in markers.tolist()]).reshape(n, 2)  # [N, 2] (dy, dx)
    lo, hi = np.maximum(0, -off), grid - np.maximum(0, off)  # marker range keeping the answer inside
    at = lo + (rng.random((n, 2)) * (hi - lo)).astype(np.int64)  # [N, 2] marker (y, x)
    rows = np.arange(n)
    cells = np.zeros((n, grid, grid), dtype=np.int64)
    todo = rows
    while len(todo):  # rejection on a label-free event: every content glyph once or more among the other cells
        draw = content[rng.integers(0, len(content), (len(todo), grid, grid))]
        draw[np.arange(len(todo)), at[todo, 0], at[todo, 1]] = EMPTY
        ok = np.all((draw[..., None] == content).any(axis=(1, 2)), axis=1)
        cells[todo[ok]] = draw[ok]
        todo = todo[~ok]
    target = (at[:, 0] + off[:, 0]) * grid + at[:, 1] + off[:, 1]  # [N] flat index of the answer's cell
    flat = cells.reshape(n, -1)
    holds = flat == content[labels][:, None]  # [N, G*G] cells holding the answer's glyph (the marker's: none)
    keys = np.where(holds, rng.random(holds.shape), -1.0)
    swap = np.where(holds[rows, target], target, keys.argmax(axis=1))  # the target itself when it holds it
    flat[rows, swap], flat[rows, target] = flat[rows, target], content[labels]
    flat[rows, at[:, 0] * grid + at[:, 1]] = markers
    return cells


def direction_sector(dy: np.ndarray, dx: np.ndarray) -> np.ndarray:
    """Sector index (DIRECTIONS) of the offset (dy, dx), rows down: 0 = E, 2 = N (up), 4 = W, 6 = S."""
    angle = np.arctan2(-dy, dx)  # counter-clockwise from E, y up
    return np.round(angle / (np.pi / 4)).astype(np.int64) % 8


def direction_cells(rng: np.random.Generator, labels: np.ndarray, grid: int) -> Cells:
    """A solid and a ring marker whose direction (solid -> ring) is the label's sector; sparse distractors."""
    n = len(labels)
    a, b = np.zeros((n, 2), np.int64), np.zeros((n, 2), np.int64)
    todo = np.arange(n)
    while len(todo):  # rejection: about 8 rounds per sample
        pa, pb = rng.integers(0, grid, (len(todo), 2)), rng.integers(0, grid, (len(todo), 2))
        d = pb - pa
        ok = np.any(d != 0, axis=1) & (direction_sector(d[:, 0], d[:, 1]) == labels[todo])
        a[todo[ok]], b[todo[ok]] = pa[ok], pb[ok]
        todo = todo[~ok]
    cells = np.full((n, grid, grid), EMPTY, dtype=np.int64)
    rows = np.arange(n)
    free = np.ones_like(cells, dtype=bool)
    free[rows, a[:, 0], a[:, 1]] = free[rows, b[:, 0], b[:, 1]] = False
    _distractors(rng, cells, free)
    cells[rows, a[:, 0], a[:, 1]], cells[rows, b[:, 0], b[:, 1]] = SOLID, RING
    return cells


def region_of(index: np.ndarray, grid: int, regions: int) -> np.ndarray:
    """Region (0..regions-1) along one axis of cell ``index``: where the cell's centre falls in the side."""
    return (regions * (2 * index + 1)) // (2 * grid)


def placement_cells(rng: np.random.Generator, labels: np.ndarray, grid: int) -> Cells:
    """One solid marker in region ``label`` (row-major over PLACEMENT_REGIONS^2); sparse distractors."""
    r = PLACEMENT_REGIONS
    n = len(labels)
    axis_region = region_of(np.arange(grid), grid, r)  # [G]
    start = np.searchsorted(axis_region, np.arange(r))  # first cell of each region (regions are contiguous)
    count = np.bincount(axis_region, minlength=r)
    want = np.stack([labels // r, labels % r], axis=1)  # [N, 2] region (row, column)
    at = start[want] + (rng.random((n, 2)) * count[want]).astype(np.int64)  # [N, 2] marker (y, x)
    cells = np.full((n, grid, grid), EMPTY, dtype=np.int64)
    rows = np.arange(n)
    free = np.ones_like(cells, dtype=bool)
    free[rows, at[:, 0], at[:, 1]] = False
    _distractors(rng, cells, free)
    cells[rows, at[:, 0], at[:, 1]] = SOLID
    return cells


def count_cells(rng: np.random.Generator, labels: np.ndarray, grid: int) -> Cells:
    """One solid marker, ``label`` content glyphs within COUNT_RADIUS of it, distractors only beyond."""
    n = len(labels)
    at = rng.integers(0, grid, (n, 2))  # [N, 2] marker (y, x)
    ys, xs = np.meshgrid(np.arange(grid), np.arange(grid), indexing="ij")  # [G, G]
    d2 = (ys[None] - at[:, 0, None, None]) ** 2 + (xs[None] - at[:, 1, None, None]) ** 2  # [N, G, G]
    near = (d2 > 0) & (d2 <= COUNT_RADIUS**2)  # [N, G, G]
    # the label's number of near cells, chosen uniformly: the smallest random keys among the near cells
    keys = np.where(near, rng.random(d2.shape), np.inf).reshape(n, -1)
    rank = np.argsort(np.argsort(keys, axis=1), axis=1).reshape(d2.shape)
    chosen = near & (rank < labels[:, None, None])
    # distractors: a binomial number (DISTRACTORS of the far cells) plus COUNT_MAX - label, so that the total
    # number of glyphs says nothing about the label: only the near ones do
    far = d2 > COUNT_RADIUS**2  # [N, G, G]
    n_far = rng.binomial(far.sum(axis=(1, 2)), DISTRACTORS) + COUNT_MAX - labels  # [N]
    keys = np.where(far, rng.random(d2.shape), np.inf).reshape(n, -1)
    rank = np.argsort(np.argsort(keys, axis=1), axis=1).reshape(d2.shape)
    chosen |= far & (rank < n_far[:, None, None])
    cells = np.full((n, grid, grid), EMPTY, dtype=np.int64)
    cells[chosen] = np.asarray(CONTENT)[rng.integers(0, len(CONTENT), int(chosen.sum()))]
    cells[np.arange(n), at[:, 0], at[:, 1]] = SOLID
    return cells


_TASKS: dict[str, tuple[list[str], Callable[[np.random.Generator, np.ndarray, int], Cells]]] = {
    "grid_lookup": ([NAMES[v - 1] for v in CONTENT], lookup_cells),
    "grid_direction": (list(DIRECTIONS), direction_cells),
    "grid_placement": ([f"r{i}c{j}" for i in range(PLACEMENT_REGIONS) for j in range(PLACEMENT_REGIONS)],
                       placement_cells),
    "grid_count": ([str(k) for k in range(COUNT_MAX + 1)], count_cells),
}
# the smallest grid each rule can draw at, and why (checked when a config is read and before drawing)
MIN_GRID: dict[str, tuple[int, str]] = {
    "grid_lookup": (max(max(abs(dy), abs(dx)) for dy, dx in LOOKUP_OFFSETS.values()) + 1,
                    f"a grid larger than its offsets {list(LOOKUP_OFFSETS.values())}"),
    "grid_direction": (2, "two distinct cells for its two markers"),
    "grid_placement": (PLACEMENT_REGIONS, f"one cell per region ({PLACEMENT_REGIONS} per axis)"),
    "grid_count": (3, "a marker's 8 neighbours"),
}
CONTROLS: dict[str, str] = {"grid_lookup_shuffled": "grid_lookup"}  # control -> the task whose images it uses
GRID_TASKS: tuple[str, ...] = (*_TASKS, *CONTROLS)
TRAIN_SEED, VAL_SEED = 0, 1  # generator seeds of the two splits (mixed with the task name and the grid)
# images per split when data.*_per_class is null; counting learns slowest and gets twice the training images
DEFAULT_IMAGES: dict[str, dict[str, int]] = {"train": {"grid_count": 12800}, "val": {}}
DEFAULT_SPLIT_IMAGES = {"train": 6400, "val": 320}


def classes_of(task: str) -> list[str]:
    """The class names of a grid task (a control has its task's classes)."""
    return list(_TASKS[CONTROLS.get(task, task)][0])


@functools.lru_cache(maxsize=32)
def scenes(task: str, *, grid: int, per_class: int, seed: int) -> tuple[Cells, Tensor]:
    """Cell values [N, grid, grid] and labels int64 [N] of ``task`` (not a control), ``per_class`` per class,
    a function of (task, grid, per_class, seed) only. Cached: callers never modify the arrays."""
    if task not in _TASKS:
        raise DataError(f"unknown grid task {task!r}; known: {', '.join(_TASKS)}")
    names, draw = _TASKS[task]
    grid_of(grid * GLYPH, "generate", task)
    rng = np.random.default_rng(mix_seed(zlib.crc32(task.encode()), grid, seed))
    labels = balanced_labels(rng, len(names), per_class)
    return draw(rng, labels, grid), torch.from_numpy(labels).long()


@functools.lru_cache(maxsize=32)
def generate(task: str, *, grid: int, per_class: int, seed: int, cell: int = GLYPH) -> tuple[Tensor, Tensor]:
    """Images uint8 [N, 1, grid * cell, grid * cell] and labels int64 [N]: ``scenes`` drawn with ``cell`` px
    cells (the same scenes at every cell size). Cached: callers never modify the tensors."""
    cells, labels = scenes(task, grid=grid, per_class=per_class, seed=seed)
    return render(cells, cell), labels


def grid_of(size: int, where: str, task: str | None = None) -> int:
    """The grid (cells per side) of an image of ``size`` px; sizes must be whole cells, and (with ``task``)
    at least the task's ``MIN_GRID``."""
    if size < GLYPH or size % GLYPH:
        raise DataError(f"{where}: grid tasks draw {GLYPH} px cells, so image sizes are positive multiples of "
                        f"{GLYPH} px, got {size}")
    grid = size // GLYPH
    least, why = MIN_GRID[CONTROLS.get(task, task)] if task is not None else (1, "")
    if grid < least:
        raise DataError(f"{where}: {task} needs {why}: at least {least} x {least} cells ({least * GLYPH} px), "
                        f"got {size} px ({grid} x {grid} cells)")
    return grid


def zoomed_grid(size: int, grid: int, where: str) -> int:
    """The cell size (px) that draws a ``grid`` x ``grid`` scene on ``size`` px: sizes must be whole multiples."""
    if size < grid or size % grid:
        raise DataError(f"{where}: the zoom protocol draws the training grid's {grid} x {grid} cells larger, so "
                        f"sizes are multiples of {grid} px, got {size}")
    return size // grid


def _val_at(task: str, per_class: int, size: int) -> TensorImages:
    images, labels = generate(task, grid=grid_of(size, "evaluation size", task), per_class=per_class, seed=VAL_SEED)
    return TensorImages(images, labels)


def _val_zoomed(task: str, per_class: int, grid: int, size: int) -> TensorImages:
    cell = zoomed_grid(size, grid, "evaluation size")
    images, labels = generate(task, grid=grid, per_class=per_class, seed=VAL_SEED, cell=cell)
    return TensorImages(images, labels)


def zoom_grids(img_size: int, zooms: list[int], task: str) -> dict[int, int]:
    """Training zoom -> the grid of its scenes on ``img_size`` px (cells of GLYPH x zoom px), checked against
    the task's ``MIN_GRID``."""
    out = {}
    for z in zooms:
        if z < 1 or img_size % (GLYPH * z):
            raise DataError(f"data.zooms: zoom {z} draws {GLYPH * z} px cells, which do not tile data.img_size "
                            f"{img_size} px; use positive zooms z with img_size a multiple of {GLYPH} x z")
        out[z] = grid = img_size // (GLYPH * z)
        least, why = MIN_GRID[task]
        if grid < least:
            raise DataError(f"data.zooms: zoom {z} draws {task} scenes of {grid} x {grid} cells on {img_size} px; "
                            f"the task needs {why}: at least {least} x {least} cells")
    return out


def build_grid_data(*, dataset: str, img_size: int, train_per_class: int | None, val_per_class: int | None,
                    augment: str, mean: list[float] | None, std: list[float] | None,
                    class_choice: bool, zooms: list[int] | None = None) -> DataBundle:
    """The training and validation sets of a grid task at ``img_size`` px; the validation set redraws
    itself at any evaluation size (``at_size``, the canvas protocol) and draws its scenes larger
    (``at_zoom``, the zoom protocol). With several ``zooms`` the training images are split evenly between
    them: scenes of img_size / (4 z) cells per side, each cell drawn on 4 z px (scale augmentation)."""
    if dataset not in GRID_TASKS:
        raise DataError(f"unknown grid task {dataset!r}; known: {', '.join(GRID_TASKS)}")
    if augment != "none":
        raise DataError(f"data.augment={augment!r}: grid tasks take no augmentation (a flip or crop changes the "
                        "answer: direction, region, offset); accepted: none; scale augmentation: data.zooms")
    if class_choice:
        raise DataError("data.classes / class_file / num_classes: a grid task's classes are fixed by the task")
    task = CONTROLS.get(dataset, dataset)
    grid = grid_of(img_size, "data.img_size", task)
    grids = zoom_grids(img_size, list(zooms or [1]), task)
    classes = classes_of(dataset)
    n_train, n_val = (per_class or max(1, DEFAULT_IMAGES[split].get(task, DEFAULT_SPLIT_IMAGES[split]) // len(classes))
                      for split, per_class in (("train", train_per_class), ("val", val_per_class)))
    shares = [n_train // len(grids) + (i < n_train % len(grids)) for i in range(len(grids))]  # per class, per zoom
    parts = [generate(task, grid=g, per_class=k, seed=TRAIN_SEED, cell=GLYPH * z)
             for (z, g), k in zip(grids.items(), shares, strict=True) if k]
    images, labels = torch.cat([im for im, _ in parts]), torch.cat([lab for _, lab in parts])
    if dataset in CONTROLS:  # the control: labels permuted once, independently of the images
        rng = np.random.default_rng(mix_seed(zlib.crc32(dataset.encode()), grid))
        labels = labels[torch.from_numpy(rng.permutation(len(labels)))]
    val = _val_at(task, n_val, img_size)
    val.at_size = functools.partial(_val_at, task, n_val)
    val.at_zoom = functools.partial(_val_zoomed, task, n_val, grid)
    canvas = (f"a new validation set drawn by the {task} rule at each evaluation grid ({GLYPH} px cells, the "
              "training scale; more cells, not a padded training-size image)")
    return DataBundle(TensorImages(images, labels), val, classes, 1, tuple(mean or (0.5,)),
                      tuple(std or (0.5,)), background=(0.0,), canvas=canvas)
