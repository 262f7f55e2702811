"""Every scheme keeps SDPA's fused CPU kernel: bias masks go in 4-D, never 3-D (which means the math path)."""

from __future__ import annotations

import weakref

import pytest
import timm
import torch
import torch.nn.functional as F

import vispos
from vispos.diagnostics.kernels import sdpa_kernels
from vispos.layers import Attention
from vispos.positions import Positions


def test_the_probe_sees_the_math_path_of_a_3d_mask() -> None:
    q = torch.randn(2, 3, 17, 16)
    assert sdpa_kernels(lambda: F.scaled_dot_product_attention(q, q, q, attn_mask=torch.randn(3, 17, 17))) == {"math"}
    four_d = torch.randn(1, 3, 17, 17)
    assert sdpa_kernels(lambda: F.scaled_dot_product_attention(q, q, q, attn_mask=four_d)) == {"flash (CPU)"}


@pytest.mark.parametrize("scheme", [*vispos.list_encodings(ndim=2), ["learned2d", "relbias2d"]])
@pytest.mark.parametrize("training", [False, True])
def test_patched_models_reach_the_fused_cpu_kernel(scheme: str | list[str], training: bool) -> None:
    model = timm.create_model("deit_tiny_distilled_patch16_224", img_size=64, depth=2, num_classes=3)
    model = vispos.patch(model, scheme).train(training)
    x = torch.randn(2, 3, 64, 96)

    def run() -> None:
        if training:
            model(x).sum().backward()
        else:
            with torch.inference_mode():
                model(x)

    names = [scheme] if isinstance(scheme, str) else scheme
    trained = ("bias", "query_bias")
    learned_mask = any(vispos.get_info(n, 2).kind in trained and vispos.get_info(n, 2).trainable for n in names)
    # PyTorch's fused CPU kernel has no gradient for the mask: a mask that trains takes the math path
    assert sdpa_kernels(run) == ({"math"} if training and learned_mask else {"flash (CPU)"})


@pytest.mark.parametrize("pos", ["alibi", "t5", "rope", "xpos", "nope"])
@pytest.mark.parametrize("causal", [False, True])
def test_sequence_layers_reach_the_fused_cpu_kernel(pos: str, causal: bool) -> None:
    layer = Attention(48, 4, pos=pos, causal=causal)
    x = torch.randn(2, 20, 48)
    with torch.inference_mode():
        assert sdpa_kernels(lambda: layer(x)) == {"flash (CPU)"}


# --- the bias mask gathered in one step ----------------------------------------------------------------
@pytest.mark.parametrize("scheme", ["relbias2d", "cpb2d", "alibi2d"])
@pytest.mark.parametrize("grid", [(3, 5), (4, 4)])
def test_one_gather_builds_the_same_mask_as_the_per_token_pairs(scheme: str, grid: tuple[int, int]) -> None:
    """Mask [1, heads, P + HW, P + HW] from the per-offset values and the prefix entries in one gather,
    against a mask written pair by pair from the offset and BEiT's three entries."""
    model = vispos.patch(timm.create_model("deit_tiny_distilled_patch16_224", img_size=64, depth=1), scheme)
    module = model.vispos.attention[0] if model.vispos.attention_kind == "bias" and isinstance(
        model.vispos.attention, torch.nn.ModuleList) else model.vispos.attention  # fmt: skip
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p))
    _, mask = model.vispos.context(grid, torch.device("cpu")).layer(0)
    per_offset = module.offset_bias(grid)  # [heads, 2H-1, 2W-1]
    entries = getattr(module, "prefix_bias", None)  # [3, heads] or None (zero)
    h, w = grid
    prefix = model.num_prefix_tokens
    n = prefix + h * w
    expected = torch.zeros(per_offset.shape[0], n, n)
    for i in range(n):
        for j in range(n):
            if i >= prefix and j >= prefix:
                (yi, xi), (yj, xj) = divmod(i - prefix, w), divmod(j - prefix, w)
                expected[:, i, j] = per_offset[:, yi - yj + h - 1, xi - xj + w - 1]
            elif entries is not None:
                expected[:, i, j] = entries[2 if i < prefix and j < prefix else 0 if i < prefix else 1]
    assert mask.shape == (1, *expected.shape)
    torch.testing.assert_close(mask[0], expected, atol=0, rtol=0)


@pytest.mark.parametrize("scheme", vispos.list_encodings(ndim=2, kind="bias"))
def test_inference_holds_at_most_one_layers_bias_mask_at_a_time(scheme: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every mask ``Positions._prefixed`` builds is watched through a weak reference: when a layer's mask is
    built, no earlier layer's mask may still be alive (a scheme shared by all layers builds one mask)."""
    model = timm.create_model("deit_tiny_distilled_patch16_224", img_size=64, depth=4, num_classes=3)
    model = vispos.patch(model, scheme).eval()
    built, alive_at_build = [], []
    prefixed = Positions._prefixed

    def watched(self: Positions, *args: object) -> torch.Tensor:
        mask = prefixed(self, *args)
        alive_at_build.append(sum(ref() is not None for ref in built))  # earlier masks still held
        built.append(weakref.ref(mask))
        if mask._base is not None:  # a view: its base holds the memory
            built.append(weakref.ref(mask._base))
        return mask

    monkeypatch.setattr(Positions, "_prefixed", watched)
    with torch.no_grad():
        model(torch.randn(2, 3, 64, 96))
    per_layer = vispos.get_info(scheme, 2).per_layer
    assert len(alive_at_build) == (len(model.blocks) if per_layer else 1)
    assert max(alive_at_build) == 0, alive_at_build
