"""The whole patched model offloaded by accelerate (``cpu_offload``, ``disk_offload``, a device map that puts the
positions on ``"disk"``), its positions included: offloading hooks bring a module's weights in around its own call
only, so every scheme reads its weights through the call of the module that holds them. Each 2D scheme's output
under offloading is the in-memory model's, fp32, on a timm ViT and a transformers DINOv3. Tiny models: two blocks
of width 32."""

from __future__ import annotations

import pytest
import torch

import vispos
from vispos.registry import get_info

accelerate = pytest.importorskip("accelerate")
timm = pytest.importorskip("timm")
tf = pytest.importorskip("transformers")

from accelerate import cpu_offload, disk_offload, init_empty_weights, load_checkpoint_and_dispatch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

WEIGHTED = [pos for pos in vispos.list_encodings(2) if get_info(pos, ndim=2).trainable]  # weights to offload


def timm_vit() -> torch.nn.Module:
    return timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, embed_dim=32, num_heads=2,
                             mlp_ratio=2.0, num_classes=0)  # fmt: skip


def dinov3() -> torch.nn.Module:
    config = tf.DINOv3ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                                image_size=32, patch_size=8, num_register_tokens=2)  # fmt: skip
    return tf.DINOv3ViTModel(config)


def out(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        y = model(x)
    return getattr(y, "last_hidden_state", y)


def patched(pos: str, build=timm_vit) -> torch.nn.Module:
    torch.manual_seed(0)
    model = vispos.patch(build(), pos, inherit=False).eval()
    with torch.no_grad():  # positional weights unlike a fresh model's (BEiT's prefix entries off zero)
        for p in model.vispos.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.mark.parametrize("how", ["cpu_offload", "disk_offload"])
@pytest.mark.parametrize("pos", vispos.list_encodings(2))
def test_every_scheme_runs_offloaded_as_in_memory(pos, how, tmp_path) -> None:
    model = patched(pos)
    x = torch.randn(1, 3, 32, 40)  # another grid than the training one: tables resized, frequencies rescaled
    expected = out(model, x)
    if how == "cpu_offload":
        model = cpu_offload(model, execution_device="cpu")
    else:
        model = disk_offload(model, str(tmp_path / "offload"), execution_device="cpu")
    assert all(p.is_meta for p in model.vispos.parameters())  # brought in by each module's call only
    torch.testing.assert_close(out(model, x), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("pos", WEIGHTED)
def test_every_trained_scheme_on_a_transformers_model_runs_offloaded_as_in_memory(pos) -> None:
    model = patched(pos, dinov3)
    x = torch.randn(1, 3, 32, 40)
    expected = out(model, x)
    model = cpu_offload(model, execution_device="cpu")
    torch.testing.assert_close(out(model, x), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("pos", WEIGHTED)
def test_every_trained_scheme_loads_with_its_positions_on_disk(pos, tmp_path) -> None:
    """A device map that puts ``vispos`` (and a block) on ``"disk"``: loaded by accelerate into a model built on the
    meta device, the in-memory model's outputs."""
    ref = patched(pos)
    path = str(tmp_path / "model.safetensors")
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, path)
    with init_empty_weights():
        model = vispos.patch(timm_vit(), pos, inherit=False)
    parts = [n for n, _ in model.named_children() if n != "blocks"] + list(model._parameters)
    device_map = {p: "cpu" for p in parts} | {"blocks.0": "cpu", "blocks.1": "disk", "vispos": "disk"}
    model = load_checkpoint_and_dispatch(model, path, device_map=device_map, offload_folder=str(tmp_path / "off"))
    x = torch.randn(1, 3, 32, 40)
    torch.testing.assert_close(out(model.eval(), x), out(ref, x), rtol=1e-5, atol=1e-6)
