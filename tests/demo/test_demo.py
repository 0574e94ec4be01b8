"""The demo runs end to end on a reduced setting and traces facts better than chance."""

from __future__ import annotations

import gradstore
from gradstore.core.run_basis import run_basis
from gradstore.demo import DemoConfig, run_demo, serve_factory
from gradstore.demo.bm25 import BM25
from gradstore.demo.corpus import build_corpus
from gradstore.demo.run import _checkpoint_epochs
from gradstore.demo.table import BM25_LABEL, SPLITS, query_halves
from gradstore.methods import METHODS
from gradstore.methods.queries import QueryBatch


def test_corpus_is_deterministic_and_holds_out_one_phrasing_per_fact():
    corpus = build_corpus(n_places=5, phrasings=6, seed=3)
    assert corpus == build_corpus(n_places=5, phrasings=6, seed=3)
    assert len(corpus.queries) == 10 and len(corpus.train) == 10 * 5 + 5 * 4
    train_texts = {e.text for e in corpus.train}
    for query in corpus.queries:
        assert query.text not in train_texts
        assert query.text.index(query.answer) > 0  # the value follows the place
        assert sum(e.fact_id == query.fact_id for e in corpus.train) == 5


def test_bm25_prefers_documents_sharing_rare_terms():
    scores = BM25(["the capital of a is b .", "the weather is cold .", "the capital of c is d ."]).scores(
        "capital of a"
    )
    assert scores.argmax() == 0 and scores[1] == 0.0


def test_query_halves_split_places_and_keep_both_facts():
    corpus = build_corpus(n_places=5, phrasings=6, seed=3)
    halves = query_halves({q.example_id: q.fact_id.split(".")[0] for q in corpus.queries})
    assert halves["validation"] | halves["test"] == halves["all"] == {q.example_id for q in corpus.queries}
    assert not halves["validation"] & halves["test"] and len(halves["validation"]) == 6  # places 0, 2, 4
    for half in ("validation", "test"):
        places = [q.rsplit(".", 1)[0] for q in halves[half]]
        assert all(places.count(p) == 2 for p in places)  # a place's capital and language together


def test_demo_end_to_end_reduced(tmp_path):
    config = DemoConfig(
        places=6,
        phrasings=8,
        epochs=10,
        checkpoints=2,
        methods=("grad-dot", "fisher", "tracin", "tracin-steps", "dvemb", "source"),
        shown_queries=1,
    )
    lines: list[str] = []
    summary = run_demo(tmp_path / "demo", config, log=lines.append)
    table = summary["table"]
    assert [row.method for row in table] == [*config.methods, "fisher", "trackstar", None, None]
    dims = f"{summary['dim']:,} dims"
    for row in table[:-2]:  # every attribution row names its registry method, its checkpoints and its dims
        assert row.method in METHODS and row.label.startswith(f"{row.method} @ ") and dims in row.label
    labels = {row.method: row.label for row in table[: len(config.methods)]}
    assert "@ epoch-5 + epoch-10," in labels["tracin"] and "@ epoch-5 + epoch-10," in labels["source"]
    assert "@ epoch-10," in labels["fisher"] and "damping" in labels["fisher"]
    steps = 10 * len(range(0, 6 * 2 * 7 + 6 * 4, config.batch_size))
    assert f"@ {steps} training steps" in labels["tracin-steps"] and f"@ {steps} training steps" in labels["dvemb"]
    assert "eigenvectors on 18 of 22 layer sides" in table[len(config.methods)].label  # token sides random
    assert table[-2].label == BM25_LABEL
    by_label = {row.label: row.recall for row in table}
    assert min(by_label[labels["fisher"]]["all"], by_label[labels["tracin"]]["all"]) > table[-1].recall["all"]
    # the printed table and the RESULT line: best (by validation recall) over BM25, both on the test half
    output = "\n".join(lines).splitlines()
    printed = {}
    for line in output:
        for row in table:
            if line.endswith(f"  {row.label}"):
                printed[row.label] = [float(v) for v in line.split()[:3]]
    assert set(printed) == set(by_label)
    for label, values in printed.items():
        assert values == [round(by_label[label][split], 3) for split in SPLITS]
    best = max((row for row in table if row.method), key=lambda row: row.recall["validation"])
    result = [line for line in output if line.startswith("RESULT demo_best_vs_bm25=")]
    assert len(result) == 1 and best.label in output[output.index(result[0]) - 1]
    value = float(result[0].split("=")[1].split()[0])
    assert value == round(best.recall["test"] / table[-2].recall["test"], 3) == round(summary["best_vs_bm25"], 3)
    assert result[0].endswith("target>=2 PASS" if summary["best_vs_bm25"] >= 2 else "target>=2 MISS")
    store = gradstore.open(tmp_path / "demo", create=False)
    n_train, n_queries = 6 * 2 * 7 + 6 * 4, 12
    assert store.count("gradients", "checkpoint = 'train'") == 10 * n_train
    assert store.count("gradients", "split = 'query' AND run_id = 'demo'") == 2 * n_queries
    assert store.count("gradients", "run_id = 'demo-curvature'") == n_train + n_queries
    assert run_basis(store, "demo-curvature") is not None and run_basis(store, "demo") is None
    written = len(config.methods) + 1  # and trackstar
    assert store.count("scores") == written * n_queries * 10
    assert any("top proponents" in line for line in lines)
    assert store.count("gradients", "run_id = 'demo-trackstar'") == n_train + n_queries
    tokens = store.sql("select side, count(distinct example_id) as n from token_scores group by 1 order by 1").df()
    assert tokens.n.tolist() == [5, 5]  # the query's top-5 fisher proponents, both sides
    assert any("top tokens" in line for line in lines)
    # the saved final weights rebuild the model for gradstore serve --model gradstore.demo:serve_factory
    model, tokenizer, loss_fn = serve_factory(tmp_path / "demo")
    query = build_corpus(6, 8, 0).queries[0]
    words = query.text.split()
    batch = tokenizer(" ".join(words[: words.index(query.answer)]), query.answer)
    assert int((batch["labels"] != -100).sum()) == 1
    final = f"epoch-{_checkpoint_epochs(config)[-1]}"
    top = store.attribute(
        QueryBatch(model, batch, ids=["typed"]), run="demo", k=10, method="grad-dot", checkpoint=final
    )
    fact_of = {e.example_id: e.fact_id for e in build_corpus(6, 8, 0).train}
    assert sum(fact_of[i] == query.fact_id for i in top.column("example_id").to_pylist()) >= 3
