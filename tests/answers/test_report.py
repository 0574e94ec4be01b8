"""The attribution report: its data matches the store, store text cannot inject markup, and the page works in a
real browser (Debian's Chromium driven by Playwright) from disk, offline."""

from __future__ import annotations

import json
import re

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

import gradstore
from gradstore.answers.report import ReportOptions, gather
from gradstore.answers.report.html import plotly_js, script_safe_json
from gradstore.demo import DemoConfig, run_demo
from ingest.projection import LayerSlot, ProjectionSpec

RUN = "r"
EVIL = '</script><script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2"> & \u2028done'
BOOKS = "<i>books</i>"  # a group label with markup: Plotly must show it as text
N_TRAIN, N_QUERIES, SIDE = 60, 5, 3


@pytest.fixture(scope="module")
def small_store(tmp_path_factory):
    """A run of random 9-dim rows; example ``t-007`` carries markup in its text, the first query too."""
    rng = np.random.default_rng(0)
    store = gradstore.open(tmp_path_factory.mktemp("report") / "store")
    layer = LayerSlot(
        name="fc",
        kind="linear",
        d_in=SIDE - 1,
        d_out=SIDE,
        k_in=None,
        k_out=None,
        mode="exact",
        offset=0,
        size=SIDE * SIDE,
        has_bias=True,
    )
    store.core.catalog.ensure_run(RUN, ProjectionSpec(seed=0, kind="none", layers=(layer,)))
    store.record_checkpoint(RUN, "final", step=1, learning_rate=0.1)
    train = [f"t-{i:03d}" for i in range(N_TRAIN)]
    queries = [f"q-{i}" for i in range(N_QUERIES)]
    with store.writer(RUN) as writer:
        train_rows = rng.standard_normal((N_TRAIN, SIDE * SIDE), dtype=np.float32)
        query_rows = rng.standard_normal((N_QUERIES, SIDE * SIDE), dtype=np.float32)
        query_rows[0] = train_rows[7] * 5  # t-007 is q-0's top proponent
        writer.append(train_rows, train, checkpoint="final", split="train")
        writer.append(query_rows, queries, checkpoint="final", split="query")
    texts = [f"training sentence {i}" for i in range(N_TRAIN)] + [f"question {i}" for i in range(N_QUERIES)]
    texts[7] = EVIL
    texts[N_TRAIN] = "question 0 <b>bold?</b>"
    store.add_examples(
        pd.DataFrame(
            {
                "example_id": train + queries,
                "text": texts,
                "source": ["web" if i % 3 else BOOKS for i in range(N_TRAIN)] + ["q"] * 5,
            }
        )
    )
    store.attribute(run=RUN, k=4, method="fisher", damping=0.3, opponents=True)
    store.attribute(run=RUN, k=4, method="grad-dot")
    store.self_influence(run=RUN, method="grad-dot")
    return store


def _embedded_data(page: str) -> dict:
    match = re.search(r'<script type="application/json" id="report-data">(.*?)</script>', page, re.S)
    return json.loads(match.group(1))


def test_report_data_matches_the_scores_table(small_store):
    data = gather(small_store.core, ReportOptions(run=RUN, top=3))
    assert data.queries_total == N_QUERIES and [q["id"] for q in data.queries] == [f"q-{i}" for i in range(5)]
    expected = small_store.sql(
        "SELECT query_id, method, example_id, score, rank FROM scores "
        "WHERE abs(rank) <= 3 ORDER BY query_id, method, rank"
    ).df()
    for query in data.queries:
        assert sorted(r["method"] for r in query["results"]) == ["fisher", "grad-dot"]
        for result in query["results"]:
            rows = expected[(expected.query_id == query["id"]) & (expected.method == result["method"])]
            pros, cons = rows[rows["rank"] > 0], rows[rows["rank"] < 0].sort_values("rank", ascending=False)
            assert [e for e, _ in result["proponents"]] == pros.example_id.tolist()
            assert [s for _, s in result["proponents"]] == pytest.approx(pros.score.tolist())
            assert [e for e, _ in result["opponents"]] == cons.example_id.tolist()
            assert result["damping"] == (0.3 if result["method"] == "fisher" else None)
    q0 = {r["method"]: r for r in data.queries[0]["results"]}
    assert q0["grad-dot"]["proponents"][0][0] == "t-007"
    assert data.texts["t-007"] == EVIL and data.texts["q-0"] == "question 0 <b>bold?</b>"
    assert [h["method"] for h in data.histograms] == ["fisher", "grad-dot"]
    assert sum(data.histograms[0]["counts"]) == N_QUERIES * 8  # fisher: 4 proponents + 4 opponents per query
    outliers = data.self_influence[0]
    assert outliers["rows_total"] == N_TRAIN and len(outliers["rows"]) == min(25, N_TRAIN)
    values = [r["value"] for r in outliers["rows"]]
    assert values == sorted(values, reverse=True)
    assert data.selection is None and data.evaluations is None and data.queries[0]["tokens"] == {}


