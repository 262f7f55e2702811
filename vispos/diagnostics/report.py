"""Every 2D scheme on one small random ViT layer: measured values as a Markdown table, maps as PNG.

Each scheme is patched onto the same random timm ``VisionTransformer`` layer (same seed, so the same qkv
weights and the same content vector for all), with its own parameters at their initial values. The
figures use matplotlib's object API (``matplotlib.figure.Figure``, Agg rendering) and never touch
pyplot's global state.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .._validate import check_grid, check_int
from ..registry import get_info, list_encodings
from ..timm import create_model
from .logits import layer_logits
from .measures import cross_term, query_map, translation_error

TOLERANCE = 1e-4  # below this a measure is zero to floating-point precision (the maths runs in fp32)
FILES = {"table": "diagnostics.md", "maps": "logit_maps.png", "measures": "measures.png"}


@dataclass(frozen=True)
class SchemeReport:
    """Measured behaviour of one 2D scheme on one random layer."""

    name: str
    kind: str
    relative: bool  # as declared in the registry
    translation: torch.Tensor  # [heads]
    cross_term: torch.Tensor  # [heads]
    maps: torch.Tensor  # [heads, H, W]: logits of the centre query against every key

    @property
    def measured_relative(self) -> bool | None:
        t = self.translation.max().item()
        return None if math.isnan(t) else t < TOLERANCE

    @property
    def measured_separable(self) -> bool | None:
        c = self.cross_term.max().item()
        return None if math.isnan(c) else c < TOLERANCE


def _display_order(name: str) -> tuple[int, str]:
    """Absolute tables first, then rotary, then biases, then conditional schemes, then nope."""
    kinds = ("additive", "rotary", "bias", "query_bias", "channels", "relative_kv", "conditional", "none")
    return kinds.index(get_info(name, ndim=2).kind), name


RANDOM_INIT_STD = 0.02  # a scheme whose tables start at zero (decomposed2d, as SAM) is drawn with this instead


def build_layer(name: str, *, grid: tuple[int, int], embed_dim: int, num_heads: int, patch_size: int = 4) -> nn.Module:
    """A one-block random ViT (cls token) at ``grid``, patched with ``name``, in eval mode; two blocks for a
    conditional scheme (peg2d after the first: its positions reach the second layer). Tables that a scheme
    starts at zero are drawn at random (``RANDOM_INIT_STD``): a zero table has no positions to measure."""
    h, w = grid
    info = get_info(name, ndim=2)
    init = inspect.signature(info.builder).parameters.get("init_std")
    options = {"init_std": RANDOM_INIT_STD} if init is not None and init.default == 0 else {}
    model = create_model(
        "vit_tiny_patch16_224",  # timm's default ViT block; every size below overrides the tiny one
        pos=name,
        pos_options=options,
        img_size=(h * patch_size, w * patch_size),
        patch_size=patch_size,
        embed_dim=embed_dim,
        depth=2 if info.kind == "conditional" else 1,
        num_heads=num_heads,
        num_classes=0,
    )
    return model.eval()


def measure_schemes(
    *,
    grid: tuple[int, int] = (11, 11),
    embed_dim: int = 128,
    num_heads: int = 4,
    seed: int = 0,
    names: list[str] | None = None,
) -> list[SchemeReport]:
    """Translation error and cross-term per head for each 2D scheme (default: all) on one random layer.

    The layer sees the same random content vector at every patch (plus the scheme's table for additive
    schemes, through the PEG for a conditional one). Global RNG state is restored afterwards.
    """
    grid = check_grid(grid)
    check_int("seed", seed)
    reports = []
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        for name in names if names is not None else sorted(list_encodings(ndim=2), key=_display_order):
            info = get_info(name, ndim=2)
            torch.manual_seed(seed)  # same content and qkv weights for every scheme
            content = torch.randn(embed_dim)
            model = build_layer(name, grid=grid, embed_dim=embed_dim, num_heads=num_heads)
            logits = layer_logits(model, grid, layer=len(model.blocks) - 1, content=content)  # [heads, HW, HW]
            reports.append(
                SchemeReport(
                    name=name,
                    kind=info.kind,
                    relative=info.relative,
                    translation=translation_error(logits, grid),
                    cross_term=cross_term(logits, grid),
                    maps=query_map(logits, grid),
                )
            )
    return reports


def _fmt(value: float) -> str:
    if math.isnan(value):
        return "n/a"
    return f"{value:.3f}" if value >= 1e-2 else f"{value:.1e}"


def _verdict(value: bool | None) -> str:
    return "n/a" if value is None else ("yes" if value else "no")


def markdown_table(reports: list[SchemeReport]) -> str:
    """One row per scheme: declared and measured properties, measures over heads."""
    rows = [
        "| scheme | kind | relative (declared) | translation error, max over heads | relative (measured) "
        "| cross-term, min – max over heads | separable (measured) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in reports:
        cross = f"{_fmt(r.cross_term.min().item())} – {_fmt(r.cross_term.max().item())}"
        if math.isnan(r.cross_term.max().item()):
            cross = "n/a"
        rows.append(
            f"| `{r.name}` | {r.kind} | {'yes' if r.relative else 'no'} | {_fmt(r.translation.max().item())} | "
            f"{_verdict(r.measured_relative)} | {cross} | {_verdict(r.measured_separable)} |"
        )
    return "\n".join(rows)


def plot_logit_maps(reports: list[SchemeReport], path: str | Path, *, heads: int = 4) -> Path:
    """One column per scheme, one row per head: the centre query's logits over key offsets (dx, dy)."""
    from matplotlib.figure import Figure  # noqa: PLC0415  (optional at import time)

    heads = min(heads, *(r.maps.shape[0] for r in reports))
    h, w = reports[0].maps.shape[-2:]
    cy, cx = h // 2, w // 2
    extent = (-cx - 0.5, w - 1 - cx + 0.5, h - 1 - cy + 0.5, -cy - 0.5)  # dx left to right, dy top to bottom
    fig = Figure(figsize=(1.45 * len(reports) + 0.6, 1.45 * heads + 0.9), layout="constrained")
    axes = fig.subplots(heads, len(reports), squeeze=False)
    for col, r in enumerate(reports):
        for head in range(heads):
            ax = axes[head, col]
            m = r.maps[head].double()
            m = m - m.mean()  # the content logit is a constant offset; show the positional variation
            lim = m.abs().max().item()
            ax.imshow(m.numpy(), cmap="RdBu_r", vmin=-lim or -1, vmax=lim or 1, extent=extent, interpolation="nearest")
            ax.set_xticks([-cx, 0, w - 1 - cx])
            ax.set_yticks([-cy, 0, h - 1 - cy])
            ax.tick_params(labelsize=6, length=2, pad=1)
            if lim == 0:
                ax.text(0, 0, "constant", ha="center", va="center", fontsize=7, color="gray")
            if head == 0:
                ax.set_title(f"{r.name}\n({r.kind})", fontsize=8)
            if col == 0:
                ax.set_ylabel(f"head {head}\ndy", fontsize=7)
            if head == heads - 1:
                ax.set_xlabel("dx", fontsize=7)
    fig.suptitle(
        "Logit of the centre patch (query) against each key at offset (dx, dy); mean removed, red high", fontsize=9
    )
    path = Path(path)
    fig.savefig(path, dpi=110)
    return path


