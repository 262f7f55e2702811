"""The class a patched timm ViT takes: the model's own class with vispos's forward on top.

``patch`` sets ``model.__class__`` to ``patched_class(type(model))``, a subclass made once per timm
class (timm's classes themselves are never modified). Its methods read the grid from the input,
build the ``PositionContext`` once per forward and hand it to the blocks through the ``attn_mask``
argument timm already forwards. Being a real class (not methods bound on the instance), a patched
model survives ``copy.deepcopy``, pickling, ``torch.save(model)`` / ``torch.load`` and spawned
workers: pickle finds the class by name in this module, which recreates it on demand.

For torch.fx (timm's ``create_feature_extractor``, torchvision's ``get_graph_node_names``) the grid-
dependent steps are leaf functions (``torch.fx.wrap``): they read sizes as Python numbers, which a
symbolic trace cannot, and run as one graph node each.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.fx
from safetensors import safe_open
from timm.layers.patch_dropout import patch_dropout_forward
from timm.models import clean_state_dict, load_state_dict
from timm.models.eva import Eva
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..host import PositionsHost
from ..positions import PositionContext, Positions, own_records
from .attention import require_context
from .inherit import timm_freqs
from .pruning import PrunesPositions

PREFIX_TOKENS: tuple[str, ...] = ("cls_token", "dist_token", "reg_token")  # timm's order


def token_grid(patch_embed: nn.Module, image: torch.Tensor) -> tuple[int, int]:
    """The token grid a timm patch embedding makes of an image batch [B, C, H, W]."""
    h, w = image.shape[-2:]
    if not patch_embed.dynamic_img_pad:
        sh, sw = patch_embed.feat_ratio(as_scalar=False)  # pixels per token (hybrids: backbone stride x patch)
        if h % sh or w % sw:
            raise ValueError(f"input size {h}x{w} is not divisible by the patch size {sh}x{sw}")
    gh, gw = patch_embed.dynamic_feat_size((h, w))
    return gh, gw


def position_context(
    positions: Positions,
    grid: tuple[int, int],
    tokens: torch.Tensor,
    attn_mask: torch.Tensor | None,
    keep: torch.Tensor | None = None,
) -> PositionContext:
    """The context at ``grid`` on the device of ``tokens``; ``keep``: the patch tokens each row holds."""
    return positions.context(grid, tokens.device, attn_mask, keep)


def drop_patches(drop: nn.Module | None, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """timm's patch dropout (``patch_drop_rate``) on tokens [B, P + HW, C], with the kept patch indices
    [B, K] (None when nothing is dropped: eval mode, no dropout), drawn exactly as timm draws them."""
    if not dropping_patches(drop):
        return x, None
    return patch_dropout_forward(x, drop.prob, drop.num_prefix_tokens, drop.ordered, drop.training)


def dropping_patches(drop: nn.Module | None) -> bool:
    """Whether a model's ``patch_drop`` module drops tokens now (training mode, a positive rate)."""
    return drop is not None and not isinstance(drop, nn.Identity) and drop.training and drop.prob > 0


def embed_tokens(positions: Positions, x: torch.Tensor, prefix: list[torch.Tensor]) -> torch.Tensor:
    """x [B, H, W, C] from the patch embedding, prefix tokens [1, P_i, C] -> [B, P + H*W, C] with positions."""
    b, h, w, c = x.shape
    x = positions.add_to_patches(x.reshape(b, h * w, c), (h, w))
    if not prefix:
        return x
    tokens = torch.cat([t.expand(b, -1, -1) for t in prefix], dim=1)
    return torch.cat((positions.add_to_prefix(tokens), x), dim=1)


def conditional_tokens(x: torch.Tensor, ctx: PositionContext) -> torch.Tensor:
    """Tokens [B, P + H*W, C] after the block a conditional scheme follows -> that scheme's output."""
    require_context(ctx)
    return ctx.positions.apply_conditional(x, ctx)


def after_block(block: nn.Module, args: tuple, kwargs: dict[str, Any], out: torch.Tensor) -> torch.Tensor:
    """Forward hook that ``patch`` puts on ``blocks[after]`` when there is a conditional scheme (peg2d): the
    block's output with the scheme applied, at the grid of the context the block was called with (its
    ``attn_mask``). Every call of the block runs it: ``forward_features`` (gradient checkpointing
    included), timm's ``forward_intermediates``, a loop of one's own over the blocks with the context.
    A module-level function, so copies and pickles of the model carry it."""
    ctx = kwargs["attn_mask"] if "attn_mask" in kwargs else args[1] if len(args) > 1 else None
    return conditional_tokens(out, ctx)


