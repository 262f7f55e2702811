"""The eager rotation with gradients (``RotateHalf``): its backward against numerical derivatives (gradcheck, fp64),
against autograd through timm's formula (x cos + rotate_half(x) sin) in fp32, against the exact transposed rotation
in bf16, and the passes it makes over q, k and their gradients counted (``benchmarks/work_count``). No timings."""

from __future__ import annotations

import pytest
import torch
from timm.layers.pos_embed_sincos import apply_rot_embed

import vispos
from benchmarks.work_count import WorkCounter
from vispos.encodings import rope
from vispos.encodings.rope import Rotary
from vispos.encodings.rope_eager import RotateHalf

B, HEADS, N, D = 2, 3, 17, 32


def qkv_views(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [B, heads, N, d], views of one [B, N, 3, heads, d] projection output that takes gradients."""
    qkv = torch.randn(B, N, 3, HEADS, D).to(dtype).requires_grad_()
    q, k, _ = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    return q, k


def tables(per_head: bool, learned: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.randn(*((HEADS,) if per_head else ()), N, D // 2) * 10
    angles = torch.cat((angles, angles), dim=-1)  # the half layout
    cos, sin = angles.cos(), angles.sin()
    return (cos.requires_grad_(), sin.requires_grad_()) if learned else (cos, sin)


@pytest.mark.parametrize("shape", [(5, 8), (3, 5, 8), (2, 1, 5, 8)], ids=["shared", "per-head", "per-sample"])
def test_gradients_equal_numerical_derivatives_in_fp64(shape: tuple[int, ...]) -> None:
    """Every input's gradient, tables included (RoPE-Mixed's are learned), broadcast as the models broadcast them;
    cos and sin drawn independently (unequal halves): the backward is the transposed map, not only the inverse."""
    x = torch.randn(2, 3, 5, 8, dtype=torch.float64, requires_grad=True)  # [B, heads, N, d], small: gradcheck
    cos, sin = (torch.randn(shape, dtype=torch.float64, requires_grad=True) for _ in range(2))
    assert torch.autograd.gradcheck(RotateHalf.apply, (x, cos, sin))


@pytest.mark.parametrize("learned", [False, True], ids=["fixed", "learned"])
@pytest.mark.parametrize("per_head", [False, True], ids=["shared", "per-head"])
def test_fp32_rotation_and_gradients_equal_autograd_through_timm_within_1e_6(per_head: bool, learned: bool) -> None:
    q, k = qkv_views(torch.float32)
    cos, sin = tables(per_head, learned)
    rq, rk = Rotary(cos, sin).rotate(q, k)
    assert type(rq.grad_fn).__name__ == "RotateHalfBackward"
    eq, ek = apply_rot_embed(q, sin, cos, half=True), apply_rot_embed(k, sin, cos, half=True)
    torch.testing.assert_close(rq, eq, atol=1e-6, rtol=0)
    torch.testing.assert_close(rk, ek, atol=1e-6, rtol=0)
    gq, gk = torch.randn_like(rq), torch.randn_like(rk)
    inputs = (q, k, cos, sin) if learned else (q, k)
    ours = torch.autograd.grad((rq, rk), inputs, (gq, gk))
    theirs = torch.autograd.grad((eq, ek), inputs, (gq, gk))
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_bf16_gradient_is_the_exact_transposed_rotation_rounded_once() -> None:
    """Under bf16 the gradient of q is summed in fp32 and rounded once: within half a bf16 unit of the exact
    [g1 c + g2 s | g2 c - g1 s] (fp64). Autograd through the formula rounds each product's share to bf16 before
    adding them, and is off by up to hundreds of units where the two shares cancel."""
    q, k = qkv_views(torch.bfloat16)
    cos, sin = tables(False)
    rq, _ = Rotary(cos, sin).rotate(q, k)
    grad = torch.randn_like(rq)
    (gq,) = torch.autograd.grad(rq, q, grad)
    g1, g2 = grad.double().chunk(2, -1)
    c, s = cos[..., : D // 2].double(), sin[..., : D // 2].double()
    exact = torch.cat((g1 * c + g2 * s, g2 * c - g1 * s), -1)
    half_unit = torch.finfo(torch.bfloat16).eps / 2 * exact.abs() * (1 + 2**-12)  # fp32's own rounding beside
    assert gq.dtype == torch.bfloat16 and ((gq.double() - exact).abs() <= half_unit).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_training_rotation_makes_three_passes_each_way(dtype: torch.dtype) -> None:
    """Forward: x cos and two half multiply-adds per tensor (3 kernels each for q and k); backward: the same three
    over each gradient. Bytes each way at most 2.5x one read and one write of q and k in fp32 (3.5x in bf16: the
    fp32 products written and read once), the tables aside; autograd through the formula made about ten kernels
    each way and counted 5x (fp32) and 10x (bf16) in the ViT-S table."""
    q, k = qkv_views(dtype)
    cos, sin = tables(False)
    table_reads = 2 * cos.numel() * 4  # cos once, sin in two halves
    one_pass = 2 * 2 * q.numel() * q.element_size()  # q and k, read once and written once
    limit = 2.5 if dtype == torch.float32 else 3.5
    with WorkCounter() as forward:
        rq, rk = Rotary(cos, sin).rotate(q, k)
    gq, gk = torch.randn_like(rq), torch.randn_like(rk)
    with WorkCounter() as backward:
        torch.autograd.grad((rq, rk), (q, k), (gq, gk))
    assert forward.work.kernels == 6
    assert forward.work.bytes - 2 * table_reads <= limit * one_pass
    rotation = {op: n for op, n in backward.work.ops.items() if "addcmul" in op or op == "aten.mul.Tensor"}
    assert sum(rotation.values()) == 6
    rotation_bytes = sum(b for op, b in backward.work.op_bytes.items() if op in rotation)
    assert rotation_bytes - 2 * table_reads <= limit * one_pass


def test_patched_model_trains_as_with_the_formula(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rope2d_mixed ViT's gradients (every weight, the learned frequencies included) equal those of the same
    model rotating through the formula (as under a trace or compile), within fp32 rounding."""
    torch.manual_seed(0)
    model = vispos.create_model("vit_tiny_patch16_224", pos="rope2d_mixed", img_size=32, depth=1, num_classes=5)
    x = torch.randn(2, 3, 32, 32)
    model(x).square().sum().backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    monkeypatch.setattr(rope, "_traced", lambda: True)
    model(x).square().sum().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(ours[name], p.grad, atol=1e-5, rtol=1e-5, msg=name)
    assert any("freqs" in name for name in ours)
