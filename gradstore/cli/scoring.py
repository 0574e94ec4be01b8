"""The scoring commands, each a call of the store API with :class:`~gradstore.methods.ScoreOptions`: ``build-index``,
``attribute``, ``select``, ``self-influence``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from gradstore.cli.common import (
    AttributeMethod,
    AttributeMethodOption,
    Blocks,
    BlocksOption,
    BuildIndexMethod,
    BuildIndexMethodOption,
    CheckpointOption,
    CheckpointsOption,
    DampingOption,
    DeviceOption,
    EngineChoice,
    EngineOption,
    KindOption,
    RayAddressOption,
    SelectSpace,
    SelfInfluenceMethod,
    SelfInfluenceMethodOption,
    SplitOption,
    StoreArg,
    WhereOption,
    app,
    check_parquet_name,
    csv_list,
    engine_of,
    one_line_errors,
    open_store,
    print_table,
    write_parquet,
)
from gradstore.errors import InvalidArgumentError
from gradstore.methods import DEFAULT_METHOD, OPTION_HELP, ScoreOptions
from gradstore.search.index import index_summary


@app.command("build-index")
@one_line_errors
def build_index_command(
    store: StoreArg,
    run: Annotated[str, typer.Option(help="Run whose training rows are indexed.")],
    checkpoint: CheckpointOption = None,
    method: BuildIndexMethodOption = BuildIndexMethod[DEFAULT_METHOD],
    damping: DampingOption = None,
    kind: KindOption = "exact",
    blocks: BlocksOption = Blocks.auto,
    refit: Annotated[bool, typer.Option(help="Fit again instead of reusing the store's fit.")] = False,
    engine: EngineOption = EngineChoice.local,
    ray_address: RayAddressOption = None,
    device: DeviceOption = None,
    split: SplitOption = "train",
    where: WhereOption = None,
) -> None:
    """Fit a preconditioner (or reuse the store's fit) and build (or update) a persisted index; an exact index's
    rows are read and prepared now, and left in a row file for later calls (``"row_file"``)."""
    options = ScoreOptions(
        method=method.value,
        checkpoint=checkpoint,
        damping=damping,
        blocks=blocks.value,
        kind=kind,
        device=device,
        split=split,
        where=where,
    )
    index = open_store(store).build_index(run, refit=refit, engine=engine_of(engine, ray_address), options=options)
    summary = index_summary(index)
    if kind == "exact" and engine == EngineChoice.local:  # later calls (new processes) map the rows
        row_file = index.warm()
        summary["row_file"] = None if row_file is None else str(row_file)
    typer.echo(json.dumps(summary, indent=2))


@app.command()
@one_line_errors
def attribute(
    store: StoreArg,
    run: Annotated[str, typer.Option(help="Run to attribute against.")],
    queries: Annotated[
        str | None, typer.Option(help="Comma-separated query example ids (default: every query row).")
    ] = None,
    where: Annotated[str | None, typer.Option(help="SQL filter selecting query rows instead.")] = None,
    k: Annotated[int, typer.Option("-k", "--k", help="Results per query.")] = 10,
    method: AttributeMethodOption = AttributeMethod[DEFAULT_METHOD],
    checkpoint: CheckpointOption = None,
    damping: DampingOption = None,
    kind: KindOption = "exact",
    blocks: BlocksOption = Blocks.auto,
    opponents: Annotated[bool, typer.Option(help="Also list the k strongest opponents.")] = False,
    out: Annotated[Path | None, typer.Option(help="Also write the results to this parquet file.")] = None,
    engine: EngineOption = EngineChoice.local,
    ray_address: RayAddressOption = None,
    rerank: Annotated[int, typer.Option(help=OPTION_HELP["rerank"])] = 0,
    query_checkpoint: Annotated[str | None, typer.Option(help=OPTION_HELP["query_checkpoint"])] = None,
    checkpoints: CheckpointsOption = None,
    write: Annotated[bool, typer.Option(help="Append the results to the store's scores table.")] = True,
    device: DeviceOption = None,
) -> None:
    """Top-k proponents (and opponents) of query examples; results are appended to the scores table unless
    --no-write (a store this process cannot write answers with --no-write)."""
    if out is not None:
        check_parquet_name(out)
    if queries is not None and where is not None:
        raise InvalidArgumentError(
            "--queries and --where both select the query rows: give one (ids with --queries, a filter with --where)"
        )
    selected = csv_list("--queries", queries) or where
    options = ScoreOptions(
        method=method.value,
        checkpoint=checkpoint,
        query_checkpoint=query_checkpoint,
        checkpoints=csv_list("--checkpoints", checkpoints),
        damping=damping,
        blocks=blocks.value,
        kind=kind,
        rerank=rerank,
        device=device,
    )
    table = open_store(store).attribute(
        selected,
        run=run,
        k=k,
        opponents=opponents,
        write=write,
        engine=engine_of(engine, ray_address),
        options=options,
    )
    if out is not None:
        write_parquet(table, out)
    print_table(table.select(["query_id", "rank", "example_id", "score", "method"]))


@app.command()
@one_line_errors
def select(
    store: StoreArg,
    run: Annotated[str, typer.Option(help="Run holding the candidate training rows.")],
    target: Annotated[
        str | None, typer.Option(help="Comma-separated target query ids (default: every query row).")
    ] = None,
    budget: Annotated[float, typer.Option(help="Fraction (<= 1) or number of examples to select.")] = 0.05,
    preconditioner: Annotated[
        SelectSpace, typer.Option(help="Method whose preconditioned space the cosines are taken in.")
    ] = SelectSpace["grad-dot"],
    aggregate: Annotated[str, typer.Option(help="max (LESS) or mean over the target set.")] = "max",
    out: Annotated[Path | None, typer.Option(help="Write the selection to this parquet file.")] = None,
    engine: EngineOption = EngineChoice.local,
    ray_address: RayAddressOption = None,
    checkpoints: CheckpointsOption = None,
    damping: DampingOption = None,
    blocks: BlocksOption = Blocks.auto,
    split: SplitOption = "train",
    where: WhereOption = None,
) -> None:
    """LESS-style data selection: the training examples most aligned with a target set."""
    if out is not None:
        check_parquet_name(out)
    from gradstore.answers.selection import export_selection

    count_or_fraction = int(budget) if budget > 1 and budget.is_integer() else budget
    options = ScoreOptions(
        method=preconditioner.value,
        checkpoints=csv_list("--checkpoints", checkpoints),
        damping=damping,
        blocks=blocks.value,
        split=split,
        where=where,
    )
    table = open_store(store).select(
        csv_list("--target", target),
        run=run,
        budget=count_or_fraction,
        aggregate=aggregate,
        engine=engine_of(engine, ray_address),
        options=options,
    )
    if out is not None:
        export_selection(table, out)
        typer.echo(f"wrote {table.num_rows} selected examples to {out}", err=True)
    print_table(table)


@app.command("self-influence")
@one_line_errors
def self_influence_command(
    store: StoreArg,
    run: Annotated[str, typer.Option(help="Run whose training rows are scored.")],
    method: SelfInfluenceMethodOption = SelfInfluenceMethod[DEFAULT_METHOD],
    checkpoint: CheckpointOption = None,
    top: Annotated[int, typer.Option(min=1, help="Rows shown.")] = 20,
    damping: DampingOption = None,
    blocks: BlocksOption = Blocks.auto,
    write: Annotated[bool, typer.Option(help="Append the values to the store's self_influence table.")] = True,
    engine: EngineOption = EngineChoice.local,
    ray_address: RayAddressOption = None,
    split: SplitOption = "train",
    where: WhereOption = None,
) -> None:
    """Self-influence of every training row (written to the self_influence table unless --no-write); shows the
    largest."""
    options = ScoreOptions(
        method=method.value,
        checkpoint=checkpoint,
        damping=damping,
        blocks=blocks.value,
        split=split,
        where=where,
    )
    table = open_store(store).self_influence(
        run=run, write=write, engine=engine_of(engine, ray_address), options=options
    )
    print_table(table.select(["example_id", "self_influence", "checkpoint", "method"]).slice(0, top), limit=top)
