"""Exact index == numpy brute force (values and ids, ties broken by the smaller id)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from brute_force import brute_force, integer_data
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from indexers import UNIT_BF16_NORM, CosinePreconditioner, ExactIndex, blocks_from_arrays, screening
from indexers.screening import RowPieces, fast_bfloat16_matmul, gathered_tiles, row_tiles


@pytest.fixture(params=["float32", "bfloat16"])
def kernel(request: pytest.FixtureRequest) -> str:
    """Both kernels must give the float32 result (bfloat16 runs everywhere, natively or not)."""
    return request.param


@pytest.mark.parametrize("block_rows", [1, 7, 64, 1000])
@pytest.mark.parametrize("k", [1, 5, 10, 150])
@pytest.mark.parametrize("largest", [True, False])
def test_matches_brute_force_with_ties_across_blocks(block_rows: int, k: int, largest: bool, kernel: str) -> None:
    queries, vectors, ids = integer_data(0, 103, 6, 5)
    scores, found = ExactIndex(device="cpu", kernel=kernel, block_rows=block_rows).search(
        queries, (ids, vectors), k, largest
    )
    expected_scores, expected_ids = brute_force(queries, vectors, ids, k, largest)
    assert scores.dtype == np.float32 and found.dtype == np.int64
    assert found.shape == (5, min(k, 103))
    np.testing.assert_array_equal(found, expected_ids)
    np.testing.assert_array_equal(scores, expected_scores.astype(np.float32))
    assert_prepared_and_bf16_blocks_agree(kernel, block_rows, queries, vectors, ids, k, largest)


def assert_prepared_and_bf16_blocks_agree(kernel, block_rows, queries, vectors, ids, k, largest) -> None:
    """Prepared rows and streamed bf16 blocks (small integers are exact in bf16) give the brute-force result:
    with the bfloat16 kernel these are the screened paths."""
    index = ExactIndex(device="cpu", kernel=kernel, block_rows=block_rows)
    expected_scores, expected_ids = brute_force(queries, vectors, ids, k, largest)
    bf16_rows = torch.from_numpy(vectors).to(torch.bfloat16)
    for source in (index.prepare(ids, vectors), (ids, bf16_rows)):
        scores, found = index.search(queries, source, k, largest)
        np.testing.assert_array_equal(found, expected_ids)
        np.testing.assert_array_equal(scores, expected_scores.astype(np.float32))


def test_all_scores_tied_takes_smallest_ids(kernel: str) -> None:
    vectors = np.ones((40, 3), np.float32)
    ids = np.arange(40, dtype=np.int64)[::-1].copy()
    scores, found = ExactIndex(device="cpu", kernel=kernel, block_rows=9).search(
        np.ones((2, 3), np.float32), (ids, vectors), 4
    )
    np.testing.assert_array_equal(found, [[0, 1, 2, 3]] * 2)
    np.testing.assert_array_equal(scores, np.full((2, 4), 3.0))


def test_random_float_data_and_multi_block_source(kernel: str) -> None:
    rng = np.random.default_rng(1)
    vectors = rng.standard_normal((500, 32)).astype(np.float32)
    queries = rng.standard_normal((8, 32)).astype(np.float32)
    ids = rng.permutation(500).astype(np.int64) + 10_000
    sizes = [13, 200, 1, 86, 200]

    def source():
        start = 0
        for size in sizes:
            yield ids[start : start + size], vectors[start : start + size]
            start += size

    scores, found = ExactIndex(device="cpu", kernel=kernel, block_rows=64).search(queries, source, 10)
    expected_scores, expected_ids = brute_force(queries, vectors, ids, 10)
    np.testing.assert_array_equal(found, expected_ids)
    np.testing.assert_allclose(scores, expected_scores, rtol=1e-5, atol=1e-5)


def test_float16_blocks_torch_queries_and_1d_query(kernel: str) -> None:
    queries, vectors, ids = integer_data(2, 70, 8, 3)
    source = blocks_from_arrays(ids, vectors.astype(np.float16), block_rows=16)
    scores, found = ExactIndex(device="cpu", kernel=kernel).search(torch.from_numpy(queries), source, 7)
    expected_scores, expected_ids = brute_force(queries, vectors, ids, 7)
    np.testing.assert_array_equal(found, expected_ids)
    np.testing.assert_array_equal(scores, expected_scores.astype(np.float32))
    one_scores, one_ids = ExactIndex(device="cpu", kernel=kernel).search(queries[1], source, 7)
    np.testing.assert_array_equal(one_ids, expected_ids[1:2])


def test_transform_is_applied_to_every_block(kernel: str) -> None:
    rng = np.random.default_rng(3)
    vectors = rng.standard_normal((90, 16)).astype(np.float32)
    queries = rng.standard_normal((4, 16)).astype(np.float32)
    ids = np.arange(90, dtype=np.int64)
    cosine = CosinePreconditioner()
    scores, found = ExactIndex(device="cpu", kernel=kernel, block_rows=20).search(
        cosine.apply_both(torch.from_numpy(queries)), (ids, vectors), 5, transform=cosine.apply_both
    )

    def unit(a):
        return a / np.linalg.norm(a, axis=1, keepdims=True)

    expected_scores, expected_ids = brute_force(unit(queries), unit(vectors), ids, 5)
    np.testing.assert_array_equal(found, expected_ids)
    np.testing.assert_allclose(scores, expected_scores, atol=1e-6)


def test_empty_source_and_bad_arguments(kernel: str) -> None:
    index = ExactIndex(device="cpu", kernel=kernel)
    scores, found = index.search(np.ones((2, 4), np.float32), (np.empty(0, np.int64), np.empty((0, 4))), 3)
    assert scores.shape == found.shape == (2, 0)
    with pytest.raises(ValueError, match="k must be"):
        index.search(np.ones((2, 4), np.float32), (np.arange(3), np.ones((3, 4))), 0)
    with pytest.raises(ValueError, match="dimension"):
        index.search(np.ones((2, 5), np.float32), (np.arange(3), np.ones((3, 4))), 1)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    n=st.integers(1, 60),
    d=st.integers(1, 5),
    k=st.integers(1, 70),
    block_rows=st.integers(1, 25),
    largest=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_property_matches_brute_force(
    n: int, d: int, k: int, block_rows: int, largest: bool, seed: int, kernel: str
) -> None:
    queries, vectors, ids = integer_data(seed, n, d, 3)
    scores, found = ExactIndex(device="cpu", kernel=kernel, block_rows=block_rows).search(
        queries, (ids, vectors), k, largest
    )
    expected_scores, expected_ids = brute_force(queries, vectors, ids, k, largest)
    np.testing.assert_array_equal(found, expected_ids)
    np.testing.assert_array_equal(scores, expected_scores.astype(np.float32))
    assert_prepared_and_bf16_blocks_agree(kernel, block_rows, queries, vectors, ids, k, largest)


def test_scaled_blocks_score_like_the_scaled_rows(kernel: str) -> None:
    """The store's layout: float16 unit rows and a float32 norm column, passed as a block's third element."""
    rng = np.random.default_rng(4)
    vectors = rng.standard_normal((150, 24)).astype(np.float32)
    queries = rng.standard_normal((5, 24)).astype(np.float32)
    norms = np.linalg.norm(vectors, axis=1).astype(np.float32)
    unit16 = (vectors / norms[:, None]).astype(np.float16)
    ids = np.arange(150, dtype=np.int64)

    def source():
        for start in range(0, 150, 40):
            yield ids[start : start + 40], unit16[start : start + 40], norms[start : start + 40]

    for largest in (True, False):
        scores, found = ExactIndex(device="cpu", kernel=kernel, block_rows=32).search(queries, source, 8, largest)
        stored = unit16.astype(np.float32) * norms[:, None]
        expected_scores, expected_ids = brute_force(queries, stored, ids, 8, largest)
        np.testing.assert_array_equal(found, expected_ids)
        np.testing.assert_allclose(scores, expected_scores, rtol=1e-5, atol=1e-5)


def near_duplicates(seed: int, n: int, d: int, q: int, spread: float):
    """Rows ``base + spread * noise``: bf16 rounding (relative 2**-8) cannot tell them apart when spread is
    small, float32 can; queries near the base make every row a near-tie for the screen."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal(d)
    vectors = (base + spread * rng.standard_normal((n, d))).astype(np.float32)
    queries = (base + 0.1 * rng.standard_normal((q, d))).astype(np.float32)
    return queries, vectors, np.arange(n, dtype=np.int64)


