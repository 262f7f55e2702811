"""The settings record of ``Positions``: options in canonical form, two settings compared, and the record
saved in and read back from a state dict (a checkpoint of other positions refused, one made at another
training grid resampled to the model's)."""

from __future__ import annotations

import inspect
from dataclasses import asdict, is_dataclass
from typing import Any

import torch
from torch import nn

from .._state import encode, options_as_written, read
from ..encodings.rope_scaling_setting import canonical_scaling
from ..registry import get_info


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


def own_records(positions: nn.Module, prefix: str = "vispos.") -> dict[str, torch.Tensor]:
    """The settings records of ``positions`` and of every module under it that keeps one, keyed as a state dict holds
    them under ``prefix``: what a host gives a plain checkpoint, which has none, so that the model keeps its settings
    (any host's positional module: ``Positions``, Swin's per-stage one)."""
    return {f"{prefix}{name}{'.' if name else ''}_extra_state": module.get_extra_state()
            for name, module in positions.named_modules()
            if type(module).get_extra_state is not nn.Module.get_extra_state}  # fmt: skip


class SettingsRecord:
    """``Positions``' state-dict record (a mixin of ``Positions``): its settings saved as a tensor, read back
    and checked against the model's own when a checkpoint loads."""

    def get_extra_state(self) -> torch.Tensor:
        """The settings as a tensor record (``vispos._state``): the state dict holds tensors only. The options
        are recorded with every default filled in (``canonical_options``)."""
        options = canonical_options(self.settings["pos"], self.settings["options"])
        settings = {**self.settings, "options": options, "train_grid": list(self.train_grid)}
        return encode({"settings": plain(settings), "enabled": int(self.enabled), "log_n_tokens": self.log_n_tokens})

    def set_extra_state(self, state: torch.Tensor | dict[str, Any]) -> None:
        """Take a checkpoint's record: one of other positions is refused, naming what differs (``load_state_dict``
        has checked it already; a loader that sets the record alone, ``_state.RecordSlot``, reaches here)."""
        state = _saved_state(state)
        self._refuse_other(state["settings"])
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
                    self._refuse_other(saved)
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

    def _refuse_other(self, saved: dict[str, Any]) -> None:
        """A ``ValueError`` naming what differs when the checkpoint's settings ``saved`` are of other positions."""
        own = self.settings
        if same_positions(saved, own):
            return
        differing = set(differing_options(saved, own))
        raise ValueError(
            f"the checkpoint's positions are {_describe(saved, differing)}; this model's are "
            f"{_describe(own, differing)} (they differ in {position_differences(saved, own)})"
            ": patch a fresh model the way the checkpoint's was patched "
            "and load it, or load with strict=False to keep only the weights outside the positions"
        )

    def _sized_modules(self, prefix: str) -> list[tuple[nn.Module, str]]:
        """(module, its state-dict prefix) for every scheme module whose weights have a grid size."""
        found = []
        for name, module in self.named_modules(prefix=prefix.rstrip(".")):
            if hasattr(module, "resample_state"):
                found.append((module, f"{name}."))
        return found
