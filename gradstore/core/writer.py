"""The streaming gradient writer: buffers appended rows and commits them to Lance in large batches.

``append`` checks the rows and adds a copy to an in-memory buffer; encoding the vectors for storage and
building the Arrow table happen once per buffer on the background thread, off the training loop (large
vectorised passes, never small multi-threaded kernels on the hot path). When the buffer reaches
``commit_rows`` rows or ``commit_bytes`` bytes (or its oldest row is ``commit_seconds`` old) it is handed
to a background thread through a bounded queue, which commits it as one Lance transaction. A full queue
blocks ``append`` (backpressure): memory stays bounded by ``(max_pending_commits + 1)`` buffers.
``flush()`` returns once every appended row is committed; ``close()`` flushes and stops the thread.

Every commit is atomic: a process killed at any moment leaves a store that opens and holds each row of
every completed commit exactly once, and no partial rows. Rows still in the buffer are lost.

The background thread also keeps the fragment count bounded by compacting small fragments.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import math
import os
import queue
import threading
import time
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from gradstore.core import commits
from gradstore.core import schema as S
from gradstore.core.append_metadata import checked_metadata, metadata_column, take
from gradstore.core.vectors import MAX_NORM, encode, row_peaks, too_large_rows
from gradstore.errors import (
    GradstoreWarning,
    InvalidArgumentError,
    NonFiniteGradientError,
    SchemaMismatchError,
    WriterClosedError,
)

log = logging.getLogger(__name__)

_STOP = object()

#: The prefix of the ids of queries given as raw vectors (``vector:0``, ``vector:1``, ... in results and in the
#: ``scores`` table): reserved, so no stored row's ``example_id`` begins with it and no such query's answers mix with
#: those of a stored query.
VECTOR_QUERY_PREFIX = "vector:"


@dataclass(frozen=True)
class WriterConfig:
    """Thresholds of the streaming writer.

    Attributes:
        commit_rows: commit once the buffer holds this many rows.
        commit_bytes: ... or this many bytes.
        commit_seconds: ... or its oldest row has waited this long (checked on append and by the thread).
        max_pending_commits: buffers that may wait for the committing thread before ``append`` blocks.
        max_fragments: compact when a table holds more small fragments (under half the compaction target,
            :func:`gradstore.core.commits.file_rows`) than this (0: never, for writers whose rows
            another process commits, see :mod:`gradstore.distributed`).
        nonfinite: ``"raise"`` rejects a batch with NaN/Inf rows (``NonFiniteGradientError``, nothing of
            the batch is written); ``"drop"`` drops those rows, logs a warning and counts them.
    """

    commit_rows: int = 4096
    commit_bytes: int = 64 << 20
    commit_seconds: float = 30.0
    max_pending_commits: int = 2
    max_fragments: int = 64
    nonfinite: str = "raise"

    def __post_init__(self) -> None:
        if self.nonfinite not in ("raise", "drop"):
            raise InvalidArgumentError(f"nonfinite must be 'raise' or 'drop', got {self.nonfinite!r}")
        for name, least in (("commit_rows", 1), ("commit_bytes", 1), ("max_pending_commits", 1), ("max_fragments", 0)):
            value = getattr(self, name)
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < least:
                raise InvalidArgumentError(f"{name} must be a whole number >= {least}, got {value!r}")
        seconds = self.commit_seconds
        if (
            isinstance(seconds, (bool, np.bool_))
            or not isinstance(seconds, (int, float, np.integer, np.floating))
            or not math.isfinite(seconds)
            or seconds < 0
        ):
            raise InvalidArgumentError(
                f"commit_seconds must be a finite number of seconds >= 0 (0: commit at every append), got "
                f"{seconds!r}: to commit by rows and bytes only, pass a large number (e.g. 3600)"
            )


def new_id_block(existing_prefix_taken) -> int:
    """Draw a random 31-bit id prefix that ``existing_prefix_taken(prefix)`` says is free."""
    while True:
        prefix = int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF
        if prefix and not existing_prefix_taken(prefix):
            return prefix


#: Writers not closed yet: closed (their rows committed) when the interpreter exits, with a warning.
_OPEN: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_open_writers() -> None:
    """At interpreter exit, commit the rows of every writer the program did not close (its background thread is a
    daemon: the rows it buffers would be lost with it) and say so."""
    for writer in list(_OPEN):
        pending = writer._buffer.rows if writer._buffer is not None else 0
        try:
            writer.close()
        except Exception as error:  # at exit: report, never raise
            warnings.warn(
                f"gradstore: a writer of run {writer.run_id!r} left open failed to commit at exit: {error!r}",
                GradstoreWarning,
                stacklevel=1,
            )
            continue
        warnings.warn(
            f"gradstore: a writer of run {writer.run_id!r} was left open; its last {pending} buffered row(s) were "
            "committed at exit. Close writers (`with store.writer(run) as writer:` or writer.close()): rows "
            "buffered by an open writer are lost if the process is killed",
            GradstoreWarning,
            stacklevel=1,
        )


class GradientWriter:
    """Buffered, background-committing appender of gradient rows for one run.

    ``grad_id`` values are ``prefix << 32 | counter``: the 31-bit prefix is drawn at random for each writer
    and checked against the table (and ``id_tables``, the store's other gradient tables), so writers in
    different processes never collide and ids stay stable across compaction (unlike Lance's ``_rowid``).
    """

    def __init__(
        self,
        table: Any,
        *,
        run_id: str,
        dim: int,
        storage_dtype: str,
        config: WriterConfig | None = None,
        id_tables: Sequence[Any] = (),
    ) -> None:
        self._table = table
        self._id_tables = [table, *id_tables]
        self.run_id = run_id
        self.dim = dim
        self.storage_dtype = storage_dtype
        self.config = config or WriterConfig()
        # an int8 table made before the block format keeps its per-row format
        self._int8_blocks = storage_dtype != "int8" or S.EXPONENT_COLUMN in table.schema.names
        self._schema = (
            S.gradients_schema(dim, storage_dtype)
            if self._int8_blocks
            else S.gradients_schema(dim, storage_dtype, int8_blocks=False)
        )
        self._prefix = new_id_block(self._prefix_taken)
        self._counter = 0
        self._lock = threading.Lock()
        self._buffer: _Buffer | None = None
        self._capacity = max(1, min(self.config.commit_rows, self.config.commit_bytes // (4 * dim + 64)))
        self._spare_blocks: list[np.ndarray] = []  # encoded buffers' float32 blocks, reused (no page faults)
        self._queue: queue.Queue = queue.Queue(maxsize=self.config.max_pending_commits)
        self._error: BaseException | None = None
        self._closed = False
        self.rows_committed = 0
        self.rows_dropped = 0
        self.commits = 0
        self.compactions = 0
        self._thread = threading.Thread(target=self._run, name=f"gradstore-writer-{run_id}", daemon=True)
        self._thread.start()
        _OPEN.add(self)

    # ------------------------------------------------------------------ public API
    def append(self, grads: Any, example_ids: Sequence[str], **metadata: Any) -> np.ndarray:
        """Append rows: ``grads`` float array ``[n, dim]`` (numpy or torch), one id per row.

        Metadata columns (scalars broadcast to all rows, or length-``n`` sequences): ``checkpoint``,
        ``step``, ``epoch``, ``example_hash``, ``split``, ``rank``, ``loss``, ``num_tokens``,
        ``learning_rate``. ``checkpoint`` defaults to capture's default label (``"train"``), so rows written
        by hand are selected as captured ones are. Ids beginning with :data:`VECTOR_QUERY_PREFIX` are refused.
        Returns the rows' ``grad_id``s (empty for dropped rows).
        """
        self._raise_if_failed()
        vectors = _as_float32_rows(grads, self.dim)
        ids = [str(i) for i in example_ids]
        if len(ids) != len(vectors):
            raise SchemaMismatchError(f"{len(vectors)} gradient rows but {len(ids)} example ids")
        reserved = next((i for i in ids if i.startswith(VECTOR_QUERY_PREFIX)), None)
        if reserved is not None:
            raise InvalidArgumentError(
                f"example id {reserved!r} begins with {VECTOR_QUERY_PREFIX!r}, the prefix reserved for the ids of "
                "queries given as vectors (their scores would mix with this row's): name the example otherwise"
            )
        metadata = checked_metadata({"checkpoint": S.DEFAULT_CHECKPOINT, **metadata}, len(ids))
        vectors, ids, metadata = self._check_finite(vectors, ids, metadata)
        n = len(ids)
        if n == 0:
            return np.empty(0, dtype=np.int64)
        with self._lock:
            start = self._counter
            if start + n >= 1 << 32:
                self._prefix, start = new_id_block(self._prefix_taken), 0
            self._counter = start + n
            grad_ids = (np.int64(self._prefix) << 32) + np.arange(start, start + n, dtype=np.int64)
        chunk = _Chunk(grad_ids, ids, metadata)
        with self._lock:
            overflow = self._buffer is not None and self._buffer.rows + n > self._buffer.capacity
        if overflow:
            self._hand_over()
        with self._lock:
            if self._buffer is None:
                self._buffer = _Buffer(self._block(n))
            self._buffer.add(chunk, vectors)
            full = (
                self._buffer.rows >= self._capacity
                or time.monotonic() - self._buffer.since >= self.config.commit_seconds
            )
        if full:
            self._hand_over()
        return grad_ids

    def flush(self) -> None:
        """Commit every appended row; returns when they are visible to readers."""
        self._raise_if_failed()
        self._hand_over()
        done = threading.Event()
        self._queue.put(done)
        while not done.wait(0.1):
            if not self._thread.is_alive():
                break
        self._raise_if_failed()

    def close(self) -> None:
        """Flush, then stop the background thread. Idempotent."""
        if self._closed:
            return
        try:
            if self._error is None:
                self.flush()
        finally:
            self._closed = True
            _OPEN.discard(self)
            self._queue.put(_STOP)
            self._thread.join()
        if self._error is not None:
            raise WriterClosedError(f"a background commit failed: {self._error!r}") from self._error

    def __enter__(self) -> GradientWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals
    def _prefix_taken(self, prefix: int) -> bool:
        low, high = prefix << 32, (prefix + 1) << 32
        return any(
            table.count_rows() > 0 and table.count_rows(f"grad_id >= {low} AND grad_id < {high}") > 0
            for table in self._id_tables
        )

    def _check_finite(self, vectors: np.ndarray, ids: list[str], metadata: dict) -> tuple:
        peaks = row_peaks(vectors)
        large = too_large_rows(vectors, peaks)
        if len(large):
            raise SchemaMismatchError(
                f"{len(large)} gradient row(s) have a norm above {MAX_NORM:.3g}, which the store cannot hold (it "
                f"would become inf; example ids {[ids[i] for i in large[:5]]}); the batch was not written"
            )
        finite = np.isfinite(peaks)
        if finite.all():
            return vectors, ids, metadata
        bad = [ids[i] for i in np.flatnonzero(~finite)]
        if self.config.nonfinite == "raise":
            raise NonFiniteGradientError(
                f"{len(bad)} gradient row(s) contain NaN/Inf or values beyond float32's range (example ids "
                f"{bad[:5]}{'...' if len(bad) > 5 else ''}); the batch was not written. Pass nonfinite='drop' to "
                "drop such rows instead."
            )
        log.warning("dropping %d non-finite gradient row(s): %s", len(bad), bad[:5])
        self.rows_dropped += len(bad)
        keep = np.flatnonzero(finite)
        metadata = {k: take(v, keep) for k, v in metadata.items()}
        return vectors[keep], [ids[i] for i in keep], metadata

    def _table_of(self, buffer: _Buffer) -> pa.Table:
        """One Arrow table of a buffer (metadata columns built and vectors encoded once per commit)."""
        chunks, n = buffer.chunks, buffer.rows
        columns: dict[str, pa.Array] = {
            "grad_id": pa.array(np.concatenate([c.grad_ids for c in chunks]), pa.int64()),
            "run_id": pa.repeat(pa.scalar(self.run_id, pa.string()), n),
            "example_id": pa.array(itertools.chain.from_iterable(c.example_ids for c in chunks), pa.string(), size=n),
        }
        for field in S.GRADIENT_METADATA_FIELDS:
            if field.name not in columns:
                columns[field.name] = metadata_column(
                    field, [c.metadata.get(field.name) for c in chunks], [len(c.example_ids) for c in chunks]
                )
        columns.update(encode(buffer.vectors[:n], self.storage_dtype, blocks=self._int8_blocks))
        return pa.Table.from_arrays([columns[name] for name in self._schema.names], schema=self._schema)

    def _block(self, rows: int) -> np.ndarray:
        """A float32 block for a new buffer of at least ``rows`` rows: a spare one when it fits. Caller holds
        the lock."""
        if rows <= self._capacity and self._spare_blocks:
            return self._spare_blocks.pop()
        return np.empty((max(self._capacity, rows), self.dim), dtype=np.float32)

    def _recycle(self, buffer: _Buffer) -> None:
        """Keep an encoded buffer's block for a later buffer (at most as many as can be in flight)."""
        with self._lock:
            if len(buffer.vectors) == self._capacity and len(self._spare_blocks) <= self.config.max_pending_commits:
                self._spare_blocks.append(buffer.vectors)

    def _hand_over(self) -> None:
        with self._lock:
            buffer, self._buffer = self._buffer, None
        if buffer is not None:
            self._put(buffer)

    def _put(self, item: object) -> None:
        while True:  # bounded wait so a dead thread surfaces as an error instead of a hang
            self._raise_if_failed()
            try:
                self._queue.put(item, timeout=0.5)
                return
            except queue.Full:
                if not self._thread.is_alive():
                    raise WriterClosedError("the writer's background thread stopped") from self._error

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise WriterClosedError(f"a background commit failed: {self._error!r}") from self._error
        if self._closed:
            raise WriterClosedError("this writer is closed")

    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=max(self.config.commit_seconds / 2, 0.05))
            except queue.Empty:
                self._commit_if_stale()
                continue
            if item is _STOP:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            if self._error is None:
                self._commit(item)

    def _commit_if_stale(self) -> None:
        with self._lock:
            buffer = self._buffer
            if buffer is None or time.monotonic() - buffer.since < self.config.commit_seconds:
                return
            self._buffer = None
        self._commit(buffer)

    def _commit(self, buffer: _Buffer) -> None:
        try:
            table = self._table_of(buffer)  # holds copies: the buffer's block is free again
            self._recycle(buffer)
            self._table.add(table)
            self.commits += 1
            self.rows_committed += table.num_rows
        except BaseException as error:  # surfaced to the caller on its next append/flush
            log.error("gradstore writer commit failed: %r", error)
            self._error = error
            return
        self._compact_if_fragmented()

    def _compact_if_fragmented(self) -> None:
        """Compact when fragments pile up; housekeeping only, so a failure is logged and never stops ingest."""
        if not self.config.max_fragments:
            return
        try:
            if commits.small_fragments(self._table.to_lance()) > self.config.max_fragments:
                commits.compact(self._table, "writer compaction")
                self.compactions += 1
        except Exception as error:
            log.warning("gradstore writer: compaction skipped (%r); the rows are committed", error)


@dataclass
class _Chunk:
    """The rows of one ``append``: their ids and validated metadata (the vectors go to the buffer's block)."""

    grad_ids: np.ndarray
    example_ids: list[str]
    metadata: dict[str, pa.Scalar | pa.Array]  # scalars (broadcast) or one value per row


class _Buffer:
    """Rows waiting for one commit: per-append chunks and one float32 block that appends copy into
    (no per-append allocation, no concatenation at commit time)."""

    def __init__(self, block: np.ndarray) -> None:
        self.chunks: list[_Chunk] = []
        self.vectors = block
        self.rows = 0
        self.since = time.monotonic()

    @property
    def capacity(self) -> int:
        """Rows the block holds."""
        return len(self.vectors)

    def add(self, chunk: _Chunk, vectors: np.ndarray) -> None:
        """Copy ``vectors`` (one row per id of ``chunk``) into the block."""
        self.vectors[self.rows : self.rows + len(vectors)] = vectors
        self.chunks.append(chunk)
        self.rows += len(vectors)


def _as_float32_rows(grads: Any, dim: int) -> np.ndarray:
    if hasattr(grads, "detach"):  # torch tensor, without importing torch here
        grads = grads.detach().to("cpu").float().numpy()
    with np.errstate(over="ignore"):  # values beyond float32 become inf and are refused as such
        vectors = np.asarray(grads, dtype=np.float32)
    if vectors.ndim != 2 or vectors.shape[1] != dim:
        raise SchemaMismatchError(f"gradient rows must have shape [n, {dim}], got {list(vectors.shape)}")
    return vectors
