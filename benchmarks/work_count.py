"""Counted work of one forward or training step: aten calls, kernels, FLOPs and bytes, under dispatch modes.

Counting rules (``benchmarks/patch_work.py`` and docs/performance.md quote them):

- calls: every aten call a ``TorchDispatchMode`` sees, after composite ops are decomposed (``aten.linear`` is
  counted as the ``t`` and ``addmm`` it runs, never twice); ``prim`` metadata queries are left out.
- kernels: the calls that would launch a kernel: not a view (the schema aliases its input: ``view``,
  ``transpose``, ``expand``...), not an allocation without data (``empty``), not a metadata query
  (``_fused_sdp_choice``, ``detach_``...).
- bytes: per kernel, the elements each tensor argument and result addresses (``addressed``: a dimension of
  stride 0, an ``expand``'s, counts once, so an explicitly expanded argument counts as an implicitly broadcast
  one), x element size, added up; tensors a kernel reads from one storage count their union at most (``a + a``
  reads a once; q and k, two views of one qkv buffer, both). A kernel that overwrites an argument without reading
  it (``copy_``, ``zero_``, ``fill_``, the random fills) or writes an ``out=`` argument counts that write only;
  the ``_like`` / ``new_*`` factories read nothing.
- FLOPs: ``torch.utils.flop_counter.FlopCounterMode`` (matrix products, convolutions, attention; elementwise
  ops count zero), with PyTorch's CPU flash-attention kernels given the formula of its other SDPA kernels.

A ``fake_model`` runs on fake tensors (``FakeTensorMode``): shapes, dtypes and the ops dispatched are those of
real CPU tensors (``tests/test_patch_work.py`` checks the counts agree), without the arithmetic, so counting a
ViT-S at 448 px takes about a second and two runs give identical numbers.
"""

from __future__ import annotations

import copy
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeCopyMode, FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

aten = torch.ops.aten
NO_KERNEL = {  # calls that move no data: allocations, metadata
    aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default, aten.new_empty.default,
    aten.new_empty_strided.default, aten.detach_.default, aten._fused_sdp_choice.default,
    aten.sym_size.int, aten.sym_stride.int, aten.sym_numel.default, aten.is_same_size.default,
    aten._unsafe_view.default,  # a view whose schema does not say so
}  # fmt: skip
WRITE_ONLY = {  # kernels that read none of their tensor arguments' data (only their dtype and device) ...
    aten.new_full.default, aten.new_zeros.default, aten.new_ones.default, aten.zeros_like.default,
    aten.ones_like.default, aten.full_like.default,
}  # fmt: skip
OVERWRITES = {  # ... or not their first argument's, which they overwrite
    aten.copy_.default, aten.zero_.default, aten.fill_.Scalar, aten.fill_.Tensor, aten.uniform_.default,
    aten.normal_.default, aten.bernoulli_.float,
}  # fmt: skip


@dataclass
class Work:
    """What one forward (or training step) dispatched: totals, and kernel calls by op name."""

    calls: int = 0
    kernels: int = 0
    bytes: int = 0
    flops: int = 0
    ops: Counter[str] = field(default_factory=Counter)  # kernel calls per op, e.g. {"aten.mul.Tensor": 24}
    op_bytes: Counter[str] = field(default_factory=Counter)  # bytes per op
    written: Counter[int] = field(default_factory=Counter)  # kernel output tensors by number of elements

    def minus(self, other: Work) -> Work:
        """This work less ``other``'s (per op: only the ops whose counts differ)."""
        ops, op_bytes = Counter(self.ops), Counter(self.op_bytes)
        ops.subtract(other.ops)
        op_bytes.subtract(other.op_bytes)
        keep = {k for k in ops if ops[k] or op_bytes[k]}
        return Work(
            self.calls - other.calls, self.kernels - other.kernels, self.bytes - other.bytes,
            self.flops - other.flops, Counter({k: ops[k] for k in keep}), Counter({k: op_bytes[k] for k in keep}),
        )  # fmt: skip


def addressed(t: torch.Tensor) -> int:
    """Elements of memory a tensor addresses: its sizes over the dimensions of non-zero stride multiplied out
    (a broadcast dimension, stride 0, is one element read again), at most its span in storage (a view whose rows
    overlap, ``unfold``'s or an ``as_strided``'s, addresses each element once)."""
    count = 1
    for size, stride in zip(t.shape, t.stride(), strict=True):
        count *= size if stride else min(size, 1)
    return min(count, addressed_span(t))


def storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def tensor_bytes(tree: object) -> int:
    """Bytes the tensors of a (nested) structure of arguments or results address, per storage: tensors of one
    storage count their union at most (the span of their merged intervals), never more than their sum."""
    by_storage: dict[int, list[torch.Tensor]] = {}
    for t in tree_leaves(tree):
        if isinstance(t, torch.Tensor):
            by_storage.setdefault(storage_key(t), []).append(t)
    total = 0
    for tensors in by_storage.values():
        size = tensors[0].element_size()
        summed = sum(addressed(t) for t in tensors)
        if len(tensors) > 1:
            intervals = sorted((t.storage_offset(), t.storage_offset() + addressed_span(t)) for t in tensors)
            union, (start, end) = 0, intervals[0]
            for lo, hi in intervals[1:]:
                if lo > end:
                    union, start = union + end - start, lo
                end = max(end, hi)
            summed = min(summed, union + end - start)
        total += summed * size
    return total


