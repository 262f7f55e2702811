"""The tester glue of ``make hf-suite``: for each transformers family vispos supports, a tiny config, the model
classes it is tested through, the scheme its own positions are, and inputs as its processor makes them.

``FamilyTester`` is what transformers' ``ModelTesterMixin`` asks of ``self.model_tester``; ``construct`` is each
model class wrapped so that every instance the common tests build (``model_class(config)``,
``from_pretrained``, ``_from_config``) is patched by vispos right after its own ``__init__``."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import torch
import transformers as tf
from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl
from transformers.models.qwen2_vl import modeling_qwen2_vl
from transformers.models.qwen3_vl import modeling_qwen3_vl

import vispos

BATCH, IMAGE, PATCH, HIDDEN, HEADS, LAYERS = 2, 32, 4, 32, 4, 2
GRID = (IMAGE // PATCH) ** 2  # patch tokens of an image
REPLACING = "relbias2d"  # the scheme every family is also patched with, its own positions left out (inherit=False)
# Qwen towers: an image of 4 x 6 patches and a two-frame video of 2 x 4 (2 x 2 merge blocks, patches of 4, 2 frames)
GRID_THW = torch.tensor([[1, 4, 6], [2, 2, 4]])
VIT = dict(image_size=IMAGE, patch_size=PATCH, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
           num_attention_heads=HEADS, intermediate_size=37)  # fmt: skip


def images(config: Any) -> dict[str, torch.Tensor]:
    return {"pixel_values": torch.randn(BATCH, 3, IMAGE, IMAGE)}


def naflex(config: Any) -> dict[str, torch.Tensor]:
    """SigLIP 2: rows of pre-cut patches, a 4 x 4 image and a 3 x 5 one padded to 16 tokens."""
    shapes = [(4, 4), (3, 5)]
    pixels, mask = torch.zeros(BATCH, 16, 3 * PATCH * PATCH), torch.zeros(BATCH, 16, dtype=torch.long)
    for i, (h, w) in enumerate(shapes):
        pixels[i, : h * w], mask[i, : h * w] = torch.randn(h * w, 3 * PATCH * PATCH), 1
    return {"pixel_values": pixels, "pixel_attention_mask": mask, "spatial_shapes": torch.tensor(shapes)}


def packed(config: Any) -> dict[str, torch.Tensor]:
    """Pixtral: two images of their own sizes, packed by the tower into one row."""
    return {"pixel_values": torch.randn(BATCH, 3, IMAGE, IMAGE), "image_sizes": torch.tensor([[32, 24], [16, 32]])}


def qwen(config: Any) -> dict[str, torch.Tensor]:
    tokens = int(GRID_THW.prod(1).sum())
    return {"hidden_states": torch.randn(tokens, 3 * 2 * PATCH * PATCH), "grid_thw": GRID_THW.clone()}


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    config: Callable[[], Any]
    classes: tuple[type, ...]
    own: str  # the scheme its own positions are inherited as
    inputs: Callable[[Any], dict[str, torch.Tensor]]
    seq_length: int


QWEN = dict(depth=LAYERS, num_heads=HEADS, patch_size=PATCH, spatial_merge_size=2, temporal_patch_size=2)
FAMILIES = [
    Family("vit", lambda: tf.ViTConfig(**VIT, encoder_stride=PATCH),
           (tf.ViTModel, tf.ViTForImageClassification, tf.ViTForMaskedImageModeling), "learned2d", images, GRID + 1),
    Family("deit", lambda: tf.DeiTConfig(**VIT, encoder_stride=PATCH),
           (tf.DeiTModel, tf.DeiTForImageClassification, tf.DeiTForImageClassificationWithTeacher,
            tf.DeiTForMaskedImageModeling), "learned2d", images, GRID + 2),
    Family("dinov2", lambda: tf.Dinov2Config(**VIT), (tf.Dinov2Model, tf.Dinov2ForImageClassification),
           "learned2d", images, GRID + 1),
    Family("dinov2_registers", lambda: tf.Dinov2WithRegistersConfig(**VIT, num_register_tokens=2),
           (tf.Dinov2WithRegistersModel, tf.Dinov2WithRegistersForImageClassification), "learned2d", images,
           GRID + 3),
    Family("dinov3", lambda: tf.DINOv3ViTConfig(**VIT, num_register_tokens=2), (tf.DINOv3ViTModel,), "rope2d",
           images, GRID + 3),
    Family("clip", lambda: tf.CLIPVisionConfig(**VIT, projection_dim=16),
           (tf.CLIPVisionModel, tf.CLIPVisionModelWithProjection), "learned2d", images, GRID + 1),
    Family("siglip", lambda: tf.SiglipVisionConfig(**VIT), (tf.SiglipVisionModel,), "learned2d", images, GRID),
    Family("siglip2", lambda: tf.Siglip2VisionConfig(**{k: v for k, v in VIT.items() if k != "image_size"},
                                                     num_patches=16),
           (tf.Siglip2VisionModel,), "learned2d", naflex, 16),
    Family("pixtral", lambda: tf.PixtralVisionConfig(**VIT), (tf.PixtralVisionModel,), "rope2d", packed,
           48 + 32),
    Family("qwen2_vl", lambda: tf.Qwen2VLVisionConfig(**QWEN, embed_dim=HIDDEN, hidden_size=16, mlp_ratio=2),
           (modeling_qwen2_vl.Qwen2VisionTransformerPretrainedModel,), "rope2d", qwen, 40),
    Family("qwen2_5_vl", lambda: tf.Qwen2_5_VLVisionConfig(**QWEN, hidden_size=HIDDEN, out_hidden_size=16,
                                                           intermediate_size=37, window_size=16,
                                                           fullatt_block_indexes=[1]),
           (modeling_qwen2_5_vl.Qwen2_5_VisionTransformerPretrainedModel,), "rope2d", qwen, 40),
    Family("qwen3_vl", lambda: tf.Qwen3VLVisionConfig(**QWEN, hidden_size=HIDDEN, out_hidden_size=16,
                                                      intermediate_size=37, num_position_embeddings=16,
                                                      deepstack_visual_indexes=[0]),
           (modeling_qwen3_vl.Qwen3VLVisionModel,), "rope2d", qwen, 40),
]  # fmt: skip
SCHEMES = ("unpatched", "inherited", REPLACING)


def patch_args(family: Family, scheme: str) -> tuple[str, bool]:
    """(what vispos.patch is given, inherit) for a suite scheme."""
    return (family.own, True) if scheme == "inherited" else (scheme, False)


def construct(cls: type, family: Family, scheme: str) -> type:
    """``cls`` itself unpatched; otherwise a subclass of the same name whose instances are patched right after
    their own ``__init__`` (the common tests dispatch on the class name: labels, heads)."""
    if scheme == "unpatched":
        return cls
    pos, inherit = patch_args(family, scheme)

    def __init__(self, config, *args, **kwargs):  # noqa: N807
        cls.__init__(self, config, *args, **kwargs)
        vispos.patch(self, pos, inherit=inherit)

    __init__.__signature__ = inspect.signature(cls.__init__)  # the options it takes (use_mask_token), read by tests
    return type(cls.__name__, (cls,), {"__init__": __init__, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__})  # fmt: skip


class FamilyTester:
    """What transformers' ``ModelTesterMixin`` reads from ``self.model_tester``."""

    batch_size, num_hidden_layers, num_attention_heads, hidden_size = BATCH, LAYERS, HEADS, HIDDEN
    image_size, patch_size, is_training = IMAGE, PATCH, True
    num_masks, mask_length = 1, GRID  # bool_masked_pos: one masked patch token of the image's (prefix excluded)

    def __init__(self, parent: Any, family: Family):
        self.parent, self.family, self.seq_length = parent, family, family.seq_length

    def get_config(self) -> Any:
        return self.family.config()

    def prepare_config_and_inputs_for_common(self) -> tuple[Any, dict[str, torch.Tensor]]:
        config = self.get_config()
        return config, self.family.inputs(config)
