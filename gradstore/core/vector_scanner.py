"""How the store scans the vector column of a gradient table: one set of Lance scanner options for every reader.

Two choices matter for speed and memory, both measured on 50,000 x 4,096 float16 rows on the 2-core machine:

* **Read-ahead.** Lance's defaults buffer about 2 GB of I/O ahead of the consumer, so a reader's peak memory
  grew with the rows it scanned; :data:`READAHEAD_BATCHES` and :data:`IO_BUFFER_BYTES` bound it to about the
  I/O buffer plus a few batches, with no measurable loss of scan speed.
* **Late materialization** (Lance reads the filter's columns, then *takes* the vectors of the matching rows only)
  costs about 0.57 s x the matching share of the rows here; reading every row's vector and filtering after costs
  about 0.45-0.57 s whatever the share (10% of the rows: 0.075 s late vs 0.47 s early; 70%: 0.36 vs 0.57; all:
  0.57 vs 0.44). A scan that knows its share (:func:`late_materialization`) takes the vectors only while it is
  below :data:`EARLY_MATERIALIZATION_SHARE`.
"""

from __future__ import annotations

from collections.abc import Sequence

import lance

READAHEAD_BATCHES = 2
IO_BUFFER_BYTES = 256 << 20
#: From this share of a table's rows on, a filtered scan reads every row's vector and filters afterwards.
EARLY_MATERIALIZATION_SHARE = 0.85


def late_materialization(selected_rows: int, table_rows: int) -> bool:
    """Whether a filtered scan keeping ``selected_rows`` of ``table_rows`` should take the vectors of the matching
    rows after the filter (``True``) rather than read every row's vector (``False``)."""
    return selected_rows < EARLY_MATERIALIZATION_SHARE * table_rows


def vector_scanner(
    dataset: lance.LanceDataset,
    columns: Sequence[str],
    filter: str | None,
    block_rows: int,
    late: bool,
    fragments: Sequence[lance.LanceFragment] | None = None,
) -> lance.LanceScanner:
    """A scanner of ``columns`` (the vector column among them) of the rows of ``dataset`` (or of ``fragments``)
    matching ``filter``, in dataset order, in batches of at most ``block_rows`` rows; ``late``: see
    :func:`late_materialization`."""
    return dataset.scanner(
        columns=list(columns),
        filter=filter,
        batch_size=block_rows,
        fragments=None if fragments is None else list(fragments),
        scan_in_order=True,
        batch_readahead=READAHEAD_BATCHES,
        fragment_readahead=1,
        io_buffer_size=IO_BUFFER_BYTES,
        late_materialization=late,
    )
