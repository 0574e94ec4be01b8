"""The store's cache of loaded FAISS indexes: a warm search reads no index file, and never serves stale data."""

from __future__ import annotations

import numpy as np
import pytest

import gradstore
import gradstore.core.sidefiles as sidefiles
from gradstore.core.index_cache import IndexCache, LoadedIndex
from ingest import LayerSlot, ProjectionSpec

pytest.importorskip("faiss")

DIM = 32
KIND = "HNSW16,Flat"


def _store(path, rows: int = 600) -> tuple[gradstore.GradStore, np.ndarray]:
    store = gradstore.open(path, storage_dtype="float32")
    layers = tuple(LayerSlot(f"l{i}", "linear", 8, 8, 4, 4, "factorized", 16 * i, 16, False) for i in range(2))
    store.core.catalog.ensure_run("run", ProjectionSpec(seed=0, kind="factorized", layers=layers))
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((rows, DIM)).astype(np.float32)
    with store.writer("run") as writer:
        writer.append(vectors, [f"x{i:04d}" for i in range(rows)], checkpoint="train", split="train")
    return store, rng.standard_normal((8, DIM)).astype(np.float32)


@pytest.fixture
def index_reads(monkeypatch) -> list[str]:
    """The index directories whose files were read and checked (``_check_directory`` calls under ``indexes/``)."""
    reads: list[str] = []
    check = sidefiles._check_directory

    def counted(directory, shown):
        if "/indexes/" in str(shown):
            reads.append(str(shown))
        return check(directory, shown)

    monkeypatch.setattr(sidefiles, "_check_directory", counted)
    return reads


def _attribute(store, queries, **options):
    table = store.attribute(queries, run="run", method="grad-dot", kind=KIND, k=10, write=False, **options)
    return table.sort_by([("query_id", "ascending"), ("rank", "ascending")])


def test_a_warm_call_reads_no_index_file_and_equals_a_fresh_load(tmp_path, index_reads):
    store, queries = _store(tmp_path / "store")
    first = _attribute(store, queries)  # builds (and keeps) the index
    index_reads.clear()
    second = _attribute(store, queries)
    third = _attribute(store, queries)
    assert index_reads == []  # neither read nor hashed the FAISS files again
    assert second.equals(first) and third.equals(first)
    fresh = gradstore.open(tmp_path / "store")  # another store object: loads from the files
    loaded = _attribute(fresh, queries)
    assert len(index_reads) == 1
    assert loaded.equals(first)
    _attribute(fresh, queries)
    assert len(index_reads) == 1


def test_rows_appended_are_found_by_the_next_call(tmp_path, index_reads):
    store, queries = _store(tmp_path / "store")
    before = _attribute(store, queries)
    assert before.column("example_id").to_pylist()[0].startswith("x")
    held = store.index([n for n in store.core.files.children("indexes")][0])
    ntotal = held.faiss_index.ntotal
    with store.writer("run") as writer:  # the queries themselves, scaled: their own best answers
        writer.append(queries * 10, [f"y{i}" for i in range(len(queries))], checkpoint="train", split="train")
    after = _attribute(store, queries)
    tops = after.filter(after.column("rank").to_numpy() == 1).column("example_id").to_pylist()
    assert tops == [f"y{i}" for i in range(len(queries))]
    assert held.faiss_index.ntotal == ntotal  # an index loaded before is not changed under its holder
    index_reads.clear()
    assert _attribute(store, queries).equals(after)  # the updated index is the one kept
    assert index_reads == []
    reopened = _attribute(gradstore.open(tmp_path / "store"), queries)
    assert reopened.equals(after)


def test_an_index_rebuilt_by_another_store_object_is_seen(tmp_path, index_reads):
    store, queries = _store(tmp_path / "store")
    before = _attribute(store, queries)
    other = gradstore.open(tmp_path / "store")  # another process, as far as the caches go
    with other.writer("run") as writer:
        writer.append(queries * 10, [f"y{i}" for i in range(len(queries))], checkpoint="train", split="train")
    _attribute(other, queries)  # updates the index on disk (rows appended)
    name = store.core.files.children("indexes")[0]
    index_reads.clear()
    index = store.index(name)
    assert len(index_reads) == 1  # the manifest changed: read again
    assert index.faiss_index.ntotal == index.manifest["rows"] == 608
    after = _attribute(store, queries)
    tops = after.filter(after.column("rank").to_numpy() == 1).column("example_id").to_pylist()
    assert tops == [f"y{i}" for i in range(len(queries))] and not after.equals(before)
    other.build_index("run", method="grad-dot", kind=KIND, refit=True, name=name)  # rebuilt from scratch
    index_reads.clear()
    rebuilt = store.index(name)
    assert len(index_reads) == 1
    assert rebuilt.manifest["built_at"] == other.index(name).manifest["built_at"]


def test_the_cache_is_bounded_and_keyed_by_identity():
    cache = IndexCache(max_indexes=2)

    def entry(identity):
        return LoadedIndex(identity, object(), None, None, None, None)

    a, b, c = entry((b"a", ())), entry((b"b", ())), entry((b"c", ()))
    cache.put("a", a)
    cache.put("b", b)
    assert cache.get("a", a.identity) is a  # now the most recently used
    cache.put("c", c)
    assert cache.get("b", b.identity) is None and len(cache) == 2
    assert cache.get("a", (b"a2", ())) is None  # another manifest: dropped
    assert cache.get("a", a.identity) is None and cache.holds(c.faiss_index)
