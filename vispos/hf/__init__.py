"""The transformers adapter: the only part of vispos that knows transformers (imported when a transformers
model is patched; transformers is not a dependency of vispos itself).

- ``families.py``: the vision families accepted (ViT, DeiT, DINOv2, DINOv2 with registers, DINOv3, CLIP,
  SigLIP, SigLIP 2's NaFlex rows), where each keeps its prefix tokens, table and layers, and those refused by name.
- ``modules.py``: the patched classes of the host model, its embeddings, its attentions (and DINOv3's
  ``rope_embeddings``), made once per transformers class and found again by pickle.
- ``patching.py``: ``patch``.
- ``towers.py``: the vision towers of vision-language models (Pixtral's and the Qwen2-VL, Qwen2.5-VL and Qwen3-VL
  encoders, alone or in their VLMs), patched around transformers' own forward, and those refused by name.
- ``loading.py``: ``from_pretrained``, which builds a saved model with the constructor options it was saved with.

Supported transformers: 5.18 and newer (``make test`` runs the newest release, ``make test-hf-min`` the
adapter's tests at the floor, ``pyproject.toml``'s ``hf`` extra; older releases are refused by name).

What the adapter touches in transformers:

- Modules recognised by class name: the embeddings classes of ``families.FAMILIES`` (the module owning one
  as ``embeddings`` is the host), the attention classes of ``families.ATTENTIONS``.
- Host: ``config`` (``image_size``, ``hidden_size``, ``num_attention_heads``, ``_attn_implementation``;
  DINOv3's ``rope_theta``, ``pos_embed_shift`` / ``_jitter`` / ``_rescale``), ``embeddings``,
  ``rope_embeddings``; its ``forward(pixel_values, ...)`` is called through ``super()`` with one more
  keyword, ``vispos_context``, which transformers' layers pass on to their attention among ``**kwargs``.
- Embeddings: the patch ``nn.Conv2d`` (its stride is the patch size; SigLIP 2: ``patch_embedding``, a Linear
  over pre-cut patches, the host's ``spatial_shapes`` argument and config ``num_patches``), ``cls_token``,
  ``distillation_token``, ``class_embedding``, ``register_tokens``, ``mask_token``, ``dropout``; the table
  ``position_embeddings`` or ``position_embedding`` (set to None once adopted).
- Attention: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` or ``out_proj``, ``head_dim``, ``scaling`` or
  ``scale``, ``attention_dropout`` or ``dropout``, ``config``; the attention functions
  ``transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS`` and each modeling module's
  ``eager_attention_forward``.
- Pixtral's tower: ``patch_conv``, ``patch_size``, ``config`` (``image_size``, ``rope_parameters["rope_theta"]``),
  ``patch_positional_embedding``, its ``forward(pixel_values, image_sizes, **kwargs)`` (the packed row: each
  image's patches row-major, image after image), the layers' ``attention`` (``PixtralAttention``).
- Qwen2-VL's tower: ``spatial_merge_size``, ``config`` (``embed_dim``, ``num_heads``, ``rope_parameters``), its
  ``forward(hidden_states, grid_thw, **kwargs)``, the blocks' ``attn`` (``VisionAttention``: ``qkv``, ``proj``,
  ``num_heads``, ``head_dim``, ``scaling``, ``attention_dropout``).
- Qwen2.5-VL's tower: as Qwen2-VL's (``config.hidden_size`` for its width; the blocks' ``attn`` is
  ``Qwen2_5_VLVisionAttention``), with ``window_size``, ``patch_size``, ``spatial_merge_unit`` and
  ``transformers.vision_utils.get_vision_window_index`` (the window order its forward follows; its precomputed
  ``window_index`` / ``cu_window_seqlens`` keywords).
- Qwen3-VL's tower: as Qwen2-VL's (``config.hidden_size``; ``Qwen3VLVisionAttention``), and ``pos_embed`` (an
  ``nn.Embedding`` called on the interpolation indices, its output summed with weights by the tower).
- ``transformers.AutoConfig`` and the model classes named by ``config.architectures`` (``from_pretrained``): their
  constructors' parameters, and the state-dict entries of the optional parts of ``families.CONSTRUCTOR_OPTIONS``.
"""

from __future__ import annotations

import transformers

from .families import FAMILIES, REFUSED
from .loading import from_pretrained
from .patching import patch

TRANSFORMERS_MIN = (5, 18)  # as pyproject.toml's hf extra declares


def check_version(version: str) -> None:
    """Refuse a transformers older than ``TRANSFORMERS_MIN`` by name: its families have another layout
    (ViT's and DINOv2's attention wrappers with ``query`` / ``key`` / ``value``, layers without keywords)."""
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    if parts < TRANSFORMERS_MIN:
        floor = ".".join(map(str, TRANSFORMERS_MIN))
        raise ImportError(
            f"vispos's transformers adapter needs transformers >= {floor} (its vision models' layout), found "
            f"{version}: pip install 'transformers>={floor}' (or pip install 'vispos[hf]')"
        )


check_version(transformers.__version__)

__all__ = ["FAMILIES", "REFUSED", "TRANSFORMERS_MIN", "check_version", "from_pretrained", "patch"]
