"""The generic contract, parametrised over the registry: shapes, dtypes, finite values, gradients, bf16, errors."""

from __future__ import annotations

import copy
import inspect
import subprocess
import sys
from pathlib import Path

import pytest
import timm
import torch

import vispos
from vispos.encodings.rope import Rotary
from vispos.encodings.shaw import ShawTables
from vispos.registry import _REGISTRY, CONTEXT, register

GRID = (3, 4)
HEADS = 2
DIM = 16  # embedding dim for additive schemes, head dim for attention schemes
WIDTH = 12  # the attention's input width (schemes of channels compute from it)
SCHEMES_2D = vispos.list_encodings(ndim=2)
SCHEMES_1D = vispos.list_encodings(ndim=1)


def build(name: str, ndim: int = 2, **extra: object) -> torch.nn.Module:
    """The scheme with small values for the context it declares (dim, num_heads, train_grid...)."""
    context = {"dim": DIM, "width": WIDTH, "num_heads": HEADS, "train_grid": GRID, "num_prefix_tokens": 0,
               "causal": False}  # fmt: skip
    context |= {"layer": 0, "depth": 1}
    info = vispos.get_info(name, ndim)
    return vispos.create_encoding(name, ndim=ndim, **{k: context[k] for k in info.context} | extra)


def qk(n: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(2, HEADS, n, DIM, generator=g).to(dtype), torch.randn(2, HEADS, n, DIM, generator=g).to(dtype))


def run_2d(module: torch.nn.Module, grid: tuple[int, int], dtype: torch.dtype = torch.float32) -> object:
    """A 2D scheme's output at ``grid``; a conditional scheme transforms tokens [2, H*W, DIM] laid on it."""
    if module.scheme_info.kind != "conditional":
        return module(grid)
    tokens = torch.randn(2, grid[0] * grid[1], DIM, generator=torch.Generator().manual_seed(3))
    return module(tokens.to(dtype), grid)


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


# --- registry data ---------------------------------------------------------------------------------------
def test_catalogue_has_the_design_names() -> None:
    assert set(SCHEMES_2D) == {
        "sincos2d",
        "learned2d",
        "rope2d",
        "rope2d_mixed",
        "relbias2d",
        "cpb2d",
        "alibi2d",
        "nope",
        "rope2d_golden",
        "string2d",
        "comrope2d",
        "liere2d",
        "peg2d",
        "decomposed2d",
        "lookhere2d",
        "fire2d",
        "irpe2d",
        "irpe2d_bias",
        "pape2d",
    }
    assert set(SCHEMES_1D) == {
        "sincos1d", "learned1d", "shaw", "t5", "alibi", "rope", "xpos", "mrope", "nope", "ropend", "fire",
    }  # fmt: skip
    assert vispos.list_encodings() == sorted(set(SCHEMES_1D) | set(SCHEMES_2D))


@pytest.mark.parametrize("ndim", [1, 2])
def test_declared_trainable_matches_parameters(ndim: int) -> None:
    for name in vispos.list_encodings(ndim):
        info = vispos.get_info(name, ndim)
        params = list(build(name, ndim).parameters())
        assert bool(params) == info.trainable, name
        assert info.ndim == ndim and info.name == name


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


@pytest.mark.parametrize("name, ndim", [(n, 2) for n in SCHEMES_2D] + [(n, 1) for n in SCHEMES_1D])
def test_every_scheme_declares_its_context_and_takes_keyword_options(name: str, ndim: int) -> None:
    """The registration contract: keyword-only arguments; the host fills the declared context, every
    other argument is a user option with a default."""
    info = vispos.get_info(name, ndim)
    params = inspect.signature(info.builder).parameters.values()
    assert all(p.kind == p.KEYWORD_ONLY for p in params), name
    assert set(info.context) <= set(CONTEXT)
    assert all(p.default is not p.empty for p in params if p.name not in info.context), name
    assert set(info.options).isdisjoint(info.context)


@pytest.fixture
def throwaway_scheme():
    """A scheme written the way a newcomer would (one class, one decorator), removed afterwards."""

    @register(
        "halfgrid2d", ndim=2, kind="bias", trainable=False, relative=True,
        extrapolation="any grid", summary="test: -strength * |dx| on every head", context=("num_heads",),
    )
    class HalfGrid(torch.nn.Module):
        def __init__(self, *, num_heads: int, strength: float = 1.0) -> None:
            super().__init__()
            self.num_heads, self.strength = num_heads, strength

        def forward(self, grid: tuple[int, int], device: torch.device | None = None) -> torch.Tensor:
            x = torch.arange(grid[1], device=device).repeat(grid[0]).float()  # [HW], row-major
            return (-self.strength * (x[:, None] - x[None]).abs()).expand(self.num_heads, -1, -1)

    yield "halfgrid2d"
    del _REGISTRY["halfgrid2d"]