@pytest.mark.parametrize("largest", [True, False])
def test_bfloat16_kernel_ranks_what_a_bf16_gemm_cannot(largest: bool) -> None:
    queries, vectors, ids = near_duplicates(5, 600, 256, 6, spread=1e-2)
    index = ExactIndex(device="cpu", kernel="bfloat16", block_rows=150)
    scores, found = index.search(queries, index.prepare(ids, vectors), 10, largest)
    float32 = ExactIndex(device="cpu", kernel="float32").search(queries, (ids, vectors), 10, largest)
    expected_scores, expected_ids = brute_force(queries, vectors, ids, 10, largest)
    np.testing.assert_array_equal(found, float32[1])
    np.testing.assert_array_equal(found, expected_ids)
    np.testing.assert_allclose(scores, float32[0], rtol=1e-6)
    np.testing.assert_allclose(scores, expected_scores, rtol=1e-6)
    # The test can fail: ranking by a plain bf16 GEMM picks other rows here.
    plain = torch.from_numpy(queries).bfloat16() @ torch.from_numpy(vectors).bfloat16().T
    plain_ids = (plain.float() if largest else -plain.float()).topk(10, dim=1).indices.numpy()
    assert (np.sort(plain_ids, 1) != np.sort(expected_ids, 1)).any()