def test_report_limits_queries_and_counts_the_rest(small_store):
    data = gather(small_store.core, ReportOptions(max_queries=2))
    assert [q["id"] for q in data.queries] == ["q-0", "q-1"] and data.queries_total == N_QUERIES
    assert any("3 of 5 queries are not shown" in note for note in data.notes)


def test_selection_breakdown_counts_candidates_and_selected(small_store):
    selection = small_store.select(run=RUN, budget=12)
    chosen = gather(small_store.core, ReportOptions(run=RUN), selection).selection
    assert chosen["selected"] == 12 and chosen["candidates"] == N_TRAIN and chosen["fraction"] == pytest.approx(0.2)
    (source,) = [b for b in chosen["breakdown"] if b["column"] == "source"]
    picked = set(selection.column("example_id").to_pylist())
    books = {f"t-{i:03d}" for i in range(0, N_TRAIN, 3)}
    assert dict(zip(source["groups"], source["candidates"])) == {BOOKS: 20, "web": 40}
    assert dict(zip(source["groups"], source["selected"])) == {BOOKS: len(picked & books), "web": len(picked - books)}
    assert [r["example_id"] for r in chosen["top"]] == selection.column("example_id").to_pylist()


@pytest.fixture
def token_store(tmp_path):
    """One score row, per-token scores on both sides (other column names), and an evaluations table."""
    store = gradstore.open(tmp_path / "store")
    store.add_examples(pd.DataFrame({"example_id": ["q", "a"], "text": ["what is x", "x is y"]}))
    store.core.append_results(
        "scores",
        pa.table(
            {
                "query_id": ["q"],
                "example_id": ["a"],
                "grad_id": [1],
                "score": [2.0],
                "rank": [1],
                "method": ["grad-dot"],
                "run_id": ["r"],
                "checkpoint": ["c"],
                "index_name": [None],
            },
        ),
    )
    store.core.db.create_table(
        "token_scores",
        pa.table(
            {
                "query_id": ["q"] * 6,
                "example_id": ["a", "a", "a", "a", "b", "b"],
                "side": ["train", "train", "query", "query", "query", "query"],
                "token_position": [1, 0, 0, 1, 0, 1],
                "token_text": ["is", "x", "what", "<is>", "what", "<is>"],
                "score": [0.5, 1.5, 0.2, -0.1, 0.25, 0.5],
            }
        ),
    )
    store.core.db.create_table("evaluations", pa.table({"method": ["grad-dot"], "lds": [0.41]}))
    return store


def test_token_scores_and_evaluations_are_shown_when_present(token_store):
    data = gather(token_store.core)
    tokens = data.queries[0]["tokens"]  # the query's tokens summed over the examples they were scored against
    assert tokens == {
        "a": [[0, "x", 1.5], [1, "is", 0.5]],
        "": [[0, "what", pytest.approx(0.45)], [1, "<is>", pytest.approx(0.4)]],
    }
    assert data.evaluations == {"columns": ["method", "lds"], "rows": [["grad-dot", 0.41]]}


def test_an_empty_store_gives_an_empty_report(store, tmp_path):
    data = gather(store.core)
    assert (data.queries, data.queries_total, data.histograms, data.self_influence) == ([], 0, [], [])
    assert data.overview["runs"] == [] and data.overview["row_counts"]["scores"] == 0
    assert '"queries":[]' in store.report(tmp_path / "empty.html").read_text(encoding="utf-8")


def test_store_text_cannot_break_out_of_the_page(small_store, tmp_path):
    path = small_store.report(tmp_path / "report.html", run=RUN)
    page = path.read_text(encoding="utf-8").replace(plotly_js(), "")  # our markup and data only
    assert "<img" not in page and "<b>" not in page and "\u2028" not in page
    assert page.count("<script") == 3 and page.count("</script>") == 3  # data, Plotly, the page's script
    assert _embedded_data(page)["texts"]["t-007"] == EVIL
    assert json.loads(script_safe_json(json.dumps(EVIL))) == EVIL


