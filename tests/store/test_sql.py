"""Store SQL: results equal a pandas reference; the store cannot be modified through it."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

import gradstore


@pytest.fixture
def filled(store):
    rng = np.random.default_rng(0)
    store.create_run("r", dim=6)
    ids = [f"e{i}" for i in range(40)]
    with store.writer("r") as writer:
        writer.append(
            rng.standard_normal((40, 6)),
            ids,
            step=np.arange(40) // 8,
            loss=rng.random(40),
            split=["train"] * 30 + ["query"] * 10,
        )
    store.add_examples(
        pd.DataFrame(
            {"example_id": ids, "source": [f"s{i % 4}" for i in range(40)], "text": [f"text {i}" for i in range(40)]}
        )
    )
    return store


def test_join_and_aggregate_equal_pandas(filled):
    got = filled.sql("""
        select e.source, g.split, count(*) as n, avg(g.loss) as mean_loss, max(g.step) as last_step
        from gradients g join examples e using (example_id)
        group by 1, 2 order by 1, 2""").df()
    grads = filled.read_gradients(columns=("example_id", "split", "loss", "step")).metadata.to_pandas()
    examples = filled.core.table("examples").to_pandas()
    expected = (
        grads.merge(examples, on="example_id")
        .groupby(["source", "split"], as_index=False)
        .agg(n=("loss", "size"), mean_loss=("loss", "mean"), last_step=("step", "max"))
    )
    pd.testing.assert_frame_equal(got.reset_index(drop=True), expected, check_dtype=False, atol=1e-6)


def test_vectors_are_not_in_sql_but_everything_else_is(filled):
    columns = filled.sql("select * from gradients limit 1").columns
    assert "grad" not in columns and "grad_norm" in columns and "example_id" in columns
    assert filled.sql("select count(*) from gradients").fetchall()[0][0] == 40
    # a self-join scans the table twice
    assert filled.sql("select count(*) from gradients a join gradients b using (step)").fetchall()[0][0] == sum(
        n * n for n in [8] * 5
    )


def test_results_convert_to_arrow_pandas_polars(filled):
    relation = filled.sql("select example_id, loss from gradients order by example_id")
    assert relation.arrow().read_all().num_rows == 40 if hasattr(relation.arrow(), "read_all") else True
    assert len(relation.df()) == 40
    assert relation.pl().height == 40


@pytest.mark.parametrize(
    "statement",
    [
        "drop table gradients",
        "delete from gradients",
        "create table x as select 1",
        "insert into examples values ('x', 'y', 'z')",
        "copy gradients to '/tmp/out.csv'",
        "attach '/tmp/x.db'",
        "select 1; drop table runs",
    ],
)
def test_sql_is_read_only(filled, statement):
    with pytest.raises(gradstore.SQLError):
        filled.sql(statement)
    assert filled.count() == 40


def test_bad_sql_gives_duckdb_message(filled):
    with pytest.raises(gradstore.SQLError, match="no_such_column"):
        filled.sql("select no_such_column from gradients")
    with pytest.raises(gradstore.SQLError, match="syntax error"):
        filled.sql("selec 1")
    with pytest.raises(gradstore.SQLError, match="disabled"):
        filled.sql("select * from read_csv('/etc/hostname')").fetchall()


def test_filters_on_large_string_example_columns(store):
    """pandas 3 makes ``large_string`` columns; Lance cannot push filters on them down, Arrow applies them."""
    store.create_run("r", dim=2)
    with store.writer("r") as writer:
        writer.append(np.ones((4, 2)), ["a", "b", "c", "d"])
    examples = pa.table(
        {
            "example_id": pa.array(["a", "b", "c", "d"], pa.large_string()),
            "source": pa.array(["x", "y", "x", None], pa.large_string()),
            "n": [1, 2, 3, 4],
        }
    )
    store.add_examples(examples)
    assert pa.types.is_large_string(store.core.table("examples").schema.field("source").type)
    got = store.sql("select example_id from examples where source = 'x' and n > 1 order by 1").fetchall()
    assert got == [("c",)]
    joined = store.sql(
        "select count(*) from gradients g join examples e using (example_id) "
        "where e.source like 'x%' or e.source is null"
    ).fetchall()
    assert joined == [(3,)]


@pytest.mark.parametrize(
    "query",
    [
        "select cast('abc' as integer)",
        "select cast(split as integer) from gradients",
        "select 1 / 0 :: hugeint, error('boom')",
    ],
)
def test_execution_time_errors_are_sql_errors(filled, query):
    with pytest.raises(gradstore.SQLError) as raised:
        filled.sql(query)
    assert "Error" in str(raised.value) and raised.value.__cause__ is None


def test_the_macros_work_before_examples_are_added(store):
    """A store with attribution results but no ``examples`` table: the ranking macros list ``example_id``s (and
    every ``examples`` column once added); ``influence_by``, which groups by one of them, says to add examples."""
    rng = np.random.default_rng(0)
    store.create_run("r", dim=4)
    with store.writer("r") as writer:
        writer.append(rng.standard_normal((6, 4)), [f"t{i}" for i in range(6)], split="train")
        writer.append(rng.standard_normal((1, 4)), ["q0"], split="query")
    scores = store.attribute(run="r", k=3, method="grad-dot", opponents=True).to_pandas()
    store.self_influence(run="r", method="grad-dot")
    proponents = store.sql("select * from top_proponents('q0', 3)").df()
    assert list(proponents.columns) == ["query_id", "rank", "score", "method", "example_id"]
    expected = scores[scores["rank"] > 0].sort_values("rank")["example_id"].tolist()
    assert proponents["example_id"].tolist() == expected
    opponents = store.sql("select example_id from top_opponents('q0', 3)").df()["example_id"].tolist()
    assert opponents == scores[scores["rank"] < 0].sort_values("rank", ascending=False)["example_id"].tolist()
    assert store.sql("select count(*) from most_self_influential(4)").fetchall() == [(4,)]
    with pytest.raises(gradstore.SQLError, match=r"influence_by\(\) .*examples table.*store\.add_examples"):
        store.sql("select * from influence_by('source')")
    store.add_examples(pd.DataFrame({"example_id": [f"t{i}" for i in range(6)], "source": ["a", "b"] * 3}))
    joined = store.sql("select example_id, source from top_proponents('q0', 3)").df()
    assert joined["example_id"].tolist() == expected and joined["source"].notna().all()
    assert store.sql("select sum(hits) from influence_by('source')").fetchall() == [(3,)]
    assert "source" in store.sql("select * from most_self_influential(1)").columns


def test_most_self_influential_lists_each_example_once_after_repeated_calls(filled):
    """Like the ``scores`` macros (``latest_scores``), ``most_self_influential`` reads each example's latest
    self_influence call: two identical calls list every example once, and a later call on fewer rows replaces the
    earlier values of those rows only; the table keeps every call."""
    filled.self_influence(run="r", method="grad-dot")
    first = filled.self_influence(run="r", method="grad-dot").to_pandas()
    listed = filled.sql("select example_id, self_influence from most_self_influential(100)").df()
    assert sorted(listed.example_id) == sorted(first.example_id)  # each of the 30 training rows once
    assert listed.self_influence.tolist() == sorted(first.self_influence, reverse=True)
    filled.self_influence(run="r", method="grad-dot", where="example_id = 'e0'")
    assert filled.sql("select count(*) from most_self_influential(100)").fetchall() == [(30,)]
    assert filled.count("self_influence") == 61
