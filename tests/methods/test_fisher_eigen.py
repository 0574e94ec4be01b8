"""A fitted Fisher is applied from its kept (low-rank) eigendecomposition, re-damped without a dense inverse,
saved (float64 eigenvectors below full rank, float32 at it) in at most 5x the bytes of the rows it fits, and scores
as a fresh fit and the closed form do, at every damping."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import gradstore
from indexers import FisherPreconditioner, load_preconditioner, make_preconditioner
from indexers.preconditioner import save_state
from ingest.projection import LayerSlot, ProjectionSpec

DIM = 96
LAYERS = [(0, 48), (48, 48)]
DAMPINGS = [0.003, 0.03, 0.1, 1.0, 10.0]


def gradients(n: int, seed: int = 0) -> np.ndarray:
    """``n`` rows with very different scales per coordinate, as real per-layer gradients have."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, DIM)) @ rng.standard_normal((DIM, DIM)) * np.logspace(-2, 0, DIM) / 10


QUERIES = np.random.default_rng(9).standard_normal((5, DIM))


def closed_form(g: np.ndarray, damping: float, blocks, power: float) -> np.ndarray:
    """``P^-power`` of the damped Fisher of rows ``g``, block-diagonal, by a full eigendecomposition in numpy."""
    out = np.zeros((DIM, DIM))
    for offset, size in blocks or [(0, DIM)]:
        part = g[:, offset : offset + size]
        values, vectors = np.linalg.eigh(part.T @ part / len(g))
        values = values.clip(min=0)
        weights = (values + damping * values.mean()) ** -power
        out[offset : offset + size, offset : offset + size] = (vectors * weights) @ vectors.T
    return out


def apply(preconditioner, x: np.ndarray, both: bool) -> np.ndarray:
    tensor = torch.from_numpy(x)
    return (preconditioner.apply_both(tensor) if both else preconditioner.apply_query(tensor)).numpy()


@pytest.mark.parametrize("n", [40, 300])  # fewer rows than dims (low rank), more
@pytest.mark.parametrize("blocks", [None, LAYERS])
def test_redamped_equals_a_fresh_fit_and_the_closed_form(n, blocks):
    g = gradients(n)
    fitted = make_preconditioner("fisher", damping=0.1, blocks=blocks).fit(g)
    kept = [vectors.shape[1] for vectors in fitted.eigenvectors]
    assert kept == [min(n, size) for _, size in blocks or [(0, DIM)]]
    many = np.random.default_rng(3).standard_normal((2 * DIM, DIM))  # more rows than a block: the dense path
    for damping in DAMPINGS:
        redamped = fitted.with_damping(damping)
        fresh = make_preconditioner("fisher", damping=damping, blocks=blocks).fit(g)
        for both in (False, True):
            expected = QUERIES @ closed_form(g, damping, blocks, 0.5 if both else 1.0)
            np.testing.assert_allclose(
                apply(redamped, QUERIES, both), expected, rtol=1e-7, atol=1e-9 * abs(expected).max()
            )
            np.testing.assert_allclose(apply(redamped, QUERIES, both), apply(fresh, QUERIES, both), rtol=1e-10)
            dense = many @ closed_form(g, damping, blocks, 0.5 if both else 1.0)
            np.testing.assert_allclose(apply(redamped, many, both), dense, rtol=1e-7, atol=1e-9 * abs(dense).max())
    assert fitted.damping == 0.1