def test_cli_report_writes_and_prints_the_path(small_store, tmp_path):
    from typer.testing import CliRunner

    from gradstore.cli import app

    out = tmp_path / "cli.html"
    result = CliRunner().invoke(app, ["report", small_store.uri, "--run", RUN, "--out", str(out), "--top", "2"])
    assert result.exit_code == 0, result.output
    assert result.output.strip().splitlines()[-1] == str(out.resolve())
    data = _embedded_data(out.read_text(encoding="utf-8"))
    assert all(len(r["proponents"]) == 2 for q in data["queries"] for r in q["results"])
    missing = CliRunner().invoke(app, ["report", small_store.uri, "--run", "nope", "--out", str(out)])
    assert missing.exit_code == 1 and "unknown run" in missing.output


# ---------------------------------------------------------------------------------------------- in a browser
# (the `browser` fixture: tests/conftest.py)


class PageLog:
    """A page opened from disk with its console errors, page errors and requests recorded."""

    def __init__(self, browser, path) -> None:
        self.errors: list[str] = []
        self.requests: list[str] = []
        self.url = path.resolve().as_uri()
        self.page = browser.new_page(viewport={"width": 1280, "height": 900})
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.page.goto(self.url)


@pytest.fixture(scope="module")
def demo_report(tmp_path_factory):
    config = DemoConfig(places=3, phrasings=5, epochs=3, checkpoints=1, methods=("grad-dot", "fisher"), shown_queries=1)
    lines: list[str] = []
    summary = run_demo(tmp_path_factory.mktemp("demo") / "demo", config, log=lines.append)
    return summary, lines


def test_demo_writes_its_report_and_prints_the_path(demo_report):
    summary, lines = demo_report
    report = summary["report"]
    assert report.endswith("/demo/report.html") and any(line.splitlines()[-1] == report for line in lines)


def test_demo_report_in_the_browser(browser, demo_report, tmp_path):
    from pathlib import Path

    opened = PageLog(browser, Path(demo_report[0]["report"]))
    page = opened.page
    items = page.locator(".query-item")
    assert items.count() == 6  # 3 places x 2 facts
    page.fill("#query-search", "language")
    assert page.locator(".query-item:visible").count() == 3
    page.fill("#query-search", "no query has this text")
    assert page.locator(".query-item:visible").count() == 0
    page.fill("#query-search", items.first.get_attribute("data-id"))
    page.locator(".query-item:visible").first.click()
    page.wait_for_selector(".score-bars .bars path")
    assert page.locator(".result").count() == 2  # grad-dot and fisher
    assert page.locator(".score-bars").first.locator(".bars path").count() == 10
    first_text = page.locator("table.results").first.locator("tbody tr").first.locator("td").nth(3).inner_text()
    store = gradstore.open(Path(demo_report[0]["store"]), create=False)
    assert first_text in set(store.sql("SELECT text FROM examples").df().text)
    assert page.locator("#self-influence table.outliers tbody tr").count() > 0
    assert "training examples" in page.inner_text(".selection-summary")
    page.screenshot(path=str(tmp_path / "demo-report.png"), full_page=True)
    assert (tmp_path / "demo-report.png").stat().st_size > 0
    assert opened.errors == []
    assert opened.requests == [opened.url]


def test_injected_text_stays_text_in_the_browser(browser, small_store, tmp_path):
    selection = small_store.select(run=RUN, budget=12)
    opened = PageLog(browser, small_store.report(tmp_path / "report.html", run=RUN, selection=selection))
    page = opened.page
    assert page.locator("#selection .breakdown .xtick text").all_text_contents() == [BOOKS, "web"]
    page.locator(".query-item").first.click()
    page.wait_for_selector(".score-bars .bars path")
    assert page.evaluate("window.__pwned") is None
    assert page.locator("img").count() == 0
    assert EVIL.replace("\u2028", "") in page.inner_text("#query-detail").replace("\u2028", "")
    assert page.inner_text(".query-full") == "question 0 <b>bold?</b>"
    assert opened.errors == [] and opened.requests == [opened.url]


def test_token_highlights_and_evaluations_in_the_browser(browser, token_store, tmp_path):
    opened = PageLog(browser, token_store.report(tmp_path / "report.html"))
    page = opened.page
    page.locator(".query-item").first.click()
    page.wait_for_selector(".score-bars .bars path")
    assert page.locator(".query-full .token").all_inner_texts() == ["what", "<is>"]
    assert page.locator("table.results .token").all_inner_texts() == ["x", "is"]
    assert page.locator("#evaluations td").all_inner_texts() == ["grad-dot", "0.4100"]
    assert opened.errors == [] and opened.requests == [opened.url]


def test_empty_report_in_the_browser(browser, store, tmp_path):
    opened = PageLog(browser, store.report(tmp_path / "empty.html"))
    assert "No attributions in the store yet" in opened.page.inner_text("#queries")
    assert opened.errors == [] and opened.requests == [opened.url]
