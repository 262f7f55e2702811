"""iRPE (Wu et al., ICCV 2021): image relative position encoding on bucketed 2D offsets, released code's rules.

The offset (dy, dx) = query - key of two patches (Swin's sign; the released ``diff = pos1 - pos2``) falls in a
bucket; each bucket holds a learned vector r_b [head_dim] (``irpe2d``: contextual mode on the keys, the released
default) or a learned scalar b_b (``irpe2d_bias``: bias mode). With d the head width, the logit of query i and key
j becomes

    irpe2d:       (q_i . k_j + q_i . r_{bucket(i, j)}) / sqrt(d)
    irpe2d_bias:  q_i . k_j / sqrt(d) + b_{bucket(i, j)}

as the released attention computes it (``q *= scale; attn = q @ k^T; attn += rpe_k(q)``: the contextual term is
taken at the scaled query). Each table is per head or shared by the heads (``shared_head``, released default True).

Offsets fall in buckets by the released piecewise index and one of four methods (``euclidean``, ``quant``,
``cross``, ``product``; ``vispos.encodings.irpe_buckets``, which has the formulas).

Prefix tokens (the released ``skip``): built for P > 0 prefix tokens (cls, distillation, registers), each table
has one more bucket, its last, read by every pair that holds a prefix token (prefix rows and prefix columns, the
P tokens alike), as ``get_bucket_ids_2d(skip=P)``; in bias mode that one value per head fills the host's three
``prefix_bias`` entries. Without prefix tokens there is no such bucket (the released ``skip=0`` tables). The
released DeiT attention finds the grid as floor(sqrt(L)) (square images only) and skip = L - H W; here the host
gives the grid and the prefix count, any (H, W).

Parameters keep the released names and shapes (``blocks.{i}.attn.rpe_k.X`` is ``vispos.attention.{i}.X`` of a
patched timm ViT): ``lookup_table_weight`` [heads or 1, head_dim, buckets] (contextual), ``lookup_table_bias``
[heads or 1, buckets] (bias); ``cross`` holds them in ``rp_rows`` and ``rp_cols`` (``iRPE_Cross``). Zero at the
start as released (``init_std`` > 0: truncated normal); one instance per layer, as ``build_rpe`` per block. The
released DeiT models keep their learned absolute embedding beside iRPE: ``vispos.patch(model, ["learned2d",
"irpe2d"])``.

Only the keys: ``on="q"`` (the code's k_j . r_{bucket(j, i)}) needs the keys, which a query-dependent bias
(``logits(q)``) does not see, and ``on="v"`` (sum_j a_ij r_{bucket(i, j)}) needs the attention weights, which
fused attention does not expose; both are refused. Bias mode on the queries is the bias at the opposite offset:
``irpe2d_bias`` is the keys' form.

Another grid: the bucket ids are recomputed (nothing is resized); far offsets share the last bucket, from where
round(...) reaches B (4 patches per axis at ratio 1.9; close to gamma for large ratios).
The released index takes float offsets too (rounding within alpha, the log rule beyond): ``pair_bias`` evaluates
it at fractional points, a step function of the offset. Ragged batches: ``irpe2d_bias`` gives its value per offset
(``offset_bias``: FlexAttention, ragged and packed batches); ``irpe2d`` is refused there, as decomposed2d. vispos's
log-n scaling multiplies q . k only, as for every bias.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .._validate import check_bool, check_choice, check_float, check_grid, check_int
from ..registry import register
from .irpe_buckets import METHODS, bucket_ids, num_buckets
from .relbias import OffsetBias, offsets_2d, prefixed_offset_index, relative_index_2d

SIDES = ("k",)


@dataclass
class BucketQueryBias:
    """iRPE's contextual term awaiting its queries (``QueryBias``'s protocol): ``logits(q)`` is a layer's mask.

    ``tables``: one per component (cross: rows, columns) [heads or 1, d, buckets]; ``per_offset`` [K, 2H-1, 2W-1] the
    bucket of each offset of ``grid``; ``skip``: the prefix bucket (the tables' last), or None (no prefix bucket:
    prefix rows and columns get zero); ``scale``: 1 / sqrt(d), the released q scale; ``tokens`` [B, M] a token subset
    (indices into the P + HW tokens) or None; ``extra``: a mask added to the result (the caller's).

    On the whole grid the mask is read from q . r_b through one int32 index of (query, bucket) per pair: besides the
    mask it holds that index (1/heads of the mask), not int64 bucket ids of every pair."""

    tables: tuple[torch.Tensor, ...]
    per_offset: torch.Tensor
    grid: tuple[int, int]
    skip: int | None
    scale: float
    num_prefix_tokens: int = 0
    tokens: torch.Tensor | None = None
    extra: torch.Tensor | None = None

    def _with(self, num_prefix_tokens: int, tokens: torch.Tensor | None, extra: torch.Tensor | None) -> BucketQueryBias:
        return BucketQueryBias(
            self.tables, self.per_offset, self.grid, self.skip, self.scale, num_prefix_tokens, tokens, extra
        )

    def with_prefix(self, num_prefix_tokens: int) -> BucketQueryBias:
        return self._with(num_prefix_tokens, self.tokens, self.extra)

    def take(self, tokens: torch.Tensor) -> BucketQueryBias:
        """The rows of a token subset, ``tokens`` [B, M] indices into the P + HW tokens."""
        return self._with(self.num_prefix_tokens, tokens, self.extra)

    def plus(self, mask: torch.Tensor | None) -> BucketQueryBias:
        """With ``mask`` (broadcastable to [B, heads, M, M]) added to the logits."""
        extra = mask if self.extra is None or mask is None else self.extra + mask
        return self._with(self.num_prefix_tokens, self.tokens, extra)

    @property
    def ids(self) -> torch.Tensor:
        """The bucket of every pair of patches: [K, HW, HW] int64."""
        return self.per_offset.flatten(1)[:, relative_index_2d(self.grid, self.per_offset.device)]

    def token_ids(self) -> torch.Tensor:
        """The bucket of every pair of tokens, prefix tokens first: [K, M, M], or [K, B, M, M] for a subset
        (``get_bucket_ids_2d``: prefix rows and columns read the prefix bucket)."""
        p, ids = self.num_prefix_tokens, self.ids
        if p:  # no prefix bucket: one past the table's last, a zero column ``logits`` appends
            skip = self.tables[0].shape[-1] if self.skip is None else self.skip
            ids = F.pad(ids, (p, 0, p, 0), value=skip)
        if self.tokens is None:
            return ids
        return ids[:, self.tokens[:, :, None], self.tokens[:, None, :]]

    def logits(self, q: torch.Tensor) -> torch.Tensor:
        """q [B, heads, M, d] (unscaled) -> the additive mask [B, heads, M, M] in q's dtype:
        (q_i / sqrt(d)) . r_{bucket(i, j)}, summed over the components."""
        q = q * self.scale
        if self.tokens is None:
            return self._grid_logits(q)
        bias = None
        for table, ids in zip(self.tables, self.token_ids().unbind(0), strict=True):
            lookup = q @ table.to(q.dtype)  # [B, heads, M, buckets]: q . r_b for every bucket b
            if self.skip is None and self.num_prefix_tokens:
                lookup = F.pad(lookup, (0, 1))  # the prefix tokens' zero column
            index = ids[None, None] if ids.dim() == 2 else ids[:, None]  # [1 or B, 1, M, M]
            term = lookup.gather(-1, index.expand(*lookup.shape[:-1], index.shape[-1]))  # [B, heads, M, M]
            bias = term if bias is None else bias + term
        return bias if self.extra is None else bias + self.extra.to(bias.dtype)

    def _grid_logits(self, q: torch.Tensor) -> torch.Tensor:
        """The whole grid's mask from the scaled queries q [B, heads, P + HW, d]: for each component, q . r_b for
        every bucket [B, heads, M, buckets], read at (query i, bucket(i, j)) through one flat int32 index."""
        b, heads, m, _ = q.shape
        p = self.num_prefix_tokens
        lookups = []
        for table in self.tables:
            lookup = q @ table.to(q.dtype)  # [B, heads, M, buckets]: q . r_b for every bucket b
            if self.skip is None and p:
                lookup = F.pad(lookup, (0, 1))  # the prefix tokens' bucket: a zero column
            lookups.append(lookup)
        buckets = lookups[0].shape[-1]
        prefix = buckets - 1 if self.skip is None else self.skip  # the bucket of the pairs with a prefix token
        index = prefixed_offset_index(self.grid, p, q.device)  # [M, M] int32: offsets, then 3 prefix entries
        rows = torch.arange(m, device=q.device, dtype=torch.int32)[:, None] * buckets
        flats = []
        for per_offset in self.per_offset.unbind(0):
            values = torch.cat((per_offset.flatten(), per_offset.new_full((3,), prefix))).to(torch.int32)
            flats.append((values[index] + rows).flatten())  # [M * M] int32: (query, bucket) of every pair
        del index  # the gather holds one int32 index per component beside the mask, nothing more
        bias = None
        for lookup, flat in zip(lookups, flats, strict=True):
            term = lookup.reshape(b * heads, m * buckets).index_select(1, flat).view(b, heads, m, m)
            bias = term if bias is None else bias + term
        return bias if self.extra is None else bias + self.extra.to(bias.dtype)


def _new_table(shape: tuple[int, ...], init_std: float) -> nn.Parameter:
    """A lookup table: zeros as released (its ``initializer`` leaves them), or truncated normal."""
    table = nn.Parameter(torch.zeros(shape))
    if init_std > 0:
        nn.init.trunc_normal_(table, std=init_std)
    return table


class _Table(nn.Module):
    """One released lookup table under its released name (cross: ``rp_rows`` and ``rp_cols`` hold one each)."""

    def __init__(self, name: str, shape: tuple[int, ...], init_std: float) -> None:
        super().__init__()
        self.name = name
        self.register_parameter(name, _new_table(shape, init_std))

    def forward(self) -> torch.Tensor:
        """The table, read in this module's own call (where offloading hooks bring it in)."""
        return getattr(self, self.name)


class BucketTables(nn.Module):
    """What both modes share: the options, the bucket counts and the tables (module docstring)."""

    def __init__(self, name: str, width: tuple[int, ...], num_heads: int, num_prefix_tokens: int, method: str,
                 ratio: float, shared_head: bool, init_std: float) -> None:  # fmt: skip
        super().__init__()
        self.num_heads = check_int("num_heads", num_heads, minimum=1)
        self.num_prefix_tokens = check_int("num_prefix_tokens", num_prefix_tokens, minimum=0)
        self.method = check_choice("method", method, METHODS)
        self.ratio = check_float("ratio", ratio, positive=True)
        self.shared_head = check_bool("shared_head", shared_head)
        init_std = check_float("init_std", init_std, minimum=0.0)
        self.buckets = num_buckets(self.method, self.ratio)
        self.skip = self.buckets if self.num_prefix_tokens else None  # the prefix bucket: one more, the last
        shape = (1 if self.shared_head else self.num_heads, *width, self.buckets + (self.skip is not None))
        self.table_name = name
        if self.method == "cross":
            self.rp_rows, self.rp_cols = _Table(name, shape, init_std), _Table(name, shape, init_std)
        else:
            self.register_parameter(name, _new_table(shape, init_std))

    def tables(self) -> tuple[torch.Tensor, ...]:
        """The tables, one per component: (rows, columns) for cross, else one."""
        if self.method == "cross":
            return (self.rp_rows(), self.rp_cols())  # through their calls: offloading hooks bring them in
        return (getattr(self, self.table_name),)

    def extra_repr(self) -> str:
        return f"method={self.method!r}, ratio={self.ratio}, buckets={self.buckets}, shared_head={self.shared_head}"


EXTRAPOLATION = ("bucket ids recomputed at the new grid, nothing resized; far offsets share the last bucket (from 4 "
                 "patches per axis at ratio 1.9, at most 8 x ratio; for quant in squared distance)")  # fmt: skip


@register(
    "irpe2d",
    ndim=2,
    kind="query_bias",
    trainable=True,
    relative=True,
    context=("dim", "num_heads", "num_prefix_tokens"),
    per_layer=True,
    summary="iRPE contextual on keys: (q . r_bucket(dy, dx)) / sqrt(d), piecewise-log buckets (product, ratio 1.9); "
    "equal to the released code (tested)",
    extrapolation=EXTRAPOLATION,
    reference="Wu et al. 2021 (iRPE)",
)
class Irpe2d(BucketTables):
    """iRPE in contextual mode on the keys, one per layer (module docstring). Defaults: the released DeiT models'
    (product, ratio 1.9, shared by the heads, on the keys)."""

    def __init__(self, *, dim: int, num_heads: int, num_prefix_tokens: int = 0, method: str = "product",
                 ratio: float = 1.9, shared_head: bool = True, on: str = "k",
                 init_std: float = 0.0) -> None:  # fmt: skip
        dim = check_int("dim (head dimension)", dim, minimum=1)
        if isinstance(on, str) and on and set(on) <= set("qkv") and set(on) - {"k"}:
            raise ValueError(
                f"on={on!r}: iRPE on the queries adds k_j . r_bucket(j, i), which needs the keys, and a query bias "
                "here is computed from the queries alone; on the values it adds sum_j a_ij r_bucket(i, j), which needs "
                "the attention weights, which fused attention does not expose; accepted: 'k' (the released default)"
            )
        on = check_choice("on", on, SIDES)
        super().__init__("lookup_table_weight", (dim,), num_heads, num_prefix_tokens, method, ratio, shared_head,
                         init_std)  # fmt: skip
        self.dim, self.on = dim, on

    def forward(self, grid: tuple[int, int], device: torch.device | None = None) -> BucketQueryBias:
        """-> a ``BucketQueryBias`` at ``grid`` (self-attention: queries and keys on the same grid)."""
        grid = check_grid(grid)
        tables = self.tables()
        per_offset = bucket_ids(offsets_2d(grid, tables[0].device), self.method, self.ratio)  # [K, 2H-1, 2W-1]
        return BucketQueryBias(tables, per_offset, grid, self.skip, self.dim**-0.5)


@register(
    "irpe2d_bias",
    ndim=2,
    kind="bias",
    trainable=True,
    relative=True,
    context=("num_heads", "num_prefix_tokens"),
    per_layer=True,
    summary="iRPE bias mode: a learned scalar per piecewise-log bucket of (dy, dx) (product, ratio 1.9); "
    "equal to the released code (tested)",
    extrapolation=EXTRAPOLATION,
    reference="Wu et al. 2021 (iRPE)",
)
class IrpeBias2d(OffsetBias, BucketTables):
    """iRPE in bias mode, one per layer (module docstring): the bias given per offset (``offset_bias``), at any
    offset (``pair_bias``), and for the prefix tokens (``prefix_bias``, the prefix bucket)."""

    def __init__(self, *, num_heads: int, num_prefix_tokens: int = 0, method: str = "product", ratio: float = 1.9,
                 shared_head: bool = True, init_std: float = 0.0) -> None:  # fmt: skip
        super().__init__("lookup_table_bias", (), num_heads, num_prefix_tokens, method, ratio, shared_head, init_std)

    def _values(self, ids: torch.Tensor) -> torch.Tensor:
        """Bucket ids [K, ...] -> the bias [heads, ...], the components summed."""
        out = sum(table[:, i] for table, i in zip(self.tables(), ids.unbind(0), strict=True))
        return out.expand(self.num_heads, *ids.shape[1:])

    @property
    def prefix_bias(self) -> torch.Tensor | None:
        """[3, heads]: prefix -> patch, patch -> prefix, prefix -> prefix, all the prefix bucket's value (None
        without prefix tokens)."""
        if self.skip is None:
            return None
        return sum(table[:, self.skip] for table in self.tables()).expand(3, self.num_heads)

    def offset_bias(self, grid: tuple[int, int], device: torch.device | None = None) -> torch.Tensor:
        """-> [heads, 2H-1, 2W-1], one value per offset (dy, dx) = query - key."""
        grid = check_grid(grid)
        return self._values(bucket_ids(offsets_2d(grid, self.tables()[0].device), self.method, self.ratio))

    def pair_bias(self, offsets: torch.Tensor) -> torch.Tensor:
        """The bias at offsets (dy, dx) = query - key [..., 2] in patch units, possibly fractional -> [heads, ...]:
        the released piecewise index at float offsets."""
        return self._values(bucket_ids(offsets.to(self.tables()[0].device), self.method, self.ratio))
