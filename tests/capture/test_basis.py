"""Curvature-aware projection: per-layer sizes, the K-FAC eigenbasis, exactness of the projected rows against
torch.func per-sample gradients, the basis in the store (round trip, fingerprint, mismatch refusal)."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

import gradstore
from gradstore.core.run_basis import basis_from_run, basis_key, run_basis
from ingest.basis import basis_from_curvature, energy_split, estimate_basis, ranked_rows, side_rows
from ingest.capture import CaptureConfig, GradientCapture, ProjectionConfig
from ingest.misuse import CaptureUsageError
from ingest.projection import ProjectionBasis, ProjectionMismatchError, ProjectionSpec, projection_matrix


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def data(n: int = 40, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g) * torch.linspace(0.2, 2.0, 6), torch.randint(0, 3, (n,), generator=g)


def sum_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1], reduction="sum")


def batches(x: torch.Tensor, y: torch.Tensor, size: int = 10) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(x[i : i + size], y[i : i + size]) for i in range(0, len(x), size)]


def per_sample_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """torch.func per-example gradients of every parameter (float64)."""
    model = model.double()
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, xi, yi):
        return F.cross_entropy(functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0), reduction="sum")

    out = vmap(grad(loss), in_dims=(None, 0, 0))(params, x.double(), y)
    model.float()
    return out


def capture_rows(model: nn.Module, x: torch.Tensor, y: torch.Tensor, **options) -> tuple[ProjectionSpec, torch.Tensor]:
    rows = []
    with GradientCapture(model, rows.append, CaptureConfig.from_options(loss_reduction="sum", **options)) as cap:
        for xb, yb in batches(x, y):
            sum_loss(model, (xb, yb)).backward()
            model.zero_grad()
    return cap.spec, torch.cat([b.grads for b in rows])


def test_sizes_are_capped_at_the_layer_width_and_set_per_layer():
    model = nn.Sequential(nn.Linear(32, 20), nn.Linear(20, 10), nn.Linear(10, 4, bias=False))
    spec = GradientCapture(model, lambda b: None, CaptureConfig.from_options(k_in=16, k_out=16)).spec
    assert [(s.k_in, s.k_out) for s in spec.layers] == [(16, 16), (16, 10), (10, 4)]
    per_layer = {"^1$": (4, 2), "^[12]$": (3, 3)}  # first matching pattern wins
    spec = GradientCapture(
        model, lambda b: None, CaptureConfig.from_options(k_in=16, k_out=16, layer_sizes=per_layer)
    ).spec
    assert [(s.k_in, s.k_out) for s in spec.layers] == [(16, 16), (4, 2), (3, 3)]
    assert spec.dim == 256 + 8 + 9 and [s.offset for s in spec.layers] == [0, 256, 264]
    dense = GradientCapture(
        model, lambda b: None, CaptureConfig.from_options(projection="dense", k_in=16, k_out=16)
    ).spec
    assert [s.size for s in dense.layers] == [256, 160, 40]  # as many dims as the factorized slots
    with pytest.raises(ValueError, match="two positive"):
        GradientCapture(model, lambda b: None, CaptureConfig.from_options(layer_sizes={"0": (0, 3)}))


def test_capped_rows_equal_the_explicit_projection():
    """A layer narrower than k_out is projected with a [d_out, d_out] matrix, exactly as recorded."""
    model = mlp()
    x, y = data()
    spec, rows = capture_rows(model, x, y, k_in=16, k_out=16, seed=3)
    grads = per_sample_grads(model, x, y)
    for slot in spec.layers:
        assert (slot.k_in, slot.k_out) == (slot.d_in_eff, slot.d_out)
        g = torch.cat([grads[f"{slot.name}.weight"], grads[f"{slot.name}.bias"].unsqueeze(-1)], -1)
        p_in = projection_matrix(3, slot.name, "in", slot.k_in, slot.d_in_eff, dtype=torch.float64)
        p_out = projection_matrix(3, slot.name, "out", slot.k_out, slot.d_out, dtype=torch.float64)
        expected = (p_out @ g @ p_in.T).flatten(1)
        torch.testing.assert_close(
            rows[:, slot.offset : slot.offset + slot.size].double(), expected, rtol=1e-4, atol=1e-5
        )


def hand_covariances(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """A = sum [a, 1][a, 1]^T from the layer inputs, S = sum g g^T from per-sample bias gradients (torch.func)."""
    grads = per_sample_grads(model, x, y)
    with torch.no_grad():
        inputs = {"0": x.double(), "2": torch.tanh(model[0](x)).double()}
    out = {}
    for name, a in inputs.items():
        a = torch.cat([a, torch.ones(len(a), 1, dtype=a.dtype)], 1)
        g = grads[f"{name}.bias"]
        out[name] = ((a.T @ a).numpy(), (g.T @ g).numpy())
    return out


def test_estimated_basis_is_the_kfac_eigenbasis():
    model = mlp()
    x, y = data()
    basis = estimate_basis(model, batches(x, y), sum_loss, ProjectionConfig(k_in=4, k_out=2))
    assert all(p.grad is None for p in model.parameters())  # the pre-pass leaves no gradient behind
    for name, (a_cov, s_cov) in hand_covariances(model, x, y).items():
        p_in, p_out = (p.astype(np.float64) for p in basis.matrices[name])
        for p, cov, k in ((p_in, a_cov, 4), (p_out, s_cov, 2)):
            assert p.shape == (k, cov.shape[0])
            np.testing.assert_allclose(p @ p.T, np.eye(k), atol=1e-6)
            top = np.sort(np.linalg.eigvalsh(cov))[::-1][:k]
            np.testing.assert_allclose(p @ cov @ p.T, np.diag(top), rtol=1e-4, atol=1e-6 * top[0])


def test_basis_rows_equal_basis_times_per_sample_gradient():
    """Projected row of layer l = P_out G P_in^T with G = [dW | db] from torch.func, P the stored basis."""
    model = mlp()
    x, y = data()
    basis = estimate_basis(model, batches(x, y), sum_loss, ProjectionConfig(k_in=4, k_out=2))
    grads = per_sample_grads(model, x, y)
    for route in ("project", "materialize"):
        spec, rows = capture_rows(model, x, y, basis=basis, route=route)
        assert spec.basis == basis.digest() and spec.dim == 4 * 2 + 4 * 2
        for slot in spec.layers:
            p_in, p_out = (torch.from_numpy(p).double() for p in basis.matrices[slot.name])
            g = torch.cat([grads[f"{slot.name}.weight"], grads[f"{slot.name}.bias"].unsqueeze(-1)], -1)
            expected = (p_out @ g @ p_in.T).flatten(1)
            torch.testing.assert_close(
                rows[:, slot.offset : slot.offset + slot.size].double(), expected, rtol=1e-4, atol=1e-5
            )


def test_basis_from_curvature_statistics():
    model = mlp()
    x, y = data()
    # exact statistics: the same eigenbasis as the pre-pass (compared as subspace projectors, signs are free)
    stats_rows: list = []
    cfg = CaptureConfig.from_options(projection=None, curvature=True, loss_reduction="sum")
    with GradientCapture(model, stats_rows.append, cfg) as cap:
        for xb, yb in batches(x, y):
            sum_loss(model, (xb, yb)).backward()
            model.zero_grad()
    from_stats = basis_from_curvature(cap.curvature(), cap.spec, k_in=4, k_out=2)
    prepass = estimate_basis(model, batches(x, y), sum_loss, ProjectionConfig(k_in=4, k_out=2))
    for name in ("0", "2"):
        for p, q in zip(from_stats.matrices[name], prepass.matrices[name]):
            np.testing.assert_allclose(p.T @ p, q.T @ q, atol=1e-4)
    # the energy split from the statistics is the pre-pass's (sizes and subspaces)
    from_stats = basis_from_curvature(cap.curvature(), cap.spec, k_in=2, k_out=3, split="energy")
    config = ProjectionConfig(k_in=2, k_out=3)
    prepass = estimate_basis(model, batches(x, y), sum_loss, config, split="energy")
    assert from_stats.sizes("2") == prepass.sizes("2") != (2, 3)  # rank-2 output side of the 3-way head
    for name in ("0", "2"):
        for p, q in zip(from_stats.matrices[name], prepass.matrices[name]):
            np.testing.assert_allclose(p.T @ p, q.T @ q, atol=1e-4)
    # factorized statistics live in projected coordinates: lifted rows R = V^T P diagonalise A exactly
    cfg = CaptureConfig.from_options(
        projection="factorized", k_in=5, k_out=3, curvature=True, loss_reduction="sum", seed=2
    )
    with GradientCapture(model, stats_rows.append, cfg) as cap:
        for xb, yb in batches(x, y):
            sum_loss(model, (xb, yb)).backward()
            model.zero_grad()
    lifted = basis_from_curvature(cap.curvature(), cap.spec, k_in=3, k_out=2)
    hand = hand_covariances(model, x, y)
    for name in ("0", "2"):
        p_in = lifted.matrices[name][0].astype(np.float64)
        projected = p_in @ (hand[name][0] / len(x)) @ p_in.T
        np.testing.assert_allclose(projected, np.diag(np.diag(projected)), atol=1e-5 * projected[0, 0])
        assert np.all(np.diff(np.diag(projected)) <= 1e-9)


def test_random_tail_is_orthogonal_to_the_leading_eigenvectors():
    cov = np.diag(np.arange(8.0, 0.0, -1.0))
    rows = side_rows(cov, 5, 2, seed=0, layer="x", side="in")
    np.testing.assert_allclose(rows @ rows.T, np.eye(5), atol=1e-10)
    np.testing.assert_allclose(np.abs(rows[:3]), np.eye(8)[:3], atol=1e-12)
    assert np.allclose(rows[3:, :3], 0.0)
    assert not np.allclose(rows, side_rows(cov, 5, 2, seed=1, layer="x", side="in"))


def store_capture(store, model, x, y, run="r", split="train", **options):
    with store.capture(model, run, loss_reduction="sum", split=split, **options) as cap:
        for i, (xb, yb) in enumerate(batches(x, y)):
            cap.set_ids([f"{split}{i * 10 + j}" for j in range(len(xb))])
            sum_loss(model, (xb, yb)).backward()
            model.zero_grad()
    return cap


def test_basis_round_trips_through_the_store_and_fixes_later_captures(store_path):
    model = mlp()
    x, y = data()
    basis = estimate_basis(model, batches(x, y), sum_loss, ProjectionConfig(k_in=4, k_out=2))
    store = gradstore.open(store_path, storage_dtype="float32")
    first = store_capture(store, model, x, y, basis=basis)
    assert first.spec.basis == basis.digest()
    assert store.core.files.exists(*basis_key(first.spec))
    reopened = gradstore.open(store_path)
    loaded = run_basis(reopened, "r")
    assert loaded is not None and loaded.digest() == basis.digest()
    for name, pair in basis.matrices.items():
        for a, b in zip(pair, loaded.matrices[name]):
            np.testing.assert_array_equal(a, b)
    assert reopened.core.run_spec("r") == first.spec
    # a query capture that names no basis uses the run's: same spec, same rows as the in-memory basis
    qx, qy = data(10, seed=7)
    query = store_capture(reopened, model, qx, qy, split="query")
    assert query.spec == first.spec
    _, expected = capture_rows(model, qx, qy, basis=basis)
    got = reopened.read_gradients("r", split="query")
    order = np.argsort([int(i[5:]) for i in got.metadata.column("example_id").to_pylist()])
    np.testing.assert_allclose(got.vectors[order], expected.numpy(), rtol=1e-6, atol=1e-7)
    assert (
        run_basis(reopened, "r") is not None and json.loads(reopened.run("r")["projection"])["basis"] == basis.digest()
    )


def test_mismatched_basis_is_refused(store_path):
    model = mlp()
    x, y = data()
    basis = estimate_basis(model, batches(x, y), sum_loss, ProjectionConfig(k_in=4, k_out=2))
    other = estimate_basis(model, batches(*data(seed=5)), sum_loss, ProjectionConfig(k_in=4, k_out=2))
    assert other.digest() != basis.digest()
    store = gradstore.open(store_path, storage_dtype="float32")
    store_capture(store, model, x, y, basis=basis)
    for options in ({"basis": other}, {"basis": None}):
        with pytest.raises(ProjectionMismatchError, match="basis"):
            store_capture(store, model, x, y, split="query", **options)
    # specs without a basis keep their fingerprint (no "basis" key), and the basis field round-trips
    plain = GradientCapture(model, lambda b: None, CaptureConfig.from_options(k_in=4, k_out=2)).spec
    assert "basis" not in plain.to_dict()
    with_basis = store.core.run_spec("r")
    assert ProjectionSpec.from_dict(with_basis.to_dict()) == with_basis
    assert with_basis.fingerprint() != ProjectionSpec(with_basis.seed, with_basis.kind, with_basis.layers).fingerprint()
    # a corrupted basis file is detected by its digest
    with np.load(io.BytesIO(store.core.files.read_bytes(*basis_key(with_basis)))) as stored:
        arrays = dict(stored)
    arrays["0|in"] = arrays["0|in"] * 2
    tampered = io.BytesIO()
    np.savez(tampered, **arrays)
    store.core.files.write_bytes(tampered.getvalue(), *basis_key(with_basis))  # a valid file with other matrices
    with pytest.raises(gradstore.StoreCorruptError, match="digest"):
        run_basis(store, "r")


def test_basis_must_fit_the_layers():
    model = mlp()
    wrong = ProjectionBasis({"0": (np.eye(3, 7), np.eye(2, 5)), "2": (np.eye(3, 5), np.eye(2, 3))})
    with pytest.raises(ValueError, match="layer '2'"):
        GradientCapture(model, lambda b: None, CaptureConfig.from_options(basis=wrong))
    with pytest.raises(ValueError, match="no matrices for layer '2'"):
        GradientCapture(
            model, lambda b: None, CaptureConfig.from_options(basis=ProjectionBasis({"0": wrong.matrices["0"]}))
        )
    with pytest.raises(ValueError, match="factorized"):
        GradientCapture(model, lambda b: None, CaptureConfig.from_options(projection="dense", basis=wrong))


def hand_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, np.ndarray]:
    grads = per_sample_grads(model, x, y)
    return {
        name: torch.cat([grads[f"{name}.weight"], grads[f"{name}.bias"].unsqueeze(-1)], -1).numpy()
        for name in ("0", "2")
    }


def assert_diagonalises(p: np.ndarray, cov: np.ndarray) -> None:
    """Rows of ``p`` are orthonormal top eigenvectors of ``cov``."""
    p = p.astype(np.float64)
    top = np.sort(np.linalg.eigvalsh(cov))[::-1][: len(p)]
    np.testing.assert_allclose(p @ cov @ p.T, np.diag(top), rtol=1e-4, atol=1e-6 * top[0])


def test_gradient_and_unit_factors():
    model = mlp()
    x, y = data()
    config = ProjectionConfig(k_in=4, k_out=2)
    gradient = estimate_basis(model, batches(x, y), sum_loss, config, factors="gradient")
    unit = estimate_basis(model, batches(x, y), sum_loss, config, factors="unit")
    for name, g in hand_gradients(model, x, y).items():  # g: [n, d_out, d_in + 1]
        assert_diagonalises(gradient.matrices[name][0], np.einsum("boi,boj->ij", g, g))
        assert_diagonalises(gradient.matrices[name][1], np.einsum("boi,bpi->op", g, g))
        g = g / np.linalg.norm(g.reshape(len(g), -1), axis=1)[:, None, None]
        assert_diagonalises(unit.matrices[name][0], np.einsum("boi,boj->ij", g, g))
        assert_diagonalises(unit.matrices[name][1], np.einsum("boi,bpi->op", g, g))
    with pytest.raises(ValueError, match="factors"):
        estimate_basis(model, batches(x, y), sum_loss, config, factors="hessian")


def test_energy_split_keeps_the_bytes_and_moves_dims_past_a_spectral_cliff():
    flat = np.ones(8)
    assert energy_split(flat, np.ones(8), 4, 4) == (4, 4)  # all splits keep 16 of 64: the requested one stays
    assert energy_split(flat, np.array([1.0, 1.0, 0.0, 0.0]), 2, 4) == (4, 2)  # rank-2 output side
    assert energy_split(np.array([4.0, 3, 2, 1]), np.array([5.0, 4, 0]), 2, 2) == (2, 2)
    assert energy_split(np.array([4.0, 3, 2, 1]), np.array([9.0, 1, 0]), 2, 2) == (4, 1)  # 10 * 9 > 7 * 10


def test_energy_split_basis_maximises_the_kept_kronecker_energy():
    """factors="gradient", split="energy": per layer, among the splits with k_in * k_out equal to the
    requested one, the kept energy sum(top k_in eig E[G^T G]) * sum(top k_out eig E[G G^T]) is the largest
    (brute force from torch.func per-sample gradients), and the rows are those partial traces' eigenvectors."""
    model = mlp()
    x, y = data()
    config = ProjectionConfig(k_in=2, k_out=3)
    basis = estimate_basis(model, batches(x, y), sum_loss, config, factors="gradient", split="energy")
    fixed = estimate_basis(model, batches(x, y), sum_loss, config, factors="gradient")
    assert {name: fixed.sizes(name) for name in fixed.matrices} == {"0": (2, 3), "2": (2, 3)}
    for name, g in hand_gradients(model, x, y).items():
        a_cov, s_cov = np.einsum("boi,boj->ij", g, g), np.einsum("boi,bpi->op", g, g)
        a, s = (np.cumsum(np.sort(np.linalg.eigvalsh(c))[::-1]) for c in (a_cov, s_cov))
        splits = [(i, 6 // i) for i in range(1, len(a) + 1) if 6 % i == 0 and 6 // i <= len(s)]
        best = max(a[i - 1] * s[o - 1] for i, o in splits)
        k_in, k_out = basis.sizes(name)
        assert k_in * k_out == 6 and a[k_in - 1] * s[k_out - 1] == pytest.approx(best, rel=1e-6)
        assert_diagonalises(basis.matrices[name][0], a_cov)
        assert_diagonalises(basis.matrices[name][1], s_cov)
    assert basis.sizes("2")[1] < 3  # the 3-way head's output gradients have rank 2: dims move to the input
    with pytest.raises(ValueError, match="split"):
        estimate_basis(model, batches(x, y), sum_loss, config, split="greedy")


def test_several_losses_per_batch_sum_their_second_moments():
    """A loss vector: every entry is backpropagated alone, so S sums over entries (here: two labels)."""
    model = mlp()
    x, y = data()

    def two_labels(model, batch):
        logits = model(batch[0])
        return torch.stack(
            [
                F.cross_entropy(logits, batch[1], reduction="sum"),
                F.cross_entropy(logits, (batch[1] + 1) % 3, reduction="sum"),
            ]
        )

    basis = estimate_basis(model, batches(x, y, size=1), two_labels, ProjectionConfig(k_in=4, k_out=2))
    s_cov = sum(hand_covariances(model, x, labels)["2"][1] for labels in (y, (y + 1) % 3))
    assert_diagonalises(basis.matrices["2"][1], s_cov)


def test_per_layer_sizes_are_remembered_by_the_run(store_path):
    model = mlp()
    x, y = data()
    store = gradstore.open(store_path, storage_dtype="float32")
    first = store_capture(store, model, x, y, layer_sizes={"^2$": (3, 2)}, k_in=4, k_out=4)
    assert [(s.k_in, s.k_out) for s in first.spec.layers] == [(4, 4), (3, 2)]
    later = store_capture(gradstore.open(store_path), model, x, y, split="query")
    assert later.spec == first.spec
    with pytest.raises(ProjectionMismatchError, match="k_in"):
        store_capture(store, model, x, y, split="query", layer_sizes={"^2$": (2, 2)})


@pytest.mark.parametrize("factors", ["gradient", "unit"])
def test_embedding_gradient_factors_equal_per_sample_gradients(factors):
    """Embeddings: the diagonal of E[G^T G] picks the input rows, E[G G^T] the output rows, with repeated tokens."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(9, 4), nn.Linear(4, 3))
    ids = torch.tensor([[1, 2, 1, 5], [3, 3, 3, 0], [7, 1, 2, 2], [4, 6, 8, 1]])
    targets = torch.randint(0, 3, (4, 4), generator=torch.Generator().manual_seed(1))

    def loss(m, batch):
        return F.cross_entropy(m(batch[0]).reshape(-1, 3), batch[1].reshape(-1), reduction="sum")

    basis = estimate_basis(
        model,
        [(ids[:2], targets[:2]), (ids[2:], targets[2:])],
        loss,
        ProjectionConfig(k_in=3, k_out=2, include="^0$"),
        factors=factors,
        layers="all",
        select="energy",
    )
    params = {k: v.detach() for k, v in model.named_parameters()}

    def one(p, i, t):
        return F.cross_entropy(functional_call(model, p, (i.unsqueeze(0),)).reshape(-1, 3), t, reduction="sum")

    g = vmap(grad(one), in_dims=(None, 0, 0))(params, ids, targets)["0.weight"].transpose(1, 2).double()  # [b, 4, 9]
    if factors == "unit":
        g = g / g.flatten(1).norm(dim=1).view(-1, 1, 1)
    diagonal = torch.einsum("boi,boi->i", g, g).numpy()
    p_in, p_out = basis.matrices["0"]
    np.testing.assert_array_equal(p_in, np.eye(9)[np.argsort(-diagonal, kind="stable")[:3]])
    assert_diagonalises(p_out, torch.einsum("boi,bpi->op", g, g).numpy())


def test_basis_from_a_runs_curvature_statistics(store_path):
    """A run captured with curvature=True (exact rows) gives the same eigenbasis as the pre-pass."""
    model = mlp()
    x, y = data()
    store = gradstore.open(store_path, storage_dtype="float32")
    store_capture(store, model, x, y, run="stats", projection=None, curvature=True, checkpoint="c0")
    from_run = basis_from_run(store, "stats", "c0", k_in=4, k_out=2)
    prepass = estimate_basis(model, batches(x, y), sum_loss, ProjectionConfig(k_in=4, k_out=2))
    for name in ("0", "2"):
        for p, q in zip(from_run.matrices[name], prepass.matrices[name]):
            np.testing.assert_allclose(p.T @ p, q.T @ q, atol=1e-4)


def tiny_lm() -> nn.Sequential:
    """Embedding (vocabulary 9) -> hidden linear -> unembedding (9 outputs), fed sequences."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(9, 6), nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 9))


def lm_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 9, (8, 5), generator=g)
    return [(ids[:4, :-1], ids[:4, 1:]), (ids[4:, :-1], ids[4:, 1:])]


def lm_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]).reshape(-1, 9), batch[1].reshape(-1), reduction="sum")


