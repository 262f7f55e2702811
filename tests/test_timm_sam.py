"""timm's SAM image encoder (``VisionTransformerSAM``) patched: its decomposed relative tables and absolute table
inherited, equal to timm's own model at the native size and at others (timm resizes them itself); window blocks
attend with window-local positions, global blocks with the grid's; every 2D scheme runs; state dicts."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
from timm.models.vision_transformer_sam import VisionTransformerSAM

import vispos
from vispos.encodings.decomposed import Decomposed2d
from vispos.timm.sam import PatchedSam, PatchedSamAttention, PatchedSamBlock

WINDOW = 3  # does not divide the 8x8 grid: window blocks pad, as SAM does
SIZES = [(64, 64), (80, 56)]  # the native 8x8 grid, and 10x7


def sam(seed: int = 0, **kwargs: object) -> VisionTransformerSAM:
    """A tiny SAM (blocks 0 and 2 windowed, 1 and 3 global) with its zero-initialised tables filled at random."""
    torch.manual_seed(seed)
    args = dict(img_size=64, patch_size=8, embed_dim=32, depth=4, num_heads=2, window_size=WINDOW,
                global_attn_indexes=(1, 3), use_rel_pos=True, neck_chans=16, num_classes=5)  # fmt: skip
    model = VisionTransformerSAM(**(args | kwargs)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "rel_pos" in name or "pos_embed" in name:
                p.copy_(torch.randn_like(p))
    return model


def patched(model: torch.nn.Module, pos: str | list[str] = "decomposed2d", **kwargs: object) -> torch.nn.Module:
    return vispos.patch(copy.deepcopy(model), pos, **kwargs)


def difference(a: torch.nn.Module, b: torch.nn.Module, size: tuple[int, int]) -> float:
    x = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        return max((a(x) - b(x)).abs().max().item(), (a.forward_features(x) - b.forward_features(x)).abs().max().item())


# --- 1: SAM's own positions inherited ---------------------------------------------------------------------------
@pytest.mark.parametrize("size", SIZES, ids=["native", "80x56"])
@pytest.mark.parametrize("abs_pos", [True, False], ids=["abs+rel", "rel"])
def test_inherited_positions_reproduce_timms_sam(size: tuple[int, int], abs_pos: bool) -> None:
    original = sam(use_abs_pos=abs_pos)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is discarded
        model = patched(original)
    assert isinstance(model, PatchedSam)
    assert model.vispos.settings["pos"] == (["learned2d", "decomposed2d"] if abs_pos else ["decomposed2d"])
    assert model.vispos.settings["inherited"]["from"] == "timm VisionTransformerSAM rel_pos_h / rel_pos_w"
    assert difference(model, original, size) <= 1e-5
    assert difference(patched(original, inherit=False), original, size) > 1e-3  # negative control


def test_inherited_tables_are_per_layer_at_each_blocks_grid() -> None:
    model = patched(sam())
    tables = model.vispos.attention
    assert all(isinstance(m, Decomposed2d) for m in tables) and len(tables) == 4
    assert [m.train_grid for m in tables] == [(WINDOW, WINDOW), (8, 8), (WINDOW, WINDOW), (8, 8)]
    assert [tuple(m.rel_pos_h.shape) for m in tables] == [(5, 16), (15, 16), (5, 16), (15, 16)]
    keys = model.state_dict()
    assert "blocks.0.attn.rel_pos_h" not in keys and "pos_embed" not in keys and "vispos.attention.1.rel_pos_w" in keys


def test_window_blocks_attend_at_window_local_positions_built_once_per_forward(monkeypatch) -> None:
    """Window blocks get the context of the window grid (every window of the batch in one call), global blocks
    the grid's; each is built once per forward."""
    model = patched(sam(), "rope2d", inherit=False)
    seen: dict[int, tuple] = {}
    forward = PatchedSamAttention.forward

    def spy(self, x, positions=None):
        seen[self.layer_idx] = (positions.grid, x.shape[:3], id(positions))
        return forward(self, x, positions)

    monkeypatch.setattr(PatchedSamAttention, "forward", spy)
    built = []
    context = type(model.vispos).context

    def counted(self, *args, **kwargs):
        built.append(args[0])
        return context(self, *args, **kwargs)

    monkeypatch.setattr(type(model.vispos), "context", counted)
    with torch.no_grad():
        model(torch.randn(2, 3, 80, 56))  # a 10x7 grid: 4x3 windows of 3x3 after padding
    assert [seen[i][0] for i in range(4)] == [(WINDOW, WINDOW), (10, 7), (WINDOW, WINDOW), (10, 7)]
    assert seen[0][1] == (2 * 4 * 3, WINDOW, WINDOW) and seen[1][1] == (2, 10, 7)
    assert seen[0][2] == seen[2][2] and seen[1][2] == seen[3][2]  # one context per kind of block
    assert sorted(built) == [(WINDOW, WINDOW), (10, 7)]


