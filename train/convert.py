"""``python -m train.convert RUN/SCHEME/checkpoint.pt OUT``: a sharded (fsdp) checkpoint as plain weights.

``OUT.safetensors``: the model's state dict, which ``vispos.create_model(..., checkpoint_path=OUT)`` loads.
``OUT.pt``: a single-file trainer checkpoint of the same run (the model's weights in place of the shard
folder, no optimiser state), which ``python -m train.evaluate`` evaluates. One process, no process group.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from safetensors.torch import save_file

from .engine import checkpoint as ckpt_io
from .engine.sharded import full_state


def convert(checkpoint: Path, out: Path) -> None:
    """Write the weights of ``checkpoint`` (a trainer checkpoint naming a shard folder) to ``out``."""
    ck = ckpt_io.load(checkpoint)
    if not ck.get("shards"):
        raise ckpt_io.CheckpointError(f"{checkpoint} holds its weights already (not an fsdp run's checkpoint)")
    weights = full_state(Path(checkpoint).parent / ck["shards"])
    if out.suffix == ".safetensors":
        save_file({k: v.contiguous() for k, v in weights.items()}, str(out))
    else:
        ckpt_io.atomic_save({**ck, "shards": None, "model": weights, "optimizer": None}, out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m train.convert", description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", type=Path, help="checkpoint.pt of an fsdp run (beside its shards-* folder)")
    ap.add_argument("out", type=Path, help="OUT.safetensors (weights) or OUT.pt (a trainer checkpoint)")
    args = ap.parse_args(argv)
    convert(args.checkpoint, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