def test_low_rank_fit_scores_as_the_full_rank_fit():
    """The same rows' Fisher kept as all ``DIM`` eigenpairs (an old-format fit) and as the top ``n``: equal."""
    g = gradients(40)
    low = make_preconditioner("fisher").fit(g)
    values, vectors = np.linalg.eigh(g.T @ g / len(g))
    full = FisherPreconditioner()
    full.dim, full.n_rows = DIM, len(g)
    full.eigenvalues, full.eigenvectors = [torch.from_numpy(values.clip(min=0))], [torch.from_numpy(vectors)]
    assert low.eigenvectors[0].shape == (DIM, 40)
    for damping in DAMPINGS:
        for both in (False, True):
            np.testing.assert_allclose(
                apply(low.with_damping(damping), QUERIES, both),
                apply(full.with_damping(damping), QUERIES, both),
                rtol=1e-7,
                atol=1e-10,
            )
        float32 = torch.from_numpy(QUERIES.astype(np.float32))
        np.testing.assert_allclose(
            low.with_damping(damping).apply_query(float32).numpy(),
            full.with_damping(damping).apply_query(float32).numpy(),
            rtol=2e-3,
            atol=2e-4 * np.abs(full.with_damping(damping).apply_query(float32).numpy()).max(),
        )


def test_queries_never_build_a_dense_matrix_and_rows_build_one_per_damping(monkeypatch):
    built = []
    original = FisherPreconditioner._matrix

    def counted(self, index, power):
        built.append((self.damping, index, power))
        return original(self, index, power)

    monkeypatch.setattr(FisherPreconditioner, "_matrix", counted)
    fitted = make_preconditioner("fisher", blocks=LAYERS).fit(gradients(300).astype(np.float32))
    queries = torch.from_numpy(QUERIES.astype(np.float32))
    for damping in DAMPINGS:
        for _ in range(3):
            fitted.with_damping(damping).apply_query(queries)
            fitted.with_damping(damping).apply_both(queries)
    assert built == []
    rows = torch.from_numpy(gradients(500, seed=1).astype(np.float32))
    first = fitted.with_damping(0.5).apply_both(rows)
    assert torch.equal(fitted.with_damping(0.5).apply_both(rows), first)
    assert sorted(built) == [(0.5, 0, 0.5), (0.5, 1, 0.5)]  # once per block, for both calls


@pytest.mark.parametrize("n", [40, 300])  # blocks of 48: low rank (float64 eigenvectors), full rank (float32)
def test_save_keeps_low_rank_float64_full_rank_float32_and_loads_to_identical_scores(tmp_path, n):
    g = gradients(n)
    fitted = make_preconditioner("fisher", damping=0.3, blocks=LAYERS).fit(g)
    before = {both: apply(fitted, QUERIES, both) for both in (False, True)}
    fitted.save(tmp_path / "p")
    dtype = np.float64 if n < 48 else np.float32
    with np.load(tmp_path / "p" / "state.npz") as state:
        assert {state[key].dtype for key in state.files if key.startswith("eigenvectors")} == {np.dtype(dtype)}
        assert state["eigenvectors_0"].shape == (48, min(n, 48))
    loaded = load_preconditioner(tmp_path / "p")
    for damping in (0.3, 0.01):
        for x in (QUERIES, QUERIES.astype(np.float32), gradients(200, seed=2).astype(np.float32)):
            for both in (False, True):
                a, b = apply(fitted.with_damping(damping), x, both), apply(loaded.with_damping(damping), x, both)
                np.testing.assert_array_equal(a, b)
    for both in (False, True):  # float32 eigenvectors moved the float64 results by little, float64 ones not at all
        tolerance = 1e-5 if dtype == np.float32 else 1e-12
        np.testing.assert_allclose(
            apply(loaded, QUERIES, both), before[both], rtol=tolerance, atol=tolerance * abs(before[both]).max()
        )


