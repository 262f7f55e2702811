"""timm's Swin and Swin V2 patched by vispos: windowed attention with vispos positions (vispos/timm/swin.py).

References: timm's own model on the same weights (inheritance, set_input_size, shift masks, intermediates), and
a window attention written here from the RoPE-ViT formula (RoPE-Swin: window-local coordinates)."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import timm
import torch
import torch.nn.functional as F

import vispos
from vispos.timm import PretrainedPositionsWarning
from vispos.timm.window import shift_mask

V1, V2 = "swin_tiny_patch4_window7_224", "swinv2_tiny_window8_256"
OWN = {V1: "relbias2d", V2: "cpb2d"}


def tiny(name: str, **kwargs) -> torch.nn.Module:
    """A two-stage Swin at 56 px (14 x 14 patches, 7 x 7 windows), position tables and norms filled so that
    nothing is trivially equal: random relative tables, cpb MLP and logit scales; Swin V2's res-post-norms
    (zero-initialised by timm, which makes every block an identity) set to 1."""
    torch.manual_seed(0)
    kwargs = dict(pretrained=False, img_size=56, embed_dim=32, depths=(2, 2), num_heads=(2, 4), window_size=7,
                  num_classes=0, drop_path_rate=0.0) | kwargs  # fmt: skip
    model = timm.create_model(name, **kwargs).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "relative_position_bias_table" in n or "logit_scale" in n or "cpb_mlp" in n:
                p.normal_(std=0.5)
            elif ".norm1.weight" in n or ".norm2.weight" in n:
                p.fill_(1.0)
    return model


def pair(name: str, **kwargs) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(timm's model, a copy with the same weights to patch)."""
    original = tiny(name, **kwargs)
    return original, copy.deepcopy(original)


def max_diff(a: torch.nn.Module, b: torch.nn.Module, size: int = 56) -> float:
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(size))
    with torch.no_grad():
        return (a(x) - b(x)).abs().max().item()


CASES = [(V1, {}), (V2, {}), (V2, {"pretrained_window_sizes": (12, 6)})]
IDS = ["swin", "swinv2", "swinv2-pretrained-window"]


@pytest.mark.parametrize(("name", "kwargs"), CASES, ids=IDS)
def test_inherited_bias_gives_timms_outputs(name, kwargs):
    original, model = pair(name, **kwargs)
    fresh = copy.deepcopy(original)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # inheriting says nothing
        vispos.patch(model, OWN[name])
        vispos.patch(fresh, OWN[name], inherit=False)
    assert max_diff(original, model) <= 1e-5
    assert max_diff(original, fresh) > 1e-3  # negative control: fresh tables change the outputs
    assert model.vispos_cfg["inherited"]["from"].startswith("timm SwinTransformer")


def test_timms_weight_keys_stay_and_the_tables_move_to_vispos():
    original, model = pair(V1)
    vispos.patch(model, "relbias2d")
    kept = {k for k in original.state_dict() if "relative_position" not in k}
    assert kept <= set(model.state_dict())
    assert "vispos.stages.1.attention.1.table" in model.state_dict()
    own = original.state_dict()["layers.1.blocks.1.attn.relative_position_bias_table"]
    torch.testing.assert_close(model.state_dict()["vispos.stages.1.attention.1.table"], own)


@pytest.mark.parametrize(("name", "other"), [(V1, "rope2d"), (V2, "relbias2d"), (V1, "learned2d")])
def test_another_scheme_says_the_bias_is_discarded(name, other):
    _, model = pair(name)
    with pytest.warns(PretrainedPositionsWarning, match="own relative position bias .* is discarded"):
        vispos.patch(model, other)
    _, fresh = pair(name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        vispos.patch(fresh, other, inherit=False)


@pytest.mark.parametrize("name", [V1, V2])
@pytest.mark.parametrize("scheme", vispos.list_encodings(ndim=2))
def test_every_2d_scheme_runs_on_swin_at_two_sizes(name, scheme):
    _, model = pair(name)
    vispos.patch(model, scheme, inherit=False)
    model.train()
    for size in (56, 84):  # 84: 21 x 21 patches, windows padded
        out = model(torch.randn(2, 3, size, size))
        assert out.shape == (2, model.num_features) and torch.isfinite(out).all()
    out.sum().backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if n.startswith("vispos.") and p.requires_grad
               and "conditional" not in n)  # fmt: skip


