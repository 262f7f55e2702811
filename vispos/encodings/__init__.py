"""The catalogue: one file per scheme family; each scheme registers itself beside its class.

Adding a scheme is one file here: every module of this package is imported (and so registers its
schemes) when ``vispos`` is. The contract:

- The class is an ``nn.Module`` whose constructor takes keyword-only arguments, decorated with
  ``@register(name, ndim=..., kind=..., ...)`` from ``vispos.registry``: its properties as data
  (kind, trainable, relative, extrapolation, summary, reference).
- ``context=`` names the constructor arguments a host fills in (``vispos.registry.CONTEXT``: ``dim``,
  ``num_heads``, ``train_grid``, ``num_prefix_tokens``, ``causal``, ``width``...); every other argument is a user
  option with a default. Hosts refuse user values for the context.
- ``forward`` by dimension and kind (2D takes ``(grid, device)``, 1D takes ``positions``):

  | kind | returns |
  | --- | --- |
  | additive | [N, dim] to add to the tokens (2D: patch tokens, row-major) |
  | rotary | ``Rotary`` (cos/sin [(heads,) N, head_dim] in fp32) |
  | bias | additive logits [heads, N, N] (1D may add a batch dim) |
  | query_bias | ``QueryBias`` (2D: ``logits(q)`` -> additive logits [B, heads, N, N] from the queries) |
  | channels | 2D: ``bind(inputs)`` takes the attention's input, then ``rotate(q, k)`` widens q and k |
  | relative_kv | ``ShawTables`` |
  | conditional | 2D: ``forward(x [B, P + H*W, dim], grid, num_prefix_tokens, tokens)``, the tokens transformed |
  | none | None |

- ``per_layer=True``: one instance per transformer layer (trainable attention schemes);
  ``scalable=True``: a ``set_scaling`` method that ``vispos.configure(scaling=...)`` calls;
  ``position_axes=3`` (1D): ``forward`` takes several ids per token, [3, (B,) N] (mrope's t, h, w), and
  [N] for the same id on every axis.
- Optional host hooks (2D): an additive table may hold ``prefix`` [P, dim] (added to the prefix tokens)
  and define ``adopt_pos_embed(pos_embed [1, P + H*W, dim]) -> bool`` (start from a timm model's own
  table); a bias may hold ``prefix_bias`` [3, heads] (prefix->patch, patch->prefix, prefix->prefix
  entries; without it prefix rows and columns get zero bias) and define ``offset_bias(grid, device)``
  -> [heads, 2H-1, 2W-1], its value per offset (dy, dx), which ``attention="flex"`` looks up instead of
  building the [heads, N, N] mask (such a bias derives from ``relbias.OffsetBias``, whose call hands both to
  the host). A scheme reads its weights only in the call of the module that holds them: offloading hooks
  (accelerate's ``cpu_offload``, ``disk_offload``) bring a module's weights in around its own call only.

``pytest tests/test_registry.py tests/test_scheme_outputs.py tests/test_properties.py`` then covers the new scheme
(shapes, dtypes, gradients, patching every timm model kind, declared relative property) with no test edits.
"""

from __future__ import annotations

import importlib
import pkgutil

from .alibi import Alibi, Alibi2d, alibi_slopes
from .comrope import ComRope2d
from .decomposed import Decomposed2d, QueryBias, relative_rows
from .learned import Learned1d, Learned2d
from .liere import Liere2d, generator_rotations
from .mrope import MRope, mrope_positions
from .nope import NoPE
from .peg import Peg2d, peg_2d, peg_2d_subset
from .relbias import ContinuousBias2d, RelBias2d, relative_index_2d
from .rope import Rope, Rotary, apply_rope
from .rope2d import Rope2d, Rope2dMixed
from .rope_scaling import SCALING_TYPES, RopeScaling, scaled_inv_freq
from .ropend import RopeNd
from .rotary_nd import Rope2dGolden
from .shaw import ShawRelative
from .sincos import SinCos1d, SinCos2d, sincos_1d, sincos_2d
from .string import String2d, fold_string
from .t5 import T5Bias, t5_bucket
from .xpos import XPos

for _module in pkgutil.iter_modules(__path__):  # each family module registers its schemes on import
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = [
    "Alibi", "Alibi2d", "ContinuousBias2d", "Learned1d", "Learned2d", "MRope", "NoPE", "RelBias2d", "Rope",
    "Rope2d", "Rope2dMixed", "RopeScaling", "Rotary", "SCALING_TYPES", "ShawRelative", "SinCos1d", "SinCos2d",
    "T5Bias", "XPos", "alibi_slopes", "apply_rope", "mrope_positions", "relative_index_2d", "scaled_inv_freq",
    "sincos_1d", "sincos_2d", "t5_bucket",
    "ComRope2d", "Liere2d", "Rope2dGolden", "RopeNd", "String2d", "fold_string", "generator_rotations",
    "Peg2d", "peg_2d", "peg_2d_subset",
    "Decomposed2d", "QueryBias", "relative_rows",
]  # fmt: skip