def assert_orthonormal(p: np.ndarray) -> None:
    p = p.astype(np.float64)
    np.testing.assert_allclose(p @ p.T, np.eye(len(p)), atol=1e-5)


def test_layers_option_keeps_the_capture_random_projection_where_asked():
    """``layers=``: which sides keep the seeded random rows (exactly the capture's), the rest the eigenbasis."""
    model, config = tiny_lm(), ProjectionConfig(k_in=3, k_out=4, seed=7)
    bases = {
        layers: estimate_basis(model, lm_batches(), lm_loss, config, factors="gradient", layers=layers)
        for layers in ("all", "non-token", "single-position")
    }

    def random(name: str, side: str, k: int, d: int) -> np.ndarray:
        return projection_matrix(7, name, side, k, d).numpy()

    shapes = {"0": (9, 6), "1": (7, 5), "3": (6, 9)}  # (d_in (+1 bias), d_out) per layer
    for name in shapes:
        for p in bases["all"].matrices[name]:
            assert_orthonormal(p)  # eigenvectors (the random rows are not orthonormal)
    expected_random = {  # (input side, output side) random under each option
        "non-token": {"0": (True, False), "1": (False, False), "3": (False, True)},  # embedding ids, vocabulary
        "single-position": {"0": (True, True), "1": (True, True), "3": (True, True)},  # all fed sequences
    }
    for layers, sides in expected_random.items():
        for name, flags in sides.items():
            for side, p, eigen, is_random, d in zip(
                ("in", "out"), bases[layers].matrices[name], bases["all"].matrices[name], flags, shapes[name]
            ):
                if is_random:
                    np.testing.assert_array_equal(p, random(name, side, len(p), d))
                else:
                    np.testing.assert_array_equal(p, eigen)
    # an all-random basis gives the rows of a capture without a basis (same seed)
    rows = {}
    for key, options in (("basis", {"basis": bases["single-position"]}), ("seeded", {})):
        captured: list = []
        cfg = CaptureConfig.from_options(k_in=3, k_out=4, seed=7, loss_reduction="sum", **options)
        with GradientCapture(model, captured.append, cfg):
            for batch in lm_batches():
                lm_loss(model, batch).backward()
                model.zero_grad()
        rows[key] = torch.cat([b.grads for b in captured])
    torch.testing.assert_close(rows["basis"], rows["seeded"], rtol=1e-4, atol=1e-6)


