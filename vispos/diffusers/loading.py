"""``from_pretrained``: a diffusers transformer saved after ``vispos.patch`` (``save_pretrained`` writes its class's
config and weights, with the positional settings as tensor records ``vispos.*`` beside them), rebuilt by its
diffusers class, patched again and given back those settings (scaling, schedule, training grid, log-n) and, for a
catalogue scheme trained in place of the model's positions (``inherit=False``), its scheme, options and weights."""

from __future__ import annotations

import json
import os
from typing import Any

import diffusers
import torch
from safetensors import safe_open
from torch import nn

from .._state import decode
from ..registry import get_info
from .families import FAMILIES, supported
from .patching import OWN_SCHEME, patch

PREFIX = "vispos."


def from_pretrained(path: str | os.PathLike, *, subfolder: str | None = None, **kwargs: Any) -> nn.Module:
    """The transformer saved at the local folder ``path`` (``subfolder``: a pipeline's ``"transformer"``), patched as
    it was saved. ``kwargs`` go to the diffusers class's ``from_pretrained`` (``torch_dtype``...); a checkpoint saved
    without vispos loads patched with the model's own positions and no scaling. The records are read from the weights
    diffusers reads (``*.safetensors``, else the ``*.bin`` files of ``safe_serialization=False``)."""
    folder = os.path.join(path, subfolder) if subfolder else os.fspath(path)
    with open(os.path.join(folder, "config.json")) as file:
        name = json.load(file).get("_class_name")
    if name not in FAMILIES:
        raise TypeError(f"{folder} holds a diffusers {name}; vispos patches {supported()}")
    model = _loading(getattr(diffusers, name)).from_pretrained(folder, **kwargs)
    model.__class__ = getattr(diffusers, name)  # the loading subclass only told diffusers which keys are vispos's
    records = saved_records(folder)
    settings = decode(records["_extra_state"])["settings"] if "_extra_state" in records else None
    if settings is not None and "inherited" not in settings:  # a catalogue scheme in place of the model's positions
        context = {c for name in settings["pos"] for c in get_info(name, ndim=2).context}  # the model's, not options
        options = {k: v for k, v in settings["options"].items() if k not in context}
        patch(model, settings["pos"], inherit=False, **options)
        model.vispos.to(next(model.parameters()).device)
    else:
        patch(model, OWN_SCHEME[FAMILIES[name].kind])
    if records:
        model.vispos.load_state_dict(records)
    return model


def saved_records(folder: str) -> dict[str, torch.Tensor]:
    """The ``vispos.*`` entries of the weights diffusers loads from ``folder``: its ``*.safetensors`` files, else (as
    ``save_pretrained(safe_serialization=False)`` writes them) its ``*.bin`` files."""
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    records: dict[str, torch.Tensor] = {}
    if files:
        for file in files:
            with safe_open(os.path.join(folder, file), "pt") as weights:
                records |= {k[len(PREFIX) :]: weights.get_tensor(k) for k in weights.keys() if k.startswith(PREFIX)}  # noqa: SIM118
        return records
    for file in sorted(f for f in os.listdir(folder) if f.endswith(".bin")):
        weights = torch.load(os.path.join(folder, file), map_location="cpu", weights_only=True)
        records |= {k[len(PREFIX) :]: v for k, v in weights.items() if k.startswith(PREFIX)}
    return records


def _loading(cls: type) -> type:
    """``cls`` for diffusers' loader, told that the ``vispos.*`` records are restored here (no "weights not used"
    warning for them; any other unused weight is still reported)."""
    ignored = [*(cls._keys_to_ignore_on_load_unexpected or []), r"^vispos\."]
    return type(cls.__name__, (cls,), {"_keys_to_ignore_on_load_unexpected": ignored, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__})  # fmt: skip
