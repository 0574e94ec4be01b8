"""Per-token attribution for language models: which training tokens carry a query's influence, and which query
tokens it explains.

A re-rank stage over the stored rows: the query's top-k training examples are found in the store (the exact
index :meth:`~gradstore.GradStore.attribute` uses), then only those k examples (and the query) are run through
the model again under :class:`~ingest.tokens.TokenGradientCapture`, with the run's projection, normaliser and loss
scaling, giving each token's share ``g_t`` of the example's row ``g = sum_t g_t``. For a method linear in the
training gradient (``score = q^T P^-1 g``, ``P`` symmetric) the scores decompose exactly:

- training side: ``score_t = (P^-1 q) . g_t``, summing to the example's score;
- query side: ``score_u = q_u . (P^-1 g)``, summing to it too.

The per-token example score (the sum) is that of the recomputed rows; it equals the stored ranking's score up
to the storage dtype's rounding. Results land in ``token_scores`` (see :data:`TOKEN_SCORES_SCHEMA`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from torch import nn

from gradstore.capture.session import config_for_run
from gradstore.core import StoreCore
from gradstore.core.catalog import check_spec
from gradstore.errors import InvalidArgumentError, MissingIdsError
from gradstore.methods import ScoreOptions
from gradstore.methods.queries import QueryBatch
from gradstore.preconditioning.fitting import FitCache, Selection
from gradstore.search.arguments import check_k
from gradstore.search.building import build_index
from ingest import CaptureConfig
from ingest.tokens import TokenGradientCapture, TokenRows

TOKEN_SCORES = "token_scores"
TOKEN_SCORES_SCHEMA = pa.schema(
    [
        pa.field("query_id", pa.string()),
        pa.field("example_id", pa.string()),  # the training example (also on the query side's rows)
        pa.field("rank", pa.int32()),  # the training example's rank among the query's proponents (1 = top)
        pa.field("side", pa.string()),  # "train": a token of the training example; "query": a token of the query
        pa.field("position", pa.int32()),  # the token's index in its sequence
        pa.field("token_id", pa.int64()),
        pa.field("token", pa.string()),
        pa.field("score", pa.float64()),  # the token's share of the (query, example) score
        pa.field("method", pa.string()),
        pa.field("run_id", pa.string()),
        pa.field("checkpoint", pa.string()),
        pa.field("created_at", pa.timestamp("us", tz="UTC")),
    ]
)
ExampleBatches = Callable[[list[str]], Any]
"""``examples(ids) -> batch``: the model's input for training examples by id (tokenized, padded)."""
TokenText = Callable[[int], str]
"""``token_text(token_id) -> str``: how a token id is shown (e.g. a tokenizer's ``convert_ids_to_tokens``)."""


def default_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """``model(**batch).loss`` (a Hugging Face style model and a dict batch)."""
    return model(**batch).loss


