"""What the commands share: the Typer app, the option types (from :class:`~gradstore.methods.ScoreOptions`'s
declaration), opening a store and one-line errors."""

from __future__ import annotations

import functools
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, NoReturn, overload

import typer
import typer.core

from gradstore.cli.allocator import limit_malloc_arenas
from gradstore.core.engine import resolve_engine
from gradstore.errors import GradstoreError, InvalidArgumentError
from gradstore.methods import ALIASES, OPTION_HELP, method_names
from gradstore.methods.extension import load_plugins

#: The order ``gradstore --help`` lists the commands in (the modules register them in import order).
COMMAND_ORDER = (
    "info",
    "sql",
    "compact",
    "verify",
    "build-index",
    "attribute",
    "select",
    "self-influence",
    "evaluate",
    "row-files",
    "report",
    "demo",
    "serve",
)


class _Commands(typer.core.TyperGroup):
    def list_commands(self, ctx: Any) -> list[str]:
        names = super().list_commands(ctx)
        return sorted(names, key=lambda name: COMMAND_ORDER.index(name) if name in COMMAND_ORDER else len(names))


app = typer.Typer(
    help="gradstore: a gradient-store database for training data attribution.",
    no_args_is_help=True,
    cls=_Commands,
    pretty_exceptions_enable=False,
)


@app.callback()
def _process() -> None:
    # before any command: this process's allocator settings (gradstore.cli.allocator)
    limit_malloc_arenas()


StoreArg = Annotated[Path, typer.Argument(help="Store directory (or object-store URI).")]


load_plugins()  # user methods (GRADSTORE_PLUGINS, entry points) join the registry before its choices are read


def method_choices(name: str, call: str) -> type[Enum]:
    """The methods the store API's ``call`` takes (:func:`~gradstore.methods.method_names`, in the registry's
    order, then the aliases of those: ``influence`` for ``fisher``...) as the choices of a command's option: its
    help lists those, and Typer refuses any other."""
    names = method_names(call)
    aliases = [alias for alias, method in ALIASES.items() if method in names]
    return Enum(name, {method: method for method in [*names, *aliases]}, type=str)


AttributeMethod = method_choices("AttributeMethod", "attribute")
BuildIndexMethod = method_choices("BuildIndexMethod", "build_index")
SelfInfluenceMethod = method_choices("SelfInfluenceMethod", "self_influence")
SelectSpace = method_choices("SelectSpace", "select")


def method_option(choices: type[Enum]) -> Any:
    """``--method`` with ``choices`` (:func:`method_choices`) and the declared help."""
    return Annotated[choices, typer.Option(help=OPTION_HELP["method"])]


AttributeMethodOption = method_option(AttributeMethod)
BuildIndexMethodOption = method_option(BuildIndexMethod)
SelfInfluenceMethodOption = method_option(SelfInfluenceMethod)


class Blocks(str, Enum):
    auto = "auto"
    layer = "layer"
    full = "full"


class EngineChoice(str, Enum):
    local = "local"
    ray = "ray"


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


def open_store(store: Path, create: bool = False):
    import gradstore

    return gradstore.open(store, create=create)


def one_line_errors(command: Callable[..., None]) -> Callable[..., None]:
    """A command that prints one line and exits with code 1 for every ``GradstoreError`` (what a user can cause)
    and ``OSError`` (a file it cannot read or write), never a traceback."""

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> None:
        try:
            command(*args, **kwargs)
        except (GradstoreError, OSError) as error:
            fail(error)

    return run


def fail(error: Exception) -> NoReturn:
    lines = str(error).strip().splitlines()  # one line: DuckDB appends the query and a caret marker
    typer.secho(f"error: {lines[0] if lines else type(error).__name__}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code=1)


def engine_of(engine: EngineChoice, address: str | None):
    return resolve_engine(engine.value, address)


def write_parquet(table, out: Path) -> None:
    """Write ``table`` to ``out`` as Parquet (:func:`check_parquet_name`)."""
    check_parquet_name(out)
    import pyarrow.parquet as pq

    pq.write_table(table, out)


def check_parquet_name(out: Path) -> None:
    """Refuse an ``--out`` name with another format's suffix (``.csv``, ``.json``): it would hold Parquet bytes."""
    if out.suffix.lower() not in ("", ".parquet", ".pq"):
        fail(InvalidArgumentError(f"--out {out} names a {out.suffix} file but the results are written as Parquet: "
                                  "give a .parquet name (gradstore sql --format csv writes CSV)"))  # fmt: skip


def print_table(table, limit: int = 50) -> None:
    typer.echo(table.to_pandas().to_string(index=False, max_rows=limit))


@overload
def csv_list(option: str, value: str) -> list[str]: ...
@overload
def csv_list(option: str, value: str | None) -> list[str] | None: ...
def csv_list(option: str, value: str | None) -> list[str] | None:
    """The comma-separated values of ``option`` (``None``: not given); given but naming nothing (``""``, ``","``)
    is an ``InvalidArgumentError`` (not read as "not given")."""
    if value is None:
        return None
    values = [v.strip() for v in value.split(",") if v.strip()]
    if not values:
        raise InvalidArgumentError(
            f"{option} {value!r} names nothing: give comma-separated values, or leave {option} out for its default"
        )
    return values
