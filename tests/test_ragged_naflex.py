"""timm's NaFlexVit as a patched host of ragged batches, fed by timm's own NaFlex patchify transform and
collator: each image its output alone, patch_coord read, patch dropout, pickling, ``vispos.patch``."""

from __future__ import annotations

import warnings

import pytest
import timm
import torch
from ragged_refs import (
    SCHEMES_2D,
    ids,
)

import vispos

# --- timm's NaFlexVit as a patched host, fed by timm's own NaFlex patchify transform and collator -----------
NAFLEX_SIZES = [(48, 80), (96, 32), (64, 64)]  # px; 16 px patches
NAFLEX_KEYS = ("patches", "patch_coord", "patch_valid")


def make_naflex(pos: str | list[str]) -> torch.nn.Module:
    from vispos.timm.naflex import patch_naflex

    torch.manual_seed(0)
    net = timm.create_model("naflexvit_base_patch16_gap", img_size=64, embed_dim=64, num_heads=2, depth=2,
                            num_classes=0)  # fmt: skip
    net = patch_naflex(net, pos)
    with torch.no_grad():
        for param in net.vispos.parameters():
            param.normal_(std=0.5)
        for name, param in net.named_parameters():
            if name.endswith("gamma"):  # layer scales at 1 (timm's 1e-5 would hide attention)
                param.fill_(1.0)
            if name.endswith("attn.qkv.weight"):
                param.mul_(4.0)
    return net.eval()


def naflex_samples() -> tuple[list[torch.Tensor], list[tuple[dict[str, torch.Tensor], int]]]:
    from timm.data.naflex_transforms import patchify_image

    g = torch.Generator().manual_seed(6)
    images = [torch.randn(3, h, w, generator=g) for h, w in NAFLEX_SIZES]
    samples = []
    for image in images:
        patches, coord, valid = patchify_image(image, (16, 16))
        samples.append(({"patches": patches, "patch_coord": coord, "patch_valid": valid}, 0))
    return images, samples


def naflex_features(net: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return net.forward_features(batch["patches"], batch["patch_coord"], batch["patch_valid"])["patches"]


@pytest.mark.parametrize("scheme", SCHEMES_2D, ids=ids)
def test_naflexvit_gives_each_image_of_a_collated_batch_its_output_alone(scheme: str | list[str]) -> None:
    """A ragged batch from timm's NaFlex collator: per image, the features of that image collated alone and
    of the image itself ([1, C, H, W] input), for every scheme; the model's forward (masked pooling) runs."""
    from timm.data.naflex_dataset import NaFlexCollator

    net, (images, samples) = make_naflex(scheme), naflex_samples()
    p = net.num_prefix_tokens
    with torch.no_grad():
        batch, _ = NaFlexCollator()(samples)
        out = naflex_features(net, batch)
        for i, sample in enumerate(samples):
            one, _ = NaFlexCollator()([sample])
            n = p + int(one["patch_valid"].sum())
            alone = naflex_features(net, one)[0, :n]
            torch.testing.assert_close(out[i, :n], alone, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(net.forward_features(images[i][None])[0], alone, rtol=1e-5, atol=1e-5)
        assert net(batch).shape == (len(samples), 64)


@pytest.mark.parametrize("scheme", ["rope2d", "relbias2d", "learned2d"])
def test_naflexvit_reads_patch_coord(scheme: str) -> None:
    """Permuting the patches with their coordinates permutes the features; permuting the patches alone (their
    coordinates left in place, positions from the row order) does not."""
    from timm.data.naflex_dataset import NaFlexCollator

    net, (_, samples) = make_naflex(scheme), naflex_samples()
    p = net.num_prefix_tokens
    with torch.no_grad():
        batch, _ = NaFlexCollator()(samples[:1])
        n = int(batch["patch_valid"].sum())
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(7))
        out = naflex_features(net, batch)[0, p : p + n]
        both = {k: batch[k].clone() for k in NAFLEX_KEYS}
        both["patches"][0, :n], both["patch_coord"][0, :n] = batch["patches"][0, perm], batch["patch_coord"][0, perm]
        torch.testing.assert_close(naflex_features(net, both)[0, p : p + n], out[perm], rtol=1e-5, atol=1e-5)
        alone = {k: batch[k].clone() for k in NAFLEX_KEYS}
        alone["patches"][0, :n] = batch["patches"][0, perm]
        assert (naflex_features(net, alone)[0, p : p + n] - out[perm]).abs().max() > 1e-3


def test_naflexvit_patch_dropout_keeps_each_tokens_coordinates() -> None:
    """Training with timm's patch dropout: the kept tokens' features equal those of the same model in eval
    mode on the kept tokens alone, handed over as a NaFlex batch with their coordinates."""
    from timm.data.naflex_dataset import NaFlexCollator

    from vispos.timm.naflex import patch_naflex

    torch.manual_seed(0)
    net = timm.create_model("naflexvit_base_patch16_gap", img_size=64, embed_dim=64, num_heads=2, depth=2,
                            num_classes=0, patch_drop_rate=0.5)  # fmt: skip
    net = patch_naflex(net, "rope2d")
    with torch.no_grad():
        for name, param in net.named_parameters():
            if name.endswith("gamma"):
                param.fill_(1.0)
            if name.endswith("attn.qkv.weight"):
                param.mul_(4.0)
    batch, _ = NaFlexCollator(max_seq_len=16)(naflex_samples()[1][:1])  # 15 patches of a 3 x 5 grid, 1 padding
    p, length = net.num_prefix_tokens, batch["patch_valid"].shape[1]
    with torch.no_grad():
        torch.manual_seed(8)
        dropped = naflex_features(net.train(), batch)
        torch.manual_seed(8)  # the indices timm's patch dropout drew
        keep = torch.argsort(torch.randn(1, length), dim=-1)[:, : dropped.shape[1] - p]
        subset = {k: batch[k][:, keep[0]] for k in NAFLEX_KEYS}
        expected = naflex_features(net.eval(), subset)
        valid = torch.cat((torch.ones(p, dtype=torch.bool), subset["patch_valid"][0]))
        assert dropped.shape[1] == p + 8 and valid.sum() > p + 4
        torch.testing.assert_close(dropped[0, valid], expected[0, valid], rtol=1e-5, atol=1e-5)


def test_a_patched_naflexvit_pickles_and_its_weights_load_into_a_fresh_one() -> None:
    import pickle

    net = make_naflex(["learned2d", "relbias2d"])
    fresh = make_naflex(["learned2d", "relbias2d"])
    with torch.no_grad():
        for param in fresh.vispos.parameters():
            param.zero_()
    fresh.load_state_dict(net.state_dict())
    x = naflex_samples()[0][0][None]
    with torch.no_grad():
        expected = net(x)
        torch.testing.assert_close(fresh(x), expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(pickle.loads(pickle.dumps(net))(x), expected, rtol=0, atol=0)


def test_vispos_patch_takes_a_naflexvit() -> None:
    """``vispos.patch`` hands a NaFlexVit to its host; what it inherits is in tests/test_naflex.py."""
    net = timm.create_model("naflexvit_base_patch16_gap", img_size=64, embed_dim=64, num_heads=2, depth=2,
                            num_classes=3)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = vispos.patch(net, "rope2d")
    assert type(model).__name__ == "PatchedNaFlexVit" and model.vispos.settings["pos"] == ["rope2d"]
    assert model.embeds.pos_embed is None and model.rope is None
