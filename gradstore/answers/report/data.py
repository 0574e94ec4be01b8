"""What an attribution report shows, gathered from a store through its SQL.

Everything here is plain JSON-ready data (dicts, lists, strings, numbers); :mod:`gradstore.answers.report.html`
turns it into the page. Text from the store is kept as it is: escaping is the renderer's job.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from gradstore.core import sql_in, sql_literal
from gradstore.core.coverage import run_coverage
from gradstore.errors import InvalidArgumentError, InvalidNameError, SchemaMismatchError
from gradstore.search.index import INDEXES, MANIFEST_FILE

if TYPE_CHECKING:
    from gradstore.core import StoreCore

#: Columns of a ``token_scores`` table the report reads (alternative names accepted for position and token).
TOKEN_COLUMNS = {
    "query_id": ("query_id",),
    "example_id": ("example_id",),
    "side": ("side",),
    "position": ("position", "token_position"),
    "token": ("token", "token_text"),
    "score": ("score",),
}
HISTOGRAM_BINS = 40
MAX_GROUPS = 30  # an examples column with more distinct values is not used for a selection breakdown


@dataclass
class ReportOptions:
    """What goes into a report.

    ``run``: only this run's scores, self-influence and selection candidates (default: every run).
    ``max_queries``: queries listed (the rest are counted in a note). ``top``: proponents and opponents
    shown per query and method. ``outliers``: self-influence rows shown. ``text_column``: the ``examples``
    column shown as an example's text (default ``text``, else the first other string column).
    """

    run: str | None = None
    max_queries: int = 1000
    top: int = 10
    outliers: int = 25
    text_column: str | None = None
    max_token_rows: int = 200_000


@dataclass
class ReportData:
    """The report's contents (see :func:`gather`)."""

    store: str
    generated_at: str
    run: str | None
    overview: dict[str, Any]
    queries: list[dict[str, Any]]
    queries_total: int
    texts: dict[str, str]
    histograms: list[dict[str, Any]]
    self_influence: list[dict[str, Any]]
    selection: dict[str, Any] | None
    evaluations: dict[str, Any] | None
    notes: list[str] = field(default_factory=list)
    online_selection: dict[str, Any] | None = None

    def to_json(self) -> str:
        """The data as JSON (non-finite numbers become ``null``)."""
        return json.dumps(_finite(asdict(self)), separators=(",", ":"), default=str)


def gather(store: StoreCore, options: ReportOptions | None = None, selection: pa.Table | None = None) -> ReportData:
    """Collect a report's data from ``store``; ``selection`` is a table from :meth:`GradStore.select`."""
    options = options or ReportOptions()
    if options.max_queries < 0 or options.top < 1 or options.outliers < 0:
        raise InvalidArgumentError(
            f"ReportOptions needs max_queries >= 0, outliers >= 0 and top >= 1, got max_queries={options.max_queries}, "
            f"outliers={options.outliers}, top={options.top}"
        )
    if options.run is not None:
        store.run(options.run)  # UnknownRunError for a run the store does not hold
    tables = set(store.tables.table_names())
    reader = _Reader(store, tables, options)
    notes: list[str] = []
    queries, total = reader.queries()
    if total > len(queries):
        notes.append(
            f"{total - len(queries)} of {total} queries are not shown (only the first "
            f"{len(queries)} by id; raise max_queries to see more)."
        )
    tokens = reader.token_scores({q["id"] for q in queries}, notes)
    for query in queries:
        query["tokens"] = tokens.get(query["id"], {})
    outliers = reader.self_influence()
    chosen = reader.selection(selection) if selection is not None else None
    wanted = {q["id"] for q in queries}
    for query in queries:
        for result in query["results"]:
            wanted.update(row[0] for row in result["proponents"] + result["opponents"])
    wanted.update(row["example_id"] for block in outliers for row in block["rows"])
    if chosen is not None:
        wanted.update(row["example_id"] for row in chosen["top"])
    return ReportData(
        store=str(store.uri),
        generated_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        run=options.run,
        overview=reader.overview(),
        queries=queries,
        queries_total=total,
        texts=reader.texts(wanted),
        histograms=reader.histograms(),
        self_influence=outliers,
        selection=chosen,
        evaluations=reader.evaluations(),
        notes=notes,
        online_selection=reader.online_selection(),
    )


