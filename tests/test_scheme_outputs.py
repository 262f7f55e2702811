"""The generic contract of every scheme's output, parametrised over the registry: shapes, dtypes, finite values,
gradients that reach every parameter, bf16 against fp32 (angles kept in fp32, results in the input dtype)."""

from __future__ import annotations

import copy

import pytest
import torch
from scheme_builds import DIM, GRID, HEADS, SCHEMES_1D, SCHEMES_2D, WIDTH, build, run_2d

import vispos
from vispos.encodings.rope import Rotary
from vispos.encodings.shaw import ShawTables


def qk(n: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(2, HEADS, n, DIM, generator=g).to(dtype), torch.randn(2, HEADS, n, DIM, generator=g).to(dtype))


def inputs(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The attention's input tokens [2, n, WIDTH] a scheme of channels computes from."""
    return torch.randn(2, n, WIDTH, generator=torch.Generator().manual_seed(4)).to(dtype)


def scalar_of(out: object, kind: str, n: int) -> torch.Tensor:
    """A scalar that depends on every output of the scheme (for gradients)."""
    g = torch.Generator().manual_seed(2)
    if kind == "channels":
        out = out.bind(inputs(n))
    if kind in ("rotary", "channels"):
        q, k = out.rotate(*qk(n))
        return (q @ k.transpose(-2, -1)).sum()
    if kind == "relative_kv":
        out = torch.cat([out.key_table, out.value_table])
    if kind == "query_bias":  # the bias at some queries
        out = out.logits(qk(n)[0])
    return (out * torch.randn(out.shape, generator=g)).sum()


# --- generic 2D contract ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", SCHEMES_2D)
def test_2d_output_shape_dtype_finite(name: str) -> None:
    info = vispos.get_info(name, 2)
    module = build(name)
    out = run_2d(module, GRID)
    n = GRID[0] * GRID[1]
    if info.kind == "none":
        assert out is None
    elif info.kind == "additive":
        assert out.shape == (n, DIM) and out.dtype == torch.float32 and out.isfinite().all()
    elif info.kind == "conditional":  # tokens in, tokens out
        assert out.shape == (2, n, DIM) and out.dtype == torch.float32 and out.isfinite().all()
    elif info.kind == "bias":
        assert out.shape == (HEADS, n, n) and out.dtype == torch.float32 and out.isfinite().all()
    elif info.kind == "query_bias":  # a bias from the queries: [B, heads, N, N] in their dtype
        bias = out.logits(qk(n)[0])
        assert bias.shape == (2, HEADS, n, n) and bias.dtype == torch.float32 and bias.isfinite().all()
        assert out.logits(qk(n, torch.bfloat16)[0]).dtype == torch.bfloat16
    elif info.kind == "channels":  # q and k widened by channels computed from the attention's inputs
        q, k = qk(n)
        rq, rk = out.bind(inputs(n)).rotate(q, k)
        assert rq.shape[:-1] == q.shape[:-1] and rq.shape == rk.shape and rq.shape[-1] > DIM
        assert rq.dtype == torch.float32 and rq.isfinite().all() and rk.isfinite().all()
        assert torch.equal(rq[..., :DIM], q) and torch.equal(rk[..., :DIM], k)
        rq, rk = out.bind(inputs(n, torch.bfloat16)).rotate(q.bfloat16(), k.bfloat16())
        assert rq.dtype == rk.dtype == torch.bfloat16
    else:
        assert isinstance(out, Rotary)
        if out.blocks is not None:  # general block rotations (ComRoPE, LieRE): [(heads,) N, d/b, b, b]
            b = out.blocks.shape[-1]
            assert out.blocks.shape[-4:] == (n, DIM // b, b, b) and out.cos is None and out.sin is None
            assert out.blocks.dtype == torch.float32 and out.blocks.isfinite().all()
        else:
            assert out.cos.shape[-2:] == (n, DIM) and out.cos.shape == out.sin.shape
            assert out.cos.dtype == torch.float32 and out.cos.isfinite().all() and out.sin.isfinite().all()
        q, k = qk(n)
        rq, rk = out.rotate(q, k)
        assert rq.shape == q.shape and rk.shape == k.shape and rq.isfinite().all()


@pytest.mark.parametrize("name", SCHEMES_2D)
def test_2d_gradients_reach_every_parameter(name: str) -> None:
    info = vispos.get_info(name, 2)
    module = build(name)
    params = dict(module.named_parameters())
    if not info.trainable:
        assert params == {}
        return
    scalar_of(run_2d(module, GRID), info.kind, GRID[0] * GRID[1]).backward()
    for pname, p in params.items():
        assert p.grad is not None and p.grad.isfinite().all() and p.grad.abs().sum() > 0, pname


@pytest.mark.parametrize("name", [n for n in SCHEMES_1D if vispos.get_info(n, 1).trainable])
def test_1d_gradients_reach_every_parameter(name: str) -> None:
    info = vispos.get_info(name, 1)
    module = build(name, 1)
    scalar_of(module(5), info.kind, 5).backward()
    for pname, p in module.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, pname


@pytest.mark.parametrize("name", [n for n in SCHEMES_2D if n != "nope"])
def test_2d_bf16_module_agrees_with_fp32(name: str) -> None:
    info = vispos.get_info(name, 2)
    module = build(name)
    half = copy.deepcopy(module).to(torch.bfloat16)
    ref, out = run_2d(module, GRID), run_2d(half, GRID, torch.bfloat16)
    n = GRID[0] * GRID[1]
    if info.kind == "rotary":  # against fp32 maths on the cast's own rounded parameters (LieRE's are O(2 pi))
        rounded = copy.deepcopy(module)
        rounded.load_state_dict(half.state_dict())
        ref = rounded(GRID)
        angles = (out.blocks,) if out.blocks is not None else (out.cos, out.sin)
        assert all(t.dtype == torch.float32 for t in angles)  # angles stay fp32
        q, k = qk(n, torch.bfloat16)
        rq, rk = out.rotate(q, k)
        assert rq.dtype == torch.bfloat16 and rk.dtype == torch.bfloat16  # back in the input dtype
        eq, ek = ref.rotate(q.float(), k.float())
        torch.testing.assert_close(rq.float(), eq, atol=3e-2, rtol=2e-2)
        torch.testing.assert_close(rk.float(), ek, atol=3e-2, rtol=2e-2)
    elif info.kind == "channels":  # in the input dtype, computed in fp32 from the cast's rounded parameters
        rounded = copy.deepcopy(module)
        rounded.load_state_dict(half.state_dict())
        q, k = qk(n, torch.bfloat16)
        x = inputs(n, torch.bfloat16)
        rq, rk = out.bind(x).rotate(q, k)
        assert rq.dtype == rk.dtype == torch.bfloat16
        eq, ek = rounded(GRID).bind(x.float()).rotate(q.float(), k.float())
        torch.testing.assert_close(rq.float(), eq, atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(rk.float(), ek, atol=1e-2, rtol=1e-2)
    elif info.kind == "query_bias":  # the bias at bf16 queries, in bf16
        q = qk(n, torch.bfloat16)[0]
        got = out.logits(q)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), ref.logits(q.float()), atol=1e-2, rtol=2e-2)
    else:
        tol = 0.1 if name == "cpb2d" else 1e-2  # 16 * sigmoid of a bf16 MLP
        torch.testing.assert_close(out.float(), ref, atol=tol, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rope2d_mixed_angles_are_fp32_after_cast(dtype: torch.dtype) -> None:
    """A cast model stores its frequencies in the cast dtype (like every weight; no private hooks), but the
    angles are still computed in fp32: equal to an fp32 module holding the same (rounded) frequencies."""
    module = vispos.create_encoding("rope2d_mixed", dim=DIM, num_heads=HEADS).to(dtype)
    reference = vispos.create_encoding("rope2d_mixed", dim=DIM, num_heads=HEADS)
    with torch.no_grad():
        reference.freqs.copy_(module.freqs.float())
    out, ref = module(GRID), reference(GRID)
    assert out.cos.dtype == torch.float32 and out.sin.dtype == torch.float32
    torch.testing.assert_close(out.cos, ref.cos, rtol=0, atol=0)
    torch.testing.assert_close(out.sin, ref.sin, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["rope", "xpos"])
def test_1d_rotary_returns_input_dtype(name: str) -> None:
    rot = build(name, 1)(6)
    assert rot.cos.dtype == torch.float32
    q, k = qk(6, torch.bfloat16)
    rq, rk = rot.rotate(q, k)
    assert rq.dtype == rk.dtype == torch.bfloat16
    eq, _ = rot.rotate(q.float(), k.float())
    torch.testing.assert_close(rq.float(), eq, atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("name", SCHEMES_1D)
def test_1d_output_shape_finite(name: str) -> None:
    info = vispos.get_info(name, 1)
    positions = torch.tensor([[0, 1, 2, 3, 4], [3, 4, 5, 6, 7]])  # [B, N]
    if info.position_axes > 1:  # several ids per token: [axes, B, N]
        positions = positions.expand(info.position_axes, -1, -1)
    out = build(name, 1)(positions)
    if info.kind == "none":
        assert out is None
    elif info.kind == "additive":
        assert out.shape == (2, 5, DIM) and out.isfinite().all()
    elif info.kind == "bias":
        assert out.shape == (2, HEADS, 5, 5)
        assert out.tril().isfinite().all()  # causal forms hold -inf above the diagonal only
    elif info.kind == "relative_kv":
        assert isinstance(out, ShawTables) and out.index.shape == (2, 5, 5)
    else:
        q, k = qk(5)
        rq, rk = out.rotate(q, k)
        assert rq.shape == q.shape and rq.isfinite().all() and rk.isfinite().all()
