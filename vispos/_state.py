"""Settings that travel with a model's weights, as a tensor.

A module's extra state (``get_extra_state``) is what ``state_dict`` saves beside its parameters. vispos
records its settings there as one ``uint8`` tensor holding UTF-8 JSON, never as a Python object: the
tools built around state dicts take tensors only (timm's ``ModelEma*`` call ``detach`` / ``copy_`` /
``is_floating_point`` on every value; ``safetensors`` refuses anything else; DDP and the hub format
expect the same). The record is made anew at each ``state_dict()`` call, so such a tool may copy into it
or average it without effect on the model.

Every record has one shape, ``[RECORD_BYTES]`` (the JSON padded with spaces), whatever it holds: a model
and its EMA copy stay copyable into each other after ``vispos.configure`` changed one of them, and a
distributed checkpoint (``torch.distributed.checkpoint``, which plans every tensor's shape) loads into a
model of other settings or another grid. A record that would not fit is refused, naming the limit.

Loaders that set a model's tensors one by one by name (accelerate's ``set_module_tensor_to_device`` in
``load_checkpoint_in_model`` / ``load_checkpoint_and_dispatch``, transformers' loader) reach a record through
``expose_records``: in a module's buffers ``_extra_state`` reads as its record and takes one, which the module
loads (checked as ``load_state_dict`` checks it); it is never listed among the buffers, so that ``named_buffers``,
``.to()``, ``to_empty`` and offloading hooks never see it, and never stored twice. Setting the attribute
(``setattr``, which torch does through ``register_buffer``), as transformers' loader does with uninitialised memory
for each key a checkpoint lacks, leaves it: torch announces every ``register_buffer`` to its buffer-registration
hooks, and vispos's (``_announce``) tells the slot which tensor is being registered rather than loaded.

Older records still load: format 1 (the JSON unpadded, any length) and vispos 0.1's dicts. A state dict
cast wholesale to another dtype (``bfloat16``, ``float16``, an integer type) keeps its records readable,
since those types hold the bytes 0-255 exactly.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping
from typing import Any

import torch

FORMAT = 2  # the record's layout; a later layout raises a clear error in an older vispos
# every record's length. The largest measured (tests/test_settings_record.py): 3.1 KB, a Positions record of
# learned2d + rope2d at head dim 128 with LongRoPE factors given at patch time and again through configure
RECORD_BYTES = 16384
READABLE = (1, 2)  # the formats this vispos reads (1: the JSON of any length; 2: padded to RECORD_BYTES)

# Scheme name -> {option: its default in the vispos versions that wrote format-1 records and 0.1 dicts}, for
# every option whose default has changed since. Those records hold only the options given; the options left
# out are read at these old defaults, so that a checkpoint is compared with a model (and refused, naming the
# option) under the options it was trained with, never reinterpreted under a newer default. Format-2 records
# hold every option with its value (``Positions.get_extra_state``) and need no such table.
FORMAT1_DEFAULTS: dict[str, dict[str, Any]] = {
    # LieRE's code: dense generators shared by the network, on linspace(0, n / n_train); before, blocks of 4 per
    # layer and head on [-1, 1]
    "liere2d": {"block_size": 4, "coords": "normalized", "per_head": True, "per_layer": True},
    # ComRoPE's code: coordinates (i + 0.5) / n in [0, 1], blocks of 8; before, [-1, 1] and blocks of 4
    "comrope2d": {"block_size": 4, "coords": "normalized"},
    # golden-gate RoPE: per-head directions at multiples of pi / phi, 0.2-20 on [-1, 1]; before, one set of
    # directions at multiples of the golden angle with RoPE's magnitudes (theta 100) on patch indices
    "rope2d_golden": {"theta": 100.0, "spacing": "golden_angle", "per_head": False, "coords": "pixel"},
}

# (scheme, option, value) -> why a format-1 record with that value cannot be read today: its meaning changed
# with no option to ask for the former one, so such a checkpoint is refused by name, never reinterpreted.
FORMAT1_REFUSED: dict[tuple[str, str, Any], str] = {
    ("string2d", "freqs", "golden"): "string2d(freqs='golden') now turns rope2d_golden's per-head directions at "
    "multiples of pi / phi (golden-gate RoPE); the former directions (one set, golden angle) are not available",
}


def encode(settings: Mapping[str, Any]) -> torch.Tensor:
    """Plain settings (dicts, lists, numbers, strings, None) -> a uint8 tensor [RECORD_BYTES] of their JSON."""
    text = json.dumps({"format": FORMAT, **settings}, sort_keys=True, separators=(",", ":"), allow_nan=False)
    data = text.encode()
    if len(data) > RECORD_BYTES:
        raise ValueError(
            f"these vispos settings take {len(data)} bytes of JSON, more than a settings record holds "
            f"(vispos._state.RECORD_BYTES = {RECORD_BYTES}): {text[:200]}..."
        )
    return torch.frombuffer(bytearray(data.ljust(RECORD_BYTES, b" ")), dtype=torch.uint8)


def decode(record: torch.Tensor | Mapping[str, Any]) -> dict[str, Any]:
    """The settings of a record made by ``encode`` (of any readable format, in any real dtype that holds
    its bytes exactly), or the dict a vispos 0.1 checkpoint holds."""
    return read(record)[0]


def read(record: torch.Tensor | Mapping[str, Any]) -> tuple[dict[str, Any], int]:
    """(settings, the record's format): 0 for a vispos 0.1 dict, else ``READABLE``'s."""
    if isinstance(record, Mapping):
        return dict(record), 0
    data = _bytes(record)
    try:
        settings = json.loads(data.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        cast = "" if record.dtype == torch.uint8 else f" (as {record.dtype}: a cast to a type that cannot hold 0-255?)"
        raise ValueError(f"the vispos settings record is damaged{cast} ({error})") from None
    version = settings.pop("format", None) if isinstance(settings, dict) else None
    if version not in READABLE:
        raise ValueError(
            f"this vispos reads settings records of format {', '.join(map(str, READABLE))}, the checkpoint's is "
            f"{version!r}: load it with the vispos that wrote it, or a newer one"
        )
    return settings, version


def options_as_written(schemes: list[str], options: Mapping[str, Any], version: int) -> dict[str, Any]:
    """The options a Positions record of format ``version`` stands for: a format-2 record holds them all; an
    older one the options given, the others at the defaults of its vispos (``FORMAT1_DEFAULTS``)."""
    if version >= 2:
        return dict(options)
    old: dict[str, Any] = {}
    for name in schemes:
        old |= FORMAT1_DEFAULTS.get(name, {})
        for (scheme, option, value), why in FORMAT1_REFUSED.items():
            if scheme == name and options.get(option) == value:
                raise ValueError(f"this checkpoint's positions were written by vispos 0.1 (settings format "
                                 f"{version}) and cannot be read today: {why}")  # fmt: skip
    return old | dict(options)


KEY = "_extra_state"  # torch's name for a module's extra state in a state dict
# Setting the attribute ``_extra_state`` (``setattr``, which reaches the buffers through ``register_buffer``) is
# not a load, as on any torch module (there it sets a plain attribute): transformers' loader does it to put an
# uninitialised tensor (``torch.empty_like``) in place of each key the checkpoint lacks before initialising them,
# and the record of a module is not a weight to initialise: the module keeps its settings. Loaders that set a
# record read from a checkpoint do it by item (accelerate's ``module._buffers[name] = value``) or call
# ``set_extra_state`` (transformers'). ``register_buffer`` calls torch's buffer-registration hooks with the tensor
# just before it stores it: ``_announce`` names that tensor to the slot, which then takes it as no load.


class RecordSlot(dict):
    """A module's ``_buffers`` in which ``_extra_state`` reads as the module's record (``get_extra_state``) and
    setting it by item loads one (``set_extra_state``, then ``loaded``); the other buffers are as before. The record
    is not among the items: the module's buffers are listed, moved and saved as without it."""

    def __init__(self, buffers: Mapping[str, Any], owner: Any, loaded: Callable[[], None] | None) -> None:
        super().__init__(buffers)
        self.owner, self.loaded = owner, loaded
        self.registering: object = None  # the tensor register_buffer is storing as the record (``_announce``)

    def __contains__(self, key: object) -> bool:
        return key == KEY or super().__contains__(key)

    def __getitem__(self, key: str) -> Any:
        return self.owner.get_extra_state() if key == KEY else super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self else default

    def __setitem__(self, key: str, value: Any) -> None:
        if key != KEY:
            super().__setitem__(key, value)
            return
        registered = getattr(self, "registering", None) is value
        self.registering = None
        if registered:  # setattr(module, "_extra_state", ...) or register_buffer: no load
            return
        if isinstance(value, torch.Tensor) and not value.is_meta:  # meta: a loader offloading it, nothing to read
            self.owner.set_extra_state(value)
            if self.loaded is not None:
                self.loaded()


def _announce(module: Any, name: str, tensor: Any) -> None:
    """torch's buffer-registration hook (every ``register_buffer``, ``setattr`` of a buffer's name included): a
    record slot is told which tensor is registered as its record, so that storing it is not taken for a load."""
    if name == KEY:
        slot = module.__dict__.get("_buffers")
        if isinstance(slot, RecordSlot):
            slot.registering = tensor


@functools.cache
def _announcing() -> Any:
    """``_announce`` registered once, with the first record slot (torch's hooks are global to its modules)."""
    return torch.nn.modules.module.register_module_buffer_registration_hook(_announce)


def expose_records(root: Any, loaded: Callable[[], None] | None = None) -> None:
    """Give every module under ``root`` (a ``torch.nn.Module``) that has a settings record a ``RecordSlot`` for
    buffers; ``loaded``: called after any but ``root``'s own record is set that way (``root`` follows its own)."""
    _announcing()
    for module in root.modules():
        if type(module).get_extra_state is torch.nn.Module.get_extra_state:
            continue
        then = None if module is root else loaded
        buffers = module.__dict__["_buffers"]
        if isinstance(buffers, RecordSlot):
            buffers.loaded = then
        else:
            module.__dict__["_buffers"] = RecordSlot(buffers, module, then)


def _bytes(record: object) -> bytes:
    """A record's bytes: a 1-D tensor of uint8, or of another real dtype whose values are the bytes."""
    if not isinstance(record, torch.Tensor) or record.dim() != 1 or record.dtype in (torch.bool, torch.complex64,
                                                                                       torch.complex128):
        raise ValueError(
            f"not a vispos settings record: expected a 1-D tensor of bytes (uint8, or a real dtype holding the "
            f"integers 0-255), got {_kind(record)}"
        )
    values = record.detach().cpu()
    if values.dtype != torch.uint8:
        exact = values.double()
        if not bool(((exact >= 0) & (exact <= 255) & (exact == exact.round())).all()):
            raise ValueError(
                f"the vispos settings record is damaged: as {values.dtype} it holds values that are not the "
                "integers 0-255 (a cast to a type that cannot hold them); load the state dict as saved"
            )
        values = values.to(torch.uint8)
    return values.numpy().tobytes()


def _kind(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__
