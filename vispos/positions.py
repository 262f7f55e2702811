"""The positional part of a patched 2D model, independent of any model library.

``Positions`` holds at most one additive, one attention and one conditional scheme and builds, once per
forward and from the actual patch grid, a ``PositionContext``: what every layer's attention needs
(rotations, additive masks, a logit scale). Hosts (the timm adapter) hand that context to their attention
layers, and apply the conditional scheme (``apply_conditional``) to the tokens after its block.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import asdict, dataclass, is_dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ._state import encode, options_as_written, read
from ._validate import check_grid
from .attention import FlexBias, as_float_mask, combine_masks, offset_score_mod
from .encodings.relbias import bias_mask, prefixed_offset_index, with_prefix_entries
from .encodings.rope import Rotary
from .encodings.rope_scaling import canonical_scaling
from .ragged import QueryScaled, RaggedLayout, concat_rotations, ragged_conditional, ragged_layout
from .registry import get_info


@dataclass
class PositionContext:
    """The positions of one forward pass at one grid; ``layer(i)`` gives layer i's rotation and mask."""

    positions: Positions
    grid: tuple[int, int]
    device: torch.device
    user_mask: torch.Tensor | None  # the caller's attn_mask, as an additive float mask
    shared: Rotary | torch.Tensor | None  # the output of a scheme shared by every layer, computed once
    logit_scale: float = 1.0  # extra temperature on every logit (log-n attention scaling)
    bias_index: torch.Tensor | None = None  # where each token pair reads its bias (bias schemes), int32
    tokens: torch.Tensor | None = None  # [B, M]: which of the P + HW tokens each row holds (a subset), or all
    ragged: RaggedLayout | None = None  # per-token images, cells and grid sizes (``Positions.ragged_context``)
    query_scale: torch.Tensor | None = None  # [B, 1, T, 1]: per-token logit scale (log-n, ragged batches)
    caller_mask: bool = False  # the caller gave a mask of its own (a ragged context keeps FlexAttention off)
    grid_tensor: torch.Tensor | None = None  # (H, W) on the device, for FlexAttention's score_mod: made once
    stacked: Rotary | None = None  # a per-layer rotation evaluated for every layer at once, [layers, ...]

    def layer(self, index: int) -> tuple[Rotary | QueryScaled | None, torch.Tensor | None]:
        """(rotation: cos/sin [(heads,) N, d] or None, additive mask [1, heads, N, N] or the caller's mask; a
        query-dependent bias comes as a ``QueryBias`` in the mask's place, ``query_mask`` gives its mask).
        For a token subset (``tokens``) or a ragged batch (``ragged``), rotations [B, heads or 1, M, d] and
        masks [B, heads or 1, M, M]; a per-token logit scale comes as a ``QueryScaled`` rotation."""
        return self.positions.layer(self, index)

    def flex(self, index: int) -> FlexBias | None:
        """Layer ``index``'s relative bias as FlexAttention takes it (a score_mod reading the bias per offset,
        a block mask for ragged batches) when it attends through FlexAttention (``vispos.configure(model,
        attention="flex")``); None when it uses SDPA."""
        return self.positions.flex(self, index)

    def check_tokens(self, x: torch.Tensor) -> None:
        """Refuse tokens x [B, T, C] this context was not built for: another number of tokens per row, or
        (a ragged batch, a token subset: built per row) another number of rows."""
        p = self.positions.num_prefix_tokens
        if self.ragged is not None:
            rows, count = self.ragged.image.shape
            built = f"a ragged batch of {rows} row(s) of {count} tokens"
        elif self.tokens is not None:
            rows, count = self.tokens.shape
            built = f"a token subset of {rows} row(s) of {count} tokens ({p} prefix + {count - p} kept)"
        else:
            rows, count = None, p + self.grid[0] * self.grid[1]
            built = f"{count} tokens ({p} prefix + a {self.grid[0]}x{self.grid[1]} grid)"
        b, t = x.shape[0], x.shape[1]
        if t != count or (rows is not None and b != rows):
            raise ValueError(
                f"the positional context was built for {built}, the attention got {b} row(s) of {t} tokens: build "
                "the context for the tokens the blocks see (the grid, keep= or the ragged batch of these rows)"
            )


def plain(value: Any) -> Any:
    """Settings as plain data (dicts, lists, numbers, strings), safe for ``torch.load(weights_only=True)``."""
    if is_dataclass(value) and not isinstance(value, type):
        return plain(asdict(value))
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def canonical_options(schemes: list[str], options: dict[str, Any]) -> dict[str, Any]:
    """Every option of ``schemes`` with its value in use: the defaults filled in, scalings in one form
    (``canonical_scaling``: every field, the type's defaults filled in). Two settings that build the same
    positions have the same canonical options; a settings record holds them, so that a later change of a
    default cannot reinterpret a checkpoint."""
    full: dict[str, Any] = {}
    for name in schemes:
        params = inspect.signature(get_info(name, ndim=2).builder).parameters
        full |= {k: p.default for k, p in params.items() if p.default is not inspect.Parameter.empty}
    full |= options
    if full.get("scaling") is not None:  # a type name, a dict or a RopeScaling: as a dict of every field
        full["scaling"] = canonical_scaling(full["scaling"])
    return plain(full)


