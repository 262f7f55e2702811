"""The compiled path: what each positional scheme adds to a ViT under ``torch.compile(model, fullgraph=True)``, read
from inductor's generated code (inductor on the CPU here; on CUDA the same graph lowers to Triton kernels).

    python -m benchmarks.compiled_work [--schemes rope2d relbias2d ...] [--depth 2] [--size 224] [--batch 8]
                                       [--modes inference training] [--json out.json] [--check]

For every 2D scheme on ``vit_small_patch16_224`` (``--depth`` blocks, random init) compiled with ``dynamic=True``,
an inference forward (``torch.no_grad``, eval) and a training step (forward and backward of the outputs' sum),
patched minus the unpatched model:

- kernels: the generated kernels the compiled code runs (the calls of its ``async_compile`` definitions: C++ on
  the CPU, Triton on CUDA; a kernel run in every layer counts in every layer, though inductor defines identical
  code once);
- library calls: the calls the generated code makes to library kernels and fallbacks (``extern_kernels.*``: the
  matrix products and SDPA; ``torch.ops.*``: ops inductor does not generate, such as ``linalg_matrix_exp``);
- MB: inductor's own estimate of the bytes its scheduled nodes read and write (``GraphLowering.count_bytes``,
  the figure ``torch._inductor.metrics.num_bytes_accessed`` collects);
- one graph (``fullgraph=True`` raises on a graph break) and, at inference, no recompile at a third size
  (``dynamic=True``, the model run again at ``size + 32``, then at ``size + 64`` under ``error_on_recompile``: a
  scheme whose table is resampled away from its own grid compiles two graphs, one for its grid and one for every
  other). A training step runs at one size (``measure``).

The budget (``kernel_budget``): one kernel per layer for the rotation or the mask, plus one per layer where a
per-layer table is computed from parameters (a trainable per-layer scheme), else one per model for a shared table;
a training step twice that, plus what ``TRAINING_EXTRA`` names with the op that needs it. Library calls are apart
(``linalg_matrix_exp`` and ``linalg_solve`` have no generated form: the learned rotations add one such call a layer
for their table). ``tests/test_compiled_schemes.py`` (``make compiled-kernels``) holds every scheme to it.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from unittest import mock

import timm
import torch
import torch._dynamo
import torch._functorch.config
import torch._inductor.compile_fx as compile_fx
import torch._inductor.config
from torch import nn
from torch._inductor import metrics
from torch._inductor.graph import GraphLowering

import vispos

MODEL = "vit_small_patch16_224"
FIXED = {"none": 0, "additive": 1}  # the kinds whose budget does not grow with the layers (``kernel_budget``)
# What a scheme's training step runs beyond twice its budget, and the op that needs it: (kernels per layer, per
# model, why), read from the generated backward of a 2-block model (``tests/test_compiled_schemes.py``)
TRAINING_EXTRA: dict[str, tuple[int, int, str]] = {
    "liere2d": (0, 1, "linalg_matrix_exp's backward is the exponential of the block matrix [[A^T, G], [0, A^T]] "
                "(a library call): one kernel assembles it and another reads the generators' gradient out of it, "
                "two kernels for the shared table's backward"),
    "string2d": (1, 2, "two tables per layer are learned (the Cayley basis and RoPE-Mixed's frequencies) where the "
                 "budget counts one: the frequencies' gradient is a reduction per layer (of the rotation's "
                 "gradient times the coordinates, over the batch, heads and tokens), for which the forward keeps "
                 "-sin of the angles (one kernel); the basis's gradient through linalg_solve (a second solve, a "
                 "library call) ends in one kernel taking the skew part of every layer's"),
}  # fmt: skip
KERNEL = re.compile(r"^(\w+) = async_compile\.(?:cpp_pybinding|cpp|triton)\(", re.M)  # a kernel's definition
LIBRARY = re.compile(  # a call of a library kernel or fallback in the generated ``call``: assigned or with out=
    r"^\s+\w+ = (?:extern_kernels\.\w+|torch\.ops\.\w+\.\w+(?:\.\w+)?)\(|^\s+extern_kernels\.\w+\(", re.M
)


@dataclass(frozen=True)
class Compiled:
    """What one compiled run generated: kernels, library calls, inductor's estimate of bytes, recompiles."""

    kernels: int
    library: int
    bytes: int
    recompiled: bool = False
    error: float = 0.0  # the largest difference of the compiled outputs from the eager model's (``compare``)

    def minus(self, other: Compiled) -> Compiled:
        return Compiled(self.kernels - other.kernels, self.library - other.library, self.bytes - other.bytes,
                        self.recompiled or other.recompiled, self.error)  # fmt: skip


