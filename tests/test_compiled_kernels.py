"""The compiled path (``benchmarks/compiled_work.py``): under ``torch.compile(model, fullgraph=True, dynamic=True)``
with inductor, a scheme adds at most its kernel budget (one kernel per layer for the rotation or the mask, plus
its table's) to the generated code, and a new image size does not recompile. The cheapest representative set
(a rotation with a shared table, a mask shared by the layers), on a 2-block ViT of 64 channels, inference;
``make compiled-kernels`` (``tests/test_compiled_schemes.py``) checks every 2D scheme, in training too."""

from __future__ import annotations

import pytest
import torch

from benchmarks.compiled_work import build as build_model
from benchmarks.compiled_work import compiled_work, kernel_budget

pytestmark = pytest.mark.slow  # inductor's kernels per scheme: make test-slow (a CI step), not make test

TINY = {"depth": 2, "embed_dim": 64, "num_heads": 2}
SIZE = 32


@pytest.fixture(scope="module")
def unpatched():
    work = compiled_work(build_model(None, SIZE, **TINY), SIZE, 2, train=False, resize=False)
    assert work.kernels > 0  # the counter reads the generated code
    return work


@pytest.mark.parametrize("scheme", ["rope2d", "alibi2d"])
def test_a_scheme_adds_at_most_its_kernel_budget_and_never_recompiles(scheme: str, unpatched) -> None:  # noqa: ANN001
    torch.manual_seed(0)
    work = compiled_work(build_model(scheme, SIZE, **TINY), SIZE, 2, train=False)
    added = work.minus(unpatched)
    assert not work.recompiled
    assert added.kernels <= kernel_budget(scheme, TINY["depth"]), added
