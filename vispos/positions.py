"""The positional part of a patched 2D model, independent of any model library.

``Positions`` holds at most one additive and one attention scheme and builds, once per forward and
from the actual patch grid, a ``PositionContext``: what every layer's attention needs (rotations,
additive masks, a logit scale). Hosts (the timm adapter) hand that context to their attention layers.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, is_dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ._validate import check_grid
from .attention import as_float_mask
from .encodings.rope import Rotary


@dataclass
class PositionContext:
    """Per-layer positional tensors for one forward pass at one grid (prefix tokens included)."""

    rotary: tuple[Rotary | None, ...]  # cos/sin [N, d] or [heads, N, d]
    masks: tuple[torch.Tensor | None, ...]  # additive [heads, N, N] or the user's mask
    logit_scale: float = 1.0  # extra temperature on every logit (log-n attention scaling)


def plain(value: Any) -> Any:
    """Settings as plain data (dicts, lists, numbers, strings), safe for ``torch.load(weights_only=True)``."""
    if is_dataclass(value) and not isinstance(value, type):
        return plain(asdict(value))
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def _describe(settings: dict[str, Any]) -> str:
    options = ", ".join(f"{k}={v!r}" for k, v in sorted(settings["options"].items()))
    h, w = settings["train_grid"]
    return f"{' + '.join(settings['pos'])}({options}) at a {h}x{w} training grid"


class Positions(nn.Module):
    """The positional scheme of a patched model: at most one additive and one attention scheme.

    ``settings`` says which schemes, with which options, at which training grid (and, once
    ``vispos.configure`` has run, the inference settings). ``enabled`` switches the whole scheme off
    (DroPE) and back on; ``log_n_tokens`` is the training token count while log-n attention scaling
    is on. All of it is saved in the state dict and restored by ``load_state_dict``, which refuses a
    checkpoint of another scheme, other options or another training grid.
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
    ) -> None:
        super().__init__()
        self.additive = additive
        self.attention = attention
        self.attention_kind = attention_kind
        self.depth = depth
        self.num_prefix_tokens = num_prefix_tokens
        self.train_grid = check_grid(train_grid, "train_grid")
        self.settings: dict[str, Any] = {"pos": list(schemes), "options": plain(options), "train_grid": self.train_grid}
        self.enabled = True
        self.log_n_tokens: int | None = None

    def get_extra_state(self) -> dict[str, Any]:
        settings = {**self.settings, "train_grid": list(self.train_grid)}
        return {"settings": plain(settings), "enabled": self.enabled, "log_n_tokens": self.log_n_tokens}

    def set_extra_state(self, state: dict[str, Any]) -> None:
        saved = {**state["settings"], "train_grid": tuple(state["settings"]["train_grid"])}
        if any(saved[k] != self.settings[k] for k in ("pos", "options", "train_grid")):
            raise ValueError(
                f"the checkpoint's positions are {_describe(saved)}; this model's are {_describe(self.settings)}: "
                "patch a fresh model the way the checkpoint's was patched, then load it"
            )
        self.settings = saved
        self.enabled = state["enabled"]
        self.log_n_tokens = state["log_n_tokens"]

    def _per_layer(self, grid: tuple[int, int], device: torch.device) -> list[tuple[nn.Module | None, Any]]:
        """(module, output) of the attention scheme for each layer; one shared output without per-layer modules."""
        if self.attention is None or not self.enabled:
            return [(None, None)] * self.depth
        if isinstance(self.attention, nn.ModuleList):
            return [(m, m(grid, device)) for m in self.attention]
        return [(self.attention, self.attention(grid, device))] * self.depth

    def _with_prefix(self, bias: torch.Tensor, module: nn.Module) -> torch.Tensor:
        """Patch bias [heads, HW, HW] -> [heads, P + HW, P + HW]. Prefix rows and columns take the scheme's
        ``prefix_bias`` [3, heads] (prefix->patch, patch->prefix, prefix->prefix, as BEiT) or zero."""
        p = self.num_prefix_tokens
        entries = getattr(module, "prefix_bias", None)
        if entries is None:
            return F.pad(bias, (p, 0, p, 0))
        heads, n, _ = bias.shape
        to_patch, from_patch, among = (e.to(bias.dtype)[:, None, None] for e in entries)  # [heads, 1, 1] each
        top = torch.cat((among.expand(heads, p, p), to_patch.expand(heads, p, n)), dim=-1)  # [heads, P, P + HW]
        bottom = torch.cat((from_patch.expand(heads, n, p), bias), dim=-1)  # [heads, HW, P + HW]
        return torch.cat((top, bottom), dim=-2)

    def context(
        self, grid: tuple[int, int], device: torch.device, user_mask: torch.Tensor | None = None
    ) -> PositionContext:
        """Rotations and masks for every layer, from the grid alone (computed once per forward)."""
        p = self.num_prefix_tokens
        user = as_float_mask(user_mask, torch.float32)
        outputs = self._per_layer(grid, device)
        logit_scale = self.logit_scale(grid)
        if self.attention_kind == "rotary":
            rotary = tuple(r.with_prefix(p) if r is not None else None for _, r in outputs)
            return PositionContext(rotary, (user,) * self.depth, logit_scale)
        masks = []
        for module, bias in outputs:
            if bias is None:
                masks.append(user)
                continue
            bias = self._with_prefix(bias, module)
            masks.append(bias if user is None else bias + user)
        return PositionContext((None,) * self.depth, tuple(masks), logit_scale)

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

    def add_to_prefix(self, tokens: torch.Tensor) -> torch.Tensor:
        """Prefix tokens [B, P, C] + the additive scheme's prefix rows (``prefix`` [P, C]), if it has them."""
        embed = getattr(self.additive, "prefix", None)
        if embed is None or not self.enabled:
            return tokens
        return tokens + embed.to(tokens.dtype)

    def extra_repr(self) -> str:
        return f"depth={self.depth}, num_prefix_tokens={self.num_prefix_tokens}, enabled={self.enabled}"
