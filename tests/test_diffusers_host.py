"""The diffusers host: ``vispos.patch`` on FLUX, FLUX.2, Qwen-Image, Lumina 2, SD3, PixArt and DiT keeps each one's
own positions (outputs equal to the unpatched transformer's on square, rectangular and odd latent grids), leaves the
text tokens' positions as the host gives them, and refuses what it does not do by name."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from diffusers_models import BUILDERS, ROPE, build, run

import vispos

diffusers = pytest.importorskip("diffusers")


def grids(name: str) -> list[tuple[int, int]]:
    if name == "dit":  # DiT's unpatchify takes square grids only
        return [(4, 4), (3, 3), (5, 5)]
    return [(4, 4), (3, 5), (5, 3)]


def scheme(name: str) -> str:
    return "rope2d" if name in ROPE else "sincos2d"


@pytest.mark.parametrize("name", list(BUILDERS))
def test_inherit_equals_the_unpatched_transformer(name: str) -> None:
    model, inputs = build(name)
    reference = copy.deepcopy(model)
    assert vispos.patch(model, scheme(name)) is model
    assert type(model).__name__ == type(reference).__name__  # save_pretrained writes the same _class_name
    for h, w in grids(name):
        torch.testing.assert_close(run(model, inputs(h, w)), run(reference, inputs(h, w)), rtol=0, atol=1e-6)


def _flux_ids(h: int, w: int, axes: int) -> torch.Tensor:
    from diffusers_models import _flux_ids

    return _flux_ids(h, w, axes)


def test_flux_text_ids_stay_unrotated_and_image_ids_match_the_host() -> None:
    model, _ = build("flux")
    own = copy.deepcopy(model.pos_embed)
    vispos.patch(model, "rope2d")
    ids = torch.cat((torch.zeros(3, 3), _flux_ids(3, 5, 3)))
    cos, sin = model.pos_embed(ids)
    want_cos, want_sin = own(ids)
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    assert torch.equal(cos[:3], torch.ones_like(cos[:3])) and torch.equal(sin[:3], torch.zeros_like(sin[:3]))


def test_qwen_text_offset_and_centred_image_ids_match_the_host() -> None:
    model, _ = build("qwen")
    own = copy.deepcopy(model.pos_embed)
    vispos.patch(model, "rope2d")
    for shape in ([[(1, 3, 5)]], [[(1, 4, 4), (1, 2, 3)]]):  # one image; a target and a reference image
        image, text = model.pos_embed(shape, torch.device("cpu"), max_txt_seq_len=4)
        want_image, want_text = own(shape, torch.device("cpu"), max_txt_seq_len=4)
        torch.testing.assert_close(image, want_image, rtol=0, atol=2e-6)
        torch.testing.assert_close(text, want_text, rtol=0, atol=2e-6)


def test_lumina_caption_positions_match_the_host() -> None:
    model, inputs = build("lumina")
    own = copy.deepcopy(model.rope_embedder)
    vispos.patch(model, "rope2d")
    given = inputs(3, 5)
    out = model.rope_embedder(given["hidden_states"], given["encoder_attention_mask"])
    want = own(given["hidden_states"], given["encoder_attention_mask"])
    for a, b in zip(out[1:4], want[1:4], strict=True):  # caption, image and joint rotations, complex128
        assert a.dtype == b.dtype == torch.complex128 and torch.equal(a, b)


def test_a_pipeline_is_patched_through_its_transformer_and_runs_end_to_end() -> None:
    model, _ = build("dit")
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",),
                                  up_block_types=("UpDecoderBlock2D",), block_out_channels=(8,), latent_channels=4,
                                  norm_num_groups=4, layers_per_block=1)  # fmt: skip
    pipe = diffusers.DiTPipeline(transformer=model, vae=vae, scheduler=diffusers.DDIMScheduler(num_train_timesteps=10))
    pipe.set_progress_bar_config(disable=True)

    def generate() -> torch.Tensor:
        return pipe(class_labels=[1], num_inference_steps=2, guidance_scale=1.0, output_type="pt",
                    generator=torch.Generator().manual_seed(0)).images  # fmt: skip

    before = generate()
    assert vispos.patch(pipe, "sincos2d") is pipe
    assert pipe.transformer.vispos_cfg["pos"] == ["sincos2d"]
    torch.testing.assert_close(generate(), before, rtol=0, atol=1e-6)


def test_refusals_name_what_is_accepted() -> None:
    model, _ = build("flux")
    with pytest.raises(ValueError, match=r"keeps a diffusion transformer's own positions \('rope2d' here\)"):
        vispos.patch(model, "alibi2d")
    with pytest.raises(ValueError, match="unknown|accepted"):
        vispos.patch(model, "no_such_scheme")
    with pytest.raises(ValueError, match="inherit=False"):
        vispos.patch(model, "rope2d", inherit=False)
    with pytest.raises(ValueError, match=r"options \['theta'\]"):
        vispos.patch(model, "rope2d", theta=100.0)
    sd3, _ = build("sd3")
    with pytest.raises(ValueError, match="'sincos2d' here"):
        vispos.patch(sd3, "rope2d")
    vispos.patch(model, "rope2d")
    with pytest.raises(ValueError, match="already patched"):
        vispos.patch(model, "rope2d")
    other = diffusers.SanaTransformer2DModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8,
                                             num_layers=1, num_cross_attention_heads=2, cross_attention_head_dim=8,
                                             cross_attention_dim=16, caption_channels=8, sample_size=8)  # fmt: skip
    with pytest.raises(TypeError, match=r"cannot patch diffusers SanaTransformer2DModel.*FluxTransformer2DModel.*"
                                        r"DiTTransformer2DModel"):  # fmt: skip
        vispos.patch(other, "rope2d")
    layered = diffusers.QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=1,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=8, axes_dims_rope=(4, 6, 6),
        use_layer3d_rope=True)  # fmt: skip
    with pytest.raises(TypeError, match="QwenEmbedRope; this one has QwenEmbedLayer3DRope"):
        vispos.patch(layered, "rope2d")


def test_the_version_floor_is_checked() -> None:
    from vispos.diffusers import DIFFUSERS_MIN, check_version

    floor = ".".join(map(str, DIFFUSERS_MIN))
    check_version(floor + ".0")
    check_version(diffusers.__version__)
    with pytest.raises(ImportError, match=rf"diffusers >= {floor}.*found 0\.41\.2"):
        check_version("0.41.2")
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    declared = next(line for line in pyproject.read_text().splitlines() if line.startswith("diffusers = "))
    assert f'"diffusers>={floor}"' in declared  # the floor the extra declares is the one checked


# what each family is saved with: its scaling above the training grid (with DyPE's schedule and log-n attention on
# the RoPE families; position interpolation of the sin-cos tables)
SAVED_WITH = {name: {"scaling": "yarn", "schedule": "dype", "log_n_attention": True} for name in ROPE}
SAVED_WITH |= {name: {"scaling": "linear"} for name in ("sd3", "pixart", "dit")}


@pytest.mark.parametrize("name", list(BUILDERS))
def test_save_pretrained_and_from_pretrained_keep_the_positions(name: str, tmp_path) -> None:
    from vispos.diffusers import from_pretrained

    model, inputs = build(name)
    vispos.patch(model, scheme(name))
    vispos.configure(model, train_grid=(3, 3), **SAVED_WITH[name])
    model.save_pretrained(tmp_path)
    loaded = from_pretrained(tmp_path)
    assert type(loaded) is type(model) and loaded.vispos_cfg == model.vispos_cfg
    own, back = model.state_dict(), loaded.state_dict()  # equal positions and weights, exactly
    assert own.keys() == back.keys()
    for key, value in own.items():
        torch.testing.assert_close(back[key], value, rtol=0, atol=0)
    given = inputs(6, 6) if name == "dit" else inputs(6, 5)  # above the training grid: the scaling is in use
    # two separately built models: outputs within float tolerance (GEMM paths follow memory alignment)
    torch.testing.assert_close(run(loaded, given), run(model, given), rtol=1e-5, atol=1e-6)
    model.save_pretrained(tmp_path / "bin", safe_serialization=False)  # as diffusers' own pipeline tests save
    pickled = from_pretrained(tmp_path / "bin")
    assert pickled.vispos_cfg == model.vispos_cfg
    torch.testing.assert_close(run(pickled, given), run(model, given), rtol=1e-5, atol=1e-6)
    plain, _ = build(name, seed=1)
    plain.save_pretrained(tmp_path / "plain")  # saved without vispos: its own positions, no scaling
    again = from_pretrained(tmp_path / "plain")
    assert again.vispos_cfg.get("scaling") is None
    # its own positions recomputed through the core: equal to the host's (Qwen-Image's within float rounding)
    torch.testing.assert_close(run(again, given), run(plain, given), rtol=0, atol=1e-6)


def test_sd3_keeps_its_stored_table_and_refuses_to_interpolate_another() -> None:
    """SD3 keeps pos_embed as a persistent buffer its checkpoint loads: a stored table other than the formula's is
    used as diffusers uses it (cropped), and interpolating the formula's table in its place is refused by name."""
    model, inputs = build("sd3")
    with torch.no_grad():
        model.pos_embed.pos_embed.add_(0.05 * torch.randn_like(model.pos_embed.pos_embed))
    reference = copy.deepcopy(model)
    vispos.patch(model, "sincos2d")
    for h, w in ((4, 4), (6, 5)):
        torch.testing.assert_close(run(model, inputs(h, w)), run(reference, inputs(h, w)), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="stored pos_embed is not the sin-cos formula's table"):
        vispos.configure(model, scaling="linear", train_grid=(3, 3))
    untouched, _ = build("sd3")
    vispos.patch(untouched, "sincos2d")
    vispos.configure(untouched, scaling="linear", train_grid=(3, 3))  # the formula's table: interpolated


