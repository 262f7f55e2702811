"""Settings that travel with a model's weights, as a tensor.

A module's extra state (``get_extra_state``) is what ``state_dict`` saves beside its parameters. vispos
records its settings there as one ``uint8`` tensor holding UTF-8 JSON, never as a Python object: the
tools built around state dicts take tensors only (timm's ``ModelEma*`` call ``detach`` / ``copy_`` /
``is_floating_point`` on every value; ``safetensors`` refuses anything else; DDP and the hub format
expect the same). The record is made anew at each ``state_dict()`` call, so such a tool may copy into it
or average it without effect on the model.

The record's length depends on the settings alone, never on the switches that change during training
(DroPE's ``enabled`` is stored as 0 / 1), so two copies of one model (a model and its EMA) keep records
of the same shape. Checkpoints of vispos 0.1 held the settings as a dict; ``decode`` reads those too.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch

FORMAT = 1  # the record's layout; a later layout raises a clear error in an older vispos


def encode(settings: Mapping[str, Any]) -> torch.Tensor:
    """Plain settings (dicts, lists, numbers, strings, None) -> a uint8 tensor [n] of their JSON."""
    text = json.dumps({"format": FORMAT, **settings}, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)


def decode(record: torch.Tensor | Mapping[str, Any]) -> dict[str, Any]:
    """The settings of a record made by ``encode`` (or the dict a vispos 0.1 checkpoint holds)."""
    if isinstance(record, Mapping):
        return dict(record)
    if not isinstance(record, torch.Tensor) or record.dtype != torch.uint8 or record.dim() != 1:
        raise ValueError(f"not a vispos settings record: expected a uint8 tensor [n], got {_kind(record)}")
    try:
        settings = json.loads(bytes(record.cpu().tolist()).decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"the vispos settings record is damaged ({error})") from None
    version = settings.pop("format", None)
    if version != FORMAT:
        raise ValueError(f"this vispos reads settings records of format {FORMAT}, the checkpoint's is {version!r}")
    return settings


def _kind(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__
