"""Fractional coordinates: a token at a point between grid cells (a merged token at the mean of its cells).

``Positions.ragged_context`` takes coordinates of a floating dtype as points in patch units and evaluates
each scheme at each token's point. The tests prove that this path is the gather path where both apply
(whole-number points), that it keeps the ragged invariant (each image as alone, permutations), that it
reads the fraction (negative control: the points floored to cells), that each scheme's value at a point is
its formula there (independent references: the papers' formulas, a linear table, RoPE's own linear
scaling), that relative schemes stay relative at fractional offsets while absolute ones do not, and that
the schemes defined at cells only (relbias2d, peg2d) refuse fractional points with a clear error."""

from __future__ import annotations

import math

import pytest
import timm
import torch

import vispos
from vispos.encodings.rope2d import Rope2d
from vispos.timm.model import PREFIX_TOKENS

ONE_GRID = tuple(vispos.list_encodings(2, kind="query_bias"))  # refuse ragged batches, and so points
SCHEMES_2D = [*(s for s in vispos.list_encodings(2) if s not in ONE_GRID), ["learned2d", "relbias2d"]]
CELLS_ONLY = ["relbias2d", "peg2d", "fire2d"]
AT_POINTS = [s for s in vispos.list_encodings(2) if s not in ("nope", *CELLS_ONLY, *ONE_GRID)]
GRIDS = [(3, 5), (4, 3)]  # the two images of a batch


def ids(scheme: str | list[str]) -> str:
    return scheme if isinstance(scheme, str) else "+".join(scheme)


def make(pos: str | list[str], *, prefix: bool = True, **options: object) -> torch.nn.Module:
    """A 2-block ViT patched with ``pos`` (2 register + 1 class token, or none), positional parameters and
    attention at a trained scale (the initialisations would hide a wrong position)."""
    torch.manual_seed(0)
    tokens = {"reg_tokens": 2} if prefix else {"class_token": False, "global_pool": "avg"}
    net = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=64, num_heads=2, depth=2,
                            num_classes=0, **tokens)  # fmt: skip
    net = vispos.patch(net, pos, inherit=False, **options)
    with torch.no_grad():
        for param in net.vispos.parameters():
            param.normal_(std=0.5)
        for blk in net.blocks:
            blk.attn.qkv.weight.mul_(4.0)
    return net.eval()


def cells(grid: tuple[int, int]) -> torch.Tensor:
    return torch.cartesian_prod(torch.arange(grid[0]), torch.arange(grid[1]))


def merged(grid: tuple[int, int], seed: int) -> torch.Tensor:
    """Points of a token-merged image: each cell moved towards a random neighbour by a random fraction, so
    every point is fractional and inside the grid; in a random order."""
    g = torch.Generator().manual_seed(seed)
    at = cells(grid).float()
    step = torch.rand(at.shape, generator=g) * 0.8 + 0.1
    sign = torch.where(at < torch.tensor(grid) - 1, 1.0, -1.0)  # towards the inside
    return (at + sign * step)[torch.randperm(at.shape[0], generator=g)]


def run(
    net: torch.nn.Module,
    rows: list[list[tuple[torch.Tensor, torch.Tensor, tuple[int, int]]]],
) -> list[list[torch.Tensor]]:
    """Rows of images (tokens [n, C], coords [n, 2], grid) -> each image's output tokens [P + n, C] (one image
    per row: padded, prefix tokens first; several: packed with segment ids)."""
    b, c, p = len(rows), net.embed_dim, net.num_prefix_tokens
    n = max(sum(t.shape[0] for t, _, _ in row) for row in rows)
    packed = max(map(len, rows)) > 1
    floating = rows[0][0][1].is_floating_point()
    tokens = torch.randn(b, n, c, generator=torch.Generator().manual_seed(9))  # padding: random values
    coords = torch.full((b, n, 2), 0.0 if floating else 0, dtype=rows[0][0][1].dtype)
    segments = torch.zeros(b, n, dtype=torch.long)
    valid = torch.zeros(b, n, dtype=torch.bool)
    sizes = torch.ones(b, max(map(len, rows)), 2, dtype=torch.long)
    spans = []
    for r, row in enumerate(rows):
        at, here = 0, []
        for s, (t, xy, grid) in enumerate(row):
            k = t.shape[0]
            tokens[r, at : at + k], coords[r, at : at + k], segments[r, at : at + k] = t, xy, s
            valid[r, at : at + k], sizes[r, s] = True, torch.tensor(grid)
            here.append((at, k))
            at += k
        spans.append(here)
    pos = net.vispos
    if packed:
        ctx = pos.ragged_context(coords, sizes, valid=valid, segments=segments)
    else:
        ctx = pos.ragged_context(coords, sizes[:, 0], valid=valid)
    x = pos.add_to_ragged(tokens, ctx)
    prefix = [t for t in (getattr(net, name, None) for name in PREFIX_TOKENS) if t is not None]
    if prefix:
        x = torch.cat((pos.add_to_prefix(torch.cat(prefix, dim=1).expand(b, -1, -1)), x), dim=1)
    with torch.no_grad():
        x = net.norm_pre(x)
        for blk in net.blocks:
            x = blk(x, attn_mask=ctx)
        x = net.norm(x)
    return [[torch.cat((x[r, :p], x[r, p + a : p + a + k])) for a, k in row] for r, row in enumerate(spans)]


