"""Every scheme keeps SDPA's fused CPU kernel: bias masks go in 4-D, never 3-D (which means the math path)."""

from __future__ import annotations

import pytest
import timm
import torch
import torch.nn.functional as F

import vispos
from vispos.diagnostics.kernels import sdpa_kernels
from vispos.layers import Attention


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
    learned_mask = any(vispos.get_info(n, 2).kind == "bias" and vispos.get_info(n, 2).trainable for n in names)
    # PyTorch's fused CPU kernel has no gradient for the mask: a mask that trains takes the math path
    assert sdpa_kernels(run) == ({"math"} if training and learned_mask else {"flash (CPU)"})


@pytest.mark.parametrize("pos", ["alibi", "t5", "rope", "xpos", "nope"])
@pytest.mark.parametrize("causal", [False, True])
def test_sequence_layers_reach_the_fused_cpu_kernel(pos: str, causal: bool) -> None:
    layer = Attention(48, 4, pos=pos, causal=causal)
    x = torch.randn(2, 20, 48)
    with torch.inference_mode():
        assert sdpa_kernels(lambda: layer(x)) == {"flash (CPU)"}
