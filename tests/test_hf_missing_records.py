"""A checkpoint that lacks a patched model's settings records, loaded by transformers' loader: transformers puts an
uninitialised tensor in place of every key the checkpoint lacks (``_move_missing_keys_from_meta_to_device``,
``setattr`` on the key's module) before initialising them. A record is not a weight to initialise: the model keeps
its settings, and transformers reports the record missing (``vispos.hf.from_pretrained`` refuses such a folder by
name). Tiny random configs."""

from __future__ import annotations

import pytest
import torch

import vispos

tf = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

SIZE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37, image_size=32,
            patch_size=8)  # fmt: skip


def dinov3(pos: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = tf.DINOv3ViTModel(tf.DINOv3ViTConfig(num_register_tokens=2, **SIZE)).eval()
    return vispos.patch(model, pos, inherit=pos == "rope2d")


def records(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if k.endswith("._extra_state")}


@pytest.mark.parametrize("pos", ["rope2d", "relbias2d"])
def test_transformers_materialising_missing_records_leaves_the_settings(pos) -> None:
    """What transformers' loader does to every key a checkpoint lacks, done to the records: transformers' own
    ``_move_missing_keys_from_meta_to_device`` (uninitialised bytes), then bytes that are no record at all."""
    model = dinov3(pos)
    before, x = records(model), torch.randn(2, 3, 32, 32)
    assert before
    with torch.no_grad():
        out = model(x).last_hidden_state
    model._move_missing_keys_from_meta_to_device(set(before), None, None, None)
    for key in before:
        parent = model.get_submodule(key.rpartition(".")[0])
        parent._extra_state = torch.full_like(before[key], 255)  # not UTF-8
    after = records(model)
    for key in before:
        assert torch.equal(after[key], before[key]), key
    with torch.no_grad():
        torch.testing.assert_close(model(x).last_hidden_state, out, rtol=0, atol=0)


def test_a_folder_lacking_a_record_is_refused_by_name(tmp_path) -> None:
    """The whole loader: transformers reports the record missing and ``vispos.hf.from_pretrained`` names it."""
    dinov3("relbias2d").save_pretrained(tmp_path)
    (file,) = tmp_path.glob("*.safetensors")
    state = load_file(file)
    save_file({k: v for k, v in state.items() if k != "vispos._extra_state"}, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks the positional weights vispos\._extra_state"):
        vispos.hf.from_pretrained(tmp_path)
