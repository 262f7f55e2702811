"""A patched NaFlexVit gives each token the position of its cell in its image's true grid, also when a row holds
a subset of the image's cells: timm's patch dropout (the grid is taken before tokens are dropped) and a subset
handed over as a NaFlex batch with its ``grid_sizes``. Checked with schemes that read the grid: comrope2d's
defaults and rope2d with normalised coordinates (the coordinate frame), learned2d (the table resampled to the
grid) and log-n attention scaling (N = H x W). The kept cells' bounding box is smaller than the grid in every
case here, and a control shows that it gives other outputs.

The log-n rule on subsets, pinned here for dense and ragged contexts: N counts the H x W cells of the image's
grid, not the tokens a row holds, so that a token's scale, like its position, depends on its image alone."""

from __future__ import annotations

import math

import pytest
import timm
import torch

import vispos
from vispos.timm.naflex import patch_naflex

SCHEMES: dict[str, tuple[str, dict[str, object], bool]] = {  # name -> (scheme, options, log-n)
    "comrope2d defaults": ("comrope2d", {}, False),
    "rope2d normalized": ("rope2d", {"coords": "normalized"}, False),
    "learned2d resampled": ("learned2d", {}, False),
    "rope2d + log-n": ("rope2d", {}, True),
}
KEYS = ("patches", "patch_coord", "patch_valid")


def naflex(scheme: str, options: dict[str, object], log_n: bool, **config: object) -> torch.nn.Module:
    """A small NaFlexVit trained at 4 x 4 (64 px), patched, with randomised positional parameters."""
    torch.manual_seed(0)
    net = timm.create_model("naflexvit_base_patch16_gap", img_size=64, pos_embed_grid_size=(4, 4), embed_dim=64,
                            num_heads=2, depth=2, num_classes=0, **config)  # fmt: skip
    net = patch_naflex(net, scheme, inherit=False, **options)
    with torch.no_grad():
        for param in net.vispos.parameters():
            param.normal_(std=0.5)
        for name, param in net.named_parameters():
            if name.endswith("gamma"):  # layer scales at 1 (timm's 1e-5 would hide attention)
                param.fill_(1.0)
            if name.endswith("attn.qkv.weight"):
                param.mul_(4.0)
    if log_n:
        vispos.configure(net, log_n_attention=True)
    return net.eval()


def image_sample(h: int = 64, w: int = 80) -> dict[str, torch.Tensor]:
    """One image as timm's NaFlex transform patchifies it (16 px patches: 4 x 5 cells, row-major), batch of 1."""
    from timm.data.naflex_transforms import patchify_image

    image = torch.randn(3, h, w, generator=torch.Generator().manual_seed(3))
    return {k: v[None] for k, v in zip(KEYS, patchify_image(image, (16, 16)), strict=True)}


def subset(sample: dict[str, torch.Tensor], keep: torch.Tensor) -> dict[str, torch.Tensor]:
    return {k: v[:, keep] for k, v in sample.items()}


def bounding_box(coords: torch.Tensor) -> tuple[int, int]:
    return tuple((coords.amax(dim=0) + 1).tolist())


