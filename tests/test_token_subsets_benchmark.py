"""The token-subset benchmark runs end to end (its dry run), and its ragged batches hold what they claim."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from benchmarks.ragged_batches import draw_sizes, patchify, ragged_batch
from benchmarks.token_subsets import main


def test_token_subsets_dry_run_writes_every_configuration(tmp_path: Path) -> None:
    out = tmp_path / "token_subsets.json"
    assert main(["--dry-run", "--schemes", "rope2d,relbias2d", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["dropout"]) == {"rope2d", "relbias2d", "timm"}
    assert set(report["ragged"]) == {"rope2d", "relbias2d"}
    for row in report["dropout"].values():
        assert set(row) == {"no dropout", "patch dropout 50%"}
        assert row["no dropout"]["ratio"] == 1.0 and row["patch dropout 50%"]["ms"] > 0
    for row in report["ragged"].values():
        assert set(row) == {"padded to the largest", "ragged rows", "packed rows"}
        assert row["padded to the largest"]["ratio"] == 1.0 and all(r["ms"] > 0 for r in row.values())


def test_packed_rows_hold_every_patch_of_every_image_once() -> None:
    sizes = draw_sizes(8, seed=2)
    assert all(112 <= h <= 224 and 112 <= w <= 224 and h % 16 == w % 16 == 0 for h, w in sizes)
    images = [torch.randn(3, h, w) for h, w in sizes]
    padded, packed = ragged_batch(images, packed=False), ragged_batch(images, packed=True)
    assert packed.patches.shape[0] < padded.patches.shape[0] == 8  # fewer rows than images
    for batch in (padded, packed):
        for i, image in enumerate(images):
            rows, cols = (batch.image == i).nonzero(as_tuple=True)
            patches, cells = patchify(image)
            assert torch.equal(batch.patches[rows, cols], patches) and torch.equal(batch.coords[rows, cols], cells)
    conv = torch.nn.Conv2d(3, 8, 16, stride=16)  # the pixel patches in a Conv2d weight's order
    expected = conv(images[0][None]).flatten(2).transpose(1, 2)[0]
    got = torch.nn.functional.linear(patchify(images[0])[0], conv.weight.flatten(1), conv.bias)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