@pytest.mark.parametrize("largest", [True, False])
def test_bfloat16_kernel_exact_when_one_query_dominates_the_screen(largest: bool) -> None:
    """One query scores far higher than the others on every row (its rows would fill a pool of the rows best for
    any query): each query's floor comes from its own top-k on the screen; the result is the float32 one."""
    rng = np.random.default_rng(11)
    vectors = rng.standard_normal((3000, 64)).astype(np.float32)
    direction = np.eye(64, dtype=np.float32)[0]
    vectors[:200] += 8 * direction  # the pool (4 * k * 3 rows) is filled by these rows, the best for query 0
    queries = rng.standard_normal((3, 64)).astype(np.float32)
    queries[0] = direction
    ids = rng.permutation(10**6)[:3000].astype(np.int64)
    index = ExactIndex(device="cpu", kernel="bfloat16", block_rows=1000)
    scores, found = index.search(queries, index.prepare(ids, vectors), 5, largest)
    float32 = ExactIndex(device="cpu", kernel="float32", block_rows=1000).search(queries, (ids, vectors), 5, largest)
    np.testing.assert_array_equal(found, float32[1])
    np.testing.assert_allclose(scores, float32[0], rtol=1e-6)


@pytest.mark.parametrize("dense_share", [0.0, 0.5, 1.0])
def test_bfloat16_kernel_exact_on_clustered_rows_whichever_way_it_rescores(monkeypatch, dense_share: float) -> None:
    """Rows in tight clusters: each query's top-k lies within the screen's error of most of its cluster, so the
    screen keeps most rows. Rescoring the gathered candidates (``DENSE_SHARE`` 1) and scoring every row of the
    block (0; the default 0.5 takes this path here) give the float32 result, ties included."""
    rng = np.random.default_rng(12)
    centres = 40 * rng.standard_normal((4, 96)).astype(np.float32)
    vectors = centres[rng.integers(0, 4, 2000)] + rng.standard_normal((2000, 96)).astype(np.float32)
    vectors[1000:1010] = vectors[0]  # exact ties across the block boundary
    queries = centres + rng.standard_normal((4, 96)).astype(np.float32)
    ids = rng.permutation(10**6)[:2000].astype(np.int64)
    monkeypatch.setattr("indexers.screening.DENSE_SHARE", dense_share)
    rescored = []
    real = screening._rescored
    monkeypatch.setattr("indexers.screening._rescored", lambda *a: rescored.append(len(a[1])) or real(*a))
    index = ExactIndex(device="cpu", kernel="bfloat16", block_rows=1000)
    expected = ExactIndex(device="cpu", kernel="float32", block_rows=1000).search(queries, (ids, vectors), 12)
    for source in (index.prepare(ids, vectors), (ids, torch.from_numpy(vectors).to(torch.bfloat16))):
        scores, found = index.search(queries, source, 12)
        if isinstance(source, tuple):
            expected = ExactIndex(device="cpu", kernel="float32").search(
                queries, (ids, source[1].to(torch.float32)), 12
            )
        np.testing.assert_array_equal(found, expected[1])
        np.testing.assert_allclose(scores, expected[0], rtol=1e-6)
    assert (sum(rescored) > 2000) == (dense_share == 1.0), rescored  # rows gathered for rescoring, 4 blocks


