"""The timm adapter: the only part of vispos that knows timm.

- ``patching.py``: ``patch`` / ``create_model``: which timm model families are accepted, and the host each
  goes to (the modules below import ``vit.py``, never ``patching.py``).
- ``vit.py``: ``VisionTransformer`` and ``Eva``, and the steps every host shares: how a model's prefix tokens,
  grids and own tables flow into ``vispos.positions.Positions``, and its attentions are replaced.
- ``model.py``: ``PatchedViT``, the class a patched model takes (its ``_pos_embed``, ``forward_features``
  and ``forward_intermediates``), made once per timm class and found again by pickle.
- ``inherit.py``: a timm model's own RoPE (RoPE-ViT, EVA-02, DINOv3, PE) as ``rope2d`` / ``rope2d_mixed``
  options, which ``patch`` keeps by default, and the warnings when options or schemes discard it.
- ``beit.py``: BEiT / BEiT v2 (``Beit``) as a host of its own (``PatchedBeit``): its relative bias (per layer
  or shared) inherited as ``relbias2d`` with BEiT's resize rule, its ``pos_embed`` as ``learned2d``.
- ``relpos.py``: timm's ``VisionTransformerRelPos`` (``vit_relpos_*``, ``vit_srelpos_*``), a host of its own: its
  relative bias (``RelPosMlp`` / ``RelPosBias``) inherited as ``cpb2d`` / ``relbias2d``, the context handed to the
  blocks as their ``shared_rel_pos``.
- ``swin.py`` and ``window.py``: Swin and Swin V2 (``SwinTransformer``, ``SwinTransformerV2``), hosts of their own
  (``SwinPositions``: additive schemes at the patch embedding, attention schemes per stage on window-local
  coordinates, shared by the windows and blocks of a stage, the shifted-window mask kept); Swin's tables inherited
  as ``relbias2d``, Swin V2's ``cpb_mlp`` as ``cpb2d``.
- ``swin_checkpoint.py``: a patched Swin's position weights from elsewhere: its own bias at patch time, another
  window (``set_input_size``), plain timm Swin / Swin V2 checkpoints (a load_state_dict pre-hook):
  timm's bias keys to the inherited scheme's, Swin's tables of another window resized as timm's loader does.
- ``swin_cr.py``: Swin V2-CR (``SwinTransformerV2Cr``) on the Swin host's positions and stages: NCHW between
  stages, each block's ``meta_mlp`` inherited as ``cpb2d(coords="log", output="linear", out_bias=True)``.
- ``sam.py``: the SAM image encoder (``VisionTransformerSAM``) as a host of its own (``PatchedSam``): NHWC
  windowed and global blocks, its per-block decomposed tables inherited as ``decomposed2d``, ``pos_embed`` as
  ``learned2d``.
- ``attention.py``: ``PatchedAttention``, which adopts a timm attention's weights and applies the
  positions; its ``positioned`` method is the one q/k path that both ``forward`` and the diagnostics use.

Supported timm: 1.0.31 and newer (``make test`` runs the newest release, ``make test-min`` the whole suite at
the floor in ``pyproject.toml``). Before 1.0.30 timm's blocks take no ``is_causal`` (< 1.0.26) and its
``RotaryEmbeddingCat`` has no ``rotate_half``, so a pretrained RoPE's layout cannot be read; 1.0.30's
``NaFlexEmbeds`` has no ``pos_embed_align_corners`` and its ``load_pretrained`` reads JAX ``.npz`` files only.
On a newer timm, what can break is what vispos reads or overrides below; ``make test-min TIMM_MIN=<version>``
runs the suite against any release.

What the adapter touches in timm, and what for:

- Classes accepted (``isinstance``): ``timm.models.vision_transformer.VisionTransformer``,
  ``timm.models.eva.Eva``, ``naflexvit.NaFlexVit``, ``beit.Beit``,
  ``vision_transformer_relpos.VisionTransformerRelPos``, ``swin_transformer.SwinTransformer``,
  ``swin_transformer_v2.SwinTransformerV2``, ``swin_transformer_v2_cr.SwinTransformerV2Cr``,
  ``vision_transformer_sam.VisionTransformerSAM`` (models);
  ``vision_transformer.Attention``, ``timm.layers.AttentionRope``, ``eva.EvaAttention``, ``beit.Attention``,
  ``vision_transformer_relpos.RelPosAttention``, Swin's and Swin V2's ``WindowAttention``, Swin V2-CR's
  ``WindowMultiHeadAttention``, SAM's ``Attention`` (attentions replaced).
- BEiT (``beit.py``): blocks called as ``block(x, shared_rel_pos_bias=...)`` (the context travels there); read:
  ``blocks[i].attn.relative_position_bias_table`` ([(2H-1)(2W-1) + 3, heads], ``gen_relative_position_index``'s
  layout), ``rel_pos_bias.relative_position_bias_table``, ``pos_embed``, ``cls_token``, ``patch_embed.grid_size``;
  written: ``pos_embed = None``, ``rel_pos_bias = None``; overridden: ``forward_features``,
  ``forward_intermediates``, ``set_input_size``; ``timm.models._features.feature_take_indices`` and
  ``timm.models._input.update_model_input_size`` (private); BEiT's resize rule is timm's
  ``layers.resize_rel_pos_bias_table`` (reproduced in ``vispos.encodings.relbias``).
- VisionTransformerRelPos (``relpos.py``): blocks called as ``block(x, shared_rel_pos=...)``; read: ``shared_rel_pos``,
  ``blocks[i].attn.rel_pos`` (``RelPosMlp``: ``mode``, ``pretrained_window_size``, ``bias_gain``, ``mlp.fc1`` /
  ``fc2`` / ``act`` / ``norm`` / ``drop1``; ``RelPosBias``: ``relative_position_bias_table``), ``cls_token``,
  ``num_prefix_tokens``; their state-dict keys (``blocks.{i}.attn.rel_pos.mlp.fc1.weight``,
  ``shared_rel_pos.relative_position_bias_table``...) mapped when a timm checkpoint loads; written:
  ``shared_rel_pos = None``, ``norm_pre = nn.Identity()``; ``timm.models._features.feature_take_indices``.
- SAM (``sam.py``): ``vision_transformer_sam.Attention``, ``Block`` (its class swapped for a subclass whose
  forward takes the positions; ``window_size``, ``norm1``, ``ls1``/``ls2``, ``drop_path1``/``drop_path2``,
  ``norm2``, ``mlp``) and ``window_partition`` / ``window_unpartition``; read: ``attn.use_rel_pos``,
  ``attn.rel_pos_h`` / ``rel_pos_w``, ``pos_embed`` [1, H, W, C], ``rope_global``, ``patch_embed.grid_size``,
  ``pos_drop``, ``patch_drop``, ``norm_pre``, ``neck``; written: ``pos_embed``, ``rope_global``, ``rope_window``
  = None; overridden: ``forward_features``, ``forward_intermediates``.
- Methods overridden on the patched subclass: ``_pos_embed`` (private; Eva's returns ``(x, rope)``),
  ``forward_features``, ``forward_intermediates`` (called through ``super()`` with ``attn_mask=``),
  ``no_weight_decay``, ``group_matcher`` (both extend timm's result).
- Block call convention: every block's ``forward(x, attn_mask=..., is_causal=...)`` passes both on to
  ``block.attn`` (timm >= 1.0.26); Eva blocks also pass ``rope=``. The positions travel in ``attn_mask``;
  a conditional scheme's forward hook on ``blocks[after]`` reads them there (keyword, or second argument).
- Model attributes read: ``blocks``, ``patch_embed``, ``embed_dim``, ``num_prefix_tokens``,
  ``no_embed_class``, ``cls_token`` / ``dist_token`` / ``reg_token``, ``pos_embed``, ``pos_drop``,
  ``patch_drop`` (``prob``, ``num_prefix_tokens``, ``ordered``), ``norm_pre``, ``norm``,
  ``grad_checkpointing``, ``num_classes``, ``pretrained_cfg``; Eva's ``rope`` and ``rope_mixed``. Written:
  ``pos_embed = None``, ``dynamic_img_size = True``, Eva's ``rope = None`` / ``rope_mixed = False``.
- Patch embedding: ``grid_size``, ``dynamic_img_pad``, ``feat_ratio(as_scalar=False)``,
  ``dynamic_feat_size``, ``proj.in_channels``; written: ``flatten = False``, ``output_fmt = Format.NHWC``,
  ``strict_img_size = False`` (``timm.layers.Format``).
- Attention submodules and attributes adopted: ``qkv`` or ``q_proj`` / ``k_proj`` / ``v_proj``, ``q_bias`` /
  ``k_bias`` / ``v_bias``, ``q_norm``, ``k_norm``, ``norm``, ``gate``, ``proj``, ``attn_drop`` (``p``),
  ``proj_drop``; ``num_heads``, ``num_kv_heads``, ``head_dim``, ``scale``, ``fused_attn``,
  ``qkv_bias_separate``.
- RoPE modules (``timm.layers.pos_embed_sincos``: ``RotaryEmbedding``, ``RotaryEmbeddingCat``,
  ``RotaryEmbeddingDinoV3``, ``RotaryEmbeddingMixed``), read to inherit a pretrained RoPE: ``temperature``,
  ``grid_indexing``, ``grid_offset``, ``ref_feat_shape``, ``rotate_half``, ``grid_type`` (1.0.31; absent
  means index grids), ``normalize_coords``, ``min_period`` / ``max_period``, ``shift_coords`` /
  ``jitter_coords`` / ``rescale_coords``, ``freqs`` (RoPE-Mixed, [2, depth, heads, d/2]); and
  ``timm.__version__`` (DINOv3's ``grid_indexing="xy"`` puts x first from 1.0.31 only).
- Functions: ``timm.create_model``; ``timm.layers.patch_dropout.patch_dropout_forward`` (tokens kept, drawn as
  timm draws them); ``timm.models.load_pretrained``, ``load_checkpoint``, ``load_state_dict`` (a patched
  model's weights through timm's loaders).
"""

from __future__ import annotations

from .attention import SUPPORTED_ATTENTION, PatchedAttention
from .inherit import PretrainedPositionsWarning
from .model import PatchedViT, patched_class
from .patching import SUPPORTED_MODELS, create_model, patch

__all__ = [
    "PretrainedPositionsWarning",
    "SUPPORTED_ATTENTION", "SUPPORTED_MODELS", "PatchedAttention", "PatchedViT", "create_model", "patch",
    "patched_class",
]  # fmt: skip
