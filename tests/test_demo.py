"""The demo runs end to end on a reduced setting and traces facts better than chance."""

from __future__ import annotations

import gradstore
from gradstore.demo import DemoConfig, run_demo, serve_factory
from gradstore.demo.bm25 import BM25
from gradstore.demo.corpus import build_corpus
from gradstore.demo.run import _checkpoint_epochs
from gradstore.queries import QueryBatch
from gradstore.run_basis import run_basis


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


def test_demo_end_to_end_reduced(tmp_path):
    config = DemoConfig(
        places=6, phrasings=8, epochs=10, checkpoints=2, methods=("grad-dot", "fisher", "tracin"), shown_queries=1
    )
    lines: list[str] = []
    summary = run_demo(tmp_path / "demo", config, log=lines.append)
    recall = summary["recall"]
    assert set(recall) == {
        "grad-dot",
        "fisher",
        "tracin",
        "fisher (curvature)",
        "trackstar (adam)",
        "bm25 (lexical)",
        "random",
    }
    assert min(recall["fisher"], recall["tracin"], recall["fisher (curvature)"]) > recall["random"]
    store = gradstore.open(tmp_path / "demo", create=False)
    n_train, n_queries = 6 * 2 * 7 + 6 * 4, 12
    assert store.count("gradients", "checkpoint = 'train'") == 10 * n_train
    assert store.count("gradients", "split = 'query' AND run_id = 'demo'") == 2 * n_queries
    assert store.count("gradients", "run_id = 'demo-curvature'") == n_train + n_queries
    assert run_basis(store, "demo-curvature") is not None and run_basis(store, "demo") is None
    assert store.count("scores") == 3 * n_queries * 10
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
