"""The Ray engine equals the in-process path (same ids, same tie order, scores within float tolerance) for
exact top-k, opponents, self-influence, LESS selection, TracIn and fits; shards partition the rows."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch
from torch import nn

import gradstore
from gradstore.core.engine import LocalEngine, RayEngine, resolve_engine
from gradstore.core.shards import example_shards, fragment_shards
from gradstore.methods import summed

ray = pytest.importorskip("ray")

DIM, ROWS_PER_CHECKPOINT, EXAMPLES = 8, 420, 150
RATES = {"c0": 0.5, "c1": 0.25, "c2": 0.125}  # powers of two: TracIn sums of integer scores stay exact


@pytest.fixture(scope="module")
def integers(tmp_path_factory):
    """Small-integer rows (exact float32 scores, many ties) over 3 checkpoints in many fragments; several
    rows per example per checkpoint; 4 query rows per checkpoint."""
    store = gradstore.open(tmp_path_factory.mktemp("ints") / "store", storage_dtype="float32")
    store.create_run("ints", dim=DIM)
    rng = np.random.default_rng(0)
    with store.writer("ints", commit_rows=64) as writer:
        for step, (checkpoint, rate) in enumerate(RATES.items()):
            rows = rng.integers(-2, 3, (ROWS_PER_CHECKPOINT, DIM)).astype(np.float32)
            ids = [f"e{i:03d}" for i in rng.integers(0, EXAMPLES, ROWS_PER_CHECKPOINT)]
            for start in range(0, ROWS_PER_CHECKPOINT, 70):
                writer.append(rows[start : start + 70], ids[start : start + 70], checkpoint=checkpoint, split="train")
            writer.append(
                rng.integers(-2, 3, (4, DIM)).astype(np.float32),
                [f"q{i}" for i in range(4)],
                checkpoint=checkpoint,
                split="query",
            )
            store.record_checkpoint("ints", checkpoint, step=step, learning_rate=rate)
    assert len(store.core.table("gradients").to_lance().get_fragments()) > 6
    return store


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    """A tiny model captured with a factorized projection (float16 storage) at two checkpoints, in several
    fragments, with curvature for kfac."""
    store = gradstore.open(tmp_path_factory.mktemp("captured") / "store")
    model = _model()
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(240, 6, generator=generator), torch.randint(0, 4, (240,), generator=generator)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for checkpoint, lr in {"a": 0.2, "b": 0.1}.items():
        with store.capture(
            model,
            "run",
            checkpoint=checkpoint,
            learning_rate=lr,
            k_in=2,
            k_out=2,
            curvature=True,
            writer=gradstore.WriterConfig(commit_rows=40),
        ) as cap:
            for start in range(0, 240, 24):
                cap.set_ids([f"x{i:03d}" for i in range(start, start + 24)])
                nn.functional.cross_entropy(model(x[start : start + 24]), y[start : start + 24]).backward()
                model.zero_grad()
            cap.set_split("query")
            cap.set_ids([f"q{i}" for i in range(5)])
            nn.functional.cross_entropy(model(x[:5] + 0.3), y[:5]).backward()
            model.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return store


def _same(local: pa.Table, remote: pa.Table, rtol: float = 1e-5) -> None:
    """Same rows in the same order; scores within float tolerance."""
    assert local.num_rows == remote.num_rows > 0
    for name in local.column_names:
        if name in ("score", "self_influence"):
            np.testing.assert_allclose(
                remote.column(name).to_numpy(), local.column(name).to_numpy(), rtol=rtol, atol=1e-6
            )
        elif name != "created_at":
            assert remote.column(name).to_pylist() == local.column(name).to_pylist(), name


def test_exact_top_k_and_opponents_with_ties_equal_brute_force(integers, ray_engine):
    store = integers
    local = store.attribute(run="ints", k=7, checkpoint="c1", opponents=True, write=False, method="grad-dot")
    remote = store.attribute(
        run="ints", k=7, checkpoint="c1", opponents=True, write=False, engine=ray_engine, method="grad-dot"
    )
    _same(local, remote, rtol=0)
    block = store.read_gradients("ints", checkpoint="c1", split="train")
    queries = store.read_gradients("ints", checkpoint="c1", split="query")
    scores = queries.vectors.astype(np.float64) @ block.vectors.astype(np.float64).T
    frame = remote.to_pandas()
    for row, query_id in enumerate(queries.metadata.column("example_id").to_pylist()):
        for largest in (True, False):
            order = np.lexsort((block.grad_ids, -scores[row] if largest else scores[row]))[:7]
            got = frame[(frame.query_id == query_id) & ((frame["rank"] > 0) == largest)]
            assert got.grad_id.tolist() == block.grad_ids[order].tolist()  # ties: the smaller grad_id first
            assert len(set(scores[row][order])) < 7  # the data does tie at the cut


def test_tracin_streams_per_example_range_and_equals_the_dense_sum(integers, ray_engine, monkeypatch):
    store = integers
    reference = store.attribute(run="ints", method="tracin", k=6, opponents=True, write=False)
    monkeypatch.setattr(summed, "EXAMPLES_PER_TASK", 11)  # many example ranges in-process too
    ranged = store.attribute(run="ints", method="tracin", k=6, opponents=True, write=False)
    remote = store.attribute(run="ints", method="tracin", k=6, opponents=True, write=False, engine=ray_engine)
    _same(reference, ranged, rtol=0)
    _same(reference, remote, rtol=0)
    dense: dict[str, np.ndarray] = {}
    for checkpoint, rate in RATES.items():
        train = store.read_gradients("ints", checkpoint=checkpoint, split="train")
        query = store.read_gradients("ints", checkpoint=checkpoint, split="query").vectors.astype(np.float64)
        for example_id, row in zip(train.metadata.column("example_id").to_pylist(), train.vectors):
            dense[example_id] = dense.get(example_id, 0) + rate * query @ row.astype(np.float64)
    ids = sorted(dense)
    matrix = np.stack([dense[i] for i in ids], axis=1)
    frame = remote.to_pandas()
    for row in range(4):
        order = np.lexsort((ids, -matrix[row]))[:6]
        got = frame[(frame.query_id == f"q{row}") & (frame["rank"] > 0)]
        assert got.example_id.tolist() == [ids[i] for i in order]
        np.testing.assert_array_equal(got.score.to_numpy(), matrix[row][order])


@pytest.mark.parametrize(
    ("method", "blocks"),
    [("fisher", "full"), ("fisher", "layer"), ("kfac", "auto"), ("ekfac", "auto"), ("cosine", "auto")],
)
def test_attribute_on_ray_equals_in_process(captured, ray_engine, method, blocks):
    local = captured.attribute(run="run", k=5, method=method, blocks=blocks, opponents=True, write=False)
    refit = captured.attribute(
        run="run", k=5, method=method, blocks=blocks, opponents=True, write=False, engine=ray_engine
    )
    _same(local, refit)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_rows_searched_as_stored_on_ray_equal_in_process(tmp_path, ray_engine, dtype):
    """Workers score unit rows as stored (upcast tile by tile, times their norms after the product), like the
    in-process exact search; rows spread over several fragments and norms over six orders of magnitude."""
    store = gradstore.open(tmp_path / "store", storage_dtype=dtype)
    store.create_run("r", dim=300)
    rng = np.random.default_rng(3)
    rows = rng.standard_normal((900, 300)).astype(np.float32) * np.logspace(-3, 3, 900, dtype=np.float32)[:, None]
    with store.writer("r", commit_rows=200) as writer:
        for start in range(0, 900, 150):
            writer.append(
                rows[start : start + 150], [f"e{i}" for i in range(start, start + 150)], checkpoint="c", split="train"
            )
    queries = rng.standard_normal((6, 300)).astype(np.float32)
    local = store.attribute(queries, run="r", k=9, opponents=True, write=False, method="grad-dot")
    remote = store.attribute(queries, run="r", k=9, opponents=True, write=False, engine=ray_engine, method="grad-dot")
    _same(local, remote)
    decoded = store.read_gradients("r", checkpoint="c", columns=()).vectors.astype(np.float64)
    best = np.argsort(-(queries.astype(np.float64) @ decoded.T), axis=1)[:, :9]
    frame = remote.to_pandas()
    for row in range(6):
        got = frame[(frame.query_id == frame.query_id.unique()[row]) & (frame["rank"] > 0)]
        assert got.example_id.tolist() == [f"e{i}" for i in best[row]]


def test_a_fit_on_ray_equals_the_in_process_fit(captured, ray_engine):
    from gradstore.methods import resolve_method
    from gradstore.preconditioning.fitting import Selection, fit_spec

    spec = fit_spec(captured.core, Selection("run", "b"), resolve_method("ekfac"))
    local = captured.fits.get(spec, 0.1, refit=True)
    remote = captured.fits.get(spec, 0.1, refit=True, engine=ray_engine)
    probe = torch.randn(3, captured.dim, dtype=torch.float64)
    torch.testing.assert_close(remote.apply_query(probe), local.apply_query(probe), rtol=1e-9, atol=1e-12)


def test_self_influence_and_selection_on_ray_equal_in_process(captured, ray_engine):
    for method in ("fisher", "kfac", "grad-dot"):
        local = captured.self_influence(run="run", method=method, write=False)
        _same(local, captured.self_influence(run="run", method=method, write=False, engine=ray_engine))
    for preconditioner, aggregate in (("grad-dot", "max"), ("fisher", "mean")):
        local = captured.select(run="run", budget=0.2, preconditioner=preconditioner, aggregate=aggregate)
        remote = captured.select(
            run="run", budget=0.2, preconditioner=preconditioner, aggregate=aggregate, engine=ray_engine
        )
        _same(local, remote)


def test_build_index_and_cli_on_ray(captured, ray_engine, tmp_path):
    from typer.testing import CliRunner

    from gradstore.cli import app

    index = captured.build_index("run", method="fisher", refit=True, engine=ray_engine)
    assert index.manifest["rows"] == 240
    queries = captured.read_gradients("run", checkpoint="b", split="query").vectors
    kinds = (("Flat", "flat"), ("IVF2,Flat", "ivf"), ("IVF4,SQ8", "ivf-sq8"), ("HNSW8,Flat", "hnsw"))
    for kind, label in kinds:
        local = captured.build_index("run", method="fisher", kind=kind, name=f"local-{label}", refit=True)
        remote = captured.build_index(
            "run", method="fisher", kind=kind, name=f"ray-{label}", refit=True, engine=ray_engine
        )
        assert len(remote.selection.shards(captured.core, ray_engine.parallelism)) > 1  # rows added by several tasks
        # (HNSW graphs cannot be merged: their rows are added here, in dataset order too)
        assert remote.indexed_ids.tolist() == local.indexed_ids.tolist()  # shards merged in dataset order
        for got, want in zip(remote.search(queries, 4), local.search(queries, 4)):
            np.testing.assert_allclose(got, want, rtol=1e-5)
        reloaded = captured.index(f"ray-{label}")
        np.testing.assert_array_equal(reloaded.search(queries, 4)[1], local.search(queries, 4)[1])
    result = CliRunner().invoke(app, ["attribute", captured.uri, "--run", "run", "-k", "3", "--engine", "ray"])
    assert result.exit_code == 0, result.output
    assert result.output.count("fisher") == 15  # 5 queries x 3


def test_shards_partition_the_rows(integers):
    store = integers
    where = "split = 'train'"
    every = sorted(store.read_gradients("ints", split="train").grad_ids.tolist())
    for parts in (1, 3, 50):
        by_fragment = [b.grad_ids for s in fragment_shards(store.core, "ints", where, parts) for b in s.blocks()]
        assert sorted(np.concatenate(by_fragment).tolist()) == every
        shards = example_shards(store.core, "ints", where, where, parts)
        assert 1 <= len(shards) <= parts
        seen: list[set[str]] = []
        for shard in shards:
            seen.append({e for b in shard.blocks() for e in b.metadata.column("example_id").to_pylist()})
        assert sum(len(s) for s in seen) == len(set().union(*seen)) == EXAMPLES  # disjoint, covering
        rows = [g for s in shards for b in s.blocks() for g in b.grad_ids.tolist()]
        assert sorted(rows) == every


def test_engine_names():
    assert isinstance(resolve_engine("local"), LocalEngine)
    assert isinstance(resolve_engine("ray", "ray://nowhere:1"), RayEngine)
    with pytest.raises(gradstore.InvalidArgumentError, match="engine must be one of"):
        resolve_engine("spark")
    with pytest.raises(gradstore.InvalidArgumentError, match="applies to engine='ray'"):
        resolve_engine("local", "ray://nowhere:1")


def test_ray_engine_on_object_storage_equals_the_local_path(ray_engine, s3_bucket):
    """Ray workers read the fragments of an S3 store with the store's own credentials and endpoint."""
    bucket, options = s3_bucket
    store = gradstore.open(f"s3://{bucket}/store", storage_options=options)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
    x, y = torch.randn(20, 5), torch.randint(0, 3, (20,))
    with store.capture(model, "run", k_in=4, k_out=2) as cap:
        for start in range(0, 20, 5):
            cap.set_ids([f"x{i}" for i in range(start, start + 5)])
            nn.functional.cross_entropy(model(x[start : start + 5]), y[start : start + 5]).backward()
            model.zero_grad()
        cap.set_split("query")
        cap.set_ids(["q0", "q1"])
        nn.functional.cross_entropy(model(x[:2] + 0.1), y[:2]).backward()
    local = store.attribute(run="run", k=4, method="fisher", opponents=True, write=False)
    remote = store.attribute(run="run", k=4, method="fisher", opponents=True, write=False, engine=ray_engine)
    assert remote.column("example_id").to_pylist() == local.column("example_id").to_pylist()
    np.testing.assert_allclose(remote.column("score").to_numpy(), local.column("score").to_numpy(), rtol=1e-5)
