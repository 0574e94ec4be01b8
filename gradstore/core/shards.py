"""Shards: the units a scan over stored gradients is split into, one per task of an engine.

A :class:`Shard` names a group of Lance fragments of the gradients dataset at one pinned version, a filter
and the metadata columns to read. It is a small picklable value: a worker anywhere opens the dataset by URI
(object-store credentials come from the worker's environment, as for Lance) and streams the shard's rows
in blocks of at most ``block_rows``, so a worker holds one block at a time whatever the shard's size.

Two ways of splitting a selection:

* :func:`fragment_shards`: contiguous groups of fragments balanced by row count (rows are independent:
  top-k, fitting statistics, self-influence);
* :func:`example_shards`: every fragment, narrowed to a range of ``example_id`` values (scores summed per
  example over several rows, e.g. TracIn's checkpoints, need every row of an example in one task); Lance
  evaluates the range on the id column first and reads the vectors of the matching rows only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

import lance
import numpy as np
import pyarrow as pa

from gradstore.core import GradientBlock, StoreCore, sql_literal
from gradstore.core.stored_rows import stored_block, stored_columns
from gradstore.core.vector_scanner import vector_scanner
from gradstore.core.vectors import vector_columns
from indexers import VectorBlocks

DEFAULT_BLOCK_ROWS = 65536
#: A block's float32 vectors take at most about this many bytes (fewer rows for wide vectors): 4,096 rows at
#: 4,096 dims. A scoring worker holds several copies of a block (Lance's read-ahead, the decoded float32 rows,
#: the bf16 screen): its peak RSS on 1,000,000 x 4,096 rows was 1.3 GB at 4,096-row blocks, 1.8 GB at 8,192
#: and 2.6 GB at 16,384, with no measurable change in scan speed (``bench/scale.py``).
DEFAULT_BLOCK_BYTES = 64 << 20


def block_rows_for(dim: int, block_bytes: int = DEFAULT_BLOCK_BYTES) -> int:
    """Rows per block so that one float32 block of ``dim``-wide vectors takes about ``block_bytes``."""
    return max(1024, min(DEFAULT_BLOCK_ROWS, block_bytes // (4 * max(1, dim))))


@dataclass(frozen=True)
class Shard:
    """Some fragments of one version of the gradients dataset, filtered; streams its rows in blocks."""

    uri: str
    version: int
    fragments: tuple[int, ...]
    storage_dtype: str
    filter: str | None = None
    columns: tuple[str, ...] = ("example_id",)
    block_rows: int = DEFAULT_BLOCK_ROWS
    late_materialization: bool = False  # read vectors of matching rows only: for filters that match few rows
    storage_options: dict[str, str] | None = None  # object-store credentials and endpoint, as the store's

    def narrowed(self, where: str | None) -> Shard:
        """This shard with ``where`` ANDed to its filter."""
        if where is None:
            return self
        return replace(self, filter=where if self.filter is None else f"({self.filter}) AND ({where})")

    def blocks(self) -> Iterator[GradientBlock]:
        """The shard's rows as float32 blocks of at most ``block_rows`` rows, in dataset order."""
        metadata = [c for c in self.columns if c != "grad_id"]
        for batch in self._batches(lambda schema: ["grad_id", *metadata, *vector_columns(schema)]):
            yield GradientBlock.from_batch(batch, metadata, self.storage_dtype)

    def stored_blocks(self) -> Iterator[tuple]:
        """The shard's rows as stored (:func:`~gradstore.core.stored_rows.stored_block`: no float32 decoding), in
        blocks of at most ``block_rows`` rows, in dataset order; the metadata columns are not read."""
        for batch in self._batches(lambda schema: stored_columns(self.storage_dtype, schema)):
            yield stored_block(batch, self.storage_dtype)

    def _batches(self, columns_of: Callable[[pa.Schema], list[str]]) -> Iterator[pa.RecordBatch]:
        """The shard's non-empty batches of the columns ``columns_of(the dataset's schema)`` names."""
        if not self.fragments:
            return
        dataset = lance.dataset(self.uri, version=self.version, storage_options=self.storage_options)
        columns = columns_of(dataset.schema)
        fragments = [dataset.get_fragment(i) for i in self.fragments]
        scanner = vector_scanner(dataset, columns, self.filter, self.block_rows, self.late_materialization, fragments)
        yield from (batch for batch in scanner.to_batches() if batch.num_rows)

    def source(self) -> VectorBlocks:
        """The shard as a re-iterable ``(grad_ids, vectors)`` source (what preconditioners fit on)."""
        return lambda: ((block.grad_ids, block.vectors) for block in self.blocks())


