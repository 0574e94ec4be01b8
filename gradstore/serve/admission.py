"""How many requests a server works on at once: ``Limits.max_concurrent`` run, up to ``Limits.max_waiting`` wait
their turn (first come, first served) for at most ``Limits.queue_timeout_s``; beyond that a request is refused with
``ServerBusyError`` (503) instead of piling up. One :class:`Admission` is shared by both transports: Flight handler
threads wait in :meth:`Admission.acquire`, the HTTP side (before it reads a body) in :meth:`Admission.acquire_async`
without holding a thread."""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager

from gradstore.serve.errors import ServerBusyError


class _Waiter:
    __slots__ = ("granted", "wake")

    def __init__(self, wake: Callable[[], None]) -> None:
        self.wake = wake
        self.granted = False


class Admission:
    """``running`` slots and a queue of at most ``waiting`` requests."""

    def __init__(self, running: int, waiting: int) -> None:
        if running < 1 or waiting < 0:
            raise ValueError("Admission needs running >= 1 and waiting >= 0")
        self._lock = threading.Lock()
        self._free = running
        self._queue: deque[_Waiter] = deque()
        self.running = running
        self.waiting = waiting

    @property
    def in_use(self) -> int:
        """Slots taken now (for tests and benches)."""
        with self._lock:
            return self.running - self._free

    def _enter(self, wake: Callable[[], None]) -> _Waiter | None:
        """Take a free slot (``None``) or join the queue (the waiter); ``ServerBusyError`` when it is full."""
        with self._lock:
            if self._free > 0 and not self._queue:
                self._free -= 1
                return None
            if len(self._queue) >= self.waiting:
                raise ServerBusyError(f"the server is busy ({self.running} requests running, {self.waiting} waiting)")
            waiter = _Waiter(wake)
            self._queue.append(waiter)
            return waiter

    def _leave(self, waiter: _Waiter) -> bool:
        """Give up waiting; ``True`` if the slot was granted meanwhile (the caller then holds it)."""
        with self._lock:
            if waiter.granted:
                return True
            self._queue.remove(waiter)
            return False

    def release(self) -> None:
        with self._lock:
            if self._queue:
                waiter = self._queue.popleft()
                waiter.granted = True
                waiter.wake()
            else:
                self._free += 1

    def acquire(self, timeout_s: float) -> None:
        """Wait (this thread) for a slot, at most ``timeout_s`` seconds."""
        event = threading.Event()
        waiter = self._enter(event.set)
        if waiter is None or event.wait(timeout_s) or self._leave(waiter):
            return
        raise ServerBusyError(f"the server is busy: no request slot within {timeout_s:g} s")

    async def acquire_async(self, timeout_s: float) -> None:
        """Wait (this task) for a slot, at most ``timeout_s`` seconds."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()

        def wake() -> None:
            loop.call_soon_threadsafe(lambda: future.done() or future.set_result(None))

        waiter = self._enter(wake)
        if waiter is None:
            return
        try:
            await asyncio.wait_for(asyncio.shield(future), timeout_s)
        except asyncio.TimeoutError:
            if not self._leave(waiter):
                raise ServerBusyError(f"the server is busy: no request slot within {timeout_s:g} s") from None
        except BaseException:  # cancelled while waiting (the client went away): give the slot on
            if self._leave(waiter):
                self.release()
            raise

    @contextmanager
    def slot(self, timeout_s: float) -> Iterator[None]:
        self.acquire(timeout_s)
        try:
            yield
        finally:
            self.release()

    @asynccontextmanager
    async def slot_async(self, timeout_s: float) -> AsyncIterator[None]:
        await self.acquire_async(timeout_s)
        try:
            yield
        finally:
            self.release()