WINDOW_CASES = [
    ("decomposed2d", {}),
    ("rope2d", {"coords": "normalized", "inherit": False}),
    ("cpb2d", {"inherit": False}),
]


@pytest.mark.parametrize(("pos", "options"), WINDOW_CASES, ids=["decomposed2d", "rope2d", "cpb2d"])
def test_a_window_block_sees_each_window_as_a_grid_of_its_own(pos: str, options: dict) -> None:
    """Window-local coordinates: on a 6x6 grid of four 3x3 windows, the window block's output on each window equals
    its output on that window alone (a 3x3 grid, where window and grid coincide). Positions at the window's cells
    of the 6x6 grid would differ: decomposed2d's window tables resized to the grid, normalised coordinates
    spanning the grid (cpb2d, normalised by its training grid, agrees either way)."""
    model = patched(sam(), pos, **options)
    with torch.no_grad():
        for p in model.vispos.parameters():
            p.copy_(torch.randn_like(p))
    x = torch.randn(1, 6, 6, 32)
    windows = [(slice(3 * i, 3 * i + 3), slice(3 * j, 3 * j + 3)) for i in range(2) for j in range(2)]
    with torch.no_grad():
        whole = model.vispos_context(torch.zeros(1, 3, 48, 48))
        alone = model.vispos_context(torch.zeros(1, 3, 24, 24))
        for index, close in ((0, True), (1, False)):  # block 1 is global: the control
            out = model.blocks[index](x, whole)
            for rows, cols in windows:
                part = model.blocks[index](x[:, rows, cols].contiguous(), alone)
                err = (out[:, rows, cols] - part).abs().max().item()
                assert (err <= 1e-5) if close else (err > 1e-3), (index, err)


# --- 2: every 2D scheme; the discarded positions said -----------------------------------------------------------
@pytest.mark.parametrize("scheme", vispos.list_encodings(ndim=2))
def test_every_2d_scheme_applies_and_runs_at_two_sizes(scheme: str) -> None:
    original = sam()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = patched(original, scheme)
    said = [str(w.message) for w in caught if issubclass(w.category, vispos.timm.PretrainedPositionsWarning)]
    if scheme == "decomposed2d":
        assert not said
    else:
        assert any("own decomposed relative positions" in m and "is discarded" in m for m in said), said
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fresh start says nothing
        # lookhere2d says how it splits its field groups over these models' 2 heads: not about the positions
        warnings.filterwarnings("ignore", message="lookhere2d: fields=", category=UserWarning)
        patched(original, scheme, inherit=False)
    with torch.no_grad():
        for size in SIZES:
            out = model(torch.randn(2, 3, *size))
            assert out.shape == (2, 5) and out.isfinite().all()


def test_a_sam_with_only_an_absolute_table_says_when_it_is_discarded() -> None:
    original = sam(use_rel_pos=False)
    with pytest.warns(vispos.timm.PretrainedPositionsWarning, match="learned pos_embed is discarded"):
        patched(original, "rope2d")
    model = patched(original, "learned2d")
    assert difference(model, original, (64, 64)) <= 1e-5


def test_sams_own_rope_is_refused_unless_started_fresh() -> None:
    original = sam(use_rel_pos=False, use_rope=True)
    with pytest.raises(ValueError, match=r"RoPE of its own \(use_rope=True\).*inherit=False"):
        patched(original)
    model = patched(original, "rope2d", inherit=False)
    assert model.rope_global is None and model.rope_window is None
    assert not any(hasattr(blk.attn, "rope") for blk in model.blocks)
    with torch.no_grad():
        assert model(torch.randn(1, 3, 80, 56)).isfinite().all()


# --- 3: state dicts -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pos", ["decomposed2d", "relbias2d", ["sincos2d", "rope2d_mixed"], ["learned2d", "peg2d"]],
                         ids=str)  # fmt: skip
