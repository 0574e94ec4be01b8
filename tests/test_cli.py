"""The command line: info, sql (every format), compact, and clear errors."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
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
    pd.testing.assert_frame_equal(pq.read_table(out).to_pandas(),
                                  pd.DataFrame({"example_id": ["a", "b", "c"], "loss": [1.0, 2.0, 3.0]}),
                                  check_dtype=False)
    table = runner.invoke(app, ["sql", str(store_path), query])
    assert "example_id" in table.output and "c" in table.output


def test_errors_are_messages_not_tracebacks(store_path, tmp_path):
    _filled(store_path)
    bad = runner.invoke(app, ["sql", str(store_path), "selec 1"])
    assert bad.exit_code == 1 and "syntax error" in bad.output and "Traceback" not in bad.output
    write = runner.invoke(app, ["sql", str(store_path), "drop table runs"])
    assert write.exit_code == 1 and "read-only" in write.output
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