@contextmanager
def generated_code() -> Iterator[list[str]]:
    """Collect the generated code of every graph compiled inside (caches off: each graph is compiled, not loaded),
    with inductor's byte estimate accumulating in ``metrics.num_bytes_accessed`` (reset on entry)."""
    codes: list[str] = []
    metrics.reset()
    log = compile_fx.inductor_metrics_log
    with ExitStack() as stack:
        stack.enter_context(mock.patch.object(GraphLowering, "save_output_code", codes.append, create=True))
        stack.enter_context(mock.patch.object(log, "isEnabledFor", lambda level: True))  # count_bytes runs
        stack.enter_context(mock.patch.object(log, "info", lambda *args, **kwargs: None))  # and prints nothing
        stack.enter_context(torch._inductor.config.patch(fx_graph_cache=False))
        stack.enter_context(torch._functorch.config.patch(enable_autograd_cache=False))
        yield codes


def kernel_calls(code: str) -> int:
    """The calls a generated module makes to the kernels it defines (``name(...)`` on the CPU, ``name.run(...)``
    for Triton): a kernel run in every layer counts in every layer, though inductor defines identical code once."""
    names = "|".join(re.escape(name) for name in KERNEL.findall(code))
    return len(re.findall(rf"^\s+(?:{names})(?:\.run)?\(", code, re.M)) if names else 0


def count_code(codes: list[str]) -> tuple[int, int]:
    """(generated kernels run, library calls made) in generated modules."""
    return sum(kernel_calls(c) for c in codes), sum(len(LIBRARY.findall(c)) for c in codes)


def compiled_work(
    model: nn.Module, size: int, batch: int, *, train: bool, resize: bool = True, compare: bool = False
) -> Compiled:
    """Compile ``model`` (``fullgraph=True``, ``dynamic=True``, inductor) and run one inference forward or training
    step on [batch, 3, size, size]; with ``resize``, run it again at ``size + 32`` and ``size + 64`` and record
    whether the third size recompiled (the second may: a table built for the first grid is used as it is there
    and resampled at any other, two graphs); with ``compare``, record how far the first compiled outputs are from
    the eager model's on the same input."""
    torch.compiler.reset()
    model.train(train)
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    error = 0.0

    def step(side: int, check: bool = False) -> None:
        nonlocal error
        x = torch.randn(batch, 3, side, side)
        with torch.set_grad_enabled(train):
            out = compiled(x)
            if check:
                with torch.no_grad():
                    error = (out.detach() - model(x)).abs().max().item()
            if train:
                out.sum().backward()
        model.zero_grad(set_to_none=True)

    with generated_code() as codes:
        step(size, check=compare)
    kernels, library = count_code(codes)
    work = Compiled(kernels, library, int(metrics.num_bytes_accessed), error=error)
    if not resize:
        return work
    try:
        step(size + 32)  # may compile once more: a table of the first grid's size is resampled at another one
        with torch._dynamo.config.patch(error_on_recompile=True):
            step(size + 64)
    except torch._dynamo.exc.RecompileError:
        return Compiled(work.kernels, work.library, work.bytes, recompiled=True, error=error)
    finally:
        torch.compiler.reset()
    return work


def kernel_budget(scheme: str, layers: int, *, training: bool = False) -> int:
    """Generated kernels a scheme may add to ``layers`` blocks: one per layer for what it does in attention (the
    rotation of q and k, the mask, the query-dependent bias, the added channels; PEG's convolution: one per layer
    bounds its one or few places) plus its table's: one per layer for a table computed per layer from parameters
    (an MLP, a matrix exponential's exponent, a Cayley basis), one per model otherwise. A table added to the
    tokens (``additive``): one for the model. ``none``: nothing. Library calls (matrix products, SDPA,
    ``linalg_matrix_exp``, ``linalg_solve``) are counted apart, not against the budget. A training step: twice
    that (each kernel of the forward may have one in the backward), plus ``TRAINING_EXTRA``'s named kernels."""
    info = vispos.get_info(scheme, ndim=2)
    if info.kind in FIXED:
        budget = FIXED[info.kind]
    else:
        budget = layers + (layers if info.per_layer and info.trainable else 1)
    if not training:
        return budget
    per_layer, per_model, _ = TRAINING_EXTRA.get(scheme, (0, 0, ""))
    return 2 * budget + per_layer * layers + per_model


