"""vispos.layers.Attention with every 1D scheme: fused = eager, causality, relative invariance, naive references."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import vispos
from vispos.layers import Attention

DIM, HEADS, N = 32, 4, 10
ATTENTION_SCHEMES = [n for n in vispos.list_encodings(ndim=1) if vispos.get_info(n, 1).kind != "additive"]
RELATIVE_SCHEMES = [n for n in ATTENTION_SCHEMES if vispos.get_info(n, 1).relative]


def make(pos: str, *, causal: bool = False, fused: bool = True, **options: object) -> Attention:
    torch.manual_seed(0)
    if pos in ("shaw",):
        options.setdefault("max_distance", 3)
        options.setdefault("init_std", 0.5)
    if pos == "t5":
        options.setdefault("num_buckets", 8)
        options.setdefault("max_distance", 16)
    module = Attention(DIM, HEADS, pos=pos, causal=causal, fused=fused, **options).eval()
    if pos == "t5":
        torch.nn.init.normal_(module.pos.embedding.weight)  # visible biases
    return module


def tokens(b: int = 2, n: int = N, seed: int = 1) -> torch.Tensor:
    return torch.randn(b, n, DIM, generator=torch.Generator().manual_seed(seed))


def test_every_non_additive_1d_scheme_is_an_attention_scheme() -> None:
    assert set(ATTENTION_SCHEMES) == {"alibi", "fire", "mrope", "nope", "rope", "ropend", "shaw", "t5", "xpos"}


@pytest.mark.parametrize("pos", ATTENTION_SCHEMES)
@pytest.mark.parametrize("causal", [False, True])
def test_fused_and_eager_attention_agree(pos: str, causal: bool) -> None:
    fused, eager = make(pos, causal=causal), make(pos, causal=causal, fused=False)
    eager.load_state_dict(fused.state_dict())
    x = tokens()
    keep = torch.ones(2, 1, 1, N, dtype=torch.bool)
    keep[1, ..., -3:] = False  # padding keys in the second sequence
    positions = torch.tensor([list(range(N)), list(range(5, 5 + N))])  # [B, N]
    if fused.position_axes > 1:  # several ids per token (mrope): [axes, B, N], different on each axis
        positions = torch.stack([positions.roll(i, dims=-1) for i in range(fused.position_axes)])
    with torch.no_grad():
        torch.testing.assert_close(fused(x), eager(x), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(fused(x, positions, keep), eager(x, positions, keep), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pos", ATTENTION_SCHEMES)
@pytest.mark.parametrize("fused", [True, False])
def test_causal_attention_never_looks_ahead(pos: str, fused: bool) -> None:
    module = make(pos, causal=True, fused=fused)
    x = tokens()
    t = 4
    changed = x.clone()
    changed[:, t + 1 :] = torch.randn(2, N - t - 1, DIM)
    with torch.no_grad():
        before, after = module(x), module(changed)
    torch.testing.assert_close(after[:, : t + 1], before[:, : t + 1], atol=1e-6, rtol=1e-6)
    assert (after[:, t + 1 :] - before[:, t + 1 :]).abs().max() > 1e-3


@pytest.mark.parametrize("pos", ["t5", "alibi"])
def test_bidirectional_bias_schemes_do_look_ahead(pos: str) -> None:
    module = make(pos)
    x = tokens()
    changed = x.clone()
    changed[:, -1] += 1.0
    with torch.no_grad():
        assert (module(changed)[:, 0] - module(x)[:, 0]).abs().max() > 1e-4


@pytest.mark.parametrize("pos", RELATIVE_SCHEMES)
@pytest.mark.parametrize("causal", [False, True])
def test_relative_schemes_ignore_a_common_position_shift(pos: str, causal: bool) -> None:
    module = make(pos, causal=causal)
    x = tokens()
    with torch.no_grad():
        base = module(x)
        shifted = module(x, torch.arange(N) + 50)
    torch.testing.assert_close(shifted, base, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("pos", ["rope", "alibi", "t5", "shaw"])
def test_per_sequence_positions_equal_separate_runs(pos: str) -> None:
    """Packed / offset sequences: positions [B, N] give each sequence the result it gets alone."""
    module = make(pos)
    x = tokens()
    positions = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [0, 2, 4, 6, 8, 10, 12, 14, 16, 18]])
    with torch.no_grad():
        batched = module(x, positions)
        alone = torch.cat([module(x[i : i + 1], positions[i]) for i in range(2)])
    torch.testing.assert_close(batched, alone, atol=1e-5, rtol=1e-5)


# --- xPos in half precision -----------------------------------------------------------------------------
def xpos_pair(qkv_gain: float = 1.0) -> tuple[Attention, torch.Tensor]:
    """A small causal xPos layer (2 heads of 8 channels) and 8192 tokens: fast on CPU, long enough for fp16."""
    torch.manual_seed(0)
    module = Attention(16, 2, pos="xpos", causal=True).eval()
    with torch.no_grad():
        module.qkv.weight.mul_(qkv_gain)
    return module, torch.randn(1, 8192, 16, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float16, 2e-3), (torch.bfloat16, 1e-2)])
def test_xpos_half_precision_attention_is_finite_and_equals_fp32_at_8192(dtype: torch.dtype, tol: float) -> None:
    """Issue 14: uncentred xPos keys overflowed fp16 past ~4094 tokens (NaN rows in the output)."""
    module, x = xpos_pair()
    half = copy.deepcopy(module).to(dtype)
    with torch.no_grad():
        ref, out = module(x), half(x.to(dtype))
    assert out.dtype == dtype and out.isfinite().all()
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("cast", ["module", "autocast"])
def test_xpos_keys_beyond_fp16_range_still_give_the_fp32_result(cast: str) -> None:
    """Larger keys: centred or not, the scaled keys overflow fp16 at 8192 tokens, while q.k does not; the
    layer keeps xPos in fp32 (also under autocast), so the output still equals the fp32 layer's."""
    module, x = xpos_pair(qkv_gain=6.0)
    with torch.no_grad():
        ref = module(x)
        half = copy.deepcopy(module).half()
        q, k, _ = half.qkv(x.half()).view(1, 8192, 3, 2, 8).permute(2, 0, 3, 1, 4)  # [1, heads, N, 8]
        assert not half.pos(8192).rotate(q, k)[1].isfinite().all()  # the premise: fp16 keys overflow
        if cast == "module":
            out = half(x.half())
        else:
            with torch.autocast("cpu", dtype=torch.float16):
                out = module(x)
    assert out.isfinite().all()
    assert (out.float() - ref).abs().max() < 1e-2 * ref.abs().max()