@pytest.mark.parametrize("largest", [True, False])
def test_bfloat16_kernel_exact_on_runs_of_similar_neighbouring_rows_in_pieces(largest: bool) -> None:
    """Each query's best rows sit next to each other (runs of near-copies, as a store holds one step's examples),
    the rows are scaled unit rows kept in pieces (as the row cache holds them): the floor's strided groups, its
    per-query pairs and the rows rescored for every query give the float32 result, each id once per query."""
    rng = np.random.default_rng(13)
    n, d = 4000, 128
    vectors = rng.standard_normal((n, d)).astype(np.float32)
    queries = rng.standard_normal((5, d)).astype(np.float32)
    for j, start in enumerate(range(100, 600, 100)):  # query j's run: 40 neighbours within bf16's error
        vectors[start : start + 40] = 4 * queries[j] + 1e-3 * rng.standard_normal((40, d)).astype(np.float32)
    norms = np.linalg.norm(vectors, axis=1).astype(np.float32) * rng.uniform(0.5, 2.0, n).astype(np.float32)
    unit16 = torch.from_numpy(vectors / np.linalg.norm(vectors, axis=1, keepdims=True)).to(torch.float16)
    ids = np.arange(n, dtype=np.int64)
    index = ExactIndex(device="cpu", kernel="bfloat16", block_rows=n)
    starts = range(0, n, 700)  # read in pieces, screened as one block of pieces
    prepared = index.prepare_blocks(
        lambda: iter([(ids[a : a + 700], unit16[a : a + 700], norms[a : a + 700]) for a in starts])
    )
    scores, found = index.search(queries, prepared, 10, largest)
    assert isinstance(next(iter(prepared)).exact, RowPieces)
    scaled = unit16.to(torch.float32).numpy() * norms[:, None]
    expected = ExactIndex(device="cpu", kernel="float32").search(queries, (ids, scaled), 10, largest)
    np.testing.assert_array_equal(found, expected[1])
    np.testing.assert_allclose(scores, expected[0], rtol=1e-6)
    assert all(len(set(row)) == len(row) for row in found.tolist())


def test_scores_within_tolerance_of_float32_on_store_rows(kernel: str) -> None:
    """The store's float16 unit rows x norm at W-query's dimension: every score within 1e-3 |q| |g| of the
    float64 one, and every found row's true score within that tolerance of the true k-th best."""
    rng = np.random.default_rng(6)
    vectors = (rng.standard_normal((3000, 4096)) * np.logspace(-8, 2, 3000)[:, None]).astype(np.float32)
    queries = rng.standard_normal((16, 4096)).astype(np.float32)
    norms = np.linalg.norm(vectors, axis=1).astype(np.float32)
    unit16 = (vectors / norms[:, None]).astype(np.float16)
    ids = np.arange(3000, dtype=np.int64)
    index = ExactIndex(device="cpu", kernel=kernel, block_rows=1024)
    scores, found = index.search(queries, index.prepare(ids, unit16, norms), 10)
    true = queries.astype(np.float64) @ vectors.astype(np.float64).T
    tolerance = 1e-3 * np.linalg.norm(queries, axis=1)[:, None] * norms[found]
    assert (np.abs(scores - np.take_along_axis(true, found, 1)) <= tolerance).all()
    kth = np.sort(true, axis=1)[:, -10]
    assert (np.take_along_axis(true, found, 1) >= kth[:, None] - tolerance).all()


