"""FlexAttention stays on its compiled kernel at every input size: no size reaches it as a Python number.

``configure(attention="flex")`` runs one compiled FlexAttention (``vispos.attention._compiled_flex``) for
every layer. Dynamo guards on every Python number a compiled call captures, so a grid or a ragged batch's
size set captured as a number would compile again for each new one and, past ``recompile_limit`` (8),
run the uncompiled kernel, which materialises the scores. The tests warm up (compiles allowed: see each),
then run at least 9 new sizes or size sets with ``error_on_recompile``: any further compile fails them.
Each output is checked against the SDPA path of the same weights."""

from __future__ import annotations

import warnings

import pytest
import timm
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import vispos
from vispos.attention import FlexBias, flex_bias_attention

# Compiles a warm-up may make: the kernel is compiled with dynamic shapes, so one compile serves every
# size of a dimension above 1; the second allows for torch's size-1 specialisation of a dimension (the
# other warm-up shape differs in every size-dependent dimension, so whatever is compiled after it is
# general).
WARM_UP_COMPILES = 2


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch.compiler.reset()
    counters.clear()
    yield
    torch.compiler.reset()


def model(prefix: bool, scheme: str = "relbias2d") -> torch.nn.Module:
    torch.manual_seed(0)
    tokens = {"reg_tokens": 1} if prefix else {"class_token": False, "global_pool": "avg"}
    net = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, num_heads=2, depth=1,
                            num_classes=0, **tokens)  # fmt: skip
    net = vispos.patch(net, scheme, inherit=False)
    with torch.no_grad():
        for p in net.vispos.parameters():  # off their init: a wrong offset shows
            p.normal_(std=0.5)
    return net.eval()


def compiles() -> int:
    return counters["frames"]["ok"]


def test_dense_flex_compiles_once_for_every_grid_size() -> None:
    """Nine new grid sizes after the warm-up: no compile (the grid is read from the per-offset table's
    shape inside the score_mod, log-n's scale multiplies q), and the SDPA path's outputs."""
    flex_net, sdpa_net = model(prefix=True), model(prefix=True)
    vispos.configure(flex_net, attention="flex", log_n_attention=True)
    vispos.configure(sdpa_net, log_n_attention=True)
    warm, sizes = [(16, 24), (40, 32)], [(24, 24), (32, 48), (48, 16), (56, 40), (8, 64), (64, 64), (40, 8),
                                         (72, 24), (16, 80)]  # fmt: skip

    def check(size: tuple[int, int]) -> None:
        x = torch.randn(2, 3, *size)
        torch.testing.assert_close(flex_net(x), sdpa_net(x), rtol=1e-4, atol=1e-5)

    with torch.no_grad():
        for size in warm:
            check(size)
        assert 1 <= compiles() <= WARM_UP_COMPILES
        with torch._dynamo.config.patch(error_on_recompile=True):
            for size in sizes:
                check(size)


def ragged_batch(g: torch.Generator, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``rows`` images of random grid sizes, one per row, padded (the longest row too, by 1 token):
    coords [B, N, 2], sizes [B, 2], valid [B, N]."""
    sizes = torch.randint(1, 7, (rows, 2), generator=g)
    n = int((sizes[:, 0] * sizes[:, 1]).max()) + 1
    coords, valid = torch.zeros(rows, n, 2, dtype=torch.long), torch.zeros(rows, n, dtype=torch.bool)
    for r, (h, w) in enumerate(sizes.tolist()):
        cells = torch.cartesian_prod(torch.arange(h), torch.arange(w))
        cells = cells[torch.randperm(h * w, generator=g)]
        coords[r, : h * w], valid[r, : h * w] = cells, True
    return coords, sizes, valid


def ragged_forward(net: torch.nn.Module, tokens: torch.Tensor, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    coords, sizes, valid = batch
    ctx = net.vispos.ragged_context(coords, sizes, valid=valid)
    p = net.num_prefix_tokens
    x = torch.cat((net.reg_token.expand(tokens.shape[0], -1, -1), tokens), dim=1)
    for blk in net.blocks:
        x = blk(x, attn_mask=ctx)
    return torch.where(torch.cat((torch.ones_like(valid[:, :p]), valid), dim=1)[..., None], x, 0.0)


def test_ragged_flex_compiles_once_for_every_set_of_image_sizes() -> None:
    """Nine ragged batches with new size sets (and new lengths) after the warm-up: no compile (the size set
    travels in tensors, the offset table's length is read as a dynamic shape), and the SDPA path's outputs."""
    flex_net, sdpa_net = model(prefix=True), model(prefix=True)
    vispos.configure(flex_net, attention="flex", log_n_attention=True)
    vispos.configure(sdpa_net, log_n_attention=True)
    g = torch.Generator().manual_seed(0)
    seen: set[tuple[tuple[int, int], ...]] = set()

    def check(rows: int) -> None:
        batch = ragged_batch(g, rows)
        seen.add(tuple(sorted(map(tuple, batch[1].tolist()))))
        tokens = torch.randn(rows, batch[0].shape[1], 32, generator=g)
        with torch.no_grad():
            torch.testing.assert_close(
                ragged_forward(flex_net, tokens, batch), ragged_forward(sdpa_net, tokens, batch), rtol=1e-4, atol=1e-5
            )

    for rows in (2, 3):
        check(rows)
    assert 1 <= compiles() <= WARM_UP_COMPILES
    with torch._dynamo.config.patch(error_on_recompile=True):
        for i in range(9):
            check(2 + i % 3)
    assert len(seen) >= 9  # new size sets, not the same batch again


def test_flex_falling_off_the_compiled_kernel_warns() -> None:
    """Past dynamo's recompile limit the kernel runs uncompiled (materialising the scores): a warning says so
    (not only a log line), and the outputs stay right."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 16, 8, generator=g) for _ in range(3))

    def plus(c: float):  # noqa: ANN202  (score_mods of different code: each compiles on its own)
        if c > 0:
            return lambda score, b, h, qi, ki: score + c
        return lambda score, b, h, qi, ki: score * 1.0

    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=1), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        flex_bias_attention(q, k, v, FlexBias(plus(0.0)), scale=0.5)
        out = flex_bias_attention(q, k, v, FlexBias(plus(1.0)), scale=0.5)  # a second compile: over the limit
    said = [str(w.message) for w in seen if "uncompiled" in str(w.message)]
    assert said and "recompile_limit" in said[0], [str(w.message) for w in seen]
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.5))