def token_scores(
    store: StoreCore,
    fits: FitCache,
    queries: QueryBatch,
    examples: ExampleBatches,
    options: ScoreOptions,
    *,
    run: str,
    k: int = 10,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    token_text: TokenText | None = None,
    batch_size: int = 8,
    write: bool = True,
) -> pa.Table:
    """Per-token scores of each query against its top-k training examples; see
    :meth:`gradstore.GradStore.token_scores`."""
    k = check_k(k)
    if write:
        store.require_writable("token_scores with write=True")
    resolved = options.check("token_scores")  # methods linear in the training gradient only
    if not isinstance(queries, QueryBatch):
        raise InvalidArgumentError(
            "token_scores takes the queries as a QueryBatch (model and batch): their tokens are needed"
        )
    checkpoint = options.checkpoint or store.default_checkpoint(run)
    selection = Selection(run, checkpoint, options.split, options.where)
    index = build_index(store, fits, selection, resolved, damping=options.damping, blocks=options.blocks)
    model = queries.model
    query_config = config_for_run(store, run, {"split": "query", "checkpoint": checkpoint, **queries.options})
    query_tokens = _token_rows(
        store,
        run,
        model,
        queries.batch,
        queries.loss_fn or default_loss,
        query_config,
        None if queries.ids is None else list(queries.ids),
    )
    query_rows = query_tokens.rows.sum(dim=1)
    _, grad_ids = index.search(query_rows, k)  # the store's top-k: the only examples recomputed
    example_of = store.example_ids_for(grad_ids.reshape(-1), run)
    top = [(q, rank + 1, example_of[int(g)]) for q in range(len(grad_ids)) for rank, g in enumerate(grad_ids[q])]
    wanted = sorted({example_id for _, _, example_id in top})
    train_config = config_for_run(store, run, {"split": "train", "checkpoint": checkpoint})
    train_tokens = {}
    for start in range(0, len(wanted), batch_size):
        ids = wanted[start : start + batch_size]
        rows = _token_rows(store, run, model, examples(ids), loss_fn or default_loss, train_config, ids)
        if rows.example_ids != ids:
            raise MissingIdsError(f"examples({ids}) returned a batch of examples {rows.example_ids}")
        train_tokens.update({example_id: (rows, b) for b, example_id in enumerate(ids)})

    space = index.space
    prepared = space.queries(query_rows).to(torch.float64)
    builder = _TableBuilder(token_text)
    for q, rank, example_id in top:
        tokens, b = train_tokens[example_id]
        train_rows = tokens.rows[b].to(torch.float64)
        query_id = query_tokens.example_ids[q]
        builder.add(query_id, example_id, rank, "train", tokens, b, (train_rows @ prepared[q]).numpy())
        example_prepared = space.queries(train_rows.sum(dim=0, keepdim=True)).to(torch.float64)[0]
        builder.add(
            query_id,
            example_id,
            rank,
            "query",
            query_tokens,
            q,
            (query_tokens.rows[q].to(torch.float64) @ example_prepared).numpy(),
        )
    table = builder.table(resolved.name, run, checkpoint)
    if write:
        store.results.append_table(TOKEN_SCORES, table)
    return table


def _token_rows(
    store: StoreCore,
    run: str,
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[..., torch.Tensor],
    config: CaptureConfig,
    ids: Sequence[str] | None,
) -> TokenRows:
    """Per-token rows of one batch with the run's projection; the model's ``.grad`` are left as they were."""
    saved = {name: None if p.grad is None else p.grad.clone() for name, p in model.named_parameters()}
    try:
        capture = TokenGradientCapture(model, config)
        check_spec(store.run_spec(run), capture.spec)
        with capture:
            if ids is not None:
                capture.set_ids(list(ids))
            loss_fn(model, batch).backward()
    except ValueError as error:
        raise InvalidArgumentError(str(error)) from error
    finally:
        for name, p in model.named_parameters():
            p.grad = saved[name]
    if len(capture.results) != 1:
        raise InvalidArgumentError(
            f"the loss function ran {len(capture.results)} captured forwards; per-token "
            "scores need exactly one per batch"
        )
    return capture.results[0]


class _TableBuilder:
    """Collects token rows (positions that are tokens only) into a ``token_scores`` table."""

    def __init__(self, token_text: TokenText | None) -> None:
        self.token_text = token_text
        self.columns: dict[str, list] = {
            name: [] for name in ("query_id", "example_id", "rank", "side", "position", "token_id", "token", "score")
        }

    def add(
        self, query_id: str, example_id: str, rank: int, side: str, tokens: TokenRows, b: int, scores: np.ndarray
    ) -> None:
        positions = np.arange(len(scores)) if tokens.mask is None else tokens.mask[b].nonzero()[:, 0].numpy()
        token_ids = [None] * len(positions) if tokens.inputs is None else tokens.inputs[b, positions].tolist()
        n = len(positions)
        self.columns["query_id"] += [query_id] * n
        self.columns["example_id"] += [example_id] * n
        self.columns["rank"] += [rank] * n
        self.columns["side"] += [side] * n
        self.columns["position"] += positions.tolist()
        self.columns["token_id"] += token_ids
        self.columns["token"] += [
            None if t is None else (self.token_text(t) if self.token_text else str(t)) for t in token_ids
        ]
        self.columns["score"] += scores[positions].tolist()

    def table(self, method: str, run: str, checkpoint: str) -> pa.Table:
        n = len(self.columns["score"])
        now = datetime.now(timezone.utc)
        return pa.Table.from_pydict(
            {
                **self.columns,
                "method": [method] * n,
                "run_id": [run] * n,
                "checkpoint": [checkpoint] * n,
                "created_at": [now] * n,
            },
            schema=TOKEN_SCORES_SCHEMA,
        )
