"""``python -m train --config configs/NAME.yaml [key=value ...]`` (also the ``vispos-train`` script)."""

from __future__ import annotations

import argparse
import sys

from .config import ConfigError, load_config
from .data import DataError
from .engine import NonFiniteLossError, StopRequested
from .experiment import run_experiment


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m train",
        description="Train several positional schemes on one ViT under identical settings and evaluate "
        "each at several resolutions (resize and canvas protocols).",
        epilog="Overrides address config keys by dotted path, e.g. train.epochs=1 eval.sizes=[28,56] "
        "'schemes=[rope2d,nope]'. Launch with torchrun for DDP.",
    )
    p.add_argument("--config", required=True, help="YAML experiment config (see configs/)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")
    p.add_argument("--quiet", action="store_true", help="no progress bars (same as progress=false)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    overrides = list(args.overrides) + (["progress=false"] if args.quiet else [])
    try:
        cfg = load_config(args.config, overrides)
        command = " ".join(["python -m train --config", args.config, *args.overrides, *(["--quiet"] * args.quiet)])
        run_experiment(cfg, command=command)
    except (ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except NonFiniteLossError as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    except StopRequested as e:
        print(f"stopped: {e}; run the same command again to resume", file=sys.stderr)
        return 4
    return 0


if __name__ == "__main__":
    sys.exit(main())
