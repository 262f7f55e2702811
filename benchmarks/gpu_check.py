"""A ready GPU check: every scheme's throughput and peak memory at several resolutions, and what token
subsets and ragged batches save, in one script.

    python -m benchmarks.gpu_check [--sizes 224 448 896] [--batch 32] [--token-batch 32] [--reps 10]
                                   [--no-compile] [--skip-throughput] [--skip-token-subsets] [--skip-real]
                                   [--out DIR]
    python -m benchmarks.gpu_check --dry-run          # tiny, on CPU: proves the script runs

Throughput: for ``vit_small_patch16_224`` under bf16 autocast and ``torch.inference_mode()``: images per
second and peak memory (``torch.cuda.max_memory_allocated``) of the unpatched timm model, timm's own Eva
RoPE model, and the model patched with every 2D scheme; the relative biases twice, through SDPA and
through FlexAttention (``vispos.configure(model, attention="flex")``), and the SDPA kernel each reaches
(an eager forward, read from the profiler's op names). ``torch.compile`` is on unless ``--no-compile``.
Sizes the model cannot fit in memory are reported as such, not fatal.

Token subsets, through ``benchmarks.token_subsets``'s functions, for every 2D scheme, training steps
(forward + backward) of ``--token-batch`` images, eager (a ragged context reads its grid sizes as Python
numbers, so it does not compile), the forward and its loss under bf16 autocast (fp32 weights and
gradients; fp32 in the dry run), ``--reps`` interleaved rounds, ratios as medians of per-round ratios:
(a) patch dropout 50 % vs none at 224 px: the speed-up of the step, timm's own model for comparison;
(b) a ragged batch (112-224 px per side, mixed aspect ratios) as ragged rows and as packed rows against
every image zero-padded to the largest: step time and peak memory (``max_memory_allocated`` after
``reset_peak_memory_stats``, extra over the resting model; not measured in the dry run) as ratios to the
padded batch. The relative biases run (b) twice, the second time configured for FlexAttention
(``<scheme> (flex)``); the ``attention`` column names what each step reaches, read from the profiler:
an SDPA kernel, or "none (FlexAttention)" (a score_mod on the tokens' cells and a block mask). Where
FlexAttention does not run (any training step on CPU, as in the dry run), a flex row names the SDPA
kernel it falls back to.

The real-device counterparts of the fake-CUDA tests (``benchmarks.gpu_real``): a bf16 training step per 2D
scheme and host (timm, transformers) with the SDPA kernel it reaches, and a device-map load per host
(``--skip-real`` leaves them out).

Writes ``gpu_check.json`` and ``gpu_check.md`` (one section per measurement) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import timm
import torch
from torch import nn

import vispos
from benchmarks import gpu_real
from benchmarks import token_subsets as subsets
from vispos.diagnostics.kernels import sdpa_kernels

MODEL = "vit_small_patch16_224"


def configurations(model: str, dry_run: bool) -> dict[str, Callable[[int], nn.Module]]:
    """label -> builder(image size)."""
    kwargs = {"depth": 2} if dry_run else {}

    def timm_model(name: str) -> Callable[[int], nn.Module]:
        return lambda size: timm.create_model(name, img_size=size, dynamic_img_size=True, **kwargs)

    def patched(scheme: str, attention: str = "sdpa") -> Callable[[int], nn.Module]:
        def build(size: int) -> nn.Module:
            m = vispos.patch(timm.create_model(model, **kwargs), scheme)  # trained at 224 px, run at `size`
            return vispos.configure(m, attention=attention) if attention != "sdpa" else m

        return build

    configs = {f"timm {name}": timm_model(name) for name in (model, "vit_small_patch16_rope_224")}
    for scheme in vispos.list_encodings(ndim=2):
        configs[f"vispos {scheme}"] = patched(scheme)
    for scheme in vispos.list_encodings(ndim=2, kind="bias"):
        configs[f"vispos {scheme} (flex)"] = patched(scheme, "flex")
    return configs


def measure(model: nn.Module, x: torch.Tensor, reps: int, device: torch.device) -> dict[str, float]:
    """Images per second and peak memory (MiB, CUDA only) of inference-mode forwards."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.inference_mode(), torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
        model(x)  # warm-up (and compilation)
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        for _ in range(reps):
            model(x)
        if device.type == "cuda":
            torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else float("nan")
    return {"img_per_s": reps * x.shape[0] / seconds, "peak_mib": peak}


