"""timm BEiT / BEiT v2 (``timm.models.beit.Beit``) patched: its relative bias (per layer or shared) and absolute
table inherited, equal to timm's own model at the native size and, at other sizes, to timm's model built there
with the checkpoint loaded through timm's ``checkpoint_filter_fn``; every 2D scheme applies; timm's model-test
style checks (forward_intermediates, torch.fx, torch.export, state dicts, pickle)."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import timm
import torch
from timm.layers import resize_rel_pos_bias_table
from timm.models.beit import checkpoint_filter_fn
from torch.export import Dim

import vispos
from vispos.encodings.relbias import RelBias2d
from vispos.encodings.relbias_resize import resize_bias_table_geometric

# BEiT's positional configurations: per-layer bias (beit_*, beitv2_*), shared bias, either with an absolute table,
# both biases at once (timm adds them)
CONFIGS = {
    "per_layer": {},
    "shared": {"use_rel_pos_bias": False, "use_shared_rel_pos_bias": True},
    "per_layer+abs": {"use_abs_pos_emb": True},
    "shared+abs": {"use_rel_pos_bias": False, "use_shared_rel_pos_bias": True, "use_abs_pos_emb": True},
    "per_layer+shared": {"use_shared_rel_pos_bias": True},
}
OTHER_SIZES = [(96, 64), (48, 80)]  # grids 6x4 (one axis grows) and 3x5 (one shrinks, one grows)


def beit(name: str = "beit_base_patch16_224", img_size: int | tuple[int, int] = 64, **kwargs: object):
    """A tiny timm BEiT with gamma 1 and every zero-initialised table, bias and the head filled at random."""
    torch.manual_seed(0)
    args = dict(pretrained=False, depth=2, embed_dim=32, num_heads=2, num_classes=5, init_values=1.0)
    model = timm.create_model(name, img_size=img_size, **(args | kwargs)).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if any(k in n for k in ("relative_position_bias_table", "pos_embed", "q_bias", "v_bias", "head.")):
                p.copy_(torch.randn_like(p))
    return model


def patched(model: torch.nn.Module, pos: str | list[str] = "relbias2d", **kwargs: object) -> torch.nn.Module:
    return vispos.patch(copy.deepcopy(model), pos, **kwargs)


def timm_at(size: tuple[int, int], original: torch.nn.Module, **kwargs: object) -> torch.nn.Module:
    """timm's BEiT built at ``size``, the original's weights loaded through timm's checkpoint filter."""
    reference = beit(img_size=size, **kwargs)
    reference.load_state_dict(checkpoint_filter_fn(original.state_dict(), reference))
    return reference


def difference(a: torch.nn.Module, b: torch.nn.Module, size: tuple[int, int]) -> float:
    x = torch.randn(2, 3, *size)
    with torch.no_grad():
        return max((a(x) - b(x)).abs().max().item(), (a.forward_features(x) - b.forward_features(x)).abs().max().item())


# --- the relative bias's layout and resizing, against timm's functions ------------------------------------------------
@pytest.mark.parametrize(("old", "new"), [((4, 4), (6, 4)), ((4, 4), (3, 5)), ((7, 7), (14, 14)), ((5, 3), (2, 6))])
def test_geometric_resize_is_timms_resize_rel_pos_bias_table(old, new) -> None:
    torch.manual_seed(0)
    per_offset = (2 * old[0] - 1) * (2 * old[1] - 1)
    table = torch.randn(per_offset + 3, 4)
    shape = ((2 * new[0] - 1) * (2 * new[1] - 1) + 3, 4)
    expected = resize_rel_pos_bias_table(table, new_window_size=new, new_bias_shape=shape, old_window_size=old)
    ours = torch.cat((resize_bias_table_geometric(table[:per_offset], old, new), table[per_offset:]))
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6)
    bicubic = vispos.create_encoding("relbias2d", num_heads=4, train_grid=old)  # control: the other rule differs
    with torch.no_grad():
        bicubic.table.copy_(table[:per_offset])
    assert (bicubic.offset_bias(new).flatten(1).T - expected[:-3]).abs().max() > 1e-3


# --- 1: the model's own positions inherited -------------------------------------------------------------------------
@pytest.mark.parametrize("config", CONFIGS, ids=list(CONFIGS))
def test_inherited_bias_reproduces_timms_beit_at_the_native_size(config: str) -> None:
    original = beit(**CONFIGS[config])
    model = patched(original)
    assert difference(model, original, (64, 64)) <= 1e-5
    assert model.vispos.settings["inherited"]["from"].startswith("timm Beit")
    assert model.vispos.settings["pos"] == (["learned2d", "relbias2d"] if "abs" in config else ["relbias2d"])
    assert difference(patched(original, inherit=False), original, (64, 64)) > 1e-3  # negative control


