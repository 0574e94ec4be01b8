"""Where a search runs: ``device=`` for exact search, FAISS on a GPU only where it moved there, and
``search_path`` reporting the device actually used (HNSW graphs: always the CPU)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import gradstore
from gradstore.errors import InvalidArgumentError
from gradstore.methods.preconditioned import indexed
from gradstore.preconditioning.fitting import Selection
from gradstore.search.building import build_index
from gradstore.search.loading import load_index
from indexers import ExactIndex, gpu_available, resolve_device
from ingest import LayerSlot, ProjectionSpec

DIM = 32
SELECTION = Selection("run", "train", "train", None)


@pytest.fixture(scope="module")
def store_and_queries(tmp_path_factory):
    store = gradstore.open(tmp_path_factory.mktemp("device") / "store", storage_dtype="float32")
    layers = tuple(LayerSlot(f"l{i}", "linear", 8, 8, 4, 4, "factorized", 16 * i, 16, False) for i in range(2))
    store.core.catalog.ensure_run("run", ProjectionSpec(seed=0, kind="factorized", layers=layers))
    rng = np.random.default_rng(0)
    with store.writer("run") as writer:
        writer.append(
            rng.standard_normal((400, DIM)).astype(np.float32),
            [f"x{i:03d}" for i in range(400)],
            checkpoint="train",
            split="train",
        )
    return store, rng.standard_normal((3, DIM)).astype(np.float32)


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def fake_gpu(monkeypatch):
    """torch and faiss both say a GPU is there (none is used: the tests only look at where searches would go)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr("gradstore.search.index.gpu_available", lambda: True)


# ------------------------------------------------------------------------------------------- indexers level
def test_resolve_device_defaults_and_refusals(no_cuda, monkeypatch) -> None:
    assert resolve_device(None) == torch.device("cpu")
    assert resolve_device("cpu") == resolve_device(torch.device("cpu")) == torch.device("cpu")
    assert ExactIndex(device="cpu").device.type == "cpu"
    with pytest.raises(ValueError, match="no CUDA GPU"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="no CUDA GPU"):
        ExactIndex(device="cuda:0")
    with pytest.raises(ValueError, match="device must be"):
        resolve_device("nonsense")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device(None) == torch.device("cuda")
    assert resolve_device(None, kernel="bfloat16") == torch.device("cpu")  # the bf16 kernel is a CPU kernel
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ValueError, match="cuda:0 to cuda:1"):
        resolve_device("cuda:2")


# ------------------------------------------------------------------------------------------- exact
def test_exact_search_on_the_cpu_when_asked(store_and_queries, fake_gpu) -> None:
    store, queries = store_and_queries
    index = build_index(store.core, store.fits, SELECTION, device="cpu")
    assert index.search_path.endswith("kernel on cpu")
    assert index._exact().device == torch.device("cpu")
    scores, ids = index.search(queries, 5)  # runs here, on the CPU, although "CUDA" is seen
    assert scores.shape == ids.shape == (3, 5)


def test_exact_default_reports_cuda_where_torch_sees_it(store_and_queries, fake_gpu) -> None:
    store, _ = store_and_queries
    index = store.build_index("run", method="grad-dot")
    assert index.device is None and index.search_path == "exact, float32 kernel on cuda"


def test_exact_cuda_without_cuda_is_refused(store_and_queries, no_cuda) -> None:
    store, _ = store_and_queries
    for device in ("cuda", "cuda:0", torch.device("cuda")):
        with pytest.raises(InvalidArgumentError, match="no CUDA GPU"):
            build_index(store.core, store.fits, SELECTION, device=device)


@pytest.mark.parametrize("device", ["mps", "meta", "nonsense", 3.5])
def test_devices_other_than_cpu_and_cuda_are_refused(store_and_queries, device) -> None:
    store, _ = store_and_queries
    with pytest.raises(InvalidArgumentError, match="device must be"):
        build_index(store.core, store.fits, SELECTION, device=device)


def test_explicit_cuda_with_another_engine_is_refused(store_and_queries, fake_gpu) -> None:
    store, queries = store_and_queries
    index = load_index(store.core, store.fits, store.build_index("run", method="grad-dot").name, indexed, device="cuda")
    assert index.device == torch.device("cuda")

    class Elsewhere:
        parallelism = 2

        def map(self, *args, **kwargs):  # pragma: no cover - refused before
            raise AssertionError("not reached")

    with pytest.raises(InvalidArgumentError, match="engine='local'"):
        index.search(queries, 5, engine=Elsewhere())


