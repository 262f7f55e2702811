"""A pytest plugin that runs timm's own model tests (``tests/test_models.py`` of the installed timm's sdist,
fetched by ``benchmarks.suite_sources`` into ``.cache/``, unmodified) on vispos-patched models.

Loaded with ``-p benchmarks.timm_suite.plugin`` (``make timm-tests``), it wraps ``timm.create_model`` before
timm's test module is collected (that module imports the name), so that every model of the families below
comes back patched, and runs each chosen test once per scheme of ``VISPOS_SCHEMES`` (comma-separated; default
``unpatched,inherited,rope2d``): ``unpatched`` leaves the model as timm builds it, ``inherited`` gives each
model the scheme its own positions are (Swin: relbias2d, Swin V2: cpb2d, BEiT: relbias2d, relpos ViT:
relbias2d or cpb2d, Eva: its RoPE, ViT: learned2d, SAM: learned2d + decomposed2d), any other name replaces
them (``inherit=False``). The tests kept are those of the models of ``MODELS`` (``VISPOS_MODELS``, comma-
separated, narrows them) and the tests named after a family; at the end the comparison of
``benchmarks.suite_report`` is printed, with the reasons of ``KNOWN``."""

from __future__ import annotations

import contextvars
import fnmatch
import functools
import os
from typing import Any

import pytest
import timm
import torch
from torch import nn

import vispos
from benchmarks.suite_report import UNPATCHED, Outcomes

FAMILIES = {"swin": ("swin_*",), "swinv2_cr": ("swinv2_cr_*",), "swinv2": ("swinv2_*",), "beit": ("beit*",),
            "relpos": ("vit_relpos_*", "vit_srelpos_*", "test_vit_relpos*"), "sam": ("samvit_*",),
            "eva": ("eva*", "vit_*_rope_*"), "vit": ("vit_*", "deit*")}  # fmt: skip
# timm's tests named after a family that take no model name (SAM's feature getter, Eva's classifier reset)
NAMED = {"samvit": "sam", "eva": "eva", "beit": "beit", "swin": "swin"}
# the models whose tests run: the smallest of each family (timm's tests take every size); SAM at 224 px too (timm's
# tests skip most of the 1024 px samvit_base_patch16's as above their size limits); test_vit_relpos is the tiny
# relpos ViT timm's relpos tests build
MODELS = ("swin_tiny_patch4_window7_224", "swinv2_tiny_window8_256", "swinv2_cr_tiny_224", "beit_base_patch16_224",
          "vit_relpos_small_patch16_224", "vit_relpos_base_patch16_clsgap_224", "test_vit_relpos",
          "samvit_base_patch16", "samvit_base_patch16_224", "eva02_tiny_patch14_224", "vit_small_patch16_rope_224",
          "vit_tiny_patch16_224", "deit_tiny_patch16_224")  # fmt: skip
FILTER_LOOKUP = (
    "finds the family's checkpoint filter as type(model).__module__'s checkpoint_filter_fn: a patched class is "
    "defined in vispos.timm (where pickle finds it; timm's classes are never changed), which has none, and timm's "
    "filter reads the tables a patched model no longer holds; a patched model's load_state_dict places and resizes "
    "the positional entries itself (docs/patching.md; at another size: tests/test_timm_beit.py, "
    "tests/test_timm_swin_checkpoint.py)"
)
KNOWN: dict[tuple[str, str, str], str] = {
    ("*script*", "*", "*"): "vispos does not support torch.jit.script (docs/patching.md)",
    ("test_headless_checkpoint_reload*", "*", "*"): FILTER_LOOKUP,
    ("test_relpos_non_square_checkpoint_reload*", "*", "*"): FILTER_LOOKUP,
    ("test_relpos_family_set_input_size*", "*", "*"): FILTER_LOOKUP,
    ("test_model_forward_*features*", "*", "*"): "features_only: timm wraps the model in a feature net, which "
    "vispos.patch does not take (skipped when patched)",
}
SCHEME: contextvars.ContextVar[str] = contextvars.ContextVar("vispos_scheme", default=UNPATCHED)
OUTCOMES = Outcomes("timm's model tests on vispos-patched models", KNOWN)