@pytest.mark.parametrize("damping", [1e-1, 1e-2, 1e-3, 1e-4, 1e-5, 1e-6, 1e-7, 1e-8])
def test_low_rank_saved_fit_is_exact_at_small_damping(tmp_path, damping):
    """Fewer rows than dims (the rank-n route): the saved fit's ``P^-1 q`` (float64 and float32 queries) and the
    store's fisher scores equal numpy's float64 ``solve(F + lambda I)`` at every damping. With float32 eigenvectors
    (before) the two terms of the low-rank formula cancelled: 1.9 relative at 1e-6; and float32 ``P^-1 q``
    (before) carried 2^-24 / damping of the score."""
    rng = np.random.default_rng(0)
    n, dim = 20, 128
    g = (rng.standard_normal((n, dim)) * rng.uniform(0.5, 2, (n, 1))).astype(np.float32)
    q = rng.standard_normal((3, dim)).astype(np.float32)
    g64, q64 = g.astype(np.float64), q.astype(np.float64)
    fisher = g64.T @ g64 / n
    want_queries = np.linalg.solve(fisher + damping * np.trace(fisher) / dim * np.eye(dim), q64.T).T
    want = want_queries @ g64.T

    fitted = make_preconditioner("fisher", damping=damping).fit(g)
    fitted.save(tmp_path / "p")
    loaded = load_preconditioner(tmp_path / "p")
    got = loaded.apply_query(torch.from_numpy(q64)).numpy()
    np.testing.assert_allclose(got, want_queries, rtol=1e-6, atol=1e-6 * abs(want_queries).max())
    got32 = loaded.apply_query(torch.from_numpy(q)).numpy()
    np.testing.assert_allclose(got32, want_queries, rtol=1e-5, atol=1e-6 * abs(want_queries).max())

    store = gradstore.open(tmp_path / "store", storage_dtype="float32")
    store.create_run("r", dim=dim)
    with store.writer("r") as writer:
        writer.append(g, [f"t{i}" for i in range(n)], split="train")
    matrix = store.score_matrix(q, run="r", method="fisher", damping=damping, blocks="full")
    scored = matrix.scores[:, np.argsort(matrix.grad_ids)]
    np.testing.assert_allclose(scored, want, rtol=1e-6, atol=1e-6 * abs(want).max())


def test_a_fit_saved_before_float64_every_eigenpair_still_loads(tmp_path):
    g = gradients(40)
    values, vectors = np.linalg.eigh(g.T @ g / len(g))
    config = {"name": "fisher", "damping": 0.1, "blocks": None, "dim": DIM, "n_rows": 40}
    save_state(tmp_path / "old", config, {"eigenvalues_0": values.clip(min=0), "eigenvectors_0": vectors})
    old = load_preconditioner(tmp_path / "old")
    new = make_preconditioner("fisher").fit(g)
    for both in (False, True):
        np.testing.assert_allclose(apply(old, QUERIES, both), apply(new, QUERIES, both), rtol=1e-7, atol=1e-10)


# ------------------------------------------------------------------------------------------------ in a store
def write_store(root: Path, n: int) -> tuple[gradstore.GradStore, np.ndarray]:
    """A store holding ``n`` train rows of two 48-dim layers (float16 unit rows + norms); the rows as read back."""
    store = gradstore.open(root)
    spec = ProjectionSpec(
        0,
        "none",
        tuple(
            LayerSlot(f"l{i}", "linear", 8, 6, None, None, "exact", offset, size, False)
            for i, (offset, size) in enumerate(LAYERS)
        ),
    )
    store.create_run("r", dim=DIM, projection=spec.to_dict())
    store.record_checkpoint("r", "c", step=0)
    with store.writer("r") as writer:
        writer.append(gradients(n).astype(np.float32), [f"e{i}" for i in range(n)], checkpoint="c", split="train")
    block = store.read_gradients("r", checkpoint="c", split="train")
    order = np.argsort(block.grad_ids)
    return store, block.vectors[order].astype(np.float64)


def scores(store, method: str, damping: float, blocks: str) -> np.ndarray:
    matrix = store.score_matrix(QUERIES.astype(np.float32), run="r", method=method, damping=damping, blocks=blocks)
    return matrix.scores[:, np.argsort(matrix.grad_ids)]