class _Reader:
    """The SQL behind each part of a report."""

    def __init__(self, store: StoreCore, tables: set[str], options: ReportOptions) -> None:
        self.store = store
        self.tables = tables
        self.options = options
        self.run_clause = f"run_id = {sql_literal(options.run)}" if options.run is not None else "TRUE"
        self.text_column = self._text_column()

    def _frame(self, query: str):
        return self.store.sql(query).df()

    def _has_rows(self, table: str) -> bool:
        return table in self.tables and self.store.tables.count(table) > 0

    def _text_column(self) -> str | None:
        if "examples" not in self.tables:
            return None
        schema = self.store.table("examples").schema
        if self.options.text_column is not None:
            if self.options.text_column not in schema.names:
                raise SchemaMismatchError(
                    f"examples have no column {self.options.text_column!r}; columns: {schema.names}"
                )
            return self.options.text_column
        strings = [f.name for f in schema if f.name != "example_id" and _is_text(f.type)]
        return "text" if "text" in strings else (strings[0] if strings else None)

    # ------------------------------------------------------------------ overview
    def overview(self) -> dict[str, Any]:
        runs = (
            self._frame(
                "SELECT run_id, created_at, dim, model_fingerprint, projection_fingerprint FROM runs "
                f"WHERE {self.run_clause} ORDER BY created_at"
            )
            if "runs" in self.tables
            else None
        )
        checkpoints = (
            self._frame(
                "SELECT run_id, checkpoint, step, epoch, learning_rate FROM checkpoints "
                f"WHERE {self.run_clause} ORDER BY run_id, step, checkpoint"
            )
            if "checkpoints" in self.tables
            else None
        )
        counts = {name: self.store.tables.count(name) for name in sorted(self.tables)}
        coverage = run_coverage(self.store)
        return {
            "runs": [{**r, "coverage": coverage.get(r["run_id"])} for r in _records(runs)],
            "checkpoints": _records(checkpoints),
            "row_counts": counts,
            "dim": self._dim(),
            "text_column": self.text_column,
        }

    def _dim(self) -> int | str | None:
        """The reported run's dim, else the store's dims (``"16, 64"`` for several)."""
        if self.options.run is not None:
            return self.store.run_dim(self.options.run)
        dims = self.store.catalog.dims
        return dims[0] if len(dims) == 1 else (", ".join(map(str, dims)) or None)

    # ------------------------------------------------------------------ queries and their top-k
    def _latest_scores(self) -> str:
        """The score rows of the latest attribution of each (query, method, run)."""
        return f"""(SELECT s.* FROM scores s JOIN (
                       SELECT query_id, method, run_id, max(created_at) AS latest FROM scores
                       WHERE {self.run_clause} GROUP BY ALL) l
                   ON s.query_id = l.query_id AND s.method = l.method AND s.run_id = l.run_id
                      AND s.created_at = l.latest)"""

    def queries(self) -> tuple[list[dict[str, Any]], int]:
        if not self._has_rows("scores"):
            return [], 0
        latest = self._latest_scores()
        total = int(self._frame(f"SELECT count(DISTINCT query_id) AS n FROM {latest}").n[0])
        rows = self._frame(f"""
            WITH shown AS (SELECT DISTINCT query_id FROM {latest} ORDER BY query_id LIMIT {self.options.max_queries})
            SELECT query_id, method, run_id, checkpoint, index_name, example_id, score, rank FROM {latest}
            WHERE query_id IN (SELECT query_id FROM shown) AND abs(rank) BETWEEN 1 AND {self.options.top}
            ORDER BY query_id, method, run_id, rank""")
        damping = self._dampings(set(rows.index_name.dropna()))
        queries: dict[str, dict[str, Any]] = {}
        for (query_id, method, run_id), group in rows.groupby(["query_id", "method", "run_id"], sort=False):
            entry = queries.setdefault(query_id, {"id": query_id, "results": []})
            index_name = group.index_name.iloc[0]
            triples = list(zip(group.example_id.tolist(), group.score.tolist(), group["rank"].tolist()))
            entry["results"].append(
                {
                    "method": method,
                    "run": run_id,
                    "checkpoint": group.checkpoint.iloc[0],
                    "damping": damping.get(index_name) if isinstance(index_name, str) else None,
                    "index": index_name if isinstance(index_name, str) else None,
                    "proponents": [[e, s] for e, s, r in triples if r > 0],
                    "opponents": [[e, s] for e, s, r in sorted(triples, key=lambda t: -t[2]) if r < 0],
                }
            )
        return list(queries.values()), total

    def _dampings(self, index_names: set[str]) -> dict[str, float | None]:
        """The damping each index was built with (from its manifest; ``None`` for undamped methods)."""
        found: dict[str, float | None] = {}
        for name in index_names:
            try:
                manifest = json.loads(self.store.files.read_bytes(INDEXES, name, MANIFEST_FILE))
            except (FileNotFoundError, InvalidNameError, ValueError):
                continue  # an index since removed, or a name a hostile store made up
            found[name] = manifest.get("damping") if isinstance(manifest, dict) else None
        return found

    def histograms(self) -> list[dict[str, Any]]:
        if not self._has_rows("scores"):
            return []
        frame = self._frame(f"SELECT method, score FROM {self._latest_scores()} WHERE rank <> 0")
        return [
            {"method": method, **_histogram(group.score.to_numpy())}
            for method, group in frame.groupby("method", sort=True)
        ]

    # ------------------------------------------------------------------ per-token scores
    def token_scores(self, query_ids: set[str], notes: list[str]) -> dict[str, dict[str, list]]:
        """``query_id -> {example_id -> [[position, token, score], ...]}`` for the training side, and under the
        key ``""`` the query's own tokens with their scores summed over the examples they were scored against."""
        if not self._has_rows("token_scores") or not query_ids:
            return {}
        names = set(self.store.table("token_scores").schema.names)
        chosen = {key: next((n for n in options if n in names), None) for key, options in TOKEN_COLUMNS.items()}
        missing = [key for key, name in chosen.items() if name is None]
        if missing:
            notes.append(f"token_scores has no column(s) {missing}; per-token highlights are not shown.")
            return {}
        select = ", ".join(f'"{name}" AS {key}' for key, name in chosen.items())
        limit = self.options.max_token_rows
        frame = self._frame(
            f"SELECT {select} FROM token_scores WHERE {sql_in(chosen['query_id'], sorted(query_ids))}"
            f" ORDER BY query_id, example_id, side, position LIMIT {limit}"
        )
        if len(frame) == limit:
            notes.append(f"token_scores: only the first {limit} token rows of the listed queries are shown.")
        query_side = frame.side == "query"
        summed = (
            frame[query_side]
            .groupby(["query_id", "position", "token"], as_index=False)
            .score.sum()
            .assign(example_id="", side="query")
        )  # query tokens summed over the examples scored
        result: dict[str, dict[str, list]] = {}
        for frame_part in (frame[~query_side], summed):
            for (query_id, example_id), group in frame_part.groupby(["query_id", "example_id"], sort=False):
                result.setdefault(query_id, {})[example_id] = [
                    [int(p), str(t), float(s)] for p, t, s in zip(group.position, group.token, group.score)
                ]
        return result

    # ------------------------------------------------------------------ self-influence
    def self_influence(self) -> list[dict[str, Any]]:
        if not self._has_rows("self_influence"):
            return []
        latest = f"""(SELECT s.* FROM self_influence s JOIN (
                          SELECT method, run_id, max(created_at) AS latest FROM self_influence
                          WHERE {self.run_clause} GROUP BY ALL) l
                      ON s.method = l.method AND s.run_id = l.run_id AND s.created_at = l.latest)"""
        frame = self._frame(f"SELECT run_id, method, checkpoint, example_id, self_influence FROM {latest}")
        blocks = []
        for (run_id, method), group in frame.groupby(["run_id", "method"], sort=True):
            values = group.self_influence.to_numpy()
            top = group.nlargest(self.options.outliers, "self_influence")
            median = float(np.median(values))
            spread = float(np.median(np.abs(values - median))) or 1.0
            blocks.append(
                {
                    "run": run_id,
                    "method": method,
                    "checkpoint": group.checkpoint.iloc[0],
                    "rows_total": len(values),
                    **_histogram(values),
                    "rows": [
                        {"example_id": e, "value": float(v), "robust_z": (float(v) - median) / spread}
                        for e, v in zip(top.example_id, top.self_influence)
                    ],
                }
            )
        return blocks

    # ------------------------------------------------------------------ selection
    def selection(self, selection: pa.Table) -> dict[str, Any]:
        if "example_id" not in selection.column_names:
            raise SchemaMismatchError(f"a selection needs an example_id column; it has {selection.column_names}")
        chosen = selection.to_pandas()
        candidates = (
            self._frame(f"SELECT DISTINCT example_id FROM gradients WHERE split = 'train' AND {self.run_clause}")
            if "gradients" in self.tables
            else None
        )
        total = len(candidates) if candidates is not None else None
        order = chosen.sort_values("rank") if "rank" in chosen else chosen
        top = [
            {"example_id": str(row.example_id), "score": float(row.score) if "score" in chosen else None}
            for row in order.head(self.options.outliers).itertuples()
        ]
        return {
            "selected": len(chosen),
            "candidates": total,
            "fraction": len(chosen) / total if total else None,
            "breakdown": self._breakdown(chosen.example_id.astype(str).tolist(), candidates),
            "top": top,
        }

    def _breakdown(self, selected: list[str], candidates) -> list[dict[str, Any]]:
        """Per low-cardinality ``examples`` column: how many candidates and selected examples each value has."""
        if "examples" not in self.tables or candidates is None:
            return []
        schema = self.store.table("examples").schema
        columns = [name for name in schema.names if name != self.text_column]
        examples = self.store.table("examples").to_lance().to_table(columns=columns).to_pandas()
        examples = examples[examples.example_id.isin(set(candidates.example_id))]
        examples["selected"] = examples.example_id.isin(set(selected))
        result = []
        for column in examples.columns:
            if column in ("example_id", "selected", self.text_column):
                continue
            values = examples[column].astype("string").fillna("(none)")
            if not 1 < values.nunique() <= MAX_GROUPS:
                continue
            counts = examples.assign(group=values).groupby("group").selected.agg(["size", "sum"])
            result.append(
                {
                    "column": column,
                    "groups": counts.index.tolist(),
                    "candidates": counts["size"].astype(int).tolist(),
                    "selected": counts["sum"].astype(int).tolist(),
                }
            )
        return result

    # ------------------------------------------------------------------ evaluations and texts
    def evaluations(self) -> dict[str, Any] | None:
        """The ``evaluations`` table. Rows written by :mod:`gradstore.answers.evaluate` (with ``metric``, ``label``,
        ``value``) come newest first with the metric in the first column, and a ``summary`` puts each label's
        latest value of every metric side by side (LDS beside QLD, each with its standard error); a table of other
        columns is shown as it is."""
        if not self._has_rows("evaluations"):
            return None
        names = self.store.table("evaluations").schema.names
        if not {"metric", "label", "value"} <= set(names):
            frame = self._frame("SELECT * FROM evaluations LIMIT 500")
            return {
                "columns": [str(c) for c in frame.columns],
                "rows": [[_cell(v) for v in row] for row in frame.itertuples(index=False)],
            }
        where = self.run_clause if "run_id" in names else "TRUE"
        first = ["metric", "run_id", "label", "method", "value", "stderr", "noise_ceiling", "queries", "subsets"]
        shown = [c for c in first if c in names] + [c for c in names if c not in first and c != "evaluation_id"]
        newest = "created_at DESC, " if "created_at" in names else ""
        frame = self._frame(
            f"SELECT {', '.join(_quoted(c) for c in shown)} FROM evaluations WHERE {where} "
            f"ORDER BY {newest}metric, label LIMIT 500"
        )
        if frame.empty:
            return None
        result: dict[str, Any] = {
            "columns": [str(c) for c in frame.columns],
            "rows": [[_cell(v) for v in row] for row in frame.itertuples(index=False)],
        }
        result["summary"] = _evaluation_summary(frame)
        return result

    def online_selection(self) -> dict[str, Any] | None:
        """Per run, what online data selection (:mod:`gradstore.capture.online`) kept: steps, examples, the kept share
        and the mean score of the kept and of the dropped examples."""
        if not self._has_rows("online_selection"):
            return None
        frame = self._frame(
            "SELECT run_id, min(policy) AS policy, count(DISTINCT step) AS steps, count(*) AS examples, "
            "sum(kept::INT) AS kept, avg(kept::INT) AS kept_share, avg(score) FILTER (WHERE kept) AS score_kept, "
            "avg(score) FILTER (WHERE NOT kept) AS score_dropped "
            f"FROM online_selection WHERE {self.run_clause} GROUP BY run_id ORDER BY run_id"
        )
        if frame.empty:
            return None
        return {
            "columns": [str(c) for c in frame.columns],
            "rows": [[_cell(v) for v in row] for row in frame.itertuples(index=False)],
        }

    def texts(self, example_ids: set[str]) -> dict[str, str]:
        if self.text_column is None or not example_ids:
            return {}
        ids = pa.array(sorted(example_ids), pa.string())
        dataset = self.store.table("examples").to_lance()
        import pyarrow.compute as pc

        table = dataset.to_table(columns=["example_id", self.text_column])
        table = table.filter(pc.is_in(table.column("example_id"), value_set=ids))
        return {
            e: "" if t is None else str(t)
            for e, t in zip(table.column("example_id").to_pylist(), table.column(self.text_column).to_pylist())
        }


