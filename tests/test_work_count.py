"""The counting rules of ``benchmarks/work_count.py`` on single kernels whose bytes are worked out by hand: bytes
follow the elements each argument addresses, not how the code spells the broadcast, and writes that read nothing
count as writes only. Also ``work_floor.mask_writes``'s shapes."""

from __future__ import annotations

import timm
import torch

from benchmarks.work_count import WorkCounter
from benchmarks.work_floor import geometry, mask_writes

F32 = 4  # bytes per element


def counted(fn, *args: torch.Tensor) -> tuple[int, int]:  # noqa: ANN001 (any callable of tensors)
    """(kernels, bytes) of running fn(*args) under the counter."""
    with WorkCounter() as counter:
        fn(*args)
    return counter.work.kernels, counter.work.bytes


def test_a_broadcast_counts_the_same_implicit_or_expanded() -> None:
    """a [8, 100, 64] + b [1, 100, 64]: a read, b read once, the sum written: (51200 + 6400 + 51200) x 4 B."""
    a, b = torch.randn(8, 100, 64), torch.randn(1, 100, 64)
    expected = (1, (8 * 100 * 64 + 100 * 64 + 8 * 100 * 64) * F32)
    assert expected == (1, 435_200)
    assert counted(torch.add, a, b) == expected
    assert counted(lambda x, y: x + y.expand(8, -1, -1), a, b) == expected


def test_fills_and_out_arguments_count_their_write_only() -> None:
    x = torch.empty(10, 10)
    assert counted(torch.Tensor.zero_, x) == (1, 100 * F32)
    assert counted(lambda t: t.fill_(3.0), x) == (1, 100 * F32)
    a, b, out = torch.randn(10), torch.randn(10), torch.empty(10)
    assert counted(lambda: torch.add(a, b, out=out)) == (1, 3 * 10 * F32)  # a and b read, out written
    assert counted(lambda: a.add_(b)) == (1, 3 * 10 * F32)  # in place: a read and written, b read


def test_a_tensor_read_twice_by_one_kernel_counts_once() -> None:
    a = torch.randn(10)
    assert counted(lambda: a + a) == (1, 2 * 10 * F32)  # a read once, the sum written


def test_overlapping_rows_of_a_view_count_each_element_once() -> None:
    """Rows [i, i + 4) of a 10-element buffer for i < 5 (as ``unfold`` makes): 8 distinct elements read, 20
    written by the copy."""
    x = torch.arange(10.0)
    windows = x.as_strided((5, 4), (1, 1))
    assert counted(torch.clone, windows) == (1, (8 + 20) * F32)


def test_views_of_one_buffer_that_do_not_overlap_count_in_full() -> None:
    """q and k, two strided views of one qkv buffer [B, N, 3, d], each read in full."""
    qkv = torch.randn(2, 5, 3, 4)
    q, k = qkv[:, :, 0], qkv[:, :, 1]
    assert counted(torch.add, q, k) == (1, (40 + 40 + 40) * F32)


def test_mask_writes_recognise_a_mask_per_forward_or_per_batch_element() -> None:
    """A 4 x 4 grid with a class token and 2 heads, batch 3: outputs of heads (or batch x heads) x Nq x Nk elements
    with Nq, Nk each 16 or 17 are masks, in any shape; a q-sized output or a sum of batch rows is not."""
    model = timm.create_model("vit_small_patch16_224", img_size=64, depth=2, embed_dim=64, num_heads=2)
    geo = geometry(model)
    written = {
        2 * 16 * 16: 1,  # [heads, HW, HW]: built
        2 * 17 * 17: 2,  # [1, heads, N, N] or [heads, N * N]: prefix rows padded, cast
        2 * 17 * 16: 4,  # [heads, N, HW]: prefix rows added first
        3 * 2 * 17 * 17: 8,  # [B, heads, N, N]: a mask per batch element
        3 * 2 * 17 * 32: 16,  # q [B, heads, N, d]
        3 * 17 * 17: 32,  # neither heads nor batch x heads
        2 * 18 * 18: 64,  # larger than the tokens
    }
    assert mask_writes(written, geo, 3) == 1 + 2 + 4 + 8