def expected_scores(g: np.ndarray, method: str, damping: float, blocks: str) -> np.ndarray:
    spans = LAYERS if blocks == "layer" else None
    q = QUERIES.astype(np.float32).astype(np.float64)
    if method == "fisher":
        return q @ closed_form(g, damping, spans, 1.0) @ g.T
    root = closed_form(g, damping, spans, 0.5)
    unit = lambda x: x / np.linalg.norm(x, axis=1, keepdims=True)  # noqa: E731
    return unit(q @ root) @ unit(g @ root).T


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@pytest.mark.parametrize("n", [40, 300])
def test_store_scores_at_every_damping_and_fit_bytes(tmp_path, n):
    store, g = write_store(tmp_path / "store", n)
    for blocks in ("full", "layer"):
        for method in ("fisher", "trackstar"):
            for damping in (0.01, 0.1, 1.0):
                expected = expected_scores(g, method, damping, blocks)
                got = scores(store, method, damping, blocks)
                np.testing.assert_allclose(got, expected, rtol=2e-3, atol=2e-4 * np.abs(expected).max())
    assert store.fits.fitted == 2  # one fit per block structure, whatever the damping and the method
    fits = directory_bytes(Path(store.fits.store.files.path("fits")))
    rows = directory_bytes(tmp_path / "store" / f"{store.core.gradient_table_name('r')}.lance")
    assert 0 < fits <= 5 * rows, (fits, rows)
    assert fits <= 5 * 2 * 2 * n * DIM  # the two fits together: at most 5x float16 rows each

    again = gradstore.open(tmp_path / "store")  # a new handle: the fits are loaded from their side files
    for blocks in ("full", "layer"):
        for method in ("fisher", "trackstar"):
            np.testing.assert_array_equal(scores(again, method, 0.1, blocks), scores(store, method, 0.1, blocks))
    assert again.fits.fitted == 0


def test_fewer_rows_than_dims_decompose_the_small_gram_matrix_and_parts_merge(monkeypatch):
    """n < size: only n x n matrices are decomposed; statistics of parts (rows stacked in some, summed in others, as
    Ray workers return them) merge to the one-pass fit; repeated rows (rank below n) still equal the closed form."""
    from indexers.preconditioner import FitStatistics

    shapes = []
    eigh = torch.linalg.eigh
    monkeypatch.setattr(torch.linalg, "eigh", lambda m: shapes.append(tuple(m.shape)) or eigh(m))
    g = gradients(30)
    g = np.concatenate([g, g[:10]])  # 40 rows of rank 30
    whole = make_preconditioner("fisher", damping=0.1, blocks=LAYERS).fit(g)
    assert shapes == [(40, 40), (40, 40)]
    assert [vectors.shape[1] for vectors in whole.eigenvectors] == [30, 30]  # the rank, not the row count
    expected = QUERIES @ closed_form(g, 0.1, LAYERS, 1.0)
    np.testing.assert_allclose(apply(whole, QUERIES, both=False), expected, rtol=1e-9, atol=1e-12)
    many = gradients(100, seed=4)  # 100 rows: blocks of 48 sum their Gram matrices; a part of 20 stacks its rows
    fitter = make_preconditioner("fisher", damping=0.1, blocks=LAYERS)
    parts = [fitter.statistics(many[:20]), fitter.statistics(many[20:90]), fitter.statistics(many[90:])]
    assert any(key.startswith("stack_") for key in parts[0].sums) and "gram_0" in parts[1].sums
    merged = make_preconditioner("fisher", damping=0.1, blocks=LAYERS).finish(FitStatistics.combine(parts))
    expected = QUERIES @ closed_form(many, 0.1, LAYERS, 0.5)
    np.testing.assert_allclose(apply(merged, QUERIES, both=True), expected, rtol=1e-9, atol=1e-12)


