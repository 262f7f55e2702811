"""A patched timm NaFlexVit keeps the model's own positions: its RoPE (axial, mixed, DINOv3) and its learned
table (both of timm's resampling paths) are inherited, and the patched model equals timm's own NaFlexVit
wherever timm's positions follow the coordinates: on batches from timm's NaFlex collator (each image's
tokens its row-major grid from position 0) and on full grids. Where timm's do not (tokens in another order),
the grid-sample table still agrees, and timm's RoPE and resized table are shown to part from the coordinates.

The models have random weights with layer scales at 1 (timm's 1e-5 would hide attention), sharpened
attention and randomised positional parameters; each equality test has a control that differs (> 1e-3)."""

from __future__ import annotations

import copy
import warnings

import pytest
import timm
import torch

import vispos
from vispos.timm.inherit import PretrainedPositionsWarning

SIZES = [(48, 80), (96, 32), (64, 64)]  # px, 16 px patches: grids 3 x 5, 6 x 2, 4 x 4 (the training grid)
KEYS = ("patches", "patch_coord", "patch_valid")

# timm NaFlexVit positional configurations -> the scheme they are patched with (what inherit keeps)
CONFIGS: dict[str, tuple[dict[str, object], str]] = {
    "learned": ({}, "learned2d"),
    "learned grid_sample": ({"pos_embed_use_grid_sample": True}, "learned2d"),
    "axial": ({"rope_type": "axial", "pos_embed": "none"}, "rope2d"),
    "axial xy half + grid_sample table": (
        {"rope_type": "axial", "rope_grid_indexing": "xy", "rope_rotate_half": True, "pos_embed_use_grid_sample": True},
        "rope2d",
    ),
    "mixed": ({"rope_type": "mixed", "pos_embed": "none"}, "rope2d_mixed"),
    "dinov3": ({"rope_type": "dinov3", "pos_embed": "none", "rope_rotate_half": True}, "rope2d"),
}


def timm_naflex(**config: object) -> torch.nn.Module:
    torch.manual_seed(0)
    net = timm.create_model("naflexvit_base_patch16_gap", img_size=64, embed_dim=64, num_heads=2, depth=2,
                            num_classes=0, **config)  # fmt: skip
    with torch.no_grad():
        for name, param in net.named_parameters():
            leaf = name.split(".")[-1]
            if leaf.startswith("gamma"):  # ls*.gamma (ViT blocks), gamma_1 / gamma_2 (EVA blocks)
                param.fill_(1.0)
            if leaf == "weight" and name.endswith("attn.qkv.weight"):
                param.mul_(4.0)
            if "pos_embed" in name or name.startswith("rope."):
                param.normal_(std=0.5)
    return net.eval()


def patched(net: torch.nn.Module, pos: str, **kwargs: object) -> torch.nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("error", PretrainedPositionsWarning)  # inheriting says nothing
        return vispos.patch(copy.deepcopy(net), pos, **kwargs)


def collated(samples: list | None = None) -> dict[str, torch.Tensor]:
    from timm.data.naflex_dataset import NaFlexCollator

    if samples is None:
        g = torch.Generator().manual_seed(6)
        samples = [(dict(zip(KEYS, patchify(torch.randn(3, h, w, generator=g)), strict=True)), 0) for h, w in SIZES]
    return NaFlexCollator()(samples)[0]