def same_positions(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two settings records describe the same schemes with the same options (any training grid)."""
    return list(a["pos"]) == list(b["pos"]) and canonical_options(a["pos"], a["options"]) == canonical_options(
        b["pos"], b["options"]
    )


def position_differences(saved: dict[str, Any], own: dict[str, Any]) -> str:
    """What differs between a checkpoint's settings and a model's: the schemes, else each option by name."""
    if list(saved["pos"]) != list(own["pos"]):
        return f"schemes {' + '.join(saved['pos'])} in the checkpoint, {' + '.join(own['pos'])} in this model"
    a, b = canonical_options(saved["pos"], saved["options"]), canonical_options(own["pos"], own["options"])
    names = differing_options(saved, own)
    return ", ".join(f"{k}: {a.get(k)!r} in the checkpoint, {b.get(k)!r} in this model" for k in names)


def differing_options(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The options two settings of the same schemes set to different values (canonically, ``canonical_options``);
    none for settings of other schemes."""
    if list(a["pos"]) != list(b["pos"]):
        return []
    x, y = canonical_options(a["pos"], a["options"]), canonical_options(b["pos"], b["options"])
    return sorted(k for k in x.keys() | y.keys() if x.get(k) != y.get(k))


def _saved_state(record: torch.Tensor | dict[str, Any]) -> dict[str, Any]:
    """A Positions record's state, its options as the vispos that wrote it meant them (``options_as_written``:
    older records hold only the options given, read at that version's defaults)."""
    state, version = read(record)
    settings = state["settings"]
    options = options_as_written(settings["pos"], settings["options"], version)
    return {**state, "settings": {**settings, "options": options}}


def _follow_scaling_grid(module: Positions, incompatible_keys: Any) -> None:
    """``load_state_dict``'s post hook: once the scheme modules have read their own records (a rope2d's holds the
    grid of the checkpoint's scaling), every inference setting follows the model's one training grid."""
    module.follow_scaling_grid()


def _with_configured_grid(settings: dict[str, Any], saved_grid: list[int]) -> dict[str, Any]:
    """Settings whose scaling record holds its grid (``"train_grid"``, as configure wrote it before the grid had
    a key of its own) -> that grid as ``configured_train_grid`` when it differs from the checkpoint's training
    grid (it was given to configure), else dropped (it was the model's grid, which the model keeps)."""
    scaling = settings.get("scaling")
    if not isinstance(scaling, dict) or "train_grid" not in scaling:
        return settings
    scaling = dict(scaling)
    grid = list(scaling.pop("train_grid"))
    given = {} if grid == list(saved_grid) else {"configured_train_grid": grid}
    return {**given, **settings, "scaling": scaling}


def _kept_indices(mask: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """A bool keep mask [B, H*W] (True: the patch is kept) -> its kept patch indices [B, K], ascending (the
    order ``x[mask].view(B, K, C)`` leaves the tokens in). Every row must keep as many patches."""
    b, n = mask.shape
    if n != grid[0] * grid[1]:
        raise ValueError(
            f"a bool keep mask must be [B, H*W] = [B, {grid[0] * grid[1]}] for the {grid[0]}x{grid[1]} grid "
            f"(True: kept), got [{b}, {n}]; pass kept patch indices [B, K] otherwise"
        )
    counts = mask.sum(dim=1)
    if not torch.compiler.is_compiling() and bool((counts != counts[:1]).any()):
        raise ValueError(f"a bool keep mask must keep as many patches in every row, got {counts.tolist()}")
    return mask.nonzero()[:, 1].view(b, -1)  # [B, K]: row-major, as the mask is read


def _describe(settings: dict[str, Any], differing: set[str]) -> str:
    """``schemes(options) at a HxW training grid``, naming the options of ``settings`` that differ from the
    schemes' current defaults or are among the ``differing`` ones (a record holds every option, a model the
    ones it was given)."""
    defaults = canonical_options(settings["pos"], {})
    shown = [(k, v) for k, v in sorted(settings["options"].items())
             if k in differing or k not in defaults or defaults[k] != v]  # fmt: skip
    options = ", ".join(f"{k}={v!r}" for k, v in shown)
    h, w = settings["train_grid"]
    return f"{' + '.join(settings['pos'])}({options}) at a {h}x{w} training grid"


class Positions(nn.Module):
    """The positional scheme of a patched model: at most one additive, one attention and one conditional scheme
    (``conditional``: applied by the host to the tokens after one block, ``apply_conditional``).

    ``settings`` says which schemes, with which options, at which training grid (and, once
    ``vispos.configure`` has run, the inference settings; ``inherited`` names the pretrained RoPE whose
    conventions the options reproduce). ``enabled`` switches the whole scheme off
    (DroPE) and back on; ``log_n_tokens`` is the training token count while log-n attention scaling
    is on. All of it is saved in the state dict and restored by ``load_state_dict``, which refuses a
    checkpoint of another scheme or other options.

    One training grid: ``train_grid`` is the grid the model was patched at, kept when a checkpoint made at
    another grid loads (its tables are resampled to it). RoPE scaling and log-n scaling are relative to
    ``scaling_grid``: that grid, or the one given to ``vispos.configure(train_grid=...)``, recorded as
    ``settings["configured_train_grid"]`` and kept through saving and loading.
    """

    def __init__(
        self,
        *,
        additive: nn.Module | None,
        attention: nn.Module | nn.ModuleList | None,
        attention_kind: str,
        depth: int,
        num_prefix_tokens: int,
        train_grid: tuple[int, int],
        schemes: list[str],
        options: dict[str, Any],
        inherited: dict[str, str] | None = None,
        conditional: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.additive = additive
        self.attention = attention
        self.conditional = conditional  # tokens after block ``conditional.after`` (peg2d); None: no such scheme
        self.attention_kind = attention_kind
        self.depth = depth
        self.num_prefix_tokens = num_prefix_tokens
        self.train_grid = check_grid(train_grid, "train_grid")
        self.settings: dict[str, Any] = {"pos": list(schemes), "options": plain(options), "train_grid": self.train_grid}
        if inherited is not None:
            self.settings["inherited"] = inherited  # where the options came from: the model's own RoPE
        self.enabled = True
        self.log_n_tokens: int | None = None
        # ``load_state_dict``'s strict flag (torch hands modules strict=True whatever the caller said);
        # the host sets it for the duration of a load
        self.strict_loading = True
        self.register_load_state_dict_post_hook(_follow_scaling_grid)  # after the scheme modules' own records

    def get_extra_state(self) -> torch.Tensor:
        """The settings as a tensor record (``vispos._state``): the state dict holds tensors only. The options
        are recorded with every default filled in (``canonical_options``)."""
        options = canonical_options(self.settings["pos"], self.settings["options"])
        settings = {**self.settings, "options": options, "train_grid": list(self.train_grid)}
        return encode({"settings": plain(settings), "enabled": int(self.enabled), "log_n_tokens": self.log_n_tokens})

    def set_extra_state(self, state: torch.Tensor | dict[str, Any]) -> None:
        state = _saved_state(state)
        # the model keeps its own options as it was given them (``load_state_dict`` has checked that they are
        # the checkpoint's, ``same_positions``) and its own grid
        self.settings = {**state["settings"], "options": self.settings["options"], "train_grid": self.train_grid}
        self.enabled = bool(state["enabled"])
        self.log_n_tokens = state["log_n_tokens"]  # inference settings (vispos.configure) are kept as saved
        self.settings = _with_configured_grid(self.settings, state["settings"]["train_grid"])
        self.follow_scaling_grid()  # relative to this model's grid, or to the one given to configure

    def _load_from_state_dict(
        self, state_dict: dict[str, Any], prefix: str, local_metadata: dict, strict: bool,
        missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str],
    ) -> None:  # fmt: skip
        """Before the weights load: a checkpoint of other positions is refused (``strict=False``: its
        positional entries are skipped and reported as unexpected, the model keeps its own); one made at
        another training grid has its tables resampled to this model's grid, which stays the training grid."""
        record = state_dict.get(f"{prefix}_extra_state")
        if isinstance(record, dict):  # vispos 0.1: a dict, and scheme modules without records of their own
            for name, module in self.named_modules(prefix=prefix.rstrip(".")):
                if module is not self and type(module).get_extra_state is not nn.Module.get_extra_state:
                    state_dict.setdefault(f"{name}._extra_state", module.get_extra_state())
        if record is not None:
            saved = _saved_state(record)["settings"]
            if not same_positions(saved, self.settings):
                if self.strict_loading:
                    own = self.settings
                    differing = set(differing_options(saved, own))
                    raise ValueError(
                        f"the checkpoint's positions are {_describe(saved, differing)}; this model's are "
                        f"{_describe(own, differing)} (they differ in {position_differences(saved, own)})"
                        ": patch a fresh model the way the checkpoint's was patched "
                        "and load it, or load with strict=False to keep only the weights outside the positions"
                    )
                skipped = [k for k in state_dict if k.startswith(prefix)]
                for key in skipped:
                    del state_dict[key]
                unexpected_keys.extend(skipped)
                missing_keys.append(f"{prefix}_extra_state")  # the model keeps its own settings
                return
            grid = tuple(saved["train_grid"])
            if grid != self.train_grid:
                for module, at in self._sized_modules(prefix):
                    module.resample_state(state_dict, at, grid, self.train_grid)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def _sized_modules(self, prefix: str) -> list[tuple[nn.Module, str]]:
        """(module, its state-dict prefix) for every scheme module whose weights have a grid size."""
        found = []
        for name, module in self.named_modules(prefix=prefix.rstrip(".")):
            if hasattr(module, "resample_state"):
                found.append((module, f"{name}."))
        return found

    @property
    def attention_backend(self) -> str:
        """``"sdpa"`` (default) or ``"flex"`` (relative biases through FlexAttention), as ``configure`` set it."""
        return self.settings.get("attention", "sdpa")

    def _prefixed(self, module: nn.Module, ctx: PositionContext) -> Rotary | torch.Tensor:
        """One scheme module's output for all tokens, prefix tokens first: rotations with identity rows for
        them, or a bias mask [1, heads, P + HW, P + HW] (4-D: SDPA's fused CPU kernel refuses 3-D masks).
        A bias with per-offset values is gathered straight into the mask (``bias_mask``), so building it
        holds little more than the mask itself. A token subset (``ctx.tokens`` [B, M]) takes its rows:
        rotations [B, heads or 1, M, d], masks [B, heads, M, M], gathered without the full mask."""
        grid, device, tokens = ctx.grid, ctx.device, ctx.tokens
        if ctx.ragged is not None:
            return self._gathered(module, ctx)
        if self.attention_kind in ("rotary", "query_bias"):  # a rotation, or a bias awaiting the queries
            out = module(grid, device).with_prefix(self.num_prefix_tokens)
            return out if tokens is None else out.take(tokens)
        if ctx.bias_index is not None:  # [P + HW, P + HW], or the subset's [B, M, M]
            mask = bias_mask(module.offset_bias(grid, device), getattr(module, "prefix_bias", None), ctx.bias_index)
            return mask[None] if tokens is None else mask.transpose(0, 1)
        mask = self._with_prefix(module(grid, device), module)  # [heads, P + HW, P + HW]
        if tokens is None:
            return mask[None]
        return mask[:, tokens[:, :, None], tokens[:, None, :]].transpose(0, 1)  # [B, heads, M, M]

    def _gathered(self, module: nn.Module, ctx: PositionContext) -> Rotary | torch.Tensor:
        """A ragged batch: the module at each distinct grid size, gathered per token: rotations [B, heads or 1,
        T, d] from one table of every size's rows, bias masks [B, heads, T, T] from one table of every size's
        per-offset values (``ctx.bias_index``)."""
        layout, p = ctx.ragged, self.num_prefix_tokens
        if layout.fractional:  # at each token's point (``RaggedLayout.points``), not at every cell
            if self.attention_kind == "rotary":
                rows = [
                    module(size, ctx.device, cells=layout.yx[here]).with_prefix(p)
                    for size, here in zip(layout.sizes, layout.points(), strict=True)
                ]
                return concat_rotations(rows).take(layout.point_index(p))
            return layout.pair_mask(module.pair_bias(layout.offsets()), getattr(module, "prefix_bias", None))
        if self.attention_kind == "rotary":
            rows = [module(size, ctx.device).with_prefix(p) for size in layout.sizes]
            return concat_rotations(rows).take(layout.table_index(p))
        if ctx.bias_index is None:  # FlexAttention was set, but this layer runs SDPA (CPU training)
            ctx.bias_index = layout.offset_index()
        return bias_mask(self._size_offsets(module, ctx), getattr(module, "prefix_bias", None), ctx.bias_index
                         ).transpose(0, 1)  # fmt: skip

    @staticmethod
    def _size_offsets(module: nn.Module, ctx: PositionContext) -> torch.Tensor:
        """A ragged batch's per-offset bias values [heads, sum over sizes of (2H-1)(2W-1)], sizes in turn."""
        return torch.cat([module.offset_bias(size, ctx.device).flatten(1) for size in ctx.ragged.sizes], dim=1)

    def _with_prefix(self, bias: torch.Tensor, module: nn.Module) -> torch.Tensor:
        """Patch bias [heads, HW, HW] -> [heads, P + HW, P + HW], for a bias scheme without ``offset_bias``.
        Prefix rows and columns take the scheme's ``prefix_bias`` [3, heads] or zero."""
        p = self.num_prefix_tokens
        entries = getattr(module, "prefix_bias", None)
        if entries is None:
            return F.pad(bias, (p, 0, p, 0))
        heads, n, _ = bias.shape
        to_patch, from_patch, among = (e.to(bias.dtype)[:, None, None] for e in entries)  # [heads, 1, 1] each
        top = torch.cat((among.expand(heads, p, p), to_patch.expand(heads, p, n)), dim=-1)  # [heads, P, P + HW]
        bottom = torch.cat((from_patch.expand(heads, n, p), bias), dim=-1)  # [heads, HW, P + HW]
        return torch.cat((top, bottom), dim=-2)

    def _bias_index(self, grid: tuple[int, int], device: torch.device) -> torch.Tensor | None:
        """The gather index of the bias masks, built once per forward and shared by every layer."""
        if self.attention_kind != "bias" or not hasattr(self._module(0), "offset_bias"):
            return None
        return prefixed_offset_index(grid, self.num_prefix_tokens, device)

    def context(
        self,
        grid: tuple[int, int],
        device: torch.device,
        user_mask: torch.Tensor | None = None,
        keep: torch.Tensor | None = None,
    ) -> PositionContext:
        """What every layer needs at this grid. A scheme shared by all layers is evaluated here, once; a
        per-layer scheme when its layer asks (``PositionContext.layer``), so in inference at most one
        layer's bias mask exists at a time.

        ``keep`` [B, K]: each row holds only these patch tokens (row-major indices into the H x W grid, in
        the order the row holds them; the prefix tokens stay first), as timm's patch dropout or an MAE
        encoder's random masking leaves them. Every token keeps the position of its place in the grid."""
        tokens = None if keep is None else self._subset(keep, grid, device)
        user = as_float_mask(user_mask, torch.float32)
        ctx = PositionContext(self, grid, device, user, None, self.logit_scale(grid), None, tokens)
        if self.enabled and self.attention is not None and not self._flex_ready(ctx):
            index = self._bias_index(grid, device)  # no dense mask is built for FlexAttention
            if index is not None and tokens is not None:
                index = index[tokens[:, :, None], tokens[:, None, :]]  # [B, M, M]
            ctx.bias_index = index
            if not self._per_layer:
                ctx.shared = self._combined(self._prefixed(self.attention, ctx), user)
            else:
                ctx.stacked = self._stacked(ctx)
        return ctx

    def _stacked(self, ctx: PositionContext) -> Rotary | None:
        """Every layer's rotation of a per-layer scheme that evaluates its layers in one go (``stacked``:
        RoPE-Mixed), prefix rows included; None where the scheme has no such form or declines this grid."""
        stack = getattr(type(self._module(0)), "stacked", None)
        if self.attention_kind != "rotary" or stack is None:
            return None
        rotation = stack(list(self.attention), ctx.grid, ctx.device)
        return None if rotation is None else rotation.with_prefix(self.num_prefix_tokens)

    def ragged_context(
        self,
        coords: torch.Tensor,
        sizes: torch.Tensor | None = None,
        *,
        valid: torch.Tensor | None = None,
        segments: torch.Tensor | None = None,
        user_mask: torch.Tensor | None = None,
    ) -> PositionContext:
        """The context of a ragged or packed batch: rows of P prefix tokens then N patch tokens, patch token n
        of row b at the integer cell ``coords[b, n]`` = (y, x) of its own image's grid (timm NaFlex's
        ``patch_coord``), ``valid`` [B, N] False for padding; one image per row of size ``sizes`` [B, 2], or
        several packed in a row (``segments`` [B, N], ``sizes`` [B, S, 2], no prefix tokens). Without
        ``sizes``, each image's grid is the bounding box of its cells (``vispos.ragged.ragged_layout``).

        Each image gets exactly what it gets alone at its own size: every scheme is computed once per
        distinct size and gathered per token, anything that depends on the size (normalised coordinates,
        RoPE scaling, resized tables, log-n scaling, folded into q per token) uses the image's own, and the
        additive mask handed to each layer ([B, heads or 1, T, T], with ``user_mask`` added) hides padding
        keys and other images' tokens. Additive tables: ``add_to_ragged``. With FlexAttention configured, a
        relative bias on integer cells attends through it instead, without a mask: a score_mod computes each
        pair's offset index from the two tokens' cells and a block mask hides padding and other images
        (``PositionContext.flex``); a mask of the caller's or fractional points keep SDPA. ``ctx.grid`` is
        the largest (H, W) in the batch.

        ``coords`` of a floating dtype are points in patch units, possibly fractional (a merged token at the
        mean of its cells): every scheme defined between grid cells is evaluated at each token's point
        (``ragged_layout``); relbias2d's integer table and peg2d's convolution refuse fractional points.
        DINOv3's coordinate augmentation (training mode) is drawn per image."""
        if self.attention_kind == "query_bias":
            raise ValueError(
                f"{self.settings['pos']}: a query-dependent bias (decomposed2d) is built for one grid; ragged and "
                "packed batches are not supported: run each image size as a batch of its own"
            )
        layout = ragged_layout(coords, sizes, valid=valid, segments=segments, num_prefix_tokens=self.num_prefix_tokens,
                               per_image=self._draws_per_forward())  # fmt: skip
        if layout.fractional and (needs := self._needs_cells()) is not None:
            layout = layout.as_cells()
            if layout is None:
                raise ValueError(needs)
        ctx = PositionContext(self, layout.grid, coords.device, None, None, 1.0, None, None, layout)
        ctx.caller_mask = user_mask is not None
        if not self._flex_ready(ctx):  # FlexAttention: a block mask instead, the dense one only on fallback
            structure = None if layout.one_image_per_row() else layout.structure_mask()  # [B, 1, T, T]
            ctx.user_mask = combine_masks(structure, as_float_mask(user_mask, torch.float32))
        user = ctx.user_mask
        if self.log_n_tokens is not None:  # per token: SDPA takes one scale for the whole batch
            ratio = layout.patch_counts().log() / math.log(self.log_n_tokens)
            ctx.query_scale = ratio.clamp(min=1.0)[:, None, :, None]  # [B, 1, T, 1]
        if self.enabled and self.attention is not None and not self._flex_ready(ctx):  # (flex: no dense mask)
            if self.attention_kind == "bias" and not layout.fractional:
                if not hasattr(self._module(0), "offset_bias"):
                    raise ValueError(f"{self.settings['pos']}: a ragged batch needs a bias given per offset")
                ctx.bias_index = layout.offset_index()  # [B, T, T], shared by every layer
            if not self._per_layer:
                ctx.shared = self._combined(self._prefixed(self.attention, ctx), user)
        return ctx

    def _draws_per_forward(self) -> bool:
        """A scheme draws at random in this forward (DINOv3's coordinate augmentation, training mode): a ragged
        batch then evaluates it per image, so that each image gets a draw of its own."""
        return self.training and any(getattr(getattr(m, "augment", None), "active", False) for m in self.modules())

    def _needs_cells(self) -> str | None:
        """Why this model's positions need integer cells (a scheme not defined between them), or None."""
        schemes = {"additive": self.additive, "attention": self.attention}
        for role, module in schemes.items():
            module = module[0] if isinstance(module, nn.ModuleList) else module
            if module is None or not self.enabled or (role == "attention" and self.attention_kind == "none"):
                continue
            if role == "attention" and self.attention_kind == "bias":
                takes = hasattr(module, "pair_bias")
            else:
                takes = "cells" in inspect.signature(module.forward).parameters
            if not takes:
                kind = "additive" if role == "additive" else self.attention_kind
                name = next(n for n in self.settings["pos"] if get_info(n, ndim=2).kind == kind)
                return (
                    f"{name} is defined at integer grid cells only (its table holds one value per integer offset): "
                    "fractional coordinates are refused; round them to cells, or use a scheme defined between "
                    "cells (cpb2d, alibi2d, the rotary schemes, sincos2d, learned2d)"
                )
        if self.conditional is not None and self.enabled:
            return (
                "peg2d convolves the tokens laid on their image's grid, where a fractional point has no cell: "
                "fractional coordinates are refused; round them to cells, or patch without peg2d"
            )
        return None

    def _subset(self, keep: torch.Tensor, grid: tuple[int, int], device: torch.device) -> torch.Tensor:
        """Kept patch indices [B, K] (or a bool mask [B, H*W], True = kept, the row holding them in grid
        order) -> the rows' token indices [B, P + K], prefix tokens first."""
        if not isinstance(keep, torch.Tensor) or keep.dim() != 2 or keep.is_floating_point() or keep.is_complex():
            got = f"{keep.dtype} tensor of shape {tuple(keep.shape)}" if isinstance(keep, torch.Tensor) else keep
            raise ValueError(
                f"keep must be an integer tensor [B, K] of patch indices or a bool mask [B, H*W] (True: kept), "
                f"got {got}"
            )
        n = grid[0] * grid[1]
        if keep.dtype == torch.bool:  # a mask, never indices 0 and 1
            keep = _kept_indices(keep, grid)
        if not torch.compiler.is_compiling() and keep.numel() and (keep.min() < 0 or keep.max() >= n):
            raise ValueError(f"keep holds patch indices outside the {grid[0]}x{grid[1]} grid (0 to {n - 1})")
        p = self.num_prefix_tokens
        prefix = torch.arange(p, device=device).expand(keep.shape[0], p)
        return torch.cat((prefix, keep.to(device) + p), dim=1)

    @property
    def _per_layer(self) -> bool:
        return isinstance(self.attention, nn.ModuleList)

    def _module(self, index: int) -> nn.Module:
        return self.attention[index] if self._per_layer else self.attention

    def layer(self, ctx: PositionContext, index: int) -> tuple[Rotary | QueryScaled | None, torch.Tensor | None]:
        """Layer ``index``'s rotation and additive mask (prefix tokens included); with a per-token logit scale
        (``ctx.query_scale``), the rotation is a ``QueryScaled`` that also scales q."""
        rotary, mask = self._layer(ctx, index)
        return (rotary, mask) if ctx.query_scale is None else (QueryScaled(rotary, ctx.query_scale), mask)

    def _layer(self, ctx: PositionContext, index: int) -> tuple[Rotary | None, torch.Tensor | None]:
        if ctx.ragged is not None and ctx.user_mask is None and self._flex_ready(ctx):
            if not ctx.ragged.one_image_per_row():  # set for FlexAttention, run through SDPA: its mask, once
                ctx.user_mask = ctx.ragged.structure_mask()
        if not self.enabled or self.attention is None:
            return None, ctx.user_mask
        if ctx.shared is not None:
            out = ctx.shared
        elif ctx.stacked is not None:
            out = ctx.stacked.select(index)
            out = out if ctx.tokens is None else out.take(ctx.tokens)
        else:
            out = self._combined(self._prefixed(self._module(index), ctx), ctx.user_mask)
        return (out, ctx.user_mask) if self.attention_kind == "rotary" else (None, out)

    def _flex_ready(self, ctx: PositionContext) -> bool:
        """FlexAttention is on and applies: an enabled relative bias on the whole grid or on a ragged batch of
        cells, no mask from the caller."""
        on = self.attention_backend == "flex" and self.enabled and self.attention_kind == "bias"
        if ctx.ragged is not None:
            return on and not ctx.caller_mask and not ctx.ragged.fractional
        return on and ctx.user_mask is None and ctx.tokens is None

    def flex(self, ctx: PositionContext, index: int) -> FlexBias | None:
        """Layer ``index``'s bias for FlexAttention (``PositionContext.flex``); None when SDPA is used."""
        if not self._flex_ready(ctx):
            return None
        module, layout = self._module(index), ctx.ragged
        entries = getattr(module, "prefix_bias", None)
        if layout is None:
            values = with_prefix_entries(module.offset_bias(ctx.grid, ctx.device), entries)
            if ctx.grid_tensor is None:  # one host-to-device copy per forward, not per layer
                ctx.grid_tensor = torch.tensor(ctx.grid, device=ctx.device)
            return FlexBias(offset_score_mod(values, ctx.grid_tensor, self.num_prefix_tokens), sized=((values, 1),))
        values = with_prefix_entries(self._size_offsets(module, ctx), entries)
        score_mod, sized = layout.flex_score_mod(values)  # padding and other images hidden by the score_mod
        return FlexBias(score_mod, None, sized)

    def _combined(self, out: Rotary | torch.Tensor, user: torch.Tensor | None) -> Rotary | torch.Tensor:
        """A bias mask plus the caller's mask (a rotation is returned as it is)."""
        if self.attention_kind == "query_bias":
            return out.plus(user)
        return out if self.attention_kind == "rotary" else combine_masks(out, user)

    @property
    def scaling_grid(self) -> tuple[int, int]:
        """The training grid RoPE scaling and log-n scaling are relative to: the one given to
        ``vispos.configure(train_grid=...)`` (``settings["configured_train_grid"]``), else ``train_grid``."""
        given = self.settings.get("configured_train_grid")
        return self.train_grid if given is None else (int(given[0]), int(given[1]))

    def follow_scaling_grid(self) -> None:
        """Put every size-relative inference setting on ``scaling_grid``: each 2D RoPE's scaling (its per-axis
        factors, YaRN's ramp) and log-n's training token count H x W. ``vispos.configure`` and every load end
        here, so that the model has one training grid."""
        grid = self.scaling_grid
        for module in self.modules():
            if getattr(getattr(module, "scheme_info", None), "scalable", False):
                module.set_train_grid(grid)  # 2D scalable schemes (rope2d)
        if self.log_n_tokens is not None:
            if grid[0] * grid[1] < 2:
                raise ValueError(f"log_n_attention needs a training grid of at least 2 patches, got {grid}")
            self.log_n_tokens = grid[0] * grid[1]

    def logit_scale(self, grid: tuple[int, int]) -> float:
        """log-n attention scaling: logits x max(1, ln N / ln N_train) for N patch tokens, so attention
        keeps its sharpness (entropy) when a larger grid spreads it over more keys."""
        if self.log_n_tokens is None:
            return 1.0
        return max(1.0, math.log(grid[0] * grid[1]) / math.log(self.log_n_tokens))

    def add_to_patches(self, x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """x [B, H*W, C] (patch tokens only) + the additive table, if any."""
        if self.additive is None or not self.enabled:
            return x
        return x + self.additive(grid, x.device).to(x.dtype)

    def embed(
        self,
        x: torch.Tensor,
        grid: tuple[int, int] | None = None,
        *,
        keep: torch.Tensor | None = None,
        coords: torch.Tensor | None = None,
        sizes: torch.Tensor | None = None,
        valid: torch.Tensor | None = None,
        segments: torch.Tensor | None = None,
        prefix: torch.Tensor | None = None,
        user_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, PositionContext]:
        """Patch tokens -> (rows [B, P + N, C] with every position they carry, the context each block takes as
        ``attn_mask``): the start of a loop of one's own over the blocks. The blocks apply the attention
        schemes; an additive table (learned2d, sincos2d) is added here, to each token at its own cell.

        One grid (``grid`` = (H, W), as ``context``): x [B, H*W, C] row-major, or [B, K, C] holding the cells
        ``keep`` [B, K]. A ragged or packed batch (``coords`` [B, N, 2], with ``sizes``, ``valid``, ``segments``
        as ``ragged_context`` takes them): x [B, N, C]. ``prefix`` [B or 1, P, C]: the model's P prefix tokens
        (class token, registers), put first with the additive scheme's prefix rows; required when P > 0."""
        if (grid is None) == (coords is None):
            raise ValueError("embed takes grid= (one grid, optionally with keep=) or coords= (a ragged batch), "
                             "exactly one of them")
        if coords is None and any(v is not None for v in (sizes, valid, segments)):
            raise ValueError("sizes, valid and segments describe a ragged batch: pass them with coords=, not grid=")
        if coords is not None and keep is not None:
            raise ValueError("keep selects cells of one grid (grid=); a ragged batch lists its cells in coords=")
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            got = f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"embed takes patch tokens x [B, N, C], got {got}")
        p, given = self.num_prefix_tokens, None if prefix is None else tuple(prefix.shape)
        if (p or prefix is not None) and (given is None or len(given) != 3 or given[1] != p):
            raise ValueError(f"this model has {p} prefix token(s) (class token, registers): pass them as "
                             f"prefix=[B or 1, {p}, C]" + ("" if p else ", or no prefix") + f", got {given}")
        if coords is None:
            grid = check_grid(grid, "grid")
            ctx = self.context(grid, x.device, user_mask, keep)  # (checks keep: indices or a bool mask)
            kept = None if ctx.tokens is None else ctx.tokens[:, p:] - p  # [B, K]: the rows' patch indices
            n = grid[0] * grid[1] if kept is None else kept.shape[1]
            if x.shape[1] != n:
                if kept is None:
                    held = "the H*W cells of the grid"
                elif keep.dtype == torch.bool:
                    held = "one token per kept cell (keep, a bool mask [B, H*W]: its True cells per row)"
                else:
                    held = "one token per kept cell (keep [B, K])"
                raise ValueError(f"x holds {x.shape[1]} tokens per row; {held} is {n}")
            if self.additive is not None and self.enabled:
                table = self.additive(grid, x.device).to(x.dtype)  # [H*W, C]
                x = x + (table if kept is None else table[kept])  # [B, N, C]
        else:
            ctx = self.ragged_context(coords, sizes, valid=valid, segments=segments, user_mask=user_mask)
            if x.shape[:2] != coords.shape[:2]:
                raise ValueError(f"x [B, N, C] has {tuple(x.shape[:2])} rows and tokens; coords [B, N, 2] "
                                 f"{tuple(coords.shape[:2])}: one cell per token")
            x = self.add_to_ragged(x, ctx)
        if prefix is None:
            return x, ctx
        return torch.cat((self.add_to_prefix(prefix.to(x.dtype).expand(x.shape[0], -1, -1)), x), dim=1), ctx

    def apply_conditional(self, x: torch.Tensor, ctx: PositionContext) -> torch.Tensor:
        """Tokens [B, P + H*W, C] (or the row's subset, ``ctx.tokens``) after block ``conditional.after``
        -> the conditional scheme's output at the context's grid (unchanged when there is none, or disabled)."""
        if self.conditional is None or not self.enabled:
            return x
        if ctx.ragged is not None:  # each image on its own grid
            return ragged_conditional(self.conditional, x, ctx.ragged)
        return self.conditional(x, ctx.grid, self.num_prefix_tokens, ctx.tokens)

    def add_to_ragged(self, x: torch.Tensor, ctx: PositionContext) -> torch.Tensor:
        """Patch tokens x [B, N, C] of a ragged batch (``ragged_context``) + the additive table of each
        token's own image size at its cell; padding is left unchanged."""
        if self.additive is None or not self.enabled:
            return x
        layout, p = ctx.ragged, self.num_prefix_tokens
        if layout.fractional:  # the table at each token's point
            points = zip(layout.sizes, layout.points(), strict=True)
            table = torch.cat([self.additive(size, x.device, cells=layout.yx[here]) for size, here in points])
            index = layout.point_index(0)[:, p:]
        else:
            table = torch.cat([self.additive(size, x.device) for size in layout.sizes])  # [sum HW, C]
            index = layout.table_index(0)[:, p:]  # [B, N]
        table, valid = table.to(x.dtype), layout.valid[:, p:, None]  # [B, N, 1]
        return torch.where(valid, x + table[index], x)

    def add_to_prefix(self, tokens: torch.Tensor) -> torch.Tensor:
        """Prefix tokens [B, P, C] + the additive scheme's prefix rows (``prefix`` [P, C]), if it has them."""
        embed = getattr(self.additive, "prefix", None)
        if embed is None or not self.enabled:
            return tokens
        return tokens + embed.to(tokens.dtype)

    def extra_repr(self) -> str:
        inherited = self.settings.get("inherited")
        said = f", inherited from {inherited['from']}" if inherited else ""
        return f"depth={self.depth}, num_prefix_tokens={self.num_prefix_tokens}, enabled={self.enabled}{said}"
