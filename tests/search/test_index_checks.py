"""What an attribution index refuses and what it warns of: FAISS kinds it cannot build (checked before FAISS sees
them: FAISS aborts the process on some), searches with arguments ``attribute`` refuses, and a FAISS index whose
selection changed since its build (rows appended: its scores are those of the build's fit)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch

import gradstore
from gradstore.core.engine import LocalEngine
from gradstore.preconditioning.fitting import ids_digest
from indexers.faiss_index import check_factory

pytest.importorskip("faiss")

DIM = 32
#: Kinds FAISS accepts and then kills the process on (assertion, SIGFPE, SIGSEGV, uncaught C++ exception) or hangs.
ABORTING_KINDS = ["HNSW0", "HNSW1", "HNSW1,Flat", "HNSW0,SQ8", "PQ4x0", "IVF4,PQ4x0", "HNSW32,SQ0", "NSG2", "RR0,Flat"]


def _store(path, rows: int = 200, seed: int = 0) -> gradstore.GradStore:
    store = gradstore.open(path, storage_dtype="float32")
    store.create_run("r", dim=DIM)
    rng = np.random.default_rng(seed)
    with store.writer("r") as writer:
        writer.append(
            rng.standard_normal((rows, DIM)).astype(np.float32), [f"t{i}" for i in range(rows)], split="train"
        )
    return store


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> gradstore.GradStore:
    return _store(tmp_path_factory.mktemp("checks") / "store")


def test_kinds_faiss_aborts_on_are_refused_and_the_process_lives(tmp_path):
    """In a child process: before the check, ``kind="HNSW0"`` ended the interpreter with a FAISS assertion."""
    _store(tmp_path / "store")
    child = textwrap.dedent(
        f"""
        import json, gradstore
        from typer.testing import CliRunner
        from gradstore.cli import app
        store = gradstore.open({str(tmp_path / "store")!r}, create=False)
        refused = {{}}
        for kind in {ABORTING_KINDS!r}:
            try:
                store.build_index("r", method="grad-dot", kind=kind)
            except gradstore.InvalidArgumentError as error:
                refused[kind] = str(error)
        cli = CliRunner().invoke(app, ["build-index", {str(tmp_path / "store")!r}, "--run", "r", "--kind", "HNSW0"])
        print(json.dumps({{"refused": refused, "cli": [cli.exit_code, cli.output]}}))
        """
    )
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert sorted(result["refused"]) == sorted(ABORTING_KINDS)
    assert "HNSW<M> with M >= 2" in result["refused"]["HNSW0"]
    assert "1 to 16 bits" in result["refused"]["PQ4x0"]
    assert "not one gradstore builds; pass a codec ('Flat'" in result["refused"]["NSG2"]
    exit_code, output = result["cli"]
    assert exit_code != 0 and "M >= 2" in output and "Traceback" not in output


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("IVF0,Flat", "at least 1 list"),
        ("IVF1000,Flat", "trains on at least 1000 rows (one per IVF list or PQ centroid) and 200 were given"),
        ("IVF4,PQ4x12", "trains on at least 4096 rows"),
        ("IDMap,Flat", "is not one gradstore builds"),
        ("PQ3", "m must divide 32"),
        ("HNSW32,PQ3", "m must divide 32"),
        ("Bogus", "is not one gradstore builds"),
    ],
)
def test_kinds_faiss_fails_on_later_are_refused_before_anything_is_fitted(small, kind, message):
    fitted = small.fits.fitted
    with pytest.raises(gradstore.InvalidArgumentError, match=message.replace("(", r"\(").replace(")", r"\)")):
        small.build_index("r", method="fisher", kind=kind)
    assert small.fits.fitted == fitted


@pytest.mark.parametrize(
    ("kind", "rows"),
    [("Flat", 1), ("SQfp16", 1), ("HNSW32", 1), ("HNSW2,SQ8", 1), ("IVF8,Flat", 8), ("IVF4,PQ4", 256),
     ("PQ8x4fs", 16), ("IVF2,PQ4x4fsr", 16), ("HNSW16,PQ2x1", 2), ("IVF1024,PQ64", 1024)],
)  # fmt: skip
def test_the_kinds_gradstore_builds_and_the_rows_they_train_on(kind, rows):
    assert check_factory(kind, 128) == rows


def test_an_index_searches_only_with_the_arguments_attribute_takes(small):
    exact = small.build_index("r", method="grad-dot")
    graph = small.build_index("r", method="grad-dot", kind="HNSW8,Flat")
    query = np.ones((1, DIM), np.float32)
    refused = [
        (exact, (np.ones((1, 7), np.float32), 3), {}, gradstore.SchemaMismatchError, "7 dims; index .* has 32"),
        (graph, (np.ones((1, 7), np.float32), 3), {}, gradstore.SchemaMismatchError, "7 dims"),
        (exact, (query, 0), {}, gradstore.InvalidArgumentError, "k must be a whole number >= 1, got 0"),
        (graph, (query, 2.5), {}, gradstore.InvalidArgumentError, "k must be a whole number >= 1"),
        (exact, ([[1.0] * DIM], 3), {}, gradstore.InvalidArgumentError, "numeric numpy array or torch tensor"),
        (exact, (np.array([["a"] * DIM]), 3), {}, gradstore.InvalidArgumentError, "an array of <U1"),
        (exact, (np.ones((1, 2, DIM), np.float32), 3), {}, gradstore.InvalidArgumentError, r"\[queries, dim\]"),
        (exact, (np.full((1, DIM), np.nan, np.float32), 3), {}, gradstore.NonFiniteGradientError, "NaN/Inf"),
        (graph, (np.full((1, DIM), np.inf, np.float32), 3), {}, gradstore.NonFiniteGradientError, "NaN/Inf"),
        (exact, (query, 3), {"rerank": 2}, gradstore.InvalidArgumentError, "kind='exact' is exact already"),
        (graph, (query, 3), {"rerank": -1}, gradstore.InvalidArgumentError, "rerank must be a whole number >= 0"),
        (graph, (query, 3), {"rerank": 1.5}, gradstore.InvalidArgumentError, "rerank must be a whole number >= 0"),
        (graph, (query, 3), {"engine": "ray"}, gradstore.InvalidArgumentError, "searched by FAISS in this process"),
        (graph, (query, 3), {"engine": "spark"}, gradstore.InvalidArgumentError, "engine must be one of"),
        (exact, (query, 3), {"engine": "spark"}, gradstore.InvalidArgumentError, "engine must be one of"),
        (exact, (query, 3), {"largest": "no"}, gradstore.InvalidArgumentError, "largest= takes True or False"),
        (graph, (query, 3), {"largest": 0}, gradstore.InvalidArgumentError, "largest= takes True or False"),
        (exact, (query, 3), {"bogus": 1}, gradstore.InvalidArgumentError, "takes no argument bogus="),
        (exact, (query + 1j, 3), {}, gradstore.InvalidArgumentError, "must be real, got an array of complex64"),
        (graph, (torch.ones(1, DIM, dtype=torch.complex64), 3), {}, gradstore.InvalidArgumentError, "must be real"),
    ]
    for index, args, kwargs, error, message in refused:
        with pytest.raises(error, match=message):
            index.search(*args, **kwargs)
    np.testing.assert_array_equal(exact.search(torch.ones(DIM), 3)[1], exact.search(query, 3)[1])  # one vector
    np.testing.assert_array_equal(graph.search(query, 3, rerank=2)[1], exact.search(query, 3)[1])
    np.testing.assert_array_equal(graph.search(query, np.int64(3), rerank=np.int32(2))[1], exact.search(query, 3)[1])
    for engine in ("local", LocalEngine()):  # the local engine by name or object: the same search
        np.testing.assert_array_equal(exact.search(query, 3, engine=engine)[1], exact.search(query, 3)[1])
        np.testing.assert_array_equal(graph.search(query, 3, engine=engine)[1], graph.search(query, 3)[1])


def test_a_faiss_index_after_an_append_searches_the_build_fits_space_and_says_so(tmp_path):
    store = _store(tmp_path / "store", rows=400)
    rng = np.random.default_rng(1)
    query = rng.standard_normal((2, DIM)).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing appended: no warning
        built = store.build_index("r", method="fisher", kind="Flat")
        built.search(query, 5)
        grad_dot = store.build_index("r", method="grad-dot", kind="Flat")
    assert built.manifest["fit_state"] == [400, ids_digest(store.read_gradients("r").grad_ids)]
    with store.writer("r") as writer:  # larger rows: the fit of all rows is another one
        writer.append(
            (rng.standard_normal((200, DIM)) * 5).astype(np.float32), [f"u{i}" for i in range(200)], split="train"
        )

    with pytest.warns(gradstore.StaleIndexWarning) as caught:
        store.index(built.name).search(query, 5)  # loaded as saved: the appended rows are not in it yet
    assert [str(w.message).split(": ")[0] for w in caught] == [
        f"index {built.name!r} holds 400 rows and its selection 600 now",
        f"index {built.name!r} (Flat) searches in the space of the fisher fit it was built with, whose rows were 400 "
        "then and are 600 now",
    ]
    index = store.build_index("r", method="fisher", kind="Flat")  # adds the appended rows, in the build's space
    assert index.faiss_index.ntotal == index.manifest["rows"] == 600
    assert index.manifest["fit_state"] == built.manifest["fit_state"]
    with pytest.warns(gradstore.StaleIndexWarning, match="whose rows were 400 then and are 600 now") as caught:
        scores, ids = index.search(query, 5)
    assert len(caught) == 1 and "refit=True" in str(caught[0].message)
    block = store.read_gradients("r")
    space = index.first_space  # the build's fit, saved with the FAISS files
    exact = space.balanced(torch.from_numpy(query)) @ space.balanced(torch.from_numpy(block.vectors)).T
    want = torch.topk(exact, 5, dim=1)
    np.testing.assert_array_equal(ids, block.grad_ids[want.indices.numpy()])
    np.testing.assert_allclose(scores, want.values.numpy(), rtol=1e-5)

    current_scores, current = store.build_index("r", method="fisher").search(query, 5)  # the refitted space
    assert not np.array_equal(ids, current)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # re-ranked: the current fit's scores; grad-dot has no fit to predate
        reranked_scores, reranked = index.search(query, 5, rerank=120)
        store.build_index("r", method="grad-dot", kind="Flat").search(query, 5)
    np.testing.assert_array_equal(reranked, current)
    np.testing.assert_allclose(reranked_scores, current_scores, rtol=1e-5)
    refitted = store.build_index("r", method="fisher", kind="Flat", refit=True)
    assert refitted.manifest["fit_state"][0] == 600
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        np.testing.assert_array_equal(refitted.search(query, 5)[1], current)
    assert grad_dot.manifest["fit_state"][0] == 400


def _replace_a_row(store: gradstore.GradStore, rng: np.random.Generator) -> tuple[int, int]:
    """Delete one row and append one by a new writer whose ``grad_id`` is below the largest (each writer draws its
    id prefix at random: writers are tried until one is): the selection's count and largest id are unchanged."""
    ids = store.read_gradients("r").grad_ids
    for _ in range(64):
        with store.writer("r") as writer:
            (new,) = writer.append(10 * rng.standard_normal((1, DIM)).astype(np.float32), ["new"], split="train")
        if new < ids.max():
            break
        store.core.table("gradients").delete(f"grad_id = {int(new)}")
    gone = int(np.sort(ids)[0])
    store.core.table("gradients").delete(f"grad_id = {gone}")
    after = store.read_gradients("r").grad_ids
    assert len(after) == len(ids) and after.max() == ids.max()  # what a (count, largest id) state would see
    return gone, int(new)


