"""The settings record (``vispos._state``): one shape whatever it holds, so that timm's EMA and distributed
checkpoints handle a patched model whose settings changed; readable after a cast to half precision; every
option recorded with its value; older records read with the defaults of the vispos that wrote them."""

from __future__ import annotations

import json
import random
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from timm.utils import ModelEmaV2, ModelEmaV3

import vispos
from vispos import _state
from vispos.positions import canonical_options, same_positions


def make(pos: str | list[str], *, img: int = 32, seed: int = 0, **options: object) -> torch.nn.Module:
    """A one-block ViT of 8 px patches (a 4 x 4 grid at 32 px), random weights."""
    torch.manual_seed(seed)
    return vispos.create_model("vit_tiny_patch16_224", pos=pos, pos_options=options, img_size=img, patch_size=8,
                               depth=1, num_classes=3).eval()  # fmt: skip


def images(size: int = 32) -> torch.Tensor:
    return torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(1))


def records(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if k.endswith("_extra_state")}


def format1(model: torch.nn.Module) -> dict[str, object]:
    """The model's state dict as a vispos of format 1 wrote it: unpadded JSON, the options as given."""
    state = model.state_dict()
    for key, record in records(model).items():
        if record.dtype != torch.uint8:  # another module's extra state (string2d's folded flag)
            continue
        settings = _state.decode(record)
        if key == "vispos._extra_state":
            settings["settings"]["options"] = dict(model.vispos.settings["options"])
        text = json.dumps({"format": 1, **settings}, sort_keys=True, separators=(",", ":"))
        state[key] = torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)
    return state


def test_every_record_has_one_shape_whatever_it_holds() -> None:
    model = make(["learned2d", "rope2d"])
    before = {k: v.shape for k, v in records(model).items()}
    vispos.configure(model, scaling="yarn", log_n_attention=True)
    after = {k: v.shape for k, v in records(model).items()}
    assert before == after and set(after.values()) == {torch.Size([_state.RECORD_BYTES])}
    assert set(records(make("relbias2d")).keys()) and {v.shape for v in records(make("relbias2d")).values()} == {
        torch.Size([_state.RECORD_BYTES])}


@pytest.mark.parametrize("ema_class", [ModelEmaV2, ModelEmaV3])
def test_timm_ema_updates_after_configure_on_the_live_model(ema_class: type) -> None:
    model = make(["learned2d", "rope2d"])
    ema = ema_class(model, decay=0.5)
    vispos.configure(model, scaling="yarn", log_n_attention=True)  # the live model's record grows
    with torch.no_grad():
        model.head.weight.add_(1.0)
    before = ema.module.head.weight.clone()
    ema.update(model)
    torch.testing.assert_close(ema.module.head.weight, 0.5 * before + 0.5 * model.head.weight)
    assert "scaling" not in ema.module.vispos.settings  # the EMA's settings are its own


def test_distributed_checkpoint_loads_across_grids_and_settings(tmp_path: Path) -> None:
    """torch.distributed.checkpoint plans every tensor's shape from the model it loads into: a checkpoint of a
    model configured for YaRN at 32 px loads into one at 64 px without those settings."""
    saved = make("rope2d", seed=0)
    vispos.configure(saved, scaling="yarn", log_n_attention=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: torch warns that it saves in one process
        dcp.save(saved.state_dict(), checkpoint_id=tmp_path / "dcp")
        target = make("rope2d", img=64, seed=1)
        state = target.state_dict()
        dcp.load(state, checkpoint_id=tmp_path / "dcp")
    target.load_state_dict(state)
    for key, value in saved.state_dict().items():
        if value.is_floating_point():
            torch.testing.assert_close(target.state_dict()[key], value, rtol=0, atol=0, msg=key)
    assert target.vispos.settings["scaling"]["scaling"] == "yarn"  # inference settings as saved


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int64])
def test_a_state_dict_cast_wholesale_loads(dtype: torch.dtype) -> None:
    """bf16 and fp16 hold the integers 0-255 exactly, so a record cast with the weights is still readable."""
    model = make(["learned2d", "rope2d"], theta=50.0)
    state = {k: v.to(dtype) if k.endswith("_extra_state") or v.is_floating_point() else v
             for k, v in model.state_dict().items()}  # fmt: skip
    fresh = make(["learned2d", "rope2d"], seed=3, theta=50.0)
    fresh.load_state_dict(state)
    assert fresh.vispos.settings == model.vispos.settings
    if dtype.is_floating_point:
        torch.testing.assert_close(fresh.head.weight, model.head.weight.to(dtype).float())


