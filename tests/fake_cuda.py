"""Running a model's forward on fake CUDA tensors (``torch._subclasses.fake_tensor.FakeTensorMode``) on a
machine without a GPU: shapes, dtypes and devices propagate, no arithmetic runs.

What it catches: a tensor made on another device than the input's (``Watch`` records every op whose output is
not on CUDA, with the vispos line that ran it), a device mismatch (raises ``FakeTensorDeviceMismatchError``),
and every host-device synchronisation (``.item()``, ``.tolist()``, ``nonzero``, boolean-mask indexing and
other ops whose output depends on data raise under fake tensors; a copy from CUDA to the host is recorded).
A ragged or packed batch's layout is read on the host by design (``ISOLATED``): ``host_reads`` runs such
forwards on real CPU tensors and records every data-dependent op with the vispos function that ran it.
What fake tensors cannot check: the backward (the autograd engine asks for a real device), the kernel a real device
chooses (SDPA flash / memory-efficient / math), numerics and speed: ``benchmarks/gpu_check.py`` measures those
on a GPU.
"""

from __future__ import annotations

import traceback
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# vispos code allowed to make host tensors during a forward, with why.
HOST_CONSTANTS = {
    # RoPE's inverse frequencies are a function of the settings alone (dim, theta, the scaling and the grid
    # size): every scaling formula is evaluated in float64 on the host, so that they are the same on every
    # device (MPS has no float64), and the [dim / 2] result is copied to the device; nothing is read back.
    "vispos/encodings/rope_scaling.py",
}


def caller() -> traceback.FrameSummary | None:
    """The innermost frame outside torch and this file: the code that ran the op."""
    frames = [f for f in traceback.extract_stack() if "/torch/" not in f.filename and f.filename != __file__]
    return frames[-1] if frames else None


def in_vispos(frame: traceback.FrameSummary | None) -> bool:
    return frame is not None and "/vispos/" in frame.filename


def where(frame: traceback.FrameSummary, at: str) -> str:
    return f"vispos/{frame.filename.split('/vispos/')[-1]}:{at}"


