"""The literature's orderings checked against a run (train.evaluation.orderings, python -m train.orderings):
every implied pair is tested against twice the Welch standard error of its gap over seeds."""

from __future__ import annotations

import dataclasses
import json
import math
import statistics

import pytest

from train import orderings as cli
from train.config.sections import SchemeConfig
from train.evaluation.orderings import CLAIMS, Claim, check, format_checks
from train.evaluation.results import RunResult, SchemeResult, SeedResult

CLAIM = Claim("a source", "a setting", ("a", "b", "c"), "1 / 2 / 3")


def _run(per_seed: dict[str, list[float]], size: int = 28) -> RunResult:
    """A run at train size 14 whose schemes scored ``per_seed[name]`` (one value per seed) at ``size`` px."""
    schemes = {}
    for name, values in per_seed.items():
        seeds = {i: SeedResult({"resize": {14: 80.0, size: v}}, {}, None, None) for i, v in enumerate(values)}
        mean = {"resize": {14: 80.0, size: statistics.fmean(values)}}
        schemes[name] = SchemeResult(SchemeConfig(name=name, pos="nope"), None, mean, 0, per_seed=seeds)
    return RunResult("synthetic", 14, [14, size], ["resize"], 100, "-", "cpu", 1, None, schemes, {},
                     seeds=list(range(len(next(iter(per_seed.values()))))))


def test_each_pair_is_judged_by_twice_its_welch_standard_error():
    a, b, c = [70.0, 72.0, 74.0], [60.0, 61.0, 62.0], [71.0, 75.0, 73.0]
    result = check(_run({"a": a, "b": b, "c": c}), CLAIM, "resize", 28)
    pairs = {(p.better, p.worse): p for p in result.pairs}
    assert set(pairs) == {("a", "b"), ("a", "c"), ("b", "c")}  # every pair the ordering implies
    se_ab = math.sqrt(statistics.variance(a) / 3 + statistics.variance(b) / 3)
    assert pairs["a", "b"].gap == pytest.approx(11.0) and pairs["a", "b"].se == pytest.approx(se_ab)
    assert pairs["a", "b"].verdict == "agrees"  # 11 > 2 * 1.29
    assert pairs["a", "c"].verdict == "tie"  # -1 within 2 * 1.63
    assert pairs["b", "c"].verdict == "reversed"  # -12 beyond 2 * 1.29
    assert result.verdict == "no"
    assert result.ordering() == "c 73.0 ≈ a 72.0 > b 61.0"
    assert "reversed: c above b by 12.0 ± 1.3" in result.details()
    assert "tie: a - c = -1.0 ± 1.6" in result.details()


def test_the_verdict_of_an_ordering():
    agrees = check(_run({"a": [80, 81, 82], "b": [70, 71, 72], "c": [60, 61, 62]}), CLAIM, "resize", 28)
    assert agrees.verdict == "yes" and agrees.details() == "every pair as claimed"
    assert agrees.ordering() == "a 81.0 > b 71.0 > c 61.0"
    unresolved = check(_run({"a": [80, 81, 82], "b": [70, 76, 82], "c": [60, 61, 62]}), CLAIM, "resize", 28)
    assert unresolved.verdict == "unresolved"  # a - b: 5 ± 3.5, a tie; nothing reversed


def test_a_margin_just_inside_or_outside_twice_the_error():
    # b's three seeds are 10 +- 1 (std 1), a's are constant: se = 1 / sqrt(3); the boundary gap is 2 / sqrt(3)
    boundary = 2.0 / math.sqrt(3.0)
    for gap, verdict in ((boundary * 1.01, "agrees"), (boundary * 0.99, "tie"), (-boundary * 1.01, "reversed")):
        run = _run({"a": [10.0 + gap] * 3, "b": [9.0, 10.0, 11.0]})
        assert check(run, Claim("s", "-", ("a", "b"), "-"), "resize", 28).pairs[0].verdict == verdict, gap


