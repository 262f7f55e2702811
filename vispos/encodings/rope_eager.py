"""The ``half``-layout rotation in three passes over x and no rotate-half copy, for eager mode: at inference
written in place (``rotate_half_in_place``), in training as an autograd Function whose backward is the inverse
rotation, three passes over the gradient (``RotateHalf``), instead of autograd through the formula's products,
which saves a rotate-half copy of x and makes about ten passes each way. A trace or compile keeps the formula
(``apply_rope`` in ``rope.py``), which the compiler fuses, and so do functorch's transforms and forward-mode AD; a
backward that records a graph (``create_graph=True``: gradient penalties) takes the same maths as out-of-place ops,
which autograd differentiates again (``tests/test_rope_higher_order.py``).

With x = [x1 | x2] (halves) and cos, sin = [c1 | c2], [s1 | s2], the rotation is
out = [x1 c1 - x2 s1 | x2 c2 + x1 s2]; its transpose, the gradient's map, is g -> [g1 c1 + g2 s2 | g2 c2 - g1 s1]:
the same three passes with the sin halves swapped and negated (the inverse rotation where s1 = s2, as in every
table ``expand_angles`` makes).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable


def at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    """cos or sin in at least fp32 (as they meet an fp32 x in the products): a no-op for the fp32 tables."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def _three_passes(
    x: torch.Tensor, cos: torch.Tensor, sin_first: torch.Tensor, sin_second: torch.Tensor, sign: float
) -> torch.Tensor:
    """[x1 c1 - sign x2 sin_first | x2 c2 + sign x1 sin_second] in x's dtype: x cos (at least fp32), then one
    multiply-add per half, in place for fp32 (and fp64), else written straight into x's dtype from the fp32 sums
    (one rounding, as the formula's final cast). ``sin_first`` / ``sin_second``: [..., d/2] each."""
    h = x.shape[-1] // 2
    cos = at_least_fp32(cos)
    x1, x2 = x[..., :h], x[..., h:]
    products = x * cos  # fp32 (x's dtype at most fp32's precision, the tables fp32)
    # in the products' layout (x's: the qkv buffer's order, which SDPA's output then follows, so that the heads
    # are merged afterwards without a copy)
    out = products if products.dtype == x.dtype else torch.empty_like(products, dtype=x.dtype)
    torch.addcmul(products[..., :h], x2, at_least_fp32(sin_first), value=-sign, out=out[..., :h])
    torch.addcmul(products[..., h:], x1, at_least_fp32(sin_second), value=sign, out=out[..., h:])
    return out


def rotate_half_in_place(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``apply_rope`` in the ``half`` layout in three passes and no rotate-half copy, for eager inference:
    out = x cos (fp32), then per half a multiply-add of the other half by sin (out[:h] - x2 sin, out[h:] + x1 sin),
    in place for fp32, or written straight into x's dtype from the fp32 sums for bf16 / fp16 (one rounding, as
    ``apply_rope``'s final cast). Equal to ``apply_rope`` within an fp32 rounding of the sum."""
    h = x.shape[-1] // 2
    return _three_passes(x, cos, sin[..., :h], sin[..., h:], 1.0)


class RotateHalf(torch.autograd.Function):
    """The ``half``-layout rotation with gradients: forward ``rotate_half_in_place``'s three passes; backward the
    transposed rotation of the gradient in three passes. Saved: cos and sin (the tables, not x), and x (a view of
    its buffer, no copy) only where a table takes a gradient (RoPE-Mixed's learned frequencies): then
    d cos = g x, d sin = [-g1 x2 | g2 x1], summed over the dimensions the table was broadcast along."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        table_grads = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        ctx.save_for_backward(cos, sin, x if table_grads else None)
        return rotate_half_in_place(x, cos, sin)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        if torch.is_grad_enabled():  # a backward that records a graph (create_graph: gradient penalties, Hessians)
            return _differentiable_backward(ctx, grad)
        return _fast_backward(ctx, grad)


def _differentiable_backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # noqa: ANN001
    """The backward as out-of-place ops autograd differentiates again: the transposed rotation
    [g1 c1 + g2 s2 | g2 c2 - g1 s1], d cos = g x and d sin = [-g1 x2 | g2 x1], in fp32, x's dtype out."""
    cos, sin, x = ctx.saved_tensors
    h = grad.shape[-1] // 2
    g = grad.float() if grad.dtype not in (torch.float32, torch.float64) else grad
    c, s = at_least_fp32(cos), at_least_fp32(sin)
    g1, g2 = g[..., :h], g[..., h:]
    grad_x = grad_cos = grad_sin = None
    if ctx.needs_input_grad[0]:
        grad_x = torch.cat((g1 * c[..., :h] + g2 * s[..., h:], g2 * c[..., h:] - g1 * s[..., :h]), -1).to(grad.dtype)
    if ctx.needs_input_grad[1]:
        grad_cos = (g * x).sum_to_size(cos.shape).to(cos.dtype)
    if ctx.needs_input_grad[2]:
        grad_sin = torch.cat((-g1 * x[..., h:], g2 * x[..., :h]), -1).sum_to_size(sin.shape).to(sin.dtype)
    return grad_x, grad_cos, grad_sin


@once_differentiable
def _fast_backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # noqa: ANN001
    """The backward in three passes over the gradient (in place where it can be), when no graph is recorded."""
    cos, sin, x = ctx.saved_tensors
    h = grad.shape[-1] // 2
    grad_x = grad_cos = grad_sin = None
    if ctx.needs_input_grad[0]:
        grad_x = _three_passes(grad, cos, sin[..., h:], sin[..., :h], -1.0)
    if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:  # the products in the tables' dtype (exact for bf16)
        zero = cos.new_zeros((1,) * grad.dim())  # a dimensioned fp32 zero: g x is computed in fp32, not in bf16
    if ctx.needs_input_grad[1]:
        grad_cos = torch.addcmul(zero, grad, x).sum_to_size(cos.shape)
    if ctx.needs_input_grad[2]:
        turned = torch.empty(torch.broadcast_shapes(grad.shape, x.shape), dtype=zero.dtype, device=grad.device)
        torch.addcmul(zero, grad[..., :h], x[..., h:], out=turned[..., :h])  # -d sin1, negated once summed
        torch.addcmul(zero, grad[..., h:], x[..., :h], out=turned[..., h:])
        grad_sin = turned.sum_to_size(sin.shape)
        grad_sin[..., :h].neg_()
    return grad_x, grad_cos, grad_sin
