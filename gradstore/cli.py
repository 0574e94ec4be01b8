"""The ``gradstore`` command line: ``gradstore --help``."""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from gradstore.errors import GradstoreError

app = typer.Typer(help="gradstore: a gradient-store database for training data attribution.",
                  no_args_is_help=True, pretty_exceptions_enable=False)

StoreArg = Annotated[Path, typer.Argument(help="Store directory (or object-store URI).")]


class OutputFormat(str, Enum):
    table = "table"
    csv = "csv"
    json = "json"
    parquet = "parquet"


def _open(store: Path, create: bool = False):
    import gradstore

    try:
        return gradstore.open(store, create=create)
    except GradstoreError as error:
        _fail(error)


def _fail(error: Exception) -> None:
    typer.secho(f"error: {error}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code=1)


@app.command()
def info(store: StoreArg,
         create: Annotated[bool, typer.Option(help="Create an empty store if none exists.")] = False) -> None:
    """Tables, row counts, runs, dimension, versions and size on disk of a store."""
    summary = _open(store, create=create).info()
    typer.echo(f"store      {summary['uri']}")
    typer.echo(f"dim        {summary['dim']}  ({summary['storage_dtype']} storage)")
    typer.echo(f"runs       {', '.join(summary['runs']) or '-'}")
    size = summary["bytes_on_disk"]
    typer.echo(f"on disk    {size / 1e6:.2f} MB" if size is not None else "on disk    (remote)")
    typer.echo(f"{'table':16s}{'rows':>12s}{'fragments':>11s}{'version':>9s}")
    for name, table in summary["tables"].items():
        typer.echo(f"{name:16s}{table['rows']:>12d}{table['fragments']:>11d}{table['version']:>9d}")


@app.command()
def sql(store: StoreArg, query: Annotated[str, typer.Argument(help="One read-only DuckDB SQL statement.")],
        format: Annotated[OutputFormat, typer.Option("--format", "-f", help="Output format.")] = OutputFormat.table,
        out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Write to this file.")] = None,
        max_rows: Annotated[int, typer.Option(help="Rows shown in table format.")] = 50) -> None:
    """Run DuckDB SQL over the store's tables (runs, checkpoints, gradients, examples, scores, ...)."""
    handle = _open(store)
    try:
        table = handle.sql(query).arrow()
    except GradstoreError as error:
        _fail(error)
    if hasattr(table, "read_all"):
        table = table.read_all()
    if format is OutputFormat.parquet:
        if out is None:
            _fail(ValueError("--format parquet needs --out FILE"))
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
def compact(store: StoreArg,
            cleanup_days: Annotated[Optional[float], typer.Option(
                help="Also delete table versions older than this many days.")] = None) -> None:
    """Compact every table's fragments (and optionally delete old versions)."""
    older = timedelta(days=cleanup_days) if cleanup_days is not None else None
    counts = _open(store).compact(cleanup_older_than=older)
    typer.echo(json.dumps({"fragments": counts}))


if __name__ == "__main__":
    app()
