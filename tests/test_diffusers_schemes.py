"""Any vispos 2D scheme inside DiT's and PixArt's self-attention (``vispos.patch(transformer, pos, inherit=False)``):
every scheme trains there, relative schemes see only offsets between image tokens, ``nope`` gives diffusers' own
processor's outputs, PixArt's cross-attention keeps diffusers' processor, and the model saves, reloads, compiles,
runs in bf16 and on fake CUDA."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.attention_processor import AttnProcessor2_0
from diffusers_models import build, run
from fake_cuda import fake_cuda

import vispos
import vispos.diffusers.schemes as schemes_module
from vispos.diffusers.schemes import SchemeAttnProcessor
from vispos.positions.settings import canonical_options
from vispos.registry import get_info, list_encodings

FRESH = ("dit", "pixart")
# every 2D scheme the DiT host takes: all but the conditional ones (they act between blocks)
SCHEMES = [n for n in list_encodings(2) if get_info(n, ndim=2).kind != "conditional"]
RELATIVE = [n for n in SCHEMES if get_info(n, ndim=2).relative and get_info(n, ndim=2).kind != "none"]


def host(name: str, seed: int = 0) -> tuple[torch.nn.Module, object]:
    """``diffusers_models``' tiny DiT or PixArt with heads of 16 (ComRoPE's smallest)."""
    model, inputs = build(name, seed)
    config = dict(model.config) | {"attention_head_dim": 16}
    if config.get("cross_attention_dim"):  # PixArt's text attends at the model's width
        config["cross_attention_dim"] = 16 * config["num_attention_heads"]
    torch.manual_seed(seed)
    return type(model).from_config(config).eval(), inputs


def fresh(name: str, pos: object, seed: int = 0, **options: object) -> tuple[torch.nn.Module, object]:
    """``host``'s model patched with ``pos`` in place of its positions."""
    model, inputs = host(name, seed)
    return vispos.patch(model, pos, inherit=False, **options), inputs