def fragment_shards(
    store: StoreCore,
    run: str,
    where: str | None,
    parts: int,
    *,
    columns: Sequence[str] = ("example_id",),
    block_rows: int | None = None,
) -> list[Shard]:
    """The rows of run ``run``'s gradient table matching ``where`` as at most ``parts`` shards of contiguous
    fragments with about equal row counts, in dataset order. ``block_rows`` defaults to :func:`block_rows_for`
    the run's dim."""
    dataset = store.gradient_dataset(run)
    block_rows = block_rows or block_rows_for(store.run_dim(run))
    fragments = dataset.get_fragments()
    sizes = np.array([fragment.count_rows() for fragment in fragments], dtype=np.int64)
    groups: list[list[int]] = [[] for _ in range(max(1, min(parts, len(fragments))))]
    total = max(1, int(sizes.sum()))
    before = 0
    for fragment, size in zip(fragments, sizes):
        # the group holding the fragment's middle row: contiguous groups of about total/parts rows each
        groups[min(len(groups) - 1, (before + int(size) // 2) * len(groups) // total)].append(fragment.fragment_id)
        before += int(size)
    return [
        Shard(
            dataset.uri,
            dataset.version,
            tuple(group),
            store.storage_dtype,
            where,
            tuple(columns),
            block_rows,
            storage_options=store.storage_options,
        )
        for group in groups
        if group
    ]


def example_shards(
    store: StoreCore,
    run: str,
    where: str | None,
    sample_where: str | None,
    parts: int,
    *,
    columns: Sequence[str] = ("example_id",),
    block_rows: int | None = None,
    sample_size: int = 4096,
) -> list[Shard]:
    """The rows of run ``run``'s gradient table matching ``where`` as ``parts`` (or fewer) shards of disjoint
    ``example_id`` ranges covering every id, each over all fragments: every row of an example lands in the
    same shard.

    The range boundaries are quantiles of a sample of the ids of rows matching ``sample_where`` (every
    ``n / sample_size``-th id, streamed), so they balance the shards without holding all ids; any
    boundaries give the same results, only the balance depends on them."""
    dataset = store.gradient_dataset(run)
    block_rows = block_rows or block_rows_for(store.run_dim(run))
    whole = Shard(
        dataset.uri,
        dataset.version,
        tuple(f.fragment_id for f in dataset.get_fragments()),
        store.storage_dtype,
        where,
        tuple(columns),
        block_rows,
        late_materialization=parts > 1,
        storage_options=store.storage_options,
    )
    boundaries = _boundaries(dataset, sample_where, parts, sample_size) if parts > 1 else []
    ranges = list(zip([None, *boundaries], [*boundaries, None]))
    return [whole.narrowed(_range_filter(low, high)) for low, high in ranges]


def _boundaries(dataset: lance.LanceDataset, where: str | None, parts: int, sample_size: int) -> list[str]:
    rows = dataset.count_rows(where)
    stride = max(1, rows // sample_size)
    sample: list[str] = []
    seen = 0
    for batch in dataset.scanner(columns=["example_id"], filter=where, batch_size=65536).to_batches():
        ids = batch.column(0).to_pylist()
        sample += ids[(-seen) % stride :: stride]
        seen += len(ids)
    distinct = sorted(set(sample))
    if len(distinct) < 2:
        return []
    picks = {distinct[len(distinct) * i // parts] for i in range(1, parts)}
    return sorted(picks - {distinct[0]})


def _range_filter(low: str | None, high: str | None) -> str | None:
    clauses = ([f"example_id >= {sql_literal(low)}"] if low is not None else []) + (
        [f"example_id < {sql_literal(high)}"] if high is not None else []
    )
    return " AND ".join(clauses) or None
