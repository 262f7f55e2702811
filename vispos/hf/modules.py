"""The classes a patched transformers model's modules take: each original class with vispos's forward on top.

``patch`` sets ``module.__class__ = patched(type(module), Mixin)`` on the modules of the one model it is
given (transformers' classes are never modified; a CLIP text tower keeps its attention class):

- the vision host (``ViTModel``, ``CLIPVisionModel``...): ``PatchedHost`` builds the positional context once
  per forward from the image grid and hands it to every layer as the ``vispos_context`` keyword, which
  transformers' layers pass on to their attention with their other keywords;
- its ``embeddings``: ``PatchedEmbeddings`` makes patch tokens at any size divisible by the patch size, adds
  an additive scheme's table (``interpolate_pos_encoding`` is no longer needed, and ignored) and puts the
  family's prefix and register tokens first;
- each attention: ``PatchedAttention`` projects as the original, applies the layer's rotation and bias and
  calls transformers' own attention function for ``config._attn_implementation`` (eager, sdpa, flex, flash),
  so ``output_attentions`` and the kernels behave as in transformers;
- DINOv3's ``rope_embeddings``, Pixtral's ``patch_positional_embedding``: ``NoRope`` (their RoPE is vispos's
  ``rope2d`` now);
- a VLM's vision tower: ``PatchedTower`` (Pixtral) and ``PatchedMergedTower`` (Qwen2-VL) hand transformers' own
  forward the context of its packed sequence, ``PatchedPackedAttention`` is Qwen2-VL's attention over it
  (``tower_modules.py``, patched by ``towers.py``).

A patched class is made once per (class, mixin) and found again by pickle by its name in this module. It is
transformers' code as far as transformers can tell (``is_custom_code`` is its base's: the family's checkpoint
conversions apply on saving and loading), and it is never built directly: ``type(model)(config)`` and
``type(model).from_pretrained(...)`` are refused, naming ``vispos.hf.from_pretrained``.
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Any

import torch
from torch import nn

from ..attention import as_float_mask, combine_masks, flex_bias_attention, query_mask, sdpa, widened
from ..host import named_base
from ..positions import PositionContext, Positions
from .families import FAMILIES, naflex_layout, patch_conv, token_grid
from .table_init import stand_in
from .tower_modules import (
    PatchedMergedTower,
    PatchedPackedAttention,
    PatchedTower,
    PatchedWindowedTower,
    PositionsHost,
    TowerTable,
    init_positions,
    require_context,
)

FLASH_REFUSAL = (
    "a bias scheme adds a bias to every attention logit, which flash attention kernels do not take: use "
    "attn_implementation='sdpa' (or 'eager', 'flex_attention'), e.g. model.set_attn_implementation('sdpa')"
)


class PatchedHost(PositionsHost):
    """Mixin placed before the transformers vision model class: positions from ``self.vispos``."""

    def vispos_context(self, pixel_values: torch.Tensor) -> PositionContext:
        """The positions of one forward pass on ``pixel_values`` [B, C, H, W]."""
        grid = token_grid(patch_conv(self.embeddings), pixel_values)
        return self.vispos.context(grid, pixel_values.device)

    def vispos_ragged_context(self, pixel_values: torch.Tensor, spatial_shapes: torch.Tensor) -> PositionContext:
        """SigLIP 2: the positions of a batch of pre-cut patches [B, N, C * p * p], each row one image of size
        ``spatial_shapes`` [B, 2] (its patches row-major, then padding): each image its own grid's."""
        cells, valid = naflex_layout(spatial_shapes, pixel_values.shape[1])
        return self.vispos.ragged_context(cells, spatial_shapes.long(), valid=valid)

    def forward(self, pixel_values: torch.Tensor | None = None, *args: Any, **kwargs: Any) -> Any:
        if pixel_values is None:
            raise ValueError("a vispos-patched model needs pixel_values")
        kwargs.pop("interpolate_pos_encoding", None)  # any size works; the flag would reach transformers' checks
        if not FAMILIES[self.embeddings.vispos_family].naflex:
            return super().forward(pixel_values, *args, vispos_context=self.vispos_context(pixel_values), **kwargs)
        shapes = kwargs["spatial_shapes"] if "spatial_shapes" in kwargs else args[1] if len(args) > 1 else None
        if shapes is None:
            raise ValueError("a patched SigLIP 2 model needs spatial_shapes [B, 2], as its processor returns them")
        ctx = self.vispos_ragged_context(pixel_values, shapes)
        self.embeddings.__dict__["_vispos_context"] = ctx  # for the additive table, which needs the layout
        try:
            return super().forward(pixel_values, *args, vispos_context=ctx, **kwargs)
        finally:
            self.embeddings.__dict__.pop("_vispos_context", None)

    def _initialize_weights(self, module: nn.Module, *args: Any, **kwargs: Any) -> None:
        """transformers' init step of one module (``initialize_weights`` takes each module of the host, children
        first): on the embeddings, with a stand-in of the table the positions hold now (``table_init``); a table
        module (CLIP, SigLIP) is visited first, as transformers visits it, the embeddings' last child."""
        if not isinstance(module, PatchedEmbeddings) or getattr(module, "_is_hf_initialized", False):
            super()._initialize_weights(module, *args, **kwargs)  # type: ignore[misc]
            return
        with stand_in(module, self.vispos) as table:
            if isinstance(table, nn.Module):
                super()._initialize_weights(table, *args, **kwargs)  # type: ignore[misc]
            super()._initialize_weights(module, *args, **kwargs)  # type: ignore[misc]

    def _init_weights(self, module: nn.Module) -> None:
        """transformers' init of one module (``initialize_weights``, a load with missing weights, a meta-device
        build): the family's own, with a stand-in for the table the positions hold now where it is not in place
        yet; vispos's modules are initialised as vispos initialises them (``init_positions``)."""
        if init_positions(self, module):
            return
        if not isinstance(module, PatchedEmbeddings):
            super()._init_weights(module)  # type: ignore[misc]
            return
        with stand_in(module, self.vispos):
            super()._init_weights(module)  # type: ignore[misc]


