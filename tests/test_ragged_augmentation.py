"""DINOv3's coordinate augmentation in a ragged batch: drawn per image (as alone), one draw for all of an
image's tokens."""

from __future__ import annotations

import torch
from ragged_refs import (
    make,
)


def test_dinov3_coordinate_augmentation_is_drawn_per_image_in_a_ragged_batch() -> None:
    """Training mode with DINOv3's shift: two images of the same size in one batch get draws of their own
    (their rotations differ, as they would alone), and each draw is one for all the image's tokens: the
    logits among an image's tokens are those without augmentation (a common shift cancels in RoPE)."""
    net = make("rope2d", prefix=False, shift_coords=2.0)
    grid = (3, 5)
    cells = torch.cartesian_prod(torch.arange(3), torch.arange(5)).expand(2, -1, -1)  # two 3 x 5 images
    sizes = torch.tensor([grid, grid])
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 2, 15, 32, generator=g), torch.randn(2, 2, 15, 32, generator=g)

    def logits(training: bool) -> tuple[torch.Tensor, torch.Tensor]:
        net.vispos.train(training)
        rotary = net.vispos.ragged_context(cells, sizes).layer(0)[0]
        rq, rk = rotary.rotate(q, k)
        return rotary.cos, rq @ rk.transpose(-2, -1)

    cos, augmented = logits(True)
    assert (cos[0] - cos[1]).abs().max() > 1e-2  # one draw per image, not per size
    _, plain = logits(False)
    torch.testing.assert_close(augmented, plain, rtol=1e-4, atol=1e-4)
