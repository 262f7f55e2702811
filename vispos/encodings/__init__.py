"""The catalogue: every scheme registered with its properties as data."""

from __future__ import annotations

from ..registry import SchemeInfo, register
from .alibi import Alibi, Alibi2d, alibi_slopes
from .learned import Learned1d, Learned2d
from .nope import NoPE
from .relbias import ContinuousBias2d, RelBias2d, relative_index_2d
from .rope import Rope, Rope2d, Rope2dMixed, Rotary, apply_rope
from .rope_scaling import SCALING_TYPES, RopeScaling, scaled_inv_freq
from .shaw import ShawRelative
from .sincos import SinCos1d, SinCos2d, sincos_1d, sincos_2d
from .t5 import T5Bias, t5_bucket
from .xpos import XPos

__all__ = [
    "Alibi", "Alibi2d", "ContinuousBias2d", "Learned1d", "Learned2d", "NoPE", "RelBias2d", "Rope", "Rope2d",
    "Rope2dMixed", "RopeScaling", "Rotary", "SCALING_TYPES", "ShawRelative", "SinCos1d", "SinCos2d", "T5Bias",
    "XPos", "alibi_slopes", "apply_rope", "relative_index_2d", "scaled_inv_freq", "sincos_1d", "sincos_2d",
    "t5_bucket",
]  # fmt: skip

# --- 2D: a grid of patch tokens -------------------------------------------------------------------
register(
    SchemeInfo(
        "sincos2d",
        2,
        "additive",
        "embedding (added)",
        trainable=False,
        relative=False,
        extrapolation="any grid (formula); unseen absolute positions",
        summary="fixed 2D sin-cos, x and y on half the channels each (MAE)",
        builder=SinCos2d,
        reference="Vaswani et al. 2017; He et al. 2022 (MAE)",
    )
)
register(
    SchemeInfo(
        "learned2d",
        2,
        "additive",
        "embedding (added)",
        trainable=True,
        relative=False,
        extrapolation="table resampled (bicubic, antialias)",
        summary="learnable (H, W, d) table; optional row + column form (NaViT)",
        builder=Learned2d,
        reference="Dosovitskiy et al. 2021 (ViT); Dehghani et al. 2023 (NaViT)",
    )
)
register(
    SchemeInfo(
        "rope2d",
        2,
        "rotary",
        "q, k",
        trainable=False,
        relative=True,
        extrapolation="unseen angles at pixel coords; linear/ntk/yarn scaling per axis; normalized coords",
        summary="axial 2D RoPE: half the rotary pairs turn with x, half with y",
        builder=Rope2d,
        reference="Heo et al. 2024 (RoPE-ViT); Simeoni et al. 2025 (DINOv3)",
    )
)
register(
    SchemeInfo(
        "rope2d_mixed",
        2,
        "rotary",
        "q, k",
        trainable=True,
        relative=True,
        per_layer=True,
        extrapolation="best of the RoPE-ViT schemes above training size",
        summary="RoPE-Mixed: learnable per-layer, per-head 2D frequencies",
        builder=Rope2dMixed,
        reference="Heo et al. 2024 (RoPE-ViT)",
    )
)
register(
    SchemeInfo(
        "relbias2d",
        2,
        "bias",
        "attention logits",
        trainable=True,
        relative=True,
        per_layer=True,
        extrapolation="table resized (bicubic) to the new grid",
        summary="Swin relative position bias: a ((2H-1)(2W-1), heads) table",
        builder=RelBias2d,
        reference="Liu et al. 2021 (Swin)",
    )
)
register(
    SchemeInfo(
        "cpb2d",
        2,
        "bias",
        "attention logits",
        trainable=True,
        relative=True,
        per_layer=True,
        extrapolation="continuous: the MLP is evaluated at new offsets",
        summary="SwinV2 continuous bias: MLP on log-spaced (dy, dx), 16 sigmoid",
        builder=ContinuousBias2d,
        reference="Liu et al. 2022 (Swin V2)",
    )
)
register(
    SchemeInfo(
        "alibi2d",
        2,
        "bias",
        "attention logits",
        trainable=False,
        relative=True,
        extrapolation="any grid (distance penalty)",
        summary="ALiBi on the Euclidean patch distance, per-head slopes",
        builder=Alibi2d,
        reference="Press et al. 2022 (ALiBi), 2D form",
    )
)
register(
    SchemeInfo(
        "nope",
        2,
        "none",
        "-",
        trainable=False,
        relative=False,
        extrapolation="nothing to extrapolate",
        summary="no positional information",
        builder=NoPE,
    )
)

# --- 1D: token sequences ----------------------------------------------------------------------------
register(
    SchemeInfo(
        "sincos1d",
        1,
        "additive",
        "embedding (added)",
        trainable=False,
        relative=False,
        extrapolation="formula defined anywhere; poor in practice",
        summary="Vaswani sinusoidal",
        builder=SinCos1d,
        reference="Vaswani et al. 2017",
    )
)
register(
    SchemeInfo(
        "learned1d",
        1,
        "additive",
        "embedding (added)",
        trainable=True,
        relative=False,
        extrapolation="none past max_len (error, clamp or interpolate: explicit)",
        summary="learned absolute table",
        builder=Learned1d,
        reference="Devlin et al. 2019 (BERT)",
    )
)
register(
    SchemeInfo(
        "shaw",
        1,
        "relative_kv",
        "q.k and value sum",
        trainable=True,
        relative=True,
        extrapolation="offsets clipped at +-k",
        summary="Shaw clipped relative embeddings on keys and values",
        builder=ShawRelative,
        reference="Shaw et al. 2018",
    )
)
register(
    SchemeInfo(
        "t5",
        1,
        "bias",
        "attention logits",
        trainable=True,
        relative=True,
        extrapolation="far offsets share the last bucket",
        summary="T5 log-bucket scalar bias",
        builder=T5Bias,
        reference="Raffel et al. 2020 (T5)",
    )
)
register(
    SchemeInfo(
        "alibi",
        1,
        "bias",
        "attention logits",
        trainable=False,
        relative=True,
        extrapolation="good (train short, test long)",
        summary="linear distance penalty, geometric slopes",
        builder=Alibi,
        reference="Press et al. 2022",
    )
)
register(
    SchemeInfo(
        "rope",
        1,
        "rotary",
        "q, k",
        trainable=False,
        relative=True,
        extrapolation="poor unscaled; linear/ntk/dynamic_ntk/yarn/longrope scaling",
        summary="rotary, rotate-half or interleaved layout",
        builder=Rope,
        reference="Su et al. 2021 (RoFormer)",
    )
)
register(
    SchemeInfo(
        "xpos",
        1,
        "rotary",
        "q, k",
        trainable=False,
        relative=True,
        extrapolation="better than RoPE (distance decay)",
        summary="RoPE with exponential decay (causal)",
        builder=XPos,
        reference="Sun et al. 2022",
    )
)
register(
    SchemeInfo(
        "nope",
        1,
        "none",
        "-",
        trainable=False,
        relative=False,
        extrapolation="task-dependent (causal mask carries order)",
        summary="no positional information",
        builder=NoPE,
        reference="Kazemnejad et al. 2023",
    )
)
