"""Peak memory of a patched ViT, per scheme and image size: its positional part, and a whole forward.

    python -m benchmarks.position_memory [--sizes 224 448 896 1344] [--device cpu|cuda] [--json out.json]

For ``vit_small_patch16_224`` (6 heads, one class token), batch 1, fp32, inference, two measurements:

- the positional part: the extra memory held at its peak while the model's ``PositionContext`` is built and
  every layer's rotation or bias mask is taken in turn, as the attention layers do during a forward;
- the whole forward, as a user sees it: the peak of ``model(image)`` minus the same peak of the unpatched timm
  model (``dynamic_img_size=True``, its learned table resampled to the grid), each in a fresh process.

The yardstick is one layer's bias mask,
[heads, N, N] in fp32 for N tokens: a bias scheme that builds its masks one layer at a time, without
transient copies, stays near 1x. timm's own RoPE (Eva) and relative-position model are measured the
same way (their sin/cos table; every block's bias in turn).

CPU: each measurement runs in a fresh process, which resets the kernel's resident-set high-water mark
(``/proc/self/clear_refs``) and reads ``VmHWM`` against ``VmRSS`` before. glibc's allocator is told to
map every block of 64 KiB or more on its own (``MALLOC_MMAP_THRESHOLD_``), so a freed tensor leaves
the resident set at once and the high-water mark counts live tensors, not heap left behind by freed
ones (without it, cpb2d's MLP activations read as 0.1 of a mask more). GPU: ``max_memory_allocated``
against ``memory_allocated`` before.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import timm
import torch

import vispos

MODEL = "vit_small_patch16_224"


def _kib(key: str) -> int:
    return int(re.search(rf"{key}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1))


def positional_part(scheme: str, px: int, device: torch.device) -> tuple[int, int]:
    """(peak extra bytes of the positional part, bytes of one layer's fp32 mask), measured in this process."""
    torch.manual_seed(0)
    model = vispos.create_model(MODEL, pos=scheme, img_size=224).eval().to(device)
    image = torch.randn(1, 3, px, px, device=device)
    heads, tokens = model.blocks[0].attn.num_heads, model.num_prefix_tokens + (px // 16) ** 2
    one_mask = heads * tokens * tokens * 4

    def run() -> None:
        with torch.inference_mode():
            ctx = model.vispos_context(image)
            for i in range(len(model.blocks)):
                out = ctx.layer(i)  # what layer i's attention holds while it runs
                del out
            del ctx

    return _peak(run, device), one_mask


TIMM_OWN = ("timm vit_small_patch16_rope_224", "timm vit_relpos_small_patch16_224")


def whole_forward(scheme: str, px: int, device: torch.device) -> tuple[int, int]:
    """(peak extra bytes of one inference forward of the model patched with ``scheme``, or of the unpatched
    model for ``scheme="unpatched"``, bytes of one layer's fp32 mask), measured in this process."""
    torch.manual_seed(0)
    if scheme == "unpatched":
        model = timm.create_model(MODEL, img_size=224, dynamic_img_size=True)
    else:
        model = vispos.create_model(MODEL, pos=scheme, img_size=224)
    model = model.eval().to(device)
    image = torch.randn(1, 3, px, px, device=device)
    heads, tokens = model.blocks[0].attn.num_heads, model.num_prefix_tokens + (px // 16) ** 2

    def run() -> None:
        with torch.inference_mode():
            out = model(image)
            del out

    return _peak(run, device), heads * tokens * tokens * 4


def timm_positional_part(label: str, px: int, device: torch.device) -> tuple[int, int]:
    """The same measurement for timm's own positional modules: the Eva RoPE's sin/cos (built per call
    with ``dynamic_img_size``), or every block's relative-position MLP bias taken in turn (``get_bias``;
    the model built at ``px``, since its index buffers are fixed at construction)."""
    torch.manual_seed(0)
    name = label.removeprefix("timm ")
    rope = "rope" in name
    model = timm.create_model(name, **({"dynamic_img_size": True} if rope else {"img_size": px})).eval().to(device)
    grid = (px // 16, px // 16)
    heads, tokens = model.blocks[0].attn.num_heads, model.num_prefix_tokens + grid[0] * grid[1]

    def run() -> None:
        with torch.inference_mode():
            if rope:
                out = model.rope.get_embed(shape=list(grid))
                del out
                return
            for blk in model.blocks:
                out = blk.attn.rel_pos.get_bias()
                del out

    return _peak(run, device), heads * tokens * tokens * 4


def _peak(run: Callable[[], None], device: torch.device) -> int:
    """Extra bytes at the peak of ``run()``, over what was allocated before it."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    before = _kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    run()
    return (_kib("VmHWM") - before) * 1024


def measure(scheme: str, px: int, device: torch.device, probe: str | None = None) -> tuple[int, int]:
    """On CPU in a fresh process (the high-water mark must not see other measurements); on GPU here.
    ``probe``: the function to run (default: the positional part, timm's own for ``TIMM_OWN``)."""
    probe = probe or ("timm_positional_part" if scheme in TIMM_OWN else "positional_part")
    if device.type == "cuda":
        return globals()[probe](scheme, px, device)
    code = (
        f"import json, torch; from benchmarks.position_memory import {probe}; "
        f"print(json.dumps({probe}({scheme!r}, {px}, torch.device('cpu'))))"
    )
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(64 * 1024)}
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, env=env)
    peak, one_mask = json.loads(out.stdout.strip().splitlines()[-1])
    return peak, one_mask


def table(results: dict[str, dict[int, dict[str, float]]], sizes: list[int]) -> str:
    """Per size: the positional part and the whole forward minus the unpatched model's, MiB (x one mask)."""
    head = " | ".join(f"{px} px: positional part | {px} px: forward" for px in sizes)
    lines = [f"| scheme | {head} |", "| --- |" + " ---: |" * (2 * len(sizes))]

    def cell(entry: dict[str, float], key: str) -> str:
        return "–" if key not in entry else f"{entry[key] / 2**20:.1f} ({entry[key] / entry['one_mask']:.2f})"

    for scheme, row in results.items():
        cells = [f"{cell(row[str(px)], 'positional')} | {cell(row[str(px)], 'forward')}" for px in sizes]
        lines.append(f"| {scheme} | " + " | ".join(cells) + " |")
    first = next(iter(results.values()))
    masks = ", ".join(f"{px} px: {first[str(px)]['one_mask'] / 2**20:.1f} MiB" for px in sizes)
    return "\n".join(lines) + f"\n\nMiB (x one layer's fp32 mask [heads, N, N]: {masks})."


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[224, 448, 896, 1344])
    parser.add_argument("--schemes", nargs="+", default=[*vispos.list_encodings(ndim=2), *TIMM_OWN])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", default=None, help="also write the results here (after every scheme: a rerun "
                        "with the same file skips the schemes it holds)")  # fmt: skip
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    path = Path(args.json) if args.json else None
    saved = json.loads(path.read_text()) if path is not None and path.exists() else {}
    fresh = saved.get("sizes") != args.sizes or saved.get("device") != device.type
    results: dict[str, dict[str, dict[str, float]]] = {} if fresh else saved["results"]
    baseline = {px: measure("unpatched", px, device, "whole_forward")[0] for px in args.sizes}
    for scheme in args.schemes:
        if scheme in results:
            continue
        results[scheme] = {}
        for px in args.sizes:
            peak, one_mask = measure(scheme, px, device)
            entry = {"positional": peak, "one_mask": one_mask}
            line = f"{scheme:14s} {px:4d} px: positional part {peak / 2**20:8.1f} MiB = {peak / one_mask:5.2f} masks"
            if scheme not in TIMM_OWN:
                entry["forward"] = measure(scheme, px, device, "whole_forward")[0] - baseline[px]
                line += f", forward {entry['forward'] / 2**20:8.1f} MiB = {entry['forward'] / one_mask:5.2f} masks"
            results[scheme][str(px)] = entry
            print(line, flush=True)
        if path is not None:
            record = {"device": device.type, "model": MODEL, "sizes": args.sizes, "results": results}
            path.write_text(json.dumps(record, indent=2))
    print(f"\n{MODEL}, batch 1, fp32, inference, {device.type}: peak extra memory of the positional part, and of a "
          "whole forward over the unpatched model's")
    print(table(results, args.sizes))


if __name__ == "__main__":
    main()
