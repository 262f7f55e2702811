"""Which scaled-dot-product-attention kernel a forward pass reaches, read from the profiler's op names.

PyTorch picks the kernel from the inputs (device, dtype, mask shape and dtype): on CPU a 3-D float mask
sends SDPA to the math path, a 4-D one keeps the fused kernel. Checking beats assuming.
"""

from __future__ import annotations

from collections.abc import Callable

from torch.profiler import ProfilerActivity, profile

SDPA_KERNELS: dict[str, str] = {
    "aten::_scaled_dot_product_flash_attention_for_cpu": "flash (CPU)",
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_efficient_attention": "memory-efficient",
    "aten::_scaled_dot_product_cudnn_attention": "cuDNN",
    "aten::_scaled_dot_product_attention_math": "math",
}


def sdpa_kernels(run: Callable[[], object]) -> set[str]:
    """The SDPA kernels (names of ``SDPA_KERNELS``'s values) that calling ``run()`` reaches."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    return {SDPA_KERNELS[e.key] for e in prof.key_averages() if e.key in SDPA_KERNELS}