torch.fx.wrap("token_grid")
torch.fx.wrap("position_context")
torch.fx.wrap("drop_patches")
torch.fx.wrap("embed_tokens")
torch.fx.wrap("conditional_tokens")


class PatchedViT(PrunesPositions, PositionsHost):
    """Mixin placed before the timm class: positions from ``self.vispos`` instead of timm's own. Each class made
    with it keeps the signatures of the timm forwards it replaces (``keep_signatures``)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        keep_signatures(cls, next(c for c in cls.__mro__ if c.__module__.startswith("timm.")))

    def no_weight_decay(self) -> set[str]:
        """timm's own (tokens) plus the positional parameters: tables, prefix entries, the cpb2d MLP and
        RoPE-Mixed frequencies are not decayed (as timm, Swin and RoPE-ViT treat theirs); pape2d's projections are
        (as its release trains them, ``PositionsHost.positional_no_weight_decay``)."""
        own = {n for n in super().no_weight_decay() if n != "pos_embed"}  # pos_embed is gone
        return own | self.positional_no_weight_decay()

    def group_matcher(self, coarse: bool = False) -> dict[str, Any]:
        """timm's groups, with per-layer positional parameters in their block, a conditional scheme in the
        block it follows, and the rest in the stem."""
        return positional_groups(super().group_matcher(coarse), self.vispos)

    def vispos_grid(self, image: torch.Tensor) -> tuple[int, int]:
        """The token grid the patch embedding makes of an image batch [B, C, H, W]."""
        return token_grid(self.patch_embed, image)

    def vispos_context(
        self, image: torch.Tensor, attn_mask: torch.Tensor | None = None, keep: torch.Tensor | None = None
    ) -> PositionContext:
        """The positions of one forward pass on ``image`` [B, C, H, W]; ``keep`` [B, K]: the patch tokens each
        row holds when only some are kept (row-major grid indices; ``Positions.context``)."""
        return position_context(self.vispos, token_grid(self.patch_embed, image), image, attn_mask, keep)

    def _pos_embed(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, None]:
        """x [B, H, W, C] from the patch embedding -> tokens [B, P + H*W, C] with positions added."""
        prefix = [t for t in (getattr(self, n, None) for n in PREFIX_TOKENS) if t is not None]
        x = self.pos_drop(embed_tokens(self.vispos, x, prefix))
        return (x, None) if isinstance(self, Eva) else x  # Eva's _pos_embed also returns its rope

    def forward_features(
        self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False
    ) -> torch.Tensor:
        grid = token_grid(self.patch_embed, x)  # refuses a size the patches do not divide, before timm does
        x = self.patch_embed(x)
        x = self._pos_embed(x)
        if isinstance(x, tuple):
            x = x[0]
        x, keep = drop_patches(self.patch_drop, x)  # positions follow the kept tokens
        ctx = position_context(self.vispos, grid, x, attn_mask, keep)
        x = self.norm_pre(x)
        for blk in self.blocks:
            if self.grad_checkpointing and torch.is_grad_enabled():
                x = checkpoint(blk, x, attn_mask=ctx, is_causal=is_causal, use_reentrant=False)
            else:
                x = blk(x, attn_mask=ctx, is_causal=is_causal)
        return self.norm(x)

    def forward_intermediates(self, x: torch.Tensor, *args: Any, attn_mask=None, **kwargs: Any):  # noqa: ANN001
        if dropping_patches(self.patch_drop):
            raise ValueError(
                "forward_intermediates with patch dropout in training mode would lose the kept tokens' "
                "positions; call it in eval mode (model.eval()) or use forward / forward_features"
            )
        return super().forward_intermediates(x, *args, attn_mask=self.vispos_context(x, attn_mask), **kwargs)


def positional_groups(timm_matcher: Mapping[str, Any], positions: Positions) -> dict[str, Any]:
    """A timm ``group_matcher`` result with the positional parameters placed: per-layer ones in their block,
    a conditional scheme in the block it follows, the rest in the stem."""
    matcher = dict(timm_matcher)
    matcher["stem"] = rf"{matcher['stem']}|^vispos\.additive|^vispos\.attention\.(?!\d)"
    blocks = matcher["blocks"]
    per_layer = r"^vispos\.attention\.(\d+)"
    matcher["blocks"] = [(per_layer, None), *blocks] if isinstance(blocks, list) else rf"{blocks}|{per_layer}"
    conditional = positions.conditional
    if conditional is not None and isinstance(blocks, list):
        matcher["blocks"].insert(0, (r"^vispos\.conditional\.", (conditional.after,)))
    elif conditional is not None:  # a single regex cannot name a fixed block: the stem
        matcher["stem"] += r"|^vispos\.conditional\."
    return matcher


def adopt_timm_checkpoint(model: PatchedViT, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    """``load_state_dict`` pre-hook: a plain timm checkpoint (no vispos entries) keeps its learned
    ``pos_embed`` when the scheme can hold it (learned2d adopts it); otherwise strict loading is refused
    rather than dropping it silently, and ``strict=False`` reports it as unexpected (moving a backbone to
    another scheme). The model's own vispos settings stay."""
    if any(k.startswith(f"{prefix}vispos.") for k in state_dict):
        return  # a vispos checkpoint: its settings are checked by Positions._load_from_state_dict
    state_dict.update(own_records(model.vispos, f"{prefix}vispos."))  # settings records: the model's own
    _adopt_rope_freqs(model, state_dict, prefix)
    key = next((k for k in (f"{prefix}pos_embed", f"{prefix}embeds.pos_embed") if k in state_dict), None)
    if key is None:
        return
    table = state_dict[key]
    if table.dim() == 4:  # NaFlexVit's [1, H, W, C]
        table = table.flatten(1, 2)
    additive = model.vispos.additive
    adopt = getattr(additive, "adopt_pos_embed", None)
    if adopt is None or not adopt(table):
        refuse_unplaced(model, f"timm's own pos_embed {tuple(table.shape)}",
                        "load the checkpoint before patching (model.load_state_dict(...), then vispos.patch(model, "
                        "...)), patch with learned2d to keep it, or load with strict=False to take every other weight "
                        "and start the positions fresh")  # fmt: skip
        return  # reported by load_state_dict as an unexpected key
    del state_dict[key]
    for name, value in additive.state_dict().items():  # the adopted table, under the patched model's keys
        state_dict[f"{prefix}vispos.additive.{name}"] = value