def test_a_cast_that_cannot_hold_the_bytes_is_refused_by_name() -> None:
    record = make("rope2d").vispos.get_extra_state()
    with pytest.raises(ValueError, match="damaged"):
        _state.decode(record.float() + 0.5)  # not integers
    with pytest.raises(ValueError, match="damaged"):
        _state.decode(record.to(torch.float8_e4m3fn))  # 3 mantissa bits: the bytes are rounded
    with pytest.raises(ValueError, match="1-D tensor of bytes"):
        _state.decode(record.bool())


def test_older_records_still_load() -> None:
    """Format 1 (unpadded JSON, options as given) and vispos 0.1's dicts."""
    model = make(["learned2d", "rope2d"], theta=50.0)
    vispos.configure(model, scaling="linear")
    old = format1(model)
    assert old["vispos._extra_state"].numel() < _state.RECORD_BYTES
    fresh = make(["learned2d", "rope2d"], seed=3, theta=50.0)
    fresh.load_state_dict(old)
    assert fresh.vispos.settings == model.vispos.settings
    legacy = make(["learned2d", "rope2d"], seed=4, theta=50.0)
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    state["vispos._extra_state"] = {"settings": dict(model.vispos.settings), "enabled": True, "log_n_tokens": None}
    legacy.load_state_dict(state)
    with torch.no_grad():
        torch.testing.assert_close(legacy(images()), fresh(images()), rtol=1e-5, atol=1e-6)


def test_a_record_that_would_not_fit_is_refused_naming_the_limit() -> None:
    with pytest.raises(ValueError, match=f"RECORD_BYTES = {_state.RECORD_BYTES}"):
        _state.encode({"options": {"long_factors": [1.5] * _state.RECORD_BYTES}})


def test_the_largest_realistic_record_fits_with_room_to_spare() -> None:
    """learned2d + rope2d at head dim 128 with LongRoPE factors (one per frequency, full precision) given at
    patch time and again through configure: the longest record a patched model writes."""
    rng = random.Random(0)
    factors = [1.0 + rng.random() * 3.0 for _ in range(32)]  # rope2d at head dim 128: 32 frequencies per axis
    scaling = {"type": "longrope", "long_factors": factors, "short_factors": factors}
    model = vispos.create_model("vit_base_patch16_224", pos=["learned2d", "rope2d"], pos_options={"scaling": scaling},
                                img_size=64, depth=1, num_heads=6)  # fmt: skip
    vispos.configure(model, scaling=scaling, log_n_attention=True)
    used = max(len(r.numpy().tobytes().rstrip()) for r in records(model).values())
    assert 2048 < used < _state.RECORD_BYTES // 4


def test_records_hold_every_option_with_its_value() -> None:
    model = make("rope2d", theta=50.0)
    saved = _state.decode(model.vispos.get_extra_state())["settings"]["options"]
    assert saved == canonical_options(["rope2d"], {"theta": 50.0}) and saved["layout"] == "half"
    assert model.vispos.settings["options"] == {"theta": 50.0}  # the model keeps the options as given


