"""Rotations kept between forwards at inference, for the schemes whose rotation costs more than RoPE's
(a matrix exponential of learned generators, an orthogonal basis from a solve)."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import nn


class InferenceCache:
    """The last few results of a module's rotation, reused while nothing they depend on has changed.

    Used only in inference: the module in eval mode, autograd off (``torch.no_grad`` or
    ``torch.inference_mode``), not traced (``torch.compile``, ``torch.export``, ``torch.jit.trace`` and
    ONNX export record the computation, never a kept result). A result is reused when it was made for the
    same key (the grid, the device, any Python state of the module's) from the module's parameters and
    buffers as they are now: the same tensors at the same version. An optimizer step, ``load_state_dict``
    or any in-place change bumps a tensor's version, ``.to()`` / ``.half()`` make new tensors: each makes
    the kept results stale, and the rotation is computed anew. Training and autograd compute it every time.
    The cache is not module state: nothing of it is in the state dict, and a copy or pickle of the module
    starts empty.
    """

    def __init__(self, size: int = 4) -> None:
        self.size = size
        self._kept: dict[Hashable, tuple[tuple[Any, ...], Any]] = {}

    def __reduce__(self) -> tuple[type, tuple[int]]:
        return InferenceCache, (self.size,)  # copies and pickles start empty

    def __len__(self) -> int:
        return len(self._kept)

    def get(self, module: nn.Module, key: Hashable, compute: Callable[[], Any]) -> Any:
        """``compute()``, or what it returned before for ``key`` if the module's tensors are unchanged since."""
        if module.training or torch.is_grad_enabled() or torch.compiler.is_compiling() or torch.jit.is_tracing():
            return compute()
        stamp = _stamp(module)
        if stamp is None:  # tensors without a version (made in inference mode): nothing to compare with
            return compute()
        kept = self._kept.pop(key, None)
        if kept is not None and kept[0] == stamp:
            self._kept[key] = kept  # most recently used last
            return kept[1]
        value = compute()
        self._kept[key] = (stamp, value)
        while len(self._kept) > self.size:
            self._kept.pop(next(iter(self._kept)))
        return value


def _stamp(module: nn.Module) -> tuple[Any, ...] | None:
    """Which tensors the module holds and their versions; None when a tensor has no version counter."""
    try:
        return tuple(
            (t.data_ptr(), t._version, t.dtype, t.device, t.shape)
            for t in (*module.parameters(), *module.buffers())
        )
    except RuntimeError:  # "Inference tensors do not track version counter"
        return None
