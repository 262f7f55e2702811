"""``from_pretrained``: a diffusers transformer saved after ``vispos.patch`` (``save_pretrained`` writes its class's
config and weights, with the positional settings as tensor records ``vispos.*`` beside them), rebuilt by its
diffusers class, patched again and given back those settings (scaling, schedule, training grid, log-n)."""

from __future__ import annotations

import json
import os
from typing import Any

import diffusers
from safetensors import safe_open
from torch import nn

from .families import FAMILIES, supported
from .patching import OWN_SCHEME, patch

PREFIX = "vispos."


def from_pretrained(path: str | os.PathLike, *, subfolder: str | None = None, **kwargs: Any) -> nn.Module:
    """The transformer saved at the local folder ``path`` (``subfolder``: a pipeline's ``"transformer"``), patched as
    it was saved. ``kwargs`` go to the diffusers class's ``from_pretrained`` (``torch_dtype``...); a checkpoint saved
    without vispos loads patched with the model's own positions and no scaling."""
    folder = os.path.join(path, subfolder) if subfolder else os.fspath(path)
    with open(os.path.join(folder, "config.json")) as file:
        name = json.load(file).get("_class_name")
    if name not in FAMILIES:
        raise TypeError(f"{folder} holds a diffusers {name}; vispos patches {supported()}")
    model = getattr(diffusers, name).from_pretrained(folder, **kwargs)
    patch(model, OWN_SCHEME[FAMILIES[name].kind])
    records = {}
    for file in sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")):
        with safe_open(os.path.join(folder, file), "pt") as weights:
            records |= {k[len(PREFIX) :]: weights.get_tensor(k) for k in weights.keys() if k.startswith(PREFIX)}  # noqa: SIM118
    if records:
        model.vispos.load_state_dict(records)
    return model
