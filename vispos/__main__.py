"""Command line: ``python -m vispos describe [--ndim 1|2]`` prints the catalogue's property table."""

from __future__ import annotations

import argparse
import os
import sys

from .encodings.rope_scaling_setting import SCALING_TYPES
from .registry import describe


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vispos", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("describe", help="print the property table of every registered scheme")
    d.add_argument("--ndim", type=int, choices=(1, 2), default=None, help="only 1D or only 2D schemes")
    args = parser.parse_args(argv)
    if args.command == "describe":
        text = (
            f"{describe(args.ndim)}\n\n"
            f"RoPE scaling (rope, rope2d option scaling=): {', '.join(SCALING_TYPES)}\n"
            "DroPE (drop positions late in training): vispos.drope.DroPE, any scheme"
        )
        try:
            print(text, flush=True)
        except BrokenPipeError:  # the reader stopped early (`| head`): not an error
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
