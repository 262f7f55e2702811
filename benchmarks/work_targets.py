"""The targets ``benchmarks/patch_work.py`` checks on its counts, one verdict per scheme and target.

- every vispos rotary scheme adds at most the bytes of timm's equivalent (RoPE-Mixed for ``rope2d_mixed``, axial
  RoPE for the others: ``vit_small_patch16_rope_224``) and at most 2x its floor, in every setting counted;
- ``comrope2d``, ``liere2d``, ``string2d`` (and STRING folded into the projections) add at inference at most 1.5x
  the bytes ``rope2d`` adds;
- a bias scheme writes one mask per forward at inference (one per layer for a per-layer table): kernel outputs of
  a mask's size (``work_floor.mask_writes``).
"""

from __future__ import annotations

from collections.abc import Callable

TIMM_AXIAL = "timm vit_small_patch16_rope_224"
TIMM_MIXED = "timm vit_small_patch16_rope_mixed_224"
CACHED = ("comrope2d", "liere2d", "string2d", "string2d (folded)")  # rotations kept between forwards at inference
Record = dict[str, object]


def setting(r: Record) -> str:
    return f"{r['size']}px {r['mode']} {r['dtype']}"


Measure = Callable[[Record], float]


def verdict(target: str, rows: list[Record], value: Measure, limit: Measure) -> dict[str, object]:
    """Whether value <= limit in every row; the detail names the worst row (highest value / limit)."""
    ratios = [(value(r) / limit(r) if limit(r) else float("inf"), r) for r in rows]
    worst, row = max(ratios, key=lambda x: x[0])
    failing = sum(ratio > 1 for ratio, _ in ratios)
    detail = f"worst {worst:.2f} of the limit at {setting(row)}; {failing} of {len(rows)} settings over"
    return {"target": target, "holds": failing == 0, "worst": round(worst, 3), "detail": detail}


def check_targets(records: list[Record]) -> list[dict[str, object]]:
    """Verdicts for the rows present (a target whose rows were not counted is skipped)."""
    added = [r for r in records if r.get("added") is not None]
    index = {(r["config"], r["size"], r["mode"], r["dtype"]): r for r in added}

    def twin(r: Record, label: str) -> Record | None:
        return index.get((label, r["size"], r["mode"], r["dtype"]))

    def added_bytes(r: Record | None) -> int:
        return r["added"]["bytes"]  # type: ignore[index]

    verdicts: list[dict[str, object]] = []
    rotary = [r["config"] for r in added if r["kind"] == "rotary" and r["config"].startswith("vispos")]
    for label in dict.fromkeys(rotary):
        scheme = label.removeprefix("vispos ")
        rows = [r for r in added if r["config"] == label]
        timm_label = TIMM_MIXED if scheme == "rope2d_mixed" else TIMM_AXIAL
        if all(twin(r, timm_label) for r in rows):
            target = f"{scheme} adds at most the bytes {timm_label.removeprefix('timm ')} adds"
            verdicts.append(verdict(target, rows, added_bytes, lambda r, t=timm_label: added_bytes(twin(r, t))))
        target = f"{scheme} adds at most 2x its floor"
        verdicts.append(verdict(target, rows, added_bytes, lambda r: 2 * r["floor_bytes"]))
        inference = [r for r in rows if r["mode"] == "inference"]
        if scheme in CACHED and inference and all(twin(r, "vispos rope2d") for r in inference):
            target = f"{scheme} adds at inference at most 1.5x the bytes rope2d adds"
            limit = lambda r: 1.5 * added_bytes(twin(r, "vispos rope2d"))  # noqa: E731
            verdicts.append(verdict(target, inference, added_bytes, limit))
    for label in dict.fromkeys(r["config"] for r in added if r["kind"] == "bias"):
        rows = [r for r in added if r["config"] == label and r["mode"] == "inference"]
        first = rows[0]
        expected = first["layers"] if first["per_layer"] else 1
        what = f"one mask per {'layer' if expected > 1 else 'forward'}"
        writes = ", ".join(f"{setting(r)}: {r['mask_writes']}" for r in rows)
        holds = all(r["mask_writes"] == expected for r in rows)
        masks = f"{expected} mask{'s' if expected > 1 else ''}"
        verdicts.append({"target": f"{label.removeprefix('vispos ')} writes {what} at inference ({masks})",
                         "holds": holds, "detail": f"mask-sized writes {writes}"})  # fmt: skip
    return verdicts
