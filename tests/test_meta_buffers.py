"""Every 2D scheme on the path a checkpoint takes into a model built on the meta device: built under
``torch.device("meta")`` (buffers on meta too, unlike accelerate's ``init_empty_weights``), patched,
``to_empty``, then the buffers a checkpoint does not hold restored by the host's protocol (timm's
``reinit_non_persistent_buffers``; transformers' ``initialize_weights``) and the weights loaded. The memory
``to_empty`` leaves is any bytes; here it is filled with NaN (and a constant for integer and bool buffers), so
a buffer nothing restores shows. Compared with the same model built and patched on the CPU."""

from __future__ import annotations

import pytest
import torch

import vispos

timm = pytest.importorskip("timm")
tf = pytest.importorskip("transformers")

from timm.models._manipulate import reinit_non_persistent_buffers  # noqa: E402

# each 2D scheme with its defaults, and the options under which a scheme holds other buffers of its own
CASES = [(name, {}) for name in vispos.list_encodings(2)] + [
    ("string2d", {"freqs": "axial"}),
    ("string2d", {"freqs": "golden"}),
    ("comrope2d", {"variant": "ld"}),
]
IDS = [name + "".join(f"-{v}" for v in options.values()) for name, options in CASES]


def timm_vit() -> torch.nn.Module:
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
                             embed_dim=32, num_heads=2, mlp_ratio=2.0, num_classes=0)  # fmt: skip


def hf_vit() -> torch.nn.Module:
    config = tf.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                          image_size=32, patch_size=8)  # fmt: skip
    return tf.ViTModel(config, add_pooling_layer=False)


def garbage(model: torch.nn.Module) -> None:
    """What ``to_empty`` may leave in every buffer, made deterministic."""
    with torch.no_grad():
        for buffer in model.buffers():
            buffer.fill_(float("nan") if buffer.is_floating_point() else True if buffer.dtype == torch.bool else 7)


def out(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        y = model.eval()(x)
    return getattr(y, "last_hidden_state", y)


def pair(build, name: str, options: dict) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The model built on the CPU and the same one built on the meta device, both patched, the latter ``to_empty``."""
    torch.manual_seed(0)
    ref = vispos.patch(build(), name, inherit=False, **options).eval()
    with torch.device("meta"):
        empty = build()
    empty = vispos.patch(empty, name, inherit=False, **options).to_empty(device="cpu")
    garbage(empty)
    return ref, empty


@pytest.mark.filterwarnings("ignore:lookhere2d")
@pytest.mark.parametrize(("name", "options"), CASES, ids=IDS)
def test_timm_meta_build_loads_and_reinits_buffers(name: str, options: dict) -> None:
    ref, empty = pair(timm_vit, name, options)
    empty.load_state_dict(ref.state_dict())
    reinit_non_persistent_buffers(empty)
    x = torch.randn(1, 3, 32, 32)
    torch.testing.assert_close(out(empty, x), out(ref, x), rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore:lookhere2d")
@pytest.mark.parametrize(("name", "options"), CASES, ids=IDS)
def test_hf_meta_build_initialises_buffers_and_loads(name: str, options: dict) -> None:
    """transformers' order: ``initialize_weights`` on the empty model (what sets the buffers a checkpoint does not
    hold), then the weights."""
    ref, empty = pair(hf_vit, name, options)
    empty.initialize_weights()
    empty.load_state_dict(ref.state_dict())
    x = torch.randn(1, 3, 32, 32)
    torch.testing.assert_close(out(empty, x), out(ref, x), rtol=0, atol=0)
