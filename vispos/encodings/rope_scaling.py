"""RoPE scaling: inverse frequencies and attention factors for inputs longer than training.

All functions are pure: ``(head dim, theta, scaling, current length) -> (inv_freq [dim/2], attention factor)``.
The formulas follow the papers and Hugging Face transformers' rope utilities:

- ``linear`` (position interpolation, Chen et al. 2023): inv_freq / s.
- ``ntk`` (NTK-aware, bloc97): base' = base * s ** (d / (d - 2)).
- ``dynamic_ntk``: base' = base * (s * L / L0 - (s - 1)) ** (d / (d - 2)), with L = max(L, L0).
- ``yarn`` (Peng et al. 2023): per-frequency ramp between interpolation and extrapolation, set by how
  many rotations a frequency makes over the original length (beta_fast, beta_slow; the ramp's ends
  rounded to whole pairs unless ``truncate=False``, as in gpt-oss); attention factor m(s) = 0.1 ln s + 1
  multiplies cos and sin, or m(s, mscale) / m(s, mscale_all_dim) with m(s, a) = 0.1 a ln s + 1 when
  both are given (DeepSeek-V2/V3).
- ``longrope`` (Ding et al. 2024): inv_freq / lambda_i with given per-frequency factors (a short set for
  lengths within the original, a long set beyond); attention factor sqrt(1 + ln s / ln L0), or the given
  ``long_mscale`` beyond the original length and ``short_mscale`` within it (Phi-3.5-MoE).
- ``llama3`` (Llama 3.1): frequencies whose wavelength 2 pi / f exceeds L0 / low_freq_factor are
  interpolated (f / s), those below L0 / high_freq_factor kept, a smooth blend in between; no attention
  factor.

``s`` is ``factor`` when given, else derived from the current length: max(1, L / L0) (for ``dynamic_ntk``
s = 1, since its formula already grows with L). Shipped models fix it: Phi-3's LongRoPE uses
s = max_position_embeddings / original_max_position_embeddings, which ``RopeScaling.from_config`` reads.

Every type reads ``factor``, ``original_length`` (the training length; the factor follows it when not given)
and ``attention_factor`` (replaces the type's temperature); the other fields belong to one type
(``TYPE_OPTIONS``). A field the chosen type does not read is an error, never ignored, whether it comes as a
keyword, in a dict or in a ``RopeScaling``. A transformers config is read as transformers reads it instead:
a key transformers knows but does not read for that ``rope_type`` (``original_max_position_embeddings`` of a
linear config, a lone yarn ``mscale``) is dropped, as transformers drops it, so that the numbers stay equal
to transformers'; a key transformers does not know is an error.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from .._validate import check_bool, check_choice, check_float, check_int

SCALING_TYPES: tuple[str, ...] = ("linear", "ntk", "dynamic_ntk", "yarn", "longrope", "llama3")
# options that belong to one scaling type, with the defaults that type fills in (None: no default)
TYPE_OPTIONS: dict[str, dict[str, object]] = {
    "yarn": {"beta_fast": 32.0, "beta_slow": 1.0, "mscale": None, "mscale_all_dim": None, "truncate": True},
    "longrope": {"long_factors": None, "short_factors": None, "long_mscale": None, "short_mscale": None},
    "llama3": {"low_freq_factor": 1.0, "high_freq_factor": 4.0},
}
# fields every type reads (besides ``type``)
COMMON_FIELDS: tuple[str, ...] = ("factor", "original_length", "attention_factor")
# transformers' rope_type -> vispos type (None: plain RoPE); "su" is Phi-3's first name for LongRoPE
HF_ROPE_TYPES: dict[str, str | None] = {
    "default": None, "mrope": None, "linear": "linear", "dynamic": "dynamic_ntk", "yarn": "yarn",
    "longrope": "longrope", "su": "longrope", "llama3": "llama3",
}  # fmt: skip
# transformers' rope_scaling / rope_parameters keys -> RopeScaling fields
HF_KEYS: dict[str, str] = {
    "factor": "factor", "original_max_position_embeddings": "original_length", "beta_fast": "beta_fast",
    "beta_slow": "beta_slow", "attention_factor": "attention_factor", "mscale": "mscale",
    "mscale_all_dim": "mscale_all_dim", "truncate": "truncate", "low_freq_factor": "low_freq_factor",
    "high_freq_factor": "high_freq_factor", "long_factor": "long_factors", "short_factor": "short_factors",
    "long_mscale": "long_mscale", "short_mscale": "short_mscale",
}  # fmt: skip
# the keys transformers' rope functions read for each type (PhiMoE's rotary embedding adds the mscale pair);
# others are dropped as transformers drops them ("Unrecognized keys in rope_parameters")
HF_READ_KEYS: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "dynamic_ntk": ("factor",),  # grows from the model's max_position_embeddings
    "yarn": ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "truncate"),
    "longrope": ("factor", "original_max_position_embeddings", "attention_factor", "long_factor", "short_factor",
                 "long_mscale", "short_mscale"),
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
}  # fmt: skip
# keys only a whole model config has: ``from_config`` reads such a mapping as a config.json
MODEL_CONFIG_KEYS: tuple[str, ...] = (
    "rope_scaling", "rope_parameters", "text_config", "max_position_embeddings", "model_type", "architectures",
)  # fmt: skip
# keys of the rotation itself, not of its scaling: options of the scheme (theta, dim, sections), left to the caller
HF_ROTATION_KEYS: tuple[str, ...] = ("rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved")


def rope_inv_freq(dim: int, theta: float) -> torch.Tensor:
    """Plain RoPE inverse frequencies theta ** (-2i / dim), i < dim / 2, fp32. Shape [dim // 2]."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)).float()


@dataclass(frozen=True)
class RopeScaling:
    """How to stretch RoPE beyond its training length; validated on construction.

    ``factor``, ``original_length`` and ``attention_factor`` belong to every type; the other fields to one
    type (``TYPE_OPTIONS``) and are refused by the others. Left at None, they take that type's default: yarn
    ``beta_fast=32``, ``beta_slow=1``, ``truncate=True`` (``mscale`` / ``mscale_all_dim`` unset), llama3
    ``low_freq_factor=1``, ``high_freq_factor=4``; longrope's ``long_mscale`` / ``short_mscale`` (both or
    neither) replace its attention factor beyond / within ``original_length``.
    """

    type: str
    factor: float | None = None  # None: max(1, length / original_length), recomputed for each length
    original_length: int | None = None  # training length (tokens per axis for 2D grids)
    beta_fast: float | None = None  # yarn: pairs turning more than this over original_length are kept (default 32)
    beta_slow: float | None = None  # yarn: pairs turning less than this are interpolated (default 1)
    attention_factor: float | None = None  # override the method's default temperature
    long_factors: tuple[float, ...] | None = None  # longrope: one per rotary frequency, beyond original_length
    short_factors: tuple[float, ...] | None = None  # longrope: within original_length (None: long_factors)
    long_mscale: float | None = None  # longrope: attention factor beyond original_length (Phi-3.5-MoE)
    short_mscale: float | None = None  # longrope: attention factor within original_length
    mscale: float | None = None  # yarn: attention factor m(s, mscale) / m(s, mscale_all_dim); both or neither
    mscale_all_dim: float | None = None
    truncate: bool | None = None  # yarn: round the ramp's ends to whole pairs (default True)
    low_freq_factor: float | None = None  # llama3: wavelengths above original_length / this are interpolated
    high_freq_factor: float | None = None  # llama3: wavelengths below original_length / this are kept

    def __post_init__(self) -> None:
        check_choice("RoPE scaling type", self.type, SCALING_TYPES)
        self._fill_type_options()
        if self.factor is not None:
            if check_float("scaling factor", self.factor) < 1.0:
                raise ValueError(f"scaling factor must be >= 1 (1 = no scaling), got {self.factor}")
        if self.original_length is not None:
            check_int("original_length", self.original_length, minimum=1)
        needs_length = self.type in ("yarn", "longrope", "dynamic_ntk", "llama3") or self.factor is None
        if needs_length and self.original_length is None:
            why = f"{self.type!r} scaling" if self.type != "linear" and self.type != "ntk" else "factor=None"
            raise ValueError(f"{why} needs original_length (the training length)")
        if self.attention_factor is not None:
            check_float("attention_factor", self.attention_factor, positive=True)
        if self.type == "yarn":
            self._check_yarn()
        elif self.type == "longrope":
            self._check_longrope()
        elif self.type == "llama3":
            low = check_float("low_freq_factor", self.low_freq_factor, positive=True)
            if check_float("high_freq_factor", self.high_freq_factor, positive=True) <= low:
                raise ValueError(f"high_freq_factor must exceed low_freq_factor, got {self.high_freq_factor} <= {low}")

    def _fill_type_options(self) -> None:
        """Refuse every field this type does not read; give this type's unset options their defaults."""
        for name, default in TYPE_OPTIONS.get(self.type, {}).items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, default)
        owners = {name: kind for kind, names in TYPE_OPTIONS.items() if kind != self.type for name in names}
        given = [f.name for f in fields(self) if f.name in owners and getattr(self, f.name) is not None]
        if given:
            kinds = sorted({owners[name] for name in given})
            accepted = ", ".join((*COMMON_FIELDS, *TYPE_OPTIONS.get(self.type, {})))
            raise ValueError(
                f"{', '.join(given)}: not used by {self.type!r} scaling (options of {', '.join(map(repr, kinds))}); "
                f"{self.type!r} takes {accepted}"
            )

    def _check_yarn(self) -> None:
        check_float("beta_fast", self.beta_fast, positive=True)
        check_float("beta_slow", self.beta_slow, positive=True)
        if self.beta_fast <= self.beta_slow:
            raise ValueError(f"beta_fast must exceed beta_slow, got {self.beta_fast} <= {self.beta_slow}")
        check_bool("truncate", self.truncate)
        if (self.mscale is None) != (self.mscale_all_dim is None):
            raise ValueError(
                "mscale and mscale_all_dim go together (attention factor m(s, mscale) / m(s, mscale_all_dim)); "
                f"got mscale={self.mscale}, mscale_all_dim={self.mscale_all_dim}"
            )
        if self.mscale is not None:
            check_float("mscale", self.mscale, positive=True)
            check_float("mscale_all_dim", self.mscale_all_dim, positive=True)

    def _check_longrope(self) -> None:
        if self.long_factors is None:
            raise ValueError("'longrope' scaling needs long_factors (one per rotary frequency, dim / 2)")
        for name in ("long_factors", "short_factors"):
            values = getattr(self, name)
            if values is not None:
                if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
                    raise TypeError(f"{name} must be a sequence of numbers, got {type(values).__name__} {values!r}")
                object.__setattr__(self, name, tuple(check_float(name, v, positive=True) for v in values))
        if (self.long_mscale is None) != (self.short_mscale is None):
            raise ValueError(
                "long_mscale and short_mscale go together (the attention factor beyond / within original_length); "
                f"got long_mscale={self.long_mscale}, short_mscale={self.short_mscale}"
            )
        if self.long_mscale is not None:
            check_float("long_mscale", self.long_mscale, positive=True)
            check_float("short_mscale", self.short_mscale, positive=True)
            if self.attention_factor is not None:
                raise ValueError("give attention_factor or long_mscale / short_mscale, not both (each sets the factor)")

    def resolve_factor(self, length: int) -> float:
        if self.factor is not None:
            return self.factor
        return max(1.0, length / self.original_length)  # type: ignore[operator]

    @classmethod
    def from_config(
        cls, config: Mapping[str, Any], *, max_position_embeddings: int | None = None
    ) -> RopeScaling | None:
        """The scaling of a transformers RoPE config; None for plain RoPE (no scaling).

        ``config``: a ``rope_scaling`` / ``rope_parameters`` dict, or a whole model config (``config.json``
        read as a dict; recognised by a key of ``MODEL_CONFIG_KEYS``) whose ``max_position_embeddings`` and
        ``original_max_position_embeddings`` are then read too. A model config without RoPE settings
        (absent, null, empty, or ``rope_type`` default: Mistral, Llama 2) gives None; one without them at the
        top level but with a ``text_config`` (a VLM: Llava, Qwen2-VL) is read from its ``text_config``.
        ``rope_type`` (or the older ``type``) is one of ``HF_ROPE_TYPES``; the keys transformers reads for that
        type (``HF_READ_KEYS``) map to fields by ``HF_KEYS``, the other keys it knows are dropped as transformers
        drops them, keys of the rotation itself (``HF_ROTATION_KEYS``: theta, partial rotary, mrope sections)
        are left to the caller, and any other key is an error. As transformers reads them:

        - ``original_max_position_embeddings``: the model config's when it has one (it takes precedence:
          Phi-3 keeps it there), else the dict's, else ``max_position_embeddings``;
        - yarn / longrope without ``factor``: max_position_embeddings / original (Phi-3's fixed LongRoPE factor);
        - dynamic grows from ``max_position_embeddings``; yarn's ``mscale`` / ``mscale_all_dim`` count only as a
          pair; LongRoPE's ``long_mscale`` / ``short_mscale`` (Phi-3.5-MoE) replace its attention factor.
        """
        if not isinstance(config, Mapping):
            raise TypeError(f"config must be a rope_scaling dict or a config.json dict, got {type(config).__name__}")
        if not any(key in config for key in MODEL_CONFIG_KEYS):  # the rope dict itself
            return _from_hf(dict(config), max_position_embeddings, None)
        rope = config.get("rope_scaling") or config.get("rope_parameters")  # rope_scaling wins, as in transformers
        if not rope:
            text = config.get("text_config")
            if isinstance(text, Mapping):  # a VLM: its language model's settings
                return cls.from_config(text, max_position_embeddings=max_position_embeddings)
            return None  # no RoPE settings: plain RoPE (or none at all)
        if not isinstance(rope, Mapping):
            raise TypeError(f"rope_scaling / rope_parameters must be a dict, got {type(rope).__name__} {rope!r}")
        if max_position_embeddings is None:
            max_position_embeddings = config.get("max_position_embeddings")
        return _from_hf(dict(rope), max_position_embeddings, config.get("original_max_position_embeddings"))


