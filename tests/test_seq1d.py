"""The train-short-test-long benchmark (benchmarks/seq1d): generators, tiny runs, result files, config."""

from __future__ import annotations

import json

import pytest
import torch

import vispos
from benchmarks.seq1d.__main__ import main
from benchmarks.seq1d.config import ConfigError, config_from_dict
from benchmarks.seq1d.runner import run, train_model
from benchmarks.seq1d.search import monotone, search_longrope
from benchmarks.seq1d.tasks import BOS, MARK, NUM_SPECIAL, SEP, Copy, Passkey, Recall, build_task


def tiny(**overrides: object) -> dict:
    """A config small enough to train in a second: L = 16, dim 16, a few steps, 1x and 2x."""
    data = {
        "name": "tiny",
        "tasks": ["passkey"],
        "progress": False,
        "model": {"dim": 16, "depth": 1, "heads": 2},
        "train": {"length": 16, "steps": 3, "batch_size": 4},
        "eval": {"multiples": [1, 2], "samples": 10, "batch_size": 8},
        "recall": {"keys": 16, "pairs": 3, "queries": 2},
        "longrope": {"search_samples": 4, "candidates": 1, "search_multiples": [1.5]},
        "schemes": ["rope"],
    }
    data.update(overrides)
    return data


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------------
# generators produce what they claim


@pytest.mark.parametrize("key_len", [1, 3])
@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 1.0])
def test_passkey_key_sits_at_requested_depth_and_is_the_target(depth: float, key_len: int) -> None:
    task, length = Passkey(values=10, key_len=key_len), 40
    batch = task.sample(6, length, gen(), depth=depth)
    slots = task.slots(length)
    marker = 1 + round(depth * slots)
    tokens = batch.tokens
    assert tokens.shape == (6, length) and (tokens[:, 0] == BOS).all()
    assert ((tokens == MARK).sum(1) == 1).all() and (tokens[:, marker] == MARK).all()
    assert (tokens[:, length - key_len - 1] == SEP).all() and ((tokens == SEP).sum(1) == 1).all()
    key = tokens[:, marker + 1 : marker + 1 + key_len]
    assert torch.equal(key, tokens[:, length - key_len :])  # the answer is the hidden key
    assert torch.equal(batch.answer.nonzero()[:, 1].unique(), torch.arange(length - key_len, length))
    assert torch.allclose(batch.depth, torch.full((6,), (marker - 1) / slots))
    filler = tokens[:, 1 : length - key_len - 1]
    assert ((filler >= NUM_SPECIAL) | (filler == MARK)).all()  # filler shares the key's alphabet


def test_passkey_depth_extremes_touch_the_ends() -> None:
    task, length = Passkey(values=10, key_len=2), 32
    first = task.sample(2, length, gen(), depth=0.0).tokens
    last = task.sample(2, length, gen(), depth=1.0).tokens
    assert (first[:, 1] == MARK).all()  # right after BOS
    assert (last[:, length - 2 - 1 - 2 - 1] == MARK).all()  # needle ends right before SEP


@pytest.mark.parametrize("length", [20, 21])
def test_copy_and_reverse_targets(length: int) -> None:
    for reverse in (False, True):
        batch = Copy(values=50, reverse=reverse).sample(5, length, gen())
        n = (length - 2) // 2
        sep = length - n - 1
        assert batch.tokens.shape == (5, length) and (batch.tokens[:, sep] == SEP).all()
        source, target = batch.tokens[:, sep - n : sep], batch.tokens[:, sep + 1 :]
        assert torch.equal(target, source.flip(1) if reverse else source)
        assert batch.answer.sum().item() == 5 * n and batch.answer[:, sep + 1 :].all()


def test_recall_answers_are_the_stored_values() -> None:
    task, length = Recall(keys=12, values=8, pairs=5, queries=3), 50
    batch = task.sample(7, length, gen())
    is_key = (batch.tokens >= NUM_SPECIAL) & (batch.tokens < NUM_SPECIAL + 12)
    for row, answer, keys in zip(batch.tokens, batch.answer, is_key, strict=True):
        sep = (row == SEP).nonzero().item()
        assert sep == length - 2 * 3 - 1 and row[0] == BOS
        where = keys[:sep].nonzero().flatten()
        assert len(where) == 5 and len(row[where].unique()) == 5  # 5 pairs, distinct keys
        stored = {int(row[p]): int(row[p + 1]) for p in where}
        assert all(int(row[p + 1]) >= NUM_SPECIAL + 12 for p in where)  # each key is followed by a value
        positions = answer.nonzero().flatten()
        assert torch.equal(positions, torch.arange(sep + 2, length, 2))
        for p in positions:
            assert stored[int(row[p - 1])] == int(row[p])
    with pytest.raises(ValueError, match="outside"):
        task.sample(1, task.min_length() - 1, gen())


