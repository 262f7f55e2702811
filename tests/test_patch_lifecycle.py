"""A patched model through a practitioner's workflow: save, reload, copy, pickle, send to workers."""

from __future__ import annotations

import copy
import io
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import timm
import timm.optim
import torch

import vispos

IMG = 64


def make(pos: str | list[str] = "rope2d", name: str = "vit_small_patch16_224", **options: object) -> torch.nn.Module:
    torch.manual_seed(0)
    model = timm.create_model(name, img_size=IMG, depth=2, num_classes=5)
    return vispos.patch(model, pos, **options).eval()


def saved(obj: object) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def x(h: int = IMG, w: int = IMG) -> torch.Tensor:
    return torch.randn(2, 3, h, w, generator=torch.Generator().manual_seed(3))


# --- the settings that change behaviour travel with the weights ------------------------------------------
def test_inference_settings_and_the_position_switch_are_restored_by_load_state_dict() -> None:
    trained = make("rope2d", theta=10.0)
    vispos.configure(trained, scaling="yarn", log_n_attention=True)
    vispos.set_position_enabled(trained, False)  # a DroPE-trained model
    state = torch.load(saved(trained.state_dict()), weights_only=True)  # plain data only
    fresh = make("rope2d", theta=10.0)
    fresh.load_state_dict(state)
    assert fresh.vispos.enabled is False and fresh.vispos.log_n_tokens == 16
    assert fresh.vispos.attention.scaling_y == vispos.RopeScaling("yarn", original_length=4)
    assert fresh.vispos_cfg == trained.vispos_cfg
    with torch.no_grad():
        torch.testing.assert_close(fresh(x(128, 96)), trained(x(128, 96)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("other", "options", "message"),
    [
        ("rope2d", {"theta": 100.0}, r"are rope2d\(theta=10.0\) at a 4x4 .*; this model's are rope2d\(theta=100.0\)"),
        ("alibi2d", {}, r"are rope2d\(theta=10.0\) at a 4x4 training grid; this model's are alibi2d\(\)"),
    ],
)
def test_a_checkpoint_of_another_scheme_or_options_is_refused(other: str, options: dict, message: str) -> None:
    state = make("rope2d", theta=10.0).state_dict()
    with pytest.raises(ValueError, match=message):
        make(other, **options).load_state_dict(state)


def test_a_plain_timm_checkpoint_keeps_its_learned_table_under_learned2d() -> None:
    torch.manual_seed(1)
    plain = timm.create_model("vit_small_patch16_224", img_size=IMG, depth=2, num_classes=5).eval()
    model = make("learned2d")
    model.load_state_dict(plain.state_dict())
    torch.testing.assert_close(model.vispos.additive.table.reshape(1, -1, 384), plain.pos_embed[:, 1:], rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(model(x()), plain(x()), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scheme", ["rope2d", "relbias2d", ["sincos2d", "alibi2d"]])
def test_a_plain_timm_checkpoint_with_a_table_the_scheme_cannot_hold_is_refused(scheme: str | list[str]) -> None:
    plain = timm.create_model("vit_small_patch16_224", img_size=IMG, depth=2, num_classes=5)
    refusal = r"holds timm's own pos_embed \(1, 17, 384\).*load the checkpoint before patching"
    with pytest.raises(ValueError, match=refusal):
        make(scheme).load_state_dict(plain.state_dict())


# --- copies, pickles, files and workers ------------------------------------------------------------------
@pytest.mark.parametrize("scheme", ["rope2d_mixed", ["learned2d", "relbias2d"]])
def test_deepcopy_pickle_and_torch_save_keep_the_patched_model(scheme: str | list[str]) -> None:
    model = make(scheme, name="deit_tiny_distilled_patch16_224")
    with torch.no_grad():
        for p in model.vispos.parameters():
            p.add_(torch.randn_like(p))
        expected = model(x(64, 96))
        copies = [copy.deepcopy(model), pickle.loads(pickle.dumps(model)), torch.load(saved(model), weights_only=False)]
        for clone in copies:
            assert type(clone) is type(model) and isinstance(clone, vispos.timm.PatchedViT)
            torch.testing.assert_close(clone(x(64, 96)), expected, rtol=0, atol=0)


def test_torch_load_in_a_fresh_process_rebuilds_the_patched_class(tmp_path: Path) -> None:
    """A new interpreter has never made the patched class: pickle asks the adapter module for it by name."""
    model = make(["learned2d", "rope2d"])
    with torch.no_grad():
        expected = model(x())
    torch.save({"model": model, "input": x(), "expected": expected}, tmp_path / "model.pt")
    script = (
        "import torch, sys\n"
        "d = torch.load(sys.argv[1], weights_only=False)\n"
        "m = d['model']\n"
        "assert type(m).__mro__[1].__name__ == 'PatchedViT', type(m).__mro__\n"
        "with torch.no_grad(): torch.testing.assert_close(m(d['input']), d['expected'], rtol=0, atol=0)\n"
        "print('ok', type(m).__name__)\n"
    )
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path / "model.pt")], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "ok VisionTransformer"


def _forward_in_worker(model: torch.nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(inputs)


def test_a_spawned_worker_receives_a_working_patched_model() -> None:
    model = make("alibi2d")
    with torch.no_grad():
        expected = model(x())
    ctx = torch.multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        out = pool.apply(_forward_in_worker, (model, x()))
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


# --- optimizer groups: positional parameters are not decayed ---------------------------------------------
@pytest.mark.parametrize("scheme", ["learned2d", "relbias2d", "cpb2d", "rope2d_mixed", ["learned2d", "relbias2d"]])
def test_timm_optimizer_leaves_every_positional_parameter_undecayed(scheme: str | list[str]) -> None:
    model = make(scheme, name="deit_tiny_distilled_patch16_224")  # cls + dist: relative biases get prefix entries
    positional = {id(p) for p in model.vispos.parameters()}
    assert positional, "the scheme has parameters"
    optimizer = timm.optim.create_optimizer_v2(model, "adamw", lr=1e-3, weight_decay=0.05)
    decayed = {id(p) for g in optimizer.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    assert not positional & decayed
    assert {"cls_token", "dist_token"} <= model.no_weight_decay()
    assert decayed, "the other matrices are still decayed"


def test_group_matcher_puts_per_layer_positional_parameters_in_their_block() -> None:
    model = make(["learned2d", "relbias2d"])
    groups = timm.models.group_parameters(model, model.group_matcher(coarse=False))
    layer_of = {name: i for i, names in enumerate(groups.values()) for name in names}
    assert layer_of["vispos.attention.1.table"] == layer_of["blocks.1.attn.qkv.weight"]
    assert layer_of["vispos.attention.0.table"] == layer_of["blocks.0.attn.qkv.weight"]
    assert layer_of["vispos.additive.table"] == layer_of["cls_token"]  # the stem, with the patch embedding
