"""Config schema: strict keys, type-checked overrides, scheme shorthands, cross-field checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from train.__main__ import main as train_main
from train.config.generation import GenerationConfig
from train.config.sections import ConfigError, SchemeConfig, apply_overrides
from train.experiment.loading import config_from_dict, load_config

BASE = {"name": "t", "schemes": ["rope2d"], "eval": {"sizes": [28, 56]}, "model": {"patch_size": 4}}


def test_unknown_top_level_key_names_the_accepted_keys() -> None:
    with pytest.raises(ConfigError) as e:
        config_from_dict({**BASE, "trian": {}})
    msg = str(e.value)
    assert "trian" in msg and "did you mean 'train'" in msg
    assert "accepted keys" in msg and "schemes" in msg and "eval" in msg


def test_unknown_nested_key_names_its_section_and_accepted_keys() -> None:
    with pytest.raises(ConfigError, match=r"unknown config key train\.lrr .*accepted keys in train: epochs"):
        config_from_dict({**BASE, "train": {"lrr": 1.0}})
    with pytest.raises(ConfigError, match=r"schemes\[0\]"):
        config_from_dict({**BASE, "schemes": [{"name": "a", "pos": "rope2d", "theta": 10}]})


def test_wrong_value_types_are_errors() -> None:
    with pytest.raises(ConfigError, match=r"train\.epochs: expected an int, got 'three'"):
        config_from_dict({**BASE, "train": {"epochs": "three"}})
    with pytest.raises(ConfigError, match=r"eval\.protocols\[0\]: 'stretch' is not accepted; accepted: resize, canvas"):
        config_from_dict({**BASE, "eval": {"sizes": [28], "protocols": ["stretch"]}})
    with pytest.raises(ConfigError, match="expected true or false"):
        config_from_dict({**BASE, "progress": "yes please"})


def test_overrides_are_type_checked_and_applied() -> None:
    data = apply_overrides(
        BASE,
        [
            "train.lr=1e-3",
            "eval.sizes=[20,28]",
            "model.global_pool=token",
            "seed=3",
            "schemes=[nope,rope2d+yarn,rope2d]",
        ],
    )
    cfg = config_from_dict(data)
    assert cfg.train.lr == pytest.approx(1e-3) and isinstance(cfg.train.lr, float)
    assert cfg.eval.sizes == [20, 28] and cfg.model.global_pool == "token" and cfg.seed == 3
    assert [s.name for s in cfg.schemes] == ["nope", "rope2d+yarn", "rope2d"]
    with pytest.raises(ConfigError, match=r"override 'train\.epochs=2\.5': train\.epochs: expected an int"):
        apply_overrides(BASE, ["train.epochs=2.5"])
    with pytest.raises(ConfigError, match=r"unknown config key train\.lrr .*did you mean 'lr'"):
        apply_overrides(BASE, ["train.lrr=1"])
    with pytest.raises(ConfigError, match="write key=value"):
        apply_overrides(BASE, ["train.lr"])
    with pytest.raises(ConfigError, match="accepted: token, avg, max, avgmax, map"):
        apply_overrides(BASE, ["model.global_pool=mean"])


def test_scheme_shorthands() -> None:
    cfg = config_from_dict(
        {
            **BASE,
            "schemes": ["rope2d", "learned2d+rope2d", "rope2d+yarn", {"name": "d", "pos": "rope2d", "drope": 0.25}],
        }
    )
    combo, variant, drope = cfg.schemes[1], cfg.schemes[2], cfg.schemes[3]
    assert combo.pos == ["learned2d", "rope2d"] and combo.trains
    assert variant == SchemeConfig(name="rope2d+yarn", base="rope2d", scaling="yarn")
    assert not variant.trains and drope.pos == ["rope2d"] and drope.drope == 0.25


def test_cross_field_checks() -> None:
    with pytest.raises(ConfigError, match="names must be unique"):
        config_from_dict({**BASE, "schemes": ["rope2d", "rope2d"]})
    with pytest.raises(ConfigError, match="base 'rope2d' is not a trained scheme.*trained: nope"):
        config_from_dict({**BASE, "schemes": ["nope", "rope2d+ntk"]})
    with pytest.raises(ConfigError, match="exactly one of sizes"):
        config_from_dict({**BASE, "eval": {"sizes": [28], "scales": [1.0]}})
    with pytest.raises(ConfigError, match=r"drope is a fraction"):
        config_from_dict({**BASE, "schemes": [{"name": "a", "pos": "rope2d", "drope": 1.5}]})


def test_cli_reports_config_errors_without_a_traceback(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("name: t\nschemes: [rope2d]\neval: {sizes: [28]}\nmodel: {depht: 3}\n")
    assert train_main(["--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "unknown config key model.depht" in err and "did you mean 'depth'" in err
    assert train_main(["--config", str(path), "train.epochs=x"]) == 2
    assert "train.epochs: expected an int" in capsys.readouterr().err


def test_shipped_configs_validate() -> None:
    root = Path(__file__).resolve().parents[1] / "configs"
    configs = sorted(p for pattern in ("fmnist_*.yaml", "imagenet*.yaml", "grid_*.yaml") for p in root.glob(pattern))
    assert {"fmnist_extrapolation.yaml", "fmnist_native.yaml", "grid_tasks_zoom.yaml"} <= {p.name for p in configs}
    for path in configs:
        cfg = load_config(path)
        assert cfg.schemes
        if isinstance(cfg, GenerationConfig):  # task: generation (fmnist_dit*)
            assert cfg.sizes[0] == cfg.data.img_size
        else:
            assert cfg.eval.protocols
    assert {"fmnist_dit.yaml", "fmnist_dit_quick.yaml"} <= {p.name for p in configs}


def test_multires_seeds_and_finetune_checks() -> None:
    with pytest.raises(ConfigError, match=r"sizes in \[1, data\.img_size=28\].*got \[16, 32\]"):
        config_from_dict({**BASE, "train": {"sizes": [16, 32]}})  # no training image above the base size
    with pytest.raises(ConfigError, match="give sizes .* or size_range .*, not both"):
        config_from_dict({**BASE, "train": {"sizes": [16], "size_range": [16, 28]}})
    with pytest.raises(ConfigError, match=r"size_range is \[min, max\] with min <= max"):
        config_from_dict({**BASE, "train": {"size_range": [28, 16]}})
    with pytest.raises(ConfigError, match="distinct seeds"):
        config_from_dict({**BASE, "seeds": [0, 0]})
    with pytest.raises(ConfigError, match="finetune: size, steps and batch_size must be >= 1"):
        config_from_dict({**BASE, "finetune": {"size": 56, "steps": 0}})
    with pytest.raises(ConfigError, match=r"schemes\[rope2d\+linear\]: sizes, augment and num_heads .* need a trained"):
        config_from_dict({**BASE, "schemes": ["rope2d", {"name": "rope2d+linear", "base": "rope2d", "sizes": [16]}]})
    with pytest.raises(ConfigError, match=r"schemes\[a\]\.sizes: sizes in \[1, data\.img_size=28\]"):
        config_from_dict({**BASE, "schemes": [{"name": "a", "pos": "rope2d", "sizes": [56]}]})
    with pytest.raises(ConfigError, match=r"schemes\[a\]\.num_heads must be >= 1, or null \(model\.num_heads\), got 0"):
        config_from_dict({**BASE, "schemes": [{"name": "a", "pos": "lookhere2d", "num_heads": 0}]})
    cfg = config_from_dict(apply_overrides(BASE, ["seeds=[0,1,2]", "finetune.size=56", "train.size_range=[12,28]"]))
    assert cfg.seeds == [0, 1, 2] and cfg.finetune.size == 56 and cfg.train.size_range == [12, 28]


def test_an_entrys_own_heads_replace_the_models_for_its_training_and_its_evaluation(tmp_path) -> None:
    """LookHere's fields of view are per head: its entry may take 4 heads of 16 beside rotary rows at one head of 64,
    the same width and parameters. An evaluation-only row loads its base's weights into a model of the base's heads
    (relbias2d's table is per head: a model of the run's one head would refuse its checkpoint)."""
    import torch

    from train.engine.models import build_model
    from train.experiment.run import run_experiment
    from train.testing import tiny_config

    schemes = ["rope2d", {"name": "relbias2d", "pos": "relbias2d", "num_heads": 4},
               {"name": "relbias2d+logn", "base": "relbias2d", "log_n_attention": True}]  # fmt: skip
    cfg = tiny_config(tmp_path, schemes=schemes, model={"num_heads": 1}, train={"epochs": 1})
    lookhere = SchemeConfig(name="lookhere2d", pos=["lookhere2d"], num_heads=4)
    models = [build_model(cfg.model, s, img_size=28, num_classes=10, in_chans=1, seed=0)
              for s in (lookhere, cfg.scheme("rope2d"))]  # fmt: skip
    assert [m.blocks[0].attn.num_heads for m in models] == [4, 1]
    assert [m.vispos.attention[0].num_heads for m in models[:1]] == [4]  # its four fields of view
    assert sum(p.numel() for p in models[0].parameters()) == sum(p.numel() for p in models[1].parameters())
    out = run_experiment(cfg)
    assert set(out.schemes) == {"rope2d", "relbias2d", "relbias2d+logn"}
    state = torch.load(tmp_path / "relbias2d" / "checkpoint.pt", weights_only=True)
    assert state["scheme"]["num_heads"] == 4 and state["fingerprint"]["model"]["num_heads"] == 4
    from train.engine.checkpoint import fingerprint

    plain = SchemeConfig(name="lookhere2d", pos=["lookhere2d"])
    assert fingerprint(cfg, lookhere)["model"]["num_heads"] == 4 and fingerprint(cfg, plain)["model"]["num_heads"] == 1
