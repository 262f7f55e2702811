"""A grid task's label is readable only from where the glyphs are. Counting: neither which glyph types an
image holds nor how many of each says anything about it, checked with the best classifier there is on such
a discrete feature (each feature value's majority label, learnt on one split, scored on another), which a
leaking generator (its near glyphs of one type) drives far above chance. Every task: the bag of patches, all
that a model without positions sees, gives a linear classifier chance accuracy on held-out images."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable

import numpy as np
import pytest
import torch

from train.data.grid_tasks import COUNT_MAX, COUNT_RADIUS, generate, render

TASKS = ("grid_lookup", "grid_direction", "grid_placement", "grid_count")

ART = {  # the glyphs written out again (row-major, '#' on): the decoder must not share the generator's bank
    "hbar": "....########....", "vbar": ".##..##..##..##.", "diag": "##..###..###..##",
    "anti": "..##.######.##..", "solid": "#" * 16, "ring": "#####..##..#####",
}
CONTENT = ("hbar", "vbar", "diag", "anti")
GRID, PER_CLASS = 8, 2000
CHANCE = 100.0 / (COUNT_MAX + 1)
MARGIN = 4.0  # points above chance; chance's standard deviation on 6000 images is 0.6 points


def decode(images: torch.Tensor) -> np.ndarray:
    """uint8 [N, 1, 4G, 4G] -> [N, G, G] glyph index into ``ART`` (-1: empty); fails on any other pattern."""
    n, g = len(images), images.shape[-1] // 4
    bits = (images[:, 0].numpy() == 255).reshape(n, g, 4, g, 4).transpose(0, 1, 3, 2, 4).reshape(n, g, g, 16)
    code = bits @ (1 << np.arange(16))  # [N, G, G]
    table = {sum(1 << i for i, c in enumerate(art) if c == "#"): k for k, art in enumerate(ART.values())} | {0: -1}
    assert set(np.unique(code).tolist()) <= set(table), "a cell that is no glyph"
    return np.vectorize(table.__getitem__)(code)


def type_counts(cells: np.ndarray) -> np.ndarray:
    """[N, G, G] glyph indices -> [N, 4]: how many glyphs of each content type each image holds."""
    return np.stack([(cells == list(ART).index(t)).sum(axis=(1, 2)) for t in CONTENT], axis=1)


FEATURES: dict[str, Callable[[np.ndarray], list[tuple[int, ...]]]] = {
    "which types appear": lambda c: [tuple(row) for row in (c > 0).astype(int)],
    **{f"number of {t}": (lambda c, i=i: [(int(v),) for v in c[:, i]]) for i, t in enumerate(CONTENT)},
    "number of each type": lambda c: [tuple(row) for row in c],
}


def best_accuracy(feature: Callable[[np.ndarray], list[tuple[int, ...]]], train: tuple[np.ndarray, np.ndarray],
                  test: tuple[np.ndarray, np.ndarray]) -> float:
    """Top-1 % on ``test`` of each feature value's majority label in ``train`` (unseen values: the overall
    majority), for (per-type counts [N, 4], labels [N]) pairs."""
    votes: dict[tuple[int, ...], Counter] = defaultdict(Counter)
    for value, label in zip(feature(train[0]), train[1].tolist(), strict=True):
        votes[value][label] += 1
    fallback = Counter(train[1].tolist()).most_common(1)[0][0]
    guess = [votes[v].most_common(1)[0][0] if v in votes else fallback for v in feature(test[0])]
    return 100.0 * float(np.mean(np.asarray(guess) == test[1]))


def split(seed: int, leak: bool = False) -> tuple[np.ndarray, np.ndarray]:
    images, labels = generate.__wrapped__("grid_count", grid=GRID, per_class=PER_CLASS, seed=seed)
    cells = decode(images)
    if leak:
        cells = decode(render(near_glyphs_of_one_type(cells)))
    return type_counts(cells), labels.numpy()


def near_glyphs_of_one_type(cells: np.ndarray) -> np.ndarray:
    """A leaking count task: the same images with every glyph near the marker made an hbar and every hbar
    farther away a vbar, so that the near glyphs are of a type no distractor has (left among the distractors,
    hbars would appear in nearly every image and their presence say little). Cell values as the generator
    writes them: glyph k of ``ART`` is k + 1, empty 0."""
    solid = list(ART).index("solid")
    n, g, _ = cells.shape
    at = np.argwhere(cells == solid)  # [N, 3]: (image, y, x), one marker per image
    assert len(at) == n
    ys, xs = np.meshgrid(np.arange(g), np.arange(g), indexing="ij")
    d2 = (ys[None] - at[:, 1, None, None]) ** 2 + (xs[None] - at[:, 2, None, None]) ** 2
    near = (d2 > 0) & (d2 <= COUNT_RADIUS**2) & (cells >= 0)
    out = cells + 1
    hbar = list(ART).index("hbar")
    out[~near & (cells == hbar)] = list(ART).index("vbar") + 1
    out[near] = hbar + 1
    return out


@pytest.fixture(scope="module")
def splits() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    return {"train": split(0), "test": split(1), "leaky train": split(0, leak=True), "leaky test": split(1, leak=True)}


@pytest.mark.parametrize("name", list(FEATURES))
def test_count_label_cannot_be_read_from_glyph_types(name: str, splits: dict) -> None:
    acc = best_accuracy(FEATURES[name], splits["train"], splits["test"])
    assert acc < CHANCE + MARGIN, f"{name} gives the count label {acc:.1f} % of the time (chance {CHANCE:.1f} %)"


@pytest.mark.parametrize("name", ["which types appear", "number of hbar"])
def test_the_check_catches_near_glyphs_of_one_type(name: str, splits: dict) -> None:
    """Negative control: the same check flags a generator whose near glyphs are all hbars."""
    acc = best_accuracy(FEATURES[name], splits["leaky train"], splits["leaky test"])
    assert acc >= CHANCE + MARGIN, acc


def bag_of_patches(images: torch.Tensor) -> np.ndarray:
    """[N, 1, H, W] -> [N, 7]: how many cells are empty and how many hold each glyph (markers included): the
    patches as a set, all that a model without positions can see of an image."""
    cells = decode(images).reshape(len(images), -1) + 1  # 0: empty
    return np.stack([np.bincount(row, minlength=len(ART) + 1) for row in cells]).astype(float)


def linear_accuracy(x: np.ndarray, y: np.ndarray, x_test: np.ndarray, y_test: np.ndarray) -> float:
    """Held-out accuracy of linear discriminant analysis (class means, pooled covariance) on features x."""
    classes = np.unique(y)
    means = np.stack([x[y == k].mean(0) for k in classes])
    cov = np.cov((x - means[np.searchsorted(classes, y)]).T) + 1e-6 * np.eye(x.shape[1])
    w = np.linalg.solve(cov, means.T)  # [F, K]
    scores = x_test @ w - 0.5 * np.einsum("kf,fk->k", means, w)
    return float((classes[scores.argmax(1)] == y_test).mean())


@pytest.mark.parametrize("task", TASKS)
def test_a_model_without_positions_has_nothing_to_go_on(task: str) -> None:
    """The glyph counts (the markers' too) are independent of the label: the best linear classifier of the
    bag of patches scores chance on held-out images, where a +1 count of the answer's glyph (the lookup's
    answer written over uniformly drawn glyphs) scores about 31 % against 25."""
    images, labels = generate.__wrapped__(task, grid=GRID, per_class=1500, seed=7)
    test_images, test_labels = generate.__wrapped__(task, grid=GRID, per_class=1000, seed=8)
    chance = 1 / (int(labels.max()) + 1)
    acc = linear_accuracy(bag_of_patches(images), labels.numpy(), bag_of_patches(test_images), test_labels.numpy())
    se = np.sqrt(chance * (1 - chance) / len(test_labels))
    assert acc < chance + 3 * se, (acc, chance)


def test_lookup_answers_are_not_more_frequent_than_the_other_glyphs() -> None:
    images, labels = generate.__wrapped__("grid_lookup", grid=GRID, per_class=2000, seed=2)
    bag = bag_of_patches(images)[:, [list(ART).index(t) + 1 for t in CONTENT]]  # [N, 4] content counts
    most_frequent = (bag + 1e-3 * np.random.default_rng(0).random(bag.shape)).argmax(1)
    chance, se = 0.25, np.sqrt(0.25 * 0.75 / len(labels))
    assert (most_frequent == labels.numpy()).mean() < chance + 3 * se
    own = bag[np.arange(len(labels)), labels.numpy()]  # the answer's glyph count, against the others' mean
    assert abs(own.mean() - (bag.sum(1) - own).mean() / 3) < 0.3