@pytest.mark.parametrize(("name", "kwargs"), CASES, ids=IDS)
def test_set_input_size_gives_timms_outputs_after_the_same_call(name, kwargs):
    """A new image size and window: relbias2d resized by Swin's own rule, cpb2d's offsets normalised as Swin V2's."""
    original, model = pair(name, **kwargs)
    vispos.patch(model, OWN[name])
    for m in (original, model):
        m.set_input_size(img_size=(84, 84), window_size=6)
    assert model.vispos_cfg["windows"] == [(6, 6), (6, 6)]
    assert max_diff(original, model, 84) <= 1e-5


@pytest.mark.parametrize("scheme", vispos.list_encodings(ndim=2))
def test_set_input_size_works_for_every_scheme(scheme):
    _, model = pair(V1)
    vispos.patch(model, scheme, inherit=False)
    model.set_input_size(img_size=(96, 96), window_size=(4, 6))
    with torch.no_grad():
        assert torch.isfinite(model(torch.randn(1, 3, 96, 96))).all()


@pytest.mark.parametrize("size", [(14, 14), (21, 28)])  # padded maps: whole windows
def test_shift_mask_is_swins(size):
    _, model = pair(V1)
    block = model.layers[0].blocks[1]
    padded = torch.zeros(1, *size, 1)
    torch.testing.assert_close(shift_mask(size, (7, 7), (3, 3)), block.get_attn_mask(padded), rtol=0, atol=0)
    block.shift_size = (3, 0)
    torch.testing.assert_close(shift_mask(size, (7, 7), (3, 0)), block.get_attn_mask(padded), rtol=0, atol=0)


# --- RoPE-Swin (naver-ai rope-vit): RoPE inside window attention, window-local coordinates --------------


