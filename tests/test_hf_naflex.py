"""SigLIP 2 (NaFlex) rows: its own table kept, and each image of a padded batch the positions of its own grid."""

from __future__ import annotations

import copy

import pytest
import torch

import vispos

tf = pytest.importorskip("transformers")

from test_hf_patch import SCHEMES_2D  # noqa: E402


def _siglip2() -> torch.nn.Module:
    config = tf.Siglip2VisionConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                    patch_size=8, num_patches=16)  # fmt: skip
    model = tf.Siglip2VisionModel(config).eval()
    with torch.no_grad():
        model.embeddings.position_embedding.weight.normal_()
    return model


def _naflex_batch(shapes: list[tuple[int, int]], tokens: int) -> dict[str, torch.Tensor]:
    """Rows as SigLIP 2's processor makes them: each image's patches row-major, then padding."""
    pixels, mask = torch.zeros(len(shapes), tokens, 3 * 64), torch.zeros(len(shapes), tokens, dtype=torch.long)
    for i, (h, w) in enumerate(shapes):
        pixels[i, : h * w], mask[i, : h * w] = torch.randn(h * w, 3 * 64), 1
    return {"pixel_values": pixels, "pixel_attention_mask": mask, "spatial_shapes": torch.tensor(shapes)}


SHAPES = [(4, 4), (3, 5), (6, 2), (2, 7)]


def test_siglip2_naflex_keeps_its_table_and_each_image_its_own_grid() -> None:
    model = _siglip2()
    batch = _naflex_batch(SHAPES, 16)
    patched = vispos.patch(copy.deepcopy(model), "learned2d")
    assert patched.vispos.additive.interpolation == "bilinear" and patched.vispos.additive.antialias
    fresh = vispos.patch(copy.deepcopy(model), "learned2d", inherit=False)
    with torch.no_grad():
        want, got, control = (m(**batch) for m in (model, patched, fresh))
    for i, (h, w) in enumerate(SHAPES):  # padding rows are not compared: every key there is masked
        torch.testing.assert_close(got.last_hidden_state[i, : h * w], want.last_hidden_state[i, : h * w], rtol=0,
                                   atol=1e-5)  # fmt: skip
    torch.testing.assert_close(got.pooler_output, want.pooler_output, rtol=0, atol=1e-5)
    assert (control.pooler_output - want.pooler_output).abs().max() > 1e-3


ONE_GRID = vispos.list_encodings(2, kind="query_bias")  # refused in ragged batches (test_decomposed2d, test_irpe2d)


@pytest.mark.parametrize("scheme", ONE_GRID)
def test_siglip2_refuses_a_query_dependent_bias_at_patch_time(scheme: str) -> None:
    with pytest.raises(ValueError, match=rf"^{scheme} on Siglip2VisionModel: a query-dependent bias .* alibi2d"):
        vispos.patch(_siglip2(), scheme, inherit=False)


@pytest.mark.parametrize("scheme", [s for s in SCHEMES_2D if s not in ONE_GRID])
def test_siglip2_padded_batch_equals_each_image_alone(scheme: str) -> None:
    model = vispos.patch(_siglip2(), scheme, inherit=False)
    batch = _naflex_batch(SHAPES, 16)
    with torch.no_grad():
        together = model(**batch).last_hidden_state
        for i, (h, w) in enumerate(SHAPES):
            alone = {k: v[i : i + 1, : h * w] if v.dim() == 2 and k != "spatial_shapes" else v[i : i + 1]
                     for k, v in batch.items()}  # fmt: skip
            alone["pixel_values"] = batch["pixel_values"][i : i + 1, : h * w]
            torch.testing.assert_close(together[i, : h * w], model(**alone).last_hidden_state[0], rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="spatial_shapes"):
        model(pixel_values=batch["pixel_values"], pixel_attention_mask=batch["pixel_attention_mask"])
