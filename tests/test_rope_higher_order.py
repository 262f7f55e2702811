"""The eager training rotation (``RotateHalf``) under higher-order and functorch gradients: double backward (a
gradient penalty), ``torch.func.grad`` / ``vmap`` / ``jacrev`` and forward-mode AD give the formula's values."""

from __future__ import annotations

import pytest
import torch
from torch.autograd import forward_ad

from vispos.encodings.rope import apply_rope, rotate_half


def formula(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


def tables(learned: bool) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.randn(5, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float32)
    angles = torch.cat((angles, angles), -1).requires_grad_(learned)  # the half layout: s1 = s2
    return angles.cos(), angles.sin()


@pytest.mark.parametrize("learned", [False, True])
def test_double_backward_equals_the_formulas(learned: bool) -> None:
    x = torch.randn(2, 5, 8, dtype=torch.float32, requires_grad=True)
    results = []
    for rotate in (apply_rope, formula):
        cos, sin = tables(learned)
        y = rotate(x, cos, sin)
        (g,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
        penalty = g.square().sum()  # a gradient penalty: differentiates the backward
        results.append(torch.autograd.grad(penalty, x))
    torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-5)
    assert results[0][0].abs().max() > 0


def test_functorch_transforms_and_forward_ad_equal_the_formulas() -> None:
    cos, sin = tables(False)
    x = torch.randn(3, 5, 8, dtype=torch.float32, requires_grad=True)
    loss = lambda f: (lambda t: f(t, cos, sin).square().sum())  # noqa: E731
    close = lambda a, b: torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)  # noqa: E731
    close(torch.func.grad(loss(apply_rope))(x), torch.func.grad(loss(formula))(x))
    close(torch.vmap(lambda t: apply_rope(t, cos, sin))(x), formula(x, cos, sin))
    close(torch.func.jacrev(lambda t: apply_rope(t, cos, sin))(x[0]),
          torch.func.jacrev(lambda t: formula(t, cos, sin))(x[0]))  # fmt: skip
    tangent = torch.randn_like(x)
    with forward_ad.dual_level():
        out = forward_ad.unpack_dual(apply_rope(forward_ad.make_dual(x.detach(), tangent), cos, sin)).tangent
    torch.testing.assert_close(out, formula(tangent, cos, sin), rtol=1e-5, atol=1e-5)