class Watch(TorchDispatchMode):
    """Records ``(op, vispos file:line)`` of every op that leaves a tensor off CUDA (a computation on the host,
    a copy to it)."""

    def __init__(self) -> None:
        super().__init__()
        self.off_device: set[tuple[str, str]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 (torch's signature)
        out = func(*args, **(kwargs or {}))
        if func.namespace == "prim" or func is torch.ops.aten.lift_fresh.default:
            return out  # FakeTensor's device queries; Python numbers made a tensor (torch.tensor), then moved
        if any(isinstance(t, torch.Tensor) and t.device.type != "cuda" for t in tree_leaves(out)):
            frame = caller()
            self.off_device.add((str(func), where(frame, str(frame.lineno)) if in_vispos(frame) else "outside vispos"))
        return out

    def unexplained(self) -> set[tuple[str, str]]:
        return {(op, at) for op, at in self.off_device if at.rsplit(":", 1)[0] not in HOST_CONSTANTS}


def fake_cuda_(model: nn.Module, mode: FakeTensorMode) -> nn.Module:
    """Every parameter and buffer of ``model`` replaced by a fake CUDA copy (``Module.to("cuda")`` would ask
    for a real device), in place."""
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[name] = nn.Parameter(mode.from_tensor(p).to("cuda"), p.requires_grad)
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = mode.from_tensor(b).to("cuda")
    return model


@contextmanager
def fake_cuda(model: nn.Module) -> Iterator[Watch]:
    """``with fake_cuda(model) as watch:`` runs the block with ``model`` on fake CUDA tensors (tensors made in
    the block are fake; make inputs with ``device="cuda"``)."""
    mode = FakeTensorMode()
    with mode:
        fake_cuda_(model, mode)
        with Watch() as watch:
            yield watch


def forwards(model: nn.Module, inputs: list, dtype: torch.dtype) -> Watch:
    """``model`` in ``dtype`` run on fake CUDA in training and eval mode on each of ``inputs`` (callables taking
    a dtype and a device); each output must be on CUDA."""
    model = model.to(dtype)
    with fake_cuda(model) as watch:
        for training in (True, False):
            model.train(training)
            for make in inputs:
                out = model(**make(dtype, "cuda"))
                leaves = [t for t in tree_leaves(out if isinstance(out, torch.Tensor) else dict(out))
                          if isinstance(t, torch.Tensor)]  # fmt: skip
                assert leaves and all(t.device.type == "cuda" for t in leaves)
    return watch


aten = torch.ops.aten
# ops whose output's shape or value reaches the host from the data (a synchronisation on a GPU)
DATA_DEPENDENT = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
                  aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default,
                  aten.repeat_interleave.Tensor}  # fmt: skip
# vispos functions allowed to read the data on the host, with why (file:function).
ISOLATED = {
    # A ragged or packed batch's layout: its distinct grid sizes become Python numbers (a position table is built
    # per size), read once per forward from the coordinates / sizes, before any block runs; on a GPU this is the
    # one synchronisation of a ragged forward. A regular batch never reaches it.
    "vispos/ragged.py:ragged_layout",
    # Whether every row is one image (no padding, no packing), read when the batch's context is built, to leave
    # out the mask that keeps images apart: part of reading the layout.
    "vispos/ragged.py:one_image_per_row",
    # peg2d on a ragged batch: each image's tokens go onto a canvas of its own grid for the convolution, the
    # number of images of each size read from the layout (once per conditional layer: PEG has one).
    "vispos/ragged_apply.py:ragged_conditional",
    # The packed rows of Pixtral and of the Qwen-VL towers: each image's (frame's) size read from image_sizes /
    # grid_thw to lay out its tokens, once per forward, as transformers' own forward reads them.
    "vispos/hf/tower_modules.py:read_sizes",
    "vispos/hf/tower_modules.py:merged_layout",
    # The Qwen-VL towers' input check: the patches grid_thw names (its frames x rows x columns, summed) against the
    # rows given, once per forward, before any block runs; the tower's own forward reads grid_thw on the host too.
    "vispos/hf/inputs.py:check_rows",
    # The Qwen-VL towers' attention splits the sequence into its frames or windows at cu_seqlens in every layer,
    # as the towers' own sdpa and eager attention do (their lengths read on the host per layer).
    "vispos/hf/tower_modules.py:segment_lengths",
}


class HostReads(TorchDispatchMode):
    """Records ``(op, vispos file:function)`` of every data-dependent op (``DATA_DEPENDENT``, and indexing or
    assigning through a boolean mask) a forward on real tensors runs: those that synchronise on a GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: set[tuple[str, str]] = set()
        self._tolist = torch.Tensor.tolist

    def __enter__(self) -> HostReads:  # Tensor.tolist reads the data without dispatching an op: watched here
        tolist, reads = self._tolist, self.reads

        def watched(tensor: torch.Tensor) -> list:
            frame = caller()
            if in_vispos(frame):
                reads.add(("Tensor.tolist", where(frame, frame.name)))
            return tolist(tensor)

        torch.Tensor.tolist = watched
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        torch.Tensor.tolist = self._tolist
        super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 (torch's signature)
        kwargs = kwargs or {}
        masked = func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default) and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]
        )
        frame = caller() if func in DATA_DEPENDENT or masked else None
        if in_vispos(frame):  # the host's own code (transformers reading image sizes) is not vispos's
            self.reads.add((str(func), where(frame, frame.name)))
        return func(*args, **kwargs)

    def unexplained(self) -> set[tuple[str, str]]:
        return {(op, at) for op, at in self.reads if at not in ISOLATED}


def host_reads(model: nn.Module, inputs: list) -> HostReads:
    """``model`` run on the CPU in training and eval mode on each of ``inputs`` (callables taking a dtype and a
    device), under ``HostReads``."""
    with HostReads() as reads:
        for training in (True, False):
            model.train(training)
            for make in inputs:
                model(**make(torch.float32, "cpu"))
    return reads
