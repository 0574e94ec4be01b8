"""A plain PyTorch training loop under ``store.capture``, then attribution of a few queries, shown through SQL.

What it shows:
1. an ordinary loop (forward, ``loss.backward()``, ``optimizer.step()``) wrapped in ``store.capture``: every
   backward streams one projected gradient per example (factorized/LoGra projection, 8 x 8 per layer) with
   its step, epoch and learning rate into the store; the only added lines name the example ids and epoch;
2. queries given as ``QueryBatch(model, batch)``: their gradients are captured on the fly with the run's
   projection and never stored;
3. ``store.attribute(..., opponents=True)`` over the rows of the last epoch, and the proponents and
   opponents of a query with their text through the shipped SQL macros.

Run (CPU, well under a minute):

    python examples/plain_pytorch_loop.py --store /tmp/plain-loop [--quick]

The store directory must be new or empty.
"""

from __future__ import annotations

import _toy
import torch

import gradstore
from gradstore.methods.queries import QueryBatch

RUN = "plain-loop"


def main(store_path: str, *, n_train: int, epochs: int, n_queries: int = 3, k: int = 5) -> None:
    """Train under capture, attribute ``n_queries`` held-out examples, print their proponents via SQL."""
    torch.set_num_threads(1)
    train, queries = _toy.make_data(n_train, 50, seed=0)
    store = gradstore.open(store_path)
    store.add_examples(train.frame())
    store.add_examples(queries.frame())  # queries too, so SQL can show their text

    model = _toy.make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(0)
    with store.capture(model, RUN, optimizer=optimizer, projection="factorized", k_in=8, k_out=8) as cap:
        for epoch in range(1, epochs + 1):
            cap.set_epoch(epoch)  # added line 1: the epoch recorded on the rows
            for ids, batch in train.batches(32, generator):
                cap.set_ids(ids)  # added line 2: the example ids of the next forward
                loss = _toy.loss_fn(model, batch)  # the loop itself is unchanged
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            print(f"epoch {epoch}: last batch loss {loss.item():.3f}")
    print(f"train accuracy {_toy.accuracy(model, train):.2f}, held-out accuracy {_toy.accuracy(model, queries):.2f}")
    print(
        store.sql(
            "SELECT epoch, count(*) AS rows, min(step) AS first_step, max(step) AS last_step, "
            "round(avg(learning_rate), 4) AS lr FROM gradients GROUP BY epoch ORDER BY epoch"
        )
        .df()
        .to_string(index=False)
    )

    # Queries: a model and a batch, captured with the run's projection (nothing is written to gradients).
    chosen = list(range(n_queries))
    query_batch = QueryBatch(
        model,
        {"x": queries.x[chosen], "y": queries.y[chosen]},
        ids=[queries.ids[i] for i in chosen],
        loss_fn=_toy.loss_fn,
    )
    result = store.attribute(
        query_batch, run=RUN, k=k, method="grad-dot", opponents=True, where=f"epoch = {epochs}"
    )  # the gradients of the last epoch
    print(f"\nattribute -> {result.num_rows} rows {result.column_names}")

    for query_id in query_batch.ids:
        query = store.sql(f"SELECT text FROM examples WHERE example_id = '{query_id}'").fetchall()[0][0]
        print(f"\nquery {query_id}: {query}")
        print("  proponents (rank 1 = most helpful):")
        print(
            store.sql(f"SELECT rank, round(score, 4) AS score, example_id, text FROM top_proponents('{query_id}', {k})")
            .df()
            .to_string(index=False)
        )
        print("  opponents (rank 1 = most harmful):")
        print(
            store.sql(f"SELECT rank, round(score, 4) AS score, example_id, text FROM top_opponents('{query_id}', {k})")
            .df()
            .to_string(index=False)
        )

    agreement = store.sql("""
        SELECT round(avg(CASE WHEN e.label = q.label THEN 1 ELSE 0 END), 3) AS share
        FROM scores s JOIN examples e USING (example_id) JOIN examples q ON q.example_id = s.query_id
        WHERE s.rank >= 1""").fetchall()[0][0]
    print(f"\nproponents with the query's label: {agreement} (chance: {1 / _toy.CLASSES:.2f})")


if __name__ == "__main__":
    _toy.run_example(__doc__, main, quick=dict(n_train=300, epochs=3), full=dict(n_train=1000, epochs=8))