def _from_hf(rope: dict[str, Any], max_len: int | None, model_orig: int | None) -> RopeScaling | None:
    """``RopeScaling.from_config`` on the rope dict itself; absent and None values are the same."""
    nested = [k for k, v in rope.items() if isinstance(v, Mapping)]
    if nested and len(nested) == len(rope):
        raise ValueError(
            f"rope_parameters given per layer type ({', '.join(nested)}); pass the dict of the layer type wanted, "
            f"e.g. rope_parameters[{nested[0]!r}]"
        )
    rope_type = rope.pop("rope_type", rope.pop("type", "default"))
    if rope_type not in HF_ROPE_TYPES:
        raise ValueError(f"unknown rope_type {rope_type!r}; accepted: {', '.join(HF_ROPE_TYPES)}")
    unknown = sorted(set(rope) - set(HF_KEYS) - set(HF_ROTATION_KEYS))
    if unknown:
        accepted = ", ".join((*HF_KEYS, *HF_ROTATION_KEYS))
        raise TypeError(f"unknown RoPE config key(s) {', '.join(unknown)} for {rope_type!r}; accepted: {accepted}")
    kind = HF_ROPE_TYPES[rope_type]
    if kind is None:
        return None
    options = {HF_KEYS[k]: v for k, v in rope.items() if k in HF_READ_KEYS[kind] and v is not None}
    if kind == "dynamic_ntk":  # transformers grows it from max_position_embeddings, whatever else is given
        if max_len is None:
            raise ValueError("'dynamic' scaling grows from max_position_embeddings; pass it (or the model config)")
        options["original_length"] = max_len
    elif kind != "linear":
        orig = model_orig if model_orig is not None else options.get("original_length", max_len)
        if orig is not None:
            options["original_length"] = orig
    if kind in ("yarn", "longrope") and "factor" not in options:
        orig = options.get("original_length")
        if max_len is None or orig is None:
            raise ValueError(f"{rope_type!r} without factor needs max_position_embeddings (factor = max / original)")
        options["factor"] = max_len / orig
    if kind == "yarn" and not (options.get("mscale") and options.get("mscale_all_dim")):
        for name in ("mscale", "mscale_all_dim"):  # transformers reads them only as a pair
            options.pop(name, None)
    if kind == "longrope" and "long_mscale" in options and "short_mscale" in options:
        options.pop("attention_factor", None)  # PhiMoE's pair replaces the attention factor
    return as_scaling(kind, **options)


