"""DuckDB macros shipped with the store's SQL (see ``docs/sql.md`` for runnable examples).

The ``scores`` macros read ``latest_scores()``: of each (run, query, method), the rows of the latest
attribute call only (every call stamps its rows with one ``created_at`` and a ``call_id``), so repeating a
call does not list its results twice; the ``scores`` table itself keeps every call.

- ``top_proponents(query, k)``: the top-k proponents of a query with the example's columns (``examples``; its
  ``example_id`` alone in a store without that table).
- ``top_opponents(query, k)``: the top-k opponents likewise.
- ``influential_examples(k, min_queries)``: examples in the top-k of at least ``min_queries`` queries,
  with how many queries and their mean score.
- ``influence_by(column_name)``: proponent scores aggregated by an ``examples`` column (e.g. ``'source'``).
- ``most_self_influential(n)``: the ``n`` training rows with the largest self-influence, with their columns
  (likewise); of each (run, example, method), the rows of the latest self_influence call only.

Each macro is defined when the tables it reads exist; :data:`UNDEFINED_MACROS` says what to do when a query calls
one that is not.
- ``top_tokens(query, k)``: the ``k`` highest-scoring training tokens of the query's scored proponents
  (``token_scores``), with the proponent's rank, the token's rank within its example and the token after it
  (the one a causal LM predicts from it).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping


def _latest_rows(table: str, key: str) -> str:
    """The rows of ``table`` stamped by the latest call of each ``key`` (a comma-separated column list): every
    call stamps its rows with one ``created_at``, so the rows of that call whose ``created_at`` is the largest of
    the key's."""
    return f"""SELECT * EXCLUDE (latest_at) FROM (
       SELECT *, max(created_at) OVER (PARTITION BY {key}) AS latest_at FROM {table})
   WHERE created_at = latest_at"""


LATEST_SCORES = f"""CREATE MACRO latest_scores() AS TABLE
   {_latest_rows("scores", "run_id, query_id, method")}"""
#: Of each (run, example, method), the ``self_influence`` rows of the latest call (``most_self_influential`` reads
#: these: repeating a call does not list an example twice).
LATEST_SELF_INFLUENCE = f"({_latest_rows('self_influence', 'run_id, example_id, method')})"
INFLUENTIAL_EXAMPLES = """CREATE MACRO influential_examples(k, min_queries) AS TABLE
   SELECT * FROM (
       SELECT example_id, count(DISTINCT query_id) AS queries, avg(score) AS mean_score
       FROM latest_scores() WHERE rank BETWEEN 1 AND k GROUP BY example_id)
   WHERE queries >= min_queries
   ORDER BY queries DESC, mean_score DESC, example_id"""
INFLUENCE_BY = """CREATE MACRO influence_by(column_name) AS TABLE
   SELECT e[column_name] AS "group", count(*) AS hits, count(DISTINCT s.query_id) AS queries,
          sum(s.score) AS total_score, avg(s.score) AS mean_score
   FROM latest_scores() s JOIN (SELECT example_id, struct_pack(*COLUMNS(*)) AS e FROM examples)
        USING (example_id)
   WHERE s.rank >= 1 GROUP BY 1 ORDER BY total_score DESC"""


def _with_examples(columns: str, source: str, examples: bool) -> str:
    """``SELECT columns`` from ``source`` (as ``s``) followed by every ``examples`` column, joined on
    ``example_id``; without an ``examples`` table (``examples`` false), by ``s.example_id`` alone."""
    if examples:
        return f"SELECT {columns}, e.* FROM {source} s JOIN examples e USING (example_id)"
    return f"SELECT {columns}, s.example_id FROM {source} s"


def scores_macros(examples: bool) -> list[str]:
    """The macros over ``scores``: ``top_proponents``/``top_opponents`` with the ``examples`` columns when
    ``examples`` (the store holds that table), else with ``example_id`` only; ``influence_by`` only with them."""
    return [
        LATEST_SCORES,
        f"""CREATE MACRO top_proponents(q, k) AS TABLE
   {_with_examples("s.query_id, s.rank, s.score, s.method", "latest_scores()", examples)}
   WHERE s.query_id = q AND s.rank BETWEEN 1 AND k ORDER BY s.rank""",
        f"""CREATE MACRO top_opponents(q, k) AS TABLE
   {_with_examples("s.query_id, -s.rank AS rank, s.score, s.method", "latest_scores()", examples)}
   WHERE s.query_id = q AND s.rank BETWEEN -k AND -1 ORDER BY s.rank DESC""",
        INFLUENTIAL_EXAMPLES,
        *([INFLUENCE_BY] if examples else []),
    ]


def self_influence_macros(examples: bool) -> list[str]:
    """``most_self_influential``, with the ``examples`` columns when ``examples``, else with ``example_id`` only."""
    return [
        f"""CREATE MACRO most_self_influential(n) AS TABLE
   {_with_examples("s.self_influence, s.method, s.checkpoint", LATEST_SELF_INFLUENCE, examples)}
   ORDER BY s.self_influence DESC LIMIT n"""
    ]


TOKEN_SCORES_COLUMNS = {
    "query_id",
    "example_id",
    "rank",
    "side",
    "position",
    "token",
    "score",
    "method",
    "run_id",
    "checkpoint",
    "created_at",
}
TOKEN_MACROS = [
    """CREATE MACRO top_tokens(q, k) AS TABLE
       SELECT query_id, rank, example_id, position, token, next_token, score, token_rank, method, run_id, checkpoint
       FROM (SELECT *, row_number() OVER (example ORDER BY score DESC, position) AS token_rank,
                    lead(token) OVER (example ORDER BY position) AS next_token
             FROM token_scores WHERE query_id = q AND side = 'train' AND rank >= 1
             WINDOW example AS (PARTITION BY query_id, example_id, method, run_id, checkpoint, created_at))
       ORDER BY score DESC, rank, position LIMIT k""",
]


def macros_for(tables: Mapping[str, Collection[str]]) -> list[str]:
    """The macro definitions whose tables exist (``tables``: name -> column names): those joining ``examples``
    list its columns when the store holds it, else ``example_id`` only (``influence_by`` needs it);
    ``top_tokens`` only over a ``token_scores`` table with the columns ``store.token_scores`` writes (others may
    hold their own)."""
    examples = "examples" in tables
    return (
        (scores_macros(examples) if "scores" in tables else [])
        + (self_influence_macros(examples) if "self_influence" in tables else [])
        + (TOKEN_MACROS if set(tables.get("token_scores", ())) >= TOKEN_SCORES_COLUMNS else [])
    )


#: The macros a store may lack (``scores`` and ``self_influence`` are in every store, so the others are always
#: defined), by name: what a query calling one is told.
UNDEFINED_MACROS = {
    "influence_by": "influence_by() groups by a column of the examples table, which this store lacks: add your "
    "examples first (store.add_examples(data, id_column=...))",
    "top_tokens": "top_tokens() reads the token_scores table that store.token_scores(...) writes, which this store "
    "lacks (or holds with other columns): score tokens first",
}
