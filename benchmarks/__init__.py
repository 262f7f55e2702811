"""Benchmarks whose numbers README quotes; run from the repository root, each prints ratios against a
baseline measured in the same run (timings never go in tests).

- ``patch_overhead``: speed of a timm ViT patched with each 2D scheme against the unpatched model (CPU or GPU).
- ``gpu_check``: throughput and peak memory of every scheme at 224 / 448 / 896 px on a GPU (``--dry-run``: CPU).
- ``seq1d``: train short, test long for every 1D scheme, RoPE scaling and DroPE (``python -m benchmarks.seq1d``).
"""
