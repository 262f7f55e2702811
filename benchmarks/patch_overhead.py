"""Speed of patched models against their unpatched baseline, measured in one interleaved run.

    python -m benchmarks.patch_overhead [--reps 10] [--batch 8] [--device cpu|cuda] [--json out.json]
                                        [--schemes rope2d,string2d,...] [--families vit,timm,swin,beit]
                                        [--transformers]

For ``vit_small_patch16_224`` at 224 px (random init): the time of a forward pass under
``torch.inference_mode()`` (what a user's evaluation sees) and of a training step (forward + backward)
of the model patched with every 2D scheme, as a ratio to the unpatched timm model, and the SDPA kernel
each reaches (from the profiler's op names). For comparison, timm's own
RoPE models (``vit_small_patch16_rope_224`` and ``vit_small_patch16_rope_mixed_224``, Eva) and relative-bias model
(``vit_relpos_small_patch16_224``)
against themselves with their positional module removed. ``string2d (folded)``: STRING after
``fold_string`` (its basis moved into the q/k projections), the form to deploy. Repetitions are
interleaved (each round times every configuration once) and ratios use per-round medians, so machine
noise hits all rows alike. Each ratio comes with a 95 % bootstrap interval over the rounds; the control
row (the unpatched model timed again as a second configuration) shows what the machine's noise alone
gives. Each row against a baseline with a control also gets its ratio minus the control's, per round
((t_row - t_control) / t_baseline: the noise the two share cancels), with its own 95 % interval: the row is
resolved when that interval leaves out 0, and the summary under the table names the smallest difference the
run resolved (``resolution``).

Windowed and BEiT hosts, where vispos inherits the model's own relative bias (``vispos.patch(model,
"relbias2d")``, ``inherit=True``): timm's Swin-T (``swin_tiny_patch4_window7_224``, its per-window tables as
window-local ``relbias2d``) and a BEiT at ViT-S size (``beit_base_patch16_224`` built 384 wide with 6 heads, 12
layers; its per-layer tables as ``relbias2d``), each against timm's own unpatched model: the same positions and
outputs (tests/test_patch_overhead_stats.py), so the ratio is vispos's cost alone.

``--families``: which groups of rows to time, comma-separated: ``vit`` (the vispos schemes on
``vit_small_patch16_224``), ``timm`` (timm's RoPE and relative-bias ViTs), ``swin``, ``beit``; default all of
them, or only ``vit`` when ``--schemes`` is given. The ``vit_small_patch16_224`` baseline and the control row are
always timed. ``--families swin,beit`` times only the new hosts (with the control).

``--transformers``: the same for a transformers ``Dinov2Model`` of DINOv2-S's size (384 wide, 12 layers,
6 heads, patch 14, sdpa) against itself unpatched, with a control row of its own: its table inherited
(``learned2d``), with ``rope2d`` beside it, and the bias schemes.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable

import timm
import torch
from torch import nn

import vispos
from vispos.diagnostics.kernels import sdpa_kernels
from vispos.encodings.string import fold_string

MODEL = "vit_small_patch16_224"
CONTROL = f"control: timm {MODEL} again"


def interval(ratios: list[float], resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95 % percentile bootstrap interval of the median of per-round ratios (rounds resampled)."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def control_of(configs: dict[str, tuple[str, object]]) -> dict[str, str]:
    """baseline label -> the label of its control row (the baseline timed again, ``control: ...``)."""
    return {base: label for label, (base, _) in configs.items() if label.startswith("control:")}


def minus_control(row: list[float], control: list[float], base: list[float]) -> tuple[float, tuple[float, float]]:
    """The median over rounds of (t_row - t_control) / t_baseline, and its 95 % bootstrap interval."""
    differences = [(t - c) / b for t, c, b in zip(row, control, base, strict=True)]
    return statistics.median(differences), interval(differences)


def resolution(results: dict[str, dict], kind: str) -> str:
    """One line on what a run resolved for ``kind`` (fwd or fwd+bwd): the smallest difference from the control
    whose interval leaves out 0, and how many rows stay within the noise."""
    resolved, unresolved = [], []
    for label, row in results.items():
        if f"{kind} minus control" not in row:
            continue
        low, high = row[f"{kind} minus control 95% interval"]
        (resolved if low > 0 or high < 0 else unresolved).append((abs(row[f"{kind} minus control"]), label))
    if not resolved:
        return f"{kind}: no row resolved from its control ({len(unresolved)} within the noise)"
    size, label = min(resolved)
    return (f"{kind}: {len(resolved)} row(s) resolved from the control, the smallest difference {size:.3f} ({label}); "
            f"{len(unresolved)} within the noise")  # fmt: skip


def _without_timm_positions(name: str) -> nn.Module:
    """timm's positional model with its positional module removed: the baseline it is compared with."""
    model = timm.create_model(name)
    if hasattr(model, "rope"):
        model.rope = None
    for blk in model.blocks:
        if hasattr(blk.attn, "rel_pos"):
            blk.attn.rel_pos = None
    if hasattr(model, "shared_rel_pos"):
        model.shared_rel_pos = None
    return model


