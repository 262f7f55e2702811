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
    ("test_model_weights_reload_no_missing_tied_weights", "*", "*"): (
        "asserts that every key a checkpoint without weights leaves missing is a parameter or buffer; a patched "
        "model's settings records (vispos._extra_state, and its scheme modules' where they have one) are module "
        "extra state, never listed among the buffers (vispos._state.expose_records: .to(), named_buffers and "
        "offloading hooks must not see them), and transformers reports them missing as torch's load_state_dict "
        "does, which vispos.hf.from_pretrained reads to refuse a folder lacking one "
        "(tests/test_hf_missing_records.py); the model keeps its settings"
    ),
    ("test_can_init_all_missing_weights", "*", "relbias2d"): (
        "reseeds before each module's _init_weights (seeded_weight_init) and compares with the model as built; "
        "vispos.patch builds a replacing scheme's modules after the model's init, each layer's table drawn in turn "
        "from one generator, so only the first layer's draw meets the reseeded one: the values differ, not the "
        "init (_init_weights initialises vispos's weights as vispos does: "
        "tests/test_hf_loading.py::test_transformers_init_initialises_vispos_weights_as_vispos_does)"
    ),
}