def test_state_dict_round_trip_into_a_freshly_patched_model(pos) -> None:
    original = sam()
    inherit = pos == "decomposed2d"
    model = patched(original, pos, inherit=inherit)
    with torch.no_grad():
        for p in model.vispos.parameters():
            p.add_(torch.randn_like(p))
    fresh = patched(sam(seed=1), pos, inherit=inherit)
    assert difference(fresh, model, (64, 64)) > 1e-3  # control: before loading
    fresh.load_state_dict(model.state_dict())
    for size in SIZES:
        assert difference(fresh, model, size) == 0.0


def test_timms_state_dict_loads_into_a_patched_model() -> None:
    original = sam()
    fresh = vispos.patch(sam(seed=1), "decomposed2d")
    assert difference(fresh, original, (64, 64)) > 1e-3
    fresh.load_state_dict(original.state_dict())
    assert difference(fresh, original, (64, 64)) <= 1e-5
    other = vispos.patch(sam(seed=1), ["learned2d", "rope2d"], inherit=False)  # a place for pos_embed only
    with pytest.raises(ValueError, match="timm SAM's decomposed relative tables"):
        other.load_state_dict(original.state_dict())
    result = other.load_state_dict(original.state_dict(), strict=False)
    assert "blocks.0.attn.rel_pos_h" in result.unexpected_keys


def test_a_timm_checkpoint_of_another_size_loads_with_each_blocks_tables_at_its_grid() -> None:
    """A plain 64 px checkpoint (8 x 8 grid) into a patched model built at 96 px (12 x 12): the global blocks'
    tables resized to the new grid, the window blocks' kept at the window's; outputs those of timm's model
    given 96 px images (which resizes the same tables at run time)."""
    original = sam()
    model = vispos.patch(sam(seed=1, img_size=96), "decomposed2d")
    assert difference(model, original, (96, 96)) > 1e-3  # the control: other weights
    model.load_state_dict(original.state_dict())
    assert difference(model, original, (96, 96)) <= 1e-5
    lengths = [layer.rel_pos_h.shape[0] for layer in model.vispos.attention]
    assert lengths == [2 * WINDOW - 1, 2 * 12 - 1, 2 * WINDOW - 1, 2 * 12 - 1]


# --- 4: timm's model-test style checks --------------------------------------------------------------------------
def test_forward_intermediates_are_timms() -> None:
    original = sam()
    model = patched(original)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        cases = ({}, {"indices": [0, 2], "norm": True}, {"indices": 2, "stop_early": True, "intermediates_only": True})
        for kwargs in cases:
            expected = original.forward_intermediates(x, **kwargs)
            torch.testing.assert_close(model.forward_intermediates(x, **kwargs), expected, rtol=0, atol=1e-5)


def test_a_patched_sam_pickles_trains_and_needs_its_positions() -> None:
    model = patched(sam(), ["learned2d", "relbias2d"], inherit=False)
    again = pickle.loads(pickle.dumps(model))
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(again(x), model(x))
    model.train().set_grad_checkpointing(True)
    model(torch.randn(2, 3, 64, 64)).sum().backward()
    assert all(p.grad is not None for p in model.vispos.parameters())
    assert isinstance(model.blocks[0], PatchedSamBlock)
    with pytest.raises(ValueError, match="needs the positions of the forward pass"):
        model.blocks[0](torch.randn(1, 8, 8, 32))
    with pytest.raises(ValueError, match="already patched"):
        vispos.patch(model, "rope2d")


@pytest.mark.parametrize("pos", [["learned2d", "decomposed2d"], ["rope2d", "peg2d"]], ids=["inherited", "rope2d-peg2d"])
def test_fx_feature_extraction_traces_the_patched_sam(pos: list[str]) -> None:
    """timm's torch.fx path (``create_feature_extractor``, its leaf modules and functions; timm's own SAM traces):
    the traced model, at the native size and at another, gives the patched model's outputs."""
    from timm.models import create_feature_extractor
    from torchvision.models.feature_extraction import get_graph_node_names

    model = patched(sam(), pos, inherit=pos[0] == "learned2d")
    last = get_graph_node_names(model)[1][-1]
    extractor = create_feature_extractor(model, return_nodes={"blocks.1": "global", last: "out"})
    caught: dict[str, torch.Tensor] = {}
    model.blocks[1].register_forward_hook(lambda _m, _a, y: caught.__setitem__("global", y))
    with torch.no_grad():
        for size in SIZES:
            x = torch.randn(1, 3, *size)
            features, out = extractor(x), model(x)
            torch.testing.assert_close(features["out"], out, rtol=0, atol=0)
            torch.testing.assert_close(features["global"], caught["global"], rtol=0, atol=0)
