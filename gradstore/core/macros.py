"""DuckDB macros shipped with the store's SQL (see ``docs/sql.md`` for runnable examples).

The ``scores`` macros read ``latest_scores()``: of each (run, query, method), the rows of the latest
attribute call only (every call stamps its rows with one ``created_at`` and a ``call_id``), so repeating a
call does not list its results twice; the ``scores`` table itself keeps every call.

- ``top_proponents(query, k)``: the top-k proponents of a query with the example's columns.
- ``top_opponents(query, k)``: the top-k opponents likewise.
- ``influential_examples(k, min_queries)``: examples in the top-k of at least ``min_queries`` queries,
  with how many queries and their mean score.
- ``influence_by(column_name)``: proponent scores aggregated by an ``examples`` column (e.g. ``'source'``).
- ``most_self_influential(n)``: the ``n`` training rows with the largest self-influence, with their columns.
- ``top_tokens(query, k)``: the ``k`` highest-scoring training tokens of the query's scored proponents
  (``token_scores``), with the proponent's rank, the token's rank within its example and the token after it
  (the one a causal LM predicts from it).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

SCORES_MACROS = [
    """CREATE MACRO latest_scores() AS TABLE
       SELECT * EXCLUDE (latest_at) FROM (
           SELECT *, max(created_at) OVER (PARTITION BY run_id, query_id, method) AS latest_at FROM scores)
       WHERE created_at = latest_at""",
    """CREATE MACRO top_proponents(q, k) AS TABLE
       SELECT s.query_id, s.rank, s.score, s.method, e.*
       FROM latest_scores() s JOIN examples e USING (example_id)
       WHERE s.query_id = q AND s.rank BETWEEN 1 AND k ORDER BY s.rank""",
    """CREATE MACRO top_opponents(q, k) AS TABLE
       SELECT s.query_id, -s.rank AS rank, s.score, s.method, e.*
       FROM latest_scores() s JOIN examples e USING (example_id)
       WHERE s.query_id = q AND s.rank BETWEEN -k AND -1 ORDER BY s.rank DESC""",
    """CREATE MACRO influential_examples(k, min_queries) AS TABLE
       SELECT * FROM (
           SELECT example_id, count(DISTINCT query_id) AS queries, avg(score) AS mean_score
           FROM latest_scores() WHERE rank BETWEEN 1 AND k GROUP BY example_id)
       WHERE queries >= min_queries
       ORDER BY queries DESC, mean_score DESC, example_id""",
    """CREATE MACRO influence_by(column_name) AS TABLE
       SELECT e[column_name] AS "group", count(*) AS hits, count(DISTINCT s.query_id) AS queries,
              sum(s.score) AS total_score, avg(s.score) AS mean_score
       FROM latest_scores() s JOIN (SELECT example_id, struct_pack(*COLUMNS(*)) AS e FROM examples)
            USING (example_id)
       WHERE s.rank >= 1 GROUP BY 1 ORDER BY total_score DESC""",
]
SELF_INFLUENCE_MACROS = [
    """CREATE MACRO most_self_influential(n) AS TABLE
       SELECT s.self_influence, s.method, s.checkpoint, e.*
       FROM self_influence s JOIN examples e USING (example_id)
       ORDER BY s.self_influence DESC LIMIT n""",
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
    """The macro definitions whose tables exist (``tables``: name -> column names); ``top_tokens`` only over a
    ``token_scores`` table with the columns ``store.token_scores`` writes (others may hold their own)."""
    tokens = TOKEN_MACROS if set(tables.get("token_scores", ())) >= TOKEN_SCORES_COLUMNS else []
    if "examples" not in tables:
        return tokens
    return (
        (SCORES_MACROS if "scores" in tables else [])
        + (SELF_INFLUENCE_MACROS if "self_influence" in tables else [])
        + tokens
    )
