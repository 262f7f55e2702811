"""Shared fixtures: small, randomly initialised timm models (no downloads)."""

from __future__ import annotations

import os

import pytest
import torch

# at most 2 threads, shared out between pytest-xdist's workers (``make test`` runs one per core) so that the
# workers together do not ask for more threads than there are cores
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // WORKERS)))


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
