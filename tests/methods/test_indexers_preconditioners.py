"""Each preconditioner == its numpy closed form on small dimensions; re-damping, streaming, save/load."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from indexers import (
    FisherPreconditioner,
    FitStatistics,
    NotFittedError,
    Preconditioner,
    VectorBlocks,
    blocks_from_arrays,
    load_preconditioner,
    make_preconditioner,
)

RNG = np.random.default_rng(0)
# Gradients with very different scales per coordinate, as real per-layer gradients have.
GRADS = RNG.standard_normal((300, 10)) @ RNG.standard_normal((10, 10)) * np.logspace(-3, 0, 10)
QUERIES = RNG.standard_normal((4, 10))
LAYOUT = [("fc1", 0, 2, 3), ("fc2", 6, 4, 1)]  # 2x3 + 1x4 = 10 dims


def chunks(array: np.ndarray, size: int = 37) -> VectorBlocks:
    return blocks_from_arrays(np.arange(len(array)), array, block_rows=size)


def apply(preconditioner: Preconditioner, x: np.ndarray, both: bool = False) -> np.ndarray:
    tensor = torch.from_numpy(x)
    return (preconditioner.apply_both(tensor) if both else preconditioner.apply_query(tensor)).numpy()


def check_inverse(preconditioner: Preconditioner, inverse: np.ndarray) -> None:
    """apply_query == P^-1 q, and apply_both is a symmetric square root of P^-1."""
    np.testing.assert_allclose(apply(preconditioner, QUERIES), QUERIES @ inverse, rtol=1e-9, atol=1e-12)
    root = apply(preconditioner, np.eye(len(inverse)), both=True)
    np.testing.assert_allclose(root, root.T, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(root @ root, inverse, rtol=1e-8, atol=1e-10)


def damped_inverse(matrix: np.ndarray, damping: float) -> np.ndarray:
    return np.linalg.inv(matrix + damping * np.trace(matrix) / len(matrix) * np.eye(len(matrix)))


def block_diagonal(*blocks: np.ndarray) -> np.ndarray:
    out = np.zeros((sum(len(b) for b in blocks),) * 2)
    position = 0
    for block in blocks:
        out[position : position + len(block), position : position + len(block)] = block
        position += len(block)
    return out


def test_identity_and_cosine() -> None:
    identity = make_preconditioner("identity").fit(chunks(GRADS))
    np.testing.assert_array_equal(apply(identity, QUERIES), QUERIES)
    np.testing.assert_array_equal(apply(identity, QUERIES, both=True), QUERIES)
    cosine = make_preconditioner("cosine").fit(np.empty((0, 10)))
    unit = QUERIES / np.linalg.norm(QUERIES, axis=1, keepdims=True)
    np.testing.assert_allclose(apply(cosine, QUERIES), unit)
    np.testing.assert_allclose(apply(cosine, QUERIES, both=True), unit)
    np.testing.assert_array_equal(apply(cosine, np.zeros((1, 10)), both=True), np.zeros((1, 10)))


def test_diagonal_closed_form() -> None:
    diagonal = make_preconditioner("diagonal", damping=0.1).fit(chunks(GRADS))
    check_inverse(diagonal, damped_inverse(np.diag((GRADS**2).mean(0)), 0.1))


def test_fisher_full_closed_form() -> None:
    fisher = make_preconditioner("fisher", damping=0.1).fit(chunks(GRADS))
    check_inverse(fisher, damped_inverse(GRADS.T @ GRADS / len(GRADS), 0.1))


def test_fisher_block_diagonal_closed_form_blocks_in_any_order() -> None:
    fisher = make_preconditioner("fisher", damping=0.3, blocks=[(3, 7), (0, 3)]).fit(chunks(GRADS))
    first, second = GRADS[:, :3], GRADS[:, 3:]
    inverse = block_diagonal(damped_inverse(first.T @ first / 300, 0.3), damped_inverse(second.T @ second / 300, 0.3))
    check_inverse(fisher, inverse)


def kfac_closed_form(factors: dict[str, tuple[np.ndarray, np.ndarray]], damping: float) -> np.ndarray:
    return block_diagonal(*(damped_inverse(np.kron(s, a), damping) for a, s in factors.values()))


def random_spd(size: int, seed: int) -> np.ndarray:
    m = np.random.default_rng(seed).standard_normal((size, size + 2))
    return m @ m.T / (size + 2)


def test_kfac_closed_form_with_given_factors() -> None:
    factors = {"fc1": (random_spd(2, 1), random_spd(3, 2)), "fc2": (random_spd(4, 3), random_spd(1, 4))}
    kfac = make_preconditioner("kfac", damping=0.1, kronecker_layout=LAYOUT, kronecker_factors=factors)
    check_inverse(kfac.fit(np.empty((0, 10))), kfac_closed_form(factors, 0.1))


def gradient_matrices(name: str) -> np.ndarray:
    _, offset, k_in, k_out = next(layer for layer in LAYOUT if layer[0] == name)
    return GRADS[:, offset : offset + k_in * k_out].reshape(-1, k_out, k_in)


def test_kfac_factors_estimated_from_gradients() -> None:
    factors = {}
    for name, *_ in LAYOUT:
        g = gradient_matrices(name)
        a = np.einsum("noi,noj->ij", g, g) / len(g)
        s = np.einsum("noi,npi->op", g, g) / len(g) / np.mean(np.sum(g**2, axis=(1, 2)))
        factors[name] = (a, s)
    kfac = make_preconditioner("kfac", damping=0.2, kronecker_layout=LAYOUT).fit(chunks(GRADS))
    check_inverse(kfac, kfac_closed_form(factors, 0.2))


def test_ekfac_eigenvalue_correction_closed_form() -> None:
    factors = {"fc1": (random_spd(2, 5), random_spd(3, 6)), "fc2": (random_spd(4, 7), random_spd(1, 8))}
    inverses = []
    for name, (a, s) in factors.items():
        basis = np.kron(np.linalg.eigh(s)[1], np.linalg.eigh(a)[1])
        g = gradient_matrices(name).reshape(len(GRADS), -1)
        eigenvalues = ((g @ basis) ** 2).mean(0)
        inverses.append(basis @ np.diag(1 / (eigenvalues + 0.1 * eigenvalues.mean())) @ basis.T)
    kfac = make_preconditioner("kfac", kronecker_layout=LAYOUT, kronecker_factors=factors, eigen_correction=True)
    check_inverse(kfac.fit(chunks(GRADS)), block_diagonal(*inverses))


def test_ekfac_without_factors_reads_the_source_twice() -> None:
    passes = []
    source = chunks(GRADS)

    def counted():
        passes.append(1)
        return source()

    kfac = make_preconditioner("kfac", kronecker_layout=LAYOUT, eigen_correction=True).fit(counted)
    assert len(passes) == 2  # factors from the gradients, then the eigenvalue correction
    np.testing.assert_allclose(apply(kfac, QUERIES), apply(kfac.fit(GRADS), QUERIES), rtol=1e-10)
    # docs/indexers.md: an array or a source, nothing else (it said "a re-iterable such as a list")
    for other in ([GRADS], iter(chunks(GRADS)())):
        with pytest.raises(TypeError, match="expected a VectorBlocks source or a \\[rows, dim\\] array"):
            make_preconditioner("kfac", kronecker_layout=LAYOUT, eigen_correction=True).fit(other)


FITTED_KINDS = [
    ("diagonal", {}),
    ("fisher", {}),
    ("fisher", {"blocks": [(0, 6), (6, 4)]}),
    ("kfac", {"kronecker_layout": LAYOUT}),
    ("kfac", {"kronecker_layout": LAYOUT, "eigen_correction": True}),
]


@pytest.mark.parametrize(("name", "options"), FITTED_KINDS)
def test_redamping_without_refit_equals_refit(name: str, options: dict) -> None:
    fitted = make_preconditioner(name, damping=0.1, **options).fit(chunks(GRADS))
    refit = make_preconditioner(name, damping=2.5, **options).fit(chunks(GRADS))
    redamped = fitted.with_damping(2.5)
    for both in (False, True):
        np.testing.assert_allclose(apply(redamped, QUERIES, both), apply(refit, QUERIES, both), rtol=1e-12)
    assert fitted.damping == 0.1  # the original is unchanged


@pytest.mark.parametrize(("name", "options"), FITTED_KINDS)
def test_streaming_blocks_equal_one_block(name: str, options: dict) -> None:
    streamed = make_preconditioner(name, **options).fit(chunks(GRADS, 7))
    whole = make_preconditioner(name, **options).fit(torch.from_numpy(GRADS))
    np.testing.assert_allclose(apply(streamed, QUERIES), apply(whole, QUERIES), rtol=1e-9)


def fit_sharded(preconditioner: Preconditioner, shards: list[np.ndarray]) -> Preconditioner:
    """What a distributed fit does: each pass's statistics per shard (each on a fresh copy, as a remote
    worker would hold), merged, then finished on the driver."""
    import pickle

    for stage in range(preconditioner.passes):
        parts = [pickle.loads(pickle.dumps(preconditioner)).statistics(chunks(shard, 11), stage) for shard in shards]
        preconditioner.finish(FitStatistics.combine(parts), stage)
    return preconditioner


KFAC_GIVEN = {
    "kronecker_layout": LAYOUT,
    "kronecker_factors": {
        "fc1": (np.diag([1.0, 2.0]), np.diag([3.0, 1.0, 0.5])),
        "fc2": (np.eye(4) * 2.0, np.ones((1, 1))),
    },
}


@pytest.mark.parametrize(
    ("name", "options"),
    [("identity", {}), *FITTED_KINDS, ("kfac", KFAC_GIVEN), ("kfac", {**KFAC_GIVEN, "eigen_correction": True})],
)
def test_sharded_statistics_merged_equal_the_whole_fit(name: str, options: dict) -> None:
    shards = [GRADS[:100], GRADS[100:101], GRADS[101:101], GRADS[101:]]  # uneven, one row, one empty
    sharded = fit_sharded(make_preconditioner(name, **options), shards)
    whole = make_preconditioner(name, **options).fit(chunks(GRADS))
    for both in (False, True):
        np.testing.assert_allclose(apply(sharded, QUERIES, both), apply(whole, QUERIES, both), rtol=1e-10, atol=1e-13)
    assert getattr(sharded, "n_rows", 0) == getattr(whole, "n_rows", 0)


def test_statistics_merge_adds_and_checks_keys() -> None:
    a = FitStatistics(2, {"x": np.array([1.0, 2.0])})
    b = FitStatistics(3, {"x": np.array([0.5, 0.25])})
    merged = FitStatistics.combine([FitStatistics(), a, b, FitStatistics()])
    assert merged.rows == 5 and merged.sums["x"].tolist() == [1.5, 2.25]
    with pytest.raises(ValueError, match="disagree"):
        a.merge(FitStatistics(1, {"y": np.zeros(2)}))
    with pytest.raises(ValueError, match="shapes"):
        a.merge(FitStatistics(1, {"x": np.zeros(3)}))
    with pytest.raises(ValueError, match="zero rows"):
        make_preconditioner("fisher").finish(FitStatistics())


@pytest.mark.parametrize(("name", "options"), [("identity", {}), ("cosine", {}), *FITTED_KINDS])
def test_save_load_round_trip(tmp_path, name: str, options: dict) -> None:
    fitted = make_preconditioner(name, damping=0.4, **options).fit(chunks(GRADS))
    fitted.save(tmp_path / "p")
    loaded = load_preconditioner(tmp_path / "p")
    assert type(loaded) is type(fitted) and loaded.name == name and isinstance(loaded, Preconditioner)
    for both in (False, True):
        np.testing.assert_array_equal(apply(loaded, QUERIES, both), apply(fitted, QUERIES, both))


@pytest.mark.parametrize("eigen_correction", [False, True])
def test_kfac_is_saved_in_float32_and_scores_as_the_float64_fit(tmp_path, eigen_correction: bool) -> None:
    fitted = make_preconditioner("kfac", damping=0.4, kronecker_layout=LAYOUT, eigen_correction=eigen_correction)
    fitted = fitted.fit(chunks(GRADS))
    before = {both: apply(fitted, QUERIES, both) for both in (False, True)}  # float64 bases, as fitted
    fitted.save(tmp_path / "p")
    with np.load(tmp_path / "p" / "state.npz") as state:
        assert {state[key].dtype for key in state.files if key.startswith("q_")} == {np.dtype(np.float32)}
    loaded = load_preconditioner(tmp_path / "p")
    for both in (False, True):
        np.testing.assert_allclose(apply(loaded, QUERIES, both), before[both], rtol=2e-6, atol=1e-7)


def test_dtypes_and_one_dimensional_inputs() -> None:
    fisher = make_preconditioner("fisher").fit(chunks(GRADS.astype(np.float32)))
    half = torch.from_numpy(QUERIES).to(torch.float16)
    assert fisher.apply_query(half).dtype == torch.float32
    np.testing.assert_allclose(fisher.apply_query(half[0]).numpy(), fisher.apply_query(half)[0].numpy(), rtol=1e-6)
    assert fisher.apply_both(torch.from_numpy(QUERIES)).dtype == torch.float64


def test_refusals() -> None:
    with pytest.raises(ValueError, match="unknown preconditioner"):
        make_preconditioner("adam")
    with pytest.raises(ValueError, match="blocks apply"):
        make_preconditioner("diagonal", blocks=[(0, 10)])
    with pytest.raises(ValueError, match="kronecker_layout"):
        make_preconditioner("kfac")
    with pytest.raises(ValueError, match="damping"):
        make_preconditioner("fisher", damping=-1.0)
    with pytest.raises(ValueError, match="tile"):
        make_preconditioner("fisher", blocks=[(0, 4), (5, 5)]).fit(chunks(GRADS))
    with pytest.raises(ValueError, match="cover"):
        make_preconditioner("kfac", kronecker_layout=LAYOUT[:1]).fit(chunks(GRADS))
    with pytest.raises(NotFittedError):
        FisherPreconditioner().apply_query(torch.from_numpy(QUERIES))
