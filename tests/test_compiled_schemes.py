"""Every 2D scheme on the compiled path (``benchmarks/compiled_work.py``): under
``torch.compile(model, fullgraph=True, dynamic=True)`` with inductor, in inference and (the rotations and the
masks) in training, the scheme compiles as one graph, computes what the eager model computes, adds at most its
kernel budget (``kernel_budget``) to the generated kernels the unpatched model runs, and at inference a third image
size does not recompile. A 2-block ViT of 64 channels at 32 px.

Marked ``compiled``: compiling some fifty graphs takes minutes, so the test suite leaves it out (``-m "not
compiled"``, pyproject.toml) and ``make compiled-kernels`` runs it, a step of its own in CI. The suite keeps a
representative pair (``tests/test_compiled_kernels.py``)."""

from __future__ import annotations

import pytest
import torch

import vispos
from benchmarks.compiled_work import build, compiled_work, kernel_budget

pytestmark = pytest.mark.compiled

TINY = {"depth": 2, "embed_dim": 64, "num_heads": 2}
SIZE = 32
TRAINED = ("rotary", "bias")  # the kinds whose training step is compiled too: the rotations and the masks
SCHEMES = vispos.list_encodings(ndim=2)
CASES = [(s, "inference") for s in SCHEMES] + [
    (s, "training") for s in SCHEMES if vispos.get_info(s, ndim=2).kind in TRAINED
]
# Why a learned mask's training step is over: attention's work outside SDPA's fused kernel
MATH_PATH = ("the mask has a gradient, so CPU attention takes SDPA's math path in training: the softmax and the copy "
             "of attention's output, and their gradients, are generated kernels in every layer (four a layer that the "
             "fused path runs inside its library kernel)")
# Over the budget: the kernels each adds today and what the generated code shows adds them. Reported as expected
# failures; a case that adds one more kernel fails, and one that comes within its budget fails until it is taken
# off this list.
OVER = {
    ("cpb2d", "inference"): (5, "the MLP is two library matrix products, so each layer's table is elementwise work "
    "in three places (the log-spaced offsets in, the ReLU between, the sigmoid out) beside the mask; the generated "
    "code fuses the second layer's input into the first layer's output and every mask into one kernel, and leaves "
    "the first layer's input a kernel of its own: 5 over 2 layers where the budget gives 4"),
    ("fire2d", "inference"): (5, "the MLP is two library matrix products, so each layer's table is elementwise work "
    "in three places (FIRE's log-normalised offsets in, the ReLU between, the table out) beside the mask; the "
    "generated code fuses the second layer's input into the first layer's output and every mask into one kernel, "
    "and leaves the first layer's input a kernel of its own: 5 over 2 layers where the budget gives 4"),
    ("decomposed2d", "inference"): (6, "each axis's product of q with its table (two einsums a layer, library matrix "
    "products) copies q into the product's layout first: two copies and the bias, three kernels a layer"),
    ("pape2d", "inference"): (6, "PaPE appends its channels to q and k and pads v to their width (attention takes one "
    "head dimension): attention's output is sliced back to the head's channels, a copy a layer before the out "
    "projection"),
    ("cpb2d", "training"): (15, f"{MATH_PATH}, beside the MLP's elementwise work and its gradient"),
    ("fire2d", "training"): (18, f"{MATH_PATH}, beside the MLP's elementwise work and its gradient"),
    ("relbias2d", "training"): (10, f"{MATH_PATH}; the table's gather and its gradient's scatter fit the budget"),
    ("irpe2d_bias", "training"): (10, f"{MATH_PATH}; the table's gather and its gradient's scatter fit the budget"),
}
_unpatched: dict[str, object] = {}


def unpatched(mode: str):  # noqa: ANN201
    """The unpatched model's generated work in ``mode``, compiled once per process."""
    if mode not in _unpatched:
        torch.manual_seed(0)
        _unpatched[mode] = compiled_work(build(None, SIZE, **TINY), SIZE, 2, train=mode == "training", resize=False)
        assert _unpatched[mode].kernels > 0  # the counter reads the generated code
    return _unpatched[mode]


@pytest.mark.parametrize(("scheme", "mode"), CASES)
def test_every_scheme_compiles_as_eager_within_its_kernel_budget_without_recompiling(scheme: str, mode: str) -> None:
    torch.manual_seed(0)
    training = mode == "training"  # one size: a new size's training graph is the host's recompile (below)
    work = compiled_work(build(scheme, SIZE, **TINY), SIZE, 2, train=training, resize=not training, compare=True)
    added = work.minus(unpatched(mode))
    print(f"{scheme} {mode}: +{added.kernels} kernels, +{added.library} library calls, "
          f"{added.bytes / 1e6:+.3f} MB by inductor's estimate, error {work.error:.1e}")
    assert work.error < 1e-4, f"compiled outputs differ from eager by {work.error}"
    # a third image size does not recompile at inference. A training step is run at one size: with these models'
    # dynamic shapes (timm's dynamic_img_pad), inductor (torch 2.14.1) fails on a training step at a third size with
    # an input-stride assertion, the unpatched model's and nope's included (a second size:
    # tests/test_compiled_resample.py)
    assert not work.recompiled, "a third image size recompiled"
    budget = kernel_budget(scheme, TINY["depth"], training=mode == "training")
    if (scheme, mode) in OVER:
        today, cause = OVER[scheme, mode]
        assert added.kernels <= today, f"{scheme} ({mode}) adds {added.kernels} kernels, {today} before: {added}"
        assert added.kernels > budget, f"{scheme} ({mode}) is within its budget now: take it off OVER"
        pytest.xfail(cause)
    assert added.kernels <= budget, added
