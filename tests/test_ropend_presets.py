"""``ropend``'s presets against the rotation of each model's released code, transcribed here as formulas.

- V-JEPA 2 (facebookresearch/vjepa2, ``src/models/utils/modules.py``): ``RoPEAttention`` cuts the head
  into contiguous sections d, h, w of 2 floor(floor(D/3) / 2) channels each (the rest unrotated), token
  ids split into (frame, row, column); ``rotate_queries_or_keys`` on a section of s channels: omega_j =
  10000^(-j / (s/2)), pairs (2i, 2i + 1) turned by x cos + rot(x) sin with rot = (-x_(2i+1), x_2i). The
  released frequency layout tiles [w_0 .. w_(s/2-1)] twice over the section (kept for the weights); the
  fix its code names repeats each w_j twice (pair i at w_i): the ``vjepa2`` preset.
- Wan 2.1 (Wan-Video/Wan2.1, ``wan/modules/model.py``): ``rope_params`` per axis with
  d - 4 floor(d/6), 2 floor(d/6), 2 floor(d/6) channels, theta^(-2j/s); ``rope_apply`` multiplies the
  complex pairs (2i, 2i + 1) of the head by e^(i p w), the three sections in (frame, h, w) order.
- HunyuanVideo (Tencent/HunyuanVideo, ``hyvideo/modules/posemb_layers.py``): ``get_nd_rotary_pos_embed``
  with ``rope_dim_list`` (16, 56, 56) and theta 256 (``--rope-theta``), positions ``linspace(0, n, n + 1)[:n]``
  per axis, cos/sin ``repeat_interleave(2)``, ``rotate_half`` pairing (2i, 2i + 1).
"""

from __future__ import annotations

import pytest
import torch

import vispos

SIZE = (3, 4, 5)  # frames, rows, columns


