"""The ``gradstore`` command line: ``gradstore --help``."""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from datetime import timedelta
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

from gradstore.core.engine import resolve_engine
from gradstore.errors import GradstoreError, InvalidArgumentError
from gradstore.methods import DEFAULT_METHOD, OPTION_HELP, ScoreOptions, method_names, resolve_method
from gradstore.methods.extension import load_plugins
from gradstore.search.index import index_summary

app = typer.Typer(
    help="gradstore: a gradient-store database for training data attribution.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)

StoreArg = Annotated[Path, typer.Argument(help="Store directory (or object-store URI).")]


load_plugins()  # user methods (GRADSTORE_PLUGINS, entry points) join the registry before its choices are read
Method = Enum("Method", {name: name for name in method_names()}, type=str)  # the registry's methods
SelectSpace = Enum("SelectSpace", {name: name for name in method_names("select")}, type=str)


class Blocks(str, Enum):
    auto = "auto"
    layer = "layer"
    full = "full"


class EngineChoice(str, Enum):
    local = "local"
    ray = "ray"


MethodOption = Annotated[Method, typer.Option(help=OPTION_HELP["method"])]
CheckpointOption = Annotated[str | None, typer.Option(help=OPTION_HELP["checkpoint"])]
DampingOption = Annotated[float | None, typer.Option(help=OPTION_HELP["damping"])]
KindOption = Annotated[str, typer.Option(help=OPTION_HELP["kind"])]
EngineOption = Annotated[
    EngineChoice, typer.Option("--engine", help="Where fitting and scans run: this process, or a Ray cluster.")
]
RayAddressOption = Annotated[
    str | None,
    typer.Option(
        "--ray-address", help="Ray cluster address (with --engine ray; default: RAY_ADDRESS, else a local cluster)."
    ),
]
DeviceOption = Annotated[str | None, typer.Option(help=OPTION_HELP["device"])]
BlocksOption = Annotated[Blocks, typer.Option(help=OPTION_HELP["blocks"])]
CheckpointsOption = Annotated[str | None, typer.Option(help=f"{OPTION_HELP['checkpoints']}, comma-separated")]
SplitOption = Annotated[str, typer.Option(help=OPTION_HELP["split"])]
WhereOption = Annotated[str | None, typer.Option(help=OPTION_HELP["where"])]

#: The commands that score, each with its call of the store API: their options are
#: :class:`~gradstore.methods.ScoreOptions` fields (same names, defaults and help; tests/test_cli_options.py checks
#: them against the declaration), passed as ``options=``.
SCORING_COMMANDS = {
    "build-index": "build_index",
    "attribute": "attribute",
    "select": "select",
    "self-influence": "self_influence",
}
#: Options of a scoring call that its command does not offer, and why.
NOT_ON_THE_COMMAND_LINE = {
    ("attribute", "where"): "--where selects the query rows (a filter on the training rows is not offered)",
    ("attribute", "split"): "the training rows' split is train",
}


class OutputFormat(str, Enum):
    table = "table"
    csv = "csv"
    json = "json"
    parquet = "parquet"


def _open(store: Path, create: bool = False):
    import gradstore

    return gradstore.open(store, create=create)


def _one_line_errors(command: Callable[..., None]) -> Callable[..., None]:
    """A command that prints one line and exits with code 1 for every ``GradstoreError`` (what a user can cause)
    and ``OSError`` (a file it cannot read or write), never a traceback."""

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> None:
        try:
            command(*args, **kwargs)
        except (GradstoreError, OSError) as error:
            _fail(error)

    return run


def _fail(error: Exception) -> NoReturn:
    lines = str(error).strip().splitlines()  # one line: DuckDB appends the query and a caret marker
    typer.secho(f"error: {lines[0] if lines else type(error).__name__}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code=1)


@app.command()
@_one_line_errors
def info(
    store: StoreArg, create: Annotated[bool, typer.Option(help="Create an empty store if none exists.")] = False
) -> None:
    """Tables, row counts, runs, dimension, versions and size on disk of a store."""
    summary = _open(store, create=create).info()
    typer.echo(f"store      {summary['uri']}")
    dims = ", ".join(map(str, summary["dims"])) or "-"
    typer.echo(f"dims       {dims}  ({summary['storage_dtype']} storage)")
    runs = ", ".join(f"{run} ({dim})" for run, dim in summary["run_dims"].items())
    typer.echo(f"runs       {runs or '-'}")
    for run, coverage in summary.get("coverage", {}).items():
        missing = coverage["not_captured"]
        listed = ", ".join(missing[:5]) + (f", ... ({len(missing)} in all)" if len(missing) > 5 else "")
        typer.echo(
            f"coverage   {run}: {coverage['fraction']:.1%} of {coverage['trainable']:,} trainable parameter entries"
            + (f"; not captured: {listed}" if missing else "")
        )
    size = summary["bytes_on_disk"]
    typer.echo(f"on disk    {size / 1e6:.2f} MB" if size is not None else "on disk    (remote)")
    typer.echo(f"{'table':16s}{'rows':>12s}{'fragments':>11s}{'version':>9s}")
    for name, table in summary["tables"].items():
        typer.echo(f"{name:16s}{table['rows']:>12d}{table['fragments']:>11d}{table['version']:>9d}")


@app.command()
@_one_line_errors
def sql(
    store: StoreArg,
    query: Annotated[str, typer.Argument(help="One read-only DuckDB SQL statement.")],
    format: Annotated[OutputFormat, typer.Option("--format", "-f", help="Output format.")] = OutputFormat.table,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Write to this file.")] = None,
    max_rows: Annotated[int, typer.Option(help="Rows shown in table format.")] = 50,
) -> None:
    """Run DuckDB SQL over the store's tables (runs, checkpoints, gradients, examples, scores, ...)."""
    table = _open(store).sql(query).arrow()
    if hasattr(table, "read_all"):
        table = table.read_all()
    if format is OutputFormat.parquet:
        if out is None:
            _fail(InvalidArgumentError("--format parquet needs --out FILE"))
        import pyarrow.parquet as pq

        pq.write_table(table, out)
        typer.echo(f"wrote {table.num_rows} rows to {out}", err=True)
        return
    frame = table.to_pandas()
    if format is OutputFormat.csv:
        text = frame.to_csv(index=False)
    elif format is OutputFormat.json:
        text = frame.to_json(orient="records", lines=True, date_format="iso")
    else:
        text = frame.to_string(index=False, max_rows=max_rows)
    text = text if text.endswith("\n") else text + "\n"
    if out is not None:
        out.write_text(text)
        typer.echo(f"wrote {table.num_rows} rows to {out}", err=True)
    else:
        sys.stdout.write(text)


@app.command()
@_one_line_errors
def compact(
    store: StoreArg,
    cleanup_days: Annotated[
        float | None, typer.Option(help="Also delete table versions older than this many days.")
    ] = None,
) -> None:
    """Compact every table's fragments (and optionally delete old versions)."""
    older = timedelta(days=cleanup_days) if cleanup_days is not None else None
    counts = _open(store).compact(cleanup_older_than=older)
    typer.echo(json.dumps({"fragments": counts}))


@app.command()
@_one_line_errors
def verify(store: StoreArg) -> None:
    """Read every table and side file and report what is damaged (exit code 1 if anything is)."""
    report = _open(store).verify()
    for name, rows in report.tables.items():
        typer.echo(f"table {name:16s}{rows:>12d} rows readable")
    typer.echo(f"side files {report.side_files_checked} checked")
    for problem in report.problems:
        typer.secho(f"DAMAGED: {problem}", fg=typer.colors.RED, err=True)
    if not report.ok:
        raise typer.Exit(code=1)
    typer.echo("ok")


def _engine(engine: EngineChoice, address: str | None):
    return resolve_engine(engine.value, address)


def _print_table(table, limit: int = 50) -> None:
    typer.echo(table.to_pandas().to_string(index=False, max_rows=limit))


def _csv_list(value: str | None) -> list[str] | None:
    return [v.strip() for v in value.split(",") if v.strip()] if value else None


@app.command("build-index")
@_one_line_errors
def build_index_command(
    store: StoreArg,
    run: Annotated[str, typer.Option(help="Run whose training rows are indexed.")],
    checkpoint: CheckpointOption = None,
    method: MethodOption = Method[DEFAULT_METHOD],
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
    index = _open(store).build_index(run, refit=refit, engine=_engine(engine, ray_address), options=options)
    summary = index_summary(index)
    if kind == "exact" and engine == EngineChoice.local:  # later calls (new processes) map the rows
        row_file = index.warm()
        summary["row_file"] = None if row_file is None else str(row_file)
    typer.echo(json.dumps(summary, indent=2))


@app.command()
@_one_line_errors
def attribute(
    store: StoreArg,
    run: Annotated[str, typer.Option(help="Run to attribute against.")],
    queries: Annotated[
        str | None, typer.Option(help="Comma-separated query example ids (default: every query row).")
    ] = None,
    where: Annotated[str | None, typer.Option(help="SQL filter selecting query rows instead.")] = None,
    k: Annotated[int, typer.Option("-k", "--k", help="Results per query.")] = 10,
    method: MethodOption = Method[DEFAULT_METHOD],
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
    selected = _csv_list(queries) if queries else where
    options = ScoreOptions(
        method=method.value,
        checkpoint=checkpoint,
        query_checkpoint=query_checkpoint,
        checkpoints=_csv_list(checkpoints),
        damping=damping,
        blocks=blocks.value,
        kind=kind,
        rerank=rerank,
        device=device,
    )
    table = _open(store).attribute(
        selected,
        run=run,
        k=k,
        opponents=opponents,
        write=write,
        engine=_engine(engine, ray_address),
        options=options,
    )
    if out is not None:
        import pyarrow.parquet as pq

        pq.write_table(table, out)
    _print_table(table.select(["query_id", "rank", "example_id", "score", "method"]))


@app.command()
@_one_line_errors
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
    from gradstore.answers.selection import export_selection

    count_or_fraction = int(budget) if budget > 1 and budget.is_integer() else budget
    options = ScoreOptions(
        method=preconditioner.value,
        checkpoints=_csv_list(checkpoints),
        damping=damping,
        blocks=blocks.value,
        split=split,
        where=where,
    )
    table = _open(store).select(
        _csv_list(target),
        run=run,
        budget=count_or_fraction,
        aggregate=aggregate,
        engine=_engine(engine, ray_address),
        options=options,
    )
    if out is not None:
        export_selection(table, out)
        typer.echo(f"wrote {table.num_rows} selected examples to {out}", err=True)
    _print_table(table)


@app.command("self-influence")
@_one_line_errors
def self_influence_command(
    store: StoreArg,
    run: Annotated[str, typer.Option(help="Run whose training rows are scored.")],
    method: MethodOption = Method[DEFAULT_METHOD],
    checkpoint: CheckpointOption = None,
    top: Annotated[int, typer.Option(help="Rows shown.")] = 20,
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
    table = _open(store).self_influence(run=run, write=write, engine=_engine(engine, ray_address), options=options)
    _print_table(table.select(["example_id", "self_influence", "checkpoint", "method"]).slice(0, top), limit=top)


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

    opened = _open(store)
    train_fn = _import_function(train)
    chosen: dict[str, dict[str, Any]] = {}
    for name in _csv_list(methods) or []:
        uses = resolve_method(name).uses
        options: dict[str, Any] = {"method": name}
        if checkpoint and "checkpoint" in uses:
            options["checkpoint"] = checkpoint
        if damping is not None and "damping" in uses:
            options["damping"] = damping
        chosen[name] = options
    if not chosen:
        raise InvalidArgumentError(f"--methods names no method; pass some of {method_names()}")
    ids = _csv_list(queries) or query_ids(opened, run)
    if not ids:
        raise InvalidArgumentError(f"run {run!r} has no query rows: pass --queries, or capture rows with split='query'")
    return opened, train_fn, ids, chosen


def _int_list(option: str, value: str) -> list[int]:
    try:
        return [int(v) for v in _csv_list(value) or []]
    except ValueError:
        raise InvalidArgumentError(f"{option} must be comma-separated integers, got {value!r}") from None


@evaluate_app.command("lds")
@_one_line_errors
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
    _print_table(table.select(["label", "value", "stderr", "noise_ceiling", "queries", "subsets", "seeds"]))


@evaluate_app.command("qld")
@_one_line_errors
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
    _print_table(table.select(["label", "value", "stderr", "queries", "subsets", "fraction", "seeds"]))


@app.command("row-files")
@_one_line_errors
def row_files(
    directory: Annotated[
        Path | None, typer.Option(help="Row file directory (default: GRADSTORE_CACHE_DIR's, else the user cache's).")
    ] = None,
    clear: Annotated[bool, typer.Option(help="Remove every row file and scan file.")] = False,
) -> None:
    """List (or remove) the row files exact search leaves for later processes: prepared rows that a new process
    maps instead of reading them from its store, and beside them the scan files of small metadata reads (derived
    copies: removing them costs one read)."""
    from gradstore.core.row_cache import SCANS_DIRECTORY, RowFiles, ScanFiles, default_row_files_directory

    files = RowFiles(directory or default_row_files_directory())
    assert files.directory is not None
    scans = ScanFiles(files.directory / SCANS_DIRECTORY)
    if clear:
        typer.echo(f"removed {files.clear()} row files and {scans.clear()} scan files from {files.directory}")
        return
    entries = files.entries()
    typer.echo(f"{files.directory}: {len(entries)} row files, {sum(e['bytes'] for e in entries) / 1e6:.1f} MB")
    for entry in entries:
        used = entry["last_used"].strftime("%Y-%m-%d %H:%M:%S")
        typer.echo(f"{entry['name']}  {entry['bytes'] / 1e6:10.1f} MB  last used {used} UTC")
    scan_usage = scans.usage()
    typer.echo(f"{scans.directory}: {scan_usage[0]} scan files, {scan_usage[1] / 1e6:.1f} MB")


@app.command()
@_one_line_errors
def report(
    store: StoreArg,
    run: Annotated[str | None, typer.Option(help="Only this run (default: every run).")] = None,
    out: Annotated[Path, typer.Option("--out", "-o", help="HTML file to write.")] = Path("report.html"),
    max_queries: Annotated[int, typer.Option(help="Queries listed (the rest are counted).")] = 1000,
    top: Annotated[int, typer.Option(help="Proponents and opponents shown per query and method.")] = 10,
    selection: Annotated[
        Path | None,
        typer.Option(exists=True, dir_okay=False, help="A selection parquet file (from select --out) to break down."),
    ] = None,
) -> None:
    """Write one self-contained HTML attribution report that opens offline in a browser."""
    chosen = None
    if selection is not None:
        import pyarrow.parquet as pq

        chosen = pq.read_table(selection)
    path = _open(store).report(out, run=run, max_queries=max_queries, top=top, selection=chosen)
    typer.echo(str(path.resolve()))


@app.command()
@_one_line_errors
def demo(
    store: Annotated[Path, typer.Option(help="Store directory (replaced if it holds a store).")] = Path(
        "gradstore-demo"
    ),
    epochs: Annotated[int, typer.Option(help="Training epochs.")] = 24,
    places: Annotated[int, typer.Option(help="Invented places (2 facts each).")] = 24,
    storage_dtype: Annotated[str, typer.Option(help="The store's encoding: float16, bfloat16, float32 or int8.")] = (
        "float16"
    ),
) -> None:
    """Run the whole job on a built-in corpus: train a tiny GPT under capture, attribute, report recall."""
    from gradstore.demo import DemoConfig, run_demo

    run_demo(store, DemoConfig(epochs=epochs, places=places, storage_dtype=storage_dtype), log=typer.echo)


@app.command()
@_one_line_errors
def serve(
    store: StoreArg,
    host: Annotated[str, typer.Option(help="Address to listen on (0.0.0.0: every interface).")] = "127.0.0.1",
    flight_port: Annotated[int, typer.Option(help="Arrow Flight port for gradstore.connect (0: a free one).")] = 8815,
    http_port: Annotated[int, typer.Option(help="HTTP port: JSON API, OpenAPI at /docs, the live report.")] = 8080,
    token_file: Annotated[
        Path | None,
        typer.Option(help="Bearer tokens, one a line: TOKEN or TOKEN:write (also read from GRADSTORE_TOKENS)."),
    ] = None,
    allow_writes: Annotated[
        bool, typer.Option("--allow-writes", help="Let write-scoped tokens ask write=True (append scores).")
    ] = False,
    refresh: Annotated[float, typer.Option(help="Seconds within which other writers' rows become visible.")] = 1.0,
    batch_window_ms: Annotated[
        float, typer.Option(help="Extra wait of a lookup for others to batch with (batches form anyway while busy).")
    ] = 0.0,
    warm: Annotated[
        str | None,
        typer.Option(help="Methods (comma-separated) to look up once per run before serving: fits and rows in memory."),
    ] = None,
    warm_kinds: Annotated[str, typer.Option(help="Index kinds the --warm lookups use (comma-separated).")] = "exact",
    tls_cert: Annotated[Path | None, typer.Option(help="PEM certificate: TLS for both transports.")] = None,
    tls_key: Annotated[Path | None, typer.Option(help="PEM key of --tls-cert.")] = None,
    model: Annotated[
        str | None,
        typer.Option(
            help="module:factory (importable from here) returning (model, tokenizer, loss_fn): "
            "the page's text box and POST /api/attribute_text."
        ),
    ] = None,
    limit: Annotated[
        list[str] | None,
        typer.Option(help="A server limit as name=value, repeatable (docs/serve.md lists them): max_concurrent=8."),
    ] = None,
) -> None:
    """Serve the store to many clients: Arrow Flight (gradstore.connect) and HTTP (JSON API, the live report)."""
    from gradstore.serve import Limits, Tokens
    from gradstore.serve import serve as start

    server = start(
        str(store),
        tokens=Tokens.load(token_file),
        host=host,
        flight_port=flight_port,
        http_port=http_port,
        allow_writes=allow_writes,
        refresh_s=refresh,
        batch_window_s=batch_window_ms / 1000,
        tls_cert=tls_cert,
        tls_key=tls_key,
        warm=_csv_list(warm),
        warm_kinds=tuple(_csv_list(warm_kinds) or ("exact",)),
        model=model,
        limits=Limits.parse(limit),
    )
    typer.echo(f"flight {server.flight_uri}")
    typer.echo(f"http {server.http_url}", err=False)
    sys.stdout.flush()
    server.wait()


if __name__ == "__main__":
    app()
