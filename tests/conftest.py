"""Shared fixtures: small, randomly initialised timm models (no downloads)."""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils._device import _device_constructors

# at most 2 threads, shared out between pytest-xdist's workers (``make test`` runs one per core) so that the
# workers together do not ask for more threads than there are cores
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // WORKERS)))

# torch's device context (``with torch.device("meta")``, the trainer's preflight) recognises the tensor
# constructors from a set it builds once per process. transformers' from_pretrained replaces ``torch.linspace``
# while it initialises a model (``initialization.meta_device_safe_creation_ops``): if the set is first built then,
# the real ``torch.linspace`` is never recognised afterwards and makes CPU tensors inside a meta context. Build the
# set now, so that which tests a worker ran before does not decide what the meta-device tests see.
_device_constructors()


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