class PatchedEmbeddings:
    """Mixin placed before a family's embeddings class: patch tokens at any size, vispos's additive table."""

    vispos_family: str

    @property
    def vispos_positions(self) -> Positions:
        return self.__dict__["_vispos_positions"]  # the host's, held without registering it a second time

    def forward(self, pixel_values: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Tokens of ``pixel_values`` with positions; ``bool_masked_pos`` (second argument or keyword) as the
        family takes it; ``interpolate_pos_encoding`` ignored (any size works); SigLIP 2's ``spatial_shapes``
        are read by the host, which hands this module the batch's layout."""
        family, positions = FAMILIES[self.vispos_family], self.vispos_positions
        bool_masked_pos = None if family.naflex else kwargs.get("bool_masked_pos", args[0] if args else None)
        if family.naflex:  # pre-cut patches [B, N, C * p * p]; the table at each image's own grid
            ctx = self.__dict__.get("_vispos_context")
            if ctx is None:
                raise ValueError("patched SigLIP 2 embeddings take their positions from the model's forward: call "
                                 "the model")  # fmt: skip
            x = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
            return positions.add_to_ragged(x, ctx)
        conv = patch_conv(self)
        grid = token_grid(conv, pixel_values)
        x = conv(pixel_values.to(conv.weight.dtype)).flatten(2).transpose(1, 2)  # [B, H*W, C]
        if bool_masked_pos is not None:
            token = self.mask_token.reshape(1, 1, -1).to(x.dtype)
            x = torch.where(bool_masked_pos.bool()[..., None], token, x)
        x = positions.add_to_patches(x, grid)
        b, c = x.shape[0], x.shape[-1]
        parts = []
        if family.prefix:
            prefix = torch.cat([getattr(self, n).reshape(1, -1, c) for n in family.prefix], dim=1).to(x.dtype)
            parts.append(positions.add_to_prefix(prefix.expand(b, -1, -1)))
        if family.registers is not None:
            parts.append(getattr(self, family.registers).to(x.dtype).expand(b, -1, -1))
        x = torch.cat((*parts, x), dim=1)
        dropout = getattr(self, "dropout", None)
        return dropout(x) if isinstance(dropout, nn.Module) else x


class NoRope:
    """Mixin for DINOv3's ``rope_embeddings`` and Pixtral's ``patch_positional_embedding``: their rotation is
    vispos's now, so they compute nothing."""

    def forward(self, *args: Any, **kwargs: Any) -> None:
        return None

class PatchedAttention:
    """Mixin placed before a family's attention class: its projections, vispos's positions, transformers'
    attention function."""

    vispos_layer: int

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: Any = None,  # DINOv3's own RoPE: not used (vispos's rope2d replaces it)
        vispos_context: PositionContext | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        ctx = require_context(vispos_context)
        ctx.check_tokens(hidden_states)
        b, n, _ = hidden_states.shape
        q, k, v = (
            proj(hidden_states).view(b, n, -1, self.head_dim).transpose(1, 2)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        impl = self.config._attn_implementation or "eager"
        dropout = self.attention_dropout if hasattr(self, "attention_dropout") else self.dropout
        dropout = dropout if self.training else 0.0
        scaling = self.scaling if hasattr(self, "scaling") else self.scale
        flex = ctx.flex(self.vispos_layer) if attention_mask is None else None
        if flex is not None and dropout == 0.0 and _flex_runs(q):  # vispos.configure(attention="flex")
            q = q * ctx.logit_scale if ctx.logit_scale != 1.0 else q
            out, weights = flex_bias_attention(q.contiguous(), k, v, flex, scale=scaling).transpose(1, 2), None
        else:
            rotary, mask = ctx.layer(self.vispos_layer, inputs=hidden_states)
            if rotary is not None:
                q, k = rotary.rotate(q, k)
            mask = query_mask(mask, q)
            if mask is not None and "flash" in impl:
                raise ValueError(f"{ctx.positions.settings['pos']} with attn_implementation={impl!r}: {FLASH_REFUSAL}")
            if mask is not None:
                given = attention_mask if isinstance(attention_mask, torch.Tensor) else None
                mask = combine_masks(mask, as_float_mask(given, torch.float32)).to(q.dtype)
            else:
                mask = attention_mask
            if impl == "flex_attention" and isinstance(mask, torch.Tensor):
                # transformers' flex function reads a dense float mask per element (and crashes on CPU in
                # torch 2.14); SDPA takes it fused. vispos.configure(attention="flex") gives the flex kernel.
                out, weights = sdpa(q, k, v, mask=mask, dropout_p=dropout, scale=scaling * ctx.logit_scale), None
                out = out.transpose(1, 2)
            else:
                attend = _attention_function(self, impl)
                out, weights = attend(self, q, k, widened(v, q), mask, dropout=dropout,
                                      scaling=scaling * ctx.logit_scale, **kwargs)  # fmt: skip
                out = out[..., : self.head_dim]  # [B, N, heads, head_dim]: a widened v's zero channels dropped
        out = out.reshape(b, n, -1).contiguous()
        proj = self.o_proj if hasattr(self, "o_proj") else self.out_proj
        return proj(out), weights


def _flex_runs(q: torch.Tensor) -> bool:
    """Where vispos's FlexAttention path runs in torch 2.14: GPUs; on CPU eager inference only."""
    return q.device.type != "cpu" or (not torch.is_grad_enabled() and not torch.compiler.is_compiling())


def _attention_function(module: nn.Module, impl: str) -> Any:
    """transformers' attention function for ``impl``; eager: the one of the module's own modeling file (their
    softmax dtypes differ: ViT's and CLIP's in fp32, DINOv2's in the input's)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    eager = _eager_function(type(module))
    return eager if impl == "eager" else ALL_ATTENTION_FUNCTIONS.get_interface(impl, eager)


@functools.cache
def _eager_function(cls: type) -> Any:
    """The ``eager_attention_forward`` of the modeling file of a (patched) attention class, found once per class."""
    base = next(c for c in cls.__mro__ if c.__module__.startswith("transformers."))
    return sys.modules[base.__module__].eager_attention_forward


MIXINS: dict[str, type] = {
    m.__name__: m
    for m in (PatchedHost, PatchedEmbeddings, PatchedAttention, NoRope, TowerTable, PatchedTower, PatchedMergedTower,
              PatchedWindowedTower, PatchedPackedAttention)
}
_CLASSES: dict[tuple[type, type], type] = {}
_PREFIX = "Patched["


NOT_BUILT = (
    "{name} is the class of a vispos-patched model, which is never built from a config: build {base} and patch it "
    "with vispos.patch, or load a patched model saved with save_pretrained with vispos.hf.from_pretrained(folder)"
)


def patched(base: type, mixin: type) -> type:
    """The subclass of transformers' ``base`` with ``mixin`` before it (one per pair, so pickle finds it)."""
    cls = _CLASSES.get((base, mixin))
    if cls is None:
        where = f"{base.__module__.replace('.', '/')}:{base.__qualname__.replace('.', '/')}"
        name = f"{_PREFIX}{mixin.__name__}:{where}]"
        namespace: dict[str, Any] = {"__module__": __name__, "__qualname__": name}
        if hasattr(base, "from_pretrained"):  # a PreTrainedModel: transformers' own, as its base is
            namespace |= {"__init__": _refusing(base.__init__), "from_pretrained": classmethod(_not_built),
                          "forward": _same_signature(mixin, base)}  # fmt: skip
            if hasattr(base, "is_custom_code"):
                namespace["is_custom_code"] = classmethod(_base_is_custom_code)
        cls = type(base.__name__, (mixin, base), namespace)
        _CLASSES[(base, mixin)] = cls
    return cls


def _same_signature(mixin: type, base: type) -> Any:
    """The mixin's forward, with the signature of the base's that it replaces (what transformers' tests and its
    ``Trainer`` read: ``remove_unused_columns`` keeps the inputs the forward names)."""
    impl = mixin.forward

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return impl(self, *args, **kwargs)

    forward.__signature__ = inspect.signature(base.forward)  # type: ignore[attr-defined]
    forward.__doc__ = impl.__doc__
    return forward


def _refusing(init: Any) -> Any:
    """A constructor that refuses (``_not_built``) with the signature of the one it stands for: what reads the
    options a model class takes (transformers' tests: ``use_mask_token``) reads the family's."""

    def __init__(self: nn.Module, *args: Any, **kwargs: Any) -> None:  # noqa: N807
        _not_built(self, *args, **kwargs)

    __init__.__signature__ = inspect.signature(init)  # type: ignore[attr-defined]
    return __init__


def _base(cls: type) -> type:
    return next(c for c in cls.__mro__ if c.__module__.startswith("transformers."))


def _base_is_custom_code(cls: type) -> bool:
    return _base(cls).is_custom_code()


def _not_built(self_or_cls: Any, *args: Any, **kwargs: Any) -> None:
    cls = self_or_cls if isinstance(self_or_cls, type) else type(self_or_cls)
    raise TypeError(NOT_BUILT.format(name=f"type(model) ({cls.__name__})", base=f"transformers' {_base(cls).__name__}"))


def __getattr__(name: str) -> type:  # module attribute lookup: how pickle finds a patched class
    found = named_base(name, _PREFIX)
    if found is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    mixin, base = found
    return patched(base, MIXINS[mixin])
