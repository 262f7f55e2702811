"""Patched models load as big models are loaded: built on the meta device (accelerate's ``init_empty_weights``,
``torch.device("meta")``), patched before or after their weights arrive, the weights set tensor by tensor by
accelerate (``load_checkpoint_in_model``, ``load_checkpoint_and_dispatch``) and run under its hooks
(``dispatch_model``, ``cpu_offload``, ``disk_offload``). Each result is compared with the same patched model
built and loaded in memory; a checkpoint of other positions is refused as ``load_state_dict`` refuses it. Tiny
models only."""

from __future__ import annotations

import pytest
import torch

import vispos

accelerate = pytest.importorskip("accelerate")
tf = pytest.importorskip("transformers")
timm = pytest.importorskip("timm")

from accelerate import (  # noqa: E402
    cpu_offload,
    disk_offload,
    dispatch_model,
    init_empty_weights,
    load_checkpoint_and_dispatch,
    load_checkpoint_in_model,
)
from safetensors.torch import save_file  # noqa: E402


def timm_vit() -> torch.nn.Module:
    return timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, embed_dim=64, num_heads=4,
                             mlp_ratio=2.0, num_classes=0)  # fmt: skip


def hf_vit() -> torch.nn.Module:
    config = tf.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                          image_size=32, patch_size=8)  # fmt: skip
    return tf.ViTModel(config, add_pooling_layer=False)


HOSTS = {"timm": timm_vit, "hf": hf_vit}
POS = ["learned2d", "rope2d"]  # a table and a record of a scheme module of its own


def out(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        y = model.eval()(x)
    return getattr(y, "last_hidden_state", y)


def saved(model: torch.nn.Module, folder) -> str:
    path = str(folder / "model.safetensors")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path)
    return path


def reference(host: str, **options) -> torch.nn.Module:
    torch.manual_seed(0)
    model = vispos.patch(HOSTS[host](), POS, inherit=False, **options)
    with torch.no_grad():  # weights unlike a fresh model's, the positions' included
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def empty(host: str, **options) -> torch.nn.Module:
    with init_empty_weights():
        model = HOSTS[host]()
    return vispos.patch(model, POS, inherit=False, **options)


@pytest.mark.parametrize("host", HOSTS)
@pytest.mark.parametrize("how", ["load_checkpoint_in_model", "load_checkpoint_and_dispatch"])
def test_a_patched_model_on_the_meta_device_loads_through_accelerate(host, how, tmp_path) -> None:
    ref = reference(host)
    path = saved(ref, tmp_path)
    model = empty(host)
    if how == "load_checkpoint_in_model":
        load_checkpoint_in_model(model, path, device_map={"": "cpu"})
    else:
        model = load_checkpoint_and_dispatch(model, path, device_map={"": "cpu"})
    x = torch.randn(2, 3, 32, 48)
    torch.testing.assert_close(out(model, x), out(ref, x), rtol=0, atol=0)
    assert model.vispos_cfg["pos"] == POS


@pytest.mark.parametrize("host", HOSTS)
def test_accelerate_refuses_a_checkpoint_of_other_positions_as_load_state_dict_does(host, tmp_path) -> None:
    path = saved(reference(host, theta=10.0), tmp_path)
    with pytest.raises(ValueError, match=r"theta: 10\.0 in the checkpoint, 100\.0 in this model"):
        load_checkpoint_in_model(empty(host, theta=100.0), path, device_map={"": "cpu"})
    with pytest.raises(ValueError, match="theta"):  # the same refusal from load_state_dict
        vispos.patch(HOSTS[host](), POS, inherit=False, theta=100.0).load_state_dict(reference(host, theta=10.0)
                                                                                     .state_dict())  # fmt: skip


@pytest.mark.parametrize("host", HOSTS)
def test_the_records_settings_arrive_through_accelerate(host, tmp_path) -> None:
    """What a record holds beyond the options (DroPE's switch, set by ``vispos.drope``) reaches the model."""
    ref = reference(host)
    ref.vispos.enabled = False
    model = empty(host)
    load_checkpoint_in_model(model, saved(ref, tmp_path), device_map={"": "cpu"})
    assert model.vispos.enabled is False


def blocks(host: str) -> list[str]:
    return ["blocks.0", "blocks.1"] if host == "timm" else ["layers.0", "layers.1"]


def cpu_and_disk(model: torch.nn.Module, host: str) -> dict[str, str]:
    """Every part of the model on the CPU but its second block, on disk (blocks listed one by one)."""
    first, second = blocks(host)
    stack = first.rsplit(".", 1)[0]
    parts = [n for n, _ in model.named_children()] + list(model._parameters)
    top = stack.split(".")[0]
    parts.remove(top)
    if top != stack:  # transformers: encoder.layer
        parts += [f"{top}.{n}" for n, _ in getattr(model, top).named_children() if n != "layer"]
    return {p: "cpu" for p in parts} | {first: "cpu", second: "disk"}


