"""Every 2D scheme's forward on a patched transformers ViT on fake CUDA tensors (``fake_cuda.py``): training and
eval mode, fp32 and bf16 weights, two image sizes; no tensor made off the device (outside
``fake_cuda.HOST_CONSTANTS``), no host-device synchronisation. The ragged and packed batches of SigLIP 2
(NaFlex), Pixtral and the Qwen2-VL / 2.5-VL / 3-VL towers read their layout on the host by design: their
forwards run on the CPU with every data-dependent op recorded, none of vispos's outside ``fake_cuda.ISOLATED``
(transformers' own reading of the image sizes is its own)."""

from __future__ import annotations

import pytest
import torch
from fake_cuda import forwards, host_reads

import vispos

tf = pytest.importorskip("transformers")

from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl  # noqa: E402
from transformers.models.qwen2_vl import modeling_qwen2_vl  # noqa: E402
from transformers.models.qwen3_vl import modeling_qwen3_vl  # noqa: E402

SCHEMES = vispos.list_encodings(ndim=2)
KINDS = {s: vispos.get_info(s, ndim=2).kind for s in SCHEMES}
TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)


def images(size: int):
    return lambda dtype, device: {"pixel_values": torch.randn(2, 3, size, size, device=device, dtype=dtype)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_patched_vit_runs_on_fake_cuda_without_leaving_the_device(scheme: str, dtype: torch.dtype) -> None:
    model = tf.ViTModel(tf.ViTConfig(**TINY, image_size=32, patch_size=8))
    watch = forwards(vispos.patch(model, scheme, inherit=False), [images(32), images(48)], dtype)
    assert not watch.unexplained()


def siglip2():
    model = tf.Siglip2VisionModel(tf.Siglip2VisionConfig(**TINY, patch_size=8, num_patches=16))

    def batch(dtype: torch.dtype, device: str) -> dict[str, torch.Tensor]:
        shapes = [(4, 4), (3, 5)]  # rows of pre-cut patches, each image's then padding, as its processor cuts them
        pixels = torch.randn(2, 16, 3 * 64, dtype=dtype, device=device)
        mask = torch.zeros(2, 16, dtype=torch.long, device=device)
        mask[0, :16], mask[1, :15] = 1, 1
        return {"pixel_values": pixels, "pixel_attention_mask": mask,
                "spatial_shapes": torch.tensor(shapes, device=device)}  # fmt: skip

    return model, batch


def pixtral():
    model = tf.PixtralVisionModel(tf.PixtralVisionConfig(**TINY, image_size=32, patch_size=8))

    def batch(dtype: torch.dtype, device: str) -> dict[str, torch.Tensor]:  # two sizes packed into one row
        return {"pixel_values": torch.randn(2, 3, 32, 32, dtype=dtype, device=device),
                "image_sizes": torch.tensor([[32, 24], [16, 32]], device=device)}  # fmt: skip

    return model, batch


def qwen(family: str):
    common = dict(depth=2, num_heads=2, patch_size=4, spatial_merge_size=2, temporal_patch_size=2)
    if family == "qwen2_vl":
        config = tf.Qwen2VLVisionConfig(**common, embed_dim=32, hidden_size=16, mlp_ratio=2)
        model = modeling_qwen2_vl.Qwen2VisionTransformerPretrainedModel._from_config(config)
    elif family == "qwen2_5_vl":
        config = tf.Qwen2_5_VLVisionConfig(**common, hidden_size=32, out_hidden_size=16, intermediate_size=64,
                                           window_size=16, fullatt_block_indexes=[1])  # fmt: skip
        model = modeling_qwen2_5_vl.Qwen2_5_VisionTransformerPretrainedModel._from_config(config)
    else:
        config = tf.Qwen3VLVisionConfig(**common, hidden_size=32, out_hidden_size=16, intermediate_size=64,
                                        num_position_embeddings=16, deepstack_visual_indexes=[0])  # fmt: skip
        model = modeling_qwen3_vl.Qwen3VLVisionModel._from_config(config)
    grid_thw = [[1, 4, 6], [2, 2, 4]]  # an image and a two-frame video, packed

    def batch(dtype: torch.dtype, device: str) -> dict[str, torch.Tensor]:
        return {"hidden_states": torch.randn(40, 3 * 2 * 4 * 4, dtype=dtype, device=device),
                "grid_thw": torch.tensor(grid_thw, device=device)}  # fmt: skip

    return model, batch


# A VLM tower has no token table (additive and conditional schemes are refused); a query-dependent bias is built
# for one grid (refused on ragged batches); Qwen3-VL's learned table goes with its RoPE
TOWER_SCHEMES = [s for s in SCHEMES if KINDS[s] in ("rotary", "bias", "none")]
CASES = [("siglip2", s) for s in SCHEMES if KINDS[s] != "query_bias"] + [
    (tower, s) for tower in ("pixtral", "qwen2_vl", "qwen2_5_vl", "qwen3_vl") for s in TOWER_SCHEMES
]
BUILD = {"siglip2": siglip2, "pixtral": pixtral, "qwen2_vl": lambda: qwen("qwen2_vl"),
         "qwen2_5_vl": lambda: qwen("qwen2_5_vl"), "qwen3_vl": lambda: qwen("qwen3_vl")}  # fmt: skip


@pytest.mark.parametrize(("family", "scheme"), CASES, ids=[f"{f}-{s}" for f, s in CASES])
def test_a_patched_tower_reads_a_packed_batch_on_the_host_only_for_its_layout(family: str, scheme: str) -> None:
    torch.manual_seed(0)
    model, batch = BUILD[family]()
    reads = host_reads(vispos.patch(model, scheme, inherit=False), [batch])
    assert not reads.unexplained()
    assert reads.reads  # the layout was read: the recorder sees the ragged path