# timm's patch embedding formats the input size into its assertion messages unless it pads (a formatted size is
# specialised: a recompile at each new size), so the models pad (by zero at sizes divisible by the patch)
DYNAMIC = {"dynamic_img_size": True, "dynamic_img_pad": True}


def build(scheme: str | None, size: int, **kwargs: object) -> nn.Module:
    """ViT-S/16 (``kwargs``: e.g. depth) patched with ``scheme``, or unpatched for None, taking any image size."""
    if scheme is None:
        return timm.create_model(MODEL, img_size=size, **DYNAMIC, **kwargs)
    return vispos.create_model(MODEL, pos=scheme, img_size=size, **DYNAMIC, **kwargs)


def measure(
    schemes: list[str], size: int, batch: int, modes: list[str], **kwargs: object
) -> list[dict[str, object]]:
    """One record per scheme and mode: the added kernels, library calls and bytes, recompiles, the budget."""
    records = []
    layers = int(kwargs.get("depth", 12))
    for mode in modes:
        torch.manual_seed(0)
        base = compiled_work(build(None, size, **kwargs), size, batch, train=mode == "training", resize=False)
        # a training step runs at one size: the unpatched ViT's fails at a second size (inductor, torch 2.14.1, on the
        # backward of timm's table resampling: "isIntList() INTERNAL ASSERT FAILED"), and at a third every model's
        # (an input-stride assertion, nope's included)
        resized = mode == "inference"
        for scheme in schemes:
            torch.manual_seed(0)
            work = compiled_work(build(scheme, size, **kwargs), size, batch, train=mode == "training", resize=resized)
            added = work.minus(base)
            budget = kernel_budget(scheme, layers, training=mode == "training")
            records.append({"scheme": scheme, "mode": mode, "layers": layers, "size": size, "batch": batch,
                            "added": asdict(added), "total": asdict(work), "budget": budget,
                            "holds": added.kernels <= budget, "resized": resized})  # fmt: skip
    return records


def table(records: list[dict[str, object]]) -> str:
    """Markdown: per scheme and mode, added kernels (per layer), library calls, inductor's MB, budget, recompiles
    (–: not checked, a training step runs at one size)."""
    lines = ["| scheme | mode | +kernels | +kernels / layer | budget | +library calls | +MB (inductor) | recompiles |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]  # fmt: skip
    for r in records:
        a, layers = r["added"], r["layers"]
        budget = f"{r['budget']}{'' if r['holds'] else ' (over)'}"
        cells = [r["scheme"], r["mode"], f"{a['kernels']:+d}", f"{a['kernels'] / layers:+.1f}", budget,
                 f"{a['library']:+d}", f"{a['bytes'] / 1e6:+.2f}",
                 "yes" if a["recompiled"] else "no" if r.get("resized", True) else "–"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schemes", nargs="+", help="only these schemes (default: every 2D scheme)")
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--modes", nargs="+", default=["inference", "training"], choices=["inference", "training"])
    parser.add_argument("--json", help="write the records here")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when a scheme adds more kernels than its budget or recompiles at a third size")
    args = parser.parse_args(argv)
    schemes = args.schemes or vispos.list_encodings(ndim=2)
    records = measure(schemes, args.size, args.batch, args.modes, depth=args.depth)
    print(f"Compiled (inductor, fullgraph, dynamic) {MODEL} with {args.depth} blocks at {args.size} px, batch "
          f"{args.batch}: added to the unpatched model\n\n{table(records)}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            f.write("[\n" + ",\n".join(f"  {json.dumps(r)}" for r in records) + "\n]\n")
    failing = [f"{r['scheme']} ({r['mode']})" for r in records if not r["holds"] or r["added"]["recompiled"]]
    if args.check and failing:
        raise SystemExit(f"over the kernel budget or recompiling: {', '.join(failing)}")


if __name__ == "__main__":
    main()