def test_an_old_record_of_a_changed_default_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """A format-1 record holds only the options given: the others are read at the defaults of its vispos
    (``FORMAT1_DEFAULTS``), so a default changed since refuses the checkpoint, naming the option."""
    old = format1(make("rope2d"))  # theta left at its default, 100 (say it was 10 then)
    monkeypatch.setitem(_state.FORMAT1_DEFAULTS, "rope2d", {"theta": 10.0})
    with pytest.raises(ValueError, match=r"theta: 10\.0 in the checkpoint, 100\.0 in this model"):
        make("rope2d", seed=1).load_state_dict(old)
    make("rope2d", seed=1, theta=10.0).load_state_dict(old)  # the options it was trained with
    make("rope2d", seed=1).load_state_dict(make("rope2d").state_dict())  # format 2: every option is in the record


@pytest.mark.parametrize("spelling", [{"type": "yarn", "beta_fast": 32}, {"type": "yarn", "beta_slow": 1.0,
                                                                          "truncate": True}])
def test_a_scaling_spelled_with_its_defaults_is_the_same_setting(spelling: dict[str, object]) -> None:
    """``scaling="yarn"`` and the same scaling with yarn's defaults written out are one setting."""
    a = {"pos": ["rope2d"], "options": {"scaling": "yarn"}, "train_grid": (4, 4)}
    b = {"pos": ["rope2d"], "options": {"scaling": spelling}, "train_grid": (4, 4)}
    assert same_positions(a, b)
    saved = make("rope2d", scaling="yarn")
    make("rope2d", seed=1, scaling=spelling).load_state_dict(saved.state_dict())
    other = {"pos": ["rope2d"], "options": {"scaling": {"type": "yarn", "beta_fast": 16}}, "train_grid": (4, 4)}
    assert not same_positions(a, other)


def test_an_old_record_whose_meaning_changed_without_an_option_is_refused_by_name() -> None:
    """string2d(freqs="golden") turns other directions since format 2, with no option for the former ones: its
    format-1 checkpoint is refused, naming the change, while a format-1 string2d of another kind loads."""
    old = format1(make("string2d", freqs="golden"))
    with pytest.raises(ValueError, match=r"written by vispos 0\.1 .*string2d\(freqs='golden'\) now turns"):
        make("string2d", seed=1, freqs="golden").load_state_dict(old)
    make("string2d", seed=1, freqs="axial").load_state_dict(format1(make("string2d", freqs="axial")))
    make("string2d", seed=1, freqs="golden").load_state_dict(make("string2d", freqs="golden").state_dict())


def test_a_record_set_by_item_loads_and_one_set_as_an_attribute_is_left() -> None:
    """Loaders that set a model's tensors by name: by item (accelerate's ``module._buffers[name] = value``) a record
    is loaded, checked; as an attribute (``setattr`` or ``register_buffer``: transformers' uninitialised memory for a
    key a checkpoint lacks) it is left, and the module keeps its settings."""
    positions = make("rope2d").vispos
    before = dict(positions.settings)
    garbage = torch.full_like(positions.get_extra_state(), 7)  # no JSON
    positions._extra_state = garbage
    positions.register_buffer("_extra_state", garbage.clone())
    assert positions.settings == before
    assert "_extra_state" not in dict(positions.named_buffers())
    with pytest.raises(ValueError, match="damaged"):
        positions._buffers["_extra_state"] = garbage  # the tensor a setattr gave before: loaded all the same
    positions._buffers["_extra_state"] = make("rope2d").vispos.get_extra_state()
    assert positions.settings == before


def test_storing_a_record_by_item_after_registering_the_same_tensor_loads_it() -> None:
    """Registering a tensor as the record (setattr, register_buffer) is not a load; storing one by item is, even the
    very tensor registered before (the slot forgets what was being registered once it is stored)."""
    model = make("rope2d")
    donor = make("rope2d")
    vispos.configure(donor, scaling="yarn")
    record = donor.vispos.get_extra_state()
    model.vispos._extra_state = record  # transformers' loader does this: no load
    assert model.vispos_cfg.get("scaling") is None
    model.vispos._buffers["_extra_state"] = record  # accelerate's loader does this: a load
    assert model.vispos_cfg["scaling"] == {"scaling": "yarn"}