def family_of(name: str) -> str | None:
    return next((f for f, patterns in FAMILIES.items() if any(fnmatch.fnmatch(name, p) for p in patterns)), None)


def named_family(test: str) -> str | None:
    """The family a test is named after (a word of its name: ``test_eva_...``, not ``test_eval_...``)."""
    return next((NAMED[w] for w in test.split("_") if w in NAMED), None)


def own_scheme(model: nn.Module) -> str | list[str]:
    """The vispos scheme a timm model's own positions are."""
    from timm.models.beit import Beit
    from timm.models.swin_transformer_v2_cr import SwinTransformerV2Cr
    from timm.models.vision_transformer_relpos import VisionTransformerRelPos
    from timm.models.vision_transformer_sam import VisionTransformerSAM

    from vispos.timm.beit import own_bias
    from vispos.timm.inherit import own_rope
    from vispos.timm.relpos import own_relative_bias
    from vispos.timm.swin import OWN_BIAS

    if type(model) in OWN_BIAS:
        return OWN_BIAS[type(model)][0]
    if isinstance(model, SwinTransformerV2Cr):
        return "cpb2d"
    if isinstance(model, VisionTransformerSAM):
        own = ["learned2d"] if model.pos_embed is not None else []
        return own + (["decomposed2d"] if model.blocks[0].attn.use_rel_pos else []) or "nope"
    if isinstance(model, Beit):
        own = own_bias(model)
        return own[0].scheme if own is not None else "learned2d"
    if isinstance(model, VisionTransformerRelPos):
        return own_relative_bias(model).scheme
    own = own_rope(model)
    return own.scheme if own is not None else "learned2d"


def patched(create: Any, name: str, *args: Any, **kwargs: Any) -> nn.Module:
    chosen = family_of(name) is not None and SCHEME.get() != UNPATCHED
    if chosen and kwargs.get("features_only"):  # timm's feature wrapper, not a model vispos patches
        pytest.skip("features_only: timm wraps the model in a feature net, which vispos.patch does not take")
    model = create(name, *args, **kwargs)
    if not chosen:
        return model
    scheme = SCHEME.get()
    if scheme == "inherited":
        return vispos.patch(model, own_scheme(model))
    return vispos.patch(model, scheme, inherit=False)


def pytest_configure(config: pytest.Config) -> None:  # noqa: ARG001
    wrapped = functools.wraps(timm.create_model)(functools.partial(patched, timm.create_model))
    timm.create_model = wrapped
    timm.models.create_model = wrapped


@pytest.fixture(autouse=True)
def vispos_scheme(request: pytest.FixtureRequest):
    # each test compiles afresh, as when timm's suite runs it alone: the three schemes' compilations of one timm
    # forward would otherwise share torch.compile's per-function recompile limit
    torch._dynamo.reset()
    token = SCHEME.set(getattr(request, "param", UNPATCHED))
    yield
    SCHEME.reset(token)


def schemes() -> list[str]:
    return os.environ.get("VISPOS_SCHEMES", f"{UNPATCHED},inherited,rope2d").split(",")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    metafunc.parametrize("vispos_scheme", schemes(), indirect=True)


def _model(item: pytest.Item) -> str | None:
    callspec = getattr(item, "callspec", None)
    return callspec.params.get("model_name") if callspec is not None else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    models = os.environ.get("VISPOS_MODELS", ",".join(MODELS)).split(",")
    keep, drop = [], []
    for item in items:
        name = _model(item)
        named = name is None and named_family(item.originalname) is not None
        (keep if name in models or named else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # node ids: tests/test_models.py::test_model_forward[inherited-2-vit_tiny_patch16_224]
    test, _, params = report.nodeid.partition("::")[2].partition("[")
    parts = params.rstrip("]").split("-")
    scheme = next((p for p in parts if p in schemes()), UNPATCHED)
    rest = [p for p in parts if p != scheme]
    family = next((family_of(p) for p in rest if family_of(p)), None) or named_family(test) or "other"
    OUTCOMES.add(family, scheme, f"{test}[{'-'.join(rest)}]", report)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:  # noqa: ARG001
    OUTCOMES.summary(terminalreporter)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:  # noqa: ARG001
    OUTCOMES.exit_status(session)
