"""Ragged and packed batches: each image in a batch gives what it gives alone, for every 2D scheme.

The reference is the patched timm model itself, run on one image at its own size (``forward_features``).
The ragged path is a small forward of the same model's modules: each image's patch tokens with their
(y, x) cells, padded into rows (or packed several to a row with segment ids), positions from
``Positions.ragged_context`` / ``add_to_ragged``, the model's own blocks with that context. Some images
hold their tokens in a random order (their coordinates travel with them), so each test fails when the
coordinates are ignored: the negative controls give every token the position of its order among its
image's tokens, row-major, as NaFlexVit's RoPE does (``coords_from_order``)."""

from __future__ import annotations

import warnings

import pytest
import timm
import torch

import vispos
from vispos.timm.model import PREFIX_TOKENS

ONE_GRID = ("decomposed2d",)  # a query-dependent bias built for one grid: ragged batches are refused (tested below)
SCHEMES_2D = [*(s for s in vispos.list_encodings(2) if s not in ONE_GRID), ["learned2d", "relbias2d"]]
SIZES = [(24, 40), (40, 16), (48, 48), (24, 40), (16, 56)]  # px; 8 px patches: grids 3x5, 5x2, 6x6, 3x5, 2x7
SHUFFLED = (1, 3, 4)  # images whose tokens come in a random order
PACKED = [[0, 1, 4], [2, 3]]  # images packed in each row


def ids(scheme: str | list[str]) -> str:
    return scheme if isinstance(scheme, str) else "+".join(scheme)


def make(pos: str | list[str], *, prefix: bool, img_size: int = 48, **options: object) -> torch.nn.Module:
    """A 2-block ViT patched with ``pos`` (3 prefix tokens, or none to pack rows), its positional parameters
    and attention at a trained scale (the initialisations would hide a wrong position)."""
    torch.manual_seed(0)
    tokens = {"reg_tokens": 2} if prefix else {"class_token": False, "global_pool": "avg"}
    net = timm.create_model("vit_tiny_patch16_224", img_size=img_size, patch_size=8, embed_dim=64, num_heads=2,
                            depth=2, num_classes=0, **tokens)  # fmt: skip
    net = vispos.patch(net, pos, inherit=False, **options)
    with torch.no_grad():
        for param in net.vispos.parameters():
            param.normal_(std=0.5)
        for blk in net.blocks:  # sharper attention than at initialisation, so that positions show
            blk.attn.qkv.weight.mul_(4.0)
    return net.eval()


def images() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(3, h, w, generator=g) for h, w in SIZES]


