"""A loop of one's own over the blocks (``Positions.embed``): tokens get every position they carry, the
additive table included, exactly as the patched model's own forward gives them; docs/patching.md's loop runs with
additive schemes and its output changes when the positions are switched off."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import timm
import torch

import vispos

ROOT = Path(__file__).resolve().parents[1]


def own_loop_block() -> str:
    """docs/patching.md's "loop of your own" example (the Python block that loops over ``model.blocks`` itself)."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs/patching.md").read_text(), flags=re.S)
    (code,) = [b for b in blocks if "for blk in model.blocks" in b]
    return code


def run_readme_loop(pos: str, *, positions_on: bool, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """docs/patching.md's loop with ``pos`` in place of its schemes, positions on or off (``Positions.enabled``),
    from seed 0: the same weights, images and masks either way."""
    code, n = re.subn(r'pos=(\[[^\]]*\]|"[^"]*")', f"pos={pos!r}", own_loop_block(), count=1)
    assert n == 1, "docs/patching.md's loop names its schemes as pos=..."
    real = vispos.create_model

    def create_model(*args: Any, **kwargs: Any) -> torch.nn.Module:
        model = real(*args, **kwargs)
        with torch.no_grad():  # a learned table starts at zero-mean noise; make it plainly non-zero
            for p in model.vispos.parameters():
                p.add_(0.5)
        model.vispos.enabled = positions_on
        return model

    monkeypatch.setattr(vispos, "create_model", create_model)
    torch.manual_seed(0)
    scope: dict[str, Any] = {}
    exec(compile(code, "docs/patching.md own-loop block", "exec"), scope)
    return scope


@pytest.mark.parametrize("pos", ["learned2d", "sincos2d", ["learned2d", "rope2d"]])
def test_readme_own_loop_gives_tokens_their_additive_positions(pos: str | list[str],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    on = run_readme_loop(pos, positions_on=True, monkeypatch=monkeypatch)
    off = run_readme_loop(pos, positions_on=False, monkeypatch=monkeypatch)
    assert torch.equal(on["x"], off["x"])  # the same inputs: only the positions differ
    for name in ("kept", "merged"):
        gap = (on[name] - off[name]).abs().max().item()
        assert gap > 1e-2, f"{name}: the loop's output is the same with positions on and off ({gap})"


def small_model(pos: str | list[str], **kwargs: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", img_size=64, depth=2, num_classes=0, **kwargs)
    vispos.patch(model, pos)
    with torch.no_grad():
        for p in model.vispos.parameters():
            p.add_(0.5)
    return model.eval()


def prefix_tokens(model: torch.nn.Module) -> torch.Tensor | None:
    tokens = [t for t in (model.cls_token, getattr(model, "reg_token", None)) if t is not None]
    return torch.cat(tokens, dim=1) if tokens else None


@pytest.mark.parametrize(("pos", "kwargs"), [
    (["learned2d", "rope2d"], {}),
    ("sincos2d", {"reg_tokens": 2}),
    (["learned2d", "relbias2d"], {"class_token": False, "global_pool": "avg"}),
])
@torch.no_grad()
def test_embed_on_the_whole_grid_is_the_models_own_forward(pos: str | list[str], kwargs: dict[str, Any]) -> None:
    model = small_model(pos, **kwargs)
    images = torch.randn(2, 3, 64, 48)
    x = model.patch_embed(images).flatten(1, 2)  # [2, 12, 192]
    rows, ctx = model.vispos.embed(x, (4, 3), prefix=prefix_tokens(model))
    for blk in model.blocks:
        rows = blk(rows, attn_mask=ctx)
    torch.testing.assert_close(model.norm(rows), model.forward_features(images))


@torch.no_grad()
def test_embed_gives_kept_and_ragged_tokens_the_table_at_their_own_cells() -> None:
    model = small_model(["learned2d", "rope2d"])  # one class token
    x = model.patch_embed(torch.randn(2, 3, 64, 64)).flatten(1, 2)  # [2, 16, 192]
    prefix = model.cls_token
    dense, _ = model.vispos.embed(x, (4, 4), prefix=prefix)
    keep = torch.tensor([[5, 0, 15], [2, 9, 3]])
    kept, ctx = model.vispos.embed(x.gather(1, keep[..., None].expand(-1, -1, 192)), (4, 4), keep=keep,
                                   prefix=prefix)
    index = torch.cat((torch.zeros(2, 1, dtype=torch.long), keep + 1), dim=1)  # prefix first
    torch.testing.assert_close(kept, dense.gather(1, index[..., None].expand(-1, -1, 192)))
    assert ctx.tokens.shape == (2, 4)
    cells = torch.cartesian_prod(torch.arange(4), torch.arange(4)).expand(2, -1, -1)  # [2, 16, 2]
    ragged, rctx = model.vispos.embed(x, coords=cells, sizes=torch.tensor([[4, 4]] * 2), prefix=prefix)
    torch.testing.assert_close(ragged, dense)
    assert rctx.ragged is not None
    model.vispos.enabled = False  # DroPE: no positions at all
    plain, _ = model.vispos.embed(x, (4, 4), prefix=prefix)
    torch.testing.assert_close(plain, torch.cat((prefix.expand(2, -1, -1), x), dim=1))


@pytest.mark.parametrize(("call", "match"), [
    (lambda p, x: p.embed(x, (4, 4)), r"this model has 1 prefix token\(s\).*prefix=\[B or 1, 1, C\], got None"),
    (lambda p, x: p.embed(x[:, :15], (4, 4), prefix=torch.zeros(1, 1, 192)), r"x holds 15 tokens per row; the H\*W"),
    (lambda p, x: p.embed(x, (4, 4), keep=torch.tensor([[0, 1]] * 2), prefix=torch.zeros(1, 1, 192)),
     r"x holds 16 tokens per row; one token per kept cell \(keep \[B, K\]\) is 2"),
    (lambda p, x: p.embed(x, (4, 4), coords=torch.zeros(2, 16, 2, dtype=torch.long)), r"exactly one of them"),
    (lambda p, x: p.embed(x), r"exactly one of them"),
    (lambda p, x: p.embed(x, (4, 4), sizes=torch.tensor([[4, 4]])), r"pass them with coords=, not grid="),
    (lambda p, x: p.embed(x, coords=torch.zeros(2, 16, 2, dtype=torch.long), keep=torch.tensor([[0]])),
     r"keep selects cells of one grid"),
    (lambda p, x: p.embed(x[0], (4, 4)), r"patch tokens x \[B, N, C\], got shape \(16, 192\)"),
])
def test_embed_names_what_is_wrong(call: Any, match: str) -> None:
    model = small_model(["learned2d", "rope2d"])
    x = torch.randn(2, 16, 192)
    with pytest.raises(ValueError, match=match):
        call(model.vispos, x)


def test_embed_without_prefix_tokens_refuses_a_prefix() -> None:
    model = small_model("learned2d", class_token=False, global_pool="avg")
    with pytest.raises(ValueError, match=r"this model has 0 prefix token\(s\).*, or no prefix, got \(1, 1, 192\)"):
        model.vispos.embed(torch.randn(2, 16, 192), (4, 4), prefix=torch.zeros(1, 1, 192))