@pytest.mark.parametrize("name", ["passkey", "copy", "reverse", "recall"])
def test_generators_are_deterministic_per_seed(name: str) -> None:
    task = build_task(name, config_from_dict(tiny()))
    a, b, c = (task.sample(4, 30, gen(s)).tokens for s in (1, 1, 2))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert int(a.max()) < task.vocab_size


# ---------------------------------------------------------------------------------------------------
# tiny runs: every task and every scheme trains a few steps and evaluates at 2x


@pytest.mark.parametrize("task", ["passkey", "copy", "reverse", "recall"])
def test_each_task_trains_and_evaluates_at_2x(task: str) -> None:
    schemes = [
        "rope",
        "rope+yarn",
        "learned1d",
        "learned1d+interpolate",
        {"name": "drope", "pos": "alibi", "drope": 0.5},
    ]
    results = run(config_from_dict(tiny(tasks=[task], schemes=schemes)))
    rows = results["tasks"][task]["rows"]
    assert list(rows) == ["rope", "rope+yarn", "learned1d", "learned1d+interpolate", "drope"]
    for name, row in rows.items():
        assert 0.0 <= row["accuracy"]["16"] <= 1.0
        if name != "learned1d":
            assert 0.0 <= row["accuracy"]["32"] <= 1.0 and row["loss"]["32"] > 0
    assert rows["learned1d"]["accuracy"]["32"] is None  # out_of_range="error": explicit, recorded
    assert "out_of_range" in rows["learned1d"]["errors"]["32"]


def test_every_1d_scheme_and_scaling_runs_at_2x() -> None:
    names = vispos.list_encodings(ndim=1)
    schemes = [n for n in names if n != "learned1d"] + ["learned1d+clamp"]
    schemes += [f"rope+{s}" for s in ("linear", "ntk", "dynamic_ntk", "yarn", "longrope", "llama3")]
    schemes.append({"name": "rope+yarn_mscale", "base": "rope", "scaling": "yarn",
                    "scaling_options": {"mscale": 0.707, "mscale_all_dim": 0.707}})  # fmt: skip
    schemes.insert(0, {"name": "learned1d", "pos": "learned1d", "options": {"out_of_range": "clamp"}})
    results = run(config_from_dict(tiny(schemes=schemes)))
    rows = results["tasks"]["passkey"]["rows"]
    assert {"sincos1d", "shaw", "t5", "alibi", "rope", "xpos", "mrope", "nope", "rope+llama3"} <= set(rows)
    for row in rows.values():
        assert all(v is not None for v in row["accuracy"].values()), row["name"]
    longrope = results["tasks"]["passkey"]["longrope"]
    assert longrope["searched"] and len(longrope["long_factors"]) == 16 // 2 // 2  # head_dim 8 -> 4 freqs


def test_drope_leaves_positions_off_and_same_seed_gives_same_model() -> None:
    cfg = config_from_dict(tiny(schemes=["rope", {"name": "drope", "pos": "rope", "drope": 0.5}]))
    task = build_task("passkey", cfg)
    model, stats = train_model(cfg, cfg.schemes[1], task, torch.device("cpu"))
    assert stats["drop_at"] == 2 and not any(b.attn.enabled for b in model.blocks)
    again, _ = train_model(cfg, cfg.schemes[1], task, torch.device("cpu"))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters(), strict=True))


def test_longrope_search_returns_monotone_factors_and_finds_the_minimum() -> None:
    target = torch.tensor([1.0, 1.0, 2.0, 4.0])
    best, value, tried = search_longrope(
        lambda f: float(((torch.tensor(f) - target) ** 2).sum()), 4, scale=4.0, generator=gen(), mutations=8
    )
    assert best == monotone(torch.tensor(best)) and min(best) >= 1.0
    assert value < 1.0 and tried > 20
    assert monotone(torch.tensor([0.5, 3.0, 2.0])) == [1.0, 3.0, 3.0]


