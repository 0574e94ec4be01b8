"""The commands that read and keep a store: ``info``, ``sql``, ``compact``, ``verify``, ``row-files``, ``report``."""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path
from typing import Annotated

import typer

from gradstore.cli.common import (
    OutputFormat,
    StoreArg,
    app,
    fail,
    one_line_errors,
    open_store,
    write_parquet,
)
from gradstore.errors import InvalidArgumentError


@app.command()
@one_line_errors
def info(
    store: StoreArg, create: Annotated[bool, typer.Option(help="Create an empty store if none exists.")] = False
) -> None:
    """Tables, row counts, runs, dimension, versions and size on disk of a store."""
    summary = open_store(store, create=create).info()
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
@one_line_errors
def sql(
    store: StoreArg,
    query: Annotated[str, typer.Argument(help="One read-only DuckDB SQL statement.")],
    format: Annotated[OutputFormat, typer.Option("--format", "-f", help="Output format.")] = OutputFormat.table,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Write to this file.")] = None,
    max_rows: Annotated[int, typer.Option(min=1, help="Rows shown in table format.")] = 50,
) -> None:
    """Run DuckDB SQL over the store's tables (runs, checkpoints, gradients, examples, scores, ...)."""
    table = open_store(store).sql(query).arrow()
    if hasattr(table, "read_all"):
        table = table.read_all()
    if format is OutputFormat.parquet:
        if out is None:
            fail(InvalidArgumentError("--format parquet needs --out FILE"))
        write_parquet(table, out)
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
@one_line_errors
def compact(
    store: StoreArg,
    cleanup_days: Annotated[
        float | None, typer.Option(min=0, help="Also delete table versions older than this many days.")
    ] = None,
) -> None:
    """Compact every table's fragments (and optionally delete old versions)."""
    older = timedelta(days=cleanup_days) if cleanup_days is not None else None
    counts = open_store(store).compact(cleanup_older_than=older)
    typer.echo(json.dumps({"fragments": counts}))


@app.command()
@one_line_errors
def verify(store: StoreArg) -> None:
    """Read every table and side file and report what is damaged (exit code 1 if anything is)."""
    report = open_store(store).verify()
    for name, rows in report.tables.items():
        typer.echo(f"table {name:16s}{rows:>12d} rows readable")
    typer.echo(f"side files {report.side_files_checked} checked")
    for problem in report.problems:
        typer.secho(f"DAMAGED: {problem}", fg=typer.colors.RED, err=True)
    if not report.ok:
        raise typer.Exit(code=1)
    typer.echo("ok")


@app.command("row-files")
@one_line_errors
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
@one_line_errors
def report(
    store: StoreArg,
    run: Annotated[str | None, typer.Option(help="Only this run (default: every run).")] = None,
    out: Annotated[Path, typer.Option("--out", "-o", help="HTML file to write.")] = Path("report.html"),
    max_queries: Annotated[int, typer.Option(min=1, help="Queries listed (the rest are counted).")] = 1000,
    top: Annotated[int, typer.Option(min=1, help="Proponents and opponents shown per query and method.")] = 10,
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
    path = open_store(store).report(out, run=run, max_queries=max_queries, top=top, selection=chosen)
    typer.echo(str(path.resolve()))