def dense_subset_features(net: torch.nn.Module, batch: dict[str, torch.Tensor], grid: tuple[int, int],
                          keep: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """The reference: the kept tokens through the blocks with the dense context of the whole grid and ``keep``
    (``Positions.context``), which knows nothing of NaFlex's coordinates."""
    x, _ = net.embeds(batch["patches"], patch_coord=batch["patch_coord"], patch_valid=batch["patch_valid"])
    p, pos = net.num_prefix_tokens, net.vispos
    ctx = pos.context(grid, x.device, keep=keep[None])
    patches = x[:, p:]
    if pos.additive is not None:
        patches = patches + pos.additive(grid, x.device)[keep]
    x = net.norm_pre(torch.cat((pos.add_to_prefix(x[:, :p]), patches), dim=1))
    for blk in net.blocks:
        x = blk(x, attn_mask=ctx)
    return net.norm(x)


@pytest.mark.parametrize("name", SCHEMES)
def test_a_subset_with_its_grid_sizes_gets_the_positions_of_its_full_grid(name: str) -> None:
    """The issue's case: a 4 x 5 image without its last row (and column) handed over as a NaFlex batch. With
    ``grid_sizes`` its tokens get what the dense subset of the 4 x 5 grid gets; without, the 3 x 4 bounding box
    moves them (the control)."""
    net = naflex(*SCHEMES[name])
    sample = image_sample()
    cells = sample["patch_coord"][0]
    keep = torch.nonzero((cells[:, 0] < 3) & (cells[:, 1] < 4))[:, 0]  # 12 of the 20 cells
    part = subset(sample, keep)
    assert bounding_box(part["patch_coord"][0]) == (3, 4)
    with torch.no_grad():
        expected = dense_subset_features(net, part, (4, 5), keep)
        given = net.forward_features(*(part[k] for k in KEYS), grid_sizes=torch.tensor([[4, 5]]))["patches"]
        torch.testing.assert_close(given, expected, rtol=1e-5, atol=1e-5)
        boxed = net.forward_features(*(part[k] for k in KEYS))["patches"]
    assert (boxed - expected).abs().max() > 1e-3


@pytest.mark.parametrize("name", SCHEMES)
def test_patch_dropout_takes_the_grid_before_dropping(name: str) -> None:
    """Training with timm's patch dropout: the kept tokens' features equal the eval-mode features of the same
    tokens handed over with their image's grid; under the kept tokens' bounding box they would not."""
    scheme, options, log_n = SCHEMES[name]
    net = naflex(scheme, options, log_n, patch_drop_rate=0.5)
    sample = image_sample()
    drawn: list[torch.Tensor] = []
    net.patch_drop.register_forward_hook(lambda module, args, out: drawn.append(out[1]))
    p = net.num_prefix_tokens
    with torch.no_grad():
        torch.manual_seed(2)  # a draw that keeps no cell of the last column
        dropped = net.train().forward_features(*(sample[k] for k in KEYS))["patches"]
        keep = drawn[0][0]  # [K]: the cells timm's patch dropout kept, in the row's order
        part = subset(sample, keep)
        assert len(keep) == 10 and bounding_box(part["patch_coord"][0]) != (4, 5)
        net.eval()
        expected = net.forward_features(*(part[k] for k in KEYS), grid_sizes=torch.tensor([[4, 5]]))["patches"]
        torch.testing.assert_close(dropped, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(expected, dense_subset_features(net, part, (4, 5), keep), rtol=1e-5, atol=1e-5)
        boxed = net.forward_features(*(part[k] for k in KEYS))["patches"]
    assert dropped.shape[1] == p + 10 and (boxed - dropped).abs().max() > 1e-3


def test_grid_sizes_in_the_input_dict_and_as_a_keyword_of_forward() -> None:
    """``model(batch)`` reads ``batch["grid_sizes"]`` (the collator's dict, extended), ``forward`` takes it as a
    keyword; both give the features' pooled logits, and a padded batch of two images gives each its own."""
    net = naflex("comrope2d", {}, False)
    sample = image_sample()
    keep = torch.arange(10)  # the first two rows of the 4 x 5 grid
    part = subset(sample, keep)
    sizes = torch.tensor([[4, 5]])
    with torch.no_grad():
        features = net.forward_features(*(part[k] for k in KEYS), grid_sizes=sizes)
        expected = net.forward_head(**features)
        torch.testing.assert_close(net({**part, "grid_sizes": sizes}), expected, rtol=0, atol=0)
        torch.testing.assert_close(net(*(part[k] for k in KEYS), grid_sizes=sizes), expected, rtol=0, atol=0)
        assert (net(part) - expected).abs().max() > 1e-3  # the 2 x 5 bounding box
        both = {k: torch.cat((part[k], sample[k][:, :10])) for k in KEYS}  # and a full 2 x 5 image
        out = net({**both, "grid_sizes": torch.tensor([[4, 5], [2, 5]])})
        torch.testing.assert_close(out[:1], expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out[1:], net(subset(sample, keep)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("sizes", "match"),
    [
        (torch.tensor([[4.0, 5.0]]), r"grid_sizes must be an integer tensor \[B, 2\] = \[1, 2\]"),
        (torch.tensor([4, 5]), r"grid_sizes must be an integer tensor \[B, 2\] = \[1, 2\].*\[2\]"),
        ([[4, 5]], r"grid_sizes must be an integer tensor .*got \[\[4, 5\]\]"),
        (torch.tensor([[0, 5]]), r"grid_sizes must be positive \(H, W\), got \[\[0, 5\]\]"),
        (torch.tensor([[4, 3]]), r"coords hold points outside their image's grid"),  # cells reach x = 4
    ],
)
def test_bad_grid_sizes_name_what_is_accepted(sizes: object, match: str) -> None:
    net = naflex("rope2d", {}, False)
    sample = image_sample()
    with pytest.raises(ValueError, match=match), torch.no_grad():
        net.forward_features(*(sample[k] for k in KEYS), grid_sizes=sizes)


def test_grid_sizes_with_images_is_refused() -> None:
    net = naflex("rope2d", {}, False)
    with pytest.raises(ValueError, match=r"grid_sizes gives each image's grid in a NaFlex batch"), torch.no_grad():
        net(torch.randn(1, 3, 64, 80), grid_sizes=torch.tensor([[4, 5]]))


# --- log-n on subsets: N = H x W of the image's grid ----------------------------------------------------
def log_n_vit() -> torch.nn.Module:
    torch.manual_seed(0)
    model = vispos.patch(timm.create_model("vit_tiny_patch16_224", img_size=64, depth=1, num_classes=0), "rope2d")
    return vispos.configure(model, log_n_attention=True).eval()  # trained at 4 x 4: N_train = 16


def test_log_n_of_a_token_subset_counts_the_cells_of_its_grid() -> None:
    """Three kept cells of an 8 x 8 grid: the logits are scaled by ln 64 / ln 16 = 1.5, as on the whole grid (a
    count of the kept tokens, ln 3 / ln 16 < 1, would leave them unscaled)."""
    pos = log_n_vit().vispos
    keep = torch.tensor([[0, 9, 63]])
    assert pos.context((8, 8), torch.device("cpu"), keep=keep).logit_scale == pytest.approx(1.5, rel=1e-6)
    assert pos.context((8, 8), torch.device("cpu")).logit_scale == pytest.approx(1.5, rel=1e-6)


def test_log_n_of_a_ragged_subset_counts_the_cells_of_each_images_grid() -> None:
    """A padded ragged batch: three cells of an 8 x 8 image beside a whole 2 x 8 image (16 cells, the training
    count): every token of the first is scaled by ln 64 / ln 16 = 1.5, prefix tokens included, the second's by 1;
    the same three cells under their 3 x 8 bounding box (no ``sizes``) by ln 24 / ln 16."""
    pos = log_n_vit().vispos
    p = pos.num_prefix_tokens
    first = torch.tensor([[0, 0], [1, 1], [2, 7]] + [[0, 0]] * 13)
    second = torch.cartesian_prod(torch.arange(2), torch.arange(8))
    coords = torch.stack((first, second))  # [2, 16, 2]
    valid = torch.arange(16)[None] < torch.tensor([[3], [16]])
    scale = pos.ragged_context(coords, torch.tensor([[8, 8], [2, 8]]), valid=valid).query_scale[:, 0, :, 0]
    torch.testing.assert_close(scale[0, : p + 3], torch.full((p + 3,), 1.5), rtol=1e-6, atol=0)
    torch.testing.assert_close(scale[1], torch.ones(p + 16), rtol=0, atol=0)
    boxed = pos.ragged_context(coords, valid=valid).query_scale[0, 0, : p + 3, 0]
    torch.testing.assert_close(boxed, torch.full((p + 3,), math.log(24) / math.log(16)), rtol=1e-6, atol=0)


def test_float_patch_coord_is_refused_naming_patch_coord() -> None:
    """NaFlexVit places patches at integer cells: a float patch_coord is refused by its own name (the message
    does not blame ``sizes``, which the caller never passed)."""
    net, sample = naflex("rope2d", {}, False), image_sample()
    net.forward_features(**sample)  # integer cells: accepted
    with pytest.raises(ValueError, match="patch_coord must be integer"):
        net.forward_features(sample["patches"], patch_coord=sample["patch_coord"].float(),
                             patch_valid=sample["patch_valid"])  # fmt: skip