def test_as_many_rows_deleted_as_appended_make_fits_and_indexes_stale(tmp_path):
    """Fits, indexes and their checks see a row replaced (one deleted, one appended with a smaller ``grad_id``):
    the fit is made again (equal to a store holding only the current rows), a FAISS index searched warns, and
    ``build_index`` with the same arguments builds it again without the deleted row."""
    store = _store(tmp_path / "store", rows=200)
    rng = np.random.default_rng(3)
    query = rng.standard_normal((2, DIM)).astype(np.float32)
    store.attribute(query, run="r", method="fisher", k=5)  # fitted and kept
    built = store.build_index("r", method="grad-dot", kind="IVF2,Flat")
    gone, new = _replace_a_row(store, rng)

    fresh = gradstore.open(tmp_path / "fresh", storage_dtype="float32")
    fresh.create_run("r", dim=DIM)
    block = store.read_gradients("r")
    with fresh.writer("r") as writer:
        writer.append(block.vectors, block.metadata.column("example_id").to_pylist(), split="train")
    for method in ("fisher", "grad-dot"):
        got = store.attribute(query, run="r", method=method, k=5)
        want = fresh.attribute(query, run="r", method=method, k=5)
        assert got.column("example_id").to_pylist() == want.column("example_id").to_pylist()
        np.testing.assert_allclose(got.column("score").to_numpy(), want.column("score").to_numpy(), rtol=1e-5)

    with pytest.warns(gradstore.StaleIndexWarning, match="as many rows deleted as appended"):
        store.index(built.name).search(query, 5)
    rebuilt = store.build_index("r", method="grad-dot", kind="IVF2,Flat")
    assert gone not in set(rebuilt.indexed_ids) and new in set(rebuilt.indexed_ids)
    assert rebuilt.faiss_index.ntotal == 200
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, ids = store.index(built.name).search(query, 200)
    assert gone not in set(ids.ravel()) and new in set(ids.ravel())


