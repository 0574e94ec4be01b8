"""True-Fisher curvature for ``kfac``/``ekfac``, and a store's dtype fixed when it is created.

A capture with ``curvature=True`` keeps the Kronecker factors of a checkpoint's training rows and of its
``"true-fisher"`` rows (labels sampled from the model) apart; the store saves both, and ``kfac``/``ekfac`` take
the eigenbasis and the eigenvalues from the true-Fisher rows wherever a checkpoint has them (as ``fisher`` fits on
those rows). The references here are plain numpy: ``A = mean a a^T``, ``S = mean s s^T`` over the tokens of the
batch, ``P = S (x) A`` (row-major ``[k_out, k_in]`` layout), damping 0.1 x the mean eigenvalue.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradstore
from gradstore.core import schema as S
from gradstore.methods import METHODS, TRUE_FISHER_SPLIT
from gradstore.preconditioning.fitting import Selection, fit_spec
from indexers.preconditioner import CONFIG_FILE
from ingest import CaptureConfig, GradientCapture
from ingest.curvature import CURVATURE_SPLITS

RUN = "tf"
CHECKPOINT = "c0"
N_TRAIN, N_QUERY, TOKENS = 24, 3, 5
DAMPING = 0.1


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))


def _data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(N_TRAIN + N_QUERY, TOKENS, 4, generator=generator)
    y = torch.randint(0, 3, (N_TRAIN + N_QUERY, TOKENS), generator=generator)
    return x, y, torch.Generator().manual_seed(2)


class Recorder:
    """The Linear layers' inputs ``[x, 1]`` and output gradients ``dy`` of every backward, per split."""

    def __init__(self, model: nn.Sequential) -> None:
        self.split = "train"
        self.a: dict[tuple[str, str], list[np.ndarray]] = {}
        self.s: dict[tuple[str, str], list[np.ndarray]] = {}
        for name, module in model.named_children():
            if isinstance(module, nn.Linear):
                module.register_forward_hook(self._hook(name))

    def _hook(self, name: str):
        def hook(module, inputs, output):
            (x,) = inputs
            key, ones = (name, self.split), torch.ones(*x.shape[:-1], 1)
            self.a.setdefault(key, []).append(torch.cat([x.detach(), ones], -1).reshape(-1, x.shape[-1] + 1))
            output.register_hook(lambda dy: self.s.setdefault(key, []).append(dy.reshape(-1, dy.shape[-1])))

        return hook

    def factors(self, split: str) -> dict[str, tuple[np.ndarray, np.ndarray, int]]:
        """``layer -> (mean a a^T, mean s s^T, tokens)`` over the recorded batches of ``split`` (float64)."""
        out = {}
        for (name, recorded), parts in self.a.items():
            if recorded == split:
                a = torch.cat(parts).double().numpy()
                s = torch.cat(self.s[(name, split)]).double().numpy()
                out[name] = (a.T @ a / len(a), s.T @ s / len(s), len(a))
        return out


def _passes(model, recorder, cap, x, y, generator, *, train=True, true_fisher=True, queries=True, draws=2):
    """Training rows (observed labels), true-Fisher rows (sampled labels, ``draws`` per example), query rows."""
    ids = [f"x{i:02d}" for i in range(N_TRAIN)]
    for start in range(0, N_TRAIN, 8) if train else ():
        recorder.split = "train"
        cap.set_split("train")
        cap.set_ids(ids[start : start + 8])
        logits = model(x[start : start + 8])
        F.cross_entropy(logits.reshape(-1, 3), y[start : start + 8].reshape(-1), reduction="sum").backward()
        model.zero_grad()
    for _ in range(draws) if true_fisher else ():
        recorder.split = TRUE_FISHER_SPLIT
        cap.set_split(TRUE_FISHER_SPLIT)
        cap.set_ids(ids)
        logits = model(x[:N_TRAIN])
        labels = gradstore.sample_labels(logits, generator=generator)
        F.cross_entropy(logits.reshape(-1, 3), labels.reshape(-1), reduction="sum").backward()
        model.zero_grad()
    if queries:
        recorder.split = "query"
        cap.set_split("query")
        cap.set_ids([f"q{i}" for i in range(N_QUERY)])
        logits = model(x[N_TRAIN:])
        F.cross_entropy(logits.reshape(-1, 3), y[N_TRAIN:].reshape(-1), reduction="sum").backward()
        model.zero_grad()


