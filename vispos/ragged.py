"""Ragged and packed batches: where each token of a row sits, and the gathers that give it its position.

A row holds ``P`` prefix tokens (cls, registers), then ``N`` patch tokens. Patch token n of row b sits at
the integer cell ``coords[b, n] = (y, x)`` of its own image's grid (timm NaFlex's ``patch_coord`` order);
``valid[b, n]`` is False for padding. Either one image per row (a padded batch: ``sizes`` [B, 2], the
prefix tokens belong to the row's image) or several images packed in a row (``segments`` [B, N] naming
each token's image among the row's ``sizes`` [B, S, 2]; packed rows hold no prefix tokens, as there is no
rule for which image a shared cls token would belong to).

A token's position is its place in its own image's grid, so every scheme is computed once per distinct
grid size, exactly as for that image alone, and gathered per token: rotations from one table of every
size's rows (``table_index``), relative biases from one table of every size's per-offset values
(``offset_index``), additive tables likewise. Tokens of different images never attend to each other and
padding is never attended to (``structure_mask``), so each image in a batch gives what it gives alone.

Coordinates of a floating dtype are points in patch units (a merged token's mean cell, ToMe): there is no
table row to gather, so each scheme is evaluated at each token's point, once per distinct grid size
(``points``: rotations and additive tables at the points, relative biases from the pairs' offsets); at
whole-number points that equals the gather from cells. A scheme defined at grid cells only (relbias2d's
table, PEG's convolution) takes whole-number points as cells (``as_cells``) and refuses fractional ones.

Applying the gathered positions to the tokens (one rotation table of every size, the per-token query
scale, the conditional scheme per image) is ``vispos.ragged_apply``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass
class RaggedLayout:
    """Every token of a ragged batch of rows [B, T = P + N]: its image, its cell and its image's grid size."""

    sizes: list[tuple[int, int]]  # each group's grid size (H, W): the distinct sizes, ascending, or each image's
    group: torch.Tensor  # [B, T] int64: index into ``sizes`` of the token's group (padding: 0)
    image: torch.Tensor  # [B, T] int64: the token's image, distinct per (row, segment); -1 for padding
    yx: torch.Tensor  # [B, T, 2] int64: (y, x) cell in its image's grid (prefix tokens, padding: 0)
    hw: torch.Tensor  # [B, T, 2] int64: its image's grid size (padding: 1 x 1)
    num_prefix_tokens: int
    fractional: bool = False  # ``yx`` holds points [B, T, 2] fp32 (floating coords), not int64 cells

    @property
    def valid(self) -> torch.Tensor:
        """[B, T] bool: a token of an image (prefix or patch), not padding."""
        return self.image >= 0

    @property
    def prefix(self) -> torch.Tensor:
        """[B, T] bool: the row's first P tokens."""
        b, t = self.image.shape
        return (torch.arange(t, device=self.image.device) < self.num_prefix_tokens).expand(b, t)

    @property
    def grid(self) -> tuple[int, int]:
        """The smallest grid holding every image of the batch: (largest H, largest W)."""
        return max(h for h, _ in self.sizes), max(w for _, w in self.sizes)

    def cells(self) -> torch.Tensor:
        """[B, T] int64: row-major cell y * W + x of each token in its image's grid (prefix, padding: 0)."""
        if self.fractional:
            raise ValueError("fractional coordinates lie between grid cells: there is no cell index to gather")
        return self.yx[..., 0] * self.hw[..., 1] + self.yx[..., 1]

    def as_cells(self) -> RaggedLayout | None:
        """This layout with its points as integer cells, if every point is a whole number (else None)."""
        if not self.fractional:
            return self
        if bool((self.yx != self.yx.round()).any()):
            return None
        return replace(self, yx=self.yx.long(), fractional=False)

    def points(self) -> list[torch.Tensor]:
        """Per distinct size (``sizes``' order): [B, T] bool, its images' patch tokens (row-major over B, T,
        the order of ``point_index``'s rows; ``yx[selected]`` are their points)."""
        patches = self.valid & ~self.prefix
        return [patches & (self.group == u) for u in range(len(self.sizes))]

    def point_index(self, prefix_rows: int) -> torch.Tensor:
        """[B, T] int64: each token's row in the concatenation, over ``sizes``, of per-size tables holding
        ``prefix_rows`` prefix rows then one row per patch token of that size (``points``' order): the
        tables of ``table_index`` evaluated at the tokens' points instead of at every cell. Prefix token j
        reads row j of its image's size; padding reads row 0."""
        index = torch.zeros(self.image.shape, dtype=torch.long, device=self.image.device)
        start = 0
        for u, here in enumerate(self.points()):
            count = int(here.sum())
            index[here] = start + prefix_rows + torch.arange(count, device=index.device)
            if prefix_rows:
                prefix = self.prefix & self.valid & (self.group == u)
                index = torch.where(prefix, start + torch.arange(self.image.shape[1], device=index.device), index)
            start += prefix_rows + count
        return index

    def offsets(self) -> torch.Tensor:
        """[B, T, T, 2] fp32: (dy, dx) = query - key between every pair of tokens, in patch units."""
        yx = self.yx.float()
        return yx[:, :, None] - yx[:, None, :]

    def table_index(self, prefix_rows: int) -> torch.Tensor:
        """[B, T] int64: each token's row in the concatenation, over ``sizes``, of per-size tables holding
        ``prefix_rows`` prefix rows then H * W patch rows (row-major). Prefix token j reads row j of its
        image's table; padding reads row 0 (a real row, hidden by the mask)."""
        rows = torch.tensor([prefix_rows + h * w for h, w in self.sizes], device=self.image.device)
        start = torch.cumsum(rows, 0) - rows  # [U]: where each size's table begins
        local = self.cells() + prefix_rows
        if prefix_rows:
            local = torch.where(self.prefix, torch.arange(self.image.shape[1], device=local.device), local)
        return torch.where(self.valid, start[self.group] + local, 0)

    def offset_index(self) -> torch.Tensor:
        """[B, T, T] int32: where each (query, key) pair reads its bias in the concatenation, over ``sizes``,
        of per-offset values [(2H-1)(2W-1)] (Swin's order) followed by BEiT's three prefix entries
        (prefix -> patch, patch -> prefix, prefix -> prefix). Pairs of different images and padding read
        entry 0 (hidden by the mask)."""
        counts = torch.tensor([(2 * h - 1) * (2 * w - 1) for h, w in self.sizes], device=self.image.device)
        start = torch.cumsum(counts, 0) - counts
        total = counts.sum().to(torch.int32)
        hw, yx = self.hw.to(torch.int32), self.yx.to(torch.int32)  # the [B, T, T] steps in int32
        h, w = hw[..., 0, None], hw[..., 1, None]  # [B, T, 1]: the query's grid
        y, x = yx[..., 0], yx[..., 1]
        dy = y[:, :, None] - y[:, None, :] + h - 1  # [B, T, T]
        dx = x[:, :, None] - x[:, None, :] + w - 1
        index = start.to(torch.int32)[self.group][:, :, None] + dy * (2 * w - 1) + dx
        query, key = self.prefix[:, :, None], self.prefix[:, None, :]
        index = torch.where(query, torch.where(key, total + 2, total), torch.where(key, total + 1, index))
        same = (self.image[:, :, None] == self.image[:, None, :]) & self.valid[:, :, None]
        return torch.where(same, index, 0)

    def pair_mask(self, per_pair: torch.Tensor, entries: torch.Tensor | None) -> torch.Tensor:
        """A bias evaluated at every pair's offset [heads, B, T, T] and BEiT's prefix entries [3, heads] (None:
        zero) -> the bias of every token pair [B, heads, T, T], prefix rows and columns as ``offset_index``
        places them (pairs of different images: 0, hidden by the mask)."""
        heads = per_pair.shape[0]
        to_patch, from_patch, among = (
            (per_pair.new_zeros(heads),) * 3 if entries is None else entries.to(per_pair.dtype)
        )
        query, key = self.prefix[:, None, :, None], self.prefix[:, None, None, :]  # [B, 1, T, 1], [B, 1, 1, T]
        bias = per_pair.transpose(0, 1)  # [B, heads, T, T]
        view = (1, heads, 1, 1)
        prefix = torch.where(key, among.view(view), to_patch.view(view))
        bias = torch.where(query, prefix, torch.where(key, from_patch.view(view), bias))
        same = (self.image[:, :, None] == self.image[:, None, :]) & self.valid[:, :, None]
        return torch.where(same[:, None], bias, 0.0)

    def flex_score_mod(self, values: torch.Tensor):  # noqa: ANN201  (a FlexAttention score_mod)
        """FlexAttention's ``score_mod`` for a relative bias on this batch: ``values`` [heads, V] as
        ``offset_index`` reads them (every size's per-offset values, then BEiT's three prefix entries); the
        index of each pair is computed from the two tokens' cells and grid, so no [B, T, T] tensor exists.
        Padded or packed rows also hide what ``structure_mask`` hides (scores of -inf) in the score_mod: a
        block mask would carry the sequence length as a Python int, a recompile per length. Returns the
        score_mod and the tensors it reads with their dimension that follows the batch's sizes."""
        counts = torch.tensor([(2 * h - 1) * (2 * w - 1) for h, w in self.sizes], device=self.image.device)
        total = counts.sum().to(torch.int32)  # a tensor: as a Python int, a guard (a recompile per set of sizes)
        start = (torch.cumsum(counts, 0) - counts).to(torch.int32)[self.group]  # [B, T]
        # every per-token value in one [B, T, 7] tensor: one dynamic length for the compiled kernel
        tokens = torch.stack((start, *self.yx.unbind(-1), *self.hw.unbind(-1), self.prefix, self.image), -1)
        tokens = tokens.to(torch.int32)
        masked = not self.one_image_per_row()

        def score_mod(score, b, head, q_idx, kv_idx):  # noqa: ANN001, ANN202
            start, y, x, h, w, prefix, image = (tokens[b, q_idx, i] for i in range(7))  # the query's
            key_y, key_x, key_prefix, key_image = (tokens[b, kv_idx, i] for i in (1, 2, 5, 6))
            index = start + (y - key_y + h - 1) * (2 * w - 1) + x - key_x + w - 1
            index = torch.minimum(index.clamp(min=0), total - 1)  # (pairs of two images: masked)
            index = torch.where(prefix > 0, torch.where(key_prefix > 0, total + 2, total),
                                torch.where(key_prefix > 0, total + 1, index))  # fmt: skip
            score = score + values[head, index].to(score.dtype)
            if not masked:
                return score
            # a token attends to its own image's tokens; a padding query to every valid key and to itself
            key_valid = key_image >= 0
            allowed = ((image == key_image) & key_valid) | ((image < 0) & (key_valid | (q_idx == kv_idx)))
            return torch.where(allowed, score, -float("inf"))

        return score_mod, ((values, 1), (tokens, 1))

    def structure_mask(self) -> torch.Tensor:
        """[B, 1, T, T] additive fp32: 0 where a query may attend to a key, -inf elsewhere. A token attends
        to the tokens of its own image; a padding query attends to every valid key and to itself, so its row
        stays finite (its output is never read)."""
        t = self.image.shape[1]
        valid = self.valid
        same = (self.image[:, :, None] == self.image[:, None, :]) & valid[:, :, None]
        itself = torch.eye(t, dtype=torch.bool, device=valid.device)
        allowed = same | (~valid[:, :, None] & (valid[:, None, :] | itself))
        zeros = torch.zeros(allowed.shape, dtype=torch.float32, device=valid.device)
        return zeros.masked_fill(~allowed, float("-inf"))[:, None]

    def one_image_per_row(self) -> bool:
        """No padding and no packing: every token attends to its whole row, so no mask is needed."""
        return bool((self.image == self.image[:, :1]).all())

    def patch_counts(self) -> torch.Tensor:
        """[B, T] fp32: the number of patches H * W of each token's image (padding: 1)."""
        return (self.hw[..., 0] * self.hw[..., 1]).float()