def addressed_span(t: torch.Tensor) -> int:
    """Elements from a tensor's first to its last (non-negative strides, as the kernels here see), 0 if empty."""
    if t.numel() == 0:
        return 0
    return 1 + sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride(), strict=True) if size > 1)


def read_arguments(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> object:
    """The arguments a kernel reads: none for a factory, all but the overwritten first for ``OVERWRITES``, all but
    its ``out=`` arguments for any other."""
    if func in WRITE_ONLY:
        return ()
    if func in OVERWRITES:
        return (args[1:], kwargs)
    outs = {a.name for a in func._schema.arguments if a.is_out}
    return (args, {k: v for k, v in kwargs.items() if k not in outs})


def is_composite(func: torch._ops.OpOverload) -> bool:
    """The op runs as a decomposition into other aten ops on CPU (``aten.linear``, ``aten.matmul``)."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    return has(func.name(), "CompositeImplicitAutograd") and not has(func.name(), "CPU")


class WorkCounter(TorchDispatchMode):
    """Counts calls, kernels and bytes per aten op; composite ops are decomposed so that their parts are seen."""

    def __init__(self) -> None:
        super().__init__()
        self.work = Work()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 (torch's signature)
        kwargs = kwargs or {}
        if func.namespace == "prim":  # FakeTensor's device queries
            return func(*args, **kwargs)
        if is_composite(func):
            with self:  # count the ops it runs
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        work = self.work
        work.calls += 1
        if func.is_view or func in NO_KERNEL or not any(isinstance(t, torch.Tensor) for t in tree_leaves(out)):
            return out
        name = str(func)
        moved = tensor_bytes(read_arguments(func, args, kwargs)) + tensor_bytes(out)
        work.kernels += 1
        work.bytes += moved
        work.ops[name] += 1
        work.op_bytes[name] += moved
        work.written.update(t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


Shape = tuple[int, ...]


def _cpu_flash_flops(q: Shape, k: Shape, v: Shape, *args: object, **kwargs: object) -> int:
    return sdpa_flop_count(q, k, v)


def _cpu_flash_backward_flops(grad_out: Shape, q: Shape, k: Shape, v: Shape, *args: object, **kwargs: object) -> int:
    return sdpa_backward_flop_count(grad_out, q, k, v)


CPU_FLASH_FLOPS = {  # FlopCounterMode knows the CUDA SDPA kernels only
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_flops,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_backward_flops,
}


@contextmanager
def quiet_fake_tensors() -> Iterator[None]:
    """Silence the warning a FakeTensor's data_ptr gives: the inference caches stamp tensors by data_ptr, which
    a FakeTensor still returns (deprecated, not an error), so they work on fake models as on real ones."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        yield


def fake_model(build: Callable[[], nn.Module]) -> nn.Module:
    """``build()`` with fake CPU tensors for parameters and buffers: built on the meta device (no initialisation)
    and materialised in a ``FakeTensorMode``, or, where building on meta fails (a ``.item()`` at build time),
    built for real and copied into fake tensors."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)  # the meta tensors being replaced are its inputs
    try:
        with torch.device("meta"):
            model = build()
    except (RuntimeError, NotImplementedError):
        with FakeCopyMode(mode):
            return copy.deepcopy(build())
    with mode:
        return model.to_empty(device="cpu")


def fake_mode_of(model: nn.Module) -> FakeTensorMode | None:
    """The fake tensor mode a model's parameters belong to; None for a real model."""
    tensors = [*model.parameters(), *model.buffers()]
    return next((t.fake_mode for t in tensors if isinstance(t, FakeTensor)), None)


@contextmanager
def on_model_tensors(model: nn.Module) -> Iterator[None]:
    """Run in the fake tensor mode of a ``fake_model`` (new tensors fake too); nothing for a real model."""
    mode = fake_mode_of(model)
    if mode is None:
        yield
        return
    with quiet_fake_tensors(), mode:
        yield


def count_work(model: nn.Module, batch: int, size: int, *, train: bool, bf16: bool) -> Work:
    """Work of one inference forward (``torch.inference_mode``, eval) or training step (train mode, forward and
    backward of the outputs' sum) of ``model`` on [batch, 3, size, size] images, fp32 or under bf16 autocast;
    on fake tensors for a ``fake_model``. At inference the counted pass is the second: the first fills what a
    model keeps between forwards (the inference caches of ComRoPE, LieRE, STRING)."""
    with ExitStack() as stack:
        stack.enter_context(on_model_tensors(model))
        model.train(train)
        images = torch.zeros(batch, 3, size, size)
        stack.enter_context(torch.enable_grad() if train else torch.inference_mode())
        stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16))
        if not train:
            model(images)
        model.zero_grad(set_to_none=True)
        with FlopCounterMode(display=False, custom_mapping=CPU_FLASH_FLOPS) as flops, WorkCounter() as counter:
            out = model(images)
            if train:
                out.sum().backward()
        model.zero_grad(set_to_none=True)
        counter.work.flops = flops.get_total_flops()
        return counter.work