def as_scaling(
    scaling: RopeScaling | str | dict | None, *, original_length: int | None = None, **options: object
) -> RopeScaling | None:
    """The one way to read a scaling setting: a ``RopeScaling``, a type name with its fields as keyword
    options, or a dict of fields (as from a YAML config). ``original_length`` is the training length to
    use when the setting gives none; a setting that gives another one, or a field given both in the dict
    and as a keyword with two values, is an error (neither is silently dropped)."""
    if scaling is None:
        if options:
            raise ValueError(f"scaling options {sorted(options)} given without scaling=; accepted: {SCALING_TYPES}")
        return None
    if isinstance(scaling, RopeScaling):
        if options:
            raise ValueError(f"scaling options {sorted(options)} given beside a RopeScaling; set them inside it")
        if original_length is None or scaling.original_length == original_length:
            return scaling
        if scaling.original_length is None:
            return replace(scaling, original_length=original_length)
        raise _given_twice({"original_length": (scaling.original_length, original_length)})
    if isinstance(scaling, str):
        scaling = {"type": scaling}
    if not isinstance(scaling, dict):
        raise TypeError(f"scaling must be None, a type name, a dict or RopeScaling; got {type(scaling).__name__}")
    accepted = [f.name for f in fields(RopeScaling)]
    twice = {k: (scaling[k], v) for k, v in options.items() if k in scaling and scaling[k] != v}
    if original_length is not None and scaling.get("original_length") not in (None, original_length):
        twice["original_length"] = (scaling["original_length"], original_length)
    if twice:
        raise _given_twice(twice)
    merged = {**scaling, **options}
    unknown = sorted(map(str, set(merged) - set(accepted)))
    if unknown:
        raise TypeError(f"unknown RoPE scaling option(s) {', '.join(unknown)}; accepted: {', '.join(accepted)}")
    for key in ("long_factors", "short_factors"):
        if isinstance(merged.get(key), Sequence) and not isinstance(merged[key], str):
            merged[key] = tuple(merged[key])
    if merged.get("original_length") is None and original_length is not None:
        merged["original_length"] = original_length
    return RopeScaling(**merged)


