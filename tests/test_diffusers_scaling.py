"""Scaling a diffusers transformer above its training grid with ``vispos.configure``: each scaling a no-op at the
training grid, its maths above it against the core's formulas (RoPE), diffusers' own sin-cos function (tables),
DyPE's formulas and defaults (the timestep schedule), and no recompiles across timesteps and sizes."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from diffusers_models import ROPE, _flux_ids, build, run

import vispos
from vispos.encodings.dype import TimestepSchedule, axis_inv_freq
from vispos.encodings.rope_scaling import RopeScaling, scaled_inv_freq

diffusers = pytest.importorskip("diffusers")

STATIC = [{"scaling": "linear"}, {"scaling": "ntk"}, {"scaling": "yarn"}, {"scaling": "yarn", "schedule": "dype"},
          {"scaling": "ntk", "schedule": "dype"}, {"log_n_attention": True}]  # fmt: skip


@pytest.mark.parametrize("name", ROPE)
def test_every_rope_scaling_is_a_no_op_at_the_training_grid(name: str) -> None:
    model, inputs = build(name)
    reference = copy.deepcopy(model)
    vispos.patch(model, "rope2d")
    grids = ((3, 5), (2, 5))  # at the training grid and below it
    want = [run(reference, inputs(h, w)) for h, w in grids]
    for setting in STATIC:
        vispos.configure(model, train_grid=(3, 5), **{"scaling": None, "log_n_attention": False, **setting})
        for (h, w), expected in zip(grids, want, strict=True):
            torch.testing.assert_close(run(model, inputs(h, w)), expected, rtol=0, atol=1e-6, msg=str(setting))


@pytest.mark.parametrize("kind", ["linear", "ntk", "yarn"])
def test_flux_per_axis_scaling_follows_the_core_formulas(kind: str) -> None:
    model, _ = build("flux")
    vispos.patch(model, "rope2d")
    vispos.configure(model, scaling=kind, train_grid=(3, 4))
    ids = torch.cat((torch.zeros(2, 3), _flux_ids(6, 4, 3)))  # y: twice the training size, x: as trained
    cos, sin = model.pos_embed(ids)
    freqs, factors = [], []
    for dim, setting in ((4, None), (6, RopeScaling(kind, factor=2.0, original_length=3)), (6, None)):
        inv, factor = scaled_inv_freq(dim, 10000.0, setting, 6)
        freqs.append(inv)
        factors.append(torch.full((dim // 2,), factor))
    angles = ids[:, :, None] * torch.stack([torch.cat((f, torch.zeros(3 - len(f)))) for f in freqs])
    angles = torch.cat([angles[:, a, : len(f)] for a, f in enumerate(freqs)], dim=-1)
    scale = torch.cat(factors)
    torch.testing.assert_close(cos, (angles.cos() * scale).repeat_interleave(2, -1), rtol=0, atol=2e-6)
    torch.testing.assert_close(sin, (angles.sin() * scale).repeat_interleave(2, -1), rtol=0, atol=2e-6)
    assert torch.equal(sin[:2], torch.zeros_like(sin[:2]))  # text tokens: no rotation (a yarn factor on cos only)


@pytest.mark.parametrize("kind", ["linear", "ntk", "yarn"])
def test_axis_inv_freq_is_the_core_scaling_for_a_tensor_factor(kind: str) -> None:
    for s in (1.0, 1.5, 2.0, 4.0):
        inv, factor = axis_inv_freq(56, 10000.0, RopeScaling(kind, original_length=64), torch.tensor(s))
        want, want_factor = scaled_inv_freq(56, 10000.0, RopeScaling(kind, factor=s, original_length=64), 0)
        torch.testing.assert_close(inv.float(), want, rtol=1e-6, atol=0)
        assert factor.item() == pytest.approx(want_factor, rel=1e-12)


def test_log_n_attention_scales_every_logit_by_the_token_ratio() -> None:
    model, _ = build("flux")
    vispos.patch(model, "rope2d")
    vispos.configure(model, log_n_attention=True, train_grid=(3, 4))
    ids = torch.cat((torch.zeros(2, 3), _flux_ids(6, 8, 3)))
    cos, sin = model.pos_embed(ids)
    ratio = math.log(48) / math.log(12)  # q and k each carry its square root
    torch.testing.assert_close(cos**2 + sin**2, torch.full_like(cos, ratio), rtol=1e-6, atol=0)


def _dype_yarn(dim: int, theta: float, length: float, s: float, sigma: float) -> tuple[torch.Tensor, float]:
    """DyPE's YaRN as the paper and its authors' code define it, written out in float64 (the reference)."""
    k = sigma**2  # kappa(t) = t ** lambda_t, lambda_t = 2
    j = torch.arange(dim // 2, dtype=torch.float64)
    base = theta ** (-2 * j / dim)
    linear, ntk = base / s, (theta * s ** (dim / (dim - 2))) ** (-2 * j / dim)

    def edge(rotations: float) -> float:  # the pair index turning `rotations` times over the training length
        return dim * math.log(length / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    def faster(fast: float, slow: float) -> torch.Tensor:
        low, high = max(math.floor(edge(fast)), 0), min(math.ceil(edge(slow)), dim // 2)
        return 1 - ((j - low) / (high - low)).clamp(0, 1)

    blend = linear * (1 - faster(1.25 * k, 0.75 * k)) + ntk * faster(1.25 * k, 0.75 * k)
    keep = faster(16 * k, 2 * k)
    return blend * (1 - keep) + base * keep, 0.1 * math.log(s) + 1


def test_dype_yarn_follows_the_papers_formulas_and_defaults() -> None:
    schedule = TimestepSchedule()
    assert (schedule.exponent, schedule.ntk_scale, schedule.beta, schedule.gamma) == (2.0, 2.0, (1.25, 0.75),
                                                                                      (16.0, 2.0))  # fmt: skip
    yarn = RopeScaling("yarn", original_length=64)
    for s in (2.0, 3.0):
        for sigma in (1.0, 0.8, 0.5, 0.25):
            inv, factor = axis_inv_freq(56, 1e4, yarn, torch.tensor(s), schedule=schedule, sigma=torch.tensor(sigma))
            want, want_factor = _dype_yarn(56, 1e4, 64.0, s, sigma)
            torch.testing.assert_close(inv, want, rtol=1e-12, atol=0)
            assert factor.item() == pytest.approx(want_factor, rel=1e-12)


def test_the_schedules_ends() -> None:
    schedule, s, d = TimestepSchedule(), torch.tensor(2.0), 56
    base = 1e4 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    for kind in ("ntk", "yarn"):
        scaling = RopeScaling(kind, original_length=64)
        clean, factor = axis_inv_freq(d, 1e4, scaling, s, schedule=schedule, sigma=torch.tensor(0.0))
        torch.testing.assert_close(clean, base, rtol=1e-12, atol=0)  # the last steps: the model's own frequencies
        assert factor.item() == pytest.approx(1.0 if kind == "ntk" else 0.1 * math.log(2) + 1)
        for sigma in (0.0, 0.5, 1.0):  # at the training size, every step is the model's own RoPE
            same, one = axis_inv_freq(d, 1e4, scaling, torch.tensor(1.0), schedule=schedule, sigma=torch.tensor(sigma))
            torch.testing.assert_close(same, base, rtol=1e-12, atol=0)
            assert one.item() == 1.0
    noisy, _ = axis_inv_freq(d, 1e4, RopeScaling("ntk", original_length=64), s, schedule=schedule,
                             sigma=torch.tensor(1.0))  # fmt: skip
    torch.testing.assert_close(noisy, (1e4 * 2.0 ** (2 * d / (d - 2))) ** (-torch.arange(0, d, 2).double() / d))


@pytest.mark.parametrize(("name", "level"), [("flux", lambda t: t), ("flux2", lambda t: t), ("qwen", lambda t: t),
                                             ("lumina", lambda t: 1 - t)])  # fmt: skip
def test_the_schedule_reads_the_noise_level_of_the_forwards_timestep(name: str, level) -> None:
    model, inputs = build(name)
    vispos.patch(model, "rope2d")
    vispos.configure(model, scaling="yarn", schedule="dype", train_grid=(2, 2))
    seen = []
    module = model.pos_embed if name != "lumina" else model.rope_embedder
    module.register_forward_hook(lambda *_: seen.append(model.vispos.rotation.sigma.item()))
    run(model, inputs(3, 3, 0.25))
    assert seen and all(v == pytest.approx(level(0.25)) for v in seen)
    assert model.vispos.rotation.sigma is None  # cleared after the forward


def test_no_recompiles_across_timesteps_and_sizes() -> None:
    from torch._dynamo.testing import CompileCounter

    model, _ = build("flux")
    vispos.patch(model, "rope2d")
    vispos.configure(model, scaling="yarn", schedule="dype", log_n_attention=True, train_grid=(3, 3))
    rope = model.vispos.rotation

    def rotation(ids: torch.Tensor, sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rope.sigma = sigma
        return model.pos_embed(ids)

    counter = CompileCounter()
    compiled = torch.compile(rotation, backend=counter, dynamic=True)
    torch._dynamo.reset()
    for h, w, t in ((4, 4, 0.9), (4, 4, 0.5), (6, 4, 0.3), (5, 7, 0.1), (8, 8, 1.0)):
        ids = torch.cat((torch.zeros(3, 3), _flux_ids(h, w, 3)))
        sigma = torch.tensor(t, dtype=torch.float64)
        got = compiled(ids, sigma)
        rope.sigma = sigma
        want = model.pos_embed(ids)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    rope.sigma = None
    assert counter.frame_count == 1  # one graph: no break, no recompile


def test_sd3_position_interpolation_against_diffusers_sincos() -> None:
    from diffusers.models.embeddings import get_1d_sincos_pos_embed_from_grid

    model, inputs = build("sd3")  # a 12 x 12 table (pos_embed_max_size), trained at 4 x 4 (sample_size 8, patch 2)
    reference = copy.deepcopy(model)
    vispos.patch(model, "sincos2d")
    vispos.configure(model, scaling="linear")
    torch.testing.assert_close(run(model, inputs(4, 4)), run(reference, inputs(4, 4)), rtol=0, atol=1e-6)
    table = model.pos_embed.__dict__["_vispos_table"]((8, 14), None)  # beyond the table's 12 columns
    y = (4 + torch.arange(8) / 2.0) / 3.0  # (top0 + r / s) / (M / base): top0 = (12 - 4) // 2, s = 8 / 4
    x = (4 + torch.arange(14) / 3.5) / 3.0
    yy, xx = torch.meshgrid(y, x, indexing="ij")
    dim = table.shape[-1]
    want = torch.cat((get_1d_sincos_pos_embed_from_grid(dim // 2, xx.reshape(-1)),
                      get_1d_sincos_pos_embed_from_grid(dim // 2, yy.reshape(-1))), dim=1).float()  # fmt: skip
    torch.testing.assert_close(table, want, rtol=0, atol=1e-6)
    assert run(model, inputs(7, 14)).isfinite().all()
    vispos.configure(model, scaling=None)
    with pytest.raises(ValueError, match="pos_embed_max_size"):
        run(model, inputs(7, 14))


def test_pixart_tables_already_interpolate() -> None:
    model, inputs = build("pixart")
    reference = copy.deepcopy(model)
    vispos.patch(model, "sincos2d")
    vispos.configure(model, scaling="linear")
    torch.testing.assert_close(run(model, inputs(8, 6)), run(reference, inputs(8, 6)), rtol=0, atol=1e-6)


def test_configure_refusals() -> None:
    model, _ = build("flux")
    vispos.patch(model, "rope2d")
    with pytest.raises(ValueError, match="'dynamic_ntk' scaling: a diffusers transformer takes linear, ntk, yarn"):
        vispos.configure(model, scaling="dynamic_ntk")
    with pytest.raises(ValueError, match="schedule='dype' schedules ntk or yarn"):
        vispos.configure(model, scaling="linear", schedule="dype")
    sd3, _ = build("sd3")
    vispos.patch(sd3, "sincos2d")
    with pytest.raises(ValueError, match="'yarn' scaling is a RoPE scaling"):
        vispos.configure(sd3, scaling="yarn")
    with pytest.raises(ValueError, match="log_n_attention on a sin-cos diffusion transformer"):
        vispos.configure(sd3, log_n_attention=True)
    assert sd3.vispos.log_n_tokens is None


def test_flux_dype_per_axis_at_the_forwards_noise_level() -> None:
    """The schedule through the host: each image axis of FLUX's rotation takes DyPE's YaRN at its own factor and the
    noise level of the forward's timestep (the factor 0.1 ln s + 1 on its own section), the first axis its own RoPE."""
    model = diffusers.FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=0,
        attention_head_dim=64, num_attention_heads=1, joint_attention_dim=8, pooled_projection_dim=8,
        axes_dims_rope=(8, 28, 28))  # fmt: skip
    vispos.patch(model, "rope2d")
    vispos.configure(model, scaling="yarn", schedule="dype", train_grid=(16, 16))
    ids = _flux_ids(32, 24, 3)  # s = 2 on y, 1.5 on x
    model.vispos.rotation.sigma = torch.tensor(0.6, dtype=torch.float64)
    cos, sin = model.pos_embed(ids)
    model.vispos.rotation.sigma = None
    base = 1e4 ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    y, m_y = _dype_yarn(28, 1e4, 16.0, 2.0, 0.6)
    x, m_x = _dype_yarn(28, 1e4, 16.0, 1.5, 0.6)
    angles = torch.cat((ids[:, :1].double() * base, ids[:, 1:2].double() * y, ids[:, 2:].double() * x), dim=-1)
    scale = torch.cat((torch.ones(4), torch.full((14,), m_y), torch.full((14,), m_x))).double()
    torch.testing.assert_close(cos, (angles.cos() * scale).repeat_interleave(2, -1).float(), rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, (angles.sin() * scale).repeat_interleave(2, -1).float(), rtol=0, atol=1e-6)


