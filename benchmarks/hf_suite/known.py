"""The one place listing transformers' common tests that pass on an unpatched model and cannot pass on a
patched one, each with its reason. ``plugin.py`` reads it; anything else passing unpatched and not patched is
reported as unexplained (and fails ``make hf-suite``)."""

from __future__ import annotations

# (test name pattern, family pattern, scheme pattern) -> reason
KNOWN: dict[tuple[str, str, str], str] = {}
