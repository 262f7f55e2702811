"""The FlexAttention path of the 2D relative biases equals the SDPA path, without a [heads, N, N] mask."""

from __future__ import annotations

import pytest
import timm
import torch
import torch._dynamo

import vispos
from vispos.positions import Positions

BIASES = vispos.list_encodings(ndim=2, kind="bias")


def model(scheme: str, **options: object) -> torch.nn.Module:
    torch.manual_seed(0)
    m = timm.create_model("deit_tiny_distilled_patch16_224", img_size=64, depth=2, num_classes=3)  # cls + dist
    m = vispos.patch(m, scheme, **options)
    with torch.no_grad():
        for p in m.vispos.parameters():  # tables, MLPs and prefix entries all off their init
            p.add_(torch.randn_like(p) * 0.5)
    return m


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch.compiler.reset()
    yield
    torch.compiler.reset()


@pytest.mark.parametrize("scheme", BIASES)
def test_flex_equals_sdpa_in_inference(scheme: str, monkeypatch: pytest.MonkeyPatch) -> None:
    sdpa_model, flex_model = model(scheme).eval(), model(scheme).eval()
    vispos.configure(flex_model, attention="flex", log_n_attention=True)
    vispos.configure(sdpa_model, log_n_attention=True)
    calls = []
    kernel = vispos.attention.flex_bias_attention
    monkeypatch.setattr("vispos.timm.attention.flex_bias_attention", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    with torch.no_grad():
        for size in ((64, 64), (96, 48)):  # the training grid and another one
            x = torch.randn(2, 3, *size)
            torch.testing.assert_close(flex_model(x), sdpa_model(x), rtol=1e-4, atol=1e-5)
    assert len(calls) == 2 * 2  # both layers, both sizes went through FlexAttention


def test_cpu_training_with_flex_set_falls_back_to_sdpa() -> None:
    """FlexAttention has no backward on CPU (torch 2.14): a training step there uses SDPA, same gradients."""
    sdpa_model, flex_model = model("relbias2d"), model("relbias2d")
    vispos.configure(flex_model, attention="flex")
    x = torch.randn(2, 3, 64, 64)
    flex_model(x).sum().backward()
    sdpa_model(x).sum().backward()
    for p, q in zip(flex_model.vispos.parameters(), sdpa_model.vispos.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


@pytest.mark.parametrize("scheme", BIASES)
def test_flex_runs_every_layer_and_builds_no_dense_mask(scheme: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Spies on the three places a layer could take: FlexAttention (every layer), SDPA (none) and the
    method that builds a layer's [heads, N, N] bias mask for SDPA (never called)."""
    m = model(scheme).eval()
    vispos.configure(m, attention="flex")
    calls: dict[str, int] = {"flex": 0, "sdpa": 0, "mask": 0}

    def spy(name: str, fn):  # noqa: ANN001, ANN202
        return lambda *a, **k: calls.__setitem__(name, calls[name] + 1) or fn(*a, **k)

    monkeypatch.setattr("vispos.timm.attention.flex_bias_attention", spy("flex", vispos.attention.flex_bias_attention))
    monkeypatch.setattr("vispos.timm.attention.sdpa", spy("sdpa", vispos.attention.sdpa))
    monkeypatch.setattr(Positions, "_prefixed", spy("mask", Positions._prefixed))
    with torch.no_grad():
        assert m(torch.randn(1, 3, 64, 64)).isfinite().all()
    assert calls == {"flex": len(m.blocks), "sdpa": 0, "mask": 0}
    assert m.vispos_cfg["attention"] == "flex"


def test_flex_setting_is_saved_and_refused_where_it_does_not_apply() -> None:
    m = model("cpb2d")
    vispos.configure(m, attention="flex")
    fresh = model("cpb2d")
    fresh.load_state_dict(m.state_dict())
    assert fresh.vispos.attention_backend == "flex"
    with pytest.raises(ValueError, match=rf"attention='flex' applies to the 2D biases \({', '.join(BIASES)}\)"):
        vispos.configure(model("rope2d"), attention="flex")
    with pytest.raises(ValueError, match=r"unknown attention 'fused'; accepted: sdpa, flex"):
        vispos.configure(m, attention="fused")
