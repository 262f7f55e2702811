"""The GPU check script runs end to end (its CPU dry run), so it is known to work when a GPU appears."""

from __future__ import annotations

import json
from pathlib import Path

import vispos
from benchmarks.gpu_check import main


def test_gpu_check_dry_run_writes_every_configuration(tmp_path: Path) -> None:
    assert main(["--dry-run", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    expected = {f"vispos {s}" for s in vispos.list_encodings(ndim=2)}
    expected |= {f"vispos {s} (flex)" for s in vispos.list_encodings(ndim=2, kind="bias")}
    expected |= {"timm vit_small_patch16_224", "timm vit_small_patch16_rope_224"}
    assert set(report["results"]) == expected
    for row in report["results"].values():
        assert set(row) == {"32", "64"} and all(r["img_per_s"] > 0 for r in row.values())
    # eager CPU inference: the fused kernel for every SDPA path, none for FlexAttention
    assert report["kernels"]["vispos relbias2d"] == report["kernels"]["vispos rope2d"] == "flash (CPU)"
    assert report["kernels"]["vispos alibi2d (flex)"] == "none (FlexAttention)"
    table = (tmp_path / "gpu_check.md").read_text()
    assert "| vispos relbias2d (flex) |" in table and "64 px img/s" in table
