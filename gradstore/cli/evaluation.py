"""``gradstore evaluate lds|qld``: attribution scores checked against the user's retraining function."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from gradstore.cli.common import (
    CheckpointOption,
    DampingOption,
    StoreArg,
    app,
    csv_list,
    one_line_errors,
    open_store,
    print_table,
)
from gradstore.errors import InvalidArgumentError
from gradstore.methods import resolve_method

evaluate_app = typer.Typer(help="Check attribution scores against retraining.", no_args_is_help=True)
app.add_typer(evaluate_app, name="evaluate")


def _import_function(spec: str):
    """``module:function`` (the module importable from the current directory) as a callable."""
    import importlib

    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise InvalidArgumentError(f"--train must be module:function, got {spec!r}")
    if "" not in sys.path:
        sys.path.insert(0, "")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as error:
        raise InvalidArgumentError(f"--train {spec!r} cannot be imported: {error}") from error


TrainOption = Annotated[
    str,
    typer.Option(
        help="Your retraining function as module:function, called as f(subsets, queries, seed) and returning "
        "losses [subsets, queries]."
    ),
]
EvaluatedQueriesOption = Annotated[
    str | None, typer.Option(help="Comma-separated query example ids (default: every query row of the run).")
]
EvaluatedMethodsOption = Annotated[
    str,
    typer.Option(help="Comma-separated methods to score (--damping and --checkpoint go to the methods that use them)."),
]
SeedsOption = Annotated[str, typer.Option(help="Comma-separated training seeds (each retraining once per seed).")]
DrawSeedOption = Annotated[int, typer.Option(help="Seed of the random draws (subsets, or the random control).")]


def _evaluation_inputs(
    store: Path, run: str, train: str, queries: str | None, methods: str, damping: float | None, checkpoint: str | None
) -> tuple[Any, Any, list[str], dict[str, dict[str, Any]]]:
    """What ``evaluate lds`` and ``evaluate qld`` share: the store, the imported training function, the query
    ids and each method's ``attribute`` options (``checkpoint``/``damping`` only for methods that use them)."""
    from gradstore.answers.evaluate import query_ids

    opened = open_store(store)
    train_fn = _import_function(train)
    chosen: dict[str, dict[str, Any]] = {}
    for name in csv_list("--methods", methods):
        uses = resolve_method(name).uses
        options: dict[str, Any] = {"method": name}
        if checkpoint and "checkpoint" in uses:
            options["checkpoint"] = checkpoint
        if damping is not None and "damping" in uses:
            options["damping"] = damping
        chosen[name] = options
    ids = csv_list("--queries", queries) or query_ids(opened, run)
    if not ids:
        raise InvalidArgumentError(f"run {run!r} has no query rows: pass --queries, or capture rows with split='query'")
    return opened, train_fn, ids, chosen


def _int_list(option: str, value: str) -> list[int]:
    try:
        return [int(v) for v in csv_list(option, value)]
    except ValueError:
        raise InvalidArgumentError(f"{option} must be comma-separated integers, got {value!r}") from None


@evaluate_app.command("lds")
@one_line_errors
def evaluate_lds(
    store: StoreArg,
    run: Annotated[str, typer.Option(help="Run whose scores are checked.")],
    train: TrainOption,
    queries: EvaluatedQueriesOption = None,
    methods: EvaluatedMethodsOption = "grad-dot,fisher",
    damping: DampingOption = None,
    checkpoint: CheckpointOption = None,
    subsets: Annotated[int, typer.Option(help="Random training subsets retrained.")] = 100,
    fraction: Annotated[float, typer.Option(help="Share of the training set in each subset.")] = 0.5,
    seeds: Annotated[str, typer.Option(help="Comma-separated training seeds (2+ give a noise ceiling).")] = "0",
    seed: DrawSeedOption = 0,
) -> None:
    """Linear datamodeling score of each method; rows are appended to the evaluations table."""
    from gradstore.answers.evaluate import lds

    opened, train_fn, query_ids, chosen = _evaluation_inputs(store, run, train, queries, methods, damping, checkpoint)
    table, _ = lds(
        opened,
        run,
        train_fn,
        queries=query_ids,
        methods=chosen,
        subsets=subsets,
        fraction=fraction,
        seeds=_int_list("--seeds", seeds),
        seed=seed,
    )
    print_table(table.select(["label", "value", "stderr", "noise_ceiling", "queries", "subsets", "seeds"]))


@evaluate_app.command("qld")
@one_line_errors
def evaluate_qld(
    store: StoreArg,
    run: Annotated[str, typer.Option(help="Run whose scores are checked.")],
    train: TrainOption,
    queries: EvaluatedQueriesOption = None,
    methods: EvaluatedMethodsOption = "grad-dot,fisher",
    damping: DampingOption = None,
    checkpoint: CheckpointOption = None,
    fraction: Annotated[float, typer.Option(help="Share of the training set removed per query.")] = 0.1,
    seeds: SeedsOption = "0",
    seed: DrawSeedOption = 0,
    draws: Annotated[int, typer.Option(help="Random removals per query in the control.")] = 3,
    batch: Annotated[int | None, typer.Option(help="At most this many subsets per train call (default: all).")] = None,
) -> None:
    """Query loss difference of each method: each query's loss without its top proponents minus its loss
    without random sets of the same size (higher is better); rows are appended to the evaluations table."""
    from gradstore.answers.evaluate import qld

    opened, train_fn, query_ids, chosen = _evaluation_inputs(store, run, train, queries, methods, damping, checkpoint)
    table = qld(
        opened,
        run,
        train_fn,
        queries=query_ids,
        methods=chosen,
        fraction=fraction,
        seeds=_int_list("--seeds", seeds),
        seed=seed,
        draws=draws,
        batch=batch,
    )
    print_table(table.select(["label", "value", "stderr", "queries", "subsets", "fraction", "seeds"]))