def _captured(path, *, true_fisher_curvature: bool = True, curvature: bool = True):
    """A float32 store with training, true-Fisher and query rows of one checkpoint (exact slots, sum loss), and the
    recorder's reference factors. ``true_fisher_curvature=False``: the true-Fisher rows come from a second capture
    without ``curvature=True`` (as in a store made before true-Fisher factors were kept)."""
    store = gradstore.open(path, storage_dtype="float32")
    model, (x, y, generator) = _model(), _data()
    recorder = Recorder(model)
    options = {"checkpoint": CHECKPOINT, "projection": None, "loss_reduction": "sum"}
    with store.capture(model, RUN, curvature=curvature, **options) as cap:
        _passes(model, recorder, cap, x, y, generator, true_fisher=true_fisher_curvature)
    if not true_fisher_curvature:
        with store.capture(model, RUN, **options) as cap:
            _passes(model, recorder, cap, x, y, generator, train=False, queries=False)
    return store, recorder


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    return _captured(tmp_path_factory.mktemp("true-fisher") / "store")


def _rows(store, split: str, order: list[str]) -> np.ndarray:
    block = store.core.read_gradients(RUN, checkpoint=CHECKPOINT, split=split)
    position = {e: i for i, e in enumerate(block.metadata.column("example_id").to_pylist())}
    return block.vectors.astype(np.float64)[[position[e] for e in order]]


def _true_fisher_rows(store) -> np.ndarray:
    return store.core.read_gradients(RUN, checkpoint=CHECKPOINT, split=TRUE_FISHER_SPLIT).vectors.astype(np.float64)


def _damped_inverse(basis: np.ndarray, values: np.ndarray) -> np.ndarray:
    values = values.clip(min=0)
    return basis @ np.diag(1.0 / (values + DAMPING * values.mean())) @ basis.T


def _reference_inverse(store, factors, eigen_rows: np.ndarray | None) -> np.ndarray:
    """``(S (x) A + damping)^-1`` per layer (EK-FAC: eigenvalues ``mean (Q^T g)^2`` over ``eigen_rows``)."""
    dim = eigen_rows.shape[1] if eigen_rows is not None else sum(s.size for s in store.core.run_spec(RUN).layers)
    inverse = np.zeros((dim, dim))
    for slot in store.core.run_spec(RUN).layers:
        a, s = factors[slot.name][:2]
        values_a, q_a = np.linalg.eigh(a)
        values_s, q_s = np.linalg.eigh(s)
        basis = np.kron(q_s, q_a)  # row-major [k_out, k_in]: index o * k_in + i
        values = np.kron(values_s.clip(min=0), values_a.clip(min=0))
        if eigen_rows is not None:
            values = ((eigen_rows[:, slot.offset : slot.offset + slot.size] @ basis) ** 2).mean(0)
        span = slice(slot.offset, slot.offset + slot.size)
        inverse[span, span] = _damped_inverse(basis, values)
    return inverse


# ---------------------------------------------------------------------------------------------- capture


def test_capture_keeps_the_true_fisher_factors_apart_and_they_equal_the_reference():
    model, (x, y, generator) = _model(), _data()
    recorder = Recorder(model)
    config = CaptureConfig.from_options(projection=None, curvature=True, loss_reduction="sum", checkpoint="c0")
    with GradientCapture(model, lambda batch: None, config) as cap:
        _passes(model, recorder, cap, x, y, generator)
    for split in CURVATURE_SPLITS:
        got, want = cap.curvature("c0", split), recorder.factors(split)
        assert got.keys() == want.keys() == {"0", "2"}
        for layer, (a, s, count) in want.items():
            assert got[layer][2] == count  # tokens of that split only (the query rows add nothing)
            np.testing.assert_allclose(got[layer][0], a, rtol=1e-6, atol=1e-10)
            np.testing.assert_allclose(got[layer][1], s, rtol=1e-6, atol=1e-12)
    assert cap.curvature("c0", TRUE_FISHER_SPLIT)["2"][2] == 2 * N_TRAIN * TOKENS  # two draws per example
    assert not np.allclose(cap.curvature("c0")["2"][1], cap.curvature("c0", TRUE_FISHER_SPLIT)["2"][1], rtol=0.05)
    with pytest.raises(ValueError, match="query"):
        cap.curvature("c0", "query")


