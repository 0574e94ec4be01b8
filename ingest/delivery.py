"""Move finished batches off the training device and hand them to the sink on a background thread.

The queue holds at most ``max_pending`` batches; :meth:`Delivery.submit` blocks when it is full
(backpressure on the training loop instead of unbounded memory). On CUDA the rows are copied with
``non_blocking=True`` into pinned host memory and the worker waits on a CUDA event before it calls
the sink, so the training stream is never synchronised by capture.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import torch

from ingest.misuse import CaptureUsageError

_STOP = object()


class Delivery:
    """A bounded queue and one worker thread that calls ``deliver(item)`` for each submitted item."""

    def __init__(self, deliver: Callable[[dict[str, Any]], None], max_pending: int) -> None:
        if max_pending < 1:
            raise CaptureUsageError("max_pending_batches must be at least 1")
        self._deliver = deliver
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="gradstore-capture-sink", daemon=True)
        self._thread.start()

    @staticmethod
    def to_host(t: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Start an asynchronous copy of ``t`` to (pinned) host memory; returns it and an event to wait on."""
        if t.device.type != "cuda":
            return t.detach().cpu(), None
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t.detach(), non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(t.device))
        return host, event

    def submit(self, item: dict[str, Any], event: torch.cuda.Event | None) -> None:
        """Queue ``item`` (waits while ``max_pending`` items are queued); re-raises a sink failure."""
        self.raise_error()
        self._queue.put((item, event))

    def flush(self) -> None:
        """Wait until every submitted item reached the sink; re-raises a sink failure."""
        self._queue.join()
        self.raise_error()

    def close(self) -> None:
        """Deliver what is pending, then stop the worker."""
        self._queue.put((_STOP, None))
        self._thread.join()

    def raise_error(self) -> None:
        """Re-raise (once), as itself, an exception raised by the sink on the worker thread."""
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _run(self) -> None:
        while True:
            item, event = self._queue.get()
            try:
                if item is _STOP:
                    return
                if event is not None:
                    event.synchronize()
                if self._error is None:
                    self._deliver(item)
            except Exception as exc:  # the sink's failure is reported on the training thread
                self._error = exc
            finally:
                self._queue.task_done()
