"""``python -m vispos.diagnostics --out DIR``: measure every 2D scheme, write the table and figures to DIR."""

from __future__ import annotations

import argparse

from .report import write_report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vispos.diagnostics", description=__doc__)
    parser.add_argument("--out", required=True, help="output folder (created if missing)")
    parser.add_argument("--grid", type=int, nargs=2, default=(11, 11), metavar=("H", "W"), help="patch grid")
    parser.add_argument("--embed-dim", type=int, default=128, help="embedding width of the random layer")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (head dim must be divisible by 4)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    text = write_report(args.out, grid=tuple(args.grid), embed_dim=args.embed_dim, num_heads=args.heads, seed=args.seed)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
