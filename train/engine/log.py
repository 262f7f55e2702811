"""The per-epoch CSV log (``log.csv`` in each scheme's folder): its columns and its atomic writer."""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any

LOG_FIELDS = ("epoch", "step", "lr", "train_loss", "train_acc", "val_acc", "skipped", "drope", "sizes", "seconds")


def write_csv(path: Path, history: list[dict[str, Any]]) -> None:
    """The per-epoch log, replaced atomically."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=LOG_FIELDS)
    writer.writeheader()
    for row in history:
        writer.writerow({k: row.get(k, "") for k in LOG_FIELDS})
    tmp = path.with_suffix(".csv.tmp")
    tmp.write_text(buf.getvalue())
    tmp.replace(path)
