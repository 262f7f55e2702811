"""Export paths of a patched Swin / Swin V2 (vispos/timm/swin.py): torch.export with dynamic height and width,
and ONNX (dynamo) run in onnxruntime, against the eager model at sizes other than the traced one.

Legal sizes: a patch-4 Swin with windows of 4 over two stages sees H/4 x W/4 tokens in stage 1 and H/8 x W/8
in stage 2; both must tile into 4 x 4 windows, so height and width are multiples of 4 * 4 * 2 = 32. Sizes stay
at 64 or more so that stage 2 (8 x 8 tokens or more) holds more than one window and the shifted blocks shift."""

from __future__ import annotations

import pytest
import timm
import torch
from torch.export import Dim

import vispos

pytestmark = pytest.mark.slow  # torch.export and ONNX at dynamic sizes: make test-slow (a CI step), not make test

V1, V2 = "swin_tiny_patch4_window7_224", "swinv2_tiny_window8_256"
# One case per path through the model: the inherited table bias, a rotation (rope2d_mixed: the window rotation
# rope2d shares, with learned frequencies), an additive table after the patch embedding, the continuous bias.
CASES = [(V1, "relbias2d"), (V1, "rope2d_mixed"), (V1, "learned2d"), (V2, "cpb2d")]  # V1/V2: inherited
IDS = ["swin-relbias2d", "swin-rope2d_mixed", "swin-learned2d", "swinv2-cpb2d"]
TRACED = (2, 3, 64, 96)
# Multiples of 32, none the traced size. Batch 1 is left out: the exported Swin guards on a batch of windows
# other than one image's (a guard equivalent to batch != 1, found here and not yet traced to its line).
SIZES = [(2, 3, 128, 64), (3, 3, 96, 96), (2, 3, 64, 160)]
# ONNX for one case of each kind of positions (a table bias, a rotation, the continuous bias): each ONNX export
# takes half a minute on two cores, and torch.export above already covers every case.
ONNX_IDS = ["swin-relbias2d", "swin-rope2d_mixed", "swinv2-cpb2d"]
ONNX = [CASES[IDS.index(id_)] for id_ in ONNX_IDS]


def model(name: str, scheme: str) -> torch.nn.Module:
    """A tiny two-stage Swin, patched; every position parameter (relative tables, cpb MLP, logit scales,
    vispos tables) moved off its init, and Swin V2's zero-initialised res-post-norms set to 1."""
    torch.manual_seed(0)
    m = timm.create_model(name, pretrained=False, img_size=64, window_size=4, embed_dim=32, depths=(2, 2),
                          num_heads=(2, 4), num_classes=3, drop_path_rate=0.0)  # fmt: skip
    m = vispos.patch(m, scheme).eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if ".norm1.weight" in n or ".norm2.weight" in n:
                p.fill_(1.0)
            elif "vispos" in n or "relative_position" in n or "logit_scale" in n or "cpb_mlp" in n:
                p.add_(torch.randn_like(p) * 0.5)
    return m


def dynamic() -> dict[str, dict[int, object]]:
    """Batch, height and width dynamic; heights and widths multiples of 32 (see the module docstring)."""
    return {"x": {0: Dim("b", min=2, max=64), 2: 32 * Dim("h", min=2, max=16), 3: 32 * Dim("w", min=2, max=16)}}


@pytest.mark.parametrize(("name", "scheme"), CASES, ids=IDS)
def test_torch_export_with_dynamic_sizes_matches_eager_at_other_sizes(name: str, scheme: str) -> None:
    m = model(name, scheme)
    program = torch.export.export(m, (torch.randn(*TRACED),), dynamic_shapes=dynamic()).module()
    with torch.no_grad():
        for size in SIZES:
            x = torch.randn(*size)
            torch.testing.assert_close(program(x), m(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("name", "scheme"), ONNX, ids=ONNX_IDS)
def test_onnx_export_runs_in_onnxruntime_at_other_sizes(name: str, scheme: str, tmp_path) -> None:  # noqa: ANN001
    pytest.importorskip("onnxscript")
    ort = pytest.importorskip("onnxruntime")
    m = model(name, scheme)
    program = torch.onnx.export(m, (torch.randn(*TRACED),), dynamo=True, dynamic_shapes=dynamic(), verbose=False)
    program.save(str(tmp_path / "model.onnx"))
    session = ort.InferenceSession(str(tmp_path / "model.onnx"))
    with torch.no_grad():
        for size in SIZES:
            x = torch.randn(*size)
            (out,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
            torch.testing.assert_close(torch.from_numpy(out), m(x), rtol=1e-4, atol=1e-5)
