"""FAISS indexes: Flat == exact, IVF recall on captured gradients, HNSW, persistence, manifests, GPU (skips)."""

from __future__ import annotations

import pickle
import sys

import numpy as np
import pytest
import torch
from torch.func import functional_call, grad, vmap

pytest.importorskip("faiss")

from indexers import (
    ExactIndex,
    FaissIndex,
    IndexMismatchError,
    blocks_from_arrays,
    choose_index_kind,
    default_nprobe,
    gpu_available,
    measure_recall,
    recall_at_k,
    require_faiss,
)
from indexers.faiss_index import DEFAULT_EF_SEARCH, GPU_MAX_K, sample_rows
from indexers.recall import ivf_nlist

MANIFEST = {
    "store_version": 7,
    "rows": 500,
    "projection": {"seed": 0, "dims": [16, 16]},
    "preconditioner": "identity",
    "metric": "ip",
}


@pytest.fixture(scope="module")
def random_rows() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((500, 32)).astype(np.float32)
    return (
        rng.permutation(5000)[:500].astype(np.int64),
        vectors,
        rng.standard_normal((6, 32)).astype(np.float32),
    )


@pytest.fixture(scope="module")
def mlp_gradients() -> tuple[np.ndarray, np.ndarray]:
    """Per-example gradients (torch.func) of a tiny MLP trained 30 steps on 10 Gaussian clusters.

    6,000 training rows and 100 held-out queries of 1,002 dims (20 -> 32 -> 10, tanh), fixed seed."""
    torch.manual_seed(0)
    n_train, n_query, d_in, classes = 6000, 100, 20, 10
    labels = torch.randint(0, classes, (n_train + n_query,))
    x = (torch.randn(classes, d_in) * 2)[labels] + torch.randn(n_train + n_query, d_in)
    model = torch.nn.Sequential(torch.nn.Linear(d_in, 32), torch.nn.Tanh(), torch.nn.Linear(32, classes))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(30):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x[:n_train]), labels[:n_train]).backward()
        optimizer.step()
    params = {name: p.detach() for name, p in model.named_parameters()}

    def loss(p, xi, yi):
        return torch.nn.functional.cross_entropy(functional_call(model, p, (xi[None],)), yi[None])

    per_example = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, labels)
    grads = torch.cat([g.reshape(len(x), -1) for g in per_example.values()], 1).numpy().astype(np.float32)
    return grads[:n_train], grads[n_train:]


def test_flat_equals_exact(random_rows) -> None:
    ids, vectors, queries = random_rows
    index = FaissIndex("Flat", 32)
    index.add(ids, vectors)
    scores, found = index.search(queries, 10)
    exact_scores, exact_ids = ExactIndex(device="cpu", block_rows=64).search(queries, (ids, vectors), 10)
    np.testing.assert_array_equal(found, exact_ids)
    np.testing.assert_allclose(scores, exact_scores, rtol=1e-5, atol=1e-5)
    assert index.search(queries, 10_000)[1].shape == (6, 500)  # k > rows gives every row


def test_ivf_recall_on_mlp_gradients_at_default_nprobe(mlp_gradients) -> None:
    train, queries = mlp_gradients
    source = blocks_from_arrays(np.arange(len(train), dtype=np.int64), train, block_rows=1000)
    factory = f"IVF{ivf_nlist(len(train))},Flat"
    index = FaissIndex(factory, train.shape[1])
    index.train(source)
    index.add_from(source)
    assert index.nprobe == default_nprobe(index.nlist)
    assert measure_recall(index, queries, source, k=10) >= 0.95