@pytest.mark.parametrize("host", HOSTS)
def test_a_patched_model_runs_with_blocks_on_cpu_and_disk(host, tmp_path) -> None:
    ref = reference(host)
    path = saved(ref, tmp_path)
    model = empty(host)
    model = load_checkpoint_and_dispatch(model, path, device_map=cpu_and_disk(model, host),
                                         offload_folder=str(tmp_path / "offload"))  # fmt: skip
    x = torch.randn(1, 3, 40, 32)
    torch.testing.assert_close(out(model, x), out(ref, x), rtol=0, atol=0)


@pytest.mark.parametrize("host", HOSTS)
@pytest.mark.parametrize("how", ["dispatch_model", "cpu_offload", "disk_offload"])
def test_a_loaded_patched_model_runs_under_accelerates_hooks(host, how, tmp_path) -> None:
    ref = reference(host)
    x = torch.randn(1, 3, 32, 32)
    expected = out(ref, x)
    model = reference(host)  # the same weights, then handed to accelerate
    if how == "dispatch_model":
        first, second = blocks(host)
        model = dispatch_model(model, device_map={first: "cpu", second: "cpu", "": "cpu"})
    elif how == "cpu_offload":
        model = cpu_offload(model, execution_device="cpu")
    else:
        model = disk_offload(model, str(tmp_path / "offload"), execution_device="cpu")
    torch.testing.assert_close(out(model, x), expected, rtol=0, atol=0)


@pytest.mark.parametrize("host", HOSTS)
def test_patched_after_the_weights_arrive_through_accelerate(host, tmp_path) -> None:
    """A plain checkpoint loaded into a model built on the meta device, then patched: the model's own table is
    adopted by learned2d as when it is patched in memory."""
    torch.manual_seed(0)
    plain = HOSTS[host]().eval()
    path = saved(plain, tmp_path)
    with init_empty_weights():
        model = HOSTS[host]()
    load_checkpoint_in_model(model, path, device_map={"": "cpu"})
    ref = vispos.patch(plain, POS)
    model = vispos.patch(model, POS)
    x = torch.randn(1, 3, 32, 40)
    torch.testing.assert_close(out(model, x), out(ref, x), rtol=0, atol=0)


@pytest.mark.parametrize("host", HOSTS)
def test_a_model_built_on_the_meta_device_is_patched_inheriting_its_table(host) -> None:
    """Built as transformers and accelerate build large models (``torch.device("meta")``), patched keeping its
    learned table: learned2d adopts it as meta, and loading the plain checkpoint materialises it."""
    torch.manual_seed(0)
    plain = HOSTS[host]().eval()
    with torch.device("meta"):
        model = HOSTS[host]()
    vispos.patch(model, "learned2d")
    assert model.vispos.additive.table.is_meta
    model.load_state_dict(plain.state_dict(), assign=True)
    ref = vispos.patch(plain, "learned2d")
    assert not any(t.is_meta for t in model.state_dict().values())
    x = torch.randn(1, 3, 32, 40)
    torch.testing.assert_close(out(model, x), out(ref, x), rtol=0, atol=0)


@pytest.mark.parametrize("pos", [["relbias2d"], ["learned2d", "rope2d_mixed"], ["cpb2d"]])
def test_timms_init_weights_initialises_vispos_weights_as_vispos_does(pos) -> None:
    """A timm ViT built on the meta device, patched, ``to_empty`` and ``init_weights`` (timm's init protocol, which
    calls each module's ``reset_parameters``): every positional weight initialised as its scheme initialises it."""
    with torch.device("meta"):
        model = timm_vit()
    vispos.patch(model, pos, inherit=False)
    model.to_empty(device="cpu")
    with torch.no_grad():  # what to_empty may leave: any bytes
        for tensor in [*model.vispos.parameters(), *model.vispos.buffers()]:
            if tensor.is_floating_point():
                tensor.fill_(float("nan"))
    model.init_weights()
    fresh = vispos.patch(timm_vit(), pos, inherit=False)
    for name, tensor in model.vispos.state_dict().items():
        if tensor.is_floating_point():
            assert torch.isfinite(tensor).all(), name
    for name, tensor in model.vispos.named_buffers():
        torch.testing.assert_close(tensor, dict(fresh.vispos.named_buffers())[name], rtol=0, atol=0)


@pytest.mark.parametrize("pos", vispos.list_encodings(2))
def test_every_scheme_loads_with_blocks_on_cpu_and_disk(pos, tmp_path) -> None:
    """Each 2D scheme on a timm ViT built on the meta device, loaded by accelerate with its positions in memory and
    a block offloaded to disk: the in-memory model's outputs."""
    torch.manual_seed(0)
    ref = vispos.patch(timm_vit(), pos, inherit=False).eval()
    with torch.no_grad():
        for p in ref.vispos.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    with init_empty_weights():
        model = timm_vit()
    vispos.patch(model, pos, inherit=False)
    model = load_checkpoint_and_dispatch(model, saved(ref, tmp_path), device_map=cpu_and_disk(model, "timm"),
                                         offload_folder=str(tmp_path / "offload"))  # fmt: skip
    x = torch.randn(1, 3, 32, 40)
    torch.testing.assert_close(out(model, x), out(ref, x), rtol=0, atol=0)
