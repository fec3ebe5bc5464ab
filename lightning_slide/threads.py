"""Background workers that never hang training: a worker that fails, or stops making progress, stops the loop.

Every blocking wait in the engine goes through `Failure.wait`, which wakes at least every `POLL_S` seconds
to check whether some worker died, so an exception in a thread surfaces in the loop within a second.

The same waits are the watchdog. Each `Worker` records the item it is on and when it started or finished
one; a wait of the training loop that has seen no worker start or finish an item for the stall limit
raises `WorkerStalled`, naming each busy worker, its item and its Python stack. A worker blocked in a wait
of its own (a disk reader waiting for a free buffer) is only waiting for another: the stalled one is the
worker blocked anywhere else, in an optimizer step or a disk read.

A teardown after Ctrl-C (`Failure.finish`) gives queued work `INTERRUPT_GRACE_S` seconds, then abandons it:
the workers are daemon threads, and those still busy are left behind.
"""

from __future__ import annotations

import dataclasses
import queue
import reprlib
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Generic, TypeVar

import torch

T = TypeVar("T")
POLL_S = 0.05
STALL_FLOOR_S = 300.0  # the automatic stall limit: never less, also before any item has been timed
STALL_ITEMS = 10.0  # ... and this many times the longest item a worker has finished
INTERRUPT_GRACE_S = 3.0  # what a teardown after Ctrl-C gives the queued updates before abandoning them
STOP_AFTER_FAILURE_S = 0.5  # how long `Worker.stop` waits for a thread once the run has failed

_short = reprlib.Repr()
_short.maxstring = _short.maxother = 60


class WorkerError(RuntimeError):
    pass


class WorkerStalled(WorkerError):
    """No background worker made progress for the stall limit; the message holds the stalled worker's stack."""


class Failure:
    """The first exception raised by any background worker, shared by all of them, and the stall watchdog.

    `stall_timeout_s` is the limit (seconds without any worker starting or finishing an item while the
    training loop waits); None scales it: max(`STALL_FLOOR_S`, `STALL_ITEMS` x the longest item so far).
    """

    def __init__(self, stall_timeout_s: float | None = None) -> None:
        self.error: BaseException | None = None
        self.where = ""
        self.changed = threading.Condition()
        self.stall_timeout_s = stall_timeout_s
        self.workers: list[Worker] = []
        self.last_progress = time.perf_counter()
        self.longest_item_s = 0.0
        self._waiting: dict[int, str] = {}  # thread ident -> what its current `wait` is for
        self._deadline: float | None = None  # set by an interrupted teardown: no wait outlasts it

    def set(self, error: BaseException, where: str) -> None:
        with self.changed:
            if self.error is None:
                self.error, self.where = error, where
            self.changed.notify_all()

    def check(self) -> None:
        if isinstance(self.error, WorkerStalled):
            raise self.error.with_traceback(None)
        if self.error is not None:
            raise WorkerError(f"slideformer {self.where} failed: {self.error!r}") from self.error

    def wait(self, ready: Callable[[], bool], what: str) -> float:
        """Block until `ready()`; raise if a worker failed or the workers stalled meanwhile. Returns the seconds
        spent waiting."""
        start = time.perf_counter()
        me, watches = threading.get_ident(), not isinstance(threading.current_thread(), Worker)
        self._waiting[me] = what
        try:
            with self.changed:
                while not ready():
                    self.check()
                    now = time.perf_counter()
                    if self._deadline is not None and now > self._deadline:
                        raise TimeoutError(f"slideformer stopped waiting for {what}: the run was interrupted")
                    if watches:
                        self._watch(now - max(start, self.last_progress), what)
                    self.changed.wait(POLL_S)
        finally:
            self._waiting.pop(me, None)
        self.check()
        return time.perf_counter() - start

    def notify(self) -> None:
        with self.changed:
            self.changed.notify_all()

    # -------------------------------------------------------------------------------------- watchdog
    @property
    def stall_limit_s(self) -> float:
        if self.stall_timeout_s is not None:
            return self.stall_timeout_s
        return max(STALL_FLOOR_S, STALL_ITEMS * self.longest_item_s)

    def progress(self, took_s: float = 0.0) -> float:
        """A worker started an item (or finished one that took `took_s`): the workers are alive."""
        self.last_progress = now = time.perf_counter()
        self.longest_item_s = max(self.longest_item_s, took_s)
        return now

    def _watch(self, quiet_s: float, what: str) -> None:
        """Fail the run when no worker has made progress for the stall limit while the loop waited for `what`."""
        limit = self.stall_limit_s
        if quiet_s > limit:
            self.set(WorkerStalled(self._stall_report(quiet_s, limit, what)), "watchdog")
            self.check()

    def _stall_report(self, quiet_s: float, limit: float, what: str) -> str:
        frames, now = sys._current_frames(), time.perf_counter()
        busy = [(w, item) for w in list(self.workers) if (item := w.current) is not None and w.is_alive()]
        blocked = [(w, item) for w, item in busy if w.ident not in self._waiting]
        stuck = {id(w) for w, _ in blocked}
        setting = f"stall_timeout_s=None: max({STALL_FLOOR_S:.0f} s, {STALL_ITEMS:.0f} x the longest item)" \
            if self.stall_timeout_s is None else f"stall_timeout_s={self.stall_timeout_s}"
        lines = [f"slideformer: no background worker made progress for {quiet_s:.1f} s (the stall limit is "
                 f"{limit:.1f} s, {setting}) while the training loop waited for {what}."]
        for w, item in blocked or busy:
            stack = "".join(traceback.format_stack(frames[w.ident])) if w.ident in frames else "  (gone)\n"
            lines.append(f"{w.name} has been on {describe(item)} for {now - w.since:.1f} s; its stack:\n{stack}")
        lines += [f"{w.name} waits for {self._waiting.get(w.ident, '?')} (on {describe(item)})."
                  for w, item in busy if stuck and id(w) not in stuck]
        if not busy:
            lines.append("No worker is busy, so nothing will make it ready.")
        lines.append("If this work is legitimately slower, raise stall_timeout_s (seconds).")
        return "\n".join(lines)

    # -------------------------------------------------------------------------------------- teardown
    def finish(self, drain: Callable[[], object]) -> None:
        """Finish queued work with `drain` before the threads stop, unless a worker failed.

        In a teardown after Ctrl-C (a KeyboardInterrupt, or a SystemExit such as Lightning's SIGTERM exit,
        being handled) the work gets `INTERRUPT_GRACE_S` seconds, then the run counts as failed, so that
        nothing later waits for it and `Worker.stop` abandons the threads still busy.
        """
        if self.error is not None:
            return
        interrupt = sys.exc_info()[1]
        if not isinstance(interrupt, (KeyboardInterrupt, SystemExit)):
            drain()
            return
        self._deadline = time.perf_counter() + INTERRUPT_GRACE_S
        try:
            drain()
        except (TimeoutError, WorkerError):
            pass  # abandoned: the run stops anyway, with the interrupt Lightning is handling
        finally:
            self.set(interrupt, "the interrupted training loop")


