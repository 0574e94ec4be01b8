"""Read ahead: a background thread produces the next items of an iterator while the caller uses the current one.

For block sources whose reading (Lance scan, decoding) and whose use (scoring) both release the GIL, this
overlaps the two: a pass costs about ``max(read, score)`` instead of ``read + score``.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

Item = TypeVar("Item")

_DONE = object()


def read_ahead(items: Iterable[Item], depth: int = 1) -> Iterator[Item]:
    """Yield ``items`` in order, produced up to ``depth`` items ahead by a background thread.

    An exception raised while producing is re-raised here, at the item where it happened. Closing the
    generator early (``break``, garbage collection) stops the thread after the item it is producing."""
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    ready: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def produce() -> None:
        try:
            for item in items:
                if not _put(ready, (item, None), stop):
                    return
        except BaseException as error:  # handed to the consumer, which re-raises it
            _put(ready, (_DONE, error), stop)
            return
        _put(ready, (_DONE, None), stop)

    thread = threading.Thread(target=produce, name="read-ahead", daemon=True)
    thread.start()
    try:
        while True:
            item, error = ready.get()
            if error is not None:
                raise error
            if item is _DONE:
                return
            yield item
    finally:
        stop.set()
        thread.join()


def _put(ready: queue.Queue, entry: tuple, stop: threading.Event) -> bool:
    """Put ``entry`` unless the consumer stopped; ``False`` when it did."""
    while not stop.is_set():
        try:
            ready.put(entry, timeout=0.05)
            return True
        except queue.Full:
            continue
    return False


def prefetched(source: Callable[[], Iterable[Item]], depth: int = 1) -> Callable[[], Iterator[Item]]:
    """A re-iterable source (e.g. :data:`indexers.blocks.VectorBlocks`) whose every pass reads ahead."""

    def ahead() -> Iterator[Item]:
        return read_ahead(source(), depth)

    return ahead