@pytest.mark.parametrize("pos", SCHEMES)
@pytest.mark.parametrize("name", FRESH)
def test_every_scheme_trains_inside_the_transformer(name: str, pos: str) -> None:
    model, inputs = fresh(name, pos)
    model.train()
    out = model(**inputs(4, 4), return_dict=False)[0]
    out.square().mean().backward()
    assert torch.isfinite(out).all()
    grads = [p.grad for n, p in model.named_parameters() if n.startswith("vispos.") and p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert model.transformer_blocks[0].norm1 is not None  # the host's blocks, weights and processors kept
    assert isinstance(model.transformer_blocks[0].attn1.processor, SchemeAttnProcessor)
    if name == "pixart":  # the cross-attention to text keeps diffusers' processor
        assert isinstance(model.transformer_blocks[0].attn2.processor, AttnProcessor2_0)
    h, w = (8, 8) if name == "dit" else (8, 6)  # DiT's own unpatchify takes square grids only
    larger = model.eval()(**inputs(h, w), return_dict=False)[0]  # above the training grid
    assert torch.isfinite(larger).all()


@pytest.mark.parametrize("name", FRESH)
def test_nope_gives_diffusers_own_processor(name: str) -> None:
    model, inputs = fresh(name, "nope")
    plain, _ = host(name)
    plain.pos_embed.pos_embed = None  # the model without its table: what nope leaves
    for block in plain.transformer_blocks:
        assert isinstance(block.attn1.processor, AttnProcessor2_0)
    for h, w in ((4, 4), (6, 6)):
        torch.testing.assert_close(run(model, inputs(h, w)), run(plain, inputs(h, w)), rtol=1e-5, atol=1e-6)


def _logits(model: torch.nn.Module, inputs: dict, monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    """The first block's attention logits between image tokens [heads, N, N], from the q, k, mask and scale the
    processor hands to SDPA."""
    seen = []
    real = schemes_module.sdpa

    def spy(q, k, v, *, mask=None, scale=None, **kw):  # noqa: ANN001, ANN202
        seen.append((q, k, mask, scale))
        return real(q, k, v, mask=mask, scale=scale, **kw)

    monkeypatch.setattr(schemes_module, "sdpa", spy)
    run(model, inputs)
    q, k, mask, scale = seen[0]
    logits = (q @ k.transpose(-1, -2)) * scale
    return (logits if mask is None else logits + mask)[0]


def _same_content(model: torch.nn.Module, h: int, w: int, seed: int = 0) -> dict:
    """DiT inputs whose every patch holds the same pixels: the attention then tells tokens apart by position only."""
    g = torch.Generator().manual_seed(seed)
    patch = torch.randn(4, 2, 2, generator=g)
    return {"hidden_states": patch.repeat(1, h, w)[None], "timestep": torch.tensor([700]),
            "class_labels": torch.tensor([1])}  # fmt: skip


def _offset_spread(logits: torch.Tensor, h: int, w: int) -> float:
    """The largest spread of the logit over the token pairs of one offset (dy, dx), relative to the logits' spread."""
    ys, xs = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    dy = (ys.reshape(-1)[:, None] - ys.reshape(-1)[None, :]) + h
    dx = (xs.reshape(-1)[:, None] - xs.reshape(-1)[None, :]) + w
    key = (dy * (2 * w + 1) + dx).reshape(-1)
    worst = 0.0
    for head in logits:
        flat = head.reshape(-1)
        for k in key.unique():
            group = flat[key == k]
            worst = max(worst, float(group.max() - group.min()))
    return worst / float(logits.std())


@pytest.mark.parametrize("pos", RELATIVE)
def test_relative_schemes_see_only_offsets_inside_the_dit(pos: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model, _ = fresh("dit", pos)
    with torch.no_grad():  # positional parameters off their zero start: a bias that is zero is trivially relative
        for p in model.vispos.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.3)
    logits = _logits(model, _same_content(model, 5, 5), monkeypatch)
    assert _offset_spread(logits, 5, 5) < 1e-4
    plain = _logits(fresh("dit", "nope")[0], _same_content(model, 5, 5), monkeypatch)
    assert (logits - plain).abs().max() > 1e-3  # the scheme acts: the logits are not nope's


@pytest.mark.parametrize("pos", ["learned2d", "sincos2d"])
def test_absolute_tables_are_not_relative_inside_the_dit(pos: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model, _ = fresh("dit", pos)
    with torch.no_grad():
        for p in model.vispos.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.3)
    assert _offset_spread(_logits(model, _same_content(model, 5, 5), monkeypatch), 5, 5) > 1e-2  # the measure fails


def test_the_model_table_is_removed_or_kept_as_asked() -> None:
    kept, inputs = build("dit")
    vispos.patch(kept, "sincos2d")  # inherit: DiT's own table
    assert kept.pos_embed.pos_embed is not None
    plain, _ = build("dit")
    torch.testing.assert_close(run(kept, inputs(4, 4)), run(plain, inputs(4, 4)))
    rope, _ = fresh("dit", "rope2d")
    assert rope.pos_embed.pos_embed is None and rope.vispos.additive is None
    both, _ = fresh("dit", ["learned2d", "rope2d"])
    assert both.vispos.additive is not None and both.vispos_cfg["pos"] == ["learned2d", "rope2d"]


def test_refusals_name_the_scheme_and_the_reason() -> None:
    for name, why in (("flux", "text and image tokens in one sequence"), ("sd3", "joint attention"),
                      ("qwen", "attending jointly"), ("lumina", "caption and image tokens")):  # fmt: skip
        model, _ = build(name)
        with pytest.raises(ValueError, match=rf"inherit=False puts a vispos scheme.*{why}.*DiTTransformer2DModel"):
            vispos.patch(model, "rope2d", inherit=False)
    dit, _ = build("dit")
    with pytest.raises(ValueError, match="peg2d on DiTTransformer2DModel: a conditional scheme"):
        vispos.patch(dit, "peg2d", inherit=False)
    with pytest.raises(ValueError, match="to train DiTTransformer2DModel with alibi2d.*inherit=False"):
        vispos.patch(dit, "alibi2d")
    model, _ = fresh("dit", "rope2d")
    with pytest.raises(ValueError, match="takes its positions from the transformer's forward"):
        model.transformer_blocks[0].attn1(torch.randn(1, 16, 16))
    timm_rope = vispos.encodings.rope2d.Rope2d(dim=16, train_grid=(4, 4))
    with pytest.raises(ValueError, match="follows a diffusion model's denoising timestep"):
        timm_rope.set_scaling("ntk", schedule="dype")


@pytest.mark.parametrize("name", FRESH)
def test_save_pretrained_and_from_pretrained_restore_the_scheme(name: str, tmp_path) -> None:
    from vispos.diffusers import from_pretrained

    model, inputs = fresh(name, ["learned2d", "rope2d"], theta=50.0)
    with torch.no_grad():
        model.vispos.additive.table.add_(0.5)  # trained weights of the scheme, saved beside the host's
    vispos.configure(model, scaling="yarn", schedule="dype", log_n_attention=True)
    model.save_pretrained(tmp_path)
    loaded = from_pretrained(tmp_path)
    # the same settings, the options as the record keeps them (every default filled in)
    canonical = lambda cfg: cfg | {"options": canonical_options(cfg["pos"], cfg["options"])}  # noqa: E731
    assert canonical(loaded.vispos_cfg) == canonical(model.vispos_cfg)
    assert loaded.vispos.attention.theta == 50.0
    own, back = model.state_dict(), loaded.state_dict()
    assert own.keys() == back.keys()
    for key, value in own.items():
        torch.testing.assert_close(back[key], value, rtol=0, atol=0)
    assert loaded.vispos.attention.schedule is not None
    given = inputs(6, 6)  # above the training grid: the scaling is in use
    torch.testing.assert_close(run(loaded, given), run(model, given), rtol=1e-5, atol=1e-6)


def test_dype_follows_the_timestep_and_is_a_no_op_at_the_training_grid() -> None:
    model, inputs = fresh("dit", "rope2d")
    base = {t: run(model, inputs(4, 4, t)) for t in (900.0, 100.0)}
    vispos.configure(model, scaling="yarn", schedule="dype")
    for t, out in base.items():  # at the training grid nothing is scaled (float64 frequencies against float32's)
        torch.testing.assert_close(run(model, inputs(4, 4, t)), out, rtol=1e-5, atol=1e-6)
    plain, _ = fresh("dit", "rope2d")
    early, late = run(model, inputs(8, 8, 999.0)), run(model, inputs(8, 8, 1.0))
    # near sigma 0 DyPE gives back the model's own frequencies (and YaRN's magnitude): nearer the unscaled model
    dist = lambda a, b: float((a - b).abs().max())  # noqa: E731
    assert dist(late, run(plain, inputs(8, 8, 1.0))) < dist(early, run(plain, inputs(8, 8, 999.0)))
    assert dist(early, run(plain, inputs(8, 8, 999.0))) > 1e-4  # early steps take the scaling
    mixed = inputs(8, 8) | {"hidden_states": torch.randn(2, 4, 16, 16), "timestep": torch.tensor([900, 100]),
                            "class_labels": torch.tensor([1, 2])}  # fmt: skip
    with pytest.raises(RuntimeError, match="one noise level per forward"):
        run(model, mixed)


def test_compiled_outputs_equal_eager_across_sizes() -> None:
    model, inputs = fresh("dit", "rope2d")
    compiled = torch.compile(model, dynamic=True)
    for h in (4, 6):
        torch.testing.assert_close(run(compiled, inputs(h, h)), run(model, inputs(h, h)), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("pos", ["rope2d", "alibi2d", "learned2d"])
def test_bf16_autocast_is_close_to_fp32(pos: str) -> None:
    model, inputs = fresh("dit", pos)
    ref = run(model, inputs(6, 6))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = run(model, inputs(6, 6))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("pos", ["rope2d", "rope2d+dype", "rope2d_mixed", "alibi2d", "lookhere2d", "irpe2d",
                                 "learned2d"])  # fmt: skip
def test_fake_cuda_forward_keeps_every_tensor_on_the_device(pos: str) -> None:
    """Every tensor of the forward on the device, no host read (DyPE's noise level included)."""
    model, _ = fresh("dit", pos.split("+")[0])
    if pos.endswith("+dype"):
        vispos.configure(model, scaling="yarn", schedule="dype")
    with fake_cuda(model) as watch:
        out = model(torch.randn(1, 4, 12, 12, device="cuda"), timestep=torch.tensor([700], device="cuda"),
                    class_labels=torch.tensor([1], device="cuda"), return_dict=False)[0]  # fmt: skip
        assert out.device.type == "cuda"
    assert not watch.unexplained(), watch.unexplained()


def test_log_n_attention_scales_every_logit_above_the_training_grid(monkeypatch: pytest.MonkeyPatch) -> None:
    """log-n attention inside the DiT: q . k x ln N / ln N_train for N image tokens, as the timm host applies it
    (through SDPA's scale; a bias scheme's mask is added unscaled)."""
    model, _ = fresh("dit", "rope2d")
    plain = _logits(model, _same_content(model, 6, 6), monkeypatch)
    vispos.configure(model, log_n_attention=True)
    scaled = _logits(model, _same_content(model, 6, 6), monkeypatch)
    ratio = torch.log(torch.tensor(36.0)) / torch.log(torch.tensor(16.0))  # a 6 x 6 grid, trained at 4 x 4
    torch.testing.assert_close(scaled, plain * ratio, rtol=1e-5, atol=1e-5)
    at_training = _logits(model, _same_content(model, 4, 4), monkeypatch)
    vispos.configure(model, log_n_attention=False)
    torch.testing.assert_close(at_training, _logits(model, _same_content(model, 4, 4), monkeypatch))
