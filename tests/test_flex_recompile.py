"""FlexAttention compiles once for every input size: a model used at many sizes, dense or ragged (NaFlex
batches change their set of image sizes almost every batch), stays on the compiled kernel.

Each test compiles at one size, then runs 9 more sizes (more than torch._dynamo's cache limit of 8) under
``error_on_recompile``, each compared with the SDPA path of the same model. A size captured by a score_mod
as a Python value (the grid, a table length, a log-n scale) is a guard and fails these tests with a recompile
error. The guards are torch._dynamo's, the same for every backend: the tests run the GPU path (sizes marked
dynamic) on CPU through the ``aot_eager`` backend, since torch 2.14's CPU kernel keeps sizes static
(``vispos.attention``)."""

from __future__ import annotations

import pytest
import timm
import torch
import torch._dynamo

import vispos

BIASES = vispos.list_encodings(ndim=2, kind="bias")
GRIDS = [(4, 4), (6, 3), (5, 7), (8, 8), (3, 9), (10, 2), (7, 7), (9, 5), (4, 11), (12, 3)]  # 10 sizes, 16 px


@pytest.fixture(autouse=True)
def _dynamic_sizes(monkeypatch: pytest.MonkeyPatch):
    """The path GPUs take, on CPU: sizes marked dynamic, compiled by a backend that runs on CPU."""
    from torch.nn.attention.flex_attention import flex_attention

    torch.compiler.reset()
    monkeypatch.setattr(vispos.attention, "_STATIC_SIZE_DEVICES", set())
    monkeypatch.setattr(vispos.attention, "_compiled_flex", torch.compile(flex_attention, backend="aot_eager"))
    yield
    torch.compiler.reset()


def trained_scale(net: torch.nn.Module) -> torch.nn.Module:
    """Positional parameters and attention off their initialisation, so that a wrong bias shows."""
    torch.manual_seed(0)
    with torch.no_grad():
        for param in net.vispos.parameters():
            param.normal_(std=0.5)
        for name, param in net.named_parameters():
            if name.endswith("gamma"):
                param.fill_(1.0)
            if name.endswith("attn.qkv.weight"):
                param.mul_(4.0)
    return net.eval()


def pair(make) -> tuple[torch.nn.Module, torch.nn.Module]:  # noqa: ANN001
    """The same patched model twice: one attending through SDPA, one through FlexAttention."""
    sdpa_net, flex_net = trained_scale(make()), trained_scale(make())
    vispos.configure(sdpa_net, log_n_attention=True)
    vispos.configure(flex_net, attention="flex", log_n_attention=True)
    return sdpa_net, flex_net


@pytest.mark.parametrize("scheme", BIASES)
def test_flex_on_dense_grids_compiles_once_for_ten_sizes(scheme: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def make() -> torch.nn.Module:
        torch.manual_seed(0)  # cls + distillation token: prefix rows take the scheme's prefix entries
        net = timm.create_model("deit_tiny_distilled_patch16_224", img_size=64, depth=2, num_classes=3)
        return vispos.patch(net, scheme)

    sdpa_net, flex_net = pair(make)
    calls = []
    kernel = vispos.attention.flex_bias_attention
    monkeypatch.setattr("vispos.timm.attention.flex_bias_attention", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    g = torch.Generator().manual_seed(3)
    inputs = [torch.randn(2, 3, 16 * h, 16 * w, generator=g) for h, w in GRIDS]
    with torch.no_grad():
        torch.testing.assert_close(flex_net(inputs[0]), sdpa_net(inputs[0]), rtol=1e-4, atol=1e-5)  # compiles
        with torch._dynamo.config.patch(error_on_recompile=True):
            for x in inputs[1:]:
                torch.testing.assert_close(flex_net(x), sdpa_net(x), rtol=1e-4, atol=1e-5)
    assert len(calls) == len(GRIDS) * len(flex_net.blocks)  # every layer of every size went through flex


@pytest.mark.parametrize("scheme", BIASES)
def test_flex_on_naflex_batches_compiles_once_for_ten_sets_of_sizes(scheme: str) -> None:
    from timm.data.naflex_dataset import NaFlexCollator
    from timm.data.naflex_transforms import patchify_image

    from vispos.timm.naflex import patch_naflex

    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        net = timm.create_model("naflexvit_base_patch16_gap", img_size=64, embed_dim=64, num_heads=2, depth=2,
                                num_classes=0)  # fmt: skip
        return patch_naflex(net, scheme)

    sdpa_net, flex_net = pair(make)
    g = torch.Generator().manual_seed(4)
    batches = []
    for i in range(len(GRIDS)):  # two images a batch, each pair of grids different from every other batch's
        samples = []
        for h, w in (GRIDS[i], GRIDS[(i + 3) % len(GRIDS)]):
            patches, coord, valid = patchify_image(torch.randn(3, 16 * h, 16 * w, generator=g), (16, 16))
            samples.append(({"patches": patches, "patch_coord": coord, "patch_valid": valid}, 0))
        batches.append(NaFlexCollator(max_seq_len=64 + 16 * (i % 3))(samples)[0])  # padded lengths vary too

    def features(net: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        out = net.forward_features(batch["patches"], batch["patch_coord"], batch["patch_valid"])["patches"]
        p = net.num_prefix_tokens
        return out[torch.cat((torch.ones(out.shape[0], p, dtype=torch.bool), batch["patch_valid"]), dim=1)]

    with torch.no_grad():
        torch.testing.assert_close(features(flex_net, batches[0]), features(sdpa_net, batches[0]), rtol=1e-4, atol=1e-5)
        with torch._dynamo.config.patch(error_on_recompile=True):
            for batch in batches[1:]:
                torch.testing.assert_close(features(flex_net, batch), features(sdpa_net, batch), rtol=1e-4, atol=1e-5)
