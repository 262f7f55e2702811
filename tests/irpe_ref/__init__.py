"""iRPE's released implementation, ported for the parity tests of ``irpe2d`` and ``irpe2d_bias``: ``buckets`` (the
piecewise index and the bucket ids of the four methods) and ``modes`` (the bias and contextual modules, their
configuration, and the attention that adds them), both re-exported here.

Source: microsoft/Cream at commit 4a13c4091e78f9abd2160e7e01c02e48c1cf8fb9: ``iRPE/DeiT-with-iRPE/irpe.py``
(``piecewise_index`` to ``build_rpe``; byte-identical to ``iRPE/DETR-with-iRPE/models/rpe_attention/irpe.py``) and
``RPEAttention`` of ``iRPE/DeiT-with-iRPE/rpe_vision_transformer.py``. Copyright (c) Microsoft Corporation.
Licences: the repository's LICENSE is the MIT License (notice below); the ``iRPE/DeiT-with-iRPE`` folder carries
the Apache License 2.0 (its LICENSE file and README, from DeiT, Copyright 2020 - present, Facebook, Inc), and
``RPEAttention`` is adapted from timm (Copyright 2020 Ross Wightman, Apache License 2.0): you may not use those
files except in compliance with the License, a copy of which is at http://www.apache.org/licenses/LICENSE-2.0;
distributed on an "AS IS" BASIS, WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.

Changes (this notice is the prominent notice of them): ``irpe.py`` split in two modules at ``get_bucket_ids_2d``
(``modes`` imports what it uses of ``buckets``); docstrings and the ``__main__`` demo removed; ``easydict``
replaced by a small ``dict`` with attribute access (``edict`` in ``modes``); the CUDA extension ``rpe_ops`` not imported
(``RPEIndexFunction = None``: the code's own pure-PyTorch path, which the released code takes when the extension
is not built); ``RPEAttention.forward`` takes ``height`` and ``width`` and hands them to ``rpe_q``/``rpe_k``/
``rpe_v``, as the released DETR attention does (the DeiT attention infers a square grid from the token count).
Everything else (the bucketing, its buffers, the lookups, the order of operations) is the released code.

MIT License. Copyright (c) Microsoft Corporation.
Permission is hereby granted, free of charge, to any person obtaining a copy of this software and associated
documentation files (the "Software"), to deal in the Software without restriction, including without limitation
the rights to use, copy, modify, merge, publish, distribute, sublicense, and/or sell copies of the Software, and to
permit persons to whom the Software is furnished to do so, subject to the following conditions: The above copyright
notice and this permission notice shall be included in all copies or substantial portions of the Software.
THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR IMPLIED, INCLUDING BUT NOT LIMITED TO THE
WARRANTIES OF MERCHANTABILITY, FITNESS FOR A PARTICULAR PURPOSE AND NONINFRINGEMENT. IN NO EVENT SHALL THE AUTHORS OR
COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM, DAMAGES OR OTHER LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR
OTHERWISE, ARISING FROM, OUT OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER DEALINGS IN THE SOFTWARE.
"""

from .buckets import (
    _METHOD_FUNC,
    BUCKET_IDS_BUF,
    METHOD,
    get_absolute_positions,
    get_bucket_ids_2d,
    get_bucket_ids_2d_without_skip,
    get_num_buckets,
    piecewise_index,
    quantize_values,
)
from .modes import (
    RPEAttention,
    RPEIndexFunction,
    build_rpe,
    edict,
    get_rpe_config,
    get_single_rpe_config,
    iRPE,
    iRPE_Cross,
)

__all__ = [
    "BUCKET_IDS_BUF",
    "METHOD",
    "RPEAttention",
    "RPEIndexFunction",
    "_METHOD_FUNC",
    "build_rpe",
    "edict",
    "get_absolute_positions",
    "get_bucket_ids_2d",
    "get_bucket_ids_2d_without_skip",
    "get_num_buckets",
    "get_rpe_config",
    "get_single_rpe_config",
    "iRPE",
    "iRPE_Cross",
    "piecewise_index",
    "quantize_values",
]
