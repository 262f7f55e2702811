"""Every 2D scheme's forward on a patched timm ViT, and on a NaFlexVit's ragged batches, on fake CUDA tensors
(``fake_cuda.py``): training and eval mode, fp32 and bf16 weights, two image sizes. No tensor is made off the
device (outside the host constants ``fake_cuda.HOST_CONSTANTS`` lists), and no host-device synchronisation
happens (it raises under fake tensors). Ragged batches read their layout on the host by design: their forwards
run on the CPU with every data-dependent op recorded, none outside ``fake_cuda.ISOLATED``."""

from __future__ import annotations

import pytest
import timm
import torch
from fake_cuda import forwards, host_reads

import vispos

SCHEMES = vispos.list_encodings(ndim=2)
DTYPES = [torch.float32, torch.bfloat16]


def images(size: int):
    return lambda dtype, device: {"x": torch.randn(2, 3, size, size, device=device, dtype=dtype)}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_patched_vit_runs_on_fake_cuda_without_leaving_the_device(scheme: str, dtype: torch.dtype) -> None:
    model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2,
                              num_classes=4, dynamic_img_size=True)  # fmt: skip
    watch = forwards(vispos.patch(model, scheme), [images(32), images(48)], dtype)
    assert not watch.unexplained()


def naflex_batch(sizes: list[tuple[int, int]]):
    """A NaFlex batch as timm's collator pads it: each image's patches row-major (its own grid), then padding."""

    def make(dtype: torch.dtype, device: str) -> dict[str, torch.Tensor]:
        tokens = max(h * w for h, w in sizes)
        patches = torch.randn(len(sizes), tokens, 8 * 8 * 3, device=device, dtype=dtype)
        coord = torch.zeros(len(sizes), tokens, 2, dtype=torch.long, device=device)
        valid = torch.zeros(len(sizes), tokens, dtype=torch.bool, device=device)
        for i, (h, w) in enumerate(sizes):  # built from Python numbers: the collator's work
            yy, xx = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
            coord[i, : h * w] = torch.stack((yy.flatten(), xx.flatten()), -1)
            valid[i, : h * w] = True
        return {"x": {"patches": patches, "patch_coord": coord, "patch_valid": valid}}

    return make


# a query-dependent bias is built for one grid: vispos refuses ragged batches for it
RAGGED = [s for s in SCHEMES if vispos.get_info(s, ndim=2).kind != "query_bias"]


@pytest.mark.parametrize("scheme", RAGGED)
def test_a_patched_naflexvit_reads_a_ragged_batch_on_the_host_only_for_its_layout(scheme: str) -> None:
    """Ragged batches read their layout on the host by design (``fake_cuda.ISOLATED``), so they run on real CPU
    tensors, every data-dependent op recorded; nothing else of the forward reads the data."""
    from vispos.timm.naflex import patch_naflex

    model = timm.create_model("naflexvit_base_patch16_gap", patch_size=8, img_size=32, embed_dim=32, num_heads=2,
                              depth=2, num_classes=4)  # fmt: skip
    batches = [naflex_batch([(4, 4), (3, 5)]), naflex_batch([(2, 6), (5, 5), (4, 3)])]
    reads = host_reads(patch_naflex(model, scheme), batches)
    assert not reads.unexplained()
    assert reads.reads  # the layout was read: the recorder sees the ragged path