def test_prepared_rows_search_like_the_streamed_ones(kernel: str) -> None:
    queries, vectors, ids = integer_data(7, 300, 12, 4)
    index = ExactIndex(device="cpu", kernel=kernel, block_rows=64)
    prepared = index.prepare(ids, torch.from_numpy(vectors))
    assert len(prepared) == 300 and prepared.kernel == kernel
    for largest in (True, False):
        streamed = index.search(queries, (ids, vectors), 9, largest)
        again = index.search(queries, prepared, 9, largest)
        np.testing.assert_array_equal(again[1], streamed[1])
        np.testing.assert_array_equal(again[0], streamed[0])
    with pytest.raises(ValueError, match="prepared"):
        index.search(queries, prepared, 3, transform=lambda block: block)
    other = "float32" if kernel == "bfloat16" else "bfloat16"
    with pytest.raises(ValueError, match="prepared"):
        ExactIndex(device="cpu", kernel=other).search(queries, prepared, 3)
    with pytest.raises(ValueError, match="one id"):
        index.prepare(ids[:5], vectors)


def test_auto_kernel_follows_the_cpu() -> None:
    assert ExactIndex(device="cpu").kernel == ("bfloat16" if fast_bfloat16_matmul() else "float32")
    assert ExactIndex(device="cpu", kernel="float32").kernel == "float32"
    with pytest.raises(ValueError, match="kernel"):
        ExactIndex(device="cpu", kernel="int8")


def test_bfloat16_kernel_is_a_cpu_kernel() -> None:
    """Its bound needs float32 accumulation, which bf16 GEMMs on other devices do not promise."""
    assert ExactIndex(kernel="bfloat16").device.type == "cpu"  # device=None: the CPU even where CUDA is seen
    assert ExactIndex(device="meta").kernel == "float32"
    with pytest.raises(ValueError, match="CPU only"):
        ExactIndex(device="meta", kernel="bfloat16")


def test_screen_bookkeeping_runs_on_one_thread_and_restores_the_count() -> None:
    from indexers.screening import one_thread

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with one_thread():
            assert torch.get_num_threads() == 1
            with one_thread():
                assert torch.get_num_threads() == 1
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        queries, vectors, ids = integer_data(3, 200, 8, 4)
        index = ExactIndex(device="cpu", kernel="bfloat16", block_rows=64)
        index.search(queries, index.prepare(ids, vectors), 5)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("largest", [True, False])
def test_bf16_unit_rows_with_a_known_norm_bound_search_like_measured_ones(largest: bool) -> None:
    """``max_norm`` (unit rows rounded to bf16, e.g. the store's bfloat16 rows) skips measuring the norms and
    changes nothing: prepared, streamed and measured searches all give the float32 result over the bf16 rows."""
    rng = np.random.default_rng(11)
    unit = rng.standard_normal((2500, 256)).astype(np.float32)
    unit[::5] = unit[1::5] + 1e-3 * unit[::5]  # near ties
    unit /= np.linalg.norm(unit, axis=1, keepdims=True)
    unit[7] = 0.0
    rows = torch.from_numpy(unit).bfloat16()
    scales = np.logspace(-8, 2, 2500).astype(np.float32)
    ids = np.arange(2500, dtype=np.int64)
    queries = rng.standard_normal((9, 256)).astype(np.float32)
    known = ExactIndex(device="cpu", kernel="bfloat16", block_rows=700, max_norm=UNIT_BF16_NORM)
    measured = ExactIndex(device="cpu", kernel="bfloat16", block_rows=700)
    assert (known.prepare(ids, rows, scales).blocks[0].norms == UNIT_BF16_NORM).all()
    expected = ExactIndex(device="cpu", kernel="float32").search(
        queries, (ids, rows.float() * torch.from_numpy(scales)[:, None]), 8, largest
    )
    for index in (known, measured):
        for source in (index.prepare(ids, rows, scales), lambda: iter([(ids, rows, scales)])):
            found = index.search(queries, source, 8, largest)
            np.testing.assert_array_equal(found[1], expected[1])
            np.testing.assert_allclose(found[0], expected[0], rtol=1e-5, atol=1e-6 * np.abs(expected[0]).max())
    with pytest.raises(ValueError, match="max_norm"):
        ExactIndex(device="cpu", max_norm=-1.0)