def kernel(model: nn.Module, x: torch.Tensor, device: torch.device) -> str:
    """The SDPA kernel(s) an eager forward reaches (from the profiler's op names), e.g. flash for RoPE and
    memory-efficient for a bias mask on CUDA; FlexAttention reaches none of them."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.inference_mode(), torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
        return ", ".join(sorted(sdpa_kernels(lambda: model(x)))) or "none (FlexAttention)"


def run(sizes: list[int], batch: int, reps: int, compile_model: bool, device: torch.device, dry_run: bool):
    """-> (label -> size -> measurements or "out of memory", label -> SDPA kernel at the first size)."""
    results: dict[str, dict[str, dict[str, float] | str]] = {}
    kernels: dict[str, str] = {}
    for label, build in configurations(MODEL, dry_run).items():
        results[label] = {}
        torch.manual_seed(0)
        kernels[label] = kernel(build(sizes[0]).to(device).eval(), torch.randn(1, 3, sizes[0], sizes[0], device=device),
                                device)  # fmt: skip
        for size in sizes:
            torch.manual_seed(0)
            try:
                model = build(size).to(device).eval()
                if compile_model:
                    model = torch.compile(model)
                x = torch.randn(batch, 3, size, size, device=device)
                results[label][str(size)] = measure(model, x, reps, device)
            except torch.OutOfMemoryError:
                results[label][str(size)] = "out of memory"
            finally:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        print(f"{label} ({kernels[label]}): {results[label]}", flush=True)
    return results, kernels


def markdown(results: dict, kernels: dict[str, str], sizes: list[int]) -> str:
    head = " | ".join(f"{s} px img/s | {s} px peak MiB" for s in sizes)
    lines = [f"| configuration | SDPA kernel | {head} |", "| --- | --- |" + " ---: | ---: |" * len(sizes)]
    for label, row in results.items():
        cells = []
        for s in sizes:
            r = row[str(s)]
            cells += [r, ""] if isinstance(r, str) else [f"{r['img_per_s']:.1f}", f"{r['peak_mib']:.0f}"]
        lines.append(f"| {label} | {kernels[label]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def token_subset_parts(batch: int, reps: int, device: torch.device, dry_run: bool) -> dict[str, dict]:
    """(a) and (b) of ``benchmarks.token_subsets`` on ``device`` -> {"dropout": scheme -> configuration ->
    {ms, ratio}, "ragged": scheme -> configuration -> {ms, ratio, attention, and on CUDA peak_mib,
    memory_ratio}}; (b) holds each relative bias once more as "<scheme> (flex)", and every scheme but the
    query-dependent biases, which take one grid per batch."""
    autocast = torch.bfloat16 if device.type == "cuda" else None
    memory = device.type == "cuda"  # on CPU a fresh process per step: token_subsets's own command line
    schemes = vispos.list_encodings(ndim=2)
    dropout = subsets.run_part("dropout", [*schemes, "timm"], batch, reps, device, False, dry_run, autocast=autocast)
    print(subsets.table("dropout", dropout), flush=True)
    # a query-dependent bias (decomposed2d) is built for one grid: vispos refuses ragged and packed batches for it
    one_grid = [s for s in schemes if vispos.get_info(s, ndim=2).kind != "query_bias"]
    ragged = subsets.run_part("ragged", one_grid, batch, reps, device, memory, dry_run, autocast=autocast, kernels=True)
    bias = vispos.list_encodings(ndim=2, kind="bias")
    flex = subsets.run_part(
        "ragged", bias, batch, reps, device, memory, dry_run, attention="flex", autocast=autocast, kernels=True
    )
    ragged |= {f"{scheme} (flex)": row for scheme, row in flex.items()}
    print(subsets.table("ragged", ragged), flush=True)
    return {"dropout": dropout, "ragged": ragged}


def sections(report: dict) -> str:
    """gpu_check.md's body: one section per measurement in ``report`` (gpu_check.json's content)."""
    out = []
    if "results" in report:
        throughput = markdown(report["results"], report["kernels"], report["sizes"])
        out += ["## Inference throughput and peak memory", throughput]
    if "patch_dropout" in report:
        a, b = report["patch_dropout"], report["ragged"]
        sizes = ", ".join(f"{h}x{w}" for h, w in b["image_sizes"])
        out += [
            "## (a) Patch dropout 50 % vs none",
            f"{MODEL} at 224 px, batch {a['batch']}, training step, {a['dtype']}; speed-up = step time without "
            "dropout / with (timm: its own learned pos_embed).",
            subsets.table("dropout", a["results"]),
            "## (b) Ragged batch vs padding every image to the largest",
            f"{MODEL} (no class token, average pool), training step, {b['dtype']}, {b['batch']} images of {sizes} "
            "px; ratios to the padded batch (below 1: cheaper); attention: the SDPA kernel each step reaches, or "
            "none (FlexAttention).",
            subsets.table("ragged", b["results"]),
        ]
    if "training_steps" in report:
        out += [gpu_real.markdown(report["training_steps"], report["device_map_loads"])]
    return "\n\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[224, 448, 896])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--token-batch", type=int, default=32, help="images per training step in (a) and (b)")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--skip-throughput", action="store_true", help="only (a) and (b)")
    p.add_argument("--skip-token-subsets", action="store_true", help="no (a) and (b)")
    p.add_argument("--skip-real", action="store_true", help="no training steps and device-map loads")
    p.add_argument("--dry-run", action="store_true", help="tiny sizes on CPU, two blocks (one in (a) and (b)), "
                   "batch 2 in (a) and (b), no compile, one round")  # fmt: skip
    p.add_argument("--out", default="gpu_check")
    args = p.parse_args(argv)
    if args.skip_throughput and args.skip_token_subsets and args.skip_real:
        p.error("--skip-throughput, --skip-token-subsets and --skip-real leave nothing to measure")
    if args.dry_run:
        device, sizes, batch, token_batch, reps, compile_model = torch.device("cpu"), [32, 64], 1, 2, 1, False
    else:
        if not torch.cuda.is_available():
            p.error("no CUDA device; use --dry-run to check the script on CPU")
        device, sizes, batch, reps = torch.device("cuda"), args.sizes, args.batch, args.reps
        token_batch, compile_model = args.token_batch, not args.no_compile
    dtype = "bf16 autocast" if device.type == "cuda" else "fp32"
    meta: dict[str, object] = {"model": MODEL, "device": str(device), "reps": reps, "dtype": dtype}
    if not args.skip_throughput:
        meta |= {"batch": batch, "compile": compile_model, "sizes": sizes}
    report: dict[str, object] = dict(meta)
    if not args.skip_throughput:
        results, kernels = run(sizes, batch, reps, compile_model, device, args.dry_run)
        report |= {"results": results, "kernels": kernels}
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if not args.skip_token_subsets:
        parts = token_subset_parts(token_batch, reps, device, args.dry_run)
        common = {"batch": token_batch, "reps": reps, "dtype": dtype, "compile": False}
        report["patch_dropout"] = {**common, "results": parts["dropout"]}
        sizes_b = subsets.draw_sizes(token_batch, seed=2)
        report["ragged"] = {**common, "image_sizes": [list(hw) for hw in sizes_b], "results": parts["ragged"]}
    if not args.skip_real:
        report["training_steps"] = gpu_real.train_steps(device, token_batch, args.dry_run)
        report["device_map_loads"] = gpu_real.device_map_loads(device, args.dry_run)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2))
    (out / "gpu_check.md").write_text(f"{json.dumps(meta)}\n\n{sections(report)}\n")
    print(sections(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