def test_add_from_scaled_float16_blocks(random_rows) -> None:
    ids, vectors, queries = random_rows
    norms = np.linalg.norm(vectors, axis=1).astype(np.float32)
    unit16 = (vectors / norms[:, None]).astype(np.float16)
    scaled = FaissIndex("Flat", 32)
    scaled.add_from(lambda: iter([(ids[:250], unit16[:250], norms[:250]), (ids[250:], unit16[250:], norms[250:])]))
    plain = FaissIndex("Flat", 32)
    plain.add(ids, unit16.astype(np.float32) * norms[:, None])
    for got, expected in zip(scaled.search(queries, 10), plain.search(queries, 10), strict=True):
        np.testing.assert_array_equal(got, expected)


def test_training_sample_is_random_and_reproducible() -> None:
    vectors = np.arange(1000, dtype=np.float32)[:, None].repeat(4, 1)
    source = blocks_from_arrays(np.arange(1000), vectors, block_rows=128)
    sample = sample_rows(source, 100, seed=3)
    rows = sample[:, 0].astype(int)
    assert len(np.unique(rows)) == 100 and rows.max() > 500 and rows.min() < 500
    np.testing.assert_array_equal(sample, sample_rows(source, 100, seed=3))
    assert len(sample_rows(source, 5000)) == 1000


@pytest.mark.parametrize("factory", ["Flat", "IVF8,Flat", "IVF8,SQfp16"])
def test_save_load_and_incremental_add_equal_rebuild(tmp_path, random_rows, factory: str) -> None:
    ids, vectors, queries = random_rows
    source = blocks_from_arrays(ids, vectors, block_rows=100)
    rebuilt = FaissIndex(factory, 32, nprobe=3)
    rebuilt.train(source, seed=1)
    rebuilt.save(tmp_path / "trained", MANIFEST)  # the same trained quantizer for both arms
    rebuilt.add(ids, vectors)

    incremental = FaissIndex.load(tmp_path / "trained", mmap=False)
    incremental.add(ids[:300], vectors[:300])
    incremental.save(tmp_path / "part", {**MANIFEST, "rows": 300})
    reloaded = FaissIndex.load(tmp_path / "part", expected_manifest={**MANIFEST, "rows": 300})  # memory-mapped
    assert reloaded.ntotal == 300 and reloaded.nprobe == rebuilt.nprobe and reloaded.manifest["rows"] == 300
    np.testing.assert_array_equal(reloaded.search(queries, 10)[1], incremental.search(queries, 10)[1])
    reloaded.add(ids[300:], vectors[300:])
    for got, expected in zip(reloaded.search(queries, 10), rebuilt.search(queries, 10), strict=True):
        np.testing.assert_array_equal(got, expected)


def test_manifest_mismatch_names_the_differing_keys(tmp_path, random_rows) -> None:
    ids, vectors, _ = random_rows
    index = FaissIndex("Flat", 32)
    index.add(ids, vectors)
    index.save(tmp_path, MANIFEST)
    expected = {**MANIFEST, "rows": 501, "projection": {"seed": 1, "dims": [16, 16]}}
    with pytest.raises(IndexMismatchError, match="projection") as error:
        FaissIndex.load(tmp_path, expected_manifest=expected)
    assert set(error.value.differences) == {"projection", "rows"}
    assert error.value.differences["rows"] == (501, 500)
    assert FaissIndex.load(tmp_path, expected_manifest=dict(MANIFEST)).ntotal == 500


def test_choose_index_kind_rule() -> None:
    assert ivf_nlist(6000) == 128 and ivf_nlist(1_000_000) == 4096 and ivf_nlist(10) == 1
    speed = {"flops_per_s": 1e11}  # 200k x 4096 x 64 queries: 1.05 s estimated
    assert choose_index_kind(150_000, 4096, **speed) == "exact"
    assert choose_index_kind(200_000, 4096, **speed) == "HNSW32,SQfp16"  # 1.7 GB of fp16 rows + links
    assert choose_index_kind(200_000, 4096, memory_budget_bytes=2 * 2**30, **speed) == "HNSW32,SQfp16"
    assert choose_index_kind(200_000, 4096, memory_budget_bytes=2**30, **speed) == "IVF2048,PQ256"
    assert choose_index_kind(10_000, 100, time_budget_s=0.0) == "HNSW32,SQfp16"
    assert choose_index_kind(10_000, 100, time_budget_s=0.0, memory_budget_bytes=10**6) == "IVF256,PQ5"