def test_unit_bf16_norm_bounds_every_unit_row_rounded_to_bf16() -> None:
    rng = np.random.default_rng(12)
    rows = [rng.standard_normal((400, d)) * rng.uniform(1e-8, 1e3, (400, 1)) for d in (1, 3, 16, 4096)]
    rows += [np.full((1, d), 1.0) for d in range(1, 300)]  # every entry rounded the same way
    for block in rows:
        block = block.astype(np.float32)
        unit = torch.from_numpy(
            block / np.linalg.norm(block.astype(np.float64), axis=1, keepdims=True).astype(np.float32)
        )
        norms = torch.linalg.vector_norm(unit.bfloat16().double(), dim=1)
        assert (norms <= (1 + 2**-8) * (1 + 1e-6)).all() and (norms <= UNIT_BF16_NORM).all()


@pytest.mark.parametrize("stored", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_the_float32_kernel_keeps_rows_as_stored_on_the_cpu(stored: torch.dtype) -> None:
    """Prepared for the float32 kernel on the CPU, float16, bfloat16 and float32 rows are referenced as they are
    (each search upcasts them one tile at a time: no float32 copy is kept), other dtypes become float32; the
    searches equal brute force either way."""
    queries, vectors, ids = integer_data(13, 300, 10, 4)
    rows = torch.from_numpy(vectors).to(stored)
    index = ExactIndex(device="cpu", kernel="float32")
    prepared = index.prepare(ids, rows)
    (block,) = prepared.blocks
    kept = stored != torch.float64
    assert block[1].dtype == (stored if kept else torch.float32)
    assert (block[1].data_ptr() == rows.data_ptr()) == kept
    for largest in (True, False):
        found = index.search(queries, prepared, 7, largest)
        reference = brute_force(queries, vectors, ids, 7, largest)
        np.testing.assert_array_equal(found[1], reference[1])
        np.testing.assert_array_equal(found[0], reference[0].astype(np.float32))


@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("stored", [torch.float16, torch.bfloat16])
def test_rows_prepared_from_small_pieces_search_like_the_streamed_ones(
    kernel: str, scaled: bool, stored: torch.dtype
) -> None:
    """Blocks of uneven sizes (Lance returns one batch per fragment): the bf16 kernel groups them up to
    ``block_rows`` without a copy (rows kept in their pieces, bf16 ones screened piece by piece), the float32
    kernel prepares each as it comes (split at ``block_rows``, never joined); the prepared rows fill as the first
    search reaches them, call ``on_complete`` once, when the last is prepared, and search like the streamed rows
    afterwards."""
    queries, vectors, ids = integer_data(11, 403, 12, 5)
    scales = np.random.default_rng(3).uniform(-2, 2, len(ids)).astype(np.float32) if scaled else None
    cuts = [0, 1, 40, 41, 100, 230, 231, 403]
    rows = torch.from_numpy(vectors).to(stored)
    pieces = [(ids[a:b], rows[a:b]) for a, b in zip(cuts, cuts[1:])]
    if scaled:
        pieces = [(*piece, scales[a:b]) for piece, a, b in zip(pieces, cuts, cuts[1:])]
    index = ExactIndex(device="cpu", kernel=kernel, block_rows=64)
    completed = []
    prepared = index.prepare_blocks(lambda: iter(pieces), on_complete=completed.append)
    assert not prepared.complete and prepared.blocks == []
    streamed_source = lambda: iter(pieces)  # noqa: E731
    for largest in (True, False):
        streamed = index.search(queries, streamed_source, 9, largest)
        found = index.search(queries, prepared, 9, largest)
        np.testing.assert_array_equal(found[1], streamed[1])
        np.testing.assert_array_equal(found[0], streamed[0])
        reference = brute_force(
            queries, vectors.astype(np.float16) * (1 if scales is None else scales[:, None]), ids, 9, largest
        )
        np.testing.assert_array_equal(found[1], reference[1])
    assert prepared.complete and completed == [prepared] and len(prepared) == 403
    assert all(len(block if kernel == "bfloat16" else block[0]) <= 64 for block in prepared.blocks[:-1])
    if kernel == "float32":
        assert [len(block[0]) for block in prepared.blocks] == [1, 39, 1, 59, 64, 64, 2, 1, 64, 64, 44]


def test_prepared_rows_fill_once_when_searched_from_two_threads() -> None:
    queries, vectors, ids = integer_data(12, 500, 8, 3)
    reads = []

    def source():
        for start in range(0, 500, 50):
            reads.append(start)
            yield ids[start : start + 50], vectors[start : start + 50]

    index = ExactIndex(device="cpu", kernel="bfloat16", block_rows=100)
    prepared = index.prepare_blocks(source)
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: index.search(queries, prepared, 7), range(2)))
    expected = brute_force(queries, vectors, ids, 7)
    for scores, found in results:
        np.testing.assert_array_equal(found, expected[1])
        np.testing.assert_array_equal(scores, expected[0].astype(np.float32))
    assert reads == list(range(0, 500, 50)) and len(prepared.blocks) == 5


