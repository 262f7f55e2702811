"""``python -m train --config configs/NAME.yaml [key=value ...]``."""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from .config.sections import ConfigError
from .data.datasets import DataError
from .engine.checkpoint import CheckpointError
from .engine.trainer import NonFiniteLossError, StopRequested
from .experiment.loading import load_config
from .experiment.run import run_experiment


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


def resume_command(config: str, overrides: list[str], quiet: bool, resumes: bool) -> str:
    """The command that continues the run: the same one, with resume=true in place of any resume= override
    unless the run resumes already (``resumes``)."""
    if not resumes:
        overrides = [o for o in overrides if o.split("=", 1)[0].strip() != "resume"] + ["resume=true"]
    words = [config, *overrides, *(["--quiet"] * quiet)]
    return " ".join(["python -m train --config", *(shlex.quote(w) for w in words)])


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    overrides = list(args.overrides) + (["progress=false"] if args.quiet else [])
    quiet = ["--quiet"] * args.quiet
    command = " ".join(["python -m train --config", args.config, *args.overrides, *quiet])
    main_rank = os.environ.get("RANK", "0") == "0"  # under torchrun, one message for the job
    cfg = None
    try:
        cfg = load_config(args.config, overrides)
        run_experiment(cfg, command=command)
    except (ConfigError, DataError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except NonFiniteLossError as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    except StopRequested as e:
        print(f"stopped: {e}; run the same command again to resume", file=sys.stderr)
        return 4
    except KeyboardInterrupt:  # checkpoints are replaced atomically: the last one written is intact
        if main_rank:
            after_bar = "\n" if sys.stderr.isatty() else ""  # a bar may hold the terminal's line
            print(f"{after_bar}interrupted: the last checkpoint is kept; resume with: "
                  f"{resume_command(args.config, list(args.overrides), args.quiet, cfg is None or cfg.resume)}",
                  file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
