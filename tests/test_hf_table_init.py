"""transformers' weight init on a model patched with its own table inherited draws what it draws on the unpatched
model: the family's init draws the table (held by vispos's learned2d) in its order with the module's other weights,
and learned2d takes those values. The reference is the unpatched model, initialised by transformers under the same
seed; also with a reseed before each module's init, as transformers' own test of its init does."""

from __future__ import annotations

import pytest
import torch

import vispos

tf = pytest.importorskip("transformers")

SIZE = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=37, image_size=32,
            patch_size=8)  # fmt: skip
GRID = 4  # 32 / 8
# family -> (build, the table's key in the unpatched state dict, learned2d's in the patched one, its prefix rows):
# a Parameter table behind a head, nn.Embedding tables (the embeddings' last child) with a prefix row and without
FAMILIES = {
    "dinov2": (lambda: tf.Dinov2ForImageClassification(tf.Dinov2Config(**SIZE, num_labels=3)),
               "dinov2.embeddings.position_embeddings", "dinov2.vispos.additive", 1),
    "clip": (lambda: tf.CLIPVisionModel(tf.CLIPVisionConfig(**SIZE)), "embeddings.position_embedding.weight",
             "vispos.additive", 1),
    "siglip": (lambda: tf.SiglipVisionModel(tf.SiglipVisionConfig(**SIZE)), "embeddings.position_embedding.weight",
               "vispos.additive", 0),
}  # fmt: skip


def initialised(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """transformers' init of every module of ``model`` (as after a meta-device build or a load lacking every weight)
    under ``seed``: its state dict."""
    for module in model.modules():
        module.__dict__.pop("_is_hf_initialized", None)
    torch.manual_seed(seed)
    model.initialize_weights()
    return model.state_dict()


def reseeding(monkeypatch: pytest.MonkeyPatch) -> None:
    """A reseed before each module's init step (transformers' ``seeded_weight_init``)."""
    step = tf.PreTrainedModel._initialize_weights

    def seeded(*args, **kwargs):
        torch.manual_seed(42)
        step(*args, **kwargs)

    monkeypatch.setattr(tf.PreTrainedModel, "_initialize_weights", seeded)


@pytest.mark.parametrize("reseeded", [False, True], ids=["one_seed", "reseeded"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_transformers_init_of_an_inheriting_patched_model_is_the_unpatched_models(family, reseeded, monkeypatch):
    build, key, learned, prefix = FAMILIES[family]
    if reseeded:
        reseeding(monkeypatch)
    plain = initialised(build(), seed=7)
    with torch.device("meta"):  # how transformers builds a model before loading
        model = build()
    vispos.patch(model, "learned2d")
    model.to_empty(device="cpu")
    patched = initialised(model, seed=7)
    table = plain.pop(key).reshape(1, -1, SIZE["hidden_size"])
    expected = plain | {f"{learned}.table": table[0, prefix:].reshape(GRID, GRID, -1)}
    if prefix:
        expected[f"{learned}.prefix"] = table[0, :prefix]
    assert {k for k, v in patched.items() if v.is_floating_point()} == {k for k, v in expected.items()
                                                                         if v.is_floating_point()}  # fmt: skip
    for name, tensor in expected.items():
        torch.testing.assert_close(patched[name], tensor, rtol=0, atol=0, msg=name)


def test_a_loaded_learned2d_keeps_its_weights_when_the_embeddings_are_initialised(tmp_path) -> None:
    """A patched checkpoint lacking ``cls_token`` loaded by transformers into a model patched as it is built: the
    embeddings are initialised (the stand-in of the table with them), learned2d keeps the weights it loaded."""
    config = tf.Dinov2Config(**SIZE)
    saved = vispos.patch(tf.Dinov2Model(config), "learned2d")
    with torch.no_grad():
        for p in saved.vispos.parameters():
            p.add_(1.0)
    saved.save_pretrained(tmp_path, state_dict={k: v for k, v in saved.state_dict().items()
                                                 if k != "embeddings.cls_token"})  # fmt: skip

    def __init__(self, config):  # noqa: N807
        tf.Dinov2Model.__init__(self, config)
        vispos.patch(self, "learned2d")

    # transformers' own module, or it takes the class for custom code and skips the family's key conversions
    Patching = type("Dinov2Model", (tf.Dinov2Model,), {"__init__": __init__, "__module__": tf.Dinov2Model.__module__})
    loaded, info = Patching.from_pretrained(tmp_path, output_loading_info=True)
    assert set(info["missing_keys"]) == {"embeddings.cls_token"}
    for name, tensor in saved.vispos.state_dict().items():
        torch.testing.assert_close(loaded.vispos.state_dict()[name], tensor, rtol=0, atol=0, msg=name)
    assert loaded.embeddings.position_embeddings is None
    assert "embeddings.position_embeddings" not in loaded.state_dict()
