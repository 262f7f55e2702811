"""Counted work per forward: what each positional scheme adds to a ViT, in aten calls, kernels, FLOPs and bytes.

    python -m benchmarks.patch_work [--json out.json] [--schemes rope2d relbias2d ...] [--sizes 224 448]
                                    [--batch 8] [--no-timm] [--towers] [--ops 8] [--quick]

For every 2D scheme on ``vit_small_patch16_224`` (random init) at each size, batch 8, fp32 and under bf16 autocast
(``torch.autocast("cpu", torch.bfloat16)``: weights stay fp32, linear layers run in bf16), the work of one
inference forward (``torch.inference_mode``, eval) and of one training step (train mode, forward and backward of
the outputs' sum), patched minus the unpatched timm model (``string2d (folded)``: STRING after ``fold_string``,
its basis moved into the q/k projections). timm's own RoPE ViTs (Eva: ``vit_small_patch16_rope_224``,
``vit_small_patch16_rope_mixed_224``, EVA-02's ``eva02_small_patch14_224``) are counted against their RoPE-free
twins: the same model with ``model.rope = None``, which Eva's forward reads as "no rotary embedding" (every block
then gets ``rope=None``). ``--towers``: the VLM vision towers at ViT-S's size (``work_towers``). Counting rules:
``benchmarks/work_count.py``; floors: ``benchmarks/work_floor.py``.
Deterministic (fake tensors, no timings): two runs print the same numbers.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass

import timm
from torch import nn

import vispos
from vispos.encodings.string import fold_string

from .work_count import Work, count_work, fake_model
from .work_floor import (
    bias_floor,
    bias_fused_floor,
    geometry,
    mask_writes,
    rotary_floor,
    rotary_fused_floor,
    timm_table_bytes,
    vispos_table_bytes,
)
from .work_targets import check_targets
from .work_towers import own_table_bytes, tower_rows

MODEL = "vit_small_patch16_224"
BASELINE = f"timm {MODEL}"
TIMM_ROPE = ("vit_small_patch16_rope_224", "vit_small_patch16_rope_mixed_224", "eva02_small_patch14_224")
SETTINGS = tuple((mode, dtype) for mode in ("inference", "training") for dtype in ("fp32", "bf16"))


@dataclass(frozen=True)
class Config:
    """One row: how to build the model at an image size, its baseline row, and which floor applies."""

    label: str
    build: Callable[[int], nn.Module]
    baseline: str = ""  # "" for a baseline row
    kind: str = ""  # "rotary", "bias" or "" (no floor)
    per_layer: bool = False
    timm_rope: bool = False
    own_table: bool = False  # a VLM tower's row: its floor counts the per-token cos / sin tables it holds


def without_rope(name: str, size: int) -> nn.Module:
    """timm's Eva ``name`` with its rotary embedding removed (``model.rope = None``): every block gets rope=None."""
    model = timm.create_model(name, img_size=size)
    model.rope = None
    return model


def configurations(
    schemes: list[str] | None = None,
    with_timm: bool = True,
    model_kwargs: dict[str, object] | None = None,
    towers: bool = False,
) -> list[Config]:
    """The baseline, every 2D scheme (or ``schemes``) on ViT-S/16, then timm's RoPE models and their twins, then
    (``towers``) the VLM vision towers' rows (``work_towers``); ``model_kwargs`` (e.g. ``depth=2``) go to every
    vispos and baseline model (the tests' tiny ViT)."""
    kw = model_kwargs or {}
    configs = [Config(BASELINE, lambda size: timm.create_model(MODEL, img_size=size, **kw))]
    for scheme in vispos.list_encodings(ndim=2) if schemes is None else schemes:
        info = vispos.get_info(scheme, ndim=2)
        kind = info.kind if info.kind in ("rotary", "bias") else ""
        build = lambda size, s=scheme: vispos.create_model(MODEL, pos=s, img_size=size, **kw)  # noqa: E731
        configs.append(Config(f"vispos {scheme}", build, BASELINE, kind, info.per_layer))
        if scheme == "string2d":  # its basis folded into the q/k projections (``fold_string``): the deployed form
            build = lambda size: fold_string(vispos.create_model(MODEL, pos="string2d", img_size=size, **kw))  # noqa: E731
            configs.append(Config("vispos string2d (folded)", build, BASELINE, kind, info.per_layer))
    for name in TIMM_ROPE if with_timm else ():
        twin = f"{name} without rope"
        configs.append(Config(twin, lambda size, n=name: without_rope(n, size)))
        build = lambda size, n=name: timm.create_model(n, img_size=size)  # noqa: E731
        configs.append(Config(f"timm {name}", build, twin, "rotary", "mixed" in name, timm_rope=True))
    for label, build, baseline, kind in tower_rows() if towers else ():
        configs.append(Config(label, build, baseline, kind, own_table=True))
    return configs


