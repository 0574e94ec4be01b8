"""The public API of before the stage packages (issue 37) through the new structure: every import path the docs,
README and examples used on 2026-12-05 still imports the same objects, and the new homes are the modules'."""

from __future__ import annotations

import importlib

import pytest

import gradstore

#: ``from <module> import <names>`` as the docs and examples wrote them before the move.
BEFORE = [
    ("gradstore.online", ["KeepTopFraction", "query_target", "select_online"]),
    ("gradstore.evaluate", ["lds"]),
    ("gradstore.selection", ["export_selection", "filter_dataset"]),
    ("gradstore.queries", ["QueryBatch"]),
    ("gradstore.hf", ["GradstoreCallback", "with_example_ids"]),
    ("gradstore.distributed", ["distributed_capture"]),
    ("gradstore.serve", ["Limits", "Tokens", "serve"]),
    ("gradstore.methods.fitting", ["FitCache", "Selection", "fit_spec"]),
    ("gradstore.methods.scoring", ["ScoringSpace"]),
]
#: Where each moved module lives now.
NOW = {
    "gradstore.online": "gradstore.capture.online",
    "gradstore.evaluate": "gradstore.answers.evaluate",
    "gradstore.selection": "gradstore.answers.selection",
    "gradstore.queries": "gradstore.methods.queries",
    "gradstore.methods.fitting": "gradstore.preconditioning.fitting",
    "gradstore.methods.scoring": "gradstore.preconditioning.scoring",
}


@pytest.mark.parametrize(("module", "names"), BEFORE)
def test_the_import_paths_of_before_still_import_the_same_objects(module, names):
    before = importlib.import_module(module)
    now = importlib.import_module(NOW.get(module, module))
    for name in names:
        assert getattr(before, name) is getattr(now, name)


def test_the_package_root_exports_what_it_did():
    assert gradstore.QueryBatch is importlib.import_module("gradstore.methods.queries").QueryBatch
    for name in ("open", "connect", "GradStore", "ScoreMatrix", "GradstoreError", "LocalEngine", "RayEngine"):
        assert name in gradstore.__all__ and hasattr(gradstore, name)
