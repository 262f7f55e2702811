"""The reference of the test_ragged_* files: each image in a ragged or packed batch gives what it gives alone.

The reference is the patched timm model itself, run on one image at its own size (``forward_features``).
The ragged path is a small forward of the same model's modules: each image's patch tokens with their
(y, x) cells, padded into rows (or packed several to a row with segment ids), positions from
``Positions.ragged_context`` / ``add_to_ragged``, the model's own blocks with that context. Some images
hold their tokens in a random order (their coordinates travel with them), so each test fails when the
coordinates are ignored: the negative controls give every token the position of its order among its
image's tokens, row-major, as NaFlexVit's RoPE does (``coords_from_order``)."""

from __future__ import annotations

import timm
import torch

import vispos
from vispos.timm.model import PREFIX_TOKENS

ONE_GRID = tuple(vispos.list_encodings(2, kind="query_bias"))  # built for one grid: ragged batches refused
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
