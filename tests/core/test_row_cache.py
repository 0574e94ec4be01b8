"""RowCache: least recently used entries dropped beyond the budget; another version of the same rows replaces
the old entry; values over the budget are not kept."""

from __future__ import annotations

import lance
import numpy as np
import pytest

from gradstore.core.row_cache import RowCache
from gradstore.errors import InvalidArgumentError


def test_budget_recency_and_versions() -> None:
    cache = RowCache(budget_bytes=10)
    cache.put((1, "a"), "a1", 4)
    cache.put((1, "b"), "b1", 4)
    assert cache.get((1, "a")) == "a1"  # now the most recently used
    cache.put((1, "c"), "c1", 4)  # 12 > 10: drops b, the least recently used
    assert cache.get((1, "b")) is None and cache.get((1, "a")) == "a1" and cache.get((1, "c")) == "c1"
    cache.put((2, "a"), "a2", 4)  # rows "a" at version 2: the version 1 entry goes
    assert cache.get((1, "a")) is None and cache.get((2, "a")) == "a2"
    assert cache.nbytes == 8 and len(cache) == 2
    assert not cache.admits(11)
    cache.put((2, "d"), "too big", 11)
    assert cache.get((2, "d")) is None and len(cache) == 2
    cache.clear()
    assert len(cache) == 0 and cache.nbytes == 0


def test_run_metadata_is_read_once_per_table_version(store, monkeypatch) -> None:
    """``run()`` and a hand-written run's checkpoint labels come from the row cache while their table's version
    is unchanged, and are read again (and right) once it changes; callers get copies."""
    store.create_run("a", dim=4)
    first = store.run("a")
    first["dim"] = 99  # a caller changing its copy changes nothing cached
    reads: list[int] = []
    original = lance.LanceDataset.to_table
    monkeypatch.setattr(
        lance.LanceDataset, "to_table", lambda self, *args, **kwargs: reads.append(1) or original(self, *args, **kwargs)
    )
    assert store.run("a")["dim"] == 4 and not reads
    store.create_run("b", dim=4)  # a new version of the runs table
    reads.clear()
    assert store.run("a")["dim"] == 4 and reads  # read again at the new version

    with store.writer("a") as writer:
        writer.append(np.ones((2, 4), np.float32), ["e0", "e1"], checkpoint="x")
    assert store.core.default_checkpoint("a") == "x"
    assert store.core.default_checkpoint("a") == "x"  # from the cache: the labels set was not consumed
    with store.writer("a") as writer:
        writer.append(np.ones((1, 4), np.float32), ["e2"], checkpoint="y")
    with pytest.raises(InvalidArgumentError, match="several checkpoint labels"):
        store.core.default_checkpoint("a")  # the new gradients version carries both labels


def test_prepared_rows_take_at_most_half_a_gpus_free_memory(monkeypatch) -> None:
    """The row cache's budget is a share of the host's memory; rows prepared on a GPU must also fit in half of
    its free memory (else they are streamed to it)."""
    import torch

    from gradstore.search.index import device_admits

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1000, 4000))
    cuda = torch.device("cuda")
    assert device_admits(500, cuda) and not device_admits(501, cuda)
    assert device_admits(10**15, torch.device("cpu"))  # the CPU: the row cache's own budget decides


@pytest.mark.parametrize("kernel", ["float32", "bfloat16"])
@pytest.mark.parametrize("stored", ["float16", "bfloat16", "float32"])
def test_the_row_cache_is_charged_what_the_prepared_rows_hold(kernel: str, stored: str) -> None:
    """``prepared_bytes`` per value equals the bytes of the row tensors a kernel keeps on the CPU (ids, norms and
    scales aside): the float32 kernel keeps the rows as stored, the bfloat16 kernel adds a bf16 copy unless they
    are bf16 already."""
    import torch

    from gradstore.search.index import prepared_bytes
    from indexers import ExactIndex
    from indexers.screening import ScreenedBlock

    rows = torch.randn(64, 32).to(getattr(torch, stored))
    index = ExactIndex(device="cpu", kernel=kernel)
    (block,) = index.prepare(np.arange(64), rows).blocks
    held = [block.exact, block.screen] if isinstance(block, ScreenedBlock) else [block[1]]
    distinct = {tensor.data_ptr(): tensor.numel() * tensor.element_size() for tensor in held}
    assert sum(distinct.values()) == 64 * 32 * prepared_bytes(stored, index)