def floor_bytes(
    config: Config, model: nn.Module, batch: int, itemsize: int, train: bool
) -> tuple[int, int] | tuple[None, None]:
    """The config's floors (``work_floor``), one pass and fused, for this model, batch and q dtype size; None where
    none applies."""
    geo = geometry(model)
    if config.kind == "rotary":
        if config.own_table:
            table = own_table_bytes(model, batch)
        else:
            table = timm_table_bytes(model) if config.timm_rope else vispos_table_bytes(model)
        return rotary_floor(geo, batch, itemsize, table, train=train), rotary_fused_floor(table, train=train)
    if config.kind == "bias":
        per_layer = config.per_layer
        return (bias_floor(geo, itemsize, per_layer=per_layer, train=train),
                bias_fused_floor(geo, itemsize, per_layer=per_layer, train=train))  # fmt: skip
    return None, None


CPU_FLASH = "aten._scaled_dot_product_flash_attention_for_cpu.default"


def cpu_kernel_note(added: Work) -> str:
    """Where the row's counts follow the CPU's SDPA choice: fewer fused CPU attention calls than the baseline
    means SDPA took its math path (a mask with a gradient: the CPU's fused kernel does not differentiate its
    mask), which writes the [B, heads, N, N] logits; CUDA's memory-efficient kernel takes such a mask and its
    gradient, so there the row would count about its floor's mask traffic instead."""
    return "CPU math path (CUDA: efficient kernel)" if added.ops.get(CPU_FLASH, 0) < 0 else ""


def measure(configs: list[Config], sizes: list[int], batch: int) -> list[dict[str, object]]:
    """One record per config, size and setting: the counts, what they add to the baseline, and the floor."""
    records: list[dict[str, object]] = []
    for size in sizes:
        base_work: dict[tuple[str, str, str], Work] = {}
        for config in configs:
            # the towers' ragged layouts check their data: real tensors (the same counts, tests/test_patch_work.py)
            model = config.build(size) if config.own_table else fake_model(lambda c=config, s=size: c.build(s))
            for mode, dtype in SETTINGS:
                train, itemsize = mode == "training", 2 if dtype == "bf16" else 4
                work = count_work(model, batch, size, train=train, bf16=dtype == "bf16")
                base_work[(config.label, mode, dtype)] = work
                record: dict[str, object] = {"config": config.label, "baseline": config.baseline, "size": size,
                    "batch": batch, "mode": mode, "dtype": dtype, "kind": config.kind, "per_layer": config.per_layer,
                    "layers": len(model.blocks), **totals(work)}  # fmt: skip
                if config.baseline:
                    added = work.minus(base_work[(config.baseline, mode, dtype)])
                    floor, fused = floor_bytes(config, model, batch, itemsize, train)
                    record["added"] = totals(added)
                    record["added_ops"] = {op: [added.ops[op], added.op_bytes[op]] for op in sorted(added.ops)}
                    record["floor_bytes"], record["fused_bytes"] = floor, fused
                    record["cpu_kernel"] = cpu_kernel_note(added)
                    if config.kind == "bias" and not train:  # masks written per forward, beyond the baseline's
                        geo, base = geometry(model), base_work[(config.baseline, mode, dtype)]
                        writes = mask_writes(work.written, geo, batch) - mask_writes(base.written, geo, batch)
                        record["mask_writes"] = writes
                    record["x_floor"] = None if floor is None else round(added.bytes / floor, 2)
                    record["x_fused"] = None if fused is None else round(added.bytes / fused, 1)
                records.append(record)
    return records


def totals(work: Work) -> dict[str, int]:
    return {"calls": work.calls, "kernels": work.kernels, "flops": work.flops, "bytes": work.bytes}


