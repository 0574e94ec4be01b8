"""One store, runs of many dims: each dim has a gradient table of its own, and every read, index and
attribution picks the run's table; runs written by hand (no capture, no checkpoint) are first-class."""

from __future__ import annotations

import multiprocessing

import numpy as np
import pytest

import gradstore
from gradstore.core import schema as S
from gradstore.core.shards import example_shards, fragment_shards

N_TRAIN, N_QUERY = 48, 4
#: run -> (dim, checkpoint label its rows carry; None: appended without one)
RUNS = {"a16": (16, "c0"), "b64": (64, "c0"), "c16": (16, "c1"), "hand": (8, None)}


def _rows(run: str) -> tuple[np.ndarray, list[str], list[str]]:
    """The run's vectors, example ids and splits: deterministic per run, different between runs."""
    dim = RUNS[run][0]
    seed = sum(map(ord, run))
    vectors = np.random.default_rng(seed).standard_normal((N_TRAIN + N_QUERY, dim)).astype(np.float32)
    ids = [f"{run}-t{i:02d}" for i in range(N_TRAIN)] + [f"{run}-q{i}" for i in range(N_QUERY)]
    return vectors, ids, ["train"] * N_TRAIN + ["query"] * N_QUERY


def _write(store, run: str) -> None:
    dim, checkpoint = RUNS[run]
    store.create_run(run, dim=dim)
    vectors, ids, splits = _rows(run)
    labels = {} if checkpoint is None else {"checkpoint": checkpoint}
    with store.writer(run, commit_rows=20) as writer:  # several commits: rows of runs interleave in fragments
        for start in range(0, len(ids), 13):
            part = slice(start, start + 13)
            writer.append(vectors[part], ids[part], split=splits[part], **labels)
    if checkpoint is not None:
        store.record_checkpoint(run, checkpoint, step=1)


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """``(multi, singles)``: one store with every run (written in turns), and one store per run."""
    root = tmp_path_factory.mktemp("multidim")
    multi = gradstore.open(root / "multi")
    for run in RUNS:
        _write(multi, run)
    singles = {}
    for run in RUNS:
        singles[run] = gradstore.open(root / run)
        _write(singles[run], run)
    return multi, singles


def _same(got, expected) -> None:
    assert got.column("query_id").to_pylist() == expected.column("query_id").to_pylist()
    assert got.column("example_id").to_pylist() == expected.column("example_id").to_pylist()
    assert got.column("rank").to_pylist() == expected.column("rank").to_pylist()
    np.testing.assert_allclose(got.column("score").to_numpy(), expected.column("score").to_numpy(), rtol=1e-5)


@pytest.mark.parametrize("run", list(RUNS))
@pytest.mark.parametrize(("method", "kind"), [("grad-dot", "exact"), ("fisher", "exact"), ("grad-dot", "Flat")])
def test_attribution_in_a_shared_store_equals_a_store_of_its_own(stores, run, method, kind):
    multi, singles = stores
    options = dict(run=run, k=5, method=method, kind=kind, opponents=kind == "exact", write=False)
    got = multi.attribute("split = 'query'", **options)
    _same(got, singles[run].attribute("split = 'query'", **options))
    assert got.num_rows == N_QUERY * 5 * (2 if kind == "exact" else 1)
    assert all(e.startswith(f"{run}-t") for e in got.column("example_id").to_pylist())


@pytest.mark.parametrize("run", ["b64", "hand"])
def test_self_influence_select_and_score_matrix_use_the_runs_rows(stores, run):
    multi, singles = stores
    for method in ("grad-dot", "fisher"):
        got = multi.self_influence(run=run, method=method, write=False)
        expected = singles[run].self_influence(run=run, method=method, write=False)
        assert got.column("example_id").to_pylist() == expected.column("example_id").to_pylist()
        np.testing.assert_allclose(got.column("self_influence"), expected.column("self_influence"), rtol=1e-5)
        chosen = multi.select("split = 'query'", run=run, budget=10, preconditioner=method)
        reference = singles[run].select("split = 'query'", run=run, budget=10, preconditioner=method)
        assert chosen.column("example_id").to_pylist() == reference.column("example_id").to_pylist()
    matrix = multi.score_matrix("split = 'query'", run=run, method="grad-dot")
    train = multi.read_gradients(run, split="train")
    assert matrix.example_ids == train.metadata.column("example_id").to_pylist()
    queries = multi.read_gradients(run, split="query").vectors
    np.testing.assert_allclose(matrix.scores, queries @ train.vectors.T, rtol=1e-4, atol=1e-4)