def test_the_store_saves_both_splits_and_keeps_the_old_key_for_training_factors(captured):
    store, recorder = captured
    core = store.core
    for split in CURVATURE_SPLITS:
        assert core.has_curvature(RUN, CHECKPOINT, split)
        saved, want = core.load_curvature(RUN, CHECKPOINT, split), recorder.factors(split)
        for layer, (a, s, count) in want.items():
            assert saved[layer][2] == count
            np.testing.assert_allclose(saved[layer][0], a, rtol=1e-6, atol=1e-10)
            np.testing.assert_allclose(saved[layer][1], s, rtol=1e-6, atol=1e-12)
    old_key = hashlib.sha256(f"{RUN}\0{CHECKPOINT}".encode()).hexdigest()[:32] + ".npz"
    assert core.files.exists("curvature", old_key)  # what stores made before true-Fisher factors hold
    default, train = core.load_curvature(RUN, CHECKPOINT), core.load_curvature(RUN, CHECKPOINT, "train")
    for layer, (a, s, _) in train.items():
        np.testing.assert_array_equal(default[layer][0], a)
        np.testing.assert_array_equal(default[layer][1], s)
    with pytest.raises(gradstore.InvalidArgumentError, match="query"):
        core.load_curvature(RUN, CHECKPOINT, "query")


# ---------------------------------------------------------------------------------------------- scoring


@pytest.mark.parametrize("method", ["kfac", "ekfac"])
def test_kfac_and_ekfac_fit_the_true_fisher_factors(captured, method):
    store, recorder = captured
    matrix = store.score_matrix(run=RUN, queries=[f"q{i}" for i in range(N_QUERY)], method=method)
    g = _rows(store, "train", matrix.example_ids)
    q = _rows(store, "query", matrix.query_ids)
    assert len(matrix.example_ids) == N_TRAIN  # the true-Fisher rows are never scored
    corrected = method == "ekfac"
    fisher_rows = _true_fisher_rows(store)
    want = q @ _reference_inverse(store, recorder.factors(TRUE_FISHER_SPLIT), fisher_rows if corrected else None)
    np.testing.assert_allclose(matrix.scores, want @ g.T, rtol=1e-4, atol=1e-6 * np.abs(want @ g.T).max())
    empirical = q @ _reference_inverse(store, recorder.factors("train"), g if corrected else None) @ g.T
    assert not np.allclose(matrix.scores, empirical, rtol=0.05)  # not the training-label curvature
    mixed = q @ _reference_inverse(store, recorder.factors("train"), fisher_rows if corrected else None) @ g.T
    assert not np.allclose(matrix.scores, mixed, rtol=0.05)  # nor its eigenbasis with true-Fisher eigenvalues
    spec = fit_spec(store.core, Selection(RUN, CHECKPOINT), METHODS[method])
    assert spec.selection.split == TRUE_FISHER_SPLIT and spec.factors == TRUE_FISHER_SPLIT


def test_without_true_fisher_factors_the_training_factors_are_used_with_a_warning(tmp_path):
    """A store whose true-Fisher rows have no factors of their own (captured without curvature=True, or by an
    earlier version) keeps today's answer: the training rows' factors, EK-FAC's eigenvalues on the true-Fisher rows."""
    store, recorder = _captured(tmp_path / "store", true_fisher_curvature=False)
    assert not store.core.has_curvature(RUN, CHECKPOINT, TRUE_FISHER_SPLIT)
    for method in ("kfac", "ekfac"):
        with pytest.warns(UserWarning, match="only the training rows' Kronecker factors"):
            matrix = store.score_matrix(run=RUN, queries=["q0", "q1"], method=method)
        g, q = _rows(store, "train", matrix.example_ids), _rows(store, "query", matrix.query_ids)
        eigen_rows = _true_fisher_rows(store) if method == "ekfac" else None
        want = q @ _reference_inverse(store, recorder.factors("train"), eigen_rows) @ g.T
        np.testing.assert_allclose(matrix.scores, want, rtol=1e-4, atol=1e-6 * np.abs(want).max())
        assert fit_spec(store.core, Selection(RUN, CHECKPOINT), METHODS[method]).factors == "train"