def test_one_seed_leaves_every_pair_untested(tmp_path, capsys):
    """One seed has no sample standard deviation: no gap, however small or large, agrees or is reversed."""
    one = check(_run({"a": [50.0], "b": [49.9], "c": [60.0]}), CLAIM, "resize", 28)
    assert all(p.se is None and p.verdict == "untested" for p in one.pairs)
    assert one.verdict == "untested (one seed)"
    assert one.ordering() == "c 60.0 >? a 50.0 >? b 49.9"
    assert one.details() == "one seed: no pair tested"
    mixed = check(_run({"a": [50.0, 51.0], "b": [40.0, 41.0], "c": [45.0]}), CLAIM, "resize", 28)  # c: one seed
    assert [p.verdict for p in mixed.pairs] == ["agrees", "untested", "untested"] and mixed.verdict == "unresolved"
    assert "untested, one seed: b - c = -4.5" in mixed.details() and "reversed" not in mixed.details()
    (tmp_path / "results.json").write_text(json.dumps(_run({"lookhere2d": [80.0], "rope2d": [60.0]}).to_json()))
    assert cli.main([str(tmp_path), "--sizes", "28", "--claims", "lookhere"]) == 0
    out = capsys.readouterr().out
    assert "one seed: the standard error over seeds is undefined, so no pair is tested" in out
    assert "| lookhere2d 80.0 >? rope2d 60.0 | untested (one seed) |" in out and "| yes |" not in out


def test_the_published_orderings_name_catalogue_schemes():
    import vispos

    for claim in CLAIMS.values():
        for scheme in claim.schemes:
            assert scheme in vispos.list_encodings(), scheme


