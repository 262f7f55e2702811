"""torch.compile on patched models: whole-graph capture, no recompiles at a fixed size, same numbers."""

from __future__ import annotations

import pytest
import timm
import torch
import torch._dynamo

import vispos


def tiny(scheme: str) -> torch.nn.Module:
    model = timm.create_model("vit_tiny_patch16_224", img_size=64, depth=2, num_classes=5)
    return vispos.patch(model, scheme)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch.compiler.reset()
    yield
    torch.compiler.reset()


@pytest.mark.parametrize("scheme", vispos.list_encodings(ndim=2))
def test_compiles_as_one_graph_without_recompiling_at_a_fixed_size(scheme: str) -> None:
    model = tiny(scheme).eval()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    x = torch.randn(2, 3, 64, 96)
    torch.testing.assert_close(compiled(x), model(x))
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(2):
            compiled(torch.randn(2, 3, 64, 96))


def test_inductor_training_step_matches_eager() -> None:
    model = tiny("rope2d").train()
    compiled = torch.compile(model)
    x = torch.randn(2, 3, 64, 64)
    out = compiled(x)
    torch.testing.assert_close(out, model(x), atol=1e-4, rtol=1e-4)
    out.sum().backward()
    assert all(p.grad is not None for p in model.blocks[0].attn.qkv.parameters())
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled(torch.randn(2, 3, 64, 64)).sum().backward()


@pytest.mark.parametrize("scheme", vispos.list_encodings(ndim=2))
def test_patch_dropout_compiles_as_one_graph_without_recompiling_per_batch(scheme: str) -> None:
    """Training with patch dropout: each batch keeps another random half of the tokens (a fixed count), and
    the positions gathered at the kept tokens neither break the graph nor recompile."""
    model = vispos.patch(timm.create_model("vit_tiny_patch16_224", img_size=64, depth=2, num_classes=5,
                                           patch_drop_rate=0.5), scheme).train()  # fmt: skip
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    compiled(torch.randn(2, 3, 64, 64)).sum().backward()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(2):
            compiled(torch.randn(2, 3, 64, 64)).sum().backward()



def test_learned_block_rotations_run_under_inductor() -> None:
    """comrope2d's matrix exponential under inductor: the exponent goes to ``matrix_exp`` as one stack of
    matrices, whatever layout inductor gives the einsum's result (a token-major 5-D exponent made the compiled
    forward fail with "view size is not compatible" inside the generated code)."""
    model = vispos.create_model("vit_tiny_patch16_224", pos="comrope2d", img_size=32, depth=1, num_classes=5).eval()
    compiled = torch.compile(model, fullgraph=True)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)
