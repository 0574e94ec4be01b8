"""LESS-style data selection: the 10% of a training set most aligned with a small target set, exported.

What it shows:
1. checkpoint passes (``_toy.train_with_passes``) with a dense JL projection (``projection="dense"``, 8 x 8 =
   64 dims per layer): training rows and the candidate target rows (``split="query"``) at three checkpoints;
2. ``store.select(target, budget=0.1)``: for every training example, the max over the target set of the
   cosine between gradients, summed over checkpoints with learning-rate weights (LESS), then the top 10%;
   the same with ``preconditioner="fisher"`` (cosine in the Fisher-whitened space);
3. the target is the held-out examples of one source (``code``); the selection is mostly ``code`` although
   the training set is a third ``code``;
4. export: ``gradstore.answers.selection.export_selection`` writes parquet,
   ``gradstore.answers.selection.filter_dataset``
   filters a Hugging Face ``datasets.Dataset`` down to the selected rows (needs the ``hf`` extra).

Run (CPU, under a minute):

    python examples/data_selection.py --store /tmp/selection [--quick]

The store directory must be new or empty; the parquet file and the dataset are written beside it
(``<store>-selection.parquet``, ``<store>-selected-dataset/``).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import _toy
import datasets
import pyarrow.parquet as pq
import torch

import gradstore
from gradstore.answers.selection import export_selection, filter_dataset

RUN = "selection"
TARGET_SOURCE = "code"


def main(store_path: str, *, n_train: int, epochs: int, pass_every: int, n_target: int = 8) -> None:
    """Capture checkpoint passes, select 10% of the training set for a target set, export the selection."""
    torch.set_num_threads(1)
    datasets.disable_progress_bars()
    train, candidates = _toy.make_data(n_train, 60, seed=2)
    store = gradstore.open(store_path)
    store.add_examples(train.frame())
    _toy.train_with_passes(
        store, RUN, train, candidates, epochs=epochs, pass_every=pass_every, projection="dense", k_in=8, k_out=8
    )
    target = [i for i, s in zip(candidates.ids, candidates.source) if s == TARGET_SOURCE][:n_target]
    base_rate = train.source.count(TARGET_SOURCE) / len(train)
    print(
        f"target: {len(target)} held-out '{TARGET_SOURCE}' examples; '{TARGET_SOURCE}' is {base_rate:.2f} "
        f"of the {len(train)} training examples"
    )

    for preconditioner in ("grad-dot", "fisher"):
        selection = store.select(target, run=RUN, budget=0.1, preconditioner=preconditioner)
        chosen = set(selection.column("example_id").to_pylist())
        share = sum(s == TARGET_SOURCE for i, s in zip(train.ids, train.source) if i in chosen) / len(chosen)
        print(
            f"select(budget=0.1, preconditioner={preconditioner!r}): {selection.num_rows} examples, "
            f"'{TARGET_SOURCE}' share {share:.2f}"
        )
    print(selection.to_pandas().head(5).to_string(index=False))

    # Export: parquet (example_id, score, rank) and a filtered Hugging Face dataset with the full rows.
    parquet_path = export_selection(selection, f"{store_path.rstrip('/')}-selection.parquet")
    print(f"wrote {pq.read_metadata(parquet_path).num_rows} rows to {parquet_path}")
    dataset = datasets.Dataset.from_pandas(train.frame())
    selected = filter_dataset(dataset, selection)
    selected.save_to_disk(f"{store_path.rstrip('/')}-selected-dataset")
    print(f"filtered datasets.Dataset: {len(selected)} of {len(dataset)} rows, columns {selected.column_names}")
    print(f"source counts of the selection: {selected.to_pandas().source.value_counts().to_dict()}")


if __name__ == "__main__":
    _toy.run_example(
        __doc__, main, quick=dict(n_train=300, epochs=4, pass_every=2), full=dict(n_train=1200, epochs=9, pass_every=3)
    )
