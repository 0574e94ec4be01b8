"""The command line: info, sql (every format), compact, and clear errors."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

import gradstore
from gradstore.cli import app

runner = CliRunner()


def _filled(path):
    store = gradstore.open(path)
    store.create_run("r", dim=4)
    with store.writer("r") as writer:
        writer.append(np.ones((3, 4)), ["a", "b", "c"], loss=[1.0, 2.0, 3.0])
    return store


def test_info_lists_tables_and_runs(store_path):
    _filled(store_path)
    result = runner.invoke(app, ["info", str(store_path)])
    assert result.exit_code == 0, result.output
    assert "gradients" in result.output and " 3 " in result.output and "runs       r" in result.output


def test_info_create_makes_an_empty_store(tmp_path):
    result = runner.invoke(app, ["info", str(tmp_path / "new"), "--create"])
    assert result.exit_code == 0 and "scores" in result.output
    assert gradstore.open(tmp_path / "new", create=False).dim is None


def test_sql_formats(store_path, tmp_path):
    _filled(store_path)
    query = "select example_id, loss from gradients order by example_id"
    csv = runner.invoke(app, ["sql", str(store_path), query, "--format", "csv"])
    assert csv.output.splitlines() == ["example_id,loss", "a,1.0", "b,2.0", "c,3.0"]
    lines = runner.invoke(app, ["sql", str(store_path), query, "-f", "json"]).output.splitlines()
    assert [json.loads(line)["loss"] for line in lines] == [1.0, 2.0, 3.0]
    out = tmp_path / "out.parquet"
    assert runner.invoke(app, ["sql", str(store_path), query, "-f", "parquet", "-o", str(out)]).exit_code == 0
    pd.testing.assert_frame_equal(
        pq.read_table(out).to_pandas(),
        pd.DataFrame({"example_id": ["a", "b", "c"], "loss": [1.0, 2.0, 3.0]}),
        check_dtype=False,
    )
    table = runner.invoke(app, ["sql", str(store_path), query])
    assert "example_id" in table.output and "c" in table.output


def test_errors_are_messages_not_tracebacks(store_path, tmp_path):
    _filled(store_path)
    bad = runner.invoke(app, ["sql", str(store_path), "selec 1"])
    assert bad.exit_code == 1 and "syntax error" in bad.output and "Traceback" not in bad.output
    write = runner.invoke(app, ["sql", str(store_path), "drop table runs"])
    assert write.exit_code == 1 and "read-only" in write.output
    cast = runner.invoke(app, ["sql", str(store_path), "select cast(example_id as integer) from gradients"])
    assert cast.exit_code == 1 and "Traceback" not in cast.output
    assert cast.output.strip().splitlines() == [
        "error: Conversion Error: Could not convert string 'a' to INT32 when casting from source column example_id"
    ]
    missing = runner.invoke(app, ["info", str(tmp_path / "nothing")])
    assert missing.exit_code == 1 and "no gradstore store" in missing.output


def test_compact(store_path):
    store = _filled(store_path)
    with store.writer("r") as writer:
        writer.append(np.ones((2, 4)), ["d", "e"])
    result = runner.invoke(app, ["compact", str(store_path), "--cleanup-days", "0"])
    assert result.exit_code == 0
    assert json.loads(result.output)["fragments"]["gradients"] == 1
    assert gradstore.open(store_path).count() == 5


def test_attribution_commands(tmp_path):
    from gradstore.demo import DemoConfig, run_demo

    path = tmp_path / "demo"
    run_demo(
        path,
        DemoConfig(places=3, phrasings=4, epochs=2, checkpoints=1, methods=("grad-dot",), shown_queries=0),
        log=lambda line: None,
    )
    store = gradstore.open(path)
    query = store.sql("select example_id from gradients where split = 'query' limit 1").fetchall()[0][0]
    out = tmp_path / "scores.parquet"
    result = runner.invoke(
        app,
        [
            "attribute",
            str(path),
            "--run",
            "demo",
            "--queries",
            query,
            "-k",
            "3",
            "--method",
            "fisher",
            "--opponents",
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    assert sorted(pq.read_table(out).column("rank").to_pylist()) == [-3, -2, -1, 1, 2, 3]
    top = runner.invoke(app, ["self-influence", str(path), "--run", "demo", "--top", "2"])
    assert top.exit_code == 0 and len(top.output.strip().splitlines()) == 3  # header + 2 rows
    best = store.sql("select example_id from self_influence order by self_influence desc limit 1").fetchall()[0][0]
    assert best in top.output.splitlines()[1]
    chosen = tmp_path / "chosen.parquet"
    selected = runner.invoke(app, ["select", str(path), "--run", "demo", "--budget", "4", "--out", str(chosen)])
    assert selected.exit_code == 0 and pq.read_table(chosen).num_rows == 4
    for command in (["select", "--budget", "4"], ["attribute", "--queries", query]):  # Parquet under a .csv name
        named = runner.invoke(
            app, [command[0], str(path), "--run", "demo", *command[1:], "--out", str(tmp_path / "x.csv")]
        )
        assert named.exit_code == 1 and "written as Parquet" in named.output and not (tmp_path / "x.csv").exists()
    index = runner.invoke(app, ["build-index", str(path), "--run", "demo", "--kind", "Flat"])
    assert index.exit_code == 0 and json.loads(index.output)["recall_at_10"] == 1.0
    exact_index = runner.invoke(app, ["build-index", str(path), "--run", "demo", "--method", "grad-dot"])
    assert exact_index.exit_code == 0 and json.loads(exact_index.output)["row_file"] is None  # under 32 MiB
    graph = runner.invoke(
        app, ["build-index", str(path), "--run", "demo", "--method", "fisher", "--kind", "HNSW8,Flat"]
    )
    assert graph.exit_code == 0 and json.loads(graph.output)["recall_at_10"] == 1.0  # a small graph: all searched
    two_stage = runner.invoke(
        app,
        ["attribute", str(path), "--run", "demo", "--queries", query, "-k", "3", "--method", "fisher"]
        + ["--kind", "HNSW8,Flat", "--rerank", "2", "--out", str(tmp_path / "graph.parquet")],
    )
    assert two_stage.exit_code == 0, two_stage.output
    exact = pq.read_table(out).filter(pc.greater(pq.read_table(out).column("rank"), 0)).sort_by("rank")
    graph_rows = pq.read_table(tmp_path / "graph.parquet").sort_by("rank")
    assert graph_rows.column("grad_id").to_pylist() == exact.column("grad_id").to_pylist()
    missing = runner.invoke(app, ["attribute", str(path), "--run", "demo", "--queries", "nope"])
    assert missing.exit_code == 1 and "nope" in missing.output


def test_attribute_defaults_to_fisher_and_user_errors_are_one_line(tmp_path):
    from gradstore.demo import DemoConfig, run_demo

    path = tmp_path / "demo"
    run_demo(
        path,
        DemoConfig(places=3, phrasings=4, epochs=1, checkpoints=1, methods=("grad-dot",), shown_queries=0),
        log=lambda line: None,
    )
    default = runner.invoke(app, ["attribute", str(path), "--run", "demo", "-k", "1"])
    assert default.exit_code == 0 and "fisher" in default.output and "grad-dot" not in default.output
    for arguments, message in (
        (["--kind", "Bogus"], "Bogus"),
        (["--queries", "nope"], "nope"),
        (["--where", "split = 'nothing'"], "no queries"),
        (["--where", "1=1) OR (1=1"], "parenthesis"),
    ):
        result = runner.invoke(app, ["attribute", str(path), "--run", "demo", *arguments])
        assert result.exit_code == 1 and message in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output
    fractional = runner.invoke(app, ["select", str(path), "--run", "demo", "--budget", "2.5"])
    assert fractional.exit_code == 1 and "whole number" in fractional.output


def test_sql_macros_without_an_examples_table(store_path):
    """``gradstore sql`` on a store holding scores but no examples: ``top_proponents`` lists example ids, and a
    macro that needs the examples table says how to add it, in one line."""
    store = gradstore.open(store_path)
    store.create_run("r", dim=4)
    with store.writer("r") as writer:
        writer.append(np.eye(4)[[0, 1, 2, 0]], ["t0", "t1", "t2", "t3"], split="train")
        writer.append(np.eye(4)[[0]], ["q0"], split="query")
    store.attribute(run="r", k=2, method="grad-dot")
    top = runner.invoke(app, ["sql", str(store_path), "select * from top_proponents('q0', 2)", "-f", "csv"])
    assert top.exit_code == 0, top.output
    assert top.output.splitlines()[0] == "query_id,rank,score,method,example_id"
    assert sorted(line.split(",")[-1] for line in top.output.splitlines()[1:]) == ["t0", "t3"]
    grouped = runner.invoke(app, ["sql", str(store_path), "select * from influence_by('source')"])
    assert grouped.exit_code == 1 and "Traceback" not in grouped.output
    assert len(grouped.output.strip().splitlines()) == 1 and "store.add_examples" in grouped.output


@pytest.mark.parametrize(
    ("command", "option", "call", "refused"),
    [
        ("self-influence", "method", "self_influence", ["cosine", "tracin", "trackstar", "replay"]),
        ("build-index", "method", "build_index", ["tracin", "tracin-steps", "source", "replay"]),
        ("attribute", "method", "attribute", []),
        ("select", "preconditioner", "select", ["cosine", "tracin"]),
    ],
)
def test_method_choices_are_the_methods_each_command_takes(store_path, command, option, call, refused):
    """Each scoring command offers (in its help) and accepts exactly the registry's methods its call takes, then
    their aliases (``influence`` for ``fisher``, as the Python API and the server take it)."""
    from gradstore.methods import ALIASES, method_names

    _filled(store_path)
    help_text = runner.invoke(app, [command, "--help"], env={"COLUMNS": "400"}).output
    (line,) = [line for line in help_text.splitlines() if f"--{option} " in line]
    names = method_names(call)
    assert f"<{'|'.join([*names, *(a for a, m in ALIASES.items() if m in names)])}>" in line
    if "fisher" in names:
        alias = runner.invoke(app, [command, str(store_path), "--run", "r", f"--{option}", "influence"])
        plain = runner.invoke(app, [command, str(store_path), "--run", "r", f"--{option}", "fisher"])
        assert alias.exit_code == plain.exit_code and alias.output == plain.output, alias.output
    for method in refused:
        result = runner.invoke(app, [command, str(store_path), "--run", "r", f"--{option}", method])
        assert result.exit_code == 2 and "is not one of" in result.output, result.output


def _with_queries(path):
    """A store of run ``r``: training rows t0..t3 and query rows q0, q1 (dim 4)."""
    store = gradstore.open(path)
    store.create_run("r", dim=4)
    with store.writer("r") as writer:
        writer.append(np.eye(4)[[0, 1, 2, 3]], ["t0", "t1", "t2", "t3"], split="train")
        writer.append(np.eye(4)[[0, 1]], ["q0", "q1"], split="query")
    return store


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["attribute", "--queries", ""], "--queries '' names nothing"),
        (["attribute", "--queries", ","], "--queries ',' names nothing"),
        (["attribute", "--queries", "q0", "--where", "example_id = 'q1'"], "--queries and --where both select"),
        (["attribute", "--checkpoints", "", "--method", "tracin"], "--checkpoints '' names nothing"),
        (["select", "--target", ""], "--target '' names nothing"),
    ],
)
def test_query_options_that_select_nothing_or_twice_are_refused(store_path, arguments, message):
    """``--queries ""`` is not "every query" (the API refuses an empty id list too), and ``--queries`` with
    ``--where`` (the docs' alternatives) is not ``--queries`` with ``--where`` ignored: one-line errors."""
    _with_queries(store_path)
    command, *options = arguments
    result = runner.invoke(app, [command, str(store_path), "--run", "r", *options])
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1, result.output
    assert result.output.startswith(f"error: {message}"), result.output
    assert gradstore.open(store_path).count("scores") == 0


@pytest.mark.parametrize(
    ("arguments", "option"),
    [
        (["report", "--top", "-1"], "--top"),
        (["report", "--top", "0"], "--top"),
        (["report", "--max-queries", "0"], "--max-queries"),
        (["self-influence", "--run", "r", "--top", "0"], "--top"),
        (["self-influence", "--run", "r", "--top", "-1"], "--top"),
        (["compact", "--cleanup-days", "-1"], "--cleanup-days"),
    ],
)
def test_counts_out_of_range_are_usage_errors_naming_the_option(store_path, tmp_path, arguments, option):
    _with_queries(store_path)
    command, *options = arguments
    out = ["--out", str(tmp_path / "r.html")] if command == "report" else []
    result = runner.invoke(app, [command, str(store_path), *options, *out])
    assert result.exit_code == 2 and f"Invalid value for '{option}'" in result.output, result.output
    assert not (tmp_path / "r.html").exists() and gradstore.open(store_path).count("self_influence") == 0


def test_the_api_names_report_top_and_refuses_a_negative_cleanup_age(store_path, tmp_path):
    from datetime import timedelta

    store = _with_queries(store_path)
    with pytest.raises(gradstore.InvalidArgumentError, match="^top must be a whole number >= 1, got -1"):
        store.report(tmp_path / "r.html", top=-1)
    with pytest.raises(gradstore.InvalidArgumentError, match="cleanup_older_than must be a timedelta >= 0"):
        store.compact(cleanup_older_than=timedelta(days=-1))


def test_evaluate_names_a_train_function_that_fails_in_one_line(store_path):
    """The user's --train function raising is their error, not gradstore's: one line naming the function."""
    _with_queries(store_path)
    for command in ("qld", "lds"):
        result = runner.invoke(
            app, ["evaluate", command, str(store_path), "--run", "r", "--train", "os:getcwd", "--methods", "grad-dot"]
        )
        assert result.exit_code == 1 and "Traceback" not in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1
        assert result.output.startswith("error: train_fn posix.getcwd failed (TypeError:"), result.output