def test_row_pieces_gather_rows_in_any_order() -> None:
    rows = torch.arange(60, dtype=torch.float32).view(20, 3).to(torch.float16)
    pieces = RowPieces([rows[:1], rows[1:9], rows[9:20]])
    assert pieces.shape == (20, 3) and len(pieces) == 20 and pieces.dtype == torch.float16
    wanted = torch.tensor([19, 0, 8, 9, 3, 3, 10], dtype=torch.int64)
    for source in (rows, pieces):  # tiles of at most 2 rows; every position once
        gathered = torch.full((7, 3), torch.nan)
        for where, tile in gathered_tiles(source, wanted, 2):
            assert len(tile) <= 2 and tile.dtype == torch.float32 and torch.isnan(gathered[where]).all()
            gathered[where] = tile
        torch.testing.assert_close(gathered, rows[wanted].float(), rtol=0, atol=0)
        assert list(gathered_tiles(source, torch.empty(0, dtype=torch.int64), 2)) == []
    assert [(part.start, part.stop, len(tile)) for part, tile in row_tiles(pieces, 4)] == [
        (0, 1, 1),
        (1, 5, 4),
        (5, 9, 4),
        (9, 13, 4),
        (13, 17, 4),
        (17, 20, 3),
    ]
    with pytest.raises(ValueError, match="one width"):
        RowPieces([rows, rows[:, :2]])


@pytest.mark.parametrize("gather_rows", [None, 7], ids=["default-gathers", "seven-rows-a-gather"])
@pytest.mark.parametrize("pieces", [False, True], ids=["one-tensor", "in-pieces"])
def test_bfloat16_kernel_rescores_the_reaching_pairs_one_query_at_a_time(monkeypatch, pieces, gather_rows) -> None:
    """Scaled unit rows where each row reaches about one query's top-k: the pairs that reach are rescored per query
    (one GEMV each over its own rows, lists of unequal lengths padded with ``-inf``) and the result is the float32
    kernel's, every id once per query; a row already among a query's floor pairs is not listed twice. Rows are
    gathered a bounded number at a time (a query's own rows cut where they exceed it)."""
    if gather_rows is not None:
        monkeypatch.setattr("indexers.screening.GATHER_ELEMENTS", 96 * gather_rows)
    rng = np.random.default_rng(21)
    n, d, q = 6000, 96, 24
    vectors = rng.standard_normal((n, d)).astype(np.float32)
    queries = rng.standard_normal((q, d)).astype(np.float32)
    norms = rng.uniform(0.5, 2.0, n).astype(np.float32)
    unit16 = torch.from_numpy(vectors / np.linalg.norm(vectors, axis=1, keepdims=True)).to(torch.float16)
    ids = rng.permutation(10**6)[:n].astype(np.int64)
    calls = []
    real = screening._reached_scores
    monkeypatch.setattr("indexers.screening._reached_scores", lambda *a: calls.append(a[2].sum()) or real(*a))
    index = ExactIndex(device="cpu", kernel="bfloat16", block_rows=n)
    if pieces:
        starts = range(0, n, 1000)
        source = index.prepare_blocks(
            lambda: iter([(ids[a : a + 1000], unit16[a : a + 1000], norms[a : a + 1000]) for a in starts])
        )
    else:
        source = index.prepare(ids, unit16, norms)
    scaled = unit16.to(torch.float32).numpy() * norms[:, None]
    expected = ExactIndex(device="cpu", kernel="float32").search(queries, (ids, scaled), 10)
    scores, found = index.search(queries, source, 10)
    assert calls and 0 < int(calls[0]) < n * q // 8  # the per-query path ran, on few pairs
    np.testing.assert_array_equal(found, expected[1])
    np.testing.assert_allclose(scores, expected[0], rtol=1e-6)
    assert all(len(set(row)) == len(row) for row in found.tolist())
