"""Train each scheme on each task under identical settings, evaluate it and its evaluation-only variants.

One job = one (task, trained scheme): train, then evaluate the model and every row whose ``base`` is this
scheme (RoPE scalings, learned1d out-of-range rules; LongRoPE factors are searched here when not given).
Jobs run in worker processes on CPU (``workers``), each with its own seeded data, so results do not
depend on how jobs are scheduled.
"""

from __future__ import annotations

import time
import zlib
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict
from multiprocessing import get_context
from typing import Any

import torch
import torch.nn.functional as F

import vispos
from train.engine.schedule import warmup_cosine
from train.runtime.seeds import mix_seed

from .config import BenchConfig, SchemeConfig
from .model import TinyLM
from .search import search_longrope
from .tasks import Batch, Passkey, Task, build_task

EvalSets = dict[int, list[tuple[float | None, Batch]]]  # length -> [(passkey depth or None, batch)]


def seed_for(cfg: BenchConfig, *parts: object) -> int:
    """A stable seed per purpose (same data for every scheme, different for train / eval / search)."""
    return mix_seed(cfg.seed, zlib.crc32("/".join(map(str, parts)).encode()), modulus=2**63)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def answer_loss(model: TinyLM, batch: Batch, device: torch.device) -> torch.Tensor:
    inputs, targets, scored = (t.to(device) for t in batch.split())
    logits = model(inputs)  # [B, N-1, vocab]
    return F.cross_entropy(logits[scored], targets[scored])


def lr_at(step: int, cfg: BenchConfig, drop_at: int | None = None) -> float:
    """Linear warm-up then cosine decay to 0; DroPE with ``drope_schedule: restart`` starts over at the drop
    (the recalibration phase of the DroPE recipe), so positions-off training gets a full schedule."""
    t = cfg.train
    start, steps = 0, t.steps
    if drop_at is not None and t.drope_schedule == "restart" and step >= drop_at:
        start, steps = drop_at, t.steps - drop_at
    return warmup_cosine(step - start, steps, max(1, round(t.warmup * steps)), peak=t.lr)


def train_model(cfg: BenchConfig, scheme: SchemeConfig, task: Task, device: torch.device) -> tuple[TinyLM, dict]:
    """Train one scheme; DroPE switches positions off for the final ``scheme.drope`` fraction of steps."""
    t = cfg.train
    torch.manual_seed(cfg.seed)
    model = TinyLM(task.vocab_size, cfg.model, pos=scheme.pos, options=scheme.options, train_length=t.length)
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, weight_decay=t.weight_decay, betas=(0.9, 0.98))
    generator = torch.Generator().manual_seed(seed_for(cfg, task.name, "train"))
    drop_at = round((1 - scheme.drope) * t.steps) if scheme.drope else t.steps
    curve, window, start = [], [], time.perf_counter()
    for step in range(t.steps):
        if scheme.drope:
            model.set_positions(step < drop_at)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg, drop_at if scheme.drope else None)
        length = t.length
        if t.min_length is not None:
            low = max(t.min_length, task.min_length())
            length = int(torch.randint(low, t.length + 1, (1,), generator=generator))
        loss = answer_loss(model, task.sample(t.batch_size, length, generator), device)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if t.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        window.append(loss.item())
        if (step + 1) % t.log_every == 0 or step + 1 == t.steps:
            curve.append([step + 1, sum(window) / len(window)])
            window = []
            if cfg.progress:
                print(
                    f"[{task.name}/{scheme.name}] step {step + 1}/{t.steps} loss {curve[-1][1]:.4f} "
                    f"({time.perf_counter() - start:.0f}s)",
                    flush=True,
                )
    model.eval()
    stats = {
        "seconds": time.perf_counter() - start,
        "final_loss": curve[-1][1],
        "curve": curve,
        "params": sum(p.numel() for p in model.parameters()),
        "drop_at": drop_at if scheme.drope else None,
    }
    return model, stats