def test_qwen_text_rows_stay_unscaled_and_each_image_follows_its_own_extent() -> None:
    """As the DyPE authors' code: text rows at the model's own frequencies with magnitude 1 under any scaling, and
    in a multi-image edit each image scaled by its own extent, not the largest one's (nor the first one's)."""
    model, _ = build("qwen")
    reference = copy.deepcopy(model)
    vispos.patch(model, "rope2d")
    vispos.configure(model, scaling="yarn", schedule="dype", train_grid=(3, 3), log_n_attention=True)
    shapes = [(1, 4, 4), (1, 8, 6)]
    images, text = model.pos_embed([shapes], max_txt_seq_len=5)  # one list of shapes per batch row, as the host
    _, own_text = reference.pos_embed([shapes], max_txt_seq_len=5)
    torch.testing.assert_close(text, own_text, rtol=0, atol=1e-6)
    assert torch.allclose(text.abs(), torch.ones(()))
    first, _ = model.pos_embed([[shapes[0]]], max_txt_seq_len=5)  # the first image alone: its own extent
    torch.testing.assert_close(images[:16], first, rtol=0, atol=0)
    second, _ = model.pos_embed([[shapes[1]]], max_txt_seq_len=5)  # the second alone (its frame id differs: 1 vs 0)
    torch.testing.assert_close(images[16:, 2:], second[:, 2:], rtol=0, atol=0)
    assert images.shape[0] == 16 + 48
    assert not torch.allclose(images[:16], reference.pos_embed([[shapes[0]]], max_txt_seq_len=5)[0])  # scaled


