"""The RoPE scaling setting: ``RopeScaling`` (a type and its fields, checked), read from a type name, a
dict, keywords or a transformers config, and put in one canonical form; ``rope_scaling`` applies it.

Every type reads ``factor``, ``original_length`` (the training length; the factor follows it when not given)
and ``attention_factor`` (replaces the type's temperature); the other fields belong to one type
(``TYPE_OPTIONS``). A field the chosen type does not read is an error, never ignored, whether it comes as a
keyword, in a dict or in a ``RopeScaling``. A transformers config is read as transformers reads it instead:
a key transformers knows but does not read for that ``rope_type`` (``original_max_position_embeddings`` of a
linear config, a lone yarn ``mscale``) is dropped, as transformers drops it, so that the numbers stay equal
to transformers'; a key transformers does not know is an error.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

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
