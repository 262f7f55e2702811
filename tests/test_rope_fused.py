"""The compiled forms of the learned rotations (``vispos/encodings/rope_fused.py``: sums of products that inductor
fuses into one kernel) compute what the eager forms compute: the block rotations' einsum (ComRoPE, LieRE) and
STRING's basis change followed by RoPE, for every layout of the tables (shared, per head, gathered per sample)
and q read where a fused qkv projection leaves it. Run eagerly here (the same ops inductor lowers); the compiled
models are compared with eager in ``tests/test_compiled_schemes.py``."""

from __future__ import annotations

import pytest
import torch

from vispos.encodings.rope import LAYOUTS, apply_blocks, apply_rope, change_basis, rotate_half, rotate_interleaved
from vispos.encodings.rope_fused import coordinate_sum, fused_basis, fused_blocks
from vispos.encodings.rotary_nd import linear_angles

B, HEADS, N, D = 2, 3, 5, 8


def qkv_view() -> torch.Tensor:
    """q as timm's fused projection leaves it: [B, heads, N, d] inside a [B, N, 3, heads, d] buffer."""
    return torch.randn(B, N, 3, HEADS, D).permute(2, 0, 3, 1, 4)[0]


SHAPES = {"shared": (N,), "heads": (HEADS, N), "sample": (B, HEADS, N), "sample1": (B, 1, N)}


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("block", [2, 4, D])
def test_fused_blocks_equal_the_einsum(shape: tuple[int, ...], block: int) -> None:
    x = qkv_view()
    blocks = torch.randn(*shape, D // block, block, block)
    torch.testing.assert_close(fused_blocks(x, blocks), apply_blocks(x, blocks), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("heads", [True, False])
@pytest.mark.parametrize("table", [(N,), (HEADS, N), (B, HEADS, N)], ids=["shared", "heads", "sample"])
def test_fused_basis_equals_the_basis_change_then_rope(layout: str, heads: bool, table: tuple[int, ...]) -> None:
    x = qkv_view()
    basis = torch.linalg.qr(torch.randn(*((HEADS,) if heads else ()), D, D))[0]
    angles = torch.randn(*table, D) * 3
    cos, sin = angles.cos(), angles.sin()
    rot = rotate_half if layout == "half" else rotate_interleaved
    expected = apply_rope(change_basis(x, basis), cos, sin, layout)
    torch.testing.assert_close(fused_basis(x, basis, cos, sin, rot), expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("heads", [(), (HEADS,)])
def test_exponents_and_angles_are_the_products_over_the_axes(heads: tuple[int, ...]) -> None:
    coords, generators, freqs = torch.randn(N, 2), torch.randn(*heads, 2, 4, 2, 2), torch.randn(*heads, 2, D // 2)
    expected = torch.einsum("na,...amij->...nmij", coords, generators)
    torch.testing.assert_close(coordinate_sum(coords, generators, 3), expected, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(linear_angles(coords, freqs), coords @ freqs, atol=1e-6, rtol=1e-6)
