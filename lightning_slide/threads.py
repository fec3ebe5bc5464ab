"""Background workers that never hang training: a failure anywhere is re-raised in the training loop.

Every blocking wait in the engine goes through `Failure.wait`, which wakes at least every `POLL_S` seconds
to check whether some worker died, so an exception in a thread surfaces in the loop within a second.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable, Generic, TypeVar

T = TypeVar("T")
POLL_S = 0.05


class WorkerError(RuntimeError):
    pass


class Failure:
    """The first exception raised by any background worker, shared by all of them."""

    def __init__(self) -> None:
        self.error: BaseException | None = None
        self.where = ""
        self.changed = threading.Condition()

    def set(self, error: BaseException, where: str) -> None:
        with self.changed:
            if self.error is None:
                self.error, self.where = error, where
            self.changed.notify_all()

    def check(self) -> None:
        if self.error is not None:
            raise WorkerError(f"slideformer {self.where} failed: {self.error!r}") from self.error

    def wait(self, ready: Callable[[], bool], what: str, timeout: float | None = None) -> float:
        """Block until `ready()`; raise if a worker failed meanwhile. Returns the seconds spent waiting."""
        start = time.perf_counter()
        with self.changed:
            while not ready():
                self.check()
                if timeout is not None and time.perf_counter() - start > timeout:
                    raise TimeoutError(f"slideformer timed out after {timeout:.0f} s waiting for {what}")
                self.changed.wait(POLL_S)
        self.check()
        return time.perf_counter() - start

    def notify(self) -> None:
        with self.changed:
            self.changed.notify_all()


class Worker(threading.Thread, Generic[T]):
    """A daemon thread that handles queued items in order and counts what it has finished."""

    def __init__(self, name: str, handle: Callable[[T], None], failure: Failure) -> None:
        super().__init__(name=f"slideformer-{name}", daemon=True)
        self._handle, self._failure = handle, failure
        self._queue: queue.SimpleQueue[T | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.submitted = 0
        self.finished = 0
        self.busy_s = 0.0
        self.start()

    def put(self, item: T) -> None:
        self._failure.check()
        with self._lock:  # producers: the training thread and the copy thread
            self.submitted += 1
        self._queue.put(item)

    def idle(self) -> bool:
        return self.finished == self.submitted

    def stop(self) -> None:
        self._queue.put(None)
        self.join(timeout=10)

    def run(self) -> None:
        while (item := self._queue.get()) is not None:
            if self._failure.error is not None:
                continue  # drain without work so stop() returns promptly
            start = time.perf_counter()
            try:
                self._handle(item)
            except BaseException as error:  # noqa: BLE001 - re-raised in the training loop
                self._failure.set(error, self.name)
                continue
            self.busy_s += time.perf_counter() - start
            self.finished += 1
            self._failure.notify()
