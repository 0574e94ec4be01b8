"""The ``evaluations`` table and what LDS and QLD share: the training and query ids, every training example's
score for every query, the scored variants (``methods``) checked, and appending one evaluation's rows."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import fields
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from gradstore.core import sql_literal
from gradstore.errors import GradstoreError, InvalidArgumentError
from gradstore.methods import DEFAULT_METHOD, ScoreOptions

if TYPE_CHECKING:
    from gradstore.store import GradStore

TrainFn = Callable[[list[list[str]], list[str], int], Any]


def retrained_losses(train_fn: TrainFn, subsets: list[list[str]], queries: list[str], seed: int) -> np.ndarray:
    """``train_fn(subsets, queries, seed)``, the user's retraining: its losses ``[len(subsets), len(queries)]`` as
    float64. An exception it raises (or a result that is not such a matrix) is an ``InvalidArgumentError`` naming
    the function, like every user function that fails."""
    try:
        result = np.asarray(train_fn(subsets, queries, seed), dtype=np.float64)
    except GradstoreError:
        raise
    except Exception as error:
        raise InvalidArgumentError(
            f"train_fn {_spelled(train_fn)} failed ({type(error).__name__}: {error}): give your retraining function "
            "f(subsets, queries, seed) returning losses [subsets, queries]"
        ) from error
    if result.shape != (len(subsets), len(queries)):
        raise InvalidArgumentError(
            f"train_fn returned shape {result.shape}, expected [subsets, queries] = ({len(subsets)}, {len(queries)}) "
            f"(train_fn is {_spelled(train_fn)})"
        )
    return result


def _spelled(function: Any) -> str:
    """``module.name`` of a function (its repr when it has no name)."""
    name = getattr(function, "__qualname__", None)
    return f"{getattr(function, '__module__', None) or '?'}.{name}" if name else repr(function)


EVALUATIONS = "evaluations"

EVALUATIONS_SCHEMA = pa.schema(
    [
        pa.field("evaluation_id", pa.string()),
        pa.field("run_id", pa.string()),
        pa.field("label", pa.string()),  # the caller's name for the scored variant
        pa.field("method", pa.string()),
        pa.field("options", pa.string()),  # JSON of the attribute() options
        pa.field("metric", pa.string()),
        pa.field("value", pa.float64()),
        pa.field("stderr", pa.float64()),
        pa.field("noise_ceiling", pa.float64()),
        pa.field("queries", pa.int32()),
        pa.field("subsets", pa.int32()),
        pa.field("seeds", pa.string()),  # JSON list
        pa.field("fraction", pa.float64()),
        pa.field("seed", pa.int64()),
        pa.field("created_at", pa.timestamp("us", tz="UTC")),
    ]
)

DEFAULT_METHODS: dict[str, dict[str, Any]] = {"grad-dot": {"method": "grad-dot"}, "fisher": {"method": "fisher"}}


def training_ids(store: GradStore, run: str, split: str = "train") -> list[str]:
    """The distinct example ids of a run's ``split`` rows, sorted."""
    store.run(run)
    relation = store.sql(
        f"SELECT DISTINCT example_id FROM gradients WHERE run_id = {sql_literal(run)} "
        f"AND split = {sql_literal(split)} ORDER BY example_id"
    )
    return [row[0] for row in relation.fetchall()]


def query_ids(store: GradStore, run: str) -> list[str]:
    """The distinct example ids of a run's query rows, sorted (what the evaluate commands use by default)."""
    return training_ids(store, run, split="query")


def scores_by_example(
    store: GradStore, run: str, queries: Sequence[str] | np.ndarray, train_ids: Sequence[str], **options: Any
) -> np.ndarray:
    """Every training example's score for every query, ``[queries, len(train_ids)]``, from
    ``store.attribute(..., write=False)`` (scores of several rows of one example are summed). Rows follow
    ``queries`` when they are ids, else the order the queries were scored in."""
    k = store.core.gradient_table(run).count_rows(f"run_id = {sql_literal(run)} AND split = 'train'")
    table = store.attribute(queries, run=run, k=k, write=False, **options)
    query_ids = table.column("query_id").to_pylist()
    named = isinstance(queries, (list, tuple)) and set(query_ids) <= set(map(str, queries))
    order = {q: i for i, q in enumerate(dict.fromkeys(map(str, queries) if named else query_ids))}
    column = {e: i for i, e in enumerate(train_ids)}
    rows = np.fromiter((order[q] for q in query_ids), np.int64, len(query_ids))
    examples = table.column("example_id").to_pylist()
    keep = np.fromiter((e in column for e in examples), bool, len(examples))
    columns = np.fromiter((column.get(e, -1) for e in examples), np.int64, len(examples))
    scores = np.zeros((len(order), len(train_ids)))
    np.add.at(scores, (rows[keep], columns[keep]), table.column("score").to_numpy()[keep])
    return scores


def check_methods(methods: Mapping[str, Mapping[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """``methods`` (label -> ``store.attribute`` options; default :data:`DEFAULT_METHODS`) checked."""
    if methods is None:
        return {label: dict(options) for label, options in DEFAULT_METHODS.items()}
    if not isinstance(methods, Mapping) or not methods:
        raise InvalidArgumentError(
            "methods must be a non-empty mapping of label -> store.attribute options, e.g. "
            "{'fisher': {'method': 'fisher', 'damping': 0.1}} (or None for grad-dot and fisher)"
        )
    chosen = {}
    for label, options in methods.items():
        if isinstance(options, ScoreOptions):  # its fields set away from their defaults, as attribute's keywords
            neutral = ScoreOptions()
            options = {
                f.name: getattr(options, f.name)
                for f in fields(ScoreOptions)
                if f.name == "method" or getattr(options, f.name) != getattr(neutral, f.name)
            }
        if not isinstance(label, str) or not isinstance(options, Mapping):
            raise InvalidArgumentError(
                f"methods[{label!r}] must map a string label to a dict of store.attribute options, got {options!r}"
            )
        reserved = sorted({"k", "write", "run", "queries"} & set(options))
        if reserved:
            raise InvalidArgumentError(
                f"methods[{label!r}] sets {reserved}, which the evaluation chooses itself: remove them"
            )
        chosen[label] = dict(options)
    return chosen


def evaluation_row(options: Mapping[str, Any], *, label: str, metric: str, seeds: Sequence[int], **fields: Any) -> dict:
    return {
        "label": label,
        "method": options.get("method", DEFAULT_METHOD),
        "options": json.dumps(dict(options), sort_keys=True, default=str),
        "metric": metric,
        "seeds": json.dumps([int(s) for s in seeds]),
        **fields,
    }


def record_evaluation(store: GradStore, run: str, rows: list[dict], write: bool) -> pa.Table:
    """The rows of one evaluation as an ``evaluations`` table (one id and time), appended unless ``write=False``."""
    evaluation_id = uuid.uuid4().hex[:16]
    now = datetime.now(timezone.utc)
    table = pa.Table.from_pylist(
        [{"evaluation_id": evaluation_id, "run_id": run, "created_at": now, **row} for row in rows],
        schema=EVALUATIONS_SCHEMA,
    )
    if write:
        store.core.results.append_table(EVALUATIONS, table)
    return table