# timm's own positional ViTs, each against itself with its positional module removed
TIMM_OWN = ("vit_small_patch16_rope_224", "vit_small_patch16_rope_mixed_224", "vit_relpos_small_patch16_224")
SWIN = "swin_tiny_patch4_window7_224"
BEIT = "beit_base_patch16_224"
BEIT_SMALL = {"embed_dim": 384, "num_heads": 6}  # ViT-S's width and heads (timm has no beit_small)
# family -> (label of timm's own model, builder of timm's model, the vispos scheme that inherits its positions)
INHERITED_HOSTS: dict[str, tuple[str, Callable[..., nn.Module], str]] = {
    "swin": (f"timm {SWIN}", lambda **kw: timm.create_model(SWIN, pretrained=False, **kw), "relbias2d"),
    "beit": (f"timm {BEIT} (ViT-S size: 384 wide, 6 heads)",
             lambda **kw: timm.create_model(BEIT, pretrained=False, **(BEIT_SMALL | kw)), "relbias2d"),
}  # fmt: skip
FAMILIES = ("vit", "timm", *INHERITED_HOSTS)


def inherited_label(family: str) -> str:
    """The row of ``family``'s model patched by vispos with its own positions inherited."""
    own, _, scheme = INHERITED_HOSTS[family]
    return f"vispos {scheme} (inherited) on {own.removeprefix('timm ')}"


def configurations(
    schemes: list[str] | None = None, families: list[str] | tuple[str, ...] | None = None
) -> dict[str, tuple[str, Callable[[], nn.Module]]]:
    """label -> (baseline label, builder); ``schemes``: only these vispos schemes on ViT-S; ``families``: only
    these groups of rows (``FAMILIES``; default all of them, or only ``vit`` when ``schemes`` is given)."""
    families = tuple(FAMILIES if schemes is None else ("vit",)) if families is None else tuple(families)
    if unknown := set(families) - set(FAMILIES):
        raise ValueError(f"unknown families {sorted(unknown)}; choose from {list(FAMILIES)}")
    configs: dict[str, tuple[str, Callable[[], nn.Module]]] = {f"timm {MODEL}": ("", lambda: timm.create_model(MODEL))}
    configs[CONTROL] = (f"timm {MODEL}", lambda: timm.create_model(MODEL))  # the same model: noise alone
    for scheme in (vispos.list_encodings(ndim=2) if schemes is None else schemes) if "vit" in families else ():
        configs[f"vispos {scheme}"] = (f"timm {MODEL}", lambda s=scheme: vispos.create_model(MODEL, pos=s))
        if scheme == "string2d":  # STRING's basis folded into the q/k projections: RoPE's cost at inference
            configs["vispos string2d (folded)"] = (
                f"timm {MODEL}", lambda: fold_string(vispos.create_model(MODEL, pos="string2d"))
            )  # fmt: skip
    for name in TIMM_OWN if "timm" in families else ():
        base = f"{name} without its positions"
        configs[base] = ("", lambda n=name: _without_timm_positions(n))
        configs[f"timm {name}"] = (base, lambda n=name: timm.create_model(n))
    for family in (f for f in INHERITED_HOSTS if f in families):  # vispos inheriting the host's own positions
        own, build, scheme = INHERITED_HOSTS[family]
        configs[own] = ("", build)
        configs[inherited_label(family)] = (own, lambda b=build, s=scheme: vispos.patch(b(), s))
    return configs


HF_MODEL = "transformers Dinov2Model (DINOv2-S size)"
HF_SCHEMES: tuple[str | list[str], ...] = ("learned2d", ["learned2d", "rope2d"], "rope2d_mixed", "relbias2d", "alibi2d")


