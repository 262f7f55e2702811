"""Build the same timm ViT for every scheme and put the scheme on it with vispos."""

from __future__ import annotations

from typing import Any

import timm
import torch
from torch import nn

from .config import ConfigError, ModelConfig, SchemeConfig

TIMM_TABLE = "timm"  # pos name meaning: keep timm's own learned table (dynamic_img_size=True), no patch


def _vispos() -> Any:
    try:
        import vispos
    except ImportError as e:  # pragma: no cover - vispos ships with this repo
        raise ConfigError(f"cannot import vispos ({e}); install the repo with `pip install -e .`") from None
    return vispos


def check_schemes(schemes: list[SchemeConfig]) -> None:
    """Fail before any training if a scheme name is not registered."""
    names: list[str] = []
    for s in schemes:
        names.extend(p for p in s.pos if p != TIMM_TABLE)
    if not names:
        return
    known = _vispos().list_encodings(ndim=2)
    for s in schemes:
        for p in s.pos:
            if p != TIMM_TABLE and p not in known:
                raise ConfigError(f"schemes[{s.name}]: unknown 2D scheme {p!r}; known: {', '.join(known)}, "
                                  f"or {TIMM_TABLE!r} (timm's own table)")
        if TIMM_TABLE in s.pos and (len(s.pos) > 1 or s.options or s.drope):
            raise ConfigError(f"schemes[{s.name}]: {TIMM_TABLE!r} stands alone (no combination, options or drope)")


def timm_kwargs(m: ModelConfig, *, img_size: int, num_classes: int, in_chans: int) -> dict[str, Any]:
    """The keyword arguments of ``timm.create_model`` for the config's architecture."""
    kwargs: dict[str, Any] = {
        k: v
        for k, v in {
            "patch_size": m.patch_size, "embed_dim": m.embed_dim, "depth": m.depth, "num_heads": m.num_heads,
            "mlp_ratio": m.mlp_ratio, "class_token": m.class_token, "global_pool": m.global_pool,
        }.items()
        if v is not None
    }
    kwargs.update(img_size=img_size, in_chans=in_chans, num_classes=num_classes,
                  drop_rate=m.drop_rate, drop_path_rate=m.drop_path_rate)
    kwargs.update(m.kwargs)
    return kwargs


def build_model(m: ModelConfig, scheme: SchemeConfig, *, img_size: int, num_classes: int, in_chans: int,
                seed: int) -> nn.Module:
    """timm.create_model with the config's architecture (same seed for every scheme), then vispos.patch."""
    kwargs = timm_kwargs(m, img_size=img_size, num_classes=num_classes, in_chans=in_chans)
    timm_table = scheme.pos == [TIMM_TABLE]
    if timm_table:
        kwargs.setdefault("dynamic_img_size", True)
    torch.manual_seed(seed)  # the shared weights are identical for every scheme
    try:
        model = timm.create_model(m.name, pretrained=False, **kwargs)
    except (TypeError, ValueError, AssertionError, RuntimeError) as e:
        raise ConfigError(f"model: timm.create_model({m.name!r}, {kwargs}) failed: {e}") from None
    if not timm_table:
        torch.manual_seed(seed + 1)  # the scheme's own parameters, identical across runs
        pos: str | list[str] = scheme.pos[0] if len(scheme.pos) == 1 else list(scheme.pos)
        try:
            _vispos().patch(model, pos, **scheme.options)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"schemes[{scheme.name}]: vispos.patch failed: {e}") from None
    return model


def patch_size_of(model: nn.Module) -> int:
    ps = model.patch_embed.patch_size  # type: ignore[union-attr]
    ps = ps if isinstance(ps, int) else ps[0]
    return int(ps)


def configure_eval(model: nn.Module, scheme: SchemeConfig, train_grid: tuple[int, int]) -> None:
    """Switch on the entry's evaluation-only settings: RoPE scaling and log-n attention scaling."""
    if scheme.scaling is None and not scheme.log_n_attention:
        return
    kwargs: dict[str, Any] = {"train_grid": train_grid}
    if scheme.scaling is not None:
        kwargs.update(scaling=scheme.scaling, **scheme.scaling_options)
    if scheme.log_n_attention:
        kwargs["log_n_attention"] = True
    try:
        _vispos().configure(model, **kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"schemes[{scheme.name}]: vispos.configure failed: {e}") from None


def set_positions(model: nn.Module, enabled: bool) -> None:
    """DroPE: switch the whole positional scheme off (or back on)."""
    _vispos().set_position_enabled(model, enabled)
