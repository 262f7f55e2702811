"""Ragged batches through FlexAttention: every layer attends without a dense mask and equals the SDPA
path; a caller's mask, fractional points or gradients fall back to SDPA."""

from __future__ import annotations

import pytest
import torch
from ragged_refs import (
    PACKED,
    SIZES,
    make,
    orders,
    ragged_features,
)

import vispos


@pytest.mark.parametrize("scheme", vispos.list_encodings(2, kind="bias"))
@pytest.mark.parametrize("rows", [[[i] for i in range(len(SIZES))], PACKED], ids=["padded", "packed"])
def test_a_ragged_batch_attends_through_flex_attention_without_a_dense_mask(
    scheme: str, rows: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With FlexAttention configured, every layer of a ragged batch (padded with prefix tokens, or packed)
    attends through it: a score_mod computes each pair's offset index from the cells, a block mask hides
    padding and other images; the outputs equal the SDPA path's (log-n scaling on, per token), and neither
    the [B, T, T] offset index nor the dense structure mask is built."""
    from vispos.ragged import RaggedLayout

    packed = len(rows[0]) > 1
    sdpa_net, flex_net = make(scheme, prefix=not packed), make(scheme, prefix=not packed)
    vispos.configure(sdpa_net, log_n_attention=True)
    vispos.configure(flex_net, attention="flex", log_n_attention=True)
    with torch.no_grad():
        expected, image, _ = ragged_features(sdpa_net, rows, orders(sdpa_net))
    calls = {"flex": 0, "index": 0, "structure": 0}

    def spy(name: str, fn):  # noqa: ANN001, ANN202
        return lambda *a, **k: calls.__setitem__(name, calls[name] + 1) or fn(*a, **k)

    monkeypatch.setattr("vispos.timm.attention.flex_bias_attention", spy("flex", vispos.attention.flex_bias_attention))
    monkeypatch.setattr(RaggedLayout, "offset_index", spy("index", RaggedLayout.offset_index))
    monkeypatch.setattr(RaggedLayout, "structure_mask", spy("structure", RaggedLayout.structure_mask))
    with torch.no_grad():
        got = ragged_features(flex_net, rows, orders(flex_net))[0]
    p = flex_net.num_prefix_tokens
    valid = torch.cat((torch.ones(image.shape[0], p, dtype=torch.bool), image >= 0), dim=1)
    torch.testing.assert_close(got[valid], expected[valid], rtol=1e-5, atol=1e-5)
    assert calls == {"flex": len(flex_net.blocks), "index": 0, "structure": 0}


def test_ragged_flex_falls_back_to_sdpa_with_a_callers_mask_fractional_points_or_gradients() -> None:
    net = make("relbias2d", prefix=True)
    vispos.configure(net, attention="flex")
    coords, valid = torch.zeros(1, 2, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.bool)
    sizes = torch.tensor([[1, 1]])
    assert net.vispos.ragged_context(coords, sizes, valid=valid).flex(0) is not None
    mask = torch.ones(1, 1, 5, 5, dtype=torch.bool)
    assert net.vispos.ragged_context(coords, sizes, valid=valid, user_mask=mask).flex(0) is None
    cpb = make("cpb2d", prefix=False)
    vispos.configure(cpb, attention="flex")
    points = torch.tensor([[[0.5, 0.0], [1.0, 0.25]]])
    assert cpb.vispos.ragged_context(points, torch.tensor([[2, 2]])).flex(0) is None
    # a CPU training step (FlexAttention has no CPU backward) runs SDPA, the same as without flex
    reference = make("relbias2d", prefix=True)
    rows = [[i] for i in range(len(SIZES))]
    got = ragged_features(net.train(), rows, orders(net))[0]
    expected = ragged_features(reference.train(), rows, orders(reference))[0]
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
