"""Export paths of a patched model: torch.export with dynamic sizes, ONNX (dynamo), jit.trace, torch.fx."""

from __future__ import annotations

import pytest
import timm
import torch
from torch.export import Dim

import vispos

pytestmark = pytest.mark.slow  # torch.export and ONNX at dynamic sizes: make test-slow (a CI step), not make test

SCHEMES = [*vispos.list_encodings(ndim=2), ["learned2d", "rope2d"]]
IDS = ["+".join(s) if isinstance(s, list) else s for s in SCHEMES]
SIZES = [(1, 3, 128, 48), (3, 3, 64, 96), (2, 3, 32, 160)]  # none of them the traced size


def model(scheme: str | list[str]) -> torch.nn.Module:
    torch.manual_seed(0)
    m = timm.create_model("deit_tiny_distilled_patch16_224", img_size=64, depth=2, num_classes=3)  # cls + dist
    m = vispos.patch(m, scheme).eval()
    with torch.no_grad():
        for p in m.vispos.parameters():  # off their init: prefix entries and tables all matter
            p.add_(torch.randn_like(p) * 0.5)
    return m


def dynamic() -> dict[str, dict[int, object]]:
    """Batch, height and width dynamic; heights and widths multiples of the patch size."""
    return {"x": {0: Dim("b", min=1, max=64), 2: 16 * Dim("h", min=2, max=32), 3: 16 * Dim("w", min=2, max=32)}}


@pytest.mark.parametrize("scheme", SCHEMES, ids=IDS)
def test_torch_export_with_dynamic_sizes_matches_eager_at_other_sizes(scheme: str | list[str]) -> None:
    m = model(scheme)
    program = torch.export.export(m, (torch.randn(2, 3, 64, 96),), dynamic_shapes=dynamic()).module()
    with torch.no_grad():
        for size in SIZES:
            x = torch.randn(*size)
            torch.testing.assert_close(program(x), m(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scheme", ["rope2d", "relbias2d", "learned2d", "decomposed2d"])
def test_onnx_export_runs_in_onnxruntime_at_other_sizes(scheme: str, tmp_path) -> None:  # noqa: ANN001
    pytest.importorskip("onnxscript")
    ort = pytest.importorskip("onnxruntime")
    m = model(scheme)
    program = torch.onnx.export(m, (torch.randn(2, 3, 64, 96),), dynamo=True, dynamic_shapes=dynamic(), verbose=False)
    program.save(str(tmp_path / "model.onnx"))
    session = ort.InferenceSession(str(tmp_path / "model.onnx"))
    with torch.no_grad():
        for size in SIZES:
            x = torch.randn(*size)
            (out,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
            torch.testing.assert_close(torch.from_numpy(out), m(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("scheme", SCHEMES, ids=IDS)
def test_jit_trace_at_a_fixed_size_matches_eager(scheme: str | list[str]) -> None:
    m = model(scheme)
    with torch.no_grad():
        traced = torch.jit.trace(m, torch.randn(2, 3, 64, 96), check_trace=False)
        x = torch.randn(2, 3, 64, 96)  # new content at the traced size
        torch.testing.assert_close(traced(x), m(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scheme", SCHEMES, ids=IDS)
def test_fx_feature_extraction_returns_the_blocks_outputs(scheme: str | list[str]) -> None:
    """timm's FX feature extractor (and torchvision's node listing) trace a patched model; the graph
    holds at sizes other than the traced one, and its features are the blocks' eager outputs."""
    from timm.models import create_feature_extractor
    from torchvision.models.feature_extraction import get_graph_node_names

    m = model(scheme)
    eval_nodes = get_graph_node_names(m)[1]
    assert "blocks.1.attn.positioned_attention" in eval_nodes and "head" in eval_nodes
    extractor = create_feature_extractor(m, return_nodes={"blocks.0": "first", "blocks.1": "last"})
    caught: dict[int, torch.Tensor] = {}
    hooks = [b.register_forward_hook(lambda _m, _a, y, i=i: caught.__setitem__(i, y)) for i, b in enumerate(m.blocks)]
    with torch.no_grad():
        for size in SIZES:
            x = torch.randn(*size)
            features = extractor(x)
            m(x)
            torch.testing.assert_close(features["first"], caught[0], rtol=0, atol=0)
            torch.testing.assert_close(features["last"], caught[1], rtol=0, atol=0)
    for h in hooks:
        h.remove()
