"""Learned-basis rotations (comrope2d, liere2d, string2d) are computed once per grid at inference and reused
until a parameter changes; the cache is invisible: the outputs equal the uncached path exactly, a weight
update or a new checkpoint is never answered with a stale rotation, and nothing of it is saved."""

from __future__ import annotations

import copy
import pickle

import pytest
import timm
import torch
import torch._dynamo

import vispos

CASES = {
    "comrope2d": ("comrope2d", {}),  # per layer and head
    "liere2d": ("liere2d", {}),  # dense, shared by every layer
    "liere2d_blocks": ("liere2d", {"block_size": 4, "per_head": True, "per_layer": True}),
    "string2d": ("string2d", {}),  # Cayley basis
    "string2d_circulant": ("string2d", {"variant": "circulant"}),
}


def make(case: str) -> torch.nn.Module:
    pos, options = CASES[case]
    torch.manual_seed(0)
    net = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=64, num_heads=2, depth=2,
                            num_classes=0)  # fmt: skip  (features out: positions show there)
    net = vispos.patch(net, pos, **options)
    with torch.no_grad():
        for param in net.vispos.parameters():
            param.normal_(std=0.5)
        for blk in net.blocks:  # sharper attention than at initialisation, so that positions show
            blk.attn.qkv.weight.mul_(4.0)
    return net.eval()


def modules(net: torch.nn.Module) -> list[torch.nn.Module]:
    attention = net.vispos.attention
    return list(attention) if isinstance(attention, torch.nn.ModuleList) else [attention]


def count_builds(net: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Spies on the costly step of each module (its generators, or STRING's angles): one count per call."""
    calls: list[int] = []
    for module in modules(net):
        name = "generators" if hasattr(module, "generators") else "angles"
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _f=original, **k: calls.append(1) or _f(*a, **k))
    return calls


def images(size: int = 32) -> torch.Tensor:
    return torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_inference_reuses_each_grids_rotation_and_equals_the_uncached_path(case, mode, monkeypatch) -> None:  # noqa: ANN001
    net, uncached = make(case), make(case)
    calls = count_builds(net, monkeypatch)
    with mode():
        first = net(images())
        built = len(calls)
        again, other = net(images()), net(images(48))  # the same grid (kept), another one (built)
        assert len(calls) == 2 * built and built == len(modules(net))
        back = net(images())  # both grids are kept
        assert len(calls) == 2 * built
    for cache in (m.cache for m in modules(uncached)):  # the reference never keeps anything
        cache.size = 0
    with torch.no_grad():
        torch.testing.assert_close(first, uncached(images()), rtol=0, atol=0)
        torch.testing.assert_close(again, first, rtol=0, atol=0)
        torch.testing.assert_close(back, first, rtol=0, atol=0)
        torch.testing.assert_close(other, uncached(images(48)), rtol=0, atol=0)


@pytest.mark.parametrize("case", CASES)
def test_a_parameter_changed_in_place_or_a_loaded_checkpoint_is_never_answered_from_the_cache(case) -> None:  # noqa: ANN001
    net, other = make(case), make(case)
    with torch.no_grad():
        for param in other.vispos.parameters():
            param.normal_(std=0.5)
        before = net(images())
        next(net.vispos.parameters()).mul_(1.5)  # an optimizer step, in place
        stepped = net(images())
        fresh = copy.deepcopy(net)  # a copy starts with an empty cache
        assert all(len(m.cache) == 0 for m in modules(fresh))
        torch.testing.assert_close(stepped, fresh(images()), rtol=1e-5, atol=1e-6)
        assert (stepped - before).abs().max() > 1e-3
        net.load_state_dict(other.state_dict())
        torch.testing.assert_close(net(images()), other(images()), rtol=1e-5, atol=1e-6)
        net.double()  # new tensors
        torch.testing.assert_close(net(images().double()).float(), other(images()), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["comrope2d", "liere2d", "string2d"])
def test_training_and_autograd_compute_the_rotation_every_time(case, monkeypatch) -> None:  # noqa: ANN001
    net = make(case)
    calls = count_builds(net, monkeypatch)
    net.train()
    net(images()).sum().backward()
    net(images()).sum().backward()
    net.eval()
    net(images())  # eval with autograd on (e.g. attribution): gradients must reach the generators
    assert len(calls) == 3 * len(modules(net))
    assert all(len(m.cache) == 0 for m in modules(net))


@pytest.mark.parametrize("case", ["comrope2d", "string2d"])
def test_the_cache_is_not_in_the_state_dict_and_a_pickle_starts_empty(case) -> None:  # noqa: ANN001
    net = make(case)
    keys = set(net.state_dict())
    with torch.no_grad():
        expected = net(images())
    assert set(net.state_dict()) == keys and not any("cache" in k for k in keys)
    restored = pickle.loads(pickle.dumps(net))
    assert all(len(m.cache) == 0 for m in modules(restored))
    with torch.no_grad():
        torch.testing.assert_close(restored(images()), expected, rtol=1e-5, atol=1e-6)


def test_a_compiled_model_computes_the_rotation_in_its_graph_without_recompiling() -> None:
    torch.compiler.reset()
    net = make("comrope2d")
    compiled = torch.compile(net, backend="aot_eager", fullgraph=True)  # the cache breaks no graph
    with torch.no_grad():
        expected = net(images())
        torch.testing.assert_close(compiled(images()), expected, rtol=1e-5, atol=1e-5)
        with torch._dynamo.config.patch(error_on_recompile=True):
            next(net.vispos.parameters()).mul_(1.5)  # a changed weight is read by the graph, not a guard
            torch.testing.assert_close(compiled(images()), net(images()), rtol=1e-5, atol=1e-5)
    torch.compiler.reset()



@pytest.mark.parametrize("case", CASES)
def test_the_kept_rotations_stay_within_the_byte_budget_and_a_larger_one_is_not_kept(case) -> None:  # noqa: ANN001
    net, small_budget, reference = make(case), make(case), make(case)
    for m in modules(small_budget):
        m.cache.max_bytes = 1  # every rotation is larger: computed while its layer runs, never kept
    for cache in (m.cache for m in modules(reference)):
        cache.size = 0
    with torch.no_grad():
        for size in (32, 48, 64):
            net(images(size))
            torch.testing.assert_close(small_budget(images(size)), reference(images(size)), rtol=0, atol=0)
    assert all(0 < m.cache.nbytes <= m.cache.max_bytes for m in modules(net))
    assert all(len(m.cache) == 0 and m.cache.nbytes == 0 for m in modules(small_budget))