def test_rows_of_extreme_norm_score_exactly_or_refuse(tmp_path):
    """4 of 40 rows scaled by 1e30 (the writer takes norms up to float32's 3.4e38): ``P^-1 q`` is ~1e-59, below
    float32. The dense scores (float64 throughout) equal numpy's (they were all zero); a float32 search refuses."""
    rng = np.random.default_rng(0)
    g = rng.standard_normal((40, 16)).astype(np.float32)
    g[:4] *= np.float32(1e30)
    q = rng.standard_normal((1, 16)).astype(np.float32)
    store = gradstore.open(tmp_path / "store", storage_dtype="float32")
    store.create_run("r", dim=16)
    with store.writer("r") as writer:
        writer.append(g, [f"t{i}" for i in range(40)], split="train")
    g64 = g.astype(np.float64)
    fisher = g64.T @ g64 / 40
    want = q.astype(np.float64) @ np.linalg.solve(fisher + 0.1 * np.trace(fisher) / 16 * np.eye(16), g64.T)
    matrix = store.score_matrix(q, run="r", method="fisher", damping=0.1, blocks="full")
    got = matrix.scores[:, np.argsort(matrix.grad_ids)]
    assert np.all(got[:, :4] != 0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * abs(want).max())
    with pytest.raises(gradstore.InvalidArgumentError, match=r"float32's range \(the stored rows' norms or the damp"):
        store.attribute(q, run="r", method="fisher", damping=0.1, blocks="full", k=3)
    for damping in (1e300, 1e-300, 0.0):  # beyond what float64 resolves: refused, never scored as zeros
        with pytest.raises(gradstore.InvalidArgumentError, match=r"damping must be a number in \[1e-15, 1e\+15\]"):
            store.attribute(q, run="r", method="fisher", damping=damping, blocks="full", k=3)


@pytest.mark.parametrize("method", ["grad-dot", "fisher"])
def test_a_query_too_small_for_float32_is_refused_naming_the_query(tmp_path, method):
    """Queries of entries ~1e-40 (below float32's normal range) on rows of ordinary norms: a float32 search would
    rank on zeros, so it is refused, and the error names the queries' scale (with grad-dot nothing else scales
    them), not the stored rows' norms; the same queries rescaled are scored."""
    rng = np.random.default_rng(4)
    store = gradstore.open(tmp_path / "store", storage_dtype="float32")
    store.create_run("r", dim=16)
    with store.writer("r") as writer:
        writer.append(rng.standard_normal((40, 16)).astype(np.float32), [f"t{i}" for i in range(40)], split="train")
    q = rng.standard_normal((2, 16)).astype(np.float32)
    tiny = (q * np.float32(1e-40)).astype(np.float32)
    too_small = r"query vector\(s\) \[0, 1\] are too small for float32"
    with pytest.raises(gradstore.InvalidArgumentError, match=too_small) as caught:
        store.attribute(tiny, run="r", method=method, k=3, write=False)
    assert "stored rows' norms" not in str(caught.value) and "Rescale these queries" in str(caught.value)
    rescaled = tiny / np.abs(tiny).max(axis=1, keepdims=True)
    got = store.attribute(rescaled, run="r", method=method, k=3, write=False)
    want = store.attribute(q, run="r", method=method, k=3, write=False)
    assert got.column("example_id").to_pylist() == want.column("example_id").to_pylist()


def test_auto_blocks_of_a_run_written_by_hand_are_one_full_block_at_any_dim(tmp_path):
    """docs/store.md: a run without a projection spec gets one full ``dim x dim`` Fisher block from
    ``blocks="auto"`` whatever its dim (2,100 here, beyond the 2,048 the doc once named), equal to numpy's."""
    rng = np.random.default_rng(5)
    dim = 2100
    g = rng.standard_normal((30, dim)).astype(np.float32)
    q = rng.standard_normal((2, dim)).astype(np.float32)
    store = gradstore.open(tmp_path / "store", storage_dtype="float32")
    store.create_run("r", dim=dim)
    with store.writer("r") as writer:
        writer.append(g, [f"t{i}" for i in range(30)], split="train")
    auto = store.score_matrix(q, run="r", method="fisher", damping=0.1)
    full = store.score_matrix(q, run="r", method="fisher", damping=0.1, blocks="full")
    np.testing.assert_array_equal(auto.scores, full.scores)
    g64 = g.astype(np.float64)
    fisher = g64.T @ g64 / 30
    want = np.linalg.solve(fisher + 0.1 * np.trace(fisher) / dim * np.eye(dim), q.T.astype(np.float64)).T @ g64.T
    got = auto.scores[:, np.argsort([int(e[1:]) for e in auto.example_ids])]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6 * np.abs(want).max())