def test_default_is_the_energy_eigenbasis_of_single_position_layers_and_influence_on_sequences():
    """A classifier MLP sees one position per example and has no token side: the default is the top
    eigenvectors of every layer. A language model's layers see sequences: ``select="influence"``."""
    model = mlp()
    x, y = data()
    config = ProjectionConfig(k_in=4, k_out=2)
    default = estimate_basis(model, batches(x, y), sum_loss, config)
    every = estimate_basis(model, batches(x, y), sum_loss, config, layers="all", select="energy")
    assert default.digest() == every.digest()
    lm, lm_config = tiny_lm(), ProjectionConfig(k_in=3, k_out=4)
    auto = estimate_basis(lm, lm_batches(), lm_loss, lm_config, factors="gradient")
    influence = estimate_basis(lm, lm_batches(), lm_loss, lm_config, factors="gradient", select="influence")
    energy = estimate_basis(lm, lm_batches(), lm_loss, lm_config, factors="gradient", select="energy")
    assert auto.digest() == influence.digest() != energy.digest()
    with pytest.raises(CaptureUsageError, match="layers must be one of"):
        estimate_basis(model, batches(x, y), sum_loss, config, layers="rare")


def test_mixed_basis_holds_the_top_eigenvectors_and_a_random_complement():
    """``tail=k//2``: the first half of each side's rows are its top eigenvectors, the rest orthogonal to them."""
    model = mlp()
    x, y = data()
    basis = estimate_basis(model, batches(x, y), sum_loss, ProjectionConfig(k_in=4, k_out=2), tail=2)
    full = estimate_basis(model, batches(x, y), sum_loss, ProjectionConfig(k_in=4, k_out=2))
    for name in ("0", "2"):
        for p, top in zip(basis.matrices[name], full.matrices[name]):
            p, top = p.astype(np.float64), top.astype(np.float64)
            assert_orthonormal(p)
            kept = len(p) - min(2, len(p))
            np.testing.assert_allclose(np.abs(p[:kept]), np.abs(top[:kept]), atol=1e-6)  # signs are free
            np.testing.assert_allclose(p[kept:] @ top[:kept].T, 0.0, atol=1e-6)


