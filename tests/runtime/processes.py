"""Work run in a forked child process that is then SIGKILLed (as the OOM killer does) or kept running.

Forking shares everything this test process has imported, so a child starts in milliseconds. The child
runs `work(report)`; `report(value)` hands a value back. Work that must keep what it made (a disk tier
whose finalizer would remove its folder, a save in progress) blocks after reporting instead of returning.
"""

from __future__ import annotations

import multiprocessing
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

Work = Callable[[Callable[[Any], None]], None]
_FORK = multiprocessing.get_context("fork")


def _child(work: Work, conn) -> None:
    work(conn.send)
    while True:  # the parent decides how this process ends
        time.sleep(60)


@contextmanager
def _started(work: Work, timeout: float) -> Iterator[tuple[multiprocessing.Process, Any]]:
    parent, child = _FORK.Pipe()
    process = _FORK.Process(target=_child, args=(work, child), daemon=True)
    process.start()
    try:
        if not parent.poll(timeout):
            raise TimeoutError(f"the child process reported nothing within {timeout} s")
        yield process, parent.recv()
    finally:
        process.kill()
        process.join()


@contextmanager
def running(work: Work, timeout: float = 30.0) -> Iterator[tuple[int, Any]]:
    """(pid, reported value) of a child doing `work`: alive inside the block, killed after it."""
    with _started(work, timeout) as (process, value):
        yield process.pid, value


def killed(work: Work, timeout: float = 30.0) -> Any:
    """What a child doing `work` reported before it was SIGKILLed and reaped (its pid is then not alive)."""
    with _started(work, timeout) as (process, value):
        process.kill()
        process.join()
    assert process.exitcode == -signal.SIGKILL
    return value
