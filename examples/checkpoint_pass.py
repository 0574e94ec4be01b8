"""Checkpoint passes, TracIn and influence, and a self-influence audit that finds injected mislabeled examples.

What it shows:
1. training with no capture at all, and at a few checkpoints a *capture pass* over the whole training set and
   the queries at fixed weights (``_toy.capture_pass``: ``store.capture(model, run, checkpoint=...,
   learning_rate=...)`` around forward + backward, no optimizer step). Gradients are exact (``projection=None``,
   548 dims for this MLP); each checkpoint's learning rate lands in the ``checkpoints`` table;
2. ``method="tracin"``: ``sum_c lr_c * q_c . g_c`` over the checkpoint passes, summed exactly before ranking;
3. ``method="fisher"`` (influence with the projected empirical Fisher, damping 0.1 x its mean eigenvalue) at
   the last checkpoint;
4. ``store.self_influence(method="fisher")``: 5% of the training labels were flipped on purpose, and the
   flipped examples rank at the top of self-influence (printed: how many of them are in the top).

Run (CPU, under a minute):

    python examples/checkpoint_pass.py --store /tmp/checkpoint-pass [--quick]

The store directory must be new or empty.
"""

from __future__ import annotations

import _toy
import torch

import gradstore

RUN = "passes"


def main(store_path: str, *, n_train: int, epochs: int, pass_every: int, k: int = 5) -> None:
    """Train with checkpoint passes, attribute with TracIn and influence, audit with self-influence."""
    torch.set_num_threads(1)
    train, queries = _toy.make_data(n_train, 40, mislabel=0.05, seed=1)
    store = gradstore.open(store_path)
    store.add_examples(train.frame())
    store.add_examples(queries.frame())  # the queries' labels, for SQL and for choosing damping (docs/concepts.md)
    model = _toy.train_with_passes(store, RUN, train, queries, epochs=epochs, pass_every=pass_every, projection=None)
    print(
        f"train accuracy {_toy.accuracy(model, train):.2f} (labels as given, flips included), "
        f"held-out accuracy {_toy.accuracy(model, queries):.2f}"
    )
    print(
        store.sql(
            "SELECT c.checkpoint, c.step, round(c.learning_rate, 4) AS learning_rate, "
            "count(*) FILTER (WHERE g.split = 'train') AS train_rows, "
            "count(*) FILTER (WHERE g.split = 'query') AS query_rows "
            "FROM checkpoints c JOIN gradients g USING (run_id, checkpoint) "
            "GROUP BY ALL ORDER BY c.step"
        )
        .df()
        .to_string(index=False)
    )

    # TracIn over every checkpoint pass (default: the checkpoints with a learning rate and query rows).
    tracin = store.attribute(run=RUN, k=k, method="tracin").to_pandas()
    # Influence with the projected Fisher at the latest checkpoint (damping relative to the mean eigenvalue).
    fisher = store.attribute(run=RUN, k=k, method="fisher", damping=0.1).to_pandas()
    label = dict(zip(train.ids + queries.ids, train.y.tolist() + queries.y.tolist()))
    for name, table in (("tracin", tracin), ("fisher", fisher)):
        same = (table.example_id.map(label) == table.query_id.map(label)).mean()
        print(f"{name:7s}: {table.query_id.nunique()} queries x top-{k}; proponents with the query's label {same:.2f}")
    first = queries.ids[0]
    print(f"\ntop-{k} proponents of {first} (label {label[first]}):")
    print(
        store.sql(
            f"SELECT method, rank, round(score, 4) AS score, example_id, label, source "
            f"FROM top_proponents('{first}', {k}) ORDER BY method, rank"
        )
        .df()
        .to_string(index=False)
    )

    # Self-influence g^T (F + damping)^-1 g of every training row at the latest checkpoint.
    audit = store.self_influence(run=RUN, method="fisher").to_pandas()
    flipped = {i for i, bad in zip(train.ids, train.mislabeled) if bad}
    top = audit.example_id.head(len(flipped)).tolist()
    found = len(flipped.intersection(top))
    print(f"\nself-influence (fisher): {len(audit)} training rows scored; the 10 highest:")
    print(
        store.sql(
            "SELECT round(self_influence, 2) AS self_influence, example_id, label, source, mislabeled "
            "FROM most_self_influential(10)"
        )
        .df()
        .to_string(index=False)
    )
    print(
        f"mislabeled in the top-{len(flipped)} of self-influence: {found} of {len(flipped)} "
        f"(random ranking would find about {len(flipped) ** 2 / len(train):.1f})"
    )


if __name__ == "__main__":
    _toy.run_example(
        __doc__, main, quick=dict(n_train=400, epochs=6, pass_every=3), full=dict(n_train=1000, epochs=12, pass_every=4)
    )
