"""The whole patched model offloaded by accelerate (``cpu_offload``, ``disk_offload``), its positions included:
offloading hooks bring a module's weights in around its own call only, so every scheme reads its weights through
the call of the module that holds them. Each 2D scheme's output under offloading is the in-memory model's, fp32.
Tiny model: two blocks of width 32."""

from __future__ import annotations

import pytest
import torch

import vispos

accelerate = pytest.importorskip("accelerate")
timm = pytest.importorskip("timm")

from accelerate import cpu_offload, disk_offload  # noqa: E402


def timm_vit() -> torch.nn.Module:
    return timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, embed_dim=32, num_heads=2,
                             mlp_ratio=2.0, num_classes=0)  # fmt: skip


def patched(pos: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = vispos.patch(timm_vit(), pos, inherit=False).eval()
    with torch.no_grad():  # positional weights unlike a fresh model's (BEiT's prefix entries off zero)
        for p in model.vispos.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.mark.parametrize("how", ["cpu_offload", "disk_offload"])
@pytest.mark.parametrize("pos", vispos.list_encodings(2))
def test_every_scheme_runs_offloaded_as_in_memory(pos, how, tmp_path) -> None:
    model = patched(pos)
    x = torch.randn(1, 3, 32, 40)  # another grid than the training one: tables resized, frequencies rescaled
    with torch.no_grad():
        expected = model(x)
        if how == "cpu_offload":
            model = cpu_offload(model, execution_device="cpu")
        else:
            model = disk_offload(model, str(tmp_path / "offload"), execution_device="cpu")
        assert any(p.is_meta for p in model.vispos.parameters()) or not list(model.vispos.parameters())
        torch.testing.assert_close(model(x), expected, rtol=0, atol=0)