def test_a_faiss_index_saved_without_its_fits_rows_is_rebuilt(tmp_path):
    store = _store(tmp_path / "store")
    index = store.build_index("r", method="fisher", kind="Flat", name="old")
    del index.manifest["fit_state"]  # as gradstore saved it before it recorded them
    index.save()
    with pytest.warns(gradstore.StaleIndexWarning, match="were never recorded"):
        store.index("old").search(np.ones((1, DIM), np.float32), 3)
    rebuilt = store.build_index("r", method="fisher", kind="Flat", name="old")
    assert rebuilt.manifest["fit_state"][0] == 200 and store.index("old").manifest["fit_state"][0] == 200


def test_a_held_index_scores_rows_appended_since_with_the_fit_of_the_rows_now(tmp_path):
    """Indexes held since before rows were appended (here by another handle of the store, as by another process):
    the exact one scores every row with the fisher fit of all the rows now, as ``attribute`` does, without a
    warning (it was the build's fit, silently); a FAISS one's ``rerank=`` re-scores its candidates with it too."""
    store = _store(tmp_path / "store", rows=100)
    rng = np.random.default_rng(2)
    query = rng.standard_normal((2, DIM)).astype(np.float32)
    held = store.build_index("r", method="fisher", damping=0.1, name="held")
    flat = store.build_index("r", method="fisher", damping=0.1, kind="Flat", name="flat")
    built_ids = store.read_gradients("r").grad_ids
    other = gradstore.open(tmp_path / "store", create=False)
    with other.writer("r") as writer:  # larger rows: the fit of all rows is another one
        writer.append(
            (3 * rng.standard_normal((200, DIM))).astype(np.float32), [f"new{i}" for i in range(200)], split="train"
        )

    block = store.read_gradients("r")
    rows = block.vectors.astype(np.float64)
    fisher = rows.T @ rows / len(rows)
    now = np.linalg.solve(fisher + 0.1 * np.trace(fisher) / DIM * np.eye(DIM), query.T.astype(np.float64)).T @ rows.T
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scores, ids = held.search(query, 5)
    top = np.argsort(-now, axis=1)[:, :5]
    np.testing.assert_array_equal(ids, block.grad_ids[top])
    np.testing.assert_allclose(scores, np.take_along_axis(now, top, axis=1), rtol=1e-4)
    attributed = store.attribute(query, run="r", method="fisher", damping=0.1, k=5, write=False)
    assert attributed.column("grad_id").to_pylist() == ids.ravel().tolist()

    indexed = np.isin(block.grad_ids, built_ids)  # the FAISS index holds the 100 rows it was built with
    with pytest.warns(gradstore.StaleIndexWarning, match="holds 100 rows and its selection 300 now"):
        reranked_scores, reranked = flat.search(query, 5, rerank=20)  # 100 candidates: every row it holds
    among = np.where(indexed, now, -np.inf)
    top = np.argsort(-among, axis=1)[:, :5]
    np.testing.assert_array_equal(reranked, block.grad_ids[top])
    np.testing.assert_allclose(reranked_scores, np.take_along_axis(now, top, axis=1), rtol=1e-4)