def ragged_layout(
    coords: torch.Tensor,
    sizes: torch.Tensor | None = None,
    *,
    valid: torch.Tensor | None = None,
    segments: torch.Tensor | None = None,
    num_prefix_tokens: int = 0,
    per_image: bool = False,
) -> RaggedLayout:
    """Check a ragged batch and lay out its tokens: ``coords`` [B, N, 2] (y, x) of the N patch tokens of each
    row, integer cells or, of a floating dtype, points in patch units (fractional: a merged token's mean
    cell), ``sizes`` [B, 2] (one image per row) or [B, S, 2] (with ``segments`` [B, N]: the image of each
    token among its row's S), ``valid`` [B, N] bool (False: padding). Without ``sizes``, each image's grid
    is the smallest one holding its tokens' points, H = ceil(largest y) + 1 and W = ceil(largest x) + 1 (for
    cells, their bounding box; a merged token at y = 1.5 reaches row 2); give the sizes when the tokens may
    not cover the grid: a normalised or size-dependent scheme reads them.

    Tokens are grouped by grid size (each scheme is evaluated once per distinct size), or, with
    ``per_image``, by image (once per image: a random draw per forward becomes one per image)."""
    if not isinstance(coords, torch.Tensor) or coords.dim() != 3 or coords.shape[-1] != 2 or _not_real(coords):
        got = f"{coords.dtype} tensor of shape {tuple(coords.shape)}" if isinstance(coords, torch.Tensor) else coords
        raise ValueError(f"coords must be a real tensor [B, N, 2] of (y, x) grid cells or points, got {got}")
    b, n, _ = coords.shape
    device = coords.device
    valid = _check_flags("valid", valid, (b, n), device)
    fractional = coords.is_floating_point()  # points in patch units
    if fractional:
        coords = torch.where(valid[..., None], coords.float(), 0.0)
        if not torch.compiler.is_compiling() and not bool(coords.isfinite().all()):
            raise ValueError("coords hold non-finite values (inf or nan) at valid tokens")
    else:
        coords = coords.long()
    if segments is None:
        image = torch.arange(b, device=device)[:, None].expand(b, n)
        count = b
    else:
        if num_prefix_tokens:
            raise ValueError(
                f"packed rows (segments) cannot hold prefix tokens (this model has {num_prefix_tokens}): which "
                "image a shared cls or register token belongs to is undefined; pack a model without prefix "
                "tokens (class_token=False, reg_tokens=0) or pad one image per row (no segments)"
            )
        if not isinstance(segments, torch.Tensor) or segments.shape != (b, n) or _not_int(segments):
            raise ValueError(f"segments must be an integer tensor [B, N] = {[b, n]} of image ids in each row")
        segments = segments.to(device).long()
        if sizes is not None and (not isinstance(sizes, torch.Tensor) or sizes.dim() != 3):
            raise ValueError("with segments, sizes must be [B, S, 2]: the (H, W) of each row's S images")
        count_s = sizes.shape[1] if sizes is not None else int(segments[valid].max()) + 1 if valid.any() else 1
        if not torch.compiler.is_compiling() and bool(((segments < 0) | (segments >= count_s))[valid].any()):
            raise ValueError(f"segments must be image ids in 0 .. {count_s - 1} (sizes holds {count_s} per row)")
        image = torch.arange(b, device=device)[:, None] * count_s + segments.clamp(0, count_s - 1)
        count = b * count_s
    image = torch.where(valid, image, -1)
    if sizes is None:  # each image's bounding box
        flat = torch.zeros(count, 2, dtype=torch.long, device=device)
        last = coords.ceil().long() if fractional else coords  # the grid's last row and column: H - 1 >= y
        flat = flat.scatter_reduce(0, image[valid][:, None].expand(-1, 2), last[valid] + 1, "amax")
    else:
        expected = (b, 2) if segments is None else (b, sizes.shape[1], 2)
        if not isinstance(sizes, torch.Tensor) or tuple(sizes.shape) != expected or _not_int(sizes):
            got = f"{sizes.dtype} tensor of shape {tuple(sizes.shape)}" if isinstance(sizes, torch.Tensor) else sizes
            raise ValueError(
                f"sizes must be an integer tensor {list(expected)} of grid sizes (H, W), got {got} (coords may be "
                "points of a floating dtype; the grid sizes stay whole numbers of patches)"
            )
        flat = sizes.to(device).long().reshape(count, 2)
    p = num_prefix_tokens
    if p:  # prefix tokens: the row's image, cell (0, 0)
        rows = torch.arange(b, device=device)[:, None].expand(b, p)
        image = torch.cat((rows, image), dim=1)
        coords = torch.cat((coords.new_zeros(b, p, 2), coords), dim=1)
    used = image >= 0
    hw = flat[image.clamp(min=0)]  # [B, T, 2]
    if per_image:
        ids, group_used = torch.unique(image[used], return_inverse=True)
        distinct = flat[ids]
    else:
        distinct, group_used = torch.unique(hw[used], dim=0, return_inverse=True)
    if not torch.compiler.is_compiling():
        if distinct.numel() == 0:
            raise ValueError("the batch holds no valid token")
        if bool((distinct < 1).any()):
            raise ValueError(f"grid sizes must be positive, got {distinct.tolist()}")
        patches = used.clone()
        patches[:, :p] = False
        if bool(((coords < 0) | (coords > hw - 1))[patches].any()):
            raise ValueError("coords hold points outside their image's grid (0 <= y <= H - 1, 0 <= x <= W - 1)")
    group = torch.zeros(image.shape, dtype=torch.long, device=device)
    group[used] = group_used
    yx = torch.where(used[..., None], coords, 0)
    hw = torch.where(used[..., None], hw, 1)
    sizes_list = [(int(h), int(w)) for h, w in distinct.tolist()]
    return RaggedLayout(sizes_list, group, image, yx, hw, p, fractional)


def _not_int(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex() or t.dtype == torch.bool


def _not_real(t: torch.Tensor) -> bool:
    return t.is_complex() or t.dtype == torch.bool


def _check_flags(name: str, flags: torch.Tensor | None, shape: tuple[int, int], device: torch.device) -> torch.Tensor:
    if flags is None:
        return torch.ones(shape, dtype=torch.bool, device=device)
    if not isinstance(flags, torch.Tensor) or flags.dtype != torch.bool or tuple(flags.shape) != shape:
        got = f"{flags.dtype} tensor of shape {tuple(flags.shape)}" if isinstance(flags, torch.Tensor) else flags
        raise ValueError(f"{name} must be a bool tensor {list(shape)} (True: a token, False: padding), got {got}")
    return flags.to(device)
