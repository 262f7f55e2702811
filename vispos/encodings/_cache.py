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

    Memory is bounded: the kept results hold at most ``max_bytes`` together (the least recently used go
    first), and a result larger than that is returned without being kept. A per-layer scheme keeps its small
    grids' rotations (ViT-S at 224 px: about 2.4 MiB a layer) and computes a large grid's while its layer runs,
    so a forward at 896 px does not hold every layer's rotation at once.
    """

    def __init__(self, size: int = 4, max_bytes: int = 2**22) -> None:
        self.size = size
        self.max_bytes = max_bytes
        self._kept: dict[Hashable, tuple[tuple[Any, ...], Any, int]] = {}

    def __reduce__(self) -> tuple[type, tuple[int, int]]:
        return InferenceCache, (self.size, self.max_bytes)  # copies and pickles start empty

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
        size = _nbytes(value)
        if size > self.max_bytes:
            return value
        self._kept[key] = (stamp, value, size)
        while len(self._kept) > self.size or sum(k[2] for k in self._kept.values()) > self.max_bytes:
            self._kept.pop(next(iter(self._kept)))
        return value

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors the kept results hold."""
        return sum(k[2] for k in self._kept.values())


def _nbytes(value: Any) -> int:
    """Bytes of the tensors of a result: a tensor, a sequence of them, or an object's tensor attributes."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(_nbytes(v) for v in value)
    if hasattr(value, "__dict__"):
        return sum(_nbytes(v) for v in vars(value).values() if isinstance(v, (torch.Tensor, tuple, list)))
    return 0


def _stamp(module: nn.Module) -> tuple[Any, ...] | None:
    """Which tensors the module holds and their versions; None when a tensor has no version counter."""
    try:
        return tuple(
            (t.data_ptr(), t._version, t.dtype, t.device, t.shape)
            for t in (*module.parameters(), *module.buffers())
        )
    except RuntimeError:  # "Inference tensors do not track version counter"
        return None
