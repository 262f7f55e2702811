"""vispos.hf.from_pretrained builds a saved model as it was built: a backbone without its optional head (ViT's and
DeiT's pooler, DINOv2's mask token, SigLIP's attention-pooling head) comes back without it, one with it comes back
with it, and a checkpoint transformers' from_pretrained loads (missing weights newly initialised, extra ones
dropped) loads, with the original's outputs where the weights exist. Tiny random configs only."""

from __future__ import annotations

import importlib
import inspect
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import vispos

tf = pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402
from test_hf_naflex import SHAPES, _naflex_batch  # noqa: E402
from test_hf_patch import SIZE, config  # noqa: E402

POS = ["learned2d", "rope2d_mixed"]  # a table and learned frequencies: both must come back
NAFLEX = {k: v for k, v in SIZE.items() if k != "image_size"} | {"num_patches": 16}

# every family built without its optional head(s) where its constructor or its config has one
WITHOUT: dict[str, Callable[[], torch.nn.Module]] = {
    "vit": lambda: tf.ViTModel(config(tf.ViTConfig), add_pooling_layer=False),
    "deit": lambda: tf.DeiTModel(config(tf.DeiTConfig), add_pooling_layer=False),
    "dinov2": lambda: tf.Dinov2Model(config(tf.Dinov2Config, mlp_ratio=2, use_mask_token=False)),
    "dinov2_reg": lambda: tf.Dinov2WithRegistersModel(  # no option: its mask token is always there
        config(tf.Dinov2WithRegistersConfig, mlp_ratio=2, num_register_tokens=4)
    ),
    "dinov3": lambda: tf.DINOv3ViTModel(config(tf.DINOv3ViTConfig, num_register_tokens=4)),  # no option
    "clip": lambda: tf.CLIPVisionModel(config(tf.CLIPVisionConfig)),  # no option
    "siglip": lambda: tf.SiglipVisionModel(config(tf.SiglipVisionConfig, vision_use_head=False)),
    "siglip2": lambda: tf.Siglip2VisionModel(tf.Siglip2VisionConfig(**NAFLEX, vision_use_head=False)),
}
# the same families with the optional head(s) built (their defaults)
WITH: dict[str, Callable[[], torch.nn.Module]] = {
    "vit": lambda: tf.ViTModel(config(tf.ViTConfig)),
    "deit": lambda: tf.DeiTModel(config(tf.DeiTConfig)),
    "dinov2": lambda: tf.Dinov2Model(config(tf.Dinov2Config, mlp_ratio=2)),
    "siglip": lambda: tf.SiglipVisionModel(config(tf.SiglipVisionConfig)),
    "siglip2": lambda: tf.Siglip2VisionModel(tf.Siglip2VisionConfig(**NAFLEX)),
}
OPTIONAL = {"vit": "pooler", "deit": "pooler", "dinov2": "embeddings.mask_token", "siglip": "head", "siglip2": "head"}


def patched(model: torch.nn.Module) -> torch.nn.Module:
    """The model patched with ``POS``, its positional parameters off their init (trained-looking)."""
    model = vispos.patch(model.eval(), POS, inherit=False)
    with torch.no_grad():
        for p in model.vispos.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def batch(family: str) -> dict[str, torch.Tensor]:
    return _naflex_batch(SHAPES, 16) if family == "siglip2" else {"pixel_values": torch.randn(2, 3, 32, 48)}


