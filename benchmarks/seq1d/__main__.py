"""``python -m benchmarks.seq1d --config configs/seq1d_passkey.yaml [key=value ...]``."""

from __future__ import annotations

import argparse
import sys
import time

from .config import ConfigError, load_config, to_dict
from .report import markdown, write_outputs
from .runner import run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.seq1d", description=__doc__)
    parser.add_argument("--config", required=True, help="YAML config (configs/seq1d_*.yaml)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.steps=500 tasks=[passkey]")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    results = {
        "config": to_dict(cfg),
        "train_length": cfg.train.length,
        "lengths": cfg.lengths(),
        "multiples": list(cfg.eval.multiples),
        **run(cfg),
    }
    results["wall_seconds"] = time.perf_counter() - start
    paths = write_outputs(results, cfg.run_dir)
    print(markdown(results))
    print("wrote " + ", ".join(map(str, paths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