@pytest.mark.parametrize("inherit", [True, False])
def test_a_pipeline_holding_a_patched_transformer_saves_and_reloads(inherit: bool, tmp_path) -> None:
    """A pipeline given an already patched transformer records diffusers' class in model_index.json: diffusers'
    own from_pretrained reloads it (the transformer unpatched, as transformers reloads a patched model), and
    vispos.diffusers.from_pretrained(folder, subfolder="transformer") gives the patched one back."""
    from vispos.diffusers import from_pretrained

    model, _ = build("dit")
    vispos.patch(model, "sincos2d" if inherit else "rope2d", inherit=inherit)
    vispos.configure(model, scaling="linear" if inherit else "yarn")
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",),
                                  up_block_types=("UpDecoderBlock2D",), block_out_channels=(8,), latent_channels=4,
                                  norm_num_groups=4, layers_per_block=1)  # fmt: skip
    pipe = diffusers.DiTPipeline(transformer=model, vae=vae, scheduler=diffusers.DDIMScheduler(num_train_timesteps=10))
    pipe.transformer = model  # assigning it again records it again
    pipe.save_pretrained(tmp_path)
    index = json.loads((tmp_path / "model_index.json").read_text())
    assert index["transformer"] == ["diffusers", "DiTTransformer2DModel"]
    again = diffusers.DiffusionPipeline.from_pretrained(tmp_path)
    assert type(again.transformer) is diffusers.DiTTransformer2DModel
    patched = from_pretrained(tmp_path, subfolder="transformer")
    assert patched.vispos_cfg["scaling"] == model.vispos_cfg["scaling"]
    assert type(patched).__name__ == "DiTTransformer2DModel" and hasattr(patched, "vispos")


