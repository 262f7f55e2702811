"""transformers' ``ModelTesterMixin`` (its ``tests/test_modeling_common.py``, from the sdist of the installed
transformers) on every family of ``families.py``, unpatched, with its own positions inherited and with the
replacing scheme: one ``unittest`` class per family and scheme, named ``Test_<family>__<scheme>``.

Run by ``make hf-suite`` with ``-p benchmarks.hf_suite.plugin``, which makes the sdist's tests importable as
``transformers_tests`` and prints the table."""

from __future__ import annotations

import unittest

from transformers_tests.test_modeling_common import ModelTesterMixin

from benchmarks.hf_suite.families import FAMILIES, SCHEMES, Family, FamilyTester, construct


def case(family: Family, scheme: str) -> type:
    def setUp(self) -> None:  # noqa: N802
        self.model_tester = FamilyTester(self, family)

    attrs = {
        "all_model_classes": tuple(construct(c, family, scheme) for c in family.classes),
        "test_resize_embeddings": False,  # vision models: no token embeddings to resize
        "setUp": setUp,
        "__module__": __name__,
    }
    return type(f"Test_{family.name}__{scheme}", (ModelTesterMixin, unittest.TestCase), attrs)


for _family in FAMILIES:
    for _scheme in SCHEMES:
        _cls = case(_family, _scheme)
        globals()[_cls.__name__] = _cls
del _family, _scheme, _cls