def table(records: list[dict[str, object]], mode: str, dtype: str) -> str:
    """Markdown table of one setting: per row and size, added calls and kernels, MB, GFLOP, the one-pass floor and
    the added bytes as a multiple of it, the fused floor and the multiple of that; rows whose counts follow the
    CPU's SDPA choice marked ``(CPU)``."""
    rows = [r for r in records if r["mode"] == mode and r["dtype"] == dtype]
    sizes = sorted({r["size"] for r in rows})
    head = "| configuration | " + " | ".join(
        f"{s}px +calls / kernels | {s}px +MB | {s}px +GFLOP | {s}px one-pass floor MB | {s}px x one pass | "
        f"{s}px fused floor MB | {s}px x fused" for s in sizes
    )  # fmt: skip
    lines = [head + " |", "| --- |" + " ---: |" * (7 * len(sizes))]
    for label in dict.fromkeys(r["config"] for r in rows):
        cells = []
        for size in sizes:
            r = next(r for r in rows if r["config"] == label and r["size"] == size)
            if not r["baseline"]:  # a baseline row: its own totals
                totals_ = f"({r['calls']} / {r['kernels']})", f"({r['bytes'] / 1e6:.1f})", f"({r['flops'] / 1e9:.2f})"
                cells += [*totals_, "", "", "", ""]
                continue
            a, floor = r["added"], r["floor_bytes"]
            cells += [f"{a['calls']:+d} / {a['kernels']:+d}", f"{a['bytes'] / 1e6:+.1f}", f"{a['flops'] / 1e9:+.3f}"]
            cells += ["", ""] if floor is None else [f"{floor / 1e6:.1f}", f"{r['x_floor']:.2f}"]
            fused = r["fused_bytes"]
            cells += ["", ""] if fused is None else [f"{fused / 1e6:.2f}", f"{r['x_fused']:.1f}"]
        cpu = any(r.get("cpu_kernel") for r in rows if r["config"] == label)
        lines.append(f"| {label}{' (CPU)' if cpu else ''} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def top_ops(record: dict[str, object], count: int) -> str:
    """The ``count`` ops that add the most bytes to a row: op, added calls, added MB."""
    ops = sorted(record["added_ops"].items(), key=lambda kv: -abs(kv[1][1]))[:count]
    return ", ".join(f"{op} {n:+d} calls {b / 1e6:+.1f} MB" for op, (n, b) in ops)


def above_floor(records: list[dict[str, object]], limit: float = 3.0, count: int = 4) -> list[str]:
    """One line per vispos rotary row and setting whose added bytes pass ``limit`` x its one-pass floor at some
    size: its multiples and the ``count`` ops adding the most bytes at the largest size (what keeps it above)."""
    lines = []
    rows = [r for r in records if r.get("x_floor") and r["kind"] == "rotary" and r["config"].startswith("vispos")]
    for key in dict.fromkeys((r["config"], r["mode"], r["dtype"]) for r in rows):
        group = sorted((r for r in rows if (r["config"], r["mode"], r["dtype"]) == key), key=lambda r: r["size"])
        if max(r["x_floor"] for r in group) > limit:
            multiples = ", ".join(f"{r['x_floor']:.2f}x at {r['size']}px" for r in group)
            lines.append(f"{key[0]}, {key[1]} {key[2]} ({multiples}): {top_ops(group[-1], count)}")
    return lines


def write_json(path: str, result: dict[str, object]) -> None:
    """The result with one record (or verdict) a line: small diffs when a count changes."""
    lines = [f'{{"batch": {result["batch"]}, "sizes": {json.dumps(result["sizes"])},']
    for key in ("records", "targets"):
        items = ",\n".join(f"  {json.dumps(item)}" for item in result[key])  # type: ignore[attr-defined]
        lines.append(f' "{key}": [\n{items}\n ]{"," if key == "records" else ""}')
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n}\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write every record (with added calls and bytes per op) here")
    parser.add_argument("--schemes", nargs="+", help="only these vispos schemes (default: every 2D scheme)")
    parser.add_argument("--sizes", nargs="+", type=int, default=[224, 448])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--no-timm", action="store_true", help="leave out timm's own RoPE models")
    parser.add_argument("--towers", action="store_true",
                        help="add the VLM vision towers' rows (Pixtral, Qwen2-VL, Qwen2.5-VL, Qwen3-VL)")
    parser.add_argument("--ops", type=int, default=0, help="print the N ops adding most bytes to each floor row")
    parser.add_argument("--quick", action="store_true", help="rope2d, rope2d_mixed, relbias2d at 224 px, batch 1")
    args = parser.parse_args(argv)
    if args.quick:
        args.schemes, args.sizes, args.batch = ["rope2d", "rope2d_mixed", "relbias2d"], [224], 1
    records = measure(configurations(args.schemes, not args.no_timm, towers=args.towers), args.sizes, args.batch)
    print(f"Counted work per forward, batch {args.batch}: added to the baseline (baseline rows: their totals)\n")
    for mode, dtype in SETTINGS:
        print(f"### {mode}, {dtype}{' autocast' if dtype == 'bf16' else ''}\n\n{table(records, mode, dtype)}\n")
    print("### targets\n")
    verdicts = check_targets(records)
    for verdict in verdicts:
        print(f"- {'holds' if verdict['holds'] else 'FAILS'}: {verdict['target']} ({verdict['detail']})")
    print("\n### rotary rows above 3x their one-pass floor: the ops adding the most bytes\n")
    for line in above_floor(records):
        print(f"- {line}")
    if args.ops:
        print("\n### ops adding the most bytes\n")
        for r in records:
            if r.get("floor_bytes"):
                print(f"- {r['config']} {r['size']}px {r['mode']} {r['dtype']}: {top_ops(r, args.ops)}")
    if args.json:
        write_json(args.json, {"batch": args.batch, "sizes": args.sizes, "records": records, "targets": verdicts})


if __name__ == "__main__":
    main()