# the end of a family hook's advice to ``refuse_unplaced``, after its own "patch with ... to keep it, "
LOAD_ADVICE = "load it before patching, or load with strict=False to take every other weight"


def refuse_unplaced(model: nn.Module, what: str, advice: str) -> None:
    """A plain timm checkpoint holds ``what``, which this model's scheme has no place for: a ``ValueError``
    (saying so, then ``advice``) when loading strictly; else nothing, the caller leaves the keys in the state
    dict and ``load_state_dict(strict=False)`` reports them as unexpected."""
    if model.vispos.strict_loading:
        raise ValueError(f"this checkpoint holds {what}, which this model ({_scheme_names(model)}) has no place for: "
                         f"{advice}")  # fmt: skip


def adopt_and_match(
    model: nn.Module, state_dict: dict[str, Any], prefix: str, pattern: re.Pattern[str]
) -> dict[str, re.Match[str]] | None:
    """A family hook's start: None for a vispos checkpoint (``Positions`` checks it); for a plain timm one,
    ``adopt_timm_checkpoint`` (settings records: the model's own), then its keys under ``prefix`` that
    ``pattern`` matches (after the prefix), each with its match."""
    if any(k.startswith(f"{prefix}vispos.") for k in state_dict):
        return None
    adopt_timm_checkpoint(model, state_dict, prefix)
    found = {k: pattern.match(k[len(prefix) :]) for k in state_dict if k.startswith(prefix)}
    return {k: m for k, m in found.items() if m is not None}


def _adopt_rope_freqs(model: PatchedViT, state_dict: dict[str, Any], prefix: str) -> None:
    """timm's RoPE-Mixed ``rope.freqs`` [2, depth, heads, d/2] -> each layer's ``vispos.attention.i.freqs``,
    when this model inherited a RoPE-Mixed (else the key stays, and loading reports it as unexpected)."""
    inherited = model.vispos.settings.get("inherited") or {}
    key = f"{prefix}rope.freqs"
    if key not in state_dict or "freqs_order" not in inherited:
        return
    freqs = timm_freqs(state_dict.pop(key), inherited["freqs_order"])
    for i in range(freqs.shape[1]):
        state_dict[f"{prefix}vispos.attention.{i}.freqs"] = freqs[:, i]


