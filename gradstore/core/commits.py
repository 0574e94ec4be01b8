"""Every write to the store's tables: through Lance datasets directly, inert, and retried on conflicts.

*Inert.* LanceDB acts on some schema metadata of a table when rows are added or searched: an
``embedding_functions`` entry makes it construct the named embedding function, which can load a model
with ``trust_remote_code`` (that is, import Python named by the store). gradstore never writes such
metadata and never lets LanceDB see it: tables whose schema carries it are refused when opened
(:func:`check_inert`), and rows are committed through ``lance`` itself (:func:`append`, :func:`upsert`),
which interprets no metadata, so a key planted after a table was opened is inert too.

*Retried.* Several processes may write one store, and compaction rewrites fragments while they do.
Lance reports a commit that lost such a race as a *retryable* conflict, before anything of it became
visible; :func:`retrying` re-runs the whole operation (re-reading the latest version) with jittered
exponential backoff, so every acknowledged write is committed exactly once.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import pyarrow as pa

from gradstore.core import schema as S
from gradstore.errors import StoreCorruptError

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Schema metadata keys LanceDB interprets (and may act on) when rows are added or a table is searched.
ACTIVE_METADATA_KEYS = ("embedding_functions",)
#: Messages of Lance errors that mean "nothing was committed, run the operation again".
RETRYABLE_MESSAGES = (
    "Retryable commit conflict",
    "Too many concurrent writers",
    # Lance rebased the transaction onto each newer version and gave up after its own retries (several writers
    # and a compaction committing all the time): nothing of it was committed
    "Failed to commit the transaction after",
)
MAX_ATTEMPTS = 12
BASE_DELAY_S = 0.02
MAX_DELAY_S = 2.0


def check_inert(schema: pa.Schema, where: str) -> None:
    """Raise ``StoreCorruptError`` if ``schema`` carries metadata LanceDB would act on."""
    keys = {k.decode() if isinstance(k, bytes) else k for k in (schema.metadata or {})}
    active = sorted(keys.intersection(ACTIVE_METADATA_KEYS))
    if active:
        raise StoreCorruptError(
            f"{where} carries schema metadata {active}, which gradstore never writes and "
            "which would make LanceDB load and run code named by the store; refusing to use it"
        )


def is_retryable(error: BaseException) -> bool:
    """Whether ``error`` is a Lance commit conflict that left nothing committed."""
    return any(message in str(error) for message in RETRYABLE_MESSAGES)


def retrying(operation: Callable[[], T], what: str, attempts: int = MAX_ATTEMPTS) -> T:
    """Run ``operation``; on a retryable commit conflict run it again after a jittered, growing delay."""
    for attempt in range(attempts):
        try:
            return operation()
        except Exception as error:
            if not is_retryable(error) or attempt == attempts - 1:
                raise
            delay = min(MAX_DELAY_S, BASE_DELAY_S * 2**attempt) * (0.5 + random.random())
            log.info("%s lost a commit race (%s); retrying in %.2fs", what, error, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")


def append(table: Any, data: pa.Table, what: str = "append") -> None:
    """Append ``data`` to a LanceDB table through its Lance dataset (no LanceDB preprocessing); a gradients
    table's rows go into data files of at most :func:`file_rows` rows."""
    rows = file_rows(data.schema)
    options = {} if rows is None else {"max_rows_per_file": rows}
    retrying(lambda: table.to_lance().insert(data, mode="append", **options), what)
    table.checkout_latest()  # this handle sees its own write whatever its read-consistency interval


def upsert(table: Any, data: pa.Table, on: Sequence[str], what: str = "upsert") -> None:
    """Insert ``data``, replacing the rows whose ``on`` columns match (Lance ``merge_insert``)."""
    retrying(
        lambda: (
            table.to_lance()
            .merge_insert(list(on))
            .when_matched_update_all()
            .when_not_matched_insert_all()
            .execute(data)
        ),
        what,
    )
    table.checkout_latest()


#: A gradients table's data files (one per fragment) hold about this many bytes of vectors at most: 4,096 rows of
#: 4,096 float16 dims. Lance reads a file's vector column into one buffer of about the file's size, and glibc maps
#: buffers above its mmap threshold fresh from the kernel for each file and unmaps them after (a page fault per page
#: read), so large files scan slowly; many small ones make the row files of exact search many pieces. Measured on
#: 50,000 x 4,096 float16 rows on the 2-core machine (2026-12-03), whole scans: 0.65-0.73 s in files of 32,768 rows
#: (256 MB, the compaction target before), 0.40-0.47 s of 4,096 or 8,192, 0.28-0.30 s of 2,048, 0.12-0.14 s of 1,024;
#: but a new process's first search with a row file took 0.174 s over 4,096-row files against 0.184 (8,192), 0.192
#: (32,768) and 0.215 s (1,024: 49 pieces to map and rescore). Small files also balance a scan's shards (groups of
#: whole fragments); Lance's default (about 1M rows, 8 GB at that width) left a two-worker scan with one task.
FILE_VECTOR_BYTES = 32 << 20
#: Fewest rows a gradients data file is cut to, however wide its rows.
MIN_FILE_ROWS = 256


def file_rows(schema: pa.Schema) -> int | None:
    """Rows of a data file of a table with this schema: bounded by :data:`FILE_VECTOR_BYTES` for a gradients table
    (a fixed-size-list vector column), Lance's default (``None``) for the others."""
    if S.VECTOR_COLUMN not in schema.names:
        return None
    vector_type = schema.field(S.VECTOR_COLUMN).type
    if not pa.types.is_fixed_size_list(vector_type):
        return None
    row_bytes = vector_type.list_size * max(1, vector_type.value_type.bit_width // 8)
    return max(MIN_FILE_ROWS, FILE_VECTOR_BYTES // row_bytes)


def small_fragments(dataset: Any) -> int:
    """Fragments of a Lance dataset that compaction would still merge (under half its target size)."""
    target = file_rows(dataset.schema) or 1 << 20
    return sum(1 for fragment in dataset.get_fragments() if fragment.count_rows() < target // 2)


def compact(table: Any, what: str = "compaction") -> None:
    """Compact a table's fragments into fragments of :func:`file_rows` (retried when a concurrent commit wins the
    race)."""

    def run() -> None:
        dataset = table.to_lance()
        target = file_rows(dataset.schema)
        dataset.optimize.compact_files(**({} if target is None else {"target_rows_per_fragment": target}))

    retrying(run, what)


class InertTable:
    """A LanceDB table as the streaming writer sees it (``add``, ``count_rows``, ``to_lance``, ``schema``), whose
    ``add`` is :func:`append`."""

    def __init__(self, table: Any) -> None:
        self.table = table

    @property
    def schema(self) -> pa.Schema:
        """The table's Arrow schema."""
        return self.table.schema

    def add(self, data: pa.Table) -> None:
        """Append ``data`` (retried on conflicts, no LanceDB preprocessing)."""
        append(self.table, data, "gradient commit")

    def count_rows(self, filter: str | None = None) -> int:
        """Rows matching ``filter``."""
        return self.table.count_rows(filter)

    def to_lance(self) -> Any:
        """The Lance dataset."""
        return self.table.to_lance()
