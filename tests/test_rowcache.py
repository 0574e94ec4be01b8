"""RowCache: least recently used entries dropped beyond the budget; another version of the same rows replaces
the old entry; values over the budget are not kept."""

from __future__ import annotations

from gradstore.core.rowcache import RowCache


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
