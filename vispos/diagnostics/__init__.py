"""Diagnostics: what a positional scheme does to attention logits, measured and drawn.

- ``scheme_logits`` / ``layer_logits``: the logit between a query at grid position p and a key at q
  for every pair, for a scheme alone (given content vectors or projections) or for one layer of a
  patched timm ViT. The content is the same at every position, so only position varies.
- ``translation_error``: how much the logits change when query and key shift by the same offset
  (zero for a relative scheme).
- ``cross_term``: energy of the row/column cross terms (Q_row K_col^T + Q_col K_row^T): zero exactly
  when L(p, q) = F(px, qx) + G(py, qy); for a relative scheme, when S(dx, dy) = f(dx) + g(dy), i.e. the
  mixed second difference S(dx, dy) - S(dx, 0) - S(0, dy) + S(0, 0) vanishes.
- ``measure_schemes`` / ``write_report`` / ``python -m vispos.diagnostics --out DIR``: every 2D scheme
  on a small random ViT layer, as a Markdown table and PNG figures.

Both measures are relative RMS values (square roots of energy ratios), per head.
"""

from __future__ import annotations

from .logits import layer_logits, scheme_logits
from .measures import (
    as_grid,
    axis_pairs,
    cross_term,
    mixed_difference,
    offset_ids,
    offset_map,
    query_map,
    separability_error,
    translation_error,
)
from .report import SchemeReport, markdown_table, measure_schemes, plot_logit_maps, plot_measures, write_report

__all__ = [
    "SchemeReport",
    "as_grid",
    "axis_pairs",
    "cross_term",
    "layer_logits",
    "markdown_table",
    "measure_schemes",
    "mixed_difference",
    "offset_ids",
    "offset_map",
    "plot_logit_maps",
    "plot_measures",
    "query_map",
    "scheme_logits",
    "separability_error",
    "translation_error",
    "write_report",
]
