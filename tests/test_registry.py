"""The registry: its catalogue and declared properties, the registration contract (keyword options, declared
context, a newcomer's scheme reaching every host), refusals that say what is accepted, ``python -m vispos describe``.
Every scheme's outputs: ``tests/test_scheme_outputs.py``."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import pytest
import timm
import torch
from scheme_builds import SCHEMES_1D, SCHEMES_2D, build, run_2d

import vispos
from vispos.registry import _REGISTRY, CONTEXT, register


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


# --- the registration contract ---------------------------------------------------------------------------
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