def orders(net: torch.nn.Module) -> list[torch.Tensor]:
    """Each image's token order: row-major, or a random permutation for the images in SHUFFLED."""
    g = torch.Generator().manual_seed(2)
    counts = [(h // 8) * (w // 8) for h, w in SIZES]
    return [torch.randperm(n, generator=g) if i in SHUFFLED else torch.arange(n) for i, n in enumerate(counts)]


def patch_tokens(net: torch.nn.Module, image: torch.Tensor, order: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """One image -> its patch tokens [n, C] (no positions) and their (y, x) cells [n, 2], both in ``order``."""
    x = net.patch_embed(image[None])[0]  # [h, w, C]
    h, w, c = x.shape
    yy, xx = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    cells = torch.stack((yy.flatten(), xx.flatten()), dim=-1)
    return x.reshape(h * w, c)[order], cells[order]


def alone(net: torch.nn.Module, image: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """The patched model on one image at its own size: features [P + n, C], patch tokens in ``order``."""
    p = net.num_prefix_tokens
    out = net.forward_features(image[None])[0]
    return torch.cat((out[:p], out[p:][order]))


def ragged_features(
    net: torch.nn.Module,
    rows: list[list[int]],
    order: list[torch.Tensor],
    *,
    wrong_coords: bool = False,
    row_perm: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Images ``rows`` (one row per list; several images: packed with segment ids) through the model's blocks
    with a ragged context. -> features [B, P + N, C], the image of each patch token [B, N] (-1: padding),
    and each patch token's index in its image's order [B, N]. ``row_perm``: permute each row's patch
    tokens with their coordinates, segments and padding flags. Padding tokens hold random values."""
    xs = images()
    parts = [[patch_tokens(net, xs[i], order[i]) for i in row] for row in rows]
    n = max(sum(t.shape[0] for t, _ in row) for row in parts)
    b, c = len(rows), net.embed_dim
    tokens = torch.randn(b, n, c, generator=torch.Generator().manual_seed(4))
    coords = torch.full((b, n, 2), 99)  # padding cells are never read
    image, rank, segments = torch.full((b, n), -1), torch.zeros(b, n, dtype=torch.long), torch.zeros(b, n)
    sizes = torch.ones(b, max(map(len, rows)), 2, dtype=torch.long)
    for r, (row, row_parts) in enumerate(zip(rows, parts, strict=True)):
        at = 0
        for s, (i, (t, cells)) in enumerate(zip(row, row_parts, strict=True)):
            k = t.shape[0]
            tokens[r, at : at + k], coords[r, at : at + k] = t, cells
            image[r, at : at + k], rank[r, at : at + k], segments[r, at : at + k] = i, torch.arange(k), s
            sizes[r, s] = torch.tensor(SIZES[i]) // 8
            at += k
    if row_perm is not None:
        for r, perm in enumerate(row_perm):
            tokens[r], coords[r], image[r], rank[r], segments[r] = (
                t[r][perm] for t in (tokens, coords, image, rank, segments)
            )
    valid = image >= 0
    if wrong_coords:  # the k-th token of an image in its row at cell (k // W, k % W): positions from the order
        same = image[:, :, None] == image[:, None, :]  # [B, N, N]
        k = (same & torch.ones(n, n, dtype=torch.bool).tril(-1)).sum(-1)  # earlier tokens of the same image
        width = sizes[torch.arange(b)[:, None], segments.long(), 1]
        coords = torch.where(valid[..., None], torch.stack((k // width, k % width), dim=-1), coords)
    packed = max(map(len, rows)) > 1
    pos = net.vispos
    if packed:
        ctx = pos.ragged_context(coords, sizes, valid=valid, segments=segments.long())
    else:
        ctx = pos.ragged_context(coords, sizes[:, 0], valid=valid)
    x = pos.add_to_ragged(tokens, ctx)
    prefix = [t for t in (getattr(net, name, None) for name in PREFIX_TOKENS) if t is not None]
    if prefix:
        x = torch.cat((pos.add_to_prefix(torch.cat(prefix, dim=1).expand(b, -1, -1)), x), dim=1)
    x = net.norm_pre(x)
    for blk in net.blocks:
        x = blk(x, attn_mask=ctx)
    return net.norm(x), image, rank


def gap(net: torch.nn.Module, out: torch.Tensor, image: torch.Tensor, rank: torch.Tensor) -> float:
    """Largest difference between the ragged features and each image's own (prefix tokens included)."""
    xs, order, p, worst = images(), orders(net), net.num_prefix_tokens, 0.0
    if not hasattr(net, "alone_features"):  # each image's own features, computed once per model
        with torch.no_grad():
            net.alone_features = [alone(net, x, o) for x, o in zip(xs, order, strict=True)]
    with torch.no_grad():
        for i in range(len(SIZES)):
            rows, cols = (image == i).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            expected = net.alone_features[i]
            got = out[rows, cols + p][torch.argsort(rank[rows, cols])]
            worst = max(worst, (got - expected[p:]).abs().max().item())
            if p:
                worst = max(worst, (out[rows[0], :p] - expected[:p]).abs().max().item())
    return worst


def without_positions(scheme: str | list[str]) -> bool:
    return scheme == "nope"


@pytest.mark.parametrize("scheme", SCHEMES_2D, ids=ids)
def test_each_image_of_a_padded_ragged_batch_gives_its_output_alone(scheme: str | list[str]) -> None:
    net = make(scheme, prefix=True)
    with torch.no_grad():
        out, image, rank = ragged_features(net, [[i] for i in range(len(SIZES))], orders(net))
        assert out.isfinite().all()  # padding rows included
        assert gap(net, out, image, rank) <= 1e-5
        if not without_positions(scheme):  # negative control: positions from the token order
            out, image, rank = ragged_features(net, [[i] for i in range(len(SIZES))], orders(net), wrong_coords=True)
            assert gap(net, out, image, rank) > 1e-3


@pytest.mark.parametrize("scheme", SCHEMES_2D, ids=ids)
def test_each_image_packed_in_a_row_with_segment_ids_gives_its_output_alone(scheme: str | list[str]) -> None:
    net = make(scheme, prefix=False)
    with torch.no_grad():
        out, image, rank = ragged_features(net, PACKED, orders(net))
        assert gap(net, out, image, rank) <= 1e-5
        if not without_positions(scheme):
            out, image, rank = ragged_features(net, PACKED, orders(net), wrong_coords=True)
            assert gap(net, out, image, rank) > 1e-3


@pytest.mark.parametrize("scheme", SCHEMES_2D, ids=ids)
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_permuting_tokens_with_their_coordinates_permutes_the_outputs(scheme: str | list[str], packed: bool) -> None:
    net = make(scheme, prefix=not packed)
    rows = PACKED if packed else [[i] for i in range(len(SIZES))]
    p = net.num_prefix_tokens
    with torch.no_grad():
        out, _, _ = ragged_features(net, rows, orders(net))
        n = out.shape[1] - p
        g = torch.Generator().manual_seed(5)
        perms = [torch.randperm(n, generator=g) for _ in rows]  # padding moves too
        moved, _, _ = ragged_features(net, rows, orders(net), row_perm=perms)
        expected = torch.stack([torch.cat((o[:p], o[p:][perm])) for o, perm in zip(out, perms, strict=True)])
        valid = torch.ones(out.shape[:2], dtype=torch.bool)
        for r, row in enumerate(rows):  # compare tokens of images only (padding outputs are never read)
            valid[r, p + sum((SIZES[i][0] // 8) * (SIZES[i][1] // 8) for i in row) :] = False
        valid[:, p:] = valid[:, p:].gather(1, torch.stack(perms))
        torch.testing.assert_close(moved[valid], expected[valid], rtol=1e-5, atol=1e-5)
        if not without_positions(scheme):  # positions from the order: a permutation changes them
            wrong, _, _ = ragged_features(net, rows, orders(net), wrong_coords=True)
            wrong_moved, _, _ = ragged_features(net, rows, orders(net), wrong_coords=True, row_perm=perms)
            wrong_expected = torch.stack([torch.cat((o[:p], o[p:][q])) for o, q in zip(wrong, perms, strict=True)])
            assert (wrong_moved[valid] - wrong_expected[valid]).abs().max() > 1e-3


@pytest.mark.parametrize(
    ("scheme", "options"),
    [
        ("rope2d", {"coords": "normalized"}),
        ("rope2d", {"scaling": "yarn"}),
        ("rope2d", {"ref_grid": (4, 4)}),
        ("relbias2d", {"log_n": True}),
        ("rope2d_mixed", {"log_n": True}),
    ],
    ids=["normalized", "yarn", "ref_grid", "relbias2d-log_n", "mixed-log_n"],
)
def test_size_dependent_settings_use_each_images_own_size(scheme: str, options: dict[str, object]) -> None:
    """Normalised coordinates, scaling relative to the training grid, a reference grid and log-n attention
    scaling (folded into q per token) all read each image's own grid size. Trained on a 4 x 4 grid, so
    that some images are larger (scaling factors and log-n factors above 1) and some smaller."""
    options = dict(options)
    log_n = options.pop("log_n", False)
    net = make(scheme, prefix=True, img_size=32, **options)
    if log_n:
        vispos.configure(net, log_n_attention=True)
    with torch.no_grad():
        out, image, rank = ragged_features(net, [[i] for i in range(len(SIZES))], orders(net))
        assert gap(net, out, image, rank) <= 1e-5


def test_positions_of_a_ragged_batch_ignore_padding_contents_and_cells() -> None:
    """Padding tokens hold random values and out-of-grid cells (99, 99) in every test above; here the
    structure mask itself: a valid query sees its own image only, a padding query every valid key and itself."""
    net = make("nope", prefix=False)
    coords = torch.tensor([[[0, 0], [0, 1], [0, 0], [99, 99]]])
    segments, valid = torch.tensor([[0, 0, 1, 0]]), torch.tensor([[True, True, True, False]])
    ctx = net.vispos.ragged_context(coords, torch.tensor([[[1, 2], [1, 1]]]), valid=valid, segments=segments)
    allowed = ctx.layer(0)[1][0, 0].isfinite()
    expected = torch.tensor([[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(allowed, expected)


def test_sizes_default_to_the_bounding_box_of_each_images_cells() -> None:
    net = make("rope2d", prefix=True)
    coords = torch.tensor([[[0, 0], [2, 4], [1, 1]], [[0, 0], [4, 1], [0, 0]]])
    valid = torch.tensor([[True, True, True], [True, True, False]])
    given = net.vispos.ragged_context(coords, torch.tensor([[3, 5], [5, 2]]), valid=valid)
    derived = net.vispos.ragged_context(coords, valid=valid)
    assert derived.ragged.sizes == given.ragged.sizes == [(3, 5), (5, 2)]
    torch.testing.assert_close(derived.layer(0)[0].cos, given.layer(0)[0].cos, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"coords": torch.zeros(1, 2, 2, dtype=torch.bool)}, r"real tensor \[B, N, 2\]"),  # floats: points
        ({"coords": torch.zeros(1, 2, dtype=torch.long)}, r"real tensor \[B, N, 2\]"),
        ({"coords": torch.tensor([[[0, 5], [0, 0]]]), "sizes": torch.tensor([[2, 5]])}, "outside their image's grid"),
        ({"coords": torch.zeros(1, 2, 2, dtype=torch.long), "sizes": torch.tensor([2, 2])}, r"sizes .*\[1, 2\]"),
        ({"coords": torch.zeros(1, 2, 2, dtype=torch.long), "valid": torch.ones(1, 2)}, "valid must be a bool tensor"),
        ({"coords": torch.zeros(1, 2, 2, dtype=torch.long), "sizes": torch.tensor([[0, 3]])}, "must be positive"),
    ],
    ids=["bool", "shape", "outside", "sizes-shape", "valid-dtype", "empty-grid"],
)
def test_a_bad_ragged_batch_is_refused(kwargs: dict[str, object], message: str) -> None:
    net = make("rope2d", prefix=True)
    with pytest.raises(ValueError, match=message):
        net.vispos.ragged_context(**kwargs)


def test_packed_rows_refuse_prefix_tokens_and_bad_segment_ids() -> None:
    coords, sizes = torch.zeros(1, 2, 2, dtype=torch.long), torch.tensor([[[1, 1], [1, 1]]])
    with pytest.raises(ValueError, match="packed rows .* cannot hold prefix tokens"):
        make("rope2d", prefix=True).vispos.ragged_context(coords, sizes, segments=torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match=r"image ids in 0 \.\. 1"):
        make("rope2d", prefix=False).vispos.ragged_context(coords, sizes, segments=torch.tensor([[0, 2]]))


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
        torch.testing.assert_close(fresh(x), expected, rtol=0, atol=0)
        torch.testing.assert_close(pickle.loads(pickle.dumps(net))(x), expected, rtol=0, atol=0)


@pytest.mark.parametrize("scheme", vispos.list_encodings(2, kind="bias"))
@pytest.mark.parametrize("rows", [[[i] for i in range(len(SIZES))], PACKED], ids=["padded", "packed"])
def test_a_ragged_batch_attends_through_flex_attention_without_a_dense_mask(
    scheme: str, rows: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With FlexAttention configured, every layer of a ragged batch (padded with prefix tokens, or packed)
    attends through it: a score_mod computes each pair's offset index from the cells, a block mask hides
    padding and other images; the outputs equal the SDPA path's (log-n scaling on, per token), and neither
    the [B, T, T] offset index nor the dense structure mask is built."""
    from vispos.ragged import RaggedLayout

    packed = len(rows[0]) > 1
    sdpa_net, flex_net = make(scheme, prefix=not packed), make(scheme, prefix=not packed)
    vispos.configure(sdpa_net, log_n_attention=True)
    vispos.configure(flex_net, attention="flex", log_n_attention=True)
    with torch.no_grad():
        expected, image, _ = ragged_features(sdpa_net, rows, orders(sdpa_net))
    calls = {"flex": 0, "index": 0, "structure": 0}

    def spy(name: str, fn):  # noqa: ANN001, ANN202
        return lambda *a, **k: calls.__setitem__(name, calls[name] + 1) or fn(*a, **k)

    monkeypatch.setattr("vispos.timm.attention.flex_bias_attention", spy("flex", vispos.attention.flex_bias_attention))
    monkeypatch.setattr(RaggedLayout, "offset_index", spy("index", RaggedLayout.offset_index))
    monkeypatch.setattr(RaggedLayout, "structure_mask", spy("structure", RaggedLayout.structure_mask))
    with torch.no_grad():
        got = ragged_features(flex_net, rows, orders(flex_net))[0]
    p = flex_net.num_prefix_tokens
    valid = torch.cat((torch.ones(image.shape[0], p, dtype=torch.bool), image >= 0), dim=1)
    torch.testing.assert_close(got[valid], expected[valid], rtol=1e-5, atol=1e-5)
    assert calls == {"flex": len(flex_net.blocks), "index": 0, "structure": 0}


def test_ragged_flex_falls_back_to_sdpa_with_a_callers_mask_fractional_points_or_gradients() -> None:
    net = make("relbias2d", prefix=True)
    vispos.configure(net, attention="flex")
    coords, valid = torch.zeros(1, 2, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.bool)
    sizes = torch.tensor([[1, 1]])
    assert net.vispos.ragged_context(coords, sizes, valid=valid).flex(0) is not None
    mask = torch.ones(1, 1, 5, 5, dtype=torch.bool)
    assert net.vispos.ragged_context(coords, sizes, valid=valid, user_mask=mask).flex(0) is None
    cpb = make("cpb2d", prefix=False)
    vispos.configure(cpb, attention="flex")
    points = torch.tensor([[[0.5, 0.0], [1.0, 0.25]]])
    assert cpb.vispos.ragged_context(points, torch.tensor([[2, 2]])).flex(0) is None
    # a CPU training step (FlexAttention has no CPU backward) runs SDPA, the same as without flex
    reference = make("relbias2d", prefix=True)
    rows = [[i] for i in range(len(SIZES))]
    got = ragged_features(net.train(), rows, orders(net))[0]
    expected = ragged_features(reference.train(), rows, orders(reference))[0]
    torch.testing.assert_close(got, expected, rtol=0, atol=0)



def test_vispos_patch_takes_a_naflexvit() -> None:
    """``vispos.patch`` hands a NaFlexVit to its host; what it inherits is in tests/test_naflex.py."""
    net = timm.create_model("naflexvit_base_patch16_gap", img_size=64, embed_dim=64, num_heads=2, depth=2,
                            num_classes=3)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = vispos.patch(net, "rope2d")
    assert type(model).__name__ == "PatchedNaFlexVit" and model.vispos.settings["pos"] == ["rope2d"]
    assert model.embeds.pos_embed is None and model.rope is None


def test_dinov3_coordinate_augmentation_is_drawn_per_image_in_a_ragged_batch() -> None:
    """Training mode with DINOv3's shift: two images of the same size in one batch get draws of their own
    (their rotations differ, as they would alone), and each draw is one for all the image's tokens: the
    logits among an image's tokens are those without augmentation (a common shift cancels in RoPE)."""
    net = make("rope2d", prefix=False, shift_coords=2.0)
    grid = (3, 5)
    cells = torch.cartesian_prod(torch.arange(3), torch.arange(5)).expand(2, -1, -1)  # two 3 x 5 images
    sizes = torch.tensor([grid, grid])
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 2, 15, 32, generator=g), torch.randn(2, 2, 15, 32, generator=g)

    def logits(training: bool) -> tuple[torch.Tensor, torch.Tensor]:
        net.vispos.train(training)
        rotary = net.vispos.ragged_context(cells, sizes).layer(0)[0]
        rq, rk = rotary.rotate(q, k)
        return rotary.cos, rq @ rk.transpose(-2, -1)

    cos, augmented = logits(True)
    assert (cos[0] - cos[1]).abs().max() > 1e-2  # one draw per image, not per size
    _, plain = logits(False)
    torch.testing.assert_close(augmented, plain, rtol=1e-4, atol=1e-4)