def test_a_registered_scheme_reaches_every_host_with_its_context(throwaway_scheme: str) -> None:
    assert throwaway_scheme in vispos.list_encodings(2) and throwaway_scheme in vispos.describe(2)
    model = timm.create_model("vit_tiny_patch16_224", img_size=64, depth=1, num_classes=3)
    vispos.patch(model, throwaway_scheme, strength=0.5)
    assert model.vispos.attention.num_heads == 3 and model.vispos.attention.strength == 0.5
    mask = model.vispos.context((2, 3), torch.device("cpu")).layer(0)[1][0]  # cls token first: zero row/column
    assert mask.shape == (3, 7, 7) and mask[:, 0].abs().sum() == 0 and mask[0, 1, 3] == -1.0
    refusal = r"num_heads of halfgrid2d are set from the model, not by hand; accepted: strength$"
    with pytest.raises(TypeError, match=refusal):
        vispos.patch(timm.create_model("vit_tiny_patch16_224", img_size=64, depth=1), throwaway_scheme, num_heads=2)


# --- bad input -------------------------------------------------------------------------------------------
def test_unknown_scheme_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown scheme 'rope3d'; known: .*alibi2d.*rope2d"):
        vispos.create_encoding("rope3d", dim=16)
    with pytest.raises(ValueError, match=r"no 2D form; 2D schemes: .*rope2d"):
        vispos.get_info("rope", ndim=2)
    with pytest.raises(ValueError, match=r"ndim must be 1, 2 or None"):
        vispos.list_encodings(ndim=3)


def test_unknown_option_lists_the_accepted_ones() -> None:
    with pytest.raises(
        TypeError, match=r"unknown option\(s\) thetaa for scheme 'rope2d'; accepted: dim, theta, coords"
    ):
        vispos.create_encoding("rope2d", dim=16, thetaa=10.0)


@pytest.mark.parametrize("name", ["rope2d", "rope2d_mixed"])
@pytest.mark.parametrize("dim", [6, 18])
def test_rope2d_head_dim_must_split_in_four(name: str, dim: int) -> None:
    with pytest.raises(ValueError, match=rf"head dimension divisible by 4, got {dim}"):
        build(name, dim=dim)


@pytest.mark.parametrize("name", [n for n in SCHEMES_2D if n != "nope"])
@pytest.mark.parametrize("grid", [(0, 4), (3, 0)])
def test_zero_size_grid_is_refused(name: str, grid: tuple[int, int]) -> None:
    with pytest.raises(ValueError, match=r"positive size"):
        run_2d(build(name), grid)


@pytest.mark.parametrize(
    ("name", "options", "error", "match"),
    [
        ("rope2d", {"theta": "100"}, TypeError, r"theta must be a number, got str"),
        ("rope2d", {"layout": "rotate_half"}, ValueError, r"accepted: half, interleaved"),
        ("rope2d", {"coords": "pixels"}, ValueError, r"accepted: pixel, normalized"),
        ("rope2d", {"dim": 16.0}, TypeError, r"dim \(head dimension\) must be an int"),
        ("learned2d", {"factorized": "yes"}, TypeError, r"factorized must be a bool"),
        ("learned2d", {"train_grid": (3.0, 4)}, TypeError, r"train_grid height must be an int"),
        ("learned2d", {"train_grid": 14}, TypeError, r"train_grid must be a pair \(H, W\)"),
        ("relbias2d", {"num_heads": "2"}, TypeError, r"num_heads must be an int"),
        ("relbias2d", {"train_grid": (0, 4)}, ValueError, r"positive size"),
        ("cpb2d", {"max_bias": -1.0}, ValueError, r"max_bias must be > 0"),
        ("sincos2d", {"dim": 18}, ValueError, r"divisible by 4"),
        ("alibi2d", {"num_heads": 0}, ValueError, r"num_heads must be >= 1"),
    ],
)
def test_bad_options_say_what_is_accepted(name: str, options: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        build(name, **options)


# --- describe ---------------------------------------------------------------------------------------------
def test_describe_command_prints_every_scheme() -> None:
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-m", "vispos", "describe"], cwd=root, capture_output=True, text=True, check=True, timeout=120
    ).stdout
    rows = [line for line in out.splitlines() if line.startswith("| `")]
    listed = {(line.split("|")[1].strip(" `"), line.split("|")[2].strip()) for line in rows}
    expected = {(n, "2D") for n in SCHEMES_2D} | {(n, "1D") for n in SCHEMES_1D}
    assert listed == expected
    for scaling in ("linear", "ntk", "dynamic_ntk", "yarn", "longrope"):
        assert scaling in out


def test_describe_piped_into_a_reader_that_stops_early_is_not_an_error() -> None:
    """`python -m vispos describe | head`: the reader is gone before the table is written."""
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "vispos", "describe"], cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    proc.stdout.close()  # before the interpreter has started: its first write meets a closed pipe
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and b"BrokenPipeError" not in err, err.decode()