def test_recall_at_k() -> None:
    assert recall_at_k(np.array([[1, 2, -1]]), np.array([[2, 3, 1]])) == pytest.approx(2 / 3)
    assert recall_at_k(np.array([[1], [5]]), np.array([[1], [4]])) == 0.5


def test_missing_faiss_says_which_extra(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "faiss", None)
    with pytest.raises(ImportError, match=r"gradstore\[cpu\]"):
        require_faiss()


@pytest.mark.skipif(gpu_available(), reason="checks the CPU-only fallback")
def test_to_gpu_without_gpu_warns_and_stays_on_cpu(random_rows) -> None:
    ids, vectors, queries = random_rows
    index = FaissIndex("Flat", 32)
    index.add(ids, vectors)
    with pytest.warns(UserWarning, match="no CUDA GPU"):
        assert index.to_gpu() is index


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs faiss-gpu and a CUDA GPU")
@pytest.mark.parametrize("factory", ["Flat", "IVF8,Flat"])
def test_gpu_search_matches_cpu_and_large_k_falls_back(random_rows, factory: str) -> None:
    ids, vectors, queries = random_rows
    source = blocks_from_arrays(ids, vectors)
    cpu = FaissIndex(factory, 32, nprobe=8)
    cpu.train(source)
    cpu.add_from(source)
    gpu = cpu.to_gpu()
    assert gpu.ntotal == cpu.ntotal
    assert recall_at_k(gpu.search(queries, 10)[1], cpu.search(queries, 10)[1]) >= 0.99  # float16 storage
    big = np.concatenate([vectors] * 5)
    gpu.add(np.arange(len(big)) + 10_000, big)
    with pytest.warns(UserWarning, match="GPU limit"):
        _, found = gpu.search(queries, GPU_MAX_K + 1)
    assert found.shape == (6, GPU_MAX_K + 1)


def test_hnsw_ef_search_persists_and_keeps_at_least_k(tmp_path, random_rows) -> None:
    ids, vectors, queries = random_rows
    index = FaissIndex("HNSW8,Flat", 32)
    assert index.graph and index.ef_search == DEFAULT_EF_SEARCH and index.nprobe is None and not index.mergeable
    assert not FaissIndex("Flat", 32).graph and FaissIndex("Flat", 32).ef_search is None
    with pytest.raises(ValueError, match="ef_search"):
        index.ef_search = 0
    index.add(ids, vectors)
    index.ef_search = 1  # a search still keeps k candidates
    scores, found = index.search(queries, 50)
    assert (found >= 0).all() and found.shape == (6, 50)
    assert (np.diff(scores, axis=1) <= 0).all()
    index.ef_search = 500  # the whole graph: exact
    _, exact_ids = ExactIndex(device="cpu").search(queries, (ids, vectors), 10)
    np.testing.assert_array_equal(index.search(queries, 10)[1], exact_ids)
    index.save(tmp_path / "hnsw", MANIFEST)
    for mmap in (True, False):
        loaded = FaissIndex.load(tmp_path / "hnsw", mmap=mmap)
        assert loaded.graph and loaded.ef_search == 500
        np.testing.assert_array_equal(loaded.search(queries, 10)[1], exact_ids)
    loaded.add(ids[:5] + 10_000, vectors[:5] * 100)  # incremental: reachable in the graph
    assert loaded.ntotal == 505 and set(loaded.search(vectors[:5] * 100, 1)[1].ravel()) == set(ids[:5] + 10_000)
    copy = pickle.loads(pickle.dumps(loaded))  # what a Ray task gets
    assert copy.graph and copy.ef_search == 500 and copy.ntotal == 505
    with pytest.raises(ValueError, match="cannot merge"):
        copy.merge_from(loaded)
