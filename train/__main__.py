"""``python -m train --config configs/NAME.yaml [key=value ...]``."""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys

import torch

from .config.generation import GenerationConfig
from .config.sections import ConfigError, ExperimentConfig
from .data.datasets import DataError
from .engine.checkpoint import CheckpointError
from .engine.trainer import NonFiniteLossError, StopRequested
from .experiment.generate import get_scorer, run_generation
from .experiment.loading import load_config
from .experiment.run import run_experiment
from .runtime.jobs import Job, run_jobs


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
    p.add_argument("--entries", nargs="+", metavar="NAME", default=None,
                   help="run only these entries of the config (an evaluation-only entry brings its base along)")
    p.add_argument("--jobs", type=int, default=1,
                   help="train the entries (per seed) in this many processes at once, one core each at threads: 1, "
                        "then evaluate and report in this one")
    # the trainings --jobs starts: each leaves the run's report to the process that assembles it
    p.add_argument("--no-report", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_intermixed_args(argv)
    if args.entries:  # KEY=VALUE after --entries is an override, not an entry's name
        args.overrides += [e for e in args.entries if "=" in e]
        args.entries = [e for e in args.entries if "=" not in e]
        if not args.entries:
            p.error("--entries needs at least one entry name before KEY=VALUE overrides")
    return args


def prepare_scorer(cfg: GenerationConfig) -> None:
    """The generation run's scorer, trained (or found) in this process before parallel jobs read it."""
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    get_scorer(cfg, lambda text: print(text, flush=True))


def only_entries(cfg: ExperimentConfig, names: list[str]) -> ExperimentConfig:
    """``cfg`` with the named entries only (and the base of each evaluation-only one among them)."""
    known = {s.name: s for s in cfg.schemes}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ConfigError(f"--entries {' '.join(unknown)}: not entries of the config ({', '.join(known)})")
    keep = set(names) | {known[n].base for n in names if known[n].base}
    return dataclasses.replace(cfg, schemes=[s for s in cfg.schemes if s.name in keep])


def parallel_jobs(config: str, overrides: list[str], cfg: ExperimentConfig) -> list[Job]:
    """One job per seed and trained entry: ``python -m train`` on that entry alone, in the folder the whole
    run keeps it in (``seed_<k>/`` with several seeds), so that the run that follows finds it finished."""
    trained = [s.name for s in cfg.schemes if s.trains]
    # a generation job also samples its entry's evaluation-only settings (the costly part of those entries)
    with_settings = {name: [name, *(s.name for s in cfg.schemes if s.base == name)] if isinstance(cfg, GenerationConfig)
                     else [name] for name in trained}  # fmt: skip
    if cfg.seeds is None:
        return [(name, ["-m", "train", "--config", config, *overrides, "--quiet", "--no-report", "--entries",
                        *with_settings[name]]) for name in trained]  # fmt: skip
    return [(f"seed {seed} {name}", ["-m", "train", "--config", config, *overrides, "--quiet", "--no-report",
                                     f"seed={seed}", "seeds=null", f"out_dir={cfg.run_dir / f'seed_{seed}'}",
                                     "--entries", *with_settings[name]])
            for seed in cfg.seeds for name in trained]


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
    extra = [*(["--entries", *args.entries] if args.entries else []), *(["--jobs", str(args.jobs)] * (args.jobs > 1))]
    command = " ".join(["python -m train --config", args.config, *args.overrides, *quiet, *extra])
    main_rank = os.environ.get("RANK", "0") == "0"  # under torchrun, one message for the job
    cfg = None
    try:
        if args.jobs < 1:
            raise ConfigError(f"--jobs must be >= 1, got {args.jobs}")
        cfg = load_config(args.config, overrides)
        if args.entries:
            cfg = only_entries(cfg, args.entries)
        generation = isinstance(cfg, GenerationConfig)
        if args.jobs > 1:  # the trainings first, side by side; the run below finds them finished
            if generation:
                prepare_scorer(cfg)  # once, before the jobs that share it
            run_jobs(parallel_jobs(args.config, list(args.overrides), cfg), args.jobs,
                     lambda text: print(text, flush=True))
        if generation:
            run_generation(cfg, command=command, report=not args.no_report)
        else:
            run_experiment(cfg, command=command, report=not args.no_report)
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