# ---------------------------------------------------------------------------------------------------
# result files and config


def test_result_files_have_the_documented_shape(tmp_path, capsys) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(json.dumps(tiny(tasks=["passkey", "recall"], schemes=["rope", "rope+ntk", "nope"])))
    assert main(["--config", str(cfg), f"out_dir={tmp_path / 'out'}", "eval.multiples=[1,2,4]"]) == 0
    out = tmp_path / "out"
    for name in ("results.json", "results.md", "accuracy.png", "loss.png", "passkey_depth.png"):
        assert (out / name).stat().st_size > 0
    results = json.loads((out / "results.json").read_text())
    assert results["lengths"] == [16, 32, 64] and results["multiples"] == [1, 2, 4] and results["train_length"] == 16
    assert results["wall_seconds"] > 0 and results["config"]["name"] == "tiny"
    for task, metric in (("passkey", "exact"), ("recall", "token")):
        data = results["tasks"][task]
        assert data["metric"] == metric and list(data["rows"]) == ["rope", "rope+ntk", "nope"]
        for row in data["rows"].values():
            assert set(row["accuracy"]) == set(row["loss"]) == {"16", "32", "64"}
            assert row["kind"] in ("trained", "variant")
        assert data["rows"]["rope"]["train"]["curve"][-1][0] == 3
    depth = results["tasks"]["passkey"]["rows"]["nope"]["by_depth"]
    assert set(depth) == {"16", "32", "64"} and len(depth["32"]) == 5
    md = (out / "results.md").read_text()
    assert "| scheme | 16 (1x, train) | 32 (2x) | 64 (4x) |" in md and md.count("\n| rope") == 4  # 2 tasks x 2
    assert "| nope |" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"trian": {}}, "unknown config key trian"),
        ({"train": {"length": 16, "stpes": 3}}, "did you mean 'steps'"),
        ({"schemes": ["rope+yarn"]}, "not a trained scheme"),
        ({"schemes": ["alibi", "alibi+linear"]}, "scaling needs a rope base"),
        ({"schemes": ["rope", "rope+clamp"]}, "applies to a learned1d base"),
        ({"schemes": ["rope+bogus"]}, "after '\\+'"),
        ({"tasks": ["passkey", "sorting"]}, "accepted: passkey"),
        ({"schemes": [{"name": "d", "pos": "rope", "drope": 1.5}]}, "drope"),
        ({"schemes": [{"name": "s", "pos": "shaw", "options": {"max_distnce": 4}}]}, "unknown option"),
        ({"schemes": [{"name": "s", "pos": "rope2d"}]}, "no 1D form"),
        ({"schemes": ["rope", {"name": "y", "base": "rope", "scaling": "yarn", "scaling_options": {"factr": 2}}]},
         "scaling"),
        ({"schemes": ["rope", {"name": "y", "base": "rope", "scaling": "linear", "scaling_options": {"factor": 0.5}}]},
         ">= 1"),
    ],
)
def test_config_rejects_bad_input(change: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config_from_dict(tiny(**change))


def test_cli_overrides_are_type_checked(tmp_path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(json.dumps(tiny()))
    assert main(["--config", str(cfg), "train.steps=many"]) == 2
    assert main(["--config", str(cfg), "train.nope=1"]) == 2


def test_scheme_shorthand_is_the_explicit_entry_and_the_old_scaling_mapping_shows_the_new_form() -> None:
    cfg = config_from_dict(tiny(schemes=["rope", "rope+ntk", "learned1d", "learned1d+clamp"]))
    explicit = config_from_dict(tiny(schemes=[
        "rope", {"name": "rope+ntk", "base": "rope", "scaling": "ntk"},
        "learned1d", {"name": "learned1d+clamp", "base": "learned1d", "out_of_range": "clamp"},
    ]))
    assert cfg.schemes == explicit.schemes
    old = {"name": "y", "base": "rope", "scaling": {"type": "yarn", "factor": 4.0}}
    with pytest.raises(ConfigError, match=r"write scaling: yarn, scaling_options: \{'factor': 4\.0\}"):
        config_from_dict(tiny(schemes=["rope", old]))