def canonical_scaling(scaling: RopeScaling | str | Mapping[str, Any]) -> dict[str, Any]:
    """A scaling setting in one form, for comparing settings: a dict of every ``RopeScaling`` field, with the
    type's defaults (``TYPE_OPTIONS``) in place of fields left unset, so that ``"yarn"``,
    ``{"type": "yarn", "beta_fast": 32}`` and ``RopeScaling("yarn", beta_fast=32.0, ...)`` are one setting.
    Sequences become lists; nothing is validated (``as_scaling`` does that when the scaling is built)."""
    if isinstance(scaling, RopeScaling):
        given = {f.name: getattr(scaling, f.name) for f in fields(RopeScaling)}
    elif isinstance(scaling, str):
        given = {"type": scaling}
    elif isinstance(scaling, Mapping):
        given = dict(scaling)
    else:
        raise TypeError(f"scaling must be a type name, a dict or RopeScaling; got {type(scaling).__name__}")
    full = {f.name: None for f in fields(RopeScaling)} | {k: v for k, v in given.items() if v is not None}
    for name, default in TYPE_OPTIONS.get(full.get("type"), {}).items():
        if full.get(name) is None:
            full[name] = default
    return {k: list(v) if isinstance(v, tuple) else v for k, v in full.items()}


def _given_twice(values: dict[str, tuple[object, object]]) -> ValueError:
    listed = "; ".join(
        f"{k}: {a!r} in scaling=, {b!r} beside it (a keyword or the training length)" for k, (a, b) in values.items()
    )
    return ValueError(f"scaling option(s) given twice with two values ({listed}); give each once")


