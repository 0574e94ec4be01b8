"""The commands that run a job: ``demo`` (the whole job on a built-in corpus) and ``serve``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from gradstore.cli.common import (
    StoreArg,
    app,
    csv_list,
    one_line_errors,
)


@app.command()
@one_line_errors
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
@one_line_errors
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
        warm=csv_list("--warm", warm),
        warm_kinds=tuple(csv_list("--warm-kinds", warm_kinds)),
        model=model,
        limits=Limits.parse(limit),
    )
    typer.echo(f"flight {server.flight_uri}")
    typer.echo(f"http {server.http_url}", err=False)
    sys.stdout.flush()
    server.wait()