def _scheme_names(model: PatchedViT) -> str:
    return " + ".join(model.vispos.settings["pos"])


# where a checkpoint file keeps an EMA of its weights: timm's train.py, timm's ModelEma users, vispos's trainer
# (train.ema); and its weights, as timm's load_state_dict looks for them
EMA_KEYS: tuple[str, ...] = ("state_dict_ema", "model_ema", "ema")
WEIGHT_KEYS: tuple[str, ...] = ("state_dict", "model")


def patched_weights(file: str | Path, *, use_ema: bool = True) -> dict[str, Any] | None:
    """The weights of a checkpoint file when they are a patched model's (``vispos.`` keys), else None.

    A ``.safetensors`` file is the state dict itself. A torch file may hold several entries, picked as
    timm's ``load_state_dict`` picks them, with the trainer's ``ema`` read beside timm's EMA entries: with
    ``use_ema`` the EMA of the weights when the file has one (what a run with ``train.ema`` evaluated and
    reported), else its weights (``state_dict``, ``model``); a file of neither is the state dict itself."""
    file = Path(file)
    if file.suffix.lower() in (".npz", ".npy"):  # JAX weights: never a patched model's
        return None
    if file.suffix == ".safetensors":
        with safe_open(file, framework="pt") as f:
            if not any(k.startswith("vispos.") for k in f.keys()):  # noqa: SIM118 (safe_open has no __iter__)
                return None
        return load_state_dict(str(file))
    checkpoint = torch.load(file, map_location="cpu", weights_only=True)
    if isinstance(checkpoint, dict):
        keys = (*EMA_KEYS, *WEIGHT_KEYS) if use_ema else WEIGHT_KEYS
        key = next((k for k in keys if isinstance(checkpoint.get(k), Mapping)), None)
        checkpoint = checkpoint if key is None else checkpoint[key]
    if not isinstance(checkpoint, Mapping) or not any(str(k).startswith("vispos.") for k in checkpoint):
        return None
    return clean_state_dict(dict(checkpoint))


_CLASSES: dict[type, type] = {}
_PREFIX = "Patched["


def _pickle_name(base: type) -> str:
    """A name without dots (pickle splits on them) that says which timm class to rebuild."""
    return f"{_PREFIX}{base.__module__.replace('.', '/')}:{base.__qualname__.replace('.', '/')}]"


SIGNED = ("forward", "forward_features", "forward_intermediates")  # the forwards a patched class may replace


def keep_signatures(cls: type, base: type) -> type:
    """Give each forward that ``cls`` replaces (``SIGNED``) the signature of ``base``'s, which tools read
    (``inspect.signature``: timm's feature wrappers, transformers' ``Trainer``): a function of ``cls``'s own that
    calls the replacement, so that one replacement shared by several patched classes keeps each base's."""
    for name in SIGNED:
        impl, replaced = getattr(cls, name, None), getattr(base, name, None)
        if impl is not None and replaced is not None and impl is not replaced:
            setattr(cls, name, _signed(impl, replaced, f"{cls.__qualname__}.{name}"))
    return cls


def _signed(impl: Any, replaced: Any, qualname: str) -> Any:
    def method(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return impl(self, *args, **kwargs)

    method.__signature__ = inspect.signature(replaced)  # type: ignore[attr-defined]
    method.__name__, method.__qualname__, method.__doc__ = replaced.__name__, qualname, impl.__doc__
    return method


def patched_class(base: type) -> type:
    """The patched subclass of ``base`` (one per class, so pickle finds the very same object)."""
    cls = _CLASSES.get(base)
    if cls is None:
        name = _pickle_name(base)
        cls = type(base.__name__, (PatchedViT, base), {"__module__": __name__, "__qualname__": name})
        _CLASSES[base] = cls
    return cls


def __getattr__(name: str) -> type:  # module attribute lookup: how pickle finds a patched class
    if not (name.startswith(_PREFIX) and name.endswith("]")):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, qualname = name[len(_PREFIX) : -1].split(":")
    base: Any = importlib.import_module(module.replace("/", "."))
    for part in qualname.split("/"):
        base = getattr(base, part)
    return patched_class(base)
