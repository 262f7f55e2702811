"""What the VLM towers refuse, and how: schemes a tower cannot take and towers vispos does not support, by name; a
query-dependent bias at ``patch`` time (the towers always pack); and inputs that do not match each other where they
arrive, named by the argument they are in. Tiny random configs (``hf_towers``)."""

from __future__ import annotations

import pytest
import torch

import vispos

tf = pytest.importorskip("transformers")

from hf_towers import QWENS, images, patches, pixtral, qwen, run, run_qwen  # noqa: E402


@pytest.mark.parametrize("scheme", vispos.list_encodings(2, kind="query_bias"))
@pytest.mark.parametrize("family", ["pixtral", *QWENS])
def test_a_query_dependent_bias_is_refused_at_patch_time_naming_the_scheme(scheme: str, family: str) -> None:
    """decomposed2d and irpe2d read one grid's table at each query: the towers always pack, so ``patch`` refuses them
    (not the first forward), naming the scheme, the tower and the attention schemes it takes."""
    tower = pixtral() if family == "pixtral" else qwen(family=family)
    name = type(tower).__name__
    with pytest.raises(ValueError, match=rf"^{scheme} on {name}: a query-dependent bias .* packs every batch.*"
                       r"takes: alibi2d, .*rope2d"):  # fmt: skip
        vispos.patch(tower, scheme, inherit=False)
    assert not hasattr(tower, "vispos")  # refused before anything changed


def test_tower_input_mistakes_are_named_by_the_argument_they_are_in() -> None:
    """Pixtral's image_sizes larger than the pixel_values they are cut from, Qwen rows that grid_thw does not count:
    refused where the inputs arrive, naming the argument and the shapes given."""
    model = vispos.patch(pixtral(), "rope2d")
    x = images()  # [3, 3, 48, 64]
    with pytest.raises(ValueError, match=r"image_sizes \[\(48, 72\)\] exceed pixel_values of shape \(3, 3, 48, 64\)"):
        run(model, x, torch.tensor([[48, 64], [32, 40], [48, 72]]))
    for family in QWENS:
        tower = vispos.patch(qwen(family=family), "rope2d")
        with pytest.raises(ValueError, match=r"grid_thw \[\[1, 4, 6\]\] names 24 patches .*\(hidden_states\) "
                           r"have shape \(52, 96\)"):  # fmt: skip
            run_qwen(tower, patches(), torch.tensor([[1, 4, 6]]))


def test_unsupported_schemes_and_towers_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="learned2d on PixtralVisionModel: the tower has no token table"):
        vispos.patch(pixtral(), ["learned2d", "rope2d"])
    model = vispos.patch(pixtral(), "rope2d")
    with pytest.raises(ValueError, match="already patched"):
        vispos.patch(model, "rope2d")
    from transformers.models.idefics3.modeling_idefics3 import Idefics3VisionTransformer

    config = tf.Idefics3VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                     image_size=32, patch_size=4)  # fmt: skip
    tower = Idefics3VisionTransformer._from_config(config)
    with pytest.raises(TypeError, match=r"Idefics3 / SmolVLM's SigLIP tower .* supported vision towers: "
                       "PixtralVisionModel, Qwen2VisionTransformerPretrainedModel, "
                       "Qwen2_5_VisionTransformerPretrainedModel, Qwen3VLVisionModel"):  # fmt: skip
        vispos.patch(tower, "rope2d")
    with pytest.raises(ValueError, match=r"grid_thw must be a tensor \[N, 3\]"):
        vispos.patch(qwen(), "rope2d")(patches(), grid_thw=torch.tensor([4, 6]))
    with pytest.raises(ValueError, match="does not tile into 2 x 2 merge blocks"):
        vispos.patch(qwen(), "rope2d")(patches(torch.tensor([[1, 3, 6]])), grid_thw=torch.tensor([[1, 3, 6]]))