SCALING_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(RopeScaling) if f.name != "type")


def fold_scaling_fields(options: dict[str, object]) -> dict[str, object]:
    """Scheme options with the ``RopeScaling`` fields given beside ``scaling=`` folded into it by ``as_scaling``
    (``scaling="yarn", original_length=128`` -> ``scaling=RopeScaling("yarn", original_length=128)``), the form
    ``vispos.configure`` takes; a field without ``scaling=`` is an error. For hosts of a scalable scheme."""
    given = {k: v for k, v in options.items() if k in SCALING_FIELDS}
    if not given:
        return options
    if options.get("scaling") is None:
        raise ValueError(f"scaling options {sorted(given)} given without scaling=; accepted: {SCALING_TYPES}")
    rest = {k: v for k, v in options.items() if k not in given}
    return {**rest, "scaling": as_scaling(options.get("scaling"), **given)}


def _yarn_correction_dim(rotations: float, dim: int, theta: float, original_length: float) -> float:
    """The (fractional) frequency index that completes ``rotations`` turns over ``original_length``."""
    return dim * math.log(original_length / (rotations * 2 * math.pi)) / (2 * math.log(theta))


def yarn_ramp(
    dim: int, theta: float, original_length: float, beta_fast: float, beta_slow: float, *, truncate: bool = True
) -> torch.Tensor:
    """YaRN's extrapolation weight per frequency, [dim // 2]: 1 keeps the frequency, 0 interpolates it.

    The ramp runs between the pairs that turn ``beta_fast`` and ``beta_slow`` times over the original
    length, floored / ceiled to whole pairs when ``truncate`` (gpt-oss keeps them fractional)."""
    low = _yarn_correction_dim(beta_fast, dim, theta, original_length)
    high = _yarn_correction_dim(beta_slow, dim, theta, original_length)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return 1.0 - ramp


