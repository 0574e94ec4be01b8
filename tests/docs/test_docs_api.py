"""docs/api.md against the code: every public name is documented, and every name it documents exists.

Written against what is public when the test runs (``gradstore.__all__``, the names ``GradStore`` defines itself,
what an open store answers), so it follows refactors of the facade without edits.
"""

from __future__ import annotations

import importlib
import re
import types
from pathlib import Path

import gradstore
from gradstore.core import StoreCore
from gradstore.store import API as STORE_API
from gradstore.store import GradStore

API = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def code_spans() -> list[str]:
    """The text of every `inline code` span of docs/api.md."""
    return re.findall(r"`([^`\n]+)`", API.read_text(encoding="utf-8"))


def mentioned(prefix: str) -> set[str]:
    """Dotted names after ``prefix.`` in the code spans (``store.attribute(...)`` -> ``attribute``), not inside a
    longer name (``gradstore.open`` is no ``store.open``) or a path (``docs/store.md``)."""
    pattern = re.compile(rf"(?<![\w/.]){re.escape(prefix)}\.([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)")
    return {name for span in code_spans() for name in pattern.findall(span)}


def words() -> set[str]:
    """Every identifier written in a code span."""
    return {word for span in code_spans() for word in re.findall(r"[A-Za-z_]\w*", span)}


def test_every_public_name_is_documented():
    missing = sorted(set(gradstore.__all__) - words())
    assert not missing, f"gradstore.__all__ names absent from docs/api.md: {missing}"


def test_the_facade_publishes_its_api_and_at_most_30_names():
    own = {name for name in vars(GradStore) if not name.startswith("_")}
    assert own == set(STORE_API), "gradstore.store.API lists every public name of GradStore"
    assert 0 < len(own) <= 30, sorted(own)
    assert not issubclass(GradStore, StoreCore), "the facade holds its core, it does not inherit it"


def test_every_facade_method_is_documented():
    own = set(STORE_API)
    missing = sorted(own - {name.split(".")[0] for name in mentioned("store")})
    assert not missing, f"GradStore methods absent from docs/api.md (as `store.<name>`): {missing}"


def test_every_store_name_in_the_doc_exists(tmp_path):
    names = {name.split(".")[0] for name in mentioned("store")}
    assert len(names) > 20, sorted(names)  # the doc's store section was found
    store = gradstore.open(tmp_path / "store", row_files=False)
    missing = sorted(name for name in names if name not in dir(store) and not hasattr(store, name))
    assert not missing, f"docs/api.md names store attributes that do not exist: {missing}"


def resolve(dotted: str) -> object:
    """``gradstore.<dotted>``: attributes, importing submodules on the way (``gradstore.hf.GradstoreCallback``)."""
    obj: object = gradstore
    for part in dotted.split("."):
        if hasattr(obj, part):
            obj = getattr(obj, part)
        elif isinstance(obj, types.ModuleType):
            obj = importlib.import_module(f"{obj.__name__}.{part}")
        else:
            raise AttributeError(f"{type(obj).__name__} {obj!r} has no attribute {part!r}")
    return obj


def test_every_gradstore_name_in_the_doc_exists():
    names = sorted(mentioned("gradstore"))
    assert "open" in names and "WriterConfig" in names, names  # the doc's names were found
    missing = []
    for name in names:
        try:
            resolve(name)
        except ModuleNotFoundError as error:
            if error.name and error.name.split(".")[0] in ("gradstore", "ingest", "indexers"):
                missing.append(f"{name} ({error})")
            # else: an optional dependency (transformers, ray) is not installed here
        except (AttributeError, ImportError) as error:
            missing.append(f"{name} ({error})")
    assert not missing, f"docs/api.md names that gradstore does not have: {missing}"


def test_every_method_is_documented():
    from gradstore.methods import ALIASES, METHODS

    text = API.read_text(encoding="utf-8")
    missing = sorted(name for name in METHODS if f"`{name}`" not in text)
    assert not missing, f"attribution methods absent from docs/api.md: {missing}"
    assert ALIASES.get("influence") == "fisher" and "`fisher`/`influence`" in text