def test_the_store_reports_its_dims_and_reads_one_dim_at_a_time(stores):
    multi, _ = stores
    assert multi.dims == [8, 16, 64]
    assert {run: multi.core.run_dim(run) for run in RUNS} == {run: dim for run, (dim, _) in RUNS.items()}
    with pytest.raises(gradstore.InvalidArgumentError, match="run_dim"):
        _ = multi.dim
    assert (
        multi.core.gradient_table_name("a16") == multi.core.gradient_table_name("c16") == S.GRADIENTS
    )  # the first dim
    assert multi.gradient_table_name("b64") == "gradients_64"
    info = multi.info()
    assert info["dim"] is None and info["dims"] == [8, 16, 64]
    assert info["run_dims"] == {run: dim for run, (dim, _) in RUNS.items()}
    assert {"gradients", "gradients_64", "gradients_8"} <= set(info["tables"])
    assert multi.count() == len(RUNS) * (N_TRAIN + N_QUERY)
    assert multi.count("gradients", "split = 'query'") == len(RUNS) * N_QUERY
    with pytest.raises(gradstore.InvalidArgumentError, match="pass run="):
        next(multi.iter_gradients())
    with pytest.raises(gradstore.InvalidArgumentError, match="several dims"):
        multi.read_gradients(["a16", "b64"])
    both = multi.read_gradients(["a16", "c16"], split="train")  # one dim, one table
    assert both.vectors.shape == (2 * N_TRAIN, 16)
    one = multi.read_gradients("b64", split="query")
    np.testing.assert_allclose(one.vectors, _rows("b64")[0][N_TRAIN:], rtol=1e-3, atol=1e-3)
    empty = multi.read_gradients("b64", where="example_id = 'none'")
    assert empty.vectors.shape == (0, 64)
    with pytest.raises(gradstore.SchemaMismatchError, match="64"):
        multi.attribute(np.ones((1, 16), np.float32), run="b64", write=False, method="grad-dot")
    with pytest.raises(gradstore.InvalidNameError, match="gradient table"):
        multi.append_table("gradients_32", S.RUNS_SCHEMA.empty_table())


def test_sql_gradients_spans_every_run_of_every_dim(stores):
    multi, _ = stores
    counts = dict(multi.sql("select run_id, count(*) from gradients group by 1").fetchall())
    assert counts == {run: N_TRAIN + N_QUERY for run in RUNS}
    assert multi.sql("select count(*) from gradients_64").fetchall() == [(N_TRAIN + N_QUERY,)]
    assert multi.sql("select count(*) from gradients_16").fetchall() == [(2 * (N_TRAIN + N_QUERY),)]
    labels = multi.sql("select distinct checkpoint from gradients where run_id = 'hand'").fetchall()
    assert labels == [(S.DEFAULT_CHECKPOINT,)]  # rows appended without a checkpoint carry capture's default
    assert "grad" not in multi.sql("select * from gradients limit 1").columns


def test_macros_join_scores_of_runs_of_several_dims(tmp_path):
    store = gradstore.open(tmp_path / "store")
    for run in ("b64", "hand"):
        _write(store, run)
        store.add_examples([{"example_id": e, "source": run} for e in _rows(run)[1]])
        store.attribute(f"example_id = '{run}-q0'", run=run, k=3, method="grad-dot")
    for run in ("b64", "hand"):
        rows = store.sql(f"select source from top_proponents('{run}-q0', 3)").fetchall()
        assert rows == [(run,)] * 3
    by_source = dict(store.sql("select \"group\", hits from influence_by('source')").fetchall())
    assert by_source == {"b64": 3, "hand": 3}


