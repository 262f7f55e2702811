"""A table resampled to another grid takes gradients on the compiled path: under ``torch.compile`` with dynamic
shapes, ``resize_bicubic`` is two matrix products of the kernel's own weights (``resize_by_weights``), because
inductor (torch 2.14.1) fails on the backward of the resampling kernels at symbolic sizes ("isIntList() INTERNAL
ASSERT FAILED"; timm's own ViT built with ``dynamic_img_pad``, whose ``resample_abs_pos_embed`` calls the kernel,
fails at a second size)."""

from __future__ import annotations

import itertools

import pytest
import torch

from benchmarks.compiled_work import build
from vispos.encodings.learned import resize_bicubic, resize_by_weights

CASES = list(itertools.product([(2, 2), (7, 5), (14, 14), (1, 4)], [(4, 4), (3, 9), (28, 28), (5, 1), (1, 1)],
                               [True, False], ["bicubic", "bilinear"]))  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("grid", "size", "antialias", "mode"), CASES)
def test_resize_by_weights_is_the_kernel(grid, size, antialias: bool, mode: str, dtype: torch.dtype) -> None:
    """Up and down, with and without antialiasing, to one row or one column: the kernel's result up to the order of
    its sums, and the same gradient as autograd through the kernel."""
    torch.manual_seed(0)
    img = torch.randn(1, 6, *grid, dtype=dtype, requires_grad=True)
    cotangent = torch.randn(1, 6, *size, dtype=dtype)
    ref = resize_bicubic(img, size, antialias, mode)
    out = resize_by_weights(img, size, antialias, mode)
    assert out.dtype == dtype and out.shape == ref.shape
    tol = 2e-6 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(out, ref, rtol=0, atol=tol)
    (grad_ref,) = torch.autograd.grad(ref, img, cotangent)
    (grad,) = torch.autograd.grad(out, img, cotangent)
    torch.testing.assert_close(grad, grad_ref, rtol=10 * tol, atol=10 * tol)  # sums of up to 28 x 28 terms


@pytest.mark.compiled
@pytest.mark.parametrize("scheme", ["learned2d", "relbias2d"])
def test_a_compiled_training_step_at_a_second_size_resamples_the_table(scheme: str) -> None:
    """Compiled with dynamic shapes at 32 px (a 2 x 2 grid, the table's own), trained at 64 px (4 x 4, resampled):
    the loss and the table's gradient are the eager model's."""
    torch.manual_seed(0)
    model = build(scheme, 32, depth=1, embed_dim=64, num_heads=2).train()
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    compiled(torch.randn(2, 3, 32, 32)).sum().backward()
    model.zero_grad(set_to_none=True)
    x = torch.randn(2, 3, 64, 64)
    loss = compiled(x).square().mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if n.startswith("vispos")}
    model.zero_grad(set_to_none=True)
    eager = model(x).square().mean()
    eager.backward()
    assert grads, "the scheme's table takes a gradient"
    torch.testing.assert_close(loss, eager, rtol=1e-5, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, dict(model.named_parameters())[name].grad, rtol=1e-4, atol=1e-6)