def test_influence_selection_keeps_the_directions_a_damped_inverse_weighs_most():
    """``select="influence"``: eigenvectors ranked by l / (l + delta)^2, delta = damping * mean eigenvalue."""
    values = np.array([100.0, 10.0, 3.0, 1.0, 0.3, 0.0])
    rotation = np.linalg.qr(np.random.default_rng(0).standard_normal((6, 6)))[0]
    cov = rotation @ np.diag(values) @ rotation.T
    delta = 0.1 * values.mean()  # 1.905
    weights, rows = ranked_rows(cov, "influence", damping=0.1)
    expected = np.argsort(-(values / (values + delta) ** 2), kind="stable")
    assert expected.tolist() == [2, 3, 1, 4, 0, 5]  # l = 3 and 1, near delta, before the top direction l = 100
    np.testing.assert_allclose(weights, (values / (values + delta) ** 2)[expected], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(np.abs(rows @ rotation), np.eye(6)[expected], atol=1e-9)  # the eigenvectors
    assert ranked_rows(cov)[0].tolist() == pytest.approx(values.tolist(), abs=1e-9)  # "energy": by eigenvalue
    # through the pre-pass: orthonormal eigenvectors of each side, those of the largest weights
    model = mlp()
    x, y = data()
    config = ProjectionConfig(k_in=3, k_out=2)
    basis = estimate_basis(model, batches(x, y), sum_loss, config, select="influence", damping=0.5)
    for name, (a_cov, s_cov) in hand_covariances(model, x, y).items():
        for p, cov in zip(basis.matrices[name], (a_cov, s_cov)):
            p = p.astype(np.float64)
            assert_orthonormal(p)
            eig = np.clip(np.linalg.eigvalsh(cov), 0.0, None)
            weight = eig / (eig + 0.5 * eig.mean()) ** 2
            kept = np.diag(p @ cov @ p.T)  # each row's eigenvalue
            np.testing.assert_allclose(p @ cov @ p.T, np.diag(kept), atol=1e-5 * eig.max())
            kept_weight = kept / (kept + 0.5 * eig.mean()) ** 2
            np.testing.assert_allclose(kept_weight, np.sort(weight)[::-1][: len(p)], rtol=1e-3)
    with pytest.raises(CaptureUsageError, match="select must be one of"):
        estimate_basis(model, batches(x, y), sum_loss, config, select="rare")
    with pytest.raises(CaptureUsageError, match="damping must be a finite number > 0"):
        estimate_basis(model, batches(x, y), sum_loss, config, select="influence", damping=0.0)
