"""``python -m vispos.diagnostics --out DIR``: measure every 2D scheme, write the table and figures to DIR."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ..registry import list_encodings
from .report import build_layer, write_report

MAX_SEED = 2**63 - 1  # torch.manual_seed's range


def check_args(args: argparse.Namespace) -> str | None:
    """What is wrong with the command line, before anything is measured (None: nothing)."""
    h, w = args.grid
    if h < 2 or w < 2:
        return f"--grid needs at least 2 patches per axis (a shift needs two positions), got {h} {w}"
    if args.embed_dim < 1 or args.heads < 1:
        return f"--embed-dim and --heads must be >= 1, got {args.embed_dim} and {args.heads}"
    if args.embed_dim % args.heads:
        return f"--embed-dim {args.embed_dim} must be divisible by --heads {args.heads}"
    if not -MAX_SEED - 1 <= args.seed <= MAX_SEED:
        return f"--seed must fit in 64 bits, got {args.seed}"
    for name in list_encodings(ndim=2):  # every scheme's own size rules (rotary pairs per axis, blocks...)
        try:
            with torch.random.fork_rng(devices=[]):  # the global RNG is left as it was
                build_layer(name, grid=(2, 2), embed_dim=args.embed_dim, num_heads=args.heads)
        except (TypeError, ValueError) as e:
            head_dim = args.embed_dim // args.heads
            return f"--embed-dim {args.embed_dim} --heads {args.heads} (head dim {head_dim}) does not fit {name}: {e}"
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        return f"--out {out} is a file; give a folder (created if missing)"
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"--out {out}: cannot create the folder ({e.strerror or e})"
    return None


def main(argv: list[str] | None = None) -> int:
    """Bad input ends with one ``error:`` line and exit status 2, as argparse does for its own checks."""
    parser = argparse.ArgumentParser(prog="python -m vispos.diagnostics", description=__doc__)
    parser.add_argument("--out", required=True, help="output folder (created if missing)")
    parser.add_argument("--grid", type=int, nargs=2, default=(11, 11), metavar=("H", "W"), help="patch grid, >= 2 x 2")
    parser.add_argument("--embed-dim", type=int, default=128, help="embedding width of the random layer")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (head dim: a multiple of 8)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    problem = check_args(args)
    if problem is not None:
        parser.error(problem)
    text = write_report(args.out, grid=tuple(args.grid), embed_dim=args.embed_dim, num_heads=args.heads, seed=args.seed)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