class _LastHidden(nn.Module):
    """A transformers model whose call returns its last hidden state (a tensor, as a timm model's output)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x).last_hidden_state


def _dinov2_small(pos: str | list[str] | None = None) -> nn.Module:
    import transformers

    config = transformers.Dinov2Config(hidden_size=384, num_hidden_layers=12, num_attention_heads=6, patch_size=14,
                                       image_size=224, attn_implementation="sdpa")  # fmt: skip
    model = transformers.Dinov2Model(config)
    keeps_table = pos is not None and "learned2d" in ([pos] if isinstance(pos, str) else pos)
    return _LastHidden(model if pos is None else vispos.patch(model, pos, inherit=keeps_table))


def transformers_configurations() -> dict[str, tuple[str, Callable[[], nn.Module]]]:
    """The transformers rows: DINOv2-S unpatched (the baseline, and again as the control) and patched."""
    configs: dict[str, tuple[str, Callable[[], nn.Module]]] = {HF_MODEL: ("", _dinov2_small)}
    configs[f"control: {HF_MODEL} again"] = (HF_MODEL, _dinov2_small)
    for pos in HF_SCHEMES:
        label = " + ".join([pos] if isinstance(pos, str) else pos)
        configs[f"vispos {label} on {HF_MODEL}"] = (HF_MODEL, lambda p=pos: _dinov2_small(p))
    return configs


def _time(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def run(
    reps: int,
    batch: int,
    device: torch.device,
    schemes: list[str] | None = None,
    hf: bool = False,
    families: list[str] | None = None,
) -> dict[str, dict[str, float]]:
    torch.manual_seed(0)
    configs = configurations(schemes, families) | (transformers_configurations() if hf else {})
    models = {label: build().to(device) for label, (_, build) in configs.items()}
    x = torch.randn(batch, 3, 224, 224, device=device)

    def forward(m: nn.Module) -> Callable[[], object]:
        def step() -> object:
            with torch.inference_mode():
                return m.eval()(x)

        return step

    def train_step(m: nn.Module) -> Callable[[], object]:
        def step() -> None:
            m.train()
            m.zero_grad(set_to_none=True)
            m(x).sum().backward()

        return step

    times: dict[str, dict[str, list[float]]] = {k: {"fwd": [], "fwd+bwd": []} for k in models}
    for m in models.values():  # warm-up
        forward(m)()
        train_step(m)()
    for _ in range(reps):
        for label, m in models.items():
            times[label]["fwd"].append(_time(forward(m), device))
            times[label]["fwd+bwd"].append(_time(train_step(m), device))
    results = {}
    controls = control_of(configs)
    for label, (base, _) in configs.items():
        steps = {"fwd": forward(models[label]), "fwd+bwd": train_step(models[label])}
        kernels = {kind: sdpa_kernels(step) for kind, step in steps.items()}
        row: dict[str, float | str] = {f"{kind} kernel": ", ".join(sorted(k)) or "-" for kind, k in kernels.items()}
        for kind in ("fwd", "fwd+bwd"):
            row[f"{kind} ms"] = 1000 * statistics.median(times[label][kind])
            if base:
                ratios = [t / b for t, b in zip(times[label][kind], times[base][kind], strict=True)]
                row[f"{kind} ratio"] = statistics.median(ratios)
                row[f"{kind} ratio 95% interval"] = interval(ratios)
            control = controls.get(base)
            if base and control is not None and control != label:
                diff, bounds = minus_control(times[label][kind], times[control][kind], times[base][kind])
                row[f"{kind} minus control"], row[f"{kind} minus control 95% interval"] = diff, bounds
        results[label] = row
    return results


def table(results: dict[str, dict[str, float]]) -> str:
    lines = [
        "| configuration | fwd ms | fwd ratio [95 % interval] | fwd minus control [95 %] | fwd+bwd ms "
        "| fwd+bwd ratio [95 % interval] | fwd+bwd minus control [95 %] | SDPA kernel (fwd / training) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]

    def shown(row: dict, kind: str) -> str:
        if f"{kind} ratio" not in row:
            return "1 (baseline)"
        low, high = row[f"{kind} ratio 95% interval"]
        return f"{row[f'{kind} ratio']:.3f} [{low:.3f}, {high:.3f}]"

    def difference(row: dict, kind: str) -> str:
        if f"{kind} minus control" not in row:
            return ""
        low, high = row[f"{kind} minus control 95% interval"]
        mark = " *" if low > 0 or high < 0 else ""  # resolved: the interval leaves out 0
        return f"{row[f'{kind} minus control']:+.3f} [{low:+.3f}, {high:+.3f}]{mark}"

    for label, row in results.items():
        cells = [label]
        for kind in ("fwd", "fwd+bwd"):
            cells += [f"{row[f'{kind} ms']:.1f}", shown(row, kind), difference(row, kind)]
        lines.append("| " + " | ".join([*cells, f"{row['fwd kernel']} / {row['fwd+bwd kernel']}"]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--schemes", default=None, help="comma-separated vispos schemes to time (default: all, "
                        "with timm's own RoPE and relative-bias models)")  # fmt: skip
    parser.add_argument("--families", default=None, help=f"comma-separated groups of rows, of {','.join(FAMILIES)} "
                        "(default: all, or vit alone with --schemes)")  # fmt: skip
    parser.add_argument("--transformers", action="store_true", help="also time a transformers DINOv2-S patched "
                        "and unpatched")  # fmt: skip
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    schemes = None if args.schemes is None else [vispos.get_info(s, 2).name for s in args.schemes.split(",")]
    families = None if args.families is None else [f.strip() for f in args.families.split(",")]
    results = run(args.reps, args.batch, device, schemes, hf=args.transformers, families=families)
    print(f"{MODEL} (and each row's own model) at 224 px, batch {args.batch}, fp32, {device.type}, "
          f"{args.reps} interleaved rounds (forward under torch.inference_mode; training step = forward + backward)")
    print(table(results))
    print("* resolved: the interval of the difference from the control leaves out 0")
    for kind in ("fwd", "fwd+bwd"):
        print(resolution(results, kind))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device.type, "batch": args.batch, "reps": args.reps, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
