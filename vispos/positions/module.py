"""``Positions``: the positional module of a patched 2D model (its schemes, settings, training grid and
size-relative scaling), assembled from the mixins of its sibling modules."""

from __future__ import annotations

import math
from typing import Any

from torch import nn

from .._state import expose_records
from .._validate import check_grid
from .contexts import Contexts
from .embedding import Embedding
from .masks import LayerOutputs
from .settings import SettingsRecord, plain


def _follow_scaling_grid(module: Positions, incompatible_keys: Any) -> None:
    """``load_state_dict``'s post hook: once the scheme modules have read their own records (a rope2d's holds the
    grid of the checkpoint's scaling), every inference setting follows the model's one training grid."""
    module.follow_scaling_grid()


class Positions(SettingsRecord, Contexts, LayerOutputs, Embedding, nn.Module):
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
        expose_records(self, self.follow_scaling_grid)  # for loaders that set tensors one by one by name

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

    def extra_repr(self) -> str:
        inherited = self.settings.get("inherited")
        said = f", inherited from {inherited['from']}" if inherited else ""
        return f"depth={self.depth}, num_prefix_tokens={self.num_prefix_tokens}, enabled={self.enabled}{said}"
