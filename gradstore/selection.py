"""Data selection (LESS-style): the training examples whose gradients align best with a target set.

``score(x) = sum_c lr_c * agg_{q in target} cos(P_c^-1/2 g_c(x), P_c^-1/2 q_c)`` with ``agg`` the max (LESS)
or the mean over the target's query rows, ``P_c`` the preconditioner fitted at checkpoint ``c``
(identity: plain cosine; ``fisher``/``diagonal``/``kfac``: cosine in the whitened space) and ``lr_c`` the
checkpoint's learning rate. The top ``budget`` examples (a fraction of the examples or a count) are selected.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from gradstore.attribution import ExampleScores, _selection_blocks, learning_rates
from gradstore.index import Selection, make_method_preconditioner
from gradstore.methods import DEFAULT_DAMPING, resolve_method
from gradstore.queries import resolve_queries

if TYPE_CHECKING:
    from gradstore.store import GradStore

AGGREGATES = ("max", "mean")


def select(store: GradStore, target: Any = None, *, run: str, budget: float = 0.05,
           preconditioner: str = "grad-dot", aggregate: str = "max", checkpoints: Sequence[str] | None = None,
           damping: float | None = None, split: str = "train", where: str | None = None) -> pa.Table:
    """Select training examples for ``target`` queries (any form :func:`resolve_queries` accepts).

    ``preconditioner`` names the space the cosine is taken in: a method name whose preconditioner is used
    (``grad-dot`` = identity, ``diagonal``, ``fisher``, ``kfac``). Returns ``(example_id, score, rank)`` for the
    selected examples, best first.
    """
    if aggregate not in AGGREGATES:
        raise ValueError(f"aggregate must be one of {AGGREGATES}, got {aggregate!r}")
    method = resolve_method(preconditioner)
    try:
        rates = learning_rates(store, run, checkpoints)
    except ValueError:
        if checkpoints is not None:
            raise
        from gradstore.attribution import default_checkpoint

        rates = {default_checkpoint(store, run): 1.0}  # no learning rates recorded: one unweighted checkpoint
    totals: ExampleScores | None = None
    target_ids: list[str] | None = None
    for checkpoint, rate in rates.items():
        selection = Selection(run, checkpoint, split, where)
        fitted = make_method_preconditioner(store, selection, method, DEFAULT_DAMPING if damping is None else damping)
        fitted.fit(vectors for _, vectors in selection.blocks(store)())
        resolved = resolve_queries(store, target, run, checkpoint)
        target_ids = target_ids or resolved.ids
        queries = _unit(fitted.apply_both(torch.from_numpy(resolved.vectors).to(torch.float64)))
        totals = totals or ExampleScores(1)
        for example_ids, vectors in _selection_blocks(store, selection):
            cosines = queries @ _unit(fitted.apply_both(vectors.to(torch.float64))).T
            reduced = cosines.max(dim=0).values if aggregate == "max" else cosines.mean(dim=0)
            totals.add(example_ids, rate * reduced[None])
    scores = totals.matrix[0].numpy()
    example_ids = np.asarray(totals.example_ids, dtype=object)
    count = budget_count(budget, len(example_ids))
    order = np.lexsort((example_ids.astype(str), -scores))[:count]
    return pa.table({"example_id": pa.array(example_ids[order].tolist(), pa.string()),
                     "score": pa.array(scores[order], pa.float64()),
                     "rank": pa.array(np.arange(1, count + 1, dtype=np.int32))})


def budget_count(budget: float, n_examples: int) -> int:
    """Examples to select: ``budget`` in (0, 1] is a fraction (rounded up), an int >= 1 a count."""
    if isinstance(budget, bool) or budget <= 0:
        raise ValueError(f"budget must be a fraction in (0, 1] or a positive count, got {budget!r}")
    if isinstance(budget, float) and budget <= 1.0:
        return min(n_examples, math.ceil(budget * n_examples))
    if float(budget) != int(budget):
        raise ValueError(f"a budget above 1 must be a whole number of examples, got {budget!r}")
    return min(n_examples, int(budget))


def _unit(rows: torch.Tensor) -> torch.Tensor:
    norms = rows.norm(dim=1, keepdim=True)
    return rows / torch.where(norms > 0, norms, torch.ones_like(norms))


def export_selection(selection: pa.Table, path: str | Path) -> Path:
    """Write a selection to parquet."""
    path = Path(path)
    pq.write_table(selection, path)
    return path


def filter_dataset(dataset: Any, selection: pa.Table, id_column: str = "example_id") -> Any:
    """The rows of an HF ``datasets.Dataset`` whose ``id_column`` is in the selection (order kept)."""
    chosen = set(selection.column("example_id").to_pylist())
    return dataset.filter(lambda row: str(row[id_column]) in chosen)