class RopeWindowAttention(torch.nn.Module):
    """RoPE-ViT's attention inside a Swin window, from the paper's formula: token i of a wh x ww window sits at
    t_x = i % ww, t_y = i // ww; axial: the first d/4 complex pairs turn by t_x * theta^(-4j/d), the next by
    t_y * theta^(-4j/d); mixed: pair j of head h by t_x * f_x[h, j] + t_y * f_y[h, j]; pairs are adjacent
    channels (complex view). No relative bias."""

    def __init__(self, original: torch.nn.Module, freqs: torch.Tensor | None, theta: float) -> None:
        super().__init__()
        self.qkv, self.proj, self.heads = original.qkv, original.proj, original.num_heads
        self.freqs, self.theta = freqs, theta
        self.window_size = original.window_size

    def cis(self, d: int) -> torch.Tensor:
        wh, ww = self.window_size
        t = torch.arange(wh * ww, dtype=torch.float32)
        tx, ty = t % ww, torch.div(t, ww, rounding_mode="floor")
        if self.freqs is None:
            mag = 1.0 / self.theta ** (torch.arange(0, d, 4)[: d // 4].float() / d)
            angles = torch.cat((torch.outer(tx, mag), torch.outer(ty, mag)), dim=-1)  # [N, d/2]
        else:
            angles = tx[None, :, None] * self.freqs[0][:, None] + ty[None, :, None] * self.freqs[1][:, None]
        return torch.polar(torch.ones_like(angles), angles)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        d = q.shape[-1]
        cis = self.cis(d)

        def rot(t: torch.Tensor) -> torch.Tensor:
            pairs = torch.view_as_complex(t.float().reshape(*t.shape[:-1], d // 2, 2))  # adjacent channels
            return torch.view_as_real(pairs * cis).flatten(-2)

        attn = (rot(q) * d**-0.5) @ rot(k).transpose(-2, -1)
        if mask is not None:
            nw = mask.shape[0]
            attn = (attn.view(-1, nw, self.heads, n, n) + mask[None, :, None]).view(-1, self.heads, n, n)
        return self.proj((attn.softmax(-1) @ v).transpose(1, 2).reshape(b, n, c))


@pytest.mark.parametrize(("scheme", "theta"), [("rope2d", 100.0), ("rope2d_mixed", 10.0)])
def test_rope_swin_equals_the_rope_vit_formula_on_window_local_coordinates(scheme, theta):
    original, model = pair(V1, dynamic_img_size=True)  # timm's dynamic mode: any size, windows padded
    vispos.patch(model, scheme, inherit=False, theta=theta, layout="interleaved")
    for i, stage in enumerate(original.layers):
        for j, blk in enumerate(stage.blocks):
            freqs = model.vispos.stages[i].attention[j].freqs.detach() if scheme == "rope2d_mixed" else None
            blk.attn = RopeWindowAttention(blk.attn, freqs, theta)
    assert max_diff(original, model) <= 1e-5
    assert max_diff(original, model, 84) <= 1e-5  # padded windows: the same window-local coordinates


# --- the rest of the model's life -------------------------------------------------------------------


def test_forward_intermediates_are_timms():
    original, model = pair(V1)
    vispos.patch(model, "relbias2d")
    x = torch.randn(1, 3, 56, 56)
    with torch.no_grad():
        want_final, want = original.forward_intermediates(x, norm=True)
        got_final, got = model.forward_intermediates(x, norm=True)
        assert [t.shape for t in got] == [t.shape for t in want]
        for a, b in zip(got + [got_final], want + [want_final], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
        assert len(model.forward_intermediates(x, indices=[0], stop_early=True, intermediates_only=True)) == 1


@pytest.mark.parametrize("scheme", ["rope2d_mixed", "learned2d", "cpb2d"])
def test_state_dict_pickle_and_deepcopy_round_trip(scheme):
    _, model = pair(V2)
    vispos.patch(model, scheme, inherit=False)
    _, other = pair(V2)
    vispos.patch(other, scheme, inherit=False)
    other.load_state_dict(model.state_dict())
    assert max_diff(model, other) == 0.0
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert type(clone) is type(model) and max_diff(model, clone) == 0.0


def test_a_checkpoint_of_other_positions_is_refused():
    _, model = pair(V1)
    vispos.patch(model, "rope2d", inherit=False)
    _, other = pair(V1)
    vispos.patch(other, "rope2d", inherit=False, theta=10.0)
    with pytest.raises(ValueError, match="theta"):
        other.load_state_dict(model.state_dict())


def test_fx_feature_extraction():
    from timm.models import create_feature_extractor

    _, model = pair(V1)
    vispos.patch(model, "rope2d_mixed", inherit=False)
    extractor = create_feature_extractor(model, return_nodes={"run_stage": "stage0", "norm": "out"})
    x = torch.randn(1, 3, 56, 56)
    with torch.no_grad():
        out = extractor(x)
        torch.testing.assert_close(out["out"], model.forward_features(x), rtol=0, atol=0)
        assert out["stage0"].shape == (1, 14, 14, 32)


def test_torch_export_at_a_static_size():
    """Exported at one size (Swin's window partition reads sizes as Python numbers: dynamic sizes are not
    supported); the exported program gives the model's outputs."""
    _, model = pair(V1)
    vispos.patch(model, "rope2d", inherit=False)
    x = torch.randn(1, 3, 56, 56)
    program = torch.export.export(model, (x,))
    with torch.no_grad():
        torch.testing.assert_close(program.module()(x), model(x), rtol=0, atol=1e-5)


def test_patching_twice_and_without_context_are_refused():
    _, model = pair(V1)
    vispos.patch(model, "rope2d", inherit=False)
    with pytest.raises(ValueError, match="already patched"):
        vispos.patch(model, "rope2d")
    with pytest.raises(ValueError, match="positional context"):
        model.layers(model.patch_embed(torch.randn(1, 3, 56, 56)))


def test_peg_after_a_block_of_the_second_stage_takes_its_width():
    _, model = pair(V1)
    vispos.patch(model, ["rope2d", "peg2d"], inherit=False, after=2)  # block 2 = stage 1's first block
    assert model.vispos.conditional.proj.in_channels == 64  # stage 1's width
    with torch.no_grad():
        assert torch.isfinite(model(torch.randn(1, 3, 56, 56))).all()
    with pytest.raises(ValueError, match="out of range"):
        vispos.patch(pair(V1)[1], "peg2d", after=4)


def test_dropout_path_matches_in_training_mode_with_the_same_draws():
    """Training mode (attention dropout): the same random draws give timm's outputs."""
    original, model = pair(V1, attn_drop_rate=0.1)
    vispos.patch(model, "relbias2d")
    original.train(), model.train()
    x = torch.randn(1, 3, 56, 56)
    torch.manual_seed(1)
    want = original(x)
    torch.manual_seed(1)
    got = model(x)
    assert F.mse_loss(got, want).item() < 1e-10
