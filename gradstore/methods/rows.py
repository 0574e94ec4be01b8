"""The checks a scoring call makes on the user's selection before any work: the training rows it names exist
(else an error saying which checkpoints hold rows) and its ``where`` filter plans against the gradients table
(else ``InvalidFilterError`` with Lance's reason, instead of Lance's ``ValueError`` mid-scan)."""

from __future__ import annotations

from collections.abc import Sequence

from gradstore.core import StoreCore, gradient_filter
from gradstore.errors import InvalidArgumentError, InvalidFilterError
from gradstore.preconditioning.fitting import Selection


def check_where(store: StoreCore, run: str, where: str | None) -> None:
    """``InvalidFilterError`` unless ``where`` (with the store's own clauses) plans on run ``run``'s rows."""
    if where is None:
        return
    expression = gradient_filter(run, None, None, None, where)  # the syntax checks of check_filter first
    name = store.gradient_table_name(run)
    if not store.has_table(name):
        return
    try:
        store.dataset(name).scanner(filter=expression, columns=["grad_id"], limit=1).explain_plan()
    except (ValueError, TypeError) as error:  # Lance: "Invalid user input: ..."
        raise InvalidFilterError(
            f"filter {where!r} cannot be used on the gradients table: {str(error).splitlines()[0]} "
            "(filter on metadata columns such as example_id, step, epoch, loss, rank)"
        ) from error


def row_values(
    store: StoreCore, run: str, column: str, checkpoints: Sequence[str] | None = None, split: str | None = None
) -> list:
    """The distinct values of metadata ``column`` among run ``run``'s rows (at ``checkpoints``, of ``split``),
    sorted by their text (``None``: rows stored without one)."""
    name = store.gradient_table_name(run)
    if not store.has_table(name):
        return []
    where = gradient_filter(run, None if checkpoints is None else list(checkpoints), split)
    return sorted(store.scan(name, [column], where).column(0).unique().to_pylist(), key=str)


def row_checkpoints(store: StoreCore, run: str, split: str) -> list[str | None]:
    """The checkpoints run ``run`` holds ``split`` rows at."""
    return row_values(store, run, "checkpoint", split=split)


def require_rows(store: StoreCore, selection: Selection) -> None:
    """``InvalidArgumentError`` saying what to pass when ``selection`` holds no rows."""
    check_where(store, selection.run, selection.where)
    if selection.count(store):
        return
    run, split, checkpoint = selection.run, selection.split, selection.checkpoint
    found = row_checkpoints(store, run, split)
    if not found:
        held = row_values(store, run, "split")
        if not held:
            raise InvalidArgumentError(
                f"run {run!r} holds no {split!r} rows: capture them first (store.capture(model, run={run!r}))"
            )
        if held == [None]:
            raise InvalidArgumentError(
                f"run {run!r} holds no {split!r} rows: its rows were written without a split; label them when "
                "writing (writer.append(..., split='train') for training rows, split='query' for queries)"
            )
        raise InvalidArgumentError(
            f"run {run!r} holds no {split!r} rows; its rows have splits {held} (None: written without one): pass "
            "split= to score one of them"
        )
    if checkpoint not in found:
        raise InvalidArgumentError(
            f"run {run!r} holds no {split!r} rows at checkpoint {checkpoint!r}; it holds them at {found}: "
            "pass checkpoint=... (stored queries at another checkpoint are picked by query_checkpoint=)"
        )
    raise InvalidArgumentError(
        f"no {split!r} rows of run {run!r} at checkpoint {checkpoint!r} match where={selection.where!r}"
    )