def make_eval_sets(cfg: BenchConfig, task: Task, lengths: list[int], samples: int, purpose: str) -> EvalSets:
    """Fixed evaluation sequences per length (passkey: the same number at each depth)."""
    sets: EvalSets = {}
    for length in lengths:
        g = torch.Generator().manual_seed(seed_for(cfg, task.name, purpose, length))
        if isinstance(task, Passkey):
            per_depth = max(1, samples // len(cfg.passkey.depths))
            sets[length] = [(d, task.sample(per_depth, length, g, depth=d)) for d in cfg.passkey.depths]
        else:
            sets[length] = [(None, task.sample(samples, length, g))]
    return sets


@torch.no_grad()
def score(model: TinyLM, batch: Batch, device: torch.device, batch_size: int) -> tuple[torch.Tensor, float]:
    """Per-sequence (right answer tokens, answer tokens) [B, 2] and the summed answer loss."""
    counts, loss_sum = [], 0.0
    for i in range(0, batch.tokens.shape[0], batch_size):
        part = Batch(batch.tokens[i : i + batch_size], batch.answer[i : i + batch_size])
        inputs, targets, scored = (t.to(device) for t in part.split())
        logits = model(inputs).float()
        right = (logits.argmax(-1) == targets) & scored
        counts.append(torch.stack((right.sum(1), scored.sum(1)), dim=1).cpu())
        loss_sum += F.cross_entropy(logits[scored], targets[scored], reduction="sum").item()
    return torch.cat(counts), loss_sum


def accuracy(counts: torch.Tensor, metric: str) -> float:
    if metric == "exact":
        return (counts[:, 0] == counts[:, 1]).float().mean().item()
    return (counts[:, 0].sum() / counts[:, 1].sum()).item()


def evaluate(model: TinyLM, task: Task, sets: EvalSets, device: torch.device, batch_size: int) -> dict[str, Any]:
    """Accuracy and mean answer loss per length (and per depth for passkey); errors recorded, not raised."""
    out: dict[str, Any] = {"accuracy": {}, "loss": {}, "errors": {}}
    if isinstance(task, Passkey):
        out["by_depth"] = {}
    for length, parts in sets.items():
        key = str(length)
        try:
            scored = [(depth, *score(model, batch, device, batch_size)) for depth, batch in parts]
        except ValueError as e:  # e.g. learned1d with out_of_range="error" beyond its table
            out["accuracy"][key] = out["loss"][key] = None
            out["errors"][key] = str(e)
            if "by_depth" in out:
                out["by_depth"][key] = {str(d): None for d, _ in parts}
            continue
        counts = torch.cat([c for _, c, _ in scored])
        out["accuracy"][key] = accuracy(counts, task.metric)
        out["loss"][key] = sum(s for _, _, s in scored) / counts[:, 1].sum().item()
        if "by_depth" in out:
            out["by_depth"][key] = {str(d): accuracy(c, task.metric) for d, c, _ in scored}
    return out


def make_scaling(cfg: BenchConfig, name: str, options: dict[str, Any],
                 long_factors: list[float] | None) -> vispos.RopeScaling:
    """A row's RoPE scaling at the training length; LongRoPE's factors from the config or the search."""
    options = {"original_length": cfg.train.length, "type": name} | dict(options)
    if name == "longrope":
        if long_factors is None:
            raise ValueError("longrope needs long_factors (given in the config or found by the search)")
        options.setdefault("factor", cfg.longrope.factor)
        options.setdefault("long_factors", tuple(long_factors))
        options.setdefault("short_factors", tuple(1.0 for _ in long_factors))
    return vispos.RopeScaling(**options)


def run_job(cfg: BenchConfig, task_name: str, scheme_name: str) -> dict[str, Any]:
    """Train ``scheme_name`` on ``task_name``; evaluate it and its variants. Returns {rows, longrope}."""
    torch.set_num_threads(cfg.threads)
    device = resolve_device(cfg.device)
    task = build_task(task_name, cfg)
    scheme = next(s for s in cfg.schemes if s.name == scheme_name)
    model, stats = train_model(cfg, scheme, task, device)
    start = time.perf_counter()
    sets = make_eval_sets(cfg, task, cfg.lengths(), cfg.eval.samples, "eval")
    rows = {
        scheme.name: {**row_info(scheme), "train": stats, **evaluate(model, task, sets, device, cfg.eval.batch_size)}
    }
    longrope: dict[str, Any] | None = None
    for variant in (s for s in cfg.schemes if s.base == scheme.name):
        if variant.out_of_range is not None:
            model.set_out_of_range(variant.out_of_range)
        else:
            factors = None
            if variant.scaling == "longrope":
                if longrope is None:
                    longrope = find_longrope(cfg, model, task, device)
                factors = longrope["long_factors"]
            vispos.configure(model, scaling=make_scaling(cfg, variant.scaling, variant.scaling_options, factors))
        rows[variant.name] = {**row_info(variant), **evaluate(model, task, sets, device, cfg.eval.batch_size)}
        if variant.scaling is not None:
            vispos.configure(model, scaling=None)
        else:
            model.set_out_of_range(scheme.options.get("out_of_range", "error"))
    if cfg.progress:
        print(
            f"[{task.name}/{scheme.name}] evaluated {len(rows)} row(s) in {time.perf_counter() - start:.0f}s",
            flush=True,
        )
    return {"task": task_name, "rows": rows, "longrope": longrope}


def find_longrope(cfg: BenchConfig, model: TinyLM, task: Task, device: torch.device) -> dict[str, Any]:
    """Given factors, or a small search on held-out sequences at held-out lengths (never the eval sets)."""
    if cfg.longrope.long_factors is not None:
        return {"long_factors": list(cfg.longrope.long_factors), "searched": False}
    lengths = [round(m * cfg.train.length) for m in cfg.longrope.search_multiples]
    sets = make_eval_sets(cfg, task, lengths, cfg.longrope.search_samples, "longrope-search")

    def objective(factors: list[float]) -> float:
        vispos.configure(model, scaling=make_scaling(cfg, "longrope", {}, factors))
        result = evaluate(model, task, sets, device, cfg.eval.batch_size)
        return sum(result["loss"].values()) / len(lengths)

    generator = torch.Generator().manual_seed(seed_for(cfg, task.name, "longrope-mutations"))
    best, value, tried = search_longrope(
        objective,
        model.head_dim // 2,
        scale=max(cfg.longrope.search_multiples),
        generator=generator,
        mutations=cfg.longrope.candidates,
        rounds=cfg.longrope.rounds,
    )
    vispos.configure(model, scaling=None)
    return {"long_factors": best, "searched": True, "objective": value, "tried": tried, "search_lengths": lengths}


def row_info(scheme: SchemeConfig) -> dict[str, Any]:
    info = asdict(scheme)
    info["kind"] = "trained" if scheme.trains else "variant"
    return info


def run(cfg: BenchConfig) -> dict[str, Any]:
    """All jobs (in parallel on CPU when ``workers`` > 1); results keyed by task, then row, in config order."""
    start = time.perf_counter()
    trained = [s.name for s in cfg.schemes if s.trains]
    weight = {s: sum(v.base == s for v in cfg.schemes) for s in trained}  # most variants first
    jobs = sorted(((t, s) for t in cfg.tasks for s in trained), key=lambda j: -weight[j[1]])
    outputs: list[dict[str, Any]] = []
    if cfg.workers == 1:
        outputs = [run_job(cfg, t, s) for t, s in jobs]
    else:
        with ProcessPoolExecutor(cfg.workers, mp_context=get_context("spawn")) as pool:
            futures = [pool.submit(run_job, cfg, t, s) for t, s in jobs]
            for n, future in enumerate(as_completed(futures), 1):
                outputs.append(future.result())
                if cfg.progress:
                    print(f"-- {n}/{len(jobs)} jobs done ({time.perf_counter() - start:.0f}s)", flush=True)
    tasks: dict[str, Any] = {}
    for name in cfg.tasks:
        task = build_task(name, cfg)
        found = {k: v for o in outputs if o["task"] == name for k, v in o["rows"].items()}
        longrope = next((o["longrope"] for o in outputs if o["task"] == name and o["longrope"]), None)
        rows = {s.name: found[s.name] for s in cfg.schemes}
        tasks[name] = {"metric": task.metric, "rows": rows, "longrope": longrope}
    return {"tasks": tasks, "wall_seconds": time.perf_counter() - start}
