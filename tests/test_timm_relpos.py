"""timm's VisionTransformerRelPos (vit_relpos_*, vit_srelpos_*) patched by vispos: its own relative bias inherited
(RelPosMlp -> cpb2d, RelPosBias -> relbias2d), compared with timm's own model on the same weights."""

from __future__ import annotations

import copy
import io
import pickle
import warnings

import pytest
import timm
import torch
from timm.layers import resize_rel_pos_bias_table
from timm.layers.pos_embed_rel import gen_relative_log_coords
from timm.models.vision_transformer_relpos import checkpoint_filter_fn
from torch.export import Dim

import vispos
from vispos.encodings.relbias import log_offsets, log_spaced_offsets, offsets_2d
from vispos.encodings.relbias_resize import resize_table
from vispos.timm import PretrainedPositionsWarning

IMG = 64  # 16 px patches: a 4 x 4 grid
SIZES = [(48, 80), (96, 64)]  # other grids, one of them not square
# (model name, timm kwargs): every RelPosMlp mode timm can build (cr: every registered name; swin: mlp_swin),
# RelPosBias, per layer and shared (srelpos), with and without a class token, pre- and post-norm blocks
CASES = [
    ("vit_relpos_small_patch16_224", {}),
    ("vit_srelpos_small_patch16_224", {}),
    ("vit_relpos_medium_patch16_cls_224", {}),
    ("vit_relpos_small_patch16_rpn_224", {}),
    ("vit_relpos_small_patch16_224", {"rel_pos_type": "mlp_swin", "class_token": True}),
    ("vit_relpos_small_patch16_224", {"rel_pos_type": "bias"}),
    ("vit_relpos_medium_patch16_cls_224", {"rel_pos_type": "bias"}),
    ("vit_srelpos_small_patch16_224", {"rel_pos_type": "bias", "class_token": True}),
]
BIAS = [i for i, (_, kw) in enumerate(CASES) if kw.get("rel_pos_type") == "bias"]  # RelPosBias: a table per grid
IDS = [f"{n}-{kw.get('rel_pos_type', 'mlp')}{'-cls' if kw.get('class_token') else ''}" for n, kw in CASES]


def timm_model(name: str, img: int | tuple[int, int] = IMG, seed: int = 0, **kwargs: object) -> torch.nn.Module:
    """A two-block model of the family built by timm, layer scales 1 and every relative-bias weight (and the
    zero-initialised biases, class token) random, so that equality is not trivial."""
    torch.manual_seed(seed)
    model = timm.create_model(name, pretrained=False, depth=2, embed_dim=64, num_heads=4, num_classes=5, img_size=img,
                              **kwargs).eval()  # fmt: skip
    with torch.no_grad():
        for key, p in model.named_parameters():
            if key.endswith(("gamma", "norm1.weight", "norm2.weight")):  # layer scales; ResPost: its norms
                p.fill_(1.0)
            elif "rel_pos" in key or key == "cls_token" or key.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.5)
    return model


def scheme_of(kwargs: dict[str, object]) -> str:
    return "relbias2d" if kwargs.get("rel_pos_type") == "bias" else "cpb2d"


def patched(original: torch.nn.Module, pos: str | list[str], **options: object) -> torch.nn.Module:
    return vispos.patch(copy.deepcopy(original), pos, **options)


def timm_at(original: torch.nn.Module, name: str, kwargs: dict[str, object], size: tuple[int, int]) -> torch.nn.Module:
    """timm's model at another input size with the same weights: built there (RelPosMlp is size-free), or, for
    RelPosBias, resized by timm (``set_input_size``: its table on BEiT's geometric grid)."""
    if kwargs.get("rel_pos_type") == "bias":
        model = copy.deepcopy(original)
        model.set_input_size(img_size=size)
        return model
    model = timm_model(name, img=size, seed=1, **kwargs)
    model.load_state_dict(original.state_dict())
    return model