def heads_of(module: Attention, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b, n, _ = x.shape
    q, k, v = module.qkv(x).view(b, n, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
    return q, k, v


def finish(module: Attention, probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    b, _, n, _ = probs.shape
    return module.proj(values.transpose(1, 2).reshape(b, n, DIM))


@pytest.mark.parametrize("causal", [False, True])
def test_alibi_attention_equals_naive_reference(causal: bool) -> None:
    module = make("alibi", causal=causal)
    x = tokens()
    slopes = [2**-2, 2**-4, 2**-6, 2**-8]  # 4 heads
    with torch.no_grad():
        q, k, v = heads_of(module, x)
        logits = q @ k.transpose(-2, -1) / math.sqrt(DIM // HEADS)
        for h in range(HEADS):
            for i in range(N):
                for j in range(N):
                    logits[:, h, i, j] -= slopes[h] * abs(i - j)
                    if causal and j > i:
                        logits[:, h, i, j] = float("-inf")
        probs = logits.softmax(-1)
        torch.testing.assert_close(module(x), finish(module, probs, probs @ v), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_shaw_attention_equals_naive_reference(causal: bool) -> None:
    module = make("shaw", causal=causal)
    k_max, d = 3, DIM // HEADS
    x = tokens(n=8)
    n = 8
    with torch.no_grad():
        q, k, v = heads_of(module, x)
        clip = torch.tensor([[min(max(j - i, -k_max), k_max) + k_max for j in range(n)] for i in range(n)])
        a_k, a_v = module.pos.key_table[clip], module.pos.value_table[clip]  # [N, N, d]: fine on a small input
        logits = torch.einsum("bhid,bhijd->bhij", q, k[:, :, None] + a_k) / math.sqrt(d)
        if causal:
            logits = logits.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        probs = logits.softmax(-1)
        values = torch.einsum("bhij,bhijd->bhid", probs, v[:, :, None] + a_v)
        torch.testing.assert_close(module(x), finish(module, probs, values), atol=1e-5, rtol=1e-5)


def test_rope_attention_equals_attention_on_rotated_heads() -> None:
    module = make("rope")
    x = tokens()
    d = DIM // HEADS
    with torch.no_grad():
        q, k, v = heads_of(module, x)
        rot = torch.zeros(N, d, d)  # explicit block rotation per position, half layout: pair (i, i + d/2)
        for p in range(N):
            for i in range(d // 2):
                a = p * 10000 ** (-2 * i / d)
                rot[p, i, i], rot[p, i, i + d // 2] = math.cos(a), -math.sin(a)
                rot[p, i + d // 2, i], rot[p, i + d // 2, i + d // 2] = math.sin(a), math.cos(a)
        rq, rk = torch.einsum("nij,bhnj->bhni", rot, q), torch.einsum("nij,bhnj->bhni", rot, k)
        probs = (rq @ rk.transpose(-2, -1) / math.sqrt(d)).softmax(-1)
        torch.testing.assert_close(module(x), finish(module, probs, probs @ v), atol=1e-5, rtol=1e-5)


def test_yarn_attention_runs_at_four_times_training_length() -> None:
    scaling = {"type": "yarn", "factor": 4.0, "original_length": N}
    fused, eager = make("rope", scaling=scaling), make("rope", scaling=scaling, fused=False)
    eager.load_state_dict(fused.state_dict())
    x = tokens(n=4 * N)
    with torch.no_grad():
        out = fused(x)
        assert out.shape == x.shape and out.isfinite().all()
        torch.testing.assert_close(out, eager(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pos", ["rope", "alibi", "t5"])
def test_bf16_attention_stays_bf16_and_close(pos: str) -> None:
    module = make(pos)
    half = make(pos).to(torch.bfloat16)
    x = tokens()
    with torch.no_grad():
        out = half(x.bfloat16())
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), module(x), atol=5e-2, rtol=5e-2)


def test_configure_sets_rope_scaling_on_a_stack_of_attention_layers() -> None:
    """One scaling API for 1D and 2D: vispos.configure reaches every RoPE of a plain layer stack."""
    stack = torch.nn.Sequential(make("rope"), make("rope"))
    reference = torch.nn.Sequential(
        make("rope", scaling={"type": "yarn", "factor": 4.0, "original_length": N}),
        make("rope", scaling={"type": "yarn", "factor": 4.0, "original_length": N}),
    )
    torch.testing.assert_close(reference[0].qkv.weight, stack[1].qkv.weight, rtol=0, atol=0)  # make() seeds 0
    x = tokens(n=4 * N)
    with torch.no_grad():
        plain = stack(x)
        assert vispos.configure(stack, scaling="yarn", factor=4.0, original_length=N) is stack
        assert all(layer.pos.scaling == vispos.RopeScaling("yarn", 4.0, N) for layer in stack)
        torch.testing.assert_close(stack(x), reference(x), rtol=0, atol=0)
        assert not torch.allclose(stack(x), plain)
        vispos.configure(stack, scaling=None)
        torch.testing.assert_close(stack(x), plain, rtol=0, atol=0)
    with pytest.raises(ValueError, match="train_grid applies to 2D RoPE"):
        vispos.configure(stack, scaling="linear", factor=2.0, train_grid=(4, 4))
    with pytest.raises(ValueError, match="RoPE scaling applies to rope and rope2d; this model uses alibi"):
        vispos.configure(torch.nn.Sequential(make("alibi")), scaling="linear", factor=2.0)
    with pytest.raises(ValueError, match="no vispos positional scheme found"):
        vispos.configure(torch.nn.Linear(2, 2), scaling="linear", factor=2.0)


def test_attention_takes_scaling_fields_as_keywords_like_configure() -> None:
    """Attention(pos="rope", scaling="yarn", original_length=...) builds what configure(...) switches to."""
    keywords = make("rope", scaling="yarn", factor=4.0, original_length=N, beta_fast=16.0)
    expected = vispos.RopeScaling("yarn", factor=4.0, original_length=N, beta_fast=16.0)
    assert keywords.pos.scaling == expected
    configured = vispos.configure(torch.nn.Sequential(make("rope")), scaling="yarn", factor=4.0, original_length=N,
                                  beta_fast=16.0)[0]  # fmt: skip
    assert configured.pos.scaling == expected
    assert make("rope", scaling="yarn", original_length=N).pos.scaling == vispos.RopeScaling("yarn", original_length=N)
    x = tokens(n=4 * N)
    with torch.no_grad():
        torch.testing.assert_close(keywords(x), configured(x), rtol=0, atol=0)
        torch.testing.assert_close(keywords(x), make("rope", scaling=expected)(x), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"scaling options \['original_length'\] given without scaling="):
        make("rope", original_length=N)
    with pytest.raises(ValueError, match=r"beta_fast: not used by 'linear' scaling"):
        make("rope", scaling="linear", factor=2.0, beta_fast=8.0)
    with pytest.raises(ValueError, match=r"given beside a RopeScaling"):
        make("rope", scaling=expected, factor=2.0)
    with pytest.raises(TypeError, match=r"unknown option\(s\) factor for alibi"):  # not a RoPE: not a scaling field
        make("alibi", factor=2.0)


@pytest.mark.parametrize(("typed", "meant"), [("log_n_atention", "log_n_attention"), ("factr", "factor"),
                                              ("train_grd", "train_grid"), ("atention", "attention")])  # fmt: skip
def test_configure_names_an_unknown_keyword_with_the_accepted_ones_and_the_nearest(typed: str, meant: str) -> None:
    """A typo is not taken for a scaling option: the message names it, what is accepted, and what it is nearest."""
    model = torch.nn.Sequential(make("rope"))
    for scaling in ({}, {"scaling": "linear"}):
        with pytest.raises(TypeError, match=rf"unknown keyword\(s\) '{typed}' \('{typed}': did you mean '{meant}'\?\); "
                           r"accepted: scaling, train_grid, log_n_attention, attention, .* factor, original_length"):
            vispos.configure(model, **scaling, **{typed: True})
    with pytest.raises(TypeError, match=r"unknown keyword\(s\) 'zzz'; accepted"):  # nothing near: no guess
        vispos.configure(model, zzz=1)


def test_set_position_enabled_switches_a_stack_of_attention_layers() -> None:
    stack = torch.nn.Sequential(make("alibi"), make("alibi"))
    x = tokens()
    with torch.no_grad():
        with_positions = stack(x)
        vispos.set_position_enabled(stack, False)
        assert not any(layer.enabled for layer in stack)
        without = stack(x)
        vispos.set_position_enabled(stack, True)
        torch.testing.assert_close(stack(x), with_positions, rtol=0, atol=0)
    assert not torch.allclose(without, with_positions)


# --- bad input -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pos", ["sincos1d", "learned1d"])
def test_additive_scheme_in_attention_is_refused(pos: str) -> None:
    with pytest.raises(ValueError, match=rf"'{pos}' is added to the token embeddings.*create_encoding"):
        Attention(DIM, HEADS, pos=pos)


def test_attention_bad_arguments_name_what_is_accepted() -> None:
    with pytest.raises(ValueError, match=r"unknown scheme 'rope3d'; known: .*alibi"):
        Attention(DIM, HEADS, pos="rope3d")
    with pytest.raises(ValueError, match=r"no 1D form; 1D schemes: .*rope"):
        Attention(DIM, HEADS, pos="rope2d")
    with pytest.raises(TypeError, match=r"unknown option\(s\) slopes for alibi; accepted: none"):
        Attention(DIM, HEADS, pos="alibi", slopes=[1.0])
    with pytest.raises(ValueError, match=r"divisible by num_heads"):
        Attention(30, HEADS)
    module = make("rope")
    with pytest.raises(ValueError, match=r"positions cover 3 tokens, the input has 10"):
        module(tokens(), torch.arange(3))
    with pytest.raises(ValueError, match=r"non-negative"):
        module(tokens(), torch.arange(N) - 1)
    with pytest.raises(ValueError, match=r"integer tensor"):
        module(tokens(), torch.arange(N).float())