def plot_measures(reports: list[SchemeReport], path: str | Path) -> Path:
    """Bars: translation error and cross-term per scheme (max over heads, dots: each head), log scale."""
    from matplotlib.figure import Figure  # noqa: PLC0415

    floor = 1e-9  # exact zeros are drawn at the floor
    fig = Figure(figsize=(8.5, 3.6), layout="constrained")
    ax = fig.subplots()
    width = 0.38
    series = (("translation error", "translation", "tab:blue"), ("cross-term", "cross_term", "tab:orange"))
    for i, (label, attr, color) in enumerate(series):
        for j, r in enumerate(reports):
            values = getattr(r, attr).double()
            x = j + (i - 0.5) * width
            if values.isnan().all():
                ax.text(x, floor * 1.5, "n/a", ha="center", va="bottom", fontsize=7)
                continue
            if values.max() == 0:
                ax.text(x, floor * 1.5, "0\n(exact)", ha="center", va="bottom", fontsize=7, color=color)
                continue
            values = values.clamp_min(floor)
            ax.bar(x, values.max().item(), width, color=color, label=label if j == 0 else None)
            ax.scatter([x] * len(values), values.numpy(), s=6, color="black", zorder=3)
    ax.axhline(TOLERANCE, color="gray", linestyle="--", linewidth=0.8)
    ax.text(len(reports) - 0.5, TOLERANCE * 1.5, "floating-point level", ha="right", fontsize=7, color="gray")
    ax.set_yscale("log")
    ax.set_ylim(floor, 50.0)
    ax.set_xticks(range(len(reports)), [r.name for r in reports], fontsize=8)
    ax.set_ylabel("relative RMS (bar: worst head)", fontsize=8)
    ax.set_title("Translation error (0: relative) and row/column cross-term (0: axes isolated)", fontsize=9)
    ax.legend(fontsize=8, loc="upper center", ncol=2, frameon=False)
    path = Path(path)
    fig.savefig(path, dpi=110)
    return path


def write_report(
    out: str | Path,
    *,
    grid: tuple[int, int] = (11, 11),
    embed_dim: int = 128,
    num_heads: int = 4,
    seed: int = 0,
) -> str:
    """Measure every 2D scheme and write ``diagnostics.md``, ``logit_maps.png`` and ``measures.png`` to ``out``.

    Returns the Markdown written to ``diagnostics.md``.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    reports = measure_schemes(grid=grid, embed_dim=embed_dim, num_heads=num_heads, seed=seed)
    plot_logit_maps(reports, out / FILES["maps"], heads=num_heads)
    plot_measures(reports, out / FILES["measures"])
    h, w = check_grid(grid)
    text = "\n".join(
        [
            "# Positional diagnostics",
            "",
            f"One random ViT layer (embed {embed_dim}, {num_heads} heads, cls token, seed {seed}) on a {h}x{w} patch "
            "grid, the same random content at every patch, each scheme patched in with its initial parameters. "
            "Translation error: RMS change of a logit when query and key shift together, relative to the "
            "logits' spread (0: relative). Cross-term: RMS of the part of the logit map that couples an x "
            "coordinate with a y coordinate, relative to its spread (0: L = F(px, qx) + G(py, qy)). "
            f"Below {TOLERANCE:g} counts as zero (fp32 maths).",
            "",
            markdown_table(reports),
            "",
            f"![logit maps]({FILES['maps']})",
            "",
            f"![measures]({FILES['measures']})",
            "",
            f"Command: `python -m vispos.diagnostics --out {out.as_posix()} --grid {h} {w} --embed-dim {embed_dim} "
            f"--heads {num_heads} --seed {seed}`",
            "",
        ]
    )
    (out / FILES["table"]).write_text(text)
    return text