@pytest.mark.parametrize("name", ROPE)
def test_dype_refuses_a_batch_of_mixed_timesteps(name: str) -> None:
    """One noise level per forward: a batch of several timesteps (training, img2img with per-sample strength) is
    refused under DyPE instead of taking the first sample's; without the schedule, or with one timestep, it runs."""
    model, inputs = build(name)
    vispos.patch(model, "rope2d")
    given = inputs(6, 5)
    batch = given  # Lumina 2's inputs hold two rows already
    if given["timestep"].numel() == 1:
        batch = {k: torch.cat([v, v]) if isinstance(v, torch.Tensor) and k not in ("img_ids", "txt_ids") else v
                 for k, v in given.items()}  # fmt: skip
    if name == "qwen":
        batch["img_shapes"] = given["img_shapes"] * 2
    same = batch["timestep"].clone()
    assert same.numel() == 2
    vispos.configure(model, scaling="yarn", train_grid=(3, 3))
    run(model, batch | {"timestep": same * torch.tensor([1.0, 0.5])})  # no schedule: the timestep is not read
    vispos.configure(model, scaling="yarn", schedule="dype")
    run(model, batch | {"timestep": same})  # guidance batches: one timestep
    with pytest.raises(RuntimeError, match="DyPE's schedule takes one noise level per forward"):
        run(model, batch | {"timestep": same * torch.tensor([1.0, 0.5])})


