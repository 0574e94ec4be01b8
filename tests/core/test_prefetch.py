"""Read-ahead: same items in the same order, errors where they happened, early exit stops the producer."""

from __future__ import annotations

import threading
import time

import pytest

from indexers import prefetched, read_ahead


def test_items_in_order_and_source_re_iterable() -> None:
    source = prefetched(lambda: iter(range(50)), depth=3)
    assert list(source()) == list(range(50))
    assert list(source()) == list(range(50))
    assert list(read_ahead([])) == []


def test_producer_runs_ahead_of_the_consumer() -> None:
    produced: list[int] = []

    def items():
        for i in range(3):
            produced.append(i)
            yield i

    ahead = read_ahead(items(), depth=1)
    assert next(ahead) == 0
    deadline = time.monotonic() + 5
    while len(produced) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert produced[:2] == [0, 1]  # item 1 was made while the caller still held item 0
    assert list(ahead) == [1, 2]


def test_error_is_raised_at_its_item() -> None:
    def items():
        yield 1
        raise KeyError("broken block")

    ahead = read_ahead(items())
    assert next(ahead) == 1
    with pytest.raises(KeyError, match="broken block"):
        next(ahead)


def test_early_exit_stops_the_thread() -> None:
    before = threading.active_count()
    for item in read_ahead(iter(range(10**9)), depth=2):
        if item == 3:
            break
    assert threading.active_count() == before
    with pytest.raises(ValueError, match="depth"):
        list(read_ahead([1], depth=0))
