"""The diffusers adapter: the only part of vispos that knows diffusers (imported when a diffusers transformer or
pipeline is patched; diffusers is not a dependency of vispos itself).

- ``families.py``: the transformers accepted (FLUX, FLUX.2, Qwen-Image, Lumina 2, SD3, PixArt, DiT), where each keeps
  its positions, its default training grid, how its timestep reads as a noise level; others refused by name.
- ``rotary.py``: the RoPE families' own rotation over their position ids, recomputed (``AxisRope``), with per-axis
  scaling, DyPE's timestep schedule (``encodings/dype.py``) and log-n attention.
- ``sincos.py``: the sin-cos families' table, recomputed (``SinCosTable``), with position interpolation.
- ``modules.py``: the patched classes (the transformer, its positional module), made once per diffusers class.
- ``patching.py``: ``patch``; ``loading.py``: ``from_pretrained`` (a patched transformer saved with
  ``save_pretrained``, rebuilt with its positional settings).

Supported diffusers: 0.42 and newer (``pyproject.toml``'s ``diffusers`` extra; ``make test-diffusers-min`` runs the
adapter's tests at the floor; older releases are refused by name).

What the adapter touches in diffusers:

- Transformers recognised by class name (``families.FAMILIES``), a pipeline's ``transformer``; the forward's
  ``timestep`` and (FLUX, FLUX.2) ``img_ids`` arguments, read by name from the host forward's signature.
- ``FluxPosEmbed`` / ``Flux2PosEmbed``: ``theta``, ``axes_dim``, ``forward(ids) -> (cos, sin)``.
- ``QwenEmbedRope``: ``theta``, ``axes_dim``, ``scale_rope``, ``forward(video_fhw, device, max_txt_seq_len)``.
- ``Lumina2RotaryPosEmbed``: ``theta``, ``axes_dim``, ``_get_freqs_cis(ids)`` (its forward builds the ids).
- ``PatchEmbed``: ``proj``, ``patch_size``, ``height``, ``width``, ``base_size``, ``interpolation_scale``,
  ``pos_embed_max_size``, ``pos_embed``, ``flatten``, ``layer_norm``, ``norm``, its ``forward(latent)``.
"""

from __future__ import annotations

import diffusers

from .families import FAMILIES
from .loading import from_pretrained
from .patching import DiffusionPositions, patch

DIFFUSERS_MIN = (0, 42)  # as pyproject.toml's diffusers extra declares


def check_version(version: str) -> None:
    """Refuse a diffusers older than ``DIFFUSERS_MIN`` by name: the positional modules vispos reproduces have
    other signatures there (Qwen-Image's rope took ``txt_seq_lens``; FLUX's embedder lived in ``embeddings``)."""
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    if parts < DIFFUSERS_MIN:
        floor = ".".join(map(str, DIFFUSERS_MIN))
        raise ImportError(
            f"vispos's diffusers adapter needs diffusers >= {floor} (its transformers' positional modules), found "
            f"{version}: pip install 'diffusers>={floor}' (or pip install 'vispos[diffusers]')"
        )


check_version(diffusers.__version__)

__all__ = ["DIFFUSERS_MIN", "FAMILIES", "DiffusionPositions", "check_version", "from_pretrained", "patch"]