@pytest.mark.parametrize("inherit", [True, False])
def test_the_patched_class_builds_no_model(inherit: bool, tmp_path) -> None:
    """diffusers' class idioms on a patched class would build a model without positions: refused by name."""
    from vispos.diffusers import from_pretrained

    model, _ = build("dit")
    vispos.patch(model, "sincos2d" if inherit else "rope2d", inherit=inherit)
    model.save_pretrained(tmp_path)
    for make in (lambda: type(model)(**model.config), lambda: type(model).from_config(model.config),
                 lambda: type(model).from_pretrained(tmp_path)):  # fmt: skip
        with pytest.raises(TypeError, match=r"builds no model.*vispos.diffusers.from_pretrained"):
            make()
    assert hasattr(from_pretrained(tmp_path), "vispos")
    assert hasattr(copy.deepcopy(model), "vispos")  # copies are not builds


def test_inherit_keeps_an_interpolation_scale_other_than_one() -> None:
    """PixArt's table divides its coordinates by interpolation_scale (PixArt-Sigma's 2 at 1024 px; DiT's config has
    none: always 1)."""
    model, inputs = build("pixart")
    torch.manual_seed(0)
    model = type(model).from_config(dict(model.config) | {"interpolation_scale": 2}).eval()
    reference = copy.deepcopy(model)
    vispos.patch(model, "sincos2d")
    for h, w in ((4, 4), (6, 5)):
        torch.testing.assert_close(run(model, inputs(h, w)), run(reference, inputs(h, w)), rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", ["flux", "qwen", "sd3", "dit"])
def test_released_weights_load_strictly_into_a_patched_transformer(name: str) -> None:
    """A plain diffusers checkpoint has no vispos records: it loads strictly, the model keeping its own settings."""
    model, inputs = build(name)
    released = build(name, seed=1)[0]
    vispos.patch(model, "rope2d" if name in ROPE else "sincos2d")
    vispos.configure(model, scaling="linear", train_grid=(3, 3))
    model.load_state_dict(released.state_dict())  # strict
    assert model.vispos_cfg["scaling"] == {"scaling": "linear"}
    vispos.configure(model, scaling=None)
    given = inputs(4, 4)
    torch.testing.assert_close(run(model, given), run(released, given), rtol=1e-5, atol=1e-6)
    fresh = vispos.patch(build("dit")[0], "learned2d", inherit=False)
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*vispos\.additive"):  # the scheme's weights: not there
        fresh.load_state_dict(build("dit", seed=1)[0].state_dict())


def test_from_pretrained_reports_no_vispos_record_as_unused(tmp_path, caplog) -> None:
    """diffusers' "weights not used" warning is for weights nobody reads: the records vispos restores are left out."""
    import logging

    from vispos.diffusers import from_pretrained

    model, _ = build("dit")
    vispos.patch(model, "rope2d", inherit=False)
    model.save_pretrained(tmp_path)
    diffusers.utils.logging.enable_propagation()
    try:
        with caplog.at_level(logging.WARNING):
            loaded = from_pretrained(tmp_path)
    finally:
        diffusers.utils.logging.disable_propagation()
    assert "were not used" not in caplog.text
    assert type(loaded).__bases__[-1] is diffusers.DiTTransformer2DModel  # not the loading subclass
