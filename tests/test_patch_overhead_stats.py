"""The overhead benchmark's interval (benchmarks/patch_overhead.py): a bootstrap of the median of per-round
ratios, tested on ratios of known spread (no timing here); its configuration list, and the inherited-host rows
(Swin-T, BEiT) comparing like with like: vispos with the host's own positions inherited gives timm's outputs."""

from __future__ import annotations

import copy
import random
import statistics

import pytest
import torch

import vispos
from benchmarks.patch_overhead import (
    CONTROL,
    INHERITED_HOSTS,
    MODEL,
    configurations,
    control_of,
    inherited_label,
    interval,
    minus_control,
    resolution,
)


def test_the_interval_holds_the_median_and_narrows_with_more_rounds() -> None:
    rng = random.Random(3)
    few = [1.05 + rng.gauss(0, 0.03) for _ in range(8)]
    many = [1.05 + rng.gauss(0, 0.03) for _ in range(128)]
    for ratios in (few, many):
        low, high = interval(ratios)
        assert low <= statistics.median(ratios) <= high
    assert interval(many)[1] - interval(many)[0] < (interval(few)[1] - interval(few)[0]) / 2
    low, high = interval(many)
    expected = 2 * 1.96 * 1.2533 * 0.03 / len(many) ** 0.5  # the median's normal-theory 95 % width
    assert expected / 2 < high - low < expected * 2
    assert interval(few) == interval(few)  # seeded: a rerun of the report prints the same interval


def test_a_constant_ratio_has_no_width_and_the_control_row_is_the_unpatched_model_again() -> None:
    assert interval([1.02] * 10) == (1.02, 1.02)
    configs = configurations(["rope2d"])
    baseline, _ = configs[CONTROL]
    assert baseline == configs["vispos rope2d"][0]  # measured against the same baseline as every scheme


def test_noise_shared_by_a_row_and_its_control_cancels_in_their_difference() -> None:
    """Rounds whose machine speed swings by +-20 % hit the row and the control alike: their ratios to the
    baseline spread, their difference does not, so a 2 % cost is resolved (interval without 0) and a row equal to
    the control is not."""
    rng = random.Random(5)
    base, control, costly, same = [], [], [], []
    for _ in range(16):
        speed = 1 + rng.uniform(-0.2, 0.2)  # the round's machine state, shared by the interleaved rows
        base.append(speed * (1 + rng.gauss(0, 0.002)))
        control.append(speed * (1 + rng.gauss(0, 0.002)))
        costly.append(speed * (1.02 + rng.gauss(0, 0.002)))
        same.append(speed * (1 + rng.gauss(0, 0.002)))
    diff, (low, high) = minus_control(costly, control, base)
    assert 0 < low <= diff <= high and abs(diff - 0.02) < 0.005
    diff, (low, high) = minus_control(same, control, base)
    assert low < 0 < high
    results = {
        "vispos costly": {"fwd minus control": 0.02, "fwd minus control 95% interval": (0.015, 0.025)},
        "vispos cheap": {"fwd minus control": 0.05, "fwd minus control 95% interval": (0.04, 0.06)},
        "vispos same": {"fwd minus control": 0.001, "fwd minus control 95% interval": (-0.01, 0.012)},
        "timm baseline": {},
    }
    assert resolution(results, "fwd") == (
        "fwd: 2 row(s) resolved from the control, the smallest difference 0.020 (vispos costly); 1 within the noise"
    )
    assert resolution({}, "fwd+bwd") == "fwd+bwd: no row resolved from its control (0 within the noise)"
    assert control_of(configurations(["rope2d"])) == {f"timm {MODEL}": CONTROL}


def test_the_inherited_host_rows_are_in_the_default_list_against_timms_own_model() -> None:
    default = configurations()
    for family, (own, _, _) in INHERITED_HOSTS.items():
        assert default[own][0] == ""  # timm's own model is its own baseline
        assert default[inherited_label(family)][0] == own
    assert set(configurations(families=["swin", "beit"])) == {
        f"timm {MODEL}", CONTROL, *(k for f, (own, _, _) in INHERITED_HOSTS.items() for k in (own, inherited_label(f)))
    }
    shared = {f"timm {MODEL}", CONTROL}
    assert not set(configurations(["rope2d"])) & (set(configurations(families=["swin", "beit"])) - shared)
    with pytest.raises(ValueError, match="unknown families"):
        configurations(families=["swin", "deit"])


def test_the_inherited_host_rows_build_at_224_with_the_hosts_tables_inherited() -> None:
    configs = configurations(families=list(INHERITED_HOSTS))
    for family, (own, _, scheme) in INHERITED_HOSTS.items():
        model = configs[inherited_label(family)][1]()
        assert model.vispos_cfg["inherited"]["from"].startswith(f"timm {type(configs[own][1]()).__name__}")
        assert scheme in str(model.vispos_cfg)


SMALL = {  # the rows' models made tiny (ViT-S width replaced), every positional table random so nothing is trivial
    "swin": {"img_size": 56, "embed_dim": 32, "depths": (2, 2), "num_heads": (2, 4), "window_size": 7},
    "beit": {"img_size": 64, "depth": 2, "embed_dim": 32, "num_heads": 2, "init_values": 1.0},
}


@pytest.mark.parametrize("family", list(INHERITED_HOSTS))
def test_the_inherited_row_gives_timms_own_outputs(family: str) -> None:
    _, build, scheme = INHERITED_HOSTS[family]
    torch.manual_seed(0)
    own = build(**SMALL[family], num_classes=0).eval()  # features: BEiT's head is initialised near zero
    with torch.no_grad():
        for name, p in own.named_parameters():
            if "relative_position_bias_table" in name:
                p.normal_(std=0.5)
    patched, fresh = vispos.patch(copy.deepcopy(own), scheme), vispos.patch(copy.deepcopy(own), scheme, inherit=False)
    size = SMALL[family]["img_size"]
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (patched(x) - own(x)).abs().max().item() <= 1e-5
        assert (fresh(x) - own(x)).abs().max().item() > 1e-3  # negative control: fresh tables change the outputs