def content(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def video_ids(t: int, h: int, w: int) -> torch.Tensor:
    """[3, T H W] (frame, row, column) of the tokens in raster order, as V-JEPA 2's ``separate_positions``
    derives them from the token index."""
    token = torch.arange(t * h * w)
    frame = token // (h * w)
    row = (token - frame * h * w) // w
    return torch.stack((frame, row, token - frame * h * w - row * w))


def rotated(preset: str, x: torch.Tensor, ids: torch.Tensor, **options: object) -> torch.Tensor:
    enc = vispos.create_encoding("ropend", dim=x.shape[-1], preset=preset, **options)
    out, _ = enc(ids).rotate(x, x)
    return out.double()


# --- transcriptions --------------------------------------------------------------------------------------


def vjepa2_section(x: torch.Tensor, pos: torch.Tensor, released: bool) -> torch.Tensor:
    """V-JEPA 2's rotation of one section x [..., N, s] at positions pos [N]."""
    s = x.shape[-1]
    omega = 1.0 / 10000 ** (torch.arange(s // 2, dtype=torch.float64) / (s / 2))  # [s/2]
    freq = pos.double()[:, None] * omega  # [N, s/2]
    per_channel = freq.repeat(1, 2) if released else freq.repeat_interleave(2, dim=-1)  # [N, s]
    pairs = x.unflatten(-1, (-1, 2))
    turned = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    return x * per_channel.cos() + turned * per_channel.sin()


def vjepa2(x: torch.Tensor, ids: torch.Tensor, released: bool) -> torch.Tensor:
    part = 2 * ((x.shape[-1] // 3) // 2)
    sections = [vjepa2_section(x[..., a * part : (a + 1) * part], ids[a], released) for a in range(3)]
    return torch.cat((*sections, x[..., 3 * part :]), dim=-1)


def complex_pairs(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """The pairs (2i, 2i + 1) of x [..., N, d] as complex numbers, multiplied by e^(i angles) [N, d/2]."""
    z = torch.view_as_complex(x.double().unflatten(-1, (-1, 2)).contiguous())
    return torch.view_as_real(z * torch.polar(torch.ones_like(angles), angles)).flatten(-2)


def wan(x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1]
    dims = (d - 4 * (d // 6), 2 * (d // 6), 2 * (d // 6))
    angles = []
    for axis, s in enumerate(dims):
        inv = 1.0 / torch.pow(10000.0, torch.arange(0, s, 2, dtype=torch.float64) / s)  # rope_params
        angles.append(ids[axis].double()[:, None] * inv)
    return complex_pairs(x, torch.cat(angles, dim=-1))


def hunyuanvideo(x: torch.Tensor, ids: torch.Tensor, dims: tuple[int, ...], theta: float) -> torch.Tensor:
    cos, sin = [], []
    for axis, s in enumerate(dims):
        inv = 1.0 / theta ** (torch.arange(0, s, 2)[: s // 2].double() / s)
        freq = ids[axis].double()[:, None] * inv  # [N, s/2]
        cos.append(freq.cos().repeat_interleave(2, dim=1))
        sin.append(freq.sin().repeat_interleave(2, dim=1))
    real, imag = x.double().unflatten(-1, (-1, 2)).unbind(-1)
    turned = torch.stack((-imag, real), dim=-1).flatten(-2)
    return x * torch.cat(cos, dim=-1) + turned * torch.cat(sin, dim=-1)


def hunyuan_ids(t: int, h: int, w: int) -> torch.Tensor:
    """``get_meshgrid_nd``: linspace(0, n, n + 1)[:n] per axis, meshgrid 'ij', flattened."""
    axes = [torch.linspace(0, n, n + 1)[:n] for n in (t, h, w)]
    return torch.stack(torch.meshgrid(*axes, indexing="ij")).flatten(1)


# --- the presets ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dim", [64, 72, 88])  # 64: 4 channels left unrotated; 88: sections of 28
def test_vjepa2_preset_is_vjepa2s_rotation_with_its_named_fix(dim: int) -> None:
    ids, x = video_ids(*SIZE), content(dim, 2, 3, 60, dim)
    torch.testing.assert_close(rotated("vjepa2", x, ids), vjepa2(x.double(), ids, released=False), rtol=0, atol=1e-5)


@pytest.mark.parametrize("dim", [64, 88])
def test_vjepa2_released_layout_is_vjepa2s_released_code(dim: int) -> None:
    ids, x = video_ids(*SIZE), content(dim + 1, 2, 3, 60, dim)
    got = rotated("vjepa2", x, ids, layout="vjepa2_released")
    torch.testing.assert_close(got, vjepa2(x.double(), ids, released=True), rtol=0, atol=1e-5)
    assert (got - vjepa2(x.double(), ids, released=False)).abs().max() > 1e-2  # the two do differ


def test_vjepa2_time_axis_turns_its_own_contiguous_section() -> None:
    """Moving every token by one frame changes channels 0-19 of a 64-channel head only (the t section)."""
    ids, x = video_ids(*SIZE), content(5, 1, 1, 60, 64)
    later = ids + torch.tensor([[1], [0], [0]])
    diff = (rotated("vjepa2", x, later) - rotated("vjepa2", x, ids)).abs().amax(dim=(0, 1, 2))  # [64]
    assert diff[:20].min() > 0 and diff[20:].max() == 0


def test_wan_preset_is_wan_rope_apply() -> None:
    ids, x = video_ids(*SIZE), content(1, 2, 3, 60, 128)
    want = wan(x, ids)
    got = rotated("wan", x, ids)
    assert (got - want).abs().max() < 1e-5  # fp32 angles against Wan's fp64
    assert (rotated("wan", x, ids[[1, 0, 2]]) - want).abs().max() > 1e-2  # the axes are not interchangeable


def test_hunyuanvideo_preset_is_hunyuanvideos_rotary() -> None:
    ids, x = hunyuan_ids(*SIZE), content(2, 2, 3, 60, 128)
    want = hunyuanvideo(x.double(), ids, (16, 56, 56), 256.0)
    torch.testing.assert_close(rotated("hunyuanvideo", x, ids.long()), want, rtol=0, atol=1e-5)


def test_half_layout_pairs_channels_inside_each_section() -> None:
    """split (8, 12, 12) with ``half``: channel i of a section pairs with i + s/2 of the same section."""
    enc = vispos.create_encoding("ropend", dim=32, split=(8, 12, 12), layout="half")
    ids, x = video_ids(*SIZE), content(3, 1, 1, 60, 32)
    got, _ = enc(ids).rotate(x, x)
    start = 0
    for axis, s in enumerate((8, 12, 12)):
        inv = 1.0 / 10000.0 ** (torch.arange(s // 2, dtype=torch.float64) * 2 / s)
        a = ids[axis].double()[:, None] * inv  # [N, s/2]
        lo, hi = x[..., start : start + s // 2].double(), x[..., start + s // 2 : start + s].double()
        want = torch.cat((lo * a.cos() - hi * a.sin(), hi * a.cos() + lo * a.sin()), dim=-1)
        torch.testing.assert_close(got[..., start : start + s].double(), want, rtol=0, atol=1e-5)
        start += s


def test_unknown_layout_names_the_accepted_ones() -> None:
    with pytest.raises(ValueError, match=r"accepted: half, interleaved, vjepa2_released"):
        vispos.create_encoding("ropend", dim=64, preset="vjepa2", layout="tiled")
