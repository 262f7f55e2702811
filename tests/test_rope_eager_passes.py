"""The eager rotation at inference (``rotate_half_in_place``, q and k in one call where they share a qkv buffer)
against timm's ``apply_rot_embed`` (x cos + rotate_half(x) sin, cast once) as the independent reference, and the
passes it makes over q and k counted (``benchmarks/work_count``)."""

from __future__ import annotations

import pytest
import torch
from timm.layers.pos_embed_sincos import apply_rot_embed

import vispos
from benchmarks.work_count import WorkCounter
from vispos.encodings.rope import Rotary, stacked_views

B, HEADS, N, D = 2, 3, 17, 32


def qkv_views(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [B, heads, N, d] as timm's attention takes them apart: views of one [B, N, 3, heads, d] output."""
    qkv = torch.randn(B, N, 3, HEADS, D).to(dtype)
    q, k, _ = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    return q, k


def tables(per_head: bool) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.randn(*((HEADS,) if per_head else ()), N, D // 2) * 10
    angles = torch.cat((angles, angles), dim=-1)  # the half layout
    return angles.cos(), angles.sin()


@pytest.mark.parametrize("per_head", [False, True], ids=["shared", "per-head"])
def test_fp32_rotation_equals_timm_within_1e_6(per_head: bool) -> None:
    q, k = qkv_views(torch.float32)
    cos, sin = tables(per_head)
    with torch.inference_mode():
        rq, rk = Rotary(cos, sin).rotate(q, k)
    for x, rotated in ((q, rq), (k, rk)):
        torch.testing.assert_close(rotated, apply_rot_embed(x, sin, cos, half=True), atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_rotation_rounds_once_from_fp32(dtype: torch.dtype) -> None:
    """The fp32 sums are written into q's dtype once, as timm's rotation with fp32 tables casts its result: at most
    one unit in the last place apart (the sums agree within an fp32 rounding), almost always equal."""
    q, k = qkv_views(dtype)
    cos, sin = tables(False)
    with torch.inference_mode():
        rq, rk = Rotary(cos, sin).rotate(q, k)
    for x, rotated in ((q, rq), (k, rk)):
        expected = apply_rot_embed(x, sin, cos, half=True)
        assert rotated.dtype == dtype
        ulp = torch.finfo(dtype).eps * expected.float().abs().clamp(min=torch.finfo(dtype).tiny)
        assert ((rotated.float() - expected.float()).abs() <= ulp).all()
        assert (rotated == expected).float().mean() > 0.99


def test_training_gradient_is_the_inverse_rotation() -> None:
    """With gradients the rotation equals timm's formula and its gradient is the inverse rotation of the output's
    (``RotateHalf``, tests/test_rope_backward.py)."""
    q, k = (t.detach().requires_grad_() for t in qkv_views(torch.float32))
    cos, sin = tables(False)
    rq, _ = Rotary(cos, sin).rotate(q, k)
    torch.testing.assert_close(rq, apply_rot_embed(q.detach(), sin, cos, half=True), atol=1e-6, rtol=0)
    grad = torch.randn_like(rq)
    rq.backward(grad)
    g1, g2 = grad.chunk(2, -1)
    c, s = cos[..., : D // 2], sin[..., : D // 2]
    torch.testing.assert_close(q.grad, torch.cat((g1 * c + g2 * s, g2 * c - g1 * s), -1), atol=1e-6, rtol=0)


def test_q_and_k_of_one_qkv_buffer_are_one_view() -> None:
    q, k = qkv_views(torch.float32)
    joint = stacked_views(q, k)
    assert joint is not None and torch.equal(joint[0], q) and torch.equal(joint[1], k)
    assert stacked_views(q, q.clone()) is None and stacked_views(k, q) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inference_rotation_makes_three_passes_over_q_and_k(dtype: torch.dtype) -> None:
    """q and k rotated in one call: x cos, then two multiply-adds of half the channels (three kernels); bytes at
    most 2.5x one read and one write of q and k in fp32 (3.5x in bf16: the fp32 products are written and read
    once), the tables aside."""
    q, k = qkv_views(dtype)
    cos, sin = tables(False)
    with torch.inference_mode(), WorkCounter() as counter:
        Rotary(cos, sin).rotate(q, k)
    one_pass = 2 * 2 * q.numel() * q.element_size()  # q and k, read once and written once
    table_reads = 2 * cos.numel() * 4  # cos once, sin in two halves
    assert counter.work.kernels == 3
    assert counter.work.bytes - table_reads <= (2.5 if dtype == torch.float32 else 3.5) * one_pass


def test_patched_model_output_unchanged_by_the_inference_path() -> None:
    """A rope2d ViT at inference (in place) equals the same model run with gradients on (``RotateHalf``)."""
    model = vispos.create_model("vit_tiny_patch16_224", pos="rope2d", img_size=32, depth=1, num_classes=5).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.inference_mode():
        fast = model(x)
    torch.testing.assert_close(fast, model(x).detach(), atol=1e-5, rtol=1e-5)
