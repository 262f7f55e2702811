"""Counted work of one denoising step of a FLUX-shaped transformer, unpatched and patched with vispos's settings;
and (``--model dit``) of the generation benchmark's DiT sampling at 2x and 3x its training size under each setting.

    python -m benchmarks.diffusers_work [--grid 128] [--json out.json]
    python -m benchmarks.diffusers_work --model dit [--json out.json]

A ``FluxTransformer2DModel`` of 6 heads of 64 channels (384 wide; RoPE sections (8, 28, 28) as FLUX's (16, 56, 56)
halved), 2 double-stream and 4 single-stream blocks, on fake tensors (``work_count.fake_model``: shapes and ops of
real CPU tensors, no arithmetic), one forward at inference on a grid x grid latent token grid with 64 text tokens,
its training grid 64 x 64 (FLUX's at 1024 px; ``--grid 128`` is 2048 px). Rows: the unpatched transformer (its own
RoPE, the baseline), patched with its RoPE inherited, then with each scaling ``vispos.configure`` sets; counting
rules as ``work_count``'s (aten kernels, bytes they read and write, FLOPs). Each row's extra over the baseline is
what vispos's positions cost per denoising step: the positions are computed once per forward, as FLUX's own.

``--model dit``: configs/fmnist_dit.yaml's ``DiTTransformer2DModel`` (4 heads of 32, depth 6, 2 x 2 px patches,
trained at 14 px: 7 x 7 tokens) for one sample at 28 and 42 px (14 x 14 and 21 x 21 tokens): unpatched (its own
sin-cos table, the baseline), with that table inherited (``dit``), with rope2d in place of it
(``vispos.patch(..., inherit=False)``) and with each inference setting of the benchmark's RoPE entries.
"""

from __future__ import annotations

import argparse
import json
from contextlib import ExitStack

import torch

import vispos
from benchmarks.work_count import CPU_FLASH_FLOPS, Work, WorkCounter, fake_model, on_model_tensors

SETTINGS: dict[str, dict | None] = {
    "unpatched (FLUX's own RoPE)": None,
    "rope2d inherited": {},
    "yarn": {"scaling": "yarn"},
    "yarn + dype": {"scaling": "yarn", "schedule": "dype"},
    "yarn + dype + log-n": {"scaling": "yarn", "schedule": "dype", "log_n_attention": True},
    "ntk + dype": {"scaling": "ntk", "schedule": "dype"},
}
TRAIN_GRID, TEXT = (64, 64), 64


def build() -> torch.nn.Module:
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(in_channels=64, num_layers=2, num_single_layers=4, attention_head_dim=64,
                                  num_attention_heads=6, joint_attention_dim=256, pooled_projection_dim=64,
                                  axes_dims_rope=(8, 28, 28))  # fmt: skip


def count_step(setting: dict | None, grid: int) -> Work:
    from torch.utils.flop_counter import FlopCounterMode

    model = fake_model(build).eval()
    if setting is not None:
        vispos.patch(model, "rope2d")
        if setting:
            vispos.configure(model, train_grid=TRAIN_GRID, **setting)
    with ExitStack() as stack:
        stack.enter_context(on_model_tensors(model))
        stack.enter_context(torch.inference_mode())
        ids = torch.zeros(grid, grid, 3)
        ids[..., 1], ids[..., 2] = torch.arange(grid)[:, None], torch.arange(grid)[None, :]
        inputs = {"hidden_states": torch.zeros(1, grid * grid, 64), "encoder_hidden_states": torch.zeros(1, TEXT, 256),
                  "pooled_projections": torch.zeros(1, 64), "timestep": torch.full((1,), 0.5),
                  "img_ids": ids.reshape(-1, 3), "txt_ids": torch.zeros(TEXT, 3)}  # fmt: skip
        with FlopCounterMode(display=False, custom_mapping=CPU_FLASH_FLOPS) as flops, WorkCounter() as counter:
            model(**inputs)
        counter.work.flops = flops.get_total_flops()
        return counter.work


