"""The family's position table during transformers' weight init of a patched model's embeddings.

``vispos.patch`` takes the learned table out of a family's embeddings (``position_embeddings``,
``position_embedding``: None in its place), but the family's ``_init_weights`` still draws it, in its order with
the module's other weights (DINOv2: the table, then ``cls_token``; CLIP, SigLIP: the table's ``nn.Embedding``
visited as the embeddings' last child, then the table again with the embeddings). While transformers initialises
the embeddings, ``stand_in`` puts a table of the recorded shape back in that place (zeros, on the embeddings'
device, in their dtype), and the family's init writes to it as to its own table (every supported family's does):
every random draw of the module is the unpatched model's. Where learned2d adopted the table (``inherit``), it then
takes those values, as ``vispos.patch`` adopts them from an unpatched model, and is marked initialised
(transformers' ``_is_hf_initialized``), so its own init draws nothing more: under one seed, the patched model's init
is the unpatched model's. A learned2d whose weights are marked loaded keeps them, and its stand-in is marked loaded
too (the family draws nothing for a table a checkpoint gave). Outside the init the place is None again: no key in
the state dict, no memory held."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from ..positions import Positions
from .families import FAMILIES


@contextlib.contextmanager
def stand_in(embeddings: nn.Module, positions: Positions) -> Iterator[torch.Tensor | nn.Module | None]:
    """While it is open: a stand-in of the family's table in its place in ``embeddings`` (a Parameter, or an
    ``nn.Embedding`` for CLIP and SigLIP), yielded; None where the family keeps no table there or a stand-in is
    already in place (the outer one hands the values over). Closed without an error: learned2d takes the values
    where it adopted the table."""
    name, table = _install(embeddings)
    if name is None:
        yield None
        return
    weight = table.weight if isinstance(table, nn.Module) else table
    adopting = getattr(embeddings, "vispos_table_adopted", False) and hasattr(positions.additive, "adopt_pos_embed")
    if adopting and any(getattr(p, "_is_hf_initialized", False) for p in positions.additive.parameters()):
        weight._is_hf_initialized, adopting = True, False  # loaded: the family draws nothing for it either
    try:
        yield table
        if adopting and not weight.is_meta:  # [1, P + H*W, C], as patch read the family's table
            if positions.additive.adopt_pos_embed(weight.detach().reshape(1, -1, weight.shape[-1])):
                positions.additive._is_hf_initialized = True
    finally:
        (embeddings._parameters if name in embeddings._parameters else embeddings._modules)[name] = None


def _install(embeddings: nn.Module) -> tuple[str | None, torch.Tensor | nn.Module | None]:
    path = FAMILIES[embeddings.vispos_family].table
    if path is None:
        return None, None
    name = path.split(".")[0]
    shape = getattr(embeddings, "vispos_table_shape", None)
    own = next(iter(embeddings.parameters()), None)
    where = {"device": own.device, "dtype": own.dtype} if own is not None else {}
    if name in embeddings._parameters and embeddings._parameters[name] is None:
        table: torch.Tensor | nn.Module = nn.Parameter(torch.zeros(shape or (0,), **where))
        embeddings._parameters[name] = table
    elif name in embeddings._modules and embeddings._modules[name] is None:
        rows, width = shape or (0, 1)
        table = nn.Embedding(rows, width, _weight=torch.zeros(rows, width, **where))  # no draw of its own
        embeddings._modules[name] = table
    else:
        return None, None
    return name, table
