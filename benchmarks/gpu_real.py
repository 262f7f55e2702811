"""The real-device counterparts of the fake-CUDA tests (``tests/test_fake_cuda_timm.py``, ``..._hf.py``), which
cannot run a backward or see which kernel a device picks: for ``benchmarks.gpu_check``.

- A bf16 training step (autocast, fp32 weights, AdamW) per 2D scheme and host (a timm ViT-S, a transformers
  ViT of the same size): its time, its loss and gradients finite, and the SDPA kernel(s) the step reaches.
- A device-map load per host: a patched model saved as sharded safetensors and loaded with a device map putting
  some blocks on the device and the rest on the CPU (timm: accelerate's ``init_empty_weights`` then
  ``load_checkpoint_and_dispatch``; transformers: ``vispos.hf.from_pretrained(folder, device_map=...)``), its
  outputs against the in-memory model's.

Each measurement that raises is reported with its error, not fatal. ``dry_run``: tiny models on the CPU."""

from __future__ import annotations

import math
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import timm
import torch
from torch import nn

import vispos
from vispos.diagnostics.kernels import sdpa_kernels


def timm_vit(dry_run: bool) -> nn.Module:
    small = dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=2) if dry_run else {}
    return timm.create_model("vit_small_patch16_224", num_classes=10, **small)


def hf_vit(dry_run: bool) -> nn.Module:
    import transformers as tf

    size = dict(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                intermediate_size=128) if dry_run else dict(hidden_size=384, num_attention_heads=6,
                                                            intermediate_size=1536)  # ViT-S  # fmt: skip
    return tf.ViTForImageClassification(tf.ViTConfig(**size, num_labels=10))


HOSTS: dict[str, Callable[[bool], nn.Module]] = {"timm": timm_vit, "transformers": hf_vit}


def logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return out if isinstance(out, torch.Tensor) else out.logits


def error(e: Exception) -> str:
    return f"failed: {type(e).__name__}: {' '.join(str(e).split())[:300]}"


def train_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, device: torch.device) -> dict[str, object]:
    """Two bf16-autocast training steps (the first warms up); the second timed, its SDPA kernels read."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(logits(model, x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        return loss

    step()
    finite = [True]

    def timed() -> None:
        loss = step()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        finite[0] = bool(torch.isfinite(loss)) and all(bool(torch.isfinite(g).all()) for g in grads)

    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    timed()  # timed without the profiler, then once more under it for the kernels
    if device.type == "cuda":
        torch.cuda.synchronize()
    ms = (time.perf_counter() - start) * 1e3
    kernels = ", ".join(sorted(sdpa_kernels(timed))) or "none (FlexAttention)"
    return {"ms": ms, "finite": finite[0], "kernel": kernels}


def train_steps(device: torch.device, batch: int, dry_run: bool) -> dict[str, dict[str, dict | str]]:
    """host -> scheme -> {ms, finite, kernel} or an error."""
    size = 32 if dry_run else 224
    out: dict[str, dict[str, dict | str]] = {}
    for host, build in HOSTS.items():
        out[host] = {}
        for scheme in vispos.list_encodings(ndim=2):
            torch.manual_seed(0)
            try:
                model = vispos.patch(build(dry_run), scheme, inherit=False).to(device).train()
                x = torch.randn(batch, 3, size, size, device=device)
                y = torch.randint(0, 10, (batch,), device=device)
                out[host][scheme] = train_step(model, x, y, device)
            except Exception as e:  # noqa: BLE001 (reported, the check goes on)
                out[host][scheme] = error(e)
        print(f"training steps, {host}: {out[host]}", flush=True)
    return out


def split_map(model: nn.Module, device: str) -> dict[str, str]:
    """The first half of a timm ViT's blocks and everything outside the blocks on ``device``, the rest on the
    CPU (accelerate moves them in at call time)."""
    names = [n for n, _ in model.named_children() if n != "blocks"]
    names += [n for n, _ in model.named_parameters(recurse=False)] + [n for n, _ in model.named_buffers(recurse=False)]
    half = len(model.blocks) // 2
    return {**dict.fromkeys(names, device), **{f"blocks.{i}": device if i < half else "cpu"
                                              for i in range(len(model.blocks))}}  # fmt: skip


def _timm_load(model: nn.Module, folder: Path, device_map: dict, dry_run: bool) -> nn.Module:
    from accelerate import init_empty_weights, load_checkpoint_and_dispatch

    with init_empty_weights():
        empty = vispos.patch(timm_vit(dry_run), "rope2d", inherit=False)
    return load_checkpoint_and_dispatch(empty, str(folder), device_map=device_map)


def device_map_loads(device: torch.device, dry_run: bool) -> dict[str, dict[str, object] | str]:
    """host -> {device_map, max_abs_diff against the in-memory model} or an error; fp32, eval mode."""
    out: dict[str, dict[str, object] | str] = {}
    size = 32 if dry_run else 224
    x = torch.randn(2, 3, size, size)
    for host in HOSTS:
        torch.manual_seed(0)
        try:
            with tempfile.TemporaryDirectory() as tmp:
                folder = Path(tmp)
                if host == "timm":
                    model = vispos.patch(timm_vit(dry_run), "rope2d", inherit=False).eval()
                    from huggingface_hub import save_torch_state_dict

                    save_torch_state_dict(model.state_dict(), folder, max_shard_size="200KB" if dry_run else "20MB")
                    device_map = split_map(model, str(device))
                    loaded = _timm_load(model, folder, device_map, dry_run).eval()
                else:
                    model = vispos.patch(hf_vit(dry_run), "rope2d", inherit=False).eval()
                    model.save_pretrained(folder, max_shard_size="200KB" if dry_run else "20MB")
                    device_map = "auto" if device.type == "cuda" else {"": "cpu"}
                    loaded = vispos.hf.from_pretrained(folder, device_map=device_map).eval()
                with torch.no_grad():
                    diff = (logits(loaded, x.to(device)).float().cpu() - logits(model, x)).abs().max().item()
                out[host] = {"device_map": device_map if isinstance(device_map, str) else "blocks split device / cpu",
                             "max_abs_diff": diff, "equal": math.isfinite(diff) and diff < 1e-4}  # fmt: skip
        except Exception as e:  # noqa: BLE001 (reported, the check goes on)
            out[host] = error(e)
        print(f"device-map load, {host}: {out[host]}", flush=True)
    return out


def markdown(steps: dict, loads: dict) -> str:
    lines = ["## bf16 training step per scheme and host", "| scheme | " + " | ".join(
        f"{h} ms | {h} finite | {h} SDPA kernel" for h in steps) + " |", "| --- |" + " ---: | --- | --- |" * len(steps)]
    for scheme in next(iter(steps.values())):
        cells = []
        for host in steps:
            r = steps[host][scheme]
            cells += [r, "", ""] if isinstance(r, str) else [f"{r['ms']:.1f}", str(r["finite"]), r["kernel"]]
        lines.append(f"| {scheme} | " + " | ".join(cells) + " |")
    lines += ["", "## Device-map load (sharded safetensors)", "| host | device map | max abs diff | equal |",
              "| --- | --- | ---: | --- |"]  # fmt: skip
    for host, r in loads.items():
        row = [r, "", ""] if isinstance(r, str) else [r["device_map"], f"{r['max_abs_diff']:.2e}", str(r["equal"])]
        lines.append(f"| {host} | " + " | ".join(row) + " |")
    return "\n".join(lines)
