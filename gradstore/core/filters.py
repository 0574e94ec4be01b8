"""SQL literals and the filters the store builds from user arguments (Lance filters and DuckDB alike).

A user's ``where`` is combined with the store's own clauses (run, checkpoint, split) inside parentheses;
:func:`check_filter` refuses text that could close those parentheses or start another statement, so a
filter can narrow a selection but never widen it.
"""

from __future__ import annotations

from collections.abc import Sequence

from gradstore.errors import InvalidFilterError

StepRange = tuple[int | None, int | None]


def sql_literal(value: str) -> str:
    """``value`` as a quoted SQL string literal."""
    return "'" + str(value).replace("'", "''") + "'"


def sql_in(column: str, values: Sequence[str]) -> str:
    """``column IN ('a', 'b', ...)``."""
    return f"{column} IN ({', '.join(sql_literal(v) for v in values)})"


def check_filter(where: str) -> str:
    """Return ``where`` if it is one self-contained boolean expression; raise ``InvalidFilterError`` otherwise.

    Outside string literals and quoted identifiers the parentheses must balance and never close below
    zero, and no statement separator (``;``) or comment (``--``, ``/*``) may appear."""
    depth, quote, position = 0, None, 0
    while position < len(where):
        char = where[position]
        if quote is not None:
            if char == quote:
                if where[position + 1 : position + 2] == quote:  # doubled quote inside a literal
                    position += 1
                else:
                    quote = None
        elif char in "'\"":
            quote = char
        elif char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
            if depth < 0:
                raise InvalidFilterError(f"filter {where!r} closes a parenthesis it did not open")
        elif char == ";" or where.startswith(("--", "/*"), position):
            raise InvalidFilterError(f"filter {where!r} may hold one expression only (no ';' or comments)")
        position += 1
    if quote is not None:
        raise InvalidFilterError(f"filter {where!r} has an unterminated quote")
    if depth:
        raise InvalidFilterError(f"filter {where!r} leaves {depth} parenthesis(es) open")
    if not where.strip():
        raise InvalidFilterError("an empty filter selects nothing; pass None to select everything")
    return where


def gradient_filter(
    run: str | Sequence[str] | None = None,
    checkpoint: str | Sequence[str] | None = None,
    split: str | Sequence[str] | None = None,
    steps: StepRange | None = None,
    where: str | None = None,
) -> str | None:
    """A filter expression selecting gradient rows (``None`` selects everything)."""
    clauses = []
    for column, value in (("run_id", run), ("checkpoint", checkpoint), ("split", split)):
        if value is None:
            continue
        values = [value] if isinstance(value, str) else list(value)
        clauses.append(sql_in(column, values))
    if steps is not None:
        low, high = steps
        if low is not None:
            clauses.append(f"step >= {int(low)}")
        if high is not None:
            clauses.append(f"step <= {int(high)}")
    if where is not None:
        clauses.append(f"({check_filter(where)})")
    return " AND ".join(clauses) or None
