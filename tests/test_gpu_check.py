"""The GPU check script runs end to end (its CPU dry run), so it is known to work when a GPU appears."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import vispos
from benchmarks.gpu_check import main

pytestmark = pytest.mark.slow  # the GPU check's dry runs: make test-slow (a CI step), not make test

SCHEMES = set(vispos.list_encodings(ndim=2))
FLEX = {f"{s} (flex)" for s in vispos.list_encodings(ndim=2, kind="bias")}
ONE_GRID = set(vispos.list_encodings(ndim=2, kind="query_bias"))  # refused in ragged batches (decomposed2d)
RAGGED = {"padded to the largest", "ragged rows", "packed rows"}


def test_gpu_check_dry_run_writes_every_configuration(tmp_path: Path) -> None:
    assert main(["--dry-run", "--skip-real", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert "training_steps" not in report
    expected = {f"vispos {s}" for s in SCHEMES} | {f"vispos {s}" for s in FLEX}
    expected |= {"timm vit_small_patch16_224", "timm vit_small_patch16_rope_224"}
    assert set(report["results"]) == expected
    for row in report["results"].values():
        assert set(row) == {"32", "64"} and all(r["img_per_s"] > 0 for r in row.values())
    # eager CPU inference: the fused kernel for every SDPA path, none for FlexAttention
    assert report["kernels"]["vispos relbias2d"] == report["kernels"]["vispos rope2d"] == "flash (CPU)"
    assert report["kernels"]["vispos alibi2d (flex)"] == "none (FlexAttention)"
    table = (tmp_path / "gpu_check.md").read_text()
    assert "| vispos relbias2d (flex) |" in table and "64 px img/s" in table
    # (a) patch dropout: every scheme and timm's own model, a speed-up against its own baseline
    dropout = report["patch_dropout"]["results"]
    assert set(dropout) == SCHEMES | {"timm"}
    for row in dropout.values():
        assert set(row) == {"no dropout", "patch dropout 50%"}
        assert row["no dropout"]["ratio"] == 1.0 and row["patch dropout 50%"]["ratio"] > 0
    # (b) ragged batch: every scheme that takes one (not decomposed2d), the biases once more for FlexAttention
    ragged = report["ragged"]
    assert ONE_GRID == {"decomposed2d", "irpe2d"}
    assert set(ragged["results"]) == (SCHEMES - ONE_GRID) | FLEX and len(ragged["image_sizes"]) == ragged["batch"] == 2
    for row in ragged["results"].values():
        assert set(row) == RAGGED and row["padded to the largest"]["ratio"] == 1.0
        assert all(r["ratio"] > 0 and r["ms"] > 0 and r["attention"] for r in row.values())
        assert all("peak_mib" not in r for r in row.values())  # memory: CUDA only
    # a CPU training step has no FlexAttention (no CPU backward): the flex rows name the SDPA kernel they run
    assert all(r["attention"] != "none (FlexAttention)" for s in FLEX for r in ragged["results"][s].values())
    assert ragged["results"]["relbias2d (flex)"]["packed rows"]["attention"] == "math"  # a mask with gradients
    assert "## (a) Patch dropout 50 % vs none" in table and "| timm | " in table
    assert "## (b) Ragged batch vs padding every image to the largest" in table
    assert "| relbias2d (flex) | packed rows |" in table and "| attention |" in table


def test_gpu_check_skip_flags(tmp_path: Path) -> None:
    assert main(["--dry-run", "--skip-throughput", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert "results" not in report and set(report["ragged"]["results"]) == (SCHEMES - ONE_GRID) | FLEX
    table = (tmp_path / "gpu_check.md").read_text()
    assert "## Inference throughput" not in table and "## (b) Ragged batch" in table
    with pytest.raises(SystemExit):
        main(["--dry-run", "--skip-throughput", "--skip-token-subsets", "--skip-real", "--out", str(tmp_path)])


def test_gpu_check_dry_run_trains_every_scheme_on_both_hosts_and_loads_through_a_device_map(tmp_path: Path) -> None:
    """The real-device part (benchmarks/gpu_real.py) on the CPU: a bf16-autocast training step per scheme and host
    with finite loss and gradients and the SDPA kernel it reached, and a sharded device-map load per host equal to
    the in-memory model."""
    assert main(["--dry-run", "--skip-throughput", "--skip-token-subsets", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    steps = report["training_steps"]
    assert set(steps) == {"timm", "transformers"}
    for host, rows in steps.items():
        assert set(rows) == SCHEMES, host
        for scheme, row in rows.items():
            assert isinstance(row, dict), (host, scheme, row)  # a string is the error it raised
            assert row["finite"] and row["ms"] > 0 and row["kernel"], (host, scheme)
    # on the CPU a bias mask with gradients takes the math kernel, RoPE the fused one
    assert steps["timm"]["relbias2d"]["kernel"] == "math" and steps["timm"]["rope2d"]["kernel"] == "flash (CPU)"
    loads = report["device_map_loads"]
    assert set(loads) == {"timm", "transformers"}
    for host, row in loads.items():
        assert isinstance(row, dict) and row["equal"], (host, row)
    table = (tmp_path / "gpu_check.md").read_text()
    assert "## bf16 training step per scheme and host" in table and "## Device-map load" in table