def images(size: tuple[int, int] = (IMG, IMG), batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, 3, *size, generator=torch.Generator().manual_seed(3))


def max_difference(a: torch.nn.Module, b: torch.nn.Module, size: tuple[int, int] = (IMG, IMG)) -> float:
    x = images(size)
    with torch.no_grad():
        return (a(x) - b(x)).abs().max().item()


# --- inheritance --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "kwargs"), CASES, ids=IDS)
def test_inherited_bias_gives_timms_outputs_at_the_native_size(name: str, kwargs: dict[str, object]) -> None:
    original = timm_model(name, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the model's own positions kept: nothing to warn about
        model = patched(original, scheme_of(kwargs))
    assert model.vispos_cfg["pos"] == [scheme_of(kwargs)]
    assert max_difference(original, model) <= 1e-5
    fresh = patched(original, scheme_of(kwargs), inherit=False)  # negative control: fresh positions
    assert max_difference(original, fresh) > 1e-3


@pytest.mark.parametrize(("name", "kwargs"), CASES, ids=IDS)
def test_at_other_grids_the_patched_model_equals_timms_model_there(name: str, kwargs: dict[str, object]) -> None:
    original = timm_model(name, **kwargs)
    model = patched(original, scheme_of(kwargs))
    for size in SIZES:
        assert max_difference(timm_at(original, name, kwargs, size), model, size) <= 1e-5, size


def test_inherited_options_name_the_mode_they_reproduce() -> None:
    cr = patched(timm_model("vit_srelpos_small_patch16_224"), "cpb2d").vispos_cfg
    assert cr["options"] == {"coords": "log", "output": "linear", "out_bias": True, "hidden": 384, "dropout": 0.125,
                             "prefix_entries": False, "per_layer": False}  # fmt: skip
    assert cr["inherited"]["from"] == "timm RelPosMlp(mode='cr')"
    swin = patched(timm_model("vit_relpos_small_patch16_224", rel_pos_type="mlp_swin"), "cpb2d").vispos_cfg
    assert swin["options"]["coords"] == "swin" and swin["options"]["offset_scale"] == "grid"
    bias = patched(timm_model("vit_relpos_small_patch16_224", rel_pos_type="bias"), "relbias2d").vispos_cfg
    assert bias["options"] == {"prefix_entries": True, "per_layer": True, "resize": "geometric"}


def test_an_option_that_changes_the_weights_shape_warns_and_starts_fresh() -> None:
    original = timm_model("vit_relpos_small_patch16_224")
    with pytest.warns(PretrainedPositionsWarning, match="hidden=32.*assume hidden=128"):
        model = patched(original, "cpb2d", hidden=32)
    assert model.vispos.attention[0].mlp[0].out_features == 32
    assert max_difference(original, model) > 1e-3


def test_a_relposmlp_mode_vispos_cannot_reproduce_is_refused_by_name() -> None:
    original = timm_model("vit_relpos_small_patch16_224")
    for blk in original.blocks:
        blk.attn.rel_pos.mode = "rw"  # timm 1.0.31 cannot build it (gen_relative_log_coords refuses 'rw')
    with pytest.raises(ValueError, match=r"mode='rw'.*accepted: modes 'swin' and 'cr'.*inherit=False"):
        vispos.patch(original, "cpb2d")
    vispos.patch(original, "cpb2d", inherit=False)  # a fresh scheme needs nothing from it


# --- every scheme ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scheme", vispos.list_encodings(ndim=2))
def test_every_2d_scheme_runs_at_two_sizes_and_another_one_warns(scheme: str) -> None:
    original = timm_model("vit_relpos_medium_patch16_cls_224")  # cpb2d inherited; a class token
    if scheme == "cpb2d":
        model = patched(original, scheme)
    else:
        with pytest.warns(PretrainedPositionsWarning, match=r"own relative position bias .* is discarded"):
            model = patched(original, scheme)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # lookhere2d says how it splits its field groups over these models' 2 heads: not about the positions
        warnings.filterwarnings("ignore", message="lookhere2d: fields=", category=UserWarning)
        silent = patched(original, scheme, inherit=False)
    with torch.no_grad():
        for size in [(IMG, IMG), SIZES[0]]:
            for m in (model, silent):
                out = m(images(size))
                assert out.shape == (2, 5) and torch.isfinite(out).all(), size


# --- timm's model checks -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "kwargs"), [CASES[2], CASES[7]], ids=[IDS[2], IDS[7]])
def test_forward_features_and_intermediates_equal_timms(name: str, kwargs: dict[str, object]) -> None:
    original = timm_model(name, **kwargs)
    model = patched(original, scheme_of(kwargs))
    x = images()
    with torch.no_grad():
        torch.testing.assert_close(model.forward_features(x), original.forward_features(x), rtol=0, atol=1e-5)
        for fmt in ("NCHW", "NLC"):
            ours = model.forward_intermediates(x, indices=[0, 1], output_fmt=fmt, return_prefix_tokens=True, norm=True)
            theirs = original.forward_intermediates(x, indices=[0, 1], output_fmt=fmt, return_prefix_tokens=True,
                                                    norm=True)  # fmt: skip
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
        only = model.forward_intermediates(images(SIZES[0]), indices=1, intermediates_only=True, stop_early=True)
        assert only[0].shape == (2, 64, 3, 5)  # NCHW at the 3 x 5 grid


def test_fx_feature_extraction_returns_the_blocks_outputs() -> None:
    from timm.models import create_feature_extractor

    model = patched(timm_model("vit_relpos_medium_patch16_cls_224"), "cpb2d")
    extractor = create_feature_extractor(model, return_nodes={"blocks.0": "first", "blocks.1": "last"})
    caught: dict[int, torch.Tensor] = {}
    hooks = [
        b.register_forward_hook(lambda _m, _a, y, i=i: caught.__setitem__(i, y)) for i, b in enumerate(model.blocks)
    ]
    with torch.no_grad():
        for size in [(IMG, IMG), *SIZES]:
            x = images(size)
            features = extractor(x)
            model(x)
            torch.testing.assert_close(features["first"], caught[0], rtol=0, atol=0)
            torch.testing.assert_close(features["last"], caught[1], rtol=0, atol=0)
    for h in hooks:
        h.remove()


@pytest.mark.parametrize(("name", "kwargs"), [CASES[1], CASES[6]], ids=[IDS[1], IDS[6]])
def test_torch_export_with_dynamic_sizes_matches_eager(name: str, kwargs: dict[str, object]) -> None:
    model = patched(timm_model(name, **kwargs), scheme_of(kwargs))
    dims = {"x": {0: Dim("b", min=1, max=8), 2: 16 * Dim("h", min=2, max=16), 3: 16 * Dim("w", min=2, max=16)}}
    program = torch.export.export(model, (images((IMG, 96)),), dynamic_shapes=dims).module()
    with torch.no_grad():
        for size in [(IMG, IMG), *SIZES]:
            x = images(size, batch=3)
            torch.testing.assert_close(program(x), model(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("name", "kwargs"), CASES, ids=IDS)
def test_state_dicts_round_trip_and_timms_own_loads(name: str, kwargs: dict[str, object]) -> None:
    original = timm_model(name, **kwargs)
    model = patched(original, scheme_of(kwargs))
    other = patched(timm_model(name, seed=7, **kwargs), scheme_of(kwargs))  # other weights, same structure
    assert max_difference(model, other) > 1e-3  # the control
    other.load_state_dict(model.state_dict())
    assert max_difference(model, other) == 0.0
    from_timm = patched(timm_model(name, seed=8, **kwargs), scheme_of(kwargs))
    from_timm.load_state_dict(original.state_dict())  # strict: every timm key has its place
    assert max_difference(original, from_timm) <= 1e-5
    attn_keys = {k for k in original.state_dict() if ".attn." in k and "rel_pos" not in k}
    assert attn_keys <= set(model.state_dict())  # timm's attention weights under their own names


@pytest.mark.parametrize(("name", "kwargs"), CASES, ids=IDS)
def test_set_input_size_gives_timms_outputs_after_the_same_call(name: str, kwargs: dict[str, object]) -> None:
    original = timm_model(name, **kwargs)
    model = patched(original, scheme_of(kwargs))
    for size in SIZES:
        reference = copy.deepcopy(original)
        reference.set_input_size(img_size=size)
        model.set_input_size(img_size=size)
        assert model.patch_embed.img_size == reference.patch_embed.img_size == size
        assert max_difference(reference, model, size) <= 1e-5, size


@pytest.mark.parametrize(("name", "kwargs"), [CASES[i] for i in BIAS], ids=[IDS[i] for i in BIAS])
def test_a_timm_checkpoint_of_another_size_loads_as_timms_filter_loads_it(name: str, kwargs: dict[str, object]) -> None:
    """A plain checkpoint of the model at 64 px (4 x 4 grid) into a patched model built at 96 px (6 x 6): its
    tables resampled as timm's checkpoint_filter_fn resamples them for timm's model at 96 px."""
    checkpoint = timm_model(name, **kwargs).state_dict()
    reference = timm_model(name, img=96, seed=1, **kwargs)
    reference.load_state_dict(checkpoint_filter_fn(checkpoint, reference))
    model = patched(timm_model(name, img=96, seed=2, **kwargs), scheme_of(kwargs))
    assert max_difference(reference, model, (96, 96)) > 1e-3  # the control: other weights
    model.load_state_dict(checkpoint)
    assert max_difference(reference, model, (96, 96)) <= 1e-5


def test_pickle_and_deepcopy_keep_the_model() -> None:
    model = patched(timm_model("vit_relpos_medium_patch16_cls_224"), ["learned2d", "cpb2d"])
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for other in (torch.load(buffer, weights_only=False), copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert type(other) is type(model)
        for size in [(IMG, IMG), SIZES[0]]:
            assert max_difference(model, other, size) == 0.0


# --- the options, against timm's own formulas ------------------------------------------------------------------
@pytest.mark.parametrize("grid", [(4, 4), (3, 5)])
def test_cpb2d_coordinates_are_timms_log_coords(grid: tuple[int, int]) -> None:
    """coords='log' is timm's 'cr' table; SwinV2's coordinates at the grid at hand are timm's 'swin' table."""
    torch.testing.assert_close(log_offsets(offsets_2d(grid)), gen_relative_log_coords(grid, mode="cr"))
    torch.testing.assert_close(log_spaced_offsets(grid, grid), gen_relative_log_coords(grid, mode="swin"))
    torch.testing.assert_close(log_spaced_offsets(grid, (6, 7)), gen_relative_log_coords(grid, (6, 7), mode="swin"))


@pytest.mark.parametrize(
    ("old", "new"), [((4, 4), (3, 5)), ((4, 4), (7, 7)), ((3, 5), (6, 2)), ((5, 5), (2, 2)), ((4, 4), (6, 4))]
)
def test_relbias2d_geometric_resize_is_timms_resize_rel_pos_bias_table(old, new) -> None:  # noqa: ANN001
    table = torch.randn((2 * old[0] - 1) * (2 * old[1] - 1), 3, generator=torch.Generator().manual_seed(0))
    shape = ((2 * new[0] - 1) * (2 * new[1] - 1), 3)
    expected = resize_rel_pos_bias_table(table, new_window_size=new, new_bias_shape=shape, old_window_size=old)
    torch.testing.assert_close(resize_table(table, old, new, "geometric"), expected, rtol=0, atol=1e-5)
    assert (resize_table(table, old, new, "bicubic") - expected).abs().max() > 1e-3  # the default differs