def test_verify_and_compact_cover_every_gradient_table(tmp_path):
    store = gradstore.open(tmp_path / "store")
    for run in RUNS:
        _write(store, run)
    before = store.attribute("split = 'query'", run="b64", k=5, write=False, method="grad-dot")
    report = store.verify()
    assert report.ok, report.problems
    assert report.tables["gradients_64"] == report.tables["gradients_8"] == N_TRAIN + N_QUERY
    counts = store.compact()
    assert counts["gradients"] == counts["gradients_64"] == counts["gradients_8"] == 1
    _same(store.attribute("split = 'query'", run="b64", k=5, write=False, method="grad-dot"), before)
    assert store.verify().ok


def test_verify_reports_rows_in_the_table_of_another_dim(tmp_path):
    store = gradstore.open(tmp_path / "store")
    _write(store, "a16")
    with store.writer("a16") as writer:  # rows claiming another run, written through a16's writer
        writer.run_id = "b64"
        writer.append(np.ones((1, 16)), ["stray"])
    store.create_run("b64", dim=64)
    problems = store.verify().problems
    assert any("b64" in p and "dim" in p for p in problems), problems


def test_a_run_written_by_hand_is_attributed_as_it_is(tmp_path):
    store = gradstore.open(tmp_path / "store")
    _write(store, "hand")
    assert store.core.default_checkpoint("hand") == S.DEFAULT_CHECKPOINT
    for method in ("grad-dot", "fisher", "diagonal", "cosine"):
        result = store.attribute(run="hand", queries="split = 'query'", method=method, k=3, write=False)
        assert result.num_rows == N_QUERY * 3
    vectors, ids, _ = _rows("hand")
    top = (
        store.attribute(vectors[N_TRAIN:], run="hand", k=1, write=False, method="grad-dot")
        .column("example_id")
        .to_pylist()
    )
    assert top == [ids[int(np.argmax(vectors[:N_TRAIN] @ q))] for q in vectors[N_TRAIN:]]
    for method in ("kfac", "ekfac"):
        with pytest.raises(gradstore.SchemaMismatchError, match=f"no projection spec.*method '{method[-4:]}'"):
            store.attribute(run="hand", queries="split = 'query'", method=method, write=False)
    with pytest.raises(gradstore.SchemaMismatchError, match="per-layer Fisher"):
        store.attribute(run="hand", queries="split = 'query'", method="fisher", blocks="layer", write=False)


def test_the_default_checkpoint_of_unrecorded_rows_is_their_label(tmp_path):
    store = gradstore.open(tmp_path / "store")
    vectors, ids, splits = _rows("hand")
    store.create_run("one", dim=8)
    with store.writer("one") as writer:
        writer.append(vectors, ids, split=splits, checkpoint="step-100")
    assert store.core.default_checkpoint("one") == "step-100"
    store.create_run("unlabelled", dim=8)  # rows written before the writer labelled them
    with store.writer("unlabelled") as writer:
        writer.append(vectors, ids, split=splits, checkpoint=None)
    assert store.core.default_checkpoint("unlabelled") is None
    result = store.attribute(run="unlabelled", method="fisher", k=2, write=False)
    _same(result, store.attribute(run="one", method="fisher", k=2, write=False))
    store.create_run("mixed", dim=8)
    with store.writer("mixed") as writer:
        writer.append(vectors[:2], ids[:2], checkpoint="x")
        writer.append(vectors[2:4], ids[2:4], checkpoint="y")
    with pytest.raises(gradstore.InvalidArgumentError, match="pass checkpoint="):
        store.core.default_checkpoint("mixed")
    store.create_run("empty", dim=8)
    assert store.core.default_checkpoint("empty") == S.DEFAULT_CHECKPOINT


def test_a_single_dim_store_keeps_one_gradients_table(tmp_path):
    store = gradstore.open(tmp_path / "store")
    _write(store, "a16")
    _write(store, "c16")
    assert store.dim == 16 and store.dims == [16]
    assert [t for t in store.core.db.list_tables().tables if t.startswith("gradients")] == ["gradients"]
    assert gradstore.open(tmp_path / "store", create=False).core.gradient_table_name("c16") == "gradients"