def yarn_mscale(s: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature m(s, a) = 0.1 a ln s + 1 (1 when s <= 1)."""
    return 0.1 * mscale * math.log(s) + 1.0 if s > 1 else 1.0


def llama3_blend(
    dim: int, theta: float, original_length: float, low_freq_factor: float, high_freq_factor: float
) -> torch.Tensor:
    """Llama 3.1's weight of the unscaled frequency per pair, [dim // 2]: 1 for wavelengths 2 pi / f below
    L0 / high_freq_factor, 0 above L0 / low_freq_factor, (L0 / wavelength - low) / (high - low) between."""
    wavelength = 2 * math.pi / rope_inv_freq(dim, theta)
    return ((original_length / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)).clamp(0, 1)


def check_scaling_dim(scaling: RopeScaling | None, dim: int) -> None:
    """LongRoPE's factor lists need one entry per rotary frequency of a ``dim``-channel rotation."""
    if scaling is None or scaling.type != "longrope":
        return
    for name in ("long_factors", "short_factors"):
        factors = getattr(scaling, name)
        if factors is not None and len(factors) != dim // 2:
            raise ValueError(
                f"longrope {name} must have one entry per rotary frequency (dim / 2 = {dim // 2}), got {len(factors)}"
            )


# --- one function per type: (dim, theta, scaling, factor s, length, span) -> (inv_freq [dim // 2], attention factor);
# ``span``: the angle (radians) the training length turns at inverse frequency 1, where YaRN and Llama 3 count
# rotations (``original_length`` for integer positions; ``scaled_inv_freq``)
Method = Callable[[int, float, RopeScaling, float, int, float], tuple[torch.Tensor, float]]


def _linear(dim: int, theta: float, sc: RopeScaling, s: float, length: int, span: float) -> tuple[torch.Tensor, float]:
    return rope_inv_freq(dim, theta) / s, 1.0


def _ntk(dim: int, theta: float, sc: RopeScaling, s: float, length: int, span: float) -> tuple[torch.Tensor, float]:
    return rope_inv_freq(dim, theta * s ** (dim / (dim - 2))), 1.0


def _dynamic_ntk(
    dim: int, theta: float, sc: RopeScaling, s: float, length: int, span: float
) -> tuple[torch.Tensor, float]:
    a = sc.factor if sc.factor is not None else 1.0  # L / L0 below already follows the length
    grown = max(length, sc.original_length) / sc.original_length  # type: ignore[operator]
    return rope_inv_freq(dim, theta * (a * grown - (a - 1)) ** (dim / (dim - 2))), 1.0


def _yarn(dim: int, theta: float, sc: RopeScaling, s: float, length: int, span: float) -> tuple[torch.Tensor, float]:
    base = rope_inv_freq(dim, theta)
    keep = yarn_ramp(dim, theta, span, sc.beta_fast, sc.beta_slow, truncate=sc.truncate)  # type: ignore[arg-type]
    if sc.mscale is None:
        attention = yarn_mscale(s)
    else:
        attention = yarn_mscale(s, sc.mscale) / yarn_mscale(s, sc.mscale_all_dim)  # type: ignore[arg-type]
    return base / s * (1 - keep) + base * keep, attention


def _longrope(
    dim: int, theta: float, sc: RopeScaling, s: float, length: int, span: float
) -> tuple[torch.Tensor, float]:
    check_scaling_dim(sc, dim)
    use_long = length > sc.original_length or sc.short_factors is None  # type: ignore[operator]
    factors = sc.long_factors if use_long else sc.short_factors
    if sc.long_mscale is not None:  # Phi-3.5-MoE: the attention factor is given, beyond / within the original length
        attention = sc.long_mscale if length > sc.original_length else sc.short_mscale  # type: ignore[operator]
    else:
        attention = math.sqrt(1 + math.log(s) / math.log(sc.original_length)) if s > 1 else 1.0  # type: ignore[arg-type]
    return rope_inv_freq(dim, theta) / torch.tensor(factors, dtype=torch.float32), attention


def _llama3(dim: int, theta: float, sc: RopeScaling, s: float, length: int, span: float) -> tuple[torch.Tensor, float]:
    base = rope_inv_freq(dim, theta)
    keep = llama3_blend(dim, theta, span, sc.low_freq_factor, sc.high_freq_factor)  # type: ignore[arg-type]
    return base / s * (1 - keep) + base * keep, 1.0


METHODS: dict[str, Method] = {
    "linear": _linear, "ntk": _ntk, "dynamic_ntk": _dynamic_ntk, "yarn": _yarn, "longrope": _longrope,
    "llama3": _llama3,
}  # fmt: skip


def scaled_inv_freq(
    dim: int, theta: float, scaling: RopeScaling | None, length: int, *, span: float | None = None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim // 2] and the attention factor for a sequence of ``length`` tokens.

    ``span``: the coordinate extent of the training length, where YaRN and Llama 3 count each frequency's
    rotations (a pair turns span x inv_freq radians over it); None: ``original_length``, the span of
    integer positions. Coordinates on another scale (DINOv3's 2 pi x normalized coordinates, 4 pi over any
    training grid) give theirs, so the ramp keeps the pairs that turn often over the training image."""
    if scaling is None:
        return rope_inv_freq(dim, theta), 1.0
    span = float(scaling.original_length) if span is None and scaling.original_length is not None else span
    factor = scaling.resolve_factor(length)
    inv_freq, attention = METHODS[scaling.type](dim, theta, scaling, factor, length, span)  # type: ignore[arg-type]
    if scaling.attention_factor is not None:
        attention = scaling.attention_factor
    return inv_freq, attention