def test_a_shared_bias_stays_one_table_for_every_layer() -> None:
    model = patched(beit(**CONFIGS["shared"]))
    assert model.vispos.settings["options"]["per_layer"] is False
    assert isinstance(model.vispos.attention, RelBias2d)  # one module, not a list
    assert "blocks.0.attn.relative_position_bias_table" not in model.state_dict()
    with pytest.raises(ValueError, match="per_layer=False shares one table, but this BEiT has one per layer"):
        with pytest.warns(vispos.timm.PretrainedPositionsWarning):
            patched(beit(), per_layer=False)


def test_beitv2_is_inherited_too() -> None:
    original = beit("beitv2_base_patch16_224")
    assert difference(patched(original), original, (64, 64)) <= 1e-5


# --- 2: every 2D scheme; the discarded bias said ----------------------------------------------------------------
@pytest.mark.parametrize("scheme", vispos.list_encodings(ndim=2))
def test_every_2d_scheme_applies_and_runs_at_two_sizes(scheme: str) -> None:
    original = beit(**CONFIGS["per_layer+abs"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = patched(original, scheme)
    said = [str(w.message) for w in caught if issubclass(w.category, vispos.timm.PretrainedPositionsWarning)]
    if scheme == "relbias2d":
        assert not said
    else:
        assert any("own relative position bias" in m and "is discarded" in m for m in said), said
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fresh start says nothing
        # lookhere2d says how it splits its field groups over these models' 2 heads: not about the positions
        warnings.filterwarnings("ignore", message="lookhere2d: fields=", category=UserWarning)
        patched(original, scheme, inherit=False)
    with torch.no_grad():
        for size in [(64, 96), (48, 32)]:
            out = model(torch.randn(2, 3, *size))
            assert out.shape == (2, 5) and out.isfinite().all()


def test_an_option_against_the_inherited_resize_rule_is_said() -> None:
    with pytest.warns(vispos.timm.PretrainedPositionsWarning, match=r"resize='bicubic'.*assume resize='geometric'"):
        patched(beit(), resize="bicubic")


# --- 3: other input sizes, as timm's checkpoint filter resizes --------------------------------------------------
@pytest.mark.parametrize("config", CONFIGS, ids=list(CONFIGS))
@pytest.mark.parametrize("size", OTHER_SIZES, ids=["96x64", "48x80"])
def test_inherited_bias_at_another_size_is_timms_model_built_there(config: str, size: tuple[int, int]) -> None:
    original = beit(**CONFIGS[config])
    reference = timm_at(size, original, **CONFIGS[config])
    assert difference(patched(original), reference, size) <= 1e-5
    with pytest.warns(vispos.timm.PretrainedPositionsWarning):
        bicubic = patched(original, resize="bicubic")  # negative control: Swin's rule
    assert difference(bicubic, reference, size) > 1e-3


@pytest.mark.parametrize("config", ["per_layer+abs", "shared"])
def test_timms_state_dict_loads_into_a_patched_model(config: str) -> None:
    original = beit(**CONFIGS[config])
    torch.manual_seed(1)
    args = dict(img_size=64, depth=2, embed_dim=32, num_heads=2, num_classes=5, init_values=1.0)
    fresh = vispos.patch(timm.create_model("beit_base_patch16_224", **args, **CONFIGS[config]).eval(), "relbias2d")
    assert difference(fresh, original, (64, 64)) > 1e-3  # control: before loading
    fresh.load_state_dict(original.state_dict())
    assert difference(fresh, original, (64, 64)) <= 1e-5
    at = (96, 64)  # a model patched at another size takes the 64 px checkpoint as timm's filter does
    other = vispos.patch(beit(img_size=at, **CONFIGS[config]), "relbias2d")
    other.load_state_dict(original.state_dict())
    assert difference(other, timm_at(at, original, **CONFIGS[config]), at) <= 1e-5


def test_a_timm_bias_with_no_place_in_the_scheme_is_refused_or_reported() -> None:
    original = beit()
    model = patched(original, "rope2d", inherit=False)
    with pytest.raises(ValueError, match="timm BEiT's relative position bias .* has no place for"):
        model.load_state_dict(original.state_dict())
    result = model.load_state_dict(original.state_dict(), strict=False)
    assert "blocks.0.attn.relative_position_bias_table" in result.unexpected_keys


def test_set_input_size_matches_timms() -> None:
    original = beit(**CONFIGS["per_layer+abs"])
    model = patched(original)
    model.set_input_size(img_size=(96, 64))
    original.set_input_size(img_size=(96, 64))
    assert model.patch_embed.grid_size == (6, 4)
    assert difference(model, original, (96, 64)) <= 1e-5


# --- 4: timm's model-test style checks --------------------------------------------------------------------------
def test_forward_intermediates_are_timms() -> None:
    original = beit()
    model = patched(original)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        for kwargs in ({}, {"indices": [0], "output_fmt": "NLC", "norm": True, "return_prefix_tokens": True},
                       {"indices": 1, "stop_early": True, "intermediates_only": True}):  # fmt: skip
            expected = original.forward_intermediates(x, **kwargs)
            torch.testing.assert_close(model.forward_intermediates(x, **kwargs), expected, rtol=0, atol=1e-5)
        final, (first, last) = model.forward_intermediates(torch.randn(1, 3, 48, 80))
        assert first.shape == last.shape == (1, 32, 3, 5) and final.shape == (1, 16, 32)


def test_fx_feature_extraction_returns_the_blocks_outputs() -> None:
    from timm.models import create_feature_extractor
    from torchvision.models.feature_extraction import get_graph_node_names

    model = patched(beit(), ["relbias2d", "peg2d"])
    assert "blocks.1.attn.positioned_attention" in get_graph_node_names(model)[1]
    extractor = create_feature_extractor(model, return_nodes={"blocks.0": "first", "blocks.1": "last"})
    caught: dict[int, torch.Tensor] = {}
    for i, b in enumerate(model.blocks):
        b.register_forward_hook(lambda _m, _a, y, i=i: caught.__setitem__(i, y))
    with torch.no_grad():
        for size in [(64, 64), (48, 80)]:
            x = torch.randn(1, 3, *size)
            features = extractor(x)
            model(x)
            torch.testing.assert_close(features["first"], caught[0], rtol=0, atol=0)
            torch.testing.assert_close(features["last"], caught[1], rtol=0, atol=0)


@pytest.mark.parametrize("scheme", ["relbias2d", "rope2d"])
def test_torch_export_with_dynamic_sizes_matches_eager_at_other_sizes(scheme: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vispos.timm.PretrainedPositionsWarning)
        model = patched(beit(**CONFIGS["per_layer+abs"]), scheme)
    dynamic = {"x": {0: Dim("b", min=1, max=8), 2: 16 * Dim("h", min=2, max=16), 3: 16 * Dim("w", min=2, max=16)}}
    program = torch.export.export(model, (torch.randn(2, 3, 64, 96),), dynamic_shapes=dynamic).module()
    with torch.no_grad():
        for size in [(1, 3, 128, 48), (3, 3, 64, 64), (2, 3, 32, 160)]:  # the training size among them
            x = torch.randn(*size)
            torch.testing.assert_close(program(x), model(x), rtol=1e-5, atol=1e-5)


def test_state_dict_round_trip_pickle_and_deepcopy() -> None:
    model = patched(beit(**CONFIGS["per_layer+abs"]))
    again = patched(beit(**CONFIGS["per_layer+abs"]))
    with torch.no_grad():
        for p in model.vispos.parameters():
            p.add_(torch.randn_like(p))  # now unlike the fresh one
    assert difference(again, model, (48, 80)) > 1e-3
    again.load_state_dict(model.state_dict())
    for copied in (again, pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        assert difference(copied, model, (48, 80)) == 0.0
    keys = model.state_dict().keys()
    assert {"blocks.0.attn.qkv.weight", "blocks.0.attn.q_bias", "blocks.0.attn.v_bias"} <= keys
    assert "blocks.0.attn.k_bias" not in keys  # zero, not saved (as timm's)


def test_training_with_gradient_checkpointing_reaches_the_bias() -> None:
    model = patched(beit()).train()
    model.set_grad_checkpointing(True)
    model(torch.randn(2, 3, 48, 80)).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.vispos.parameters())
    assert {"vispos.attention.0.table", "cls_token"} <= model.no_weight_decay()
    assert model.group_matcher()["blocks"][0][0] == r"^vispos\.attention\.(\d+)"


def test_a_conditional_scheme_runs_after_its_block() -> None:
    """peg2d on BEiT's blocks (which take the context as shared_rel_pos_bias): its convolution reaches the output,
    in forward and in forward_intermediates, at a non-square size."""
    model = patched(beit(), ["relbias2d", "peg2d"], after=1)
    x = torch.randn(2, 3, 48, 80)
    with torch.no_grad():
        with_peg, last = model(x), model.forward_intermediates(x, indices=[1], output_fmt="NLC")[1][0]
        model.vispos.conditional.proj.weight.zero_()
        model.vispos.conditional.proj.bias.zero_()
        without, last_without = model(x), model.forward_intermediates(x, indices=[1], output_fmt="NLC")[1][0]
    assert (with_peg - without).abs().max() > 1e-3 and (last - last_without).abs().max() > 1e-3