def features(net: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return net.forward_features(*(batch[k] for k in KEYS))["patches"]


def valid_tokens(net: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    b, p = batch["patch_valid"].shape[0], net.num_prefix_tokens
    return torch.cat((torch.ones(b, p, dtype=torch.bool), batch["patch_valid"]), dim=1)


@pytest.mark.parametrize("name", CONFIGS)
def test_patched_naflexvit_equals_timms_on_a_collated_ragged_batch(name: str) -> None:
    config, scheme = CONFIGS[name]
    net = timm_naflex(**config)
    ours = patched(net, scheme)
    assert ours.vispos_cfg["pos"][-1] == scheme
    batch = collated()
    valid = valid_tokens(net, batch)
    expected = features(net, batch)[valid]
    torch.testing.assert_close(features(ours, batch)[valid], expected, rtol=1e-5, atol=1e-5)
    fresh = vispos.patch(copy.deepcopy(net), scheme, inherit=False)  # control: the model's positions dropped
    with torch.no_grad():
        for param in fresh.vispos.parameters():
            param.normal_(std=0.5)
    assert (features(fresh, batch)[valid] - expected).abs().max() > 1e-3


@pytest.mark.parametrize("name", CONFIGS)
def test_patched_naflexvit_equals_timms_on_full_grids_off_the_training_grid(name: str) -> None:
    """Full grids other than the 4 x 4 the table was made for, as NaFlex batches and as images [B, C, H, W].
    timm's image input resizes a grid-sample model's table (its NaFlex input samples it); the patched model
    samples it for both, so on images the comparison holds where timm's two paths agree."""
    config, scheme = CONFIGS[name]
    net = timm_naflex(**config)
    ours = patched(net, scheme)
    for h, w in [(48, 112), (128, 96)]:
        image = torch.randn(2, 3, h, w, generator=torch.Generator().manual_seed(h))
        batch = collated([(dict(zip(KEYS, patchify(one), strict=True)), 0) for one in image])
        valid = valid_tokens(net, batch)
        torch.testing.assert_close(features(ours, batch)[valid], features(net, batch)[valid], rtol=1e-5, atol=1e-5)
        with torch.no_grad():
            ours_image = ours.forward_features(image)
            torch.testing.assert_close(ours_image.flatten(0, 1), features(ours, batch)[valid], rtol=1e-5, atol=1e-5)
            if not config.get("pos_embed_use_grid_sample"):
                torch.testing.assert_close(ours_image, net.forward_features(image), rtol=1e-5, atol=1e-5)


def patchify(image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from timm.data.naflex_transforms import patchify_image

    return patchify_image(image, (16, 16))


def permuted(batch: dict[str, torch.Tensor], row: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The batch with row ``row``'s valid tokens in a random order, their coordinates travelling with them."""
    n = int(batch["patch_valid"][row].sum())
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(3))
    out = {k: batch[k].clone() for k in KEYS}
    for k in ("patches", "patch_coord"):
        out[k][row, :n] = batch[k][row, perm]
    return out, perm


@pytest.mark.parametrize(
    ("name", "timm_follows"), [("learned grid_sample", True), ("learned", False), ("axial", False)]
)
def test_where_timms_naflexvit_reads_positions_from_token_order(name: str, timm_follows: bool) -> None:
    """Tokens permuted with their coordinates: the patched model's features permute with them; timm's do for
    its grid-sample table, not for its resized table or its RoPE (placed by token order)."""
    config, scheme = CONFIGS[name]
    net = timm_naflex(**config)
    ours = patched(net, scheme)
    batch, p = collated(), net.num_prefix_tokens
    shuffled, perm = permuted(batch, row=0)
    n = perm.numel()
    for model, follows in ((ours, True), (net, timm_follows)):
        expected = features(model, batch)[0, p : p + n][perm]
        got = features(model, shuffled)[0, p : p + n]
        if follows:
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        else:
            assert (got - expected).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["learned", "axial xy half + grid_sample table", "mixed"])
def test_a_plain_timm_naflexvit_checkpoint_loads_into_a_patched_model(name: str) -> None:
    """timm's own state dict (``embeds.pos_embed`` [1, H, W, C], ``rope.freqs``) goes into the inherited
    table and frequencies of a patched model built from other weights."""
    config, scheme = CONFIGS[name]
    net = timm_naflex(**config)
    other = timm_naflex(**config)
    with torch.no_grad():
        for param in other.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    ours = patched(other, scheme)
    ours.load_state_dict(net.state_dict())
    batch = collated()
    valid = valid_tokens(net, batch)
    torch.testing.assert_close(features(ours, batch)[valid], features(net, batch)[valid], rtol=1e-5, atol=1e-5)


def test_what_cannot_be_inherited_is_said() -> None:
    factorized = timm_naflex(pos_embed="factorized")
    with pytest.warns(PretrainedPositionsWarning, match="factorized table"):
        vispos.patch(copy.deepcopy(factorized), "learned2d")
    sampled = timm_naflex(pos_embed_use_grid_sample=True)
    with pytest.warns(PretrainedPositionsWarning, match="resample='resize'"):
        model = vispos.patch(copy.deepcopy(sampled), "learned2d", resample="resize")
    assert model.vispos_cfg["options"]["resample"] == "resize"
    preserving = timm_naflex(pos_embed_ar_preserving=True)
    with pytest.warns(PretrainedPositionsWarning, match="pos_embed_ar_preserving=True"):
        vispos.patch(copy.deepcopy(preserving), "learned2d")
    with pytest.warns(PretrainedPositionsWarning, match="RoPE .* is discarded"):
        vispos.patch(copy.deepcopy(timm_naflex(rope_type="axial")), "relbias2d")
    with warnings.catch_warnings():
        warnings.simplefilter("error", PretrainedPositionsWarning)
        vispos.patch(copy.deepcopy(timm_naflex(rope_type="axial")), "relbias2d", inherit=False)
