"""``vispos.patch(transformer, "rope2d")`` on a diffusers transformer (or a pipeline holding one).

What changes on the one transformer it is given (never on diffusers' classes): it gets ``vispos`` (a
``DiffusionPositions``: the model's own positions, recomputed by vispos: ``rotary.AxisRope`` or
``sincos.SinCosTable``), its positional module takes the patched class of ``modules.py`` that computes through them,
and its class becomes the patched one, whose forward reads the timestep. Nothing else: attention processors,
weights and the forward's signature are the host's, so outputs equal the unpatched model's until
``vispos.configure`` sets a scaling.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .._validate import check_bool
from ..host import PositionsHost
from ..positions import Positions
from ..registry import get_info
from .families import FAMILIES, Family, find_transformer
from .modules import ROPE_CLASSES, PatchedPatchEmbed, PatchedTransformer, adopt_positions, patched, set_rope
from .rotary import AxisRope
from .schemes import patch_schemes
from .sincos import SinCosTable

ALREADY_PATCHED = "this transformer is already patched by vispos; patch a fresh one instead"
OWN_SCHEME = {"rope": "rope2d", "sincos": "sincos2d"}


class DiffusionPositions(Positions):
    """``Positions`` of a diffusers transformer: its own RoPE (``rotation``) or sin-cos table (``additive``), which
    the host's modules evaluate; ``vispos.configure`` sets their scaling, training grid and log-n attention."""

    @property
    def rotation(self) -> AxisRope | None:
        return self.attention if isinstance(self.attention, AxisRope) else None

    def follow_scaling_grid(self) -> None:
        if self.log_n_tokens is not None and self.rotation is None:
            self.log_n_tokens = None
            self.settings["log_n_attention"] = False
            raise ValueError(
                "log_n_attention on a sin-cos diffusion transformer (SD3, PixArt, DiT): its attention takes no "
                "rotation to carry the logit scale, and vispos leaves diffusers' attention processors as they are; "
                "it applies to the RoPE transformers (FLUX, FLUX.2, Qwen-Image, Lumina 2)"
            )
        super().follow_scaling_grid()
        if self.rotation is not None:
            self.rotation.log_n_tokens = self.log_n_tokens


def patch(model: Any, pos: str | list[str] | tuple[str, ...], *, inherit: bool = True, **options: Any) -> Any:
    """Keep a diffusers transformer's own positions, recomputed by vispos (``pos``: ``"rope2d"`` for FLUX, FLUX.2,
    Qwen-Image and Lumina 2, ``"sincos2d"`` for SD3, PixArt and DiT), so that ``vispos.configure`` can scale them;
    or, with ``inherit=False`` on DiT and PixArt, put any catalogue scheme (``options``: its own) in their
    self-attention in place of the model's table (``schemes.py``: a model to train).
    ``model``: the transformer or a pipeline (its ``transformer`` is patched). In place; returns ``model``."""
    check_bool("inherit", inherit)
    transformer, family = find_transformer(model)
    if isinstance(transformer, PositionsHost):
        raise ValueError(ALREADY_PATCHED)
    if not inherit:
        _check_fresh(family)
        patch_schemes(transformer, family, pos, options)
        return model
    _check_request(family, pos, inherit, options)
    module = getattr(transformer, family.module)
    depth = sum(1 for m in transformer.modules() if type(m).__name__.endswith("Attention"))
    if family.kind == "rope":
        rope = AxisRope(axes_dim=tuple(module.axes_dim), theta=module.theta, spatial=family.spatial,
                        train_grid=family.train_grid, source=_describe(module))  # fmt: skip
        positions = DiffusionPositions(additive=None, attention=rope, attention_kind="rotary", depth=depth,
                                       num_prefix_tokens=0, train_grid=family.train_grid, schemes=["rope2d"],
                                       options={}, inherited={"from": rope.source})  # fmt: skip
        set_rope(module, rope)
        module.__class__ = patched(type(module), ROPE_CLASSES[family.name])
    else:
        grid = (module.height, module.width)
        table = SinCosTable(dim=module.proj.out_channels, base_size=module.base_size,
                            interpolation_scale=module.interpolation_scale, max_size=module.pos_embed_max_size,
                            train_grid=grid)  # fmt: skip
        positions = DiffusionPositions(additive=table, attention=None, attention_kind="none", depth=depth,
                                       num_prefix_tokens=0, train_grid=grid, schemes=["sincos2d"], options={},
                                       inherited={"from": _describe(module)})  # fmt: skip
        module.__dict__["_vispos_table"] = table
        table.__dict__["_host_embed"] = module  # SD3's stored table, from its checkpoint (not a submodule of the table)
        module.__class__ = patched(type(module), PatchedPatchEmbed)
    adopt_positions(transformer, positions, family.name, PatchedTransformer)
    return model


def _check_request(family: Family, pos: Any, inherit: bool, options: dict[str, Any]) -> None:
    """Refuse, by name, what the diffusers host does not do: another scheme, ``inherit=False``, options."""
    names = [pos] if isinstance(pos, str) else list(pos) if isinstance(pos, (list, tuple)) else None
    if not names or not all(isinstance(n, str) for n in names):
        raise TypeError(f"pos must be a scheme name or a list of names, got {pos!r}")
    for name in names:
        get_info(name, ndim=2)  # an unknown name is refused with the list of schemes
    own = OWN_SCHEME[family.kind]
    if names != [own]:
        fresh = ("" if family.joint is not None else
                 f"; to train {family.name} with {' + '.join(names)} in place of its positions, patch with "
                 "inherit=False")  # fmt: skip
        raise ValueError(
            f"{family.name}: with inherit=True vispos keeps a diffusion transformer's own positions ({own!r} here), "
            f"which its pretrained weights need, and scales them: patch with {own!r}, then "
            f"vispos.configure(transformer, scaling=...){fresh}"
        )
    if options:
        raise ValueError(
            f"{family.name}: options {sorted(options)}: the inherited positions take the model's own settings; set "
            "scaling with vispos.configure(transformer, scaling=..., train_grid=(H, W))"
        )


def _check_fresh(family: Family) -> None:
    """``inherit=False`` (a catalogue scheme in place of the model's positions) where the blocks' self-attention
    holds the image tokens alone; a joint-attention family is refused, saying why."""
    if family.joint is not None:
        takes = ", ".join(name for name, f in FAMILIES.items() if f.joint is None)
        raise ValueError(
            f"{family.name}: inherit=False puts a vispos scheme in the self-attention over image tokens, and this "
            f"model's attention holds {family.joint}: image-image pairs would need the scheme and text pairs the "
            f"family's own positions inside its own processor, which vispos does not rebuild. inherit=False takes "
            f"{takes}; here, patch with {OWN_SCHEME[family.kind]!r} (its own positions) and scale them"
        )


def _describe(module: nn.Module) -> str:
    keys = ("theta", "axes_dim", "scale_rope", "base_size", "interpolation_scale", "pos_embed_max_size")
    said = ", ".join(f"{k}={list(v) if isinstance(v, tuple) else v!r}" for k in keys
                     if (v := getattr(module, k, None)) is not None)  # fmt: skip
    return f"{type(module).__name__}({said})"