# ------------------------------------------------------------------------------------------- FAISS


def test_hnsw_is_searched_on_the_cpu_even_where_a_gpu_is_seen(store_and_queries, fake_gpu) -> None:
    pytest.importorskip("faiss")
    store, queries = store_and_queries
    index = store.build_index("run", kind="HNSW8,Flat", method="grad-dot")
    assert index.search_path == "faiss HNSW8,Flat on cpu"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not moved: no "no GPU version" warning either
        index.search(queries, 5)
    assert index.search_path == "faiss HNSW8,Flat on cpu"
    with pytest.raises(InvalidArgumentError, match="no GPU version"):
        build_index(store.core, store.fits, SELECTION, kind="HNSW8,Flat", device="cuda")


def test_hnsw_says_cpu_without_a_gpu(store_and_queries) -> None:
    pytest.importorskip("faiss")
    store, _ = store_and_queries
    assert store.build_index("run", kind="HNSW8,Flat", method="grad-dot").search_path == "faiss HNSW8,Flat on cpu"


@pytest.mark.skipif(gpu_available(), reason="checks the fallback where faiss cannot use a GPU")
def test_faiss_reports_where_the_index_actually_is(store_and_queries, fake_gpu) -> None:
    pytest.importorskip("faiss")
    store, queries = store_and_queries
    index = store.build_index("run", kind="Flat", method="grad-dot")
    assert index.search_path == "faiss Flat on gpu"  # not searched yet: where it would go
    with pytest.warns(UserWarning, match="no CUDA GPU usable by FAISS"):
        index.search(queries, 5)  # faiss itself has no GPU here: the copy stays on the CPU
    assert index.search_path == "faiss Flat on cpu"


def test_faiss_device_cpu_stays_on_the_cpu(store_and_queries, fake_gpu) -> None:
    pytest.importorskip("faiss")
    store, queries = store_and_queries
    index = build_index(store.core, store.fits, SELECTION, kind="Flat", device="cpu")
    assert index.search_path == "faiss Flat on cpu"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        index.search(queries, 5)
    assert index.search_path == "faiss Flat on cpu" and not index._gpu_copy.on_gpu


def test_faiss_cuda_refusals(store_and_queries, monkeypatch) -> None:
    pytest.importorskip("faiss")
    store, _ = store_and_queries
    monkeypatch.setattr("gradstore.search.index.gpu_available", lambda: False)
    with pytest.raises(InvalidArgumentError, match="FAISS cannot use a GPU here"):
        build_index(store.core, store.fits, SELECTION, kind="IVF4,Flat", device="cuda")
    with pytest.raises(InvalidArgumentError, match="every GPU faiss sees"):
        build_index(store.core, store.fits, SELECTION, kind="Flat", device="cuda:0")


# ------------------------------------------------------------------------------------------- on a GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_exact_search_on_cuda_and_cpu_agree(store_and_queries) -> None:
    store, queries = store_and_queries
    build = build_index
    on_gpu = build(store, store.fits, SELECTION, device="cuda")
    on_cpu = build(store, store.fits, SELECTION, device="cpu")
    assert on_gpu.search_path == "exact, float32 kernel on cuda" and on_cpu.search_path.endswith("on cpu")
    for _ in range(2):  # the second searches read rows each device prepared and kept apart
        gpu_scores, gpu_ids = on_gpu.search(queries, 10)
        cpu_scores, cpu_ids = on_cpu.search(queries, 10)
        np.testing.assert_array_equal(gpu_ids, cpu_ids)
        np.testing.assert_allclose(gpu_scores, cpu_scores, rtol=1e-4, atol=1e-4)
    assert on_gpu._cache_key() != on_cpu._cache_key()


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs faiss-gpu and a CUDA GPU")
def test_faiss_on_gpu_says_gpu_after_its_search(store_and_queries) -> None:
    store, queries = store_and_queries
    index = build_index(store.core, store.fits, SELECTION, kind="IVF4,Flat", device="cuda")
    index.search(queries, 5)
    assert index._gpu_copy.on_gpu and index.search_path == "faiss IVF4,Flat on gpu"
