"""The store's API contract: one fit per rows and method, typed errors, methods and options that say what
they do, dense score matrices, and the package's layer contract."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import tomllib
import torch
from tiny_models import tiny_mlp
from torch import nn

import gradstore
import ingest
from gradstore.methods.queries import QueryBatch
from indexers import make_preconditioner

N_TRAIN, N_QUERY = 32, 4
ROOT = Path(__file__).resolve().parents[2]


def _loss(model, x, y):
    return nn.functional.cross_entropy(model(x), y)


def _data(seed: int, n: int):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=generator), torch.randint(0, 3, (n,), generator=generator)


def _capture(store, model, run="run", checkpoint="c0", **options):
    (x, y), (xq, yq) = _data(1, N_TRAIN), _data(2, N_QUERY)
    options = {"k_in": 3, "k_out": 3, **options}
    with store.capture(model, run, checkpoint=checkpoint, learning_rate=0.1, curvature=True, **options) as cap:
        for start in range(0, N_TRAIN, 8):
            cap.set_ids([f"x{i}" for i in range(start, start + 8)])
            _loss(model, x[start : start + 8], y[start : start + 8]).backward()
            model.zero_grad()
        cap.set_split("query")
        cap.set_ids([f"q{i}" for i in range(N_QUERY)])
        _loss(model, xq, yq).backward()
        model.zero_grad()
    return cap


def _filled(path) -> None:
    _capture(gradstore.open(path, storage_dtype="float32"), tiny_mlp())


@pytest.fixture
def filled(built_store, store_path):
    """A copy of a captured float32 store (built once per session), and the model it was captured from."""
    shutil.copytree(built_store("api-filled", _filled), store_path)
    return gradstore.open(store_path), tiny_mlp()


def _rows(store, split):
    block = store.read_gradients("run", checkpoint="c0", split=split)
    return block.metadata.column("example_id").to_pylist(), block.vectors.astype(np.float64), block.grad_ids


def test_layer_contract_holds():
    """ingest/indexers never import gradstore; inside gradstore nothing imports a layer above it."""
    command = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run(
        [str(command), "--config", str(ROOT / "pyproject.toml"), "--no-cache"], capture_output=True, text=True, cwd=ROOT
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 kept, 0 broken" in result.stdout
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (inside,) = [c for c in contracts if c.get("containers") == ["gradstore"]]
    assert len(inside["layers"]) <= 8 and inside["exhaustive"]  # stages, every module in one


def test_one_fit_serves_attribute_self_influence_select_and_index(filled):
    store, _ = filled
    store.attribute(run="run", method="fisher", k=3, write=False)
    assert store.fits.fitted == 1
    store.self_influence(run="run", method="fisher", damping=0.5, write=False)
    store.select(run="run", preconditioner="fisher", budget=4)
    store.build_index("run", method="fisher", damping=0.3)
    store.score_matrix(run="run", method="fisher", damping=0.01)
    assert store.fits.fitted == 1  # every damping and every use re-damped one fit
    reopened = gradstore.open(store.uri)
    reopened.attribute(run="run", method="fisher", k=3, write=False)
    assert reopened.fits.fitted == 0  # read back from the store's side files
    with reopened.writer("run") as writer:
        writer.append(np.ones((1, reopened.dim)), ["late"], checkpoint="c0", split="train")
    reopened.attribute(run="run", method="fisher", k=3, write=False)
    assert reopened.fits.fitted == 1  # rows appended since make the fit stale


def test_ekfac_is_eigen_corrected_kfac(filled):
    store, _ = filled
    ids, g, _ = _rows(store, "train")
    layout = [(s.name, s.offset, s.k_in, s.k_out) for s in store.core.run_spec("run").layers]
    factors = {name: (a, s) for name, (a, s, _) in store.core.load_curvature("run", "c0").items()}
    q_ids, q, _ = _rows(store, "query")
    for method, corrected in (("kfac", False), ("ekfac", True)):
        expected = make_preconditioner(
            "kfac", damping=0.1, kronecker_layout=layout, kronecker_factors=factors, eigen_correction=corrected
        ).fit(g)
        matrix = store.score_matrix(q_ids, run="run", method=method)
        want = expected.apply_query(torch.from_numpy(q)).numpy() @ g.T
        np.testing.assert_allclose(matrix.scores, want, rtol=1e-4, atol=1e-6)
        assert matrix.example_ids == ids
    kfac = store.score_matrix(q_ids, run="run", method="kfac").scores
    ekfac = store.score_matrix(q_ids, run="run", method="ekfac").scores
    assert not np.allclose(kfac, ekfac, rtol=1e-3)
    assert store.build_index("run", method="ekfac").name != store.build_index("run", method="kfac").name


def _inverse(matrix: np.ndarray, damping: float) -> np.ndarray:
    values = np.linalg.eigvalsh(matrix)
    return np.linalg.inv(matrix + damping * values.clip(min=0).mean() * np.eye(len(matrix)))


@pytest.mark.parametrize("blocks", ["full", "layer"])
def test_fisher_block_structure_is_a_choice(filled, blocks):
    store, _ = filled
    _, g, _ = _rows(store, "train")
    q_ids, q, _ = _rows(store, "query")
    spans = [(0, g.shape[1])] if blocks == "full" else [(s.offset, s.size) for s in store.core.run_spec("run").layers]
    inverse = np.zeros((g.shape[1], g.shape[1]))
    for offset, size in spans:
        part = g[:, offset : offset + size]
        inverse[offset : offset + size, offset : offset + size] = _inverse(part.T @ part / len(g), 0.1)
    matrix = store.score_matrix(q_ids, run="run", method="fisher", blocks=blocks)
    want = q @ inverse @ g.T
    np.testing.assert_allclose(matrix.scores, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
    assert matrix.query_ids == q_ids and matrix.torch().shape == (N_QUERY, N_TRAIN)
    with pytest.raises(gradstore.InvalidArgumentError, match="blocks"):
        store.score_matrix(run="run", method="fisher", blocks="diagonal")


def test_score_matrix_grad_dot_equals_numpy_and_writes_nothing(filled):
    store, _ = filled
    ids, g, grad_ids = _rows(store, "train")
    q_ids, q, _ = _rows(store, "query")
    matrix = store.score_matrix(q_ids, run="run", method="grad-dot")
    np.testing.assert_allclose(matrix.scores, q @ g.T, rtol=1e-5, atol=1e-7)
    assert matrix.example_ids == ids and np.array_equal(matrix.grad_ids, grad_ids)
    assert store.count("scores") == 0


def test_curvature_counts_training_rows_only(filled):
    store, _ = filled
    counts = {count for _, _, count in store.core.load_curvature("run", "c0").values()}
    assert counts == {N_TRAIN}  # the query rows captured in the same pass are not counted


def test_run_remembers_its_loss_reduction(store):
    model = tiny_mlp()
    first = _capture(store, model, loss_reduction="sum")
    assert first.capture.config.loss_reduction == "sum"
    later = _capture(store, model, checkpoint="c1")
    assert later.capture.config.loss_reduction == "sum"
    with pytest.raises(gradstore.ProjectionMismatchError) as caught:
        _capture(store, model, checkpoint="c2", k_in=2)
    assert isinstance(caught.value, ingest.ProjectionMismatchError)


def test_non_finite_rows_raise_from_capture_when_asked_to(store):
    model = tiny_mlp()
    _capture(store, model)
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")
    x, y = _data(3, 4)
    capture = store.capture(model, "run", checkpoint="c9", on_nonfinite="raise")
    with pytest.raises(gradstore.NonFiniteGradientError), capture as cap:
        cap.set_ids(["n0", "n1", "n2", "n3"])
        _loss(model, x, y).backward()
    assert store.count("gradients", "checkpoint = 'c9'") == 0


def test_empty_batch_is_a_no_op(store):
    model = tiny_mlp()
    with store.capture(model, "run", k_in=3, k_out=3) as cap:
        x, y = _data(4, 0)
        model(x).sum().backward()
        cap.set_ids(["a", "b"])
        _loss(model, *_data(5, 2)).backward()
    assert store.count() == 2


def test_query_capture_restores_the_models_grads_when_it_fails(filled):
    store, model = filled
    for p in model.parameters():
        p.grad = torch.full_like(p, 7.0)

    def failing_loss(model, batch):
        model(batch).sum().backward()
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        batch = QueryBatch(model, torch.randn(2, 6), ids=["a", "b"], loss_fn=failing_loss)
        store.attribute(batch, run="run", method="grad-dot")
    assert all(torch.equal(p.grad, torch.full_like(p, 7.0)) for p in model.parameters())


def test_one_formatting_style_and_a_clean_lint():
    """The repository is formatted by ``ruff format`` and passes ``ruff check`` (rules in pyproject.toml)."""
    ruff = Path(sys.executable).with_name("ruff")
    if not ruff.exists():
        pytest.skip("ruff is not installed (it comes with the test extra)")
    for arguments in (["format", "--check", "."], ["check", "."]):
        result = subprocess.run([str(ruff), *arguments], capture_output=True, text=True, cwd=ROOT)
        assert result.returncode == 0, result.stdout + result.stderr


def test_repeated_attribute_calls_are_listed_once_by_the_macros(filled):
    store, _ = filled
    store.add_examples([{"example_id": f"x{i}", "source": f"s{i % 2}"} for i in range(N_TRAIN)])
    store.attribute(["q0"], run="run", k=3, method="grad-dot")
    latest = store.attribute(["q0"], run="run", k=5, method="grad-dot")
    assert store.sql("SELECT count(DISTINCT call_id) FROM scores").fetchall() == [(2,)]
    listed = store.sql("SELECT example_id FROM top_proponents('q0', 10)").df().example_id.tolist()
    assert listed == latest.column("example_id").to_pylist()  # the latest call only, each row once
    assert store.count("scores") == 8  # the table keeps every call


def test_a_scores_table_from_before_call_ids_gets_the_column(store):
    import lance

    import gradstore.core.schema as S

    old = pa.schema([f for f in S.SCORES_SCHEMA if f.name != "call_id"], metadata=S.SCORES_SCHEMA.metadata)
    lance.write_dataset(old.empty_table(), f"{store.uri}/{S.SCORES}.lance", schema=old, mode="overwrite")
    reopened = gradstore.open(store.uri)
    model = tiny_mlp()
    _capture(reopened, model)
    table = reopened.attribute(run="run", k=2, method="grad-dot")
    assert "call_id" in reopened.core.table(S.SCORES).schema.names
    assert reopened.sql("SELECT count(DISTINCT call_id), count(*) FROM scores").fetchall() == [(1, table.num_rows)]