# the generation benchmark's settings: (scheme, inherit, configure's keywords); None: unpatched
DIT_SETTINGS: dict[str, tuple[str, bool, dict] | None] = {
    "unpatched (DiT's own sin-cos)": None,
    "dit (sincos2d inherited)": ("sincos2d", True, {}),
    "rope2d": ("rope2d", False, {}),
    "rope2d + linear": ("rope2d", False, {"scaling": "linear"}),
    "rope2d + ntk": ("rope2d", False, {"scaling": "ntk"}),
    "rope2d + yarn": ("rope2d", False, {"scaling": "yarn"}),
    "rope2d + ntk + dype": ("rope2d", False, {"scaling": "ntk", "schedule": "dype"}),
    "rope2d + yarn + dype": ("rope2d", False, {"scaling": "yarn", "schedule": "dype"}),
    "rope2d + log-n": ("rope2d", False, {"log_n_attention": True}),
}
DIT_SIZES = (28, 42)  # 2x and 3x the training size, 14 px


def build_dit() -> torch.nn.Module:
    from diffusers import DiTTransformer2DModel

    return DiTTransformer2DModel(num_attention_heads=4, attention_head_dim=32, in_channels=1, out_channels=1,
                                 num_layers=6, sample_size=14, patch_size=2, num_embeds_ada_norm=10,
                                 norm_num_groups=1)  # fmt: skip


def count_dit_step(setting: tuple[str, bool, dict] | None, size: int) -> Work:
    from torch.utils.flop_counter import FlopCounterMode

    model = fake_model(build_dit).eval()
    if setting is not None:
        scheme, inherit, options = setting
        vispos.patch(model, scheme, inherit=inherit)
        if options:
            vispos.configure(model, **options)
    with ExitStack() as stack:
        stack.enter_context(on_model_tensors(model))
        stack.enter_context(torch.inference_mode())
        inputs = {"hidden_states": torch.zeros(1, 1, size, size), "timestep": torch.full((1,), 500.0),
                  "class_labels": torch.zeros(1, dtype=torch.long)}  # fmt: skip
        with FlopCounterMode(display=False, custom_mapping=CPU_FLASH_FLOPS) as flops, WorkCounter() as counter:
            model(**inputs)
        counter.work.flops = flops.get_total_flops()
        return counter.work


def dit_main(path: str | None) -> None:
    out: dict[str, dict] = {}
    print("one sampling step of configs/fmnist_dit.yaml's DiT (one sample), trained at 14 px")
    print("| setting | size | kernels | MB moved | GFLOPs | extra kernels | extra bytes |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for size in DIT_SIZES:
        rows = {name: count_dit_step(setting, size) for name, setting in DIT_SETTINGS.items()}
        base = next(iter(rows.values()))
        for name, work in rows.items():
            extra = work.minus(base)
            print(f"| {name} | {size} px | {work.kernels} | {work.bytes / 1e6:.1f} | {work.flops / 1e9:.3f} | "
                  f"{extra.kernels:+d} | {extra.bytes / base.bytes:+.2%} |")  # fmt: skip
            out.setdefault(str(size), {})[name] = {
                "kernels": work.kernels, "bytes": work.bytes, "flops": work.flops, "extra_kernels": extra.kernels,
                "extra_bytes": extra.bytes,
            }  # fmt: skip
    if path:
        with open(path, "w") as file:
            json.dump({"model": "configs/fmnist_dit.yaml", "sizes": out}, file, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("flux", "dit"), default="flux",
                        help="flux: a FLUX-shaped transformer; dit: the generation benchmark's DiT")
    parser.add_argument("--grid", type=int, default=128, help="latent tokens per side (training grid: 64; flux)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    if args.model == "dit":
        dit_main(args.json)
        return
    rows = {name: count_step(setting, args.grid) for name, setting in SETTINGS.items()}
    base = next(iter(rows.values()))
    print(f"one denoising step, {args.grid} x {args.grid} latent tokens + {TEXT} text tokens, training grid 64 x 64")
    print("| setting | kernels | MB moved | GFLOPs | extra kernels | extra bytes |")
    print("| --- | --- | --- | --- | --- | --- |")
    out = {}
    for name, work in rows.items():
        extra = work.minus(base)
        print(f"| {name} | {work.kernels} | {work.bytes / 1e6:.1f} | {work.flops / 1e9:.2f} | {extra.kernels:+d} | "
              f"{extra.bytes / base.bytes:+.2%} |")  # fmt: skip
        out[name] = {"kernels": work.kernels, "bytes": work.bytes, "flops": work.flops,
                     "extra_kernels": extra.kernels, "extra_bytes": extra.bytes}  # fmt: skip
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"grid": args.grid, "text_tokens": TEXT, "rows": out}, file, indent=1)


if __name__ == "__main__":
    main()
