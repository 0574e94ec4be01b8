"""A small CNN on 8x8 digit images trained under ``store.capture``, then the training images behind a few test
predictions.

What it shows:
1. a plain PyTorch loop training ``Conv2d -> ReLU -> Conv2d -> ReLU -> Linear`` on scikit-learn's bundled digits
   (nothing downloaded) inside ``store.capture``: the convolutions are captured like linear layers, each one's
   per-example gradient taken at the convolution op in its im2col view ``[C_out, C_in x 3 x 3 + bias]`` and
   projected (factorized, at most 16 x 16 per layer); ``store.info()["coverage"]`` says every trainable weight of
   the run was captured (docs/capture.md, "What is captured, and how");
2. a checkpoint pass at the trained weights (``checkpoint="final"``: every training image's row, no step);
3. ``store.attribute(QueryBatch(...), method="fisher")`` for a few test images (influence with the projected
   Fisher of the final rows; the query rows are captured on the fly and not stored), their top proponents with
   labels through the ``top_proponents`` SQL macro, and the first test image drawn beside its top proponent.

Run (CPU, a few seconds):

    python examples/vision_cnn.py --store /tmp/vision-cnn [--quick]

The store directory must be new or empty; the digits come with scikit-learn (the ``bench`` extra).
``bench/fidelity_vision.py`` measures how well such scores predict
retraining (LDS) on the same data.
"""

from __future__ import annotations

import _toy
import pandas as pd
import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.nn import functional as F

import gradstore
from gradstore.methods.queries import QueryBatch

RUN = "digits-cnn"
SHADES = " .:-=+*#%@"  # pixel intensity 0..16 as text


def make_model(seed: int = 0) -> nn.Module:
    """Two convolutions and a linear head for ``[n, 1, 8, 8]`` images."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(16 * 4 * 4, 10),
    )


def loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean cross-entropy of a batch (capture's default ``loss_reduction="mean"`` undoes the mean)."""
    return F.cross_entropy(model(batch["x"]), batch["y"])


def draw(*images: torch.Tensor) -> str:
    """8x8 images (pixels 0..16) side by side as text."""
    return "\n".join(
        "   ".join(
            "".join(SHADES[min(int(v) * len(SHADES) // 17, len(SHADES) - 1)] * 2 for v in image[r]) for image in images
        )
        for r in range(8)
    )


def main(store_path: str, *, n_train: int, epochs: int, n_queries: int = 4, k: int = 5) -> None:
    """Train under capture, run a final checkpoint pass, attribute ``n_queries`` test images."""
    torch.set_num_threads(1)
    digits = load_digits()
    order = torch.randperm(len(digits.target), generator=torch.Generator().manual_seed(0))
    pixels = torch.tensor(digits.images, dtype=torch.float32)  # [1797, 8, 8], 0..16
    labels = torch.tensor(digits.target)
    train, test = order[:n_train], order[n_train : n_train + n_queries]
    x, y = pixels[train, None] / 16, labels[train]
    ids = [f"img-{int(i):04d}" for i in train]
    query_ids = [f"img-{int(i):04d}" for i in test]
    store = gradstore.open(store_path)
    store.add_examples(
        pd.DataFrame(
            {
                "example_id": ids + query_ids,
                "text": [f"digit {int(labels[i])}" for i in torch.cat([train, test])],
                "label": labels[torch.cat([train, test])].tolist(),
            }
        )
    )

    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(0)
    with store.capture(model, RUN, optimizer=optimizer, projection="factorized", k_in=16, k_out=16) as cap:
        for epoch in range(1, epochs + 1):
            cap.set_epoch(epoch)
            for rows in torch.randperm(n_train, generator=generator).split(64):
                cap.set_ids([ids[i] for i in rows.tolist()])  # the example ids of the next forward
                loss = loss_fn(model, {"x": x[rows], "y": y[rows]})
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            print(f"epoch {epoch}: last batch loss {loss.item():.3f}")
    with torch.no_grad():
        held_out = pixels[order[n_train : n_train + 300], None] / 16
        accuracy = (model(held_out).argmax(1) == labels[order[n_train : n_train + 300]]).float().mean()
    print(f"held-out accuracy {float(accuracy):.3f} (300 test images)")

    # Rows at the trained weights: every training image once, no optimizer step.
    with store.capture(model, RUN, checkpoint="final", learning_rate=optimizer.param_groups[0]["lr"]) as cap:
        for rows in torch.arange(n_train).split(256):
            cap.set_ids([ids[i] for i in rows.tolist()])
            loss_fn(model, {"x": x[rows], "y": y[rows]}).backward()
            model.zero_grad()

    coverage = store.info()["coverage"][RUN]
    print(
        f"\ncoverage of run {RUN!r}: {coverage['fraction']:.0%} of {coverage['trainable']:,} trainable weights "
        f"captured, {len(coverage['captured'])} parameters: {', '.join(coverage['captured'])}; "
        f"not captured: {coverage['not_captured'] or 'none'}; {store.dim} dims a row"
    )

    queries = QueryBatch(model, {"x": pixels[test, None] / 16, "y": labels[test]}, ids=query_ids, loss_fn=loss_fn)
    result = store.attribute(queries, run=RUN, k=k, method="fisher", checkpoint="final", damping=0.1)
    print(f"\nattribute -> {result.num_rows} rows (method fisher, checkpoint 'final')")
    for query_id in query_ids:
        label = store.sql(f"SELECT label FROM examples WHERE example_id = '{query_id}'").fetchall()[0][0]
        print(f"\ntest image {query_id} (digit {label}): proponents (rank 1 = most helpful)")
        print(
            store.sql(
                f"SELECT rank, round(score, 4) AS score, example_id, label FROM top_proponents('{query_id}', {k})"
            )
            .df()
            .to_string(index=False)
        )
    top = result.to_pandas()
    first = top[(top.query_id == query_ids[0]) & (top["rank"] == 1)].example_id.iloc[0]
    print(f"\n{query_ids[0]} and its top proponent {first}:")
    print(draw(pixels[test[0]], pixels[int(first.split("-")[1])]))
    share = store.sql("""
        SELECT round(avg(CASE WHEN e.label = q.label THEN 1 ELSE 0 END), 3)
        FROM scores s JOIN examples e USING (example_id) JOIN examples q ON q.example_id = s.query_id
        WHERE s.rank >= 1""").fetchall()[0][0]
    print(f"\nproponents with the query's label: {share} (chance: 0.10)")


if __name__ == "__main__":
    _toy.run_example(__doc__, main, quick=dict(n_train=500, epochs=3), full=dict(n_train=1200, epochs=6))
