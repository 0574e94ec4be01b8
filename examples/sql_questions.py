"""Questions about influence in SQL: the shipped DuckDB macros and custom joins, as pandas and polars.

What it shows, after checkpoint passes (``_toy.train_with_passes``, default factorized projection), influence
attribution with opponents (``method="fisher"``) and a self-influence audit, all written to the store:

- ``top_proponents(query, k)`` / ``top_opponents(query, k)``: a query's strongest supporters/opposers with
  their ``examples`` columns;
- ``influential_examples(k, min_queries)``: training examples in the top-k of many queries;
- ``influence_by(column)``: proponent scores aggregated by an ``examples`` column (``'source'``, ``'label'``);
- ``most_self_influential(n)``: the audit's top rows with their columns (flipped labels show up here);
- custom joins: proponents vs opponents by whether they share the query's label (``examples`` joined twice),
  mislabeled examples among proponents and opponents, and self-influence against the stored gradient norm;
- results as pandas (``.df()``) and polars (``.pl()``) DataFrames; ``.arrow()`` gives Arrow.

Run (CPU, under a minute):

    python examples/sql_questions.py --store /tmp/sql-questions [--quick]

The store directory must be new or empty. Afterwards try ``gradstore sql /tmp/sql-questions "SELECT ..."``.
"""

from __future__ import annotations

import _toy
import torch

import gradstore

RUN = "sql"


def show(title: str, frame) -> None:
    """Print a titled result (pandas or polars)."""
    print(f"\n-- {title}\n{frame}")


def main(store_path: str, *, n_train: int, epochs: int, k: int = 5) -> None:
    """Fill a store with scores and self-influence, then ask it questions in SQL."""
    torch.set_num_threads(1)
    train, queries = _toy.make_data(n_train, 30, mislabel=0.05, seed=3)
    store = gradstore.open(store_path)
    store.add_examples(train.frame())
    store.add_examples(queries.frame())  # query rows too: joins can compare a query with its proponents
    _toy.train_with_passes(store, RUN, train, queries, epochs=epochs, pass_every=epochs)
    store.attribute(run=RUN, k=k, method="fisher", opponents=True)  # -> scores
    store.self_influence(run=RUN, method="fisher")  # -> self_influence

    query = queries.ids[0]
    show(
        f"top_proponents('{query}', {k})  [pandas]",
        store.sql(
            f"SELECT rank, round(score, 3) AS score, example_id, label, source, mislabeled "
            f"FROM top_proponents('{query}', {k})"
        )
        .df()
        .to_string(index=False),
    )
    show(
        f"top_opponents('{query}', {k})  [polars]",
        store.sql(
            f"SELECT rank, round(score, 3) AS score, example_id, label, source, mislabeled "
            f"FROM top_opponents('{query}', {k})"
        ).pl(),
    )
    show(
        f"influential_examples({k}, 3): in the top-{k} of at least 3 queries",
        store.sql(
            f"SELECT i.*, e.label, e.source FROM influential_examples({k}, 3) i "
            f"JOIN examples e USING (example_id) ORDER BY i.queries DESC, i.mean_score DESC LIMIT 8"
        )
        .df()
        .to_string(index=False),
    )
    show("influence_by('source')  [polars]", store.sql("SELECT * FROM influence_by('source')").pl())
    show("influence_by('label')", store.sql("SELECT * FROM influence_by('label')").df().to_string(index=False))
    show(
        "most_self_influential(8)",
        store.sql(
            "SELECT round(self_influence, 1) AS self_influence, example_id, label, source, mislabeled "
            "FROM most_self_influential(8)"
        )
        .df()
        .to_string(index=False),
    )

    # Custom: do proponents share the query's label, and opponents not? (examples joined on both sides)
    show(
        "custom: share of results with the query's label, proponents vs opponents",
        store.sql("""
            SELECT CASE WHEN s.rank > 0 THEN 'proponent' ELSE 'opponent' END AS side,
                   count(*) AS results, round(avg((e.label = q.label)::INT), 3) AS same_label,
                   round(avg((e.source = q.source)::INT), 3) AS same_source
            FROM scores s
            JOIN examples e ON e.example_id = s.example_id
            JOIN examples q ON q.example_id = s.query_id
            GROUP BY side ORDER BY side DESC""")
        .df()
        .to_string(index=False),
    )
    # Custom: how often do (injected) mislabeled examples appear among proponents and opponents?
    show(
        "custom: mislabeled examples among results (base rate in the training set below)",
        store.sql("""
            SELECT CASE WHEN rank > 0 THEN 'proponent' ELSE 'opponent' END AS side,
                   round(avg(mislabeled::INT), 3) AS mislabeled_share,
                   (SELECT round(avg(mislabeled::INT), 3) FROM examples WHERE example_id LIKE 'train-%') AS base_rate
            FROM scores JOIN examples USING (example_id) GROUP BY side ORDER BY side DESC""").pl(),
    )
    # Custom: self-influence against the stored gradient norm (gradients' metadata, joined by grad_id).
    show(
        "custom: self-influence vs gradient norm, by mislabeled",
        store.sql("""
            SELECT e.mislabeled, count(*) AS examples, round(avg(si.self_influence), 1) AS mean_self_influence,
                   round(avg(g.grad_norm), 3) AS mean_grad_norm,
                   round(corr(si.self_influence, g.grad_norm), 3) AS corr
            FROM self_influence si JOIN gradients g USING (grad_id) JOIN examples e ON e.example_id = si.example_id
            GROUP BY e.mislabeled ORDER BY e.mislabeled""")
        .df()
        .to_string(index=False),
    )


if __name__ == "__main__":
    _toy.run_example(__doc__, main, quick=dict(n_train=300, epochs=4), full=dict(n_train=1000, epochs=8))