def test_a_creator_that_loses_the_race_for_gradients_takes_a_table_of_its_own(tmp_path):
    """The race, made deterministic: this store decides that no ``gradients`` table exists, and another store
    creates one of another dim before this one's ``create`` commits."""
    late = gradstore.open(tmp_path / "store")
    first = gradstore.open(tmp_path / "store")
    tables = late.core.gradient_tables
    decide = tables.primary_dim

    def decided_before_the_other_won() -> int | None:
        tables.primary_dim = decide
        first.create_run("winner", dim=16)
        return None

    tables.primary_dim = decided_before_the_other_won
    late.create_run("loser", dim=64)
    assert tables.primary_dim == decide  # the lie was told once, then the table was re-read
    assert late.gradient_table_name("loser") == "gradients_64" and late.gradient_table_name("winner") == "gradients"
    assert gradstore.open(tmp_path / "store").dims == [16, 64]


def _create_and_write(path: str, run: str, dim: int, barrier) -> None:
    store = gradstore.open(path)
    barrier.wait()  # both processes create their run together (no timing assumption: any order is correct)
    store.create_run(run, dim=dim)
    with store.writer(run) as writer:
        writer.append(np.full((3, dim), dim, np.float32), [f"{run}-{i}" for i in range(3)])


def test_two_processes_creating_runs_of_different_dims_both_get_their_table(tmp_path):
    path = str(tmp_path / "store")
    gradstore.open(path)
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(2)
    workers = [
        context.Process(target=_create_and_write, args=(path, run, dim, barrier))
        for run, dim in (("r16", 16), ("r64", 64))
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(300)
    assert [worker.exitcode for worker in workers] == [0, 0]
    store = gradstore.open(path, create=False)
    assert store.dims == [16, 64]
    assert sorted(store.core.gradient_table_name(run) for run in ("r16", "r64")) in (
        ["gradients", "gradients_64"],
        ["gradients", "gradients_16"],
    )
    for run, dim in (("r16", 16), ("r64", 64)):
        block = store.read_gradients(run)
        np.testing.assert_allclose(block.vectors, np.full((3, dim), dim), rtol=1e-3)
    assert store.verify().ok


def test_shards_cover_the_runs_own_table_only(stores):
    multi, _ = stores
    for run in ("a16", "b64"):
        where = f"run_id = '{run}' AND split = 'train'"
        for shards in (fragment_shards(multi.core, run, where, 3), example_shards(multi.core, run, where, where, 3)):
            blocks = [block for shard in shards for block in shard.blocks()]
            ids = sorted(e for block in blocks for e in block.metadata.column("example_id").to_pylist())
            assert ids == sorted(_rows(run)[1][:N_TRAIN])
            assert {block.vectors.shape[1] for block in blocks} == {RUNS[run][0]}


def test_the_ray_engine_reads_the_runs_own_table(stores, ray_engine):
    multi, _ = stores
    engine = ray_engine
    for run in ("b64", "hand"):
        options = dict(run=run, k=4, method="fisher", opponents=True, write=False)
        _same(multi.attribute(**options, engine=engine), multi.attribute(**options))
        got = multi.self_influence(run=run, method="grad-dot", write=False, engine=engine)
        expected = multi.self_influence(run=run, method="grad-dot", write=False)
        np.testing.assert_allclose(got.column("self_influence"), expected.column("self_influence"), rtol=1e-6)


def test_runs_of_several_dims_on_object_storage(s3_bucket, tmp_path):
    pytest.importorskip("boto3")
    bucket, options = s3_bucket
    remote = gradstore.open(f"s3://{bucket}/store", storage_options=options)
    local = gradstore.open(tmp_path / "local")
    for store in (remote, local):
        for run in ("b64", "hand"):
            _write(store, run)
    assert remote.dims == [8, 64] and remote.core.gradient_table_name("hand") == "gradients_8"
    for run in ("b64", "hand"):
        for kind in ("exact", "Flat"):
            options_ = dict(run=run, k=3, method="fisher", kind=kind, write=False)
            _same(remote.attribute(**options_), local.attribute(**options_))
    assert dict(remote.sql("select run_id, count(*) from gradients group by 1").fetchall()) == {
        "b64": N_TRAIN + N_QUERY,
        "hand": N_TRAIN + N_QUERY,
    }
    remote.compact()
    assert remote.verify().ok
