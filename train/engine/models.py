"""Build the same timm ViT for every scheme and put the scheme on it with vispos."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import timm
import torch
from torch import nn

import vispos

from ..config.sections import TIMM_TABLE, ConfigError, ExperimentConfig, ModelConfig, SchemeConfig, scheme_config


def preflight(cfg: ExperimentConfig) -> int:
    """Build each trained entry's model on the meta device (no memory, no weights, no RNG draws),
    switch on every entry's evaluation settings, and check every size against the patch size: what would
    otherwise fail only once training has started. Returns the patch size."""
    d = cfg.data
    in_chans, num_classes = len(d.mean) if d.mean else 3, d.num_classes or 2  # neither changes what is checked

    def meta_model(scheme: SchemeConfig) -> nn.Module:
        with warnings.catch_warnings(), torch.device("meta"):
            warnings.simplefilter("ignore")  # e.g. PretrainedPositionsWarning: shown when the real model is built
            return build_model(cfg.model, scheme, img_size=d.img_size, num_classes=num_classes, in_chans=in_chans,
                               seed=None)

    patch = patch_size_of(meta_model(SchemeConfig(name="model", pos=[TIMM_TABLE])))  # timm's model, unpatched
    if d.img_size % patch:
        raise ConfigError(f"data.img_size={d.img_size} must be a multiple of the patch size {patch} "
                          f"(model {cfg.model.name}, model.patch_size={cfg.model.patch_size}), "
                          f"e.g. {max(patch, d.img_size // patch * patch)}")
    for s in (s for s in cfg.schemes if s.trains):
        model = meta_model(s)
        for entry in (v for v in cfg.schemes if v is s or v.base == s.name):
            configure_eval(model, entry, (d.img_size // patch,) * 2)
    from ..data.loaders import train_sizes
    from ..evaluation.accuracy import eval_sizes  # accuracy -> loaders -> config

    eval_sizes(cfg.eval, d.img_size, patch)
    train_sizes(cfg.train, d.img_size, patch)
    for s in (s for s in cfg.schemes if s.sizes is not None):
        train_sizes(scheme_config(cfg, s).train, d.img_size, patch)
    size = cfg.finetune.size
    if size is not None and size % patch:
        raise ConfigError(f"finetune.size={size} must be a multiple of the patch size {patch}, "
                          f"e.g. {max(patch, size // patch * patch)} or {(size // patch + 1) * patch}")
    return patch


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
                seed: int | None) -> nn.Module:
    """timm.create_model with the config's architecture (same seed for every scheme), then vispos.patch.

    ``seed=None`` leaves the global RNG alone (``preflight``'s meta-device models draw nothing). An entry's own
    ``num_heads`` replaces the model's."""
    if scheme.num_heads is not None:
        m = dataclasses.replace(m, num_heads=scheme.num_heads)
    kwargs = timm_kwargs(m, img_size=img_size, num_classes=num_classes, in_chans=in_chans)
    timm_table = scheme.pos == [TIMM_TABLE]
    if timm_table:
        kwargs.setdefault("dynamic_img_size", True)
    if seed is not None:
        torch.manual_seed(seed)  # the shared weights are identical for every scheme
    try:
        model = timm.create_model(m.name, pretrained=False, **kwargs)
    except (TypeError, ValueError, AssertionError, RuntimeError) as e:
        raise ConfigError(f"model: timm.create_model({m.name!r}, {kwargs}) failed: {e}") from None
    if not timm_table:
        if seed is not None:
            torch.manual_seed(seed + 1)  # the scheme's own parameters, identical across runs
        pos: str | list[str] = scheme.pos[0] if len(scheme.pos) == 1 else list(scheme.pos)
        try:
            vispos.patch(model, pos, **scheme.options)
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
        vispos.configure(model, **kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"schemes[{scheme.name}]: vispos.configure failed: {e}") from None


def set_positions(model: nn.Module, enabled: bool) -> None:
    """DroPE: switch the whole positional scheme off (or back on)."""
    vispos.set_position_enabled(model, enabled)