def _is_text(kind: pa.DataType) -> bool:
    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)


def _histogram(values: np.ndarray) -> dict[str, Any]:
    finite = values[np.isfinite(values)]
    if len(finite) == 0:
        return {"counts": [], "edges": []}
    counts, edges = np.histogram(finite, bins=HISTOGRAM_BINS)
    return {"counts": counts.tolist(), "edges": edges.tolist()}


def _records(frame) -> list[dict[str, Any]]:
    if frame is None:
        return []
    return [{k: _cell(v) for k, v in row.items()} for row in frame.to_dict(orient="records")]


def _quoted(column: str) -> str:
    return '"' + column.replace('"', '""') + '"'


def _evaluation_summary(frame) -> dict[str, Any]:
    """Each (run, label)'s latest value of every metric side by side (rows newest first in ``frame``):
    ``run, label, method, LDS, LDS stderr, QLD, QLD stderr, ...`` (metrics in name order; ``noise ceiling`` after
    a metric that has one)."""
    keys = ["run_id", "label"] if "run_id" in frame.columns else ["label"]
    metrics = sorted({str(m) for m in frame["metric"].dropna()})
    latest = frame.dropna(subset=["metric"]).drop_duplicates(subset=[*keys, "metric"], keep="first")
    ceilings = {
        m
        for m in metrics
        if "noise_ceiling" in frame.columns and latest.loc[latest.metric == m, "noise_ceiling"].notna().any()
    }
    columns = ["run" if k == "run_id" else k for k in keys] + (["method"] if "method" in frame.columns else [])
    for m in metrics:
        columns += [m.upper(), f"{m.upper()} stderr"] + ([f"{m.upper()} noise ceiling"] if m in ceilings else [])
    rows = []
    for key, group in latest.groupby(keys, sort=True, dropna=False):
        key = key if isinstance(key, tuple) else (key,)
        row = [_cell(k) for k in key] + ([_cell(group["method"].iloc[0])] if "method" in frame.columns else [])
        by_metric = {str(r["metric"]): r for _, r in group.iterrows()}
        for m in metrics:
            found = by_metric.get(m)
            row += [None, None] if found is None else [_cell(found["value"]), _cell(found.get("stderr"))]
            if m in ceilings:
                row.append(None if found is None else _cell(found["noise_ceiling"]))
        rows.append(row)
    return {"columns": columns, "rows": rows}


def _cell(value: Any) -> Any:
    """A table cell as a JSON scalar."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, np.generic):
        return _cell(value.item())
    if isinstance(value, datetime):  # pandas Timestamps too
        return value.isoformat(timespec="seconds")
    try:
        import pandas as pd

        if pd.isna(value):
            return None
    except (TypeError, ValueError):
        pass
    return str(value)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
