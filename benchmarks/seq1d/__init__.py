"""Train short, test long: a 1D extrapolation benchmark for every vispos sequence scheme.

A tiny causal transformer (``vispos.layers.Attention``) is trained at a short length L on synthetic tasks that
need position and retrieval (passkey, copy / reverse, associative recall) and evaluated at multiples of L,
for every 1D scheme, every RoPE scaling method applied at evaluation, and a DroPE run, under identical
training settings. Run ``python -m benchmarks.seq1d --config configs/seq1d_passkey.yaml``.
"""

from .config import BenchConfig, ConfigError, load_config
from .runner import run
from .tasks import Copy, Passkey, Recall, build_task

__all__ = ["BenchConfig", "ConfigError", "Copy", "Passkey", "Recall", "build_task", "load_config", "run"]