def test_the_command_prints_the_table_and_refuses_what_the_run_lacks(tmp_path, capsys):
    run = _run({"learned2d": [60, 61, 62], "rope2d": [50, 52, 54], "rope2d_mixed": [70, 72, 74],
                "alibi2d": [71, 73, 75], "nope": [40, 41, 42]})
    (tmp_path / "results.json").write_text(json.dumps(run.to_json()))
    assert cli.main([str(tmp_path), "--sizes", "28"]) == 0
    out = capsys.readouterr().out
    assert "| RoPE-ViT (ECCV 2024) | rope2d_mixed > rope2d > learned2d | 28 px (2x) |" in out
    assert "rope2d_mixed 72.0 > learned2d 61.0 > rope2d 52.0 | no |" in out
    assert "alibi2d 73.0 ≈ rope2d_mixed 72.0 > learned2d 61.0 > nope 41.0 | unresolved |" in out
    assert "not checked, the run trains fewer than two of their schemes: LookHere (NeurIPS 2024) (lookhere2d" in out
    assert cli.main([str(tmp_path), "--sizes", "28", "--claims", "lookhere"]) == 2  # asked for by name: refused
    assert "has 1 of LookHere (NeurIPS 2024)'s schemes" in capsys.readouterr().err
    assert cli.main([str(tmp_path), "--sizes", "20"]) == 2
    assert "no resize accuracy at 20 px" in capsys.readouterr().err
    assert cli.main([str(tmp_path / "missing.json"), "--sizes", "28"]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_the_table_states_the_test_train_ratio():
    run = _run({"a": [1.0, 2.0], "b": [0.0, 1.0], "c": [0.0, 0.5]}, size=24)
    table = format_checks([check(run, CLAIM, "resize", 24)], 14)
    assert "| a source | a > b > c | 24 px (1.7x) |" in table


def test_a_run_with_some_of_the_claimed_schemes_checks_their_pairs_and_names_the_rest(tmp_path, capsys):
    part = check(_run({"a": [80.0, 81.0], "c": [60.0, 61.0]}), CLAIM, "resize", 28)
    assert [(p.better, p.worse) for p in part.pairs] == [("a", "c")] and part.missing == ("b",)
    assert part.verdict == "yes" and part.details() == "not trained: b"
    (tmp_path / "results.json").write_text(json.dumps(_run({"rope2d": [50.0], "alibi2d": [60.0]}).to_json()))
    assert cli.main([str(tmp_path), "--sizes", "28", "--claims", "rope_vit"]) == 2
    assert "has 1 of RoPE-ViT (ECCV 2024)'s schemes" in capsys.readouterr().err


def test_a_grid_reports_task_is_read_by_name(tmp_path, capsys):
    """A grid report's results.json holds one run per task: --task picks one, and either mistake is named."""
    runs = {"grid_lookup": _run({"lookhere2d": [90, 92, 94], "rope2d": [30, 31, 32]}).to_json(),
            "grid_count": _run({"lookhere2d": [40, 41, 42], "rope2d": [60, 61, 62]}).to_json()}  # fmt: skip
    (tmp_path / "results.json").write_text(json.dumps(runs))
    assert cli.main([str(tmp_path), "--task", "grid_lookup", "--sizes", "28"]) == 0
    assert "lookhere2d 92.0 > rope2d 31.0 | yes |" in capsys.readouterr().out
    assert cli.main([str(tmp_path), "--task", "grid_count", "--sizes", "28"]) == 0
    assert "rope2d 61.0 > lookhere2d 41.0 | no |" in capsys.readouterr().out
    assert cli.main([str(tmp_path), "--sizes", "28"]) == 2
    assert "give --task; its tasks: grid_lookup, grid_count" in capsys.readouterr().err
    assert cli.main([str(tmp_path), "--task", "grid_placement", "--sizes", "28"]) == 2
    assert "no task 'grid_placement'" in capsys.readouterr().err
    (tmp_path / "one.json").write_text(json.dumps(runs["grid_count"]))
    assert cli.main([str(tmp_path / "one.json"), "--task", "grid_count", "--sizes", "28"]) == 2
    assert "not a grid report's" in capsys.readouterr().err


def _trained(run: RunResult, verdicts: dict[str, list[bool]]) -> RunResult:
    """``run`` with each named scheme trained and each of its seeds' plateau verdicts as given."""
    from train.evaluation.convergence import Convergence
    from train.evaluation.results import TrainSummary

    for name, passed in verdicts.items():
        r = run.schemes[name]
        r.train = TrainSummary(1.0, 1, None, None, None, 0, [])
        for seed, ok in zip(r.per_seed.values(), passed, strict=True):
            seed.convergence = dataclasses.asdict(Convergence(gain=0.1 if ok else 3.0, last=80.0, points=8,
                                                              converged=ok))
    return run


def test_each_row_states_how_many_seeds_of_its_models_converged(tmp_path, capsys):
    """An ordering read off models still learning says so: per ranked scheme, seeds passing / checked, an
    evaluation-only entry read as its trained base, and a closing sentence naming the unconverged schemes."""
    run = _trained(_run({"rope2d": [50, 52, 54], "learned2d": [60, 61, 62], "rope2d+linear": [62, 63, 64]}),
                   {"rope2d": [True, True, False], "learned2d": [True, True, True]})
    run.schemes["rope2d+linear"].scheme = SchemeConfig(name="rope2d+linear", pos="rope2d", base="rope2d")
    claim = Claim("s", "-", ("rope2d+linear", "learned2d", "rope2d"), "-")
    result = check(run, claim, "resize", 28)
    assert result.converged == {"rope2d+linear": (2, 3), "learned2d": (3, 3), "rope2d": (2, 3)}
    assert result.convergence() == "rope2d+linear 2/3, learned2d 3/3, rope2d 2/3"
    assert result.unconverged == ("rope2d+linear", "rope2d")
    assert "| rope2d+linear 2/3, learned2d 3/3, rope2d 2/3 |" in format_checks([result], 14)
    (tmp_path / "results.json").write_text(json.dumps(run.to_json()))
    assert cli.main([str(tmp_path), "--sizes", "28", "--claims", "rope_vit"]) == 0
    out = capsys.readouterr().out
    assert "| rope2d 2/3, learned2d 3/3 |" in out  # in the claimed order
    assert "1 of 1 rows rank models that fail the convergence check (rope2d)" in out
    converged = _trained(_run({"rope2d": [50, 52], "learned2d": [60, 61]}),
                         {"rope2d": [True, True], "learned2d": [True, True]})
    (tmp_path / "results.json").write_text(json.dumps(converged.to_json()))
    assert cli.main([str(tmp_path), "--sizes", "28", "--claims", "rope_vit"]) == 0
    assert "fail the convergence check" not in capsys.readouterr().out
    unchecked = check(_run({"a": [1.0], "b": [0.0]}), Claim("s", "-", ("a", "b"), "-"), "resize", 28)
    assert unchecked.convergence() == "a –, b –" and unchecked.unconverged == ()  # evaluation-only, no base