def outputs(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        out = model(**inputs)
    return {k: v for k in ("last_hidden_state", "pooler_output") if (v := getattr(out, k, None)) is not None}


def assert_same_outputs(loaded: torch.nn.Module, model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> None:
    got, want = outputs(loaded, inputs), outputs(model, inputs)
    assert got.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-5, msg=name)


def submodule(model: torch.nn.Module, path: str) -> object:
    """The optional part at ``path`` (an attribute path), or None where the model has none."""
    found: object = model
    for part in path.split("."):
        found = getattr(found, part, None)
    return found


@pytest.mark.parametrize("family", sorted(WITHOUT))
def test_a_model_saved_without_its_optional_heads_comes_back_without_them(family: str, tmp_path: Path) -> None:
    model = patched(WITHOUT[family]())
    model.save_pretrained(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # built as saved: every weight has its place, nothing to report
        loaded = vispos.hf.from_pretrained(tmp_path)
    assert type(loaded) is type(model) and loaded.state_dict().keys() == model.state_dict().keys()
    if family in OPTIONAL:
        assert submodule(loaded, OPTIONAL[family]) is None
    assert_same_outputs(loaded, model, batch(family))


@pytest.mark.parametrize("family", sorted(WITH))
def test_a_model_saved_with_its_optional_heads_still_round_trips(family: str, tmp_path: Path) -> None:
    model = patched(WITH[family]())
    model.save_pretrained(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = vispos.hf.from_pretrained(tmp_path)
    assert submodule(loaded, OPTIONAL[family]) is not None
    assert loaded.state_dict().keys() == model.state_dict().keys()
    assert_same_outputs(loaded, model, batch(family))


@pytest.mark.parametrize("cls", ["ViTModel", "DeiTModel"])
def test_a_mask_token_comes_back_and_masks_as_saved(cls: str, tmp_path: Path) -> None:
    """``use_mask_token=True`` (off by default) without a pooler: both read back from the checkpoint's keys."""
    model_cls, config_cls = getattr(tf, cls), getattr(tf, cls.replace("Model", "Config"))
    model = patched(model_cls(config(config_cls), add_pooling_layer=False, use_mask_token=True))
    with torch.no_grad():
        model.embeddings.mask_token.normal_()
    model.save_pretrained(tmp_path)
    loaded = vispos.hf.from_pretrained(tmp_path)
    assert loaded.pooler is None
    torch.testing.assert_close(loaded.embeddings.mask_token, model.embeddings.mask_token, rtol=0, atol=0)
    inputs = {"pixel_values": torch.randn(2, 3, 32, 32), "bool_masked_pos": torch.rand(2, 16) > 0.5}
    assert_same_outputs(loaded, model, inputs)


def test_options_passed_by_keyword_build_the_model_as_transformers_does(tmp_path: Path) -> None:
    """A keyword option wins over the checkpoint's keys: what it adds is newly initialised, what it removes is
    dropped (said in a warning, as transformers' from_pretrained reports them), the rest gives equal outputs."""
    x = {"pixel_values": torch.randn(2, 3, 32, 32)}
    bare, pooled = patched(WITHOUT["vit"]()), patched(WITH["vit"]())
    bare.save_pretrained(tmp_path / "bare")
    pooled.save_pretrained(tmp_path / "pooled")
    with pytest.warns(UserWarning, match=r"newly initialised: pooler\.dense\.bias, pooler\.dense\.weight"):
        grown = vispos.hf.from_pretrained(tmp_path / "bare", add_pooling_layer=True)
    reference = tf.ViTModel.from_pretrained(tmp_path / "bare", add_pooling_layer=True)  # transformers' own
    assert grown.pooler is not None and reference.pooler is not None
    torch.testing.assert_close(outputs(grown, x)["last_hidden_state"], outputs(bare, x)["last_hidden_state"],
                               rtol=0, atol=1e-5)  # fmt: skip
    with pytest.warns(UserWarning, match=r"dropped: pooler\.dense\.bias, pooler\.dense\.weight"):
        cut = vispos.hf.from_pretrained(tmp_path / "pooled", add_pooling_layer=False)
    assert cut.pooler is None and cut.state_dict().keys() == bare.state_dict().keys()
    torch.testing.assert_close(outputs(cut, x)["last_hidden_state"], outputs(pooled, x)["last_hidden_state"],
                               rtol=0, atol=1e-5)  # fmt: skip
    eager = vispos.hf.from_pretrained(tmp_path / "bare", attn_implementation="eager", hidden_dropout_prob=0.0)
    assert eager.pooler is None and eager.config._attn_implementation == "eager"  # config keywords as before


def test_options_are_checked_by_name(tmp_path: Path) -> None:
    patched(WITHOUT["vit"]()).save_pretrained(tmp_path / "vit")
    patched(WITHOUT["dinov2"]()).save_pretrained(tmp_path / "dinov2")
    with pytest.raises(TypeError, match="add_pooling_layer must be a bool"):
        vispos.hf.from_pretrained(tmp_path / "vit", add_pooling_layer="no")
    with pytest.raises(ValueError, match=r"Dinov2Model takes no option 'add_pooling_layer'.*config.*it has none"):
        vispos.hf.from_pretrained(tmp_path / "dinov2", add_pooling_layer=False)
    with pytest.raises(ValueError, match=r"ViTModel takes no option 'hiden_size'.*add_pooling_layer, use_mask_token"):
        vispos.hf.from_pretrained(tmp_path / "vit", hiden_size=32)


def test_missing_weights_load_as_in_transformers_but_the_positions_are_required(tmp_path: Path) -> None:
    """A weight missing outside the positions is newly initialised (transformers loads such a checkpoint too);
    a missing positional weight is refused by name: the folder no longer holds the positions it records."""
    model = patched(WITHOUT["vit"]())
    model.save_pretrained(tmp_path)
    (file,) = tmp_path.glob("*.safetensors")
    state = load_file(file)
    save_file({k: v for k, v in state.items() if k != "layernorm.weight"}, file, metadata={"format": "pt"})
    with pytest.warns(UserWarning, match=r"newly initialised: layernorm\.weight"):
        loaded = vispos.hf.from_pretrained(tmp_path)
    assert tf.ViTModel.from_pretrained(tmp_path, add_pooling_layer=False).pooler is None  # transformers loads it
    torch.testing.assert_close(loaded.layernorm.weight, torch.ones(64), rtol=0, atol=0)  # LayerNorm's init
    torch.testing.assert_close(loaded.vispos.attention[0].freqs, model.vispos.attention[0].freqs, rtol=0, atol=0)
    save_file({k: v for k, v in state.items() if k != "vispos.additive.table"}, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks the positional weights vispos\.additive\.table"):
        vispos.hf.from_pretrained(tmp_path)


def test_every_constructor_option_of_the_families_is_read_back() -> None:
    """Every option a supported family's model class takes besides its config is read back from a checkpoint's keys
    (``CONSTRUCTOR_OPTIONS``): a release adding one fails here rather than in a user's from_pretrained."""
    from vispos.hf.families import CONSTRUCTOR_OPTIONS

    seen = set()
    for name in ("vit", "deit", "dinov2", "dinov2_with_registers", "dinov3_vit", "clip", "siglip", "siglip2"):
        module = importlib.import_module(f"transformers.models.{name}")
        for cls in (getattr(module, attr) for attr in dir(module)):  # a lazy module: its names, not its vars
            if not (isinstance(cls, type) and issubclass(cls, tf.PreTrainedModel) and "PreTrained" not in cls.__name__):
                continue
            options = set(inspect.signature(cls.__init__).parameters) - {"self", "config"}
            assert options == set(CONSTRUCTOR_OPTIONS.get(cls.__name__, {})), cls.__name__
            seen.add(cls.__name__)
    assert {"ViTModel", "DeiTModel", "Dinov2Model", "DINOv3ViTModel", "Siglip2VisionModel"} <= seen