@pytest.mark.parametrize("kind", ["yarn", "ntk"])
def test_each_axis_scales_against_its_own_training_length(kind: str) -> None:
    """A non-square training grid: each axis's factor and YaRN's ramp come from that axis's own training length (the
    x axis's from the width, not the height)."""
    # axes of 14 channels and these lengths put YaRN's ramp ends on different pairs for y and x (whole pairs)
    model = vispos.patch(wide_flux(), "rope2d")
    vispos.configure(model, scaling=kind, train_grid=(10, 40))
    ids = torch.cat((torch.zeros(2, 3), _flux_ids(20, 80, 3)))  # both axes at twice their training size
    cos, _ = model.pos_embed(ids)
    freqs, factors = [], []
    for dim, setting, length in ((4, None, 1), (14, RopeScaling(kind, original_length=10), 20),
                                 (14, RopeScaling(kind, original_length=40), 80)):  # fmt: skip
        inv, factor = scaled_inv_freq(dim, 10000.0, setting, length)
        freqs.append(inv)
        factors.append(torch.full((dim // 2,), factor))
    angles = torch.cat([ids[:, a, None] * f for a, f in enumerate(freqs)], dim=-1)
    want = (angles.cos() * torch.cat(factors)).repeat_interleave(2, -1)
    torch.testing.assert_close(cos, want, rtol=0, atol=2e-6)


def test_the_default_training_grids_are_the_released_checkpoints() -> None:
    """The grids scalings are relative to by default: the DyPE authors' code's 64 for FLUX (1024 px) and 83 for
    Qwen-Image (1328 px), FLUX's for FLUX.2 and Lumina 2; the sin-cos families' config sample_size // patch_size."""
    expected = {"flux": (64, 64), "flux2": (64, 64), "qwen": (83, 83), "lumina": (64, 64), "sd3": (4, 4),
                "pixart": (4, 4), "dit": (4, 4)}  # fmt: skip
    for name, grid in expected.items():
        model, _ = build(name)
        vispos.patch(model, "rope2d" if name in ROPE else "sincos2d")
        assert tuple(model.vispos_cfg["train_grid"]) == grid, name


def test_flux2_refuses_its_kv_cache_under_a_scaling() -> None:
    """Keys cached at step 0 carry that step's extent and noise level: with a scaling or log-n the cache would break
    relative positions, so the combination is refused (without one the positions are the host's)."""
    model, inputs = build("flux2")
    vispos.patch(model, "rope2d")
    for setting in ({"scaling": "yarn", "schedule": "dype"}, {"log_n_attention": True}):
        vispos.configure(model, **{"scaling": None, "log_n_attention": False, **setting})
        with pytest.raises(ValueError, match="KV cache.*under a scaling or log-n attention"):
            run(model, inputs(4, 4) | {"kv_cache_mode": "extract"})


def wide_flux() -> torch.nn.Module:
    """A FLUX with RoPE sections of 14 channels: wide enough for YaRN's ramp ends to fall on different pairs."""
    return diffusers.FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                            attention_head_dim=32, num_attention_heads=2, joint_attention_dim=8,
                                            pooled_projection_dim=8, axes_dims_rope=(4, 14, 14))  # fmt: skip


def test_the_dype_papers_yarn_baseline_is_exponent_zero() -> None:
    """schedule={"type": "dype", "exponent": 0}: kappa = 1 at every step, the paper's YaRN baseline (its three bands
    at kappa = 1): the same rotation at every timestep, DyPE's at sigma 1, and not YaRN's own single ramp."""
    model = vispos.patch(wide_flux(), "rope2d")
    ids = torch.cat((torch.zeros(2, 3), _flux_ids(64, 64, 3)))
    rope = model.vispos.rotation

    def at(sigma: float, **setting: object) -> torch.Tensor:
        vispos.configure(model, train_grid=(32, 32), **setting)
        rope.sigma = torch.tensor(sigma, dtype=torch.float64)
        return model.pos_embed(ids)[0]

    baseline = {"scaling": "yarn", "schedule": {"type": "dype", "exponent": 0.0}}
    torch.testing.assert_close(at(0.1, **baseline), at(0.9, **baseline), rtol=0, atol=0)
    torch.testing.assert_close(at(0.3, **baseline), at(1.0, scaling="yarn", schedule="dype"), rtol=0, atol=0)
    assert not torch.allclose(at(0.3, **baseline), at(0.3, scaling="yarn", schedule=None))


def test_angles_follow_diffusers_device_rule_for_their_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """float64 angles, float32 on MPS and NPU (no float64 there), as diffusers' rope functions choose: the whole
    computation (positions, extent, noise level, scaled frequencies) in that dtype, close to the float64 result."""
    from vispos.encodings import dype

    assert dype.angle_dtype(torch.device("mps")) == torch.float32 == dype.angle_dtype("npu")
    assert dype.angle_dtype("cpu") == torch.float64 == dype.angle_dtype(torch.device("cuda", 0))
    model, _ = build("flux")
    vispos.patch(model, "rope2d")
    vispos.configure(model, scaling="yarn", schedule="dype", train_grid=(3, 3), log_n_attention=True)
    rope = model.vispos.rotation
    rope.sigma = torch.tensor(0.6, dtype=torch.float64)
    ids = torch.cat((torch.zeros(2, 3), _flux_ids(6, 5, 3)))
    wide = rope.pairs(ids)
    assert wide[0].dtype == torch.float64
    monkeypatch.setattr(dype, "angle_dtype", lambda device: torch.float32)  # the rule as it reads an MPS device
    monkeypatch.setattr(vispos.diffusers.rotary, "angle_dtype", lambda device: torch.float32)
    rope.sigma = rope.sigma.float()
    narrow = rope.pairs(ids)
    assert narrow[0].dtype == torch.float32 and narrow[1].dtype == torch.float32
    torch.testing.assert_close(narrow[0], wide[0].float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(narrow[1], wide[1].float(), rtol=1e-5, atol=1e-5)


def test_dype_refuses_a_timestep_on_another_scale() -> None:
    """FLUX reads its timestep as sigma in [0, 1]: a timestep of 500 (another family's scale) would be clamped to
    sigma 1 silently under DyPE; it is refused instead. An empty batch runs."""
    model, inputs = build("flux")
    vispos.patch(model, "rope2d")
    vispos.configure(model, scaling="yarn", schedule="dype", train_grid=(3, 3))
    with pytest.raises(RuntimeError, match=r"reads its timestep as sigma itself, in \[0, 1\]"):
        run(model, inputs(4, 4, 500.0))
    run(model, inputs(4, 4, 1.0))
    from vispos.diffusers.families import FAMILIES, noise_level

    assert noise_level(FAMILIES["FluxTransformer2DModel"], torch.zeros(0), single=True) is None


def test_without_a_timestep_dype_takes_its_full_strength() -> None:
    """The positional module called with no noise level of a forward (outside the transformer's forward, or a
    forward given no timestep) takes DyPE at sigma 1, the full scaling, not sigma 0 (none)."""
    model = vispos.patch(wide_flux(), "rope2d")
    vispos.configure(model, scaling="yarn", schedule="dype", train_grid=(32, 32))
    rope = model.vispos.rotation
    ids = torch.cat((torch.zeros(2, 3), _flux_ids(64, 64, 3)))
    assert rope.sigma is None
    unset = model.pos_embed(ids)[0]
    rope.sigma = torch.tensor(1.0, dtype=torch.float64)
    full = model.pos_embed(ids)[0]
    rope.sigma = torch.tensor(0.0, dtype=torch.float64)
    none = model.pos_embed(ids)[0]
    rope.sigma = None
    torch.testing.assert_close(unset, full, rtol=0, atol=0)
    assert not torch.allclose(unset, none)


def test_a_training_grid_in_pixels_is_refused() -> None:
    """train_grid counts latent tokens: (1024, 1024) on FLUX (16 px per token) is a size in pixels, refused."""
    model, _ = build("flux")
    vispos.patch(model, "rope2d")
    with pytest.raises(ValueError, match=r"counts latent tokens, not pixels.*train_grid=\(64, 64\)"):
        vispos.configure(model, scaling="yarn", train_grid=(1024, 1024))
    assert model.vispos.rotation.scaling is None and model.vispos.rotation.train_grid == (64, 64)  # nothing set
    with pytest.raises(ValueError, match="counts latent tokens"):
        vispos.configure(model, train_grid=(1024, 1024))
    assert "configured_train_grid" not in model.vispos_cfg
    vispos.configure(model, scaling="yarn", train_grid=(128, 96))  # 2048 x 1536 px: a grid some model trains at
