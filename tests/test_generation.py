"""The generation trainer (``task: generation``): its scores against closed forms, its config checks, and the quick
config end to end (train, resume, sample at 1x / 2x / 3x under inference settings, score, report)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from train.__main__ import main, parallel_jobs
from train.config.schema import ConfigError
from train.evaluation.generation_report import Prediction, verdict
from train.evaluation.scores import crops, frechet, resample
from train.experiment.loading import load_config

QUICK = "configs/fmnist_dit_quick.yaml"
# the quick config made smaller still: the pipeline, not the numbers
TINY = ["data.train_per_class=20", "train.epochs=1", "train.batch_size=50", "sample.images=20", "sample.steps=2",
        "scores.train_images=500", "scores.reference_images=40"]  # fmt: skip


def test_frechet_equals_the_closed_form_of_two_gaussians() -> None:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(200_000, 3, generator=g, dtype=torch.float64) * torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64)
    b = torch.randn(200_000, 3, generator=g, dtype=torch.float64) * torch.tensor([3.0, 1.0, 0.5], dtype=torch.float64)
    b = b + torch.tensor([1.0, 0.0, -2.0], dtype=torch.float64)
    # diagonal covariances: ||mu_a - mu_b||^2 + sum (sigma_a - sigma_b)^2
    expected = (1 + 0 + 4) + ((1 - 3) ** 2 + (2 - 1) ** 2 + 0)
    assert math.isclose(frechet(a, b), expected, rel_tol=0.02)
    assert abs(frechet(a, a)) < 1e-6
    # a rotation of both sets leaves it unchanged (the trace term is basis-free)
    q, _ = torch.linalg.qr(torch.randn(3, 3, generator=g, dtype=torch.float64))
    assert math.isclose(frechet(a @ q, b @ q), frechet(a, b), rel_tol=1e-6)


def test_crops_are_windows_of_each_image() -> None:
    images = torch.arange(2 * 6 * 6, dtype=torch.float32).reshape(2, 1, 6, 6)
    out = crops(images, 3, seed=0)
    assert out.shape == (2, 1, 3, 3)
    for i in range(2):
        found = [(t, l) for t in range(4) for l in range(4) if torch.equal(images[i, :, t : t + 3, l : l + 3], out[i])]
        assert len(found) == 1
    assert crops(images, 6, seed=0) is images
    assert resample(images / 100, 6) is not None and resample(images, 12).shape == (2, 1, 12, 12)


def test_prediction_verdicts_follow_the_two_standard_error_rule() -> None:
    def run(a: list[float], b: list[float]) -> dict:
        to = lambda vals: {"scores": {str(i): {"28": {"fid": v}} for i, v in enumerate(vals)}}  # noqa: E731
        return {"schemes": {"a": to(a), "b": to(b)}}

    claim = Prediction("test", ("a", "b"))  # a has the lower (better) FID
    assert verdict(run([1.0, 1.1, 0.9], [5.0, 5.2, 4.8]), claim, 28).startswith("yes")
    assert verdict(run([5.0, 5.2, 4.8], [1.0, 1.1, 0.9]), claim, 28).startswith("no")
    assert verdict(run([1.0, 3.0, 5.0], [2.0, 4.0, 6.0]), claim, 28).startswith("unresolved")
    assert verdict(run([1.0], [2.0]), claim, 28).startswith("untested")
    assert verdict({"schemes": {}}, claim, 28) == "not run"


def test_config_checks_name_the_problem() -> None:
    cfg = load_config("configs/fmnist_dit.yaml")
    assert cfg.sizes == [14, 28, 42] and cfg.seeds == [0, 1, 2]
    dype = cfg.scheme("rope2d+yarn+dype")
    assert (dype.base, dype.scaling, dype.scaling_options) == ("rope2d", "yarn", {"schedule": "dype"})
    assert cfg.scheme("dit").inherit and cfg.scheme("rope2d+logn").log_n_attention
    for override, message in (
        ("train.mixup=0.2", "does not use them"), ("data.img_size=15", "multiple of model.patch_size"),
        ("sample.guidance=0.5", "guidance scale"),
        ("schemes=[peg2d]", r"schemes\[peg2d\]: peg2d on DiTTransformer2DModel"),
        ("schemes=[{name: x, pos: rope2d, inherit: true}]", "inherit keeps DiT's own"),
        ("schemes=[alibi2d, alibi2d+yarn]", r"schemes\[alibi2d\+yarn\]: RoPE scaling applies to rope"),
        ("data.dataset=folder", "takes fashion_mnist"),
    ):  # fmt: skip
        with pytest.raises(ConfigError, match=message):
            load_config(QUICK, [override])
    jobs = parallel_jobs("configs/fmnist_dit.yaml", [], cfg)
    rope = next(args for label, args in jobs if label == "seed 0 rope2d")
    assert rope[rope.index("--entries") + 1 :] == ["rope2d", "rope2d+yarn+dype", "rope2d+yarn", "rope2d+ntk+dype",
                                                   "rope2d+ntk", "rope2d+linear", "rope2d+logn"]  # fmt: skip


def test_the_quick_config_runs_end_to_end_and_resumes(tmp_path, capsys) -> None:
    args = ["--config", QUICK, f"out_dir={tmp_path}", *TINY, "--quiet"]
    assert main(args) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["sizes"] == [14, 28, 42] and set(results["floor"]) == {"14", "28", "42"}
    assert list(results["schemes"]) == ["dit", "rope2d", "rope2d+yarn+dype"]
    for name, entry in results["schemes"].items():
        scores = entry["scores"]["0"]
        for size in ("14", "28", "42"):
            assert all(math.isfinite(scores[size][k]) for k in ("fid", "patch_fid", "accuracy"))
            assert (tmp_path / name / f"samples_{size}.png").is_file()
    same = results["schemes"]["rope2d"]["scores"]["0"], results["schemes"]["rope2d+yarn+dype"]["scores"]["0"]
    assert same[0]["14"]["fid"] == same[1]["14"]["fid"]  # at the training size DyPE-YaRN changes nothing
    assert same[0]["42"]["fid"] != same[1]["42"]["fid"]  # above it, it does
    assert (tmp_path / "results.md").is_file() and (tmp_path / "scores.png").is_file()
    assert (tmp_path / "classes.png").is_file()  # one class at every size, by the entries that ran
    checkpoint = tmp_path / "rope2d" / "checkpoint.pt"
    stamp = checkpoint.stat().st_mtime_ns
    capsys.readouterr()
    assert main(args) == 0  # every entry finished: nothing is trained or sampled again
    assert checkpoint.stat().st_mtime_ns == stamp
    assert "step" not in capsys.readouterr().out
    assert json.loads((tmp_path / "results.json").read_text())["schemes"] == results["schemes"]
    from train.generation_status import main as status

    capsys.readouterr()
    assert status(["--config", QUICK, f"out_dir={tmp_path}", *TINY]) == 0
    table = capsys.readouterr().out
    assert "| `rope2d+yarn+dype` | scored |" in table and "3 of 3 entries scored" in table


def test_an_interrupted_training_resumes_to_the_same_weights(tmp_path) -> None:
    from train.engine.diffusion import train_dit
    from train.experiment.generate import GenerationRun
    from train.runtime.process import setup

    cfg = load_config(QUICK, [f"out_dir={tmp_path}", *TINY, "train.epochs=2", "train.checkpoint_every=1",
                              "schemes=[rope2d]"])  # fmt: skip
    rt = setup("cpu")
    run = GenerationRun(cfg, rt, lambda _: None)
    whole = train_dit(cfg, cfg.schemes[0], run.images, run.labels, 10, rt, tmp_path / "whole", lambda _: None)

    class Stop(Exception):
        pass

    def stop_at_step_3(text: str) -> None:
        if "step 3/" in text:
            raise Stop

    with pytest.raises(Stop):  # killed in its third step, after the checkpoint of the second
        train_dit(cfg, cfg.schemes[0], run.images, run.labels, 10, rt, tmp_path / "cut", stop_at_step_3)
    said: list[str] = []
    resumed = train_dit(cfg, cfg.schemes[0], run.images, run.labels, 10, rt, tmp_path / "cut", said.append)
    assert said[0].startswith("[rope2d] resumed at step 2 of 8")
    for (name, a), b in zip(whole.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=name)


@pytest.mark.slow
def test_two_processes_train_sample_and_report(tmp_path) -> None:
    """Under torchrun (two gloo processes, DDP) the run trains every entry, one process samples and scores, and the
    report holds every entry at every size."""
    import subprocess
    import sys

    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "train", "--config", QUICK,
               f"out_dir={tmp_path}", *TINY, "--quiet"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert list(results["schemes"]) == ["dit", "rope2d", "rope2d+yarn+dype"]
    assert all(set(e["scores"]["0"]) == {"14", "28", "42"} for e in results["schemes"].values())