def describe(item: object) -> str:
    """A short description of a queued item for a stall report: a dataclass's fields, tensors by shape."""
    if dataclasses.is_dataclass(item) and not isinstance(item, type):
        fields = (f"{f.name}={_field(getattr(item, f.name))}" for f in dataclasses.fields(item) if f.repr)
        return f"{type(item).__name__}({', '.join(fields)})"
    return _field(item)


def _field(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"<tensor {list(value.shape)} {value.dtype}>"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        scalars = (f"{f.name}={getattr(value, f.name)!r}" for f in dataclasses.fields(value)
                   if isinstance(getattr(value, f.name), (int, float, str, bool)))
        return f"{type(value).__name__}({', '.join(scalars)})"
    if callable(value):
        return getattr(value, "__qualname__", type(value).__name__)
    if isinstance(value, tuple):
        return f"({', '.join(_field(v) for v in value)})"
    return _short.repr(value)


class Worker(threading.Thread, Generic[T]):
    """A daemon thread that handles queued items in order and counts what it has finished.

    `current` is the item being handled (None between items) and `since` when it started: the watchdog's
    view of the thread. A wait inside an item (for a disk read, a CUDA event) counts as working on it.
    """

    def __init__(self, name: str, handle: Callable[[T], None], failure: Failure) -> None:
        super().__init__(name=f"slideformer-{name}", daemon=True)
        self._handle, self._failure = handle, failure
        self._queue: queue.SimpleQueue[T | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.submitted = 0
        self.finished = 0
        self.busy_s = 0.0
        self.current: T | None = None
        self.since = 0.0
        failure.workers.append(self)
        self.start()

    def put(self, item: T) -> None:
        self._failure.check()
        with self._lock:  # producers: the training thread and the copy thread
            self.submitted += 1
        self._queue.put(item)

    def idle(self) -> bool:
        return self.finished == self.submitted

    def waiting(self) -> bool:
        """Items are queued behind the one being handled."""
        return not self._queue.empty()

    def stop(self) -> None:
        """End the thread after its queued items; once the run has failed, a thread stuck in one is left behind."""
        self._queue.put(None)
        self.join(timeout=STOP_AFTER_FAILURE_S if self._failure.error is not None else 10)
        if not self.is_alive() and self in self._failure.workers:
            self._failure.workers.remove(self)

    def run(self) -> None:
        while (item := self._queue.get()) is not None:
            if self._failure.error is not None:
                continue  # drain without work so stop() returns promptly
            self.current, self.since = item, self._failure.progress()
            try:
                self._handle(item)
            except BaseException as error:  # noqa: BLE001 - re-raised in the training loop
                self.current = None
                self._failure.set(error, self.name)
                continue
            took = time.perf_counter() - self.since
            self.current = None
            self.busy_s += took
            self.finished += 1
            self._failure.progress(took)
            self._failure.notify()
