"""The one place listing transformers' common tests that pass on an unpatched model and cannot pass on a
patched one, each with its reason. ``plugin.py`` reads it; anything else passing unpatched and not patched is
reported as unexplained (and fails ``make hf-suite``)."""

from __future__ import annotations

# (test name pattern, family pattern, scheme pattern) -> reason
KNOWN: dict[tuple[str, str, str], str] = {
    ("test_base_model_prefix_loads_base_weights", "*", "*"): (
        "builds type(model)(config) of a patched model: that class refuses construction and names "
        "vispos.hf.from_pretrained, which rebuilds a saved patched model (docs/hf.md)"
    ),
}