def test_without_curvature_the_factors_are_estimated_from_the_rows_as_the_registry_says(tmp_path):
    """The documented fallback: rows captured without curvature=True get factors estimated from the rows
    (``A = E[G^T G]``, ``S = E[G G^T] / E[|G|^2]``) of the rows the curvature is fitted on (here the true-Fisher
    rows), and the fit records where its factors came from."""
    for method in ("kfac", "ekfac"):
        assert "without them the factors are estimated from the rows" in METHODS[method].requires
    store, _ = _captured(tmp_path / "store", curvature=False)
    assert not any(store.core.has_curvature(RUN, CHECKPOINT, split) for split in CURVATURE_SPLITS)
    fisher_rows = _true_fisher_rows(store)
    estimated = {}
    for slot in store.core.run_spec(RUN).layers:
        grads = fisher_rows[:, slot.offset : slot.offset + slot.size].reshape(-1, slot.k_out, slot.k_in)
        a = np.einsum("noi,noj->ij", grads, grads)
        s = np.einsum("noi,npi->op", grads, grads)
        estimated[slot.name] = (a / len(grads), s / np.trace(a))
    for method in ("kfac", "ekfac"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the documented fallback warns nothing
            matrix = store.score_matrix(run=RUN, queries=["q0", "q1"], method=method)
        g, q = _rows(store, "train", matrix.example_ids), _rows(store, "query", matrix.query_ids)
        want = q @ _reference_inverse(store, estimated, fisher_rows if method == "ekfac" else None) @ g.T
        np.testing.assert_allclose(matrix.scores, want, rtol=1e-4, atol=1e-6 * np.abs(want).max())
        spec = fit_spec(store.core, Selection(RUN, CHECKPOINT), METHODS[method])
        assert spec.factors == "rows"
    assert fit_spec(store.core, Selection(RUN, CHECKPOINT), METHODS["fisher"]).factors is None


# ---------------------------------------------------------------------------------------------- storage dtype


def test_a_store_keeps_the_dtype_it_was_created_with(tmp_path):
    path = tmp_path / "store"
    created = gradstore.open(path, storage_dtype="float32")
    assert created.dims == [] and created.storage_dtype == "float32"
    rank = gradstore.open(path)  # another rank of the job, before any run exists
    assert rank.storage_dtype == "float32"
    vectors = np.random.default_rng(0).standard_normal((6, 8)).astype(np.float32) * 1e-6
    rank.create_run("r", dim=8)
    with rank.writer("r") as writer:
        writer.append(vectors, [f"e{i}" for i in range(6)], checkpoint="c0", split="train")
    block = gradstore.open(path).read_gradients("r", columns=("example_id",))
    order = np.argsort(block.metadata.column("example_id").to_pylist())
    assert block.vectors.dtype == np.float32
    np.testing.assert_array_equal(block.vectors[order], vectors)  # float32 rows, not float16's rounding
    for other in ("float16", "bfloat16"):
        with pytest.raises(gradstore.GradstoreError, match="fixed when it is created"):
            gradstore.open(path, storage_dtype=other)


def test_a_different_dtype_on_an_empty_store_is_refused(tmp_path):
    default = gradstore.open(tmp_path / "default")  # created with the default, float16
    with pytest.raises(gradstore.SchemaMismatchError, match="stores float16 vectors, not float32"):
        gradstore.open(tmp_path / "default", storage_dtype="float32")
    assert gradstore.open(tmp_path / "default", storage_dtype="float16").storage_dtype == default.storage_dtype


def test_an_empty_store_of_an_earlier_version_takes_the_dtype_asked_for(tmp_path, monkeypatch):
    monkeypatch.setattr(S, "runs_schema_of_new_store", lambda dtype: S.RUNS_SCHEMA)  # nothing recorded
    gradstore.open(tmp_path / "old")
    monkeypatch.undo()
    assert gradstore.open(tmp_path / "old").storage_dtype == "float16"
    old = gradstore.open(tmp_path / "old", storage_dtype="bfloat16")
    assert old.storage_dtype == "bfloat16"
    old.create_run("r", dim=4)  # the first run fixes it, as before
    assert gradstore.open(tmp_path / "old").storage_dtype == "bfloat16"
    with pytest.raises(gradstore.SchemaMismatchError):
        gradstore.open(tmp_path / "old", storage_dtype="float32")


@pytest.mark.parametrize("method", ["kfac", "ekfac"])
def test_a_fit_of_recorded_factors_saves_what_it_counts(captured, method):
    """``preconditioner.json`` of a fit of the recorded true-Fisher factors: ``factor_count`` the capture's token
    count, ``n_rows`` the rows the fit read (EK-FAC's eigenvalue pass; none for kfac: ``null``, never a false 0)."""
    store, _ = captured
    store.score_matrix(run=RUN, queries=["q0"], method=method)
    key = fit_spec(store.core, Selection(RUN, CHECKPOINT), METHODS[method]).key()
    config = json.loads((Path(store.fits.store.files.path("fits")) / key / "preconditioner" / CONFIG_FILE).read_text())
    tokens = {count for _, _, count in store.core.load_curvature(RUN, CHECKPOINT, TRUE_FISHER_SPLIT).values()}
    assert config["factor_count"] == tokens.pop() > 0
    assert config["n_rows"] == (len(_true_fisher_rows(store)) if method == "ekfac" else None)
