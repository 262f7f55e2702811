"""Checkpoints: written atomically, loadable with ``torch.load(weights_only=True)``.

A checkpoint holds only tensors and primitive containers: model, optimizer and scheduler state, the
RNG states (as tensors), the data position (epoch, step within it, global step), the running sums of
the current epoch, the history of finished epochs, and the config that made it. Its fingerprint (what
determines the trained weights) decides whether it may be resumed.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..config.sections import DataConfig, ExperimentConfig, SchemeConfig, scheme_config, to_dict

FORMAT = 1


def atomic_save(obj: Any, path: Path) -> None:
    """torch.save to a temporary file in the same folder, fsync, then os.replace onto ``path``. Ctrl-C
    (SIGINT) and SIGTERM wait until the file is in place, so an interrupted run leaves no temporary file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with signals_deferred():
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(obj, f)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)  # mkstemp creates 0600
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM back for the block and deliver one that arrived after it. Python runs signal
    handlers in the main thread whichever thread the signal reached, so the handlers are swapped there."""
    signals = [s for s in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(s) is not None]
    if threading.current_thread() is not threading.main_thread() or not signals:
        yield
        return
    caught: list[int] = []
    previous = {s: signal.signal(s, lambda signum, _frame: caught.append(signum)) for s in signals}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for s in dict.fromkeys(caught):
            signal.raise_signal(s)


class CheckpointError(RuntimeError):
    """A checkpoint is missing, a folder, foreign or incomplete; the message says what is expected."""


def load(path: Path, map_location: str | torch.device = "cpu", *, required: tuple[str, ...] = ()) -> dict[str, Any]:
    """Load a checkpoint safely (weights_only=True); a clear error for a missing, foreign or incomplete file
    (``required``: entries it must hold)."""
    path = Path(path)
    if path.is_dir():
        inside = sorted(p.name for p in path.glob("*.pt"))
        hint = f" ({', '.join(inside)} there)" if inside else ""
        raise CheckpointError(f"{path} is a folder; give a checkpoint file the trainer wrote, e.g. "
                              f"{path / 'checkpoint.pt'}{hint}")
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # torch's own text suggests weights_only=False, which is not the remedy here
        why = type(e).__name__
        raise CheckpointError(f"cannot load checkpoint {path}: not a file the trainer wrote ({why})") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a vispos trainer checkpoint (format {FORMAT})")
    missing = [k for k in required if k not in ckpt]
    if missing:
        raise CheckpointError(f"{path} has no {', '.join(missing)} entry: it cannot be rebuilt and evaluated "
                              f"(a trainer checkpoint holds {', '.join(required)})")
    return ckpt


def rng_state() -> dict[str, Any]:
    """Every RNG the trainer touches, as tensors and ints."""
    py = random.getstate()
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python_version": int(py[0]),
        "python": torch.tensor(py[1], dtype=torch.int64),
        "python_gauss": py[2],
        "numpy": torch.from_numpy(np_state[1].astype(np.int64)),
        "numpy_pos": int(np_state[2]),
        "numpy_has_gauss": int(np_state[3]),
        "numpy_gauss": float(np_state[4]),
    }
    if torch.cuda.is_available():
        state["cuda"] = [s.cpu() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"].cpu())
    random.setstate((state["python_version"], tuple(int(v) for v in state["python"].tolist()), state["python_gauss"]))
    np.random.set_state(("MT19937", state["numpy"].numpy().astype(np.uint32), state["numpy_pos"],
                         state["numpy_has_gauss"], state["numpy_gauss"]))
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


def fingerprint(cfg: ExperimentConfig, scheme: SchemeConfig) -> dict[str, Any]:
    """What determines the trained weights; a checkpoint is resumed only when this matches."""
    cfg = scheme_config(cfg, scheme)
    data = {k: v for k, v in to_dict(cfg.data).items() if k != "workers"}
    if data["zooms"] == [1]:  # the training scale only: runs made before data.zooms keep their fingerprint
        data.pop("zooms")
    if data["crop_scale"] == DataConfig().crop_scale:  # likewise for runs made before data.crop_scale
        data.pop("crop_scale")
    train = {k: v for k, v in to_dict(cfg.train).items() if k not in (
        "checkpoint_every", "compile", "log_every", "activation_checkpointing", "val_every", "converged_within")}
    if not cfg.train.ema:  # the EMA settings matter only when it is on (runs made before it keep their fingerprint)
        train = {k: v for k, v in train.items() if not k.startswith("ema")}
    for key, default in (("pos_lr_scale", 1.0), ("pos_weight_decay", 0.0)):  # at their defaults: runs made before
        if train[key] == default:
            train.pop(key)
    if cfg.train.strategy == "ddp":  # likewise the strategy: a DDP run's checkpoint is one file, an FSDP run's sharded
        train.pop("strategy")
    sch = {k: v for k, v in to_dict(scheme).items() if k in ("pos", "options", "drope")}
    return {"seed": cfg.seed, "data": data, "model": to_dict(cfg.model), "train": train, "scheme": sch}


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}.{k}" if prefix else k))
    return out


def fingerprint_diff(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The dotted keys whose values differ between two fingerprints."""
    fa, fb = _flat(a), _flat(b)
    return sorted(k for k in set(fa) | set(fb) if fa.get(k) != fb.get(k))