def images(net: torch.nn.Module, points: bool) -> list[tuple[torch.Tensor, torch.Tensor, tuple[int, int]]]:
    """The two test images: random tokens, their coordinates (merged points, or shuffled integer cells)."""
    g = torch.Generator().manual_seed(3)
    out = []
    for i, grid in enumerate(GRIDS):
        at = merged(grid, seed=i) if points else cells(grid)[torch.randperm(grid[0] * grid[1], generator=g)]
        out.append((torch.randn(at.shape[0], net.embed_dim, generator=g), at, grid))
    return out


@pytest.mark.parametrize("pos", SCHEMES_2D, ids=ids)
def test_whole_number_points_equal_integer_cells(pos: str | list[str]) -> None:
    """Floating coordinates at whole numbers take the per-point path (or, for relbias2d and peg2d, become
    cells); either way the outputs are those of the integer cells, which tests/test_ragged_alone.py proves equal
    to each image run alone."""
    net = make(pos)
    ints = images(net, points=False)
    floats = [(t, xy.float(), grid) for t, xy, grid in ints]
    for got, expected in zip(run(net, [floats[:1], floats[1:]]), run(net, [ints[:1], ints[1:]]), strict=True):
        torch.testing.assert_close(got[0], expected[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("pos", AT_POINTS, ids=ids)
def test_fractional_points_in_a_batch_give_each_image_what_it_gives_alone(pos: str) -> None:
    """Padded rows and one packed row of merged images equal each image alone; permuting a row's tokens with
    their points permutes the outputs; flooring the points to cells (the fraction ignored) changes them."""
    net = make(pos, prefix=False)
    pair = images(net, points=True)
    alone = [run(net, [[image]])[0][0] for image in pair]
    padded = [row[0] for row in run(net, [pair[:1], pair[1:]])]
    packed = run(net, [pair])[0]
    for got in (padded, packed):
        for out, expected in zip(got, alone, strict=True):
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    perm = torch.randperm(pair[0][0].shape[0], generator=torch.Generator().manual_seed(5))
    t, xy, grid = pair[0]
    shuffled = run(net, [[(t[perm], xy[perm], grid)]])[0][0]
    torch.testing.assert_close(shuffled, alone[0][perm], rtol=1e-5, atol=1e-5)
    floored = run(net, [[(t, xy.floor(), grid)]])[0][0]
    assert (floored - alone[0]).abs().max() > 1e-3


RELATIVE = ["rope2d", "rope2d_mixed", "rope2d_golden", "string2d", "alibi2d", "cpb2d", ("comrope2d", "pixel"),
            "irpe2d_bias", "lookhere2d", "pape2d"]
ABSOLUTE = ["sincos2d", "learned2d", ("learned2d", "grid_sample"), ("liere2d", "pixel")]


def scheme_options(entry: str | tuple[str, str]) -> tuple[str, dict[str, object]]:
    if isinstance(entry, str):
        return entry, {}
    name, value = entry
    return name, {"resample": value} if name == "learned2d" else {"coords": value}


@pytest.mark.parametrize("entry", RELATIVE + ABSOLUTE, ids=lambda e: e if isinstance(e, str) else "-".join(e))
def test_relative_schemes_stay_relative_at_fractional_offsets(entry: str | tuple[str, str]) -> None:
    """Moving every point of an image by (0.3, 0.55) keeps each relative scheme's outputs (its scores
    depend on the offsets only) and changes each absolute scheme's (LieRE is not relative either)."""
    name, options = scheme_options(entry)
    net = make(name, prefix=False, **options)
    t, xy, grid = images(net, points=True)[1]
    inside = xy.clamp(max=torch.tensor(grid) - 1.0 - 0.55)  # so that the moved points stay inside the grid
    before = run(net, [[(t, inside, grid)]])[0][0]
    after = run(net, [[(t, inside + torch.tensor([0.3, 0.55]), grid)]])[0][0]
    gap = (after - before).abs().max()
    if entry in RELATIVE:
        assert gap <= 1e-5
    else:
        assert gap > 1e-3


def test_rope2d_at_half_cells_equals_its_linear_scaling_at_twice_the_grid() -> None:
    """Position interpolation by 2 turns cell y by the angle of y / 2: rope2d at the points (y / 2, x / 2)
    of a 3 x 4 image is rope2d with linear scaling at the 6 x 8 grid (vispos's scaling, tested against
    the papers' formulas in tests/test_rope_scaling_formulas.py)."""
    plain = Rope2d(dim=32, theta=100.0)
    scaled = Rope2d(dim=32, theta=100.0, scaling="linear", train_grid=(3, 4))
    expected = scaled((6, 8))
    got = plain((3, 4), cells=cells((6, 8)).float() / 2)
    torch.testing.assert_close(got.cos, expected.cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(got.sin, expected.sin, rtol=0, atol=1e-6)


def test_rope2d_normalized_coordinates_at_points_follow_dinov3s_formula() -> None:
    """DINOv3's frame at a point: ((y + 0.5) / H * 2 - 1) * 2 pi per period, as at a cell centre."""
    module = Rope2d(dim=16, coords="normalized", axes="yx", min_period=1.0, max_period=10.0)
    points = torch.tensor([[0.25, 1.5], [2.75, 0.1]])
    h, w = 3, 4
    periods = 1.0 * 10.0 ** torch.linspace(0, 1, 4)
    y = ((points[:, 0] + 0.5) / h * 2 - 1) * 2 * math.pi
    x = ((points[:, 1] + 0.5) / w * 2 - 1) * 2 * math.pi
    angles = torch.cat((y[:, None] / periods, x[:, None] / periods), dim=-1)  # half layout: pairs (j, j + d/2)
    got = module((h, w), cells=points)
    torch.testing.assert_close(got.cos, torch.cat((angles, angles), -1).cos(), rtol=0, atol=1e-5)


def test_sincos2d_at_points_is_the_formula() -> None:
    """[sin(x w_i), cos(x w_i) ... | the same for y], w_i = 10000 ** (-2i / (d / 2)), at fractional points."""
    module = vispos.create_encoding("sincos2d", dim=16)
    points = torch.tensor([[0.5, 2.25], [3.7, 0.1]])
    inv = 1e4 ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8)

    def one(v: torch.Tensor) -> torch.Tensor:
        a = v.double()[:, None] * inv
        return torch.stack((a.sin(), a.cos()), dim=-1).flatten(-2)

    expected = torch.cat((one(points[:, 1]), one(points[:, 0])), dim=-1).float()
    torch.testing.assert_close(module((5, 5), cells=points), expected, rtol=0, atol=1e-6)


def keys_cubic(table: torch.Tensor, y: float, x: float, a: float = -0.75) -> torch.Tensor:
    """Keys' cubic convolution (torch's bicubic, a = -0.75) of a table [H, W, d] at the point (y, x) in cell
    units, indices clamped to the border: sum over the 4 x 4 nearest cells of W(y - i) W(x - j) T[i, j]."""

    def weight(s: float) -> float:
        s = abs(s)
        if s <= 1:
            return (a + 2) * s**3 - (a + 3) * s**2 + 1
        return a * s**3 - 5 * a * s**2 + 8 * a * s - 4 * a if s < 2 else 0.0

    h, w, _ = table.shape
    out = torch.zeros(table.shape[-1], dtype=torch.float64)
    for i in range(math.floor(y) - 1, math.floor(y) + 3):
        for j in range(math.floor(x) - 1, math.floor(x) + 3):
            out += weight(y - i) * weight(x - j) * table[min(max(i, 0), h - 1), min(max(j, 0), w - 1)].double()
    return out.float()


@pytest.mark.parametrize("resample", ["resize", "grid_sample"])
def test_learned2d_interpolates_between_cells(resample: str) -> None:
    """At fractional points the table is Keys' cubic convolution of its cells (torch's bicubic), clamped to
    the border; at whole-number points it is its own rows. ``grid_sample`` on another grid first maps the
    point's place in the image onto the table: (y + 0.5) / H * H0 - 0.5."""
    module = vispos.create_encoding("learned2d", dim=3, train_grid=(6, 7), resample=resample)
    with torch.no_grad():
        module.table.normal_()
    table = module.table.detach()
    points = torch.tensor([[1.25, 1.5], [2.5, 4.75], [3.9, 2.1], [0.2, 6.0], [5.0, 0.6]])
    expected = torch.stack([keys_cubic(table, float(y), float(x)) for y, x in points])
    torch.testing.assert_close(module((6, 7), cells=points), expected, rtol=0, atol=1e-5)
    at = cells((6, 7)).float()
    torch.testing.assert_close(module((6, 7), cells=at), module((6, 7)).float(), rtol=0, atol=1e-5)
    if resample == "grid_sample":
        on_table = (points + 0.5) / torch.tensor([3.0, 14.0]) * torch.tensor([6.0, 7.0]) - 0.5
        expected = torch.stack([keys_cubic(table, float(y), float(x)) for y, x in on_table])
        torch.testing.assert_close(module((3, 14), cells=points), expected, rtol=0, atol=1e-5)
    else:  # another grid: the table resized to it (timm's rule), then read between its cells
        resized = module((3, 14)).view(3, 14, 3).detach()
        expected = torch.stack([keys_cubic(resized, float(y), float(x)) for y, x in points.clamp(max=2.0)])
        torch.testing.assert_close(module((3, 14), cells=points.clamp(max=2.0)), expected, rtol=0, atol=1e-5)


def test_alibi2d_and_cpb2d_at_fractional_offsets_are_their_formulas() -> None:
    offsets = torch.tensor([[0.5, -1.25], [2.0, 3.0], [-0.1, 0.0]])
    alibi = vispos.create_encoding("alibi2d", num_heads=4)
    slopes = torch.tensor([2.0 ** (-8 * (h + 1) / 4) for h in range(4)])  # ALiBi's geometric slopes
    expected = -slopes[:, None] * offsets.norm(dim=-1)[None]
    torch.testing.assert_close(alibi.pair_bias(offsets), expected, rtol=0, atol=1e-6)

    cpb = vispos.create_encoding("cpb2d", num_heads=3, train_grid=(5, 9), hidden=16)
    t = offsets / torch.tensor([4.0, 8.0]) * 8  # SwinV2: (dy, dx) / (pretrained size - 1) * 8
    inputs = torch.sign(t) * torch.log2(t.abs() + 1) / 3  # sign * log2(1 + |t|) / log2(8)
    expected = 16 * torch.sigmoid(cpb.mlp(inputs)).T
    torch.testing.assert_close(cpb.pair_bias(offsets), expected, rtol=0, atol=1e-6)
    table = cpb.offset_bias((5, 9))  # at whole-number offsets: the per-offset table
    whole = torch.tensor([[2, -3], [-4, 8]])
    from_table = table[:, whole[:, 0] + 4, whole[:, 1] + 8]
    torch.testing.assert_close(cpb.pair_bias(whole.float()), from_table, rtol=0, atol=1e-6)


@pytest.mark.parametrize("pos", CELLS_ONLY)
def test_schemes_defined_at_cells_refuse_fractional_points(pos: str) -> None:
    net = make(pos)
    pair = images(net, points=True)
    with pytest.raises(ValueError, match=f"{pos} .*fractional coordinates are refused"):
        run(net, [pair[:1]])


def test_bad_points_are_refused() -> None:
    net = make("rope2d", prefix=False)
    pos = net.vispos
    with pytest.raises(ValueError, match="non-finite"):
        pos.ragged_context(torch.tensor([[[0.5, float("nan")]]]), torch.tensor([[2, 2]]))
    with pytest.raises(ValueError, match="outside their image's grid"):
        pos.ragged_context(torch.tensor([[[0.5, 1.5]]]), torch.tensor([[2, 2]]))  # x <= W - 1 = 1
    with pytest.raises(ValueError, match="real tensor"):
        pos.ragged_context(torch.ones(1, 1, 2, dtype=torch.bool), torch.tensor([[2, 2]]))
    ctx = pos.ragged_context(torch.tensor([[[0.5, 1.0], [1.0, 0.25]]]), torch.tensor([[2, 2]]))
    assert ctx.ragged.fractional and ctx.grid == (2, 2)


def test_the_documented_table_names_every_2d_scheme() -> None:
    """docs/token_subsets.md says what each 2D scheme does at a fractional point: none is left out."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "token_subsets.md").read_text()
    section = text.split("## Fractional coordinates", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]  # the table's rows, schemes first
    listed = {name.strip() for row in rows for name in row.split("|")[1].replace("`", "").split(",")}
    missing = [s for s in vispos.list_encodings(2) if s not in listed]
    assert not missing, missing
