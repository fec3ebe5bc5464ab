"""CPU threads for work split into cache-sized pieces, each thread running its torch ops on one core.

Why: torch spreads every CPU op over all its intra-op threads, and for an op over a cache-sized piece the fork and
join cost more than the op. Updating compact Adam moments takes some twenty ops per 256K-element piece; on an H200
machine's 16 cores, run that way, it managed 0.10 G elements/s with 8-bit moments and 0.41 with bf16 ones (fused
AdamW over whole fp32 units: 3.41), and smaller pieces were slower in proportion to their number. Here each thread
runs its ops on its own core (`torch.set_num_threads` holds for the calling thread's own parallel regions under
OpenMP, ATen's CPU backend), the pieces are spread over the threads, and a piece stays in one core's cache from its
first op to its last. Each thread's share of the work should be one call that releases Python's global lock for
its whole length (Layer-Adam's is one TorchScript call): op by op from Python, every op waits for the lock that the
training thread holds.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Generic, TypeVar

import torch

S = TypeVar("S")


def pool_threads() -> int:
    """How many threads a pool made now has: the calling thread's intra-op thread count (OMP_NUM_THREADS or
    `torch.set_num_threads`; by default the machine's physical cores)."""
    return torch.get_num_threads()


class PiecePool(Generic[S]):
    """`threads` single-core threads, each with its own scratch (`make_scratch()`, made on that thread)."""

    def __init__(self, threads: int, make_scratch: Callable[[], S]) -> None:
        self.threads = threads
        self._local = threading.local()
        self.scratches: list[S] = []  # every thread's
        started = threading.Barrier(threads)
        before = torch.get_num_threads()
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="slide-pieces")
        # every thread starts now (the barrier holds each start until all run) and sets its own thread count
        starts = [self._executor.submit(self._start, make_scratch, started) for _ in range(threads)]
        errors = [e for e in (start.exception() for start in starts) if e is not None]
        torch.set_num_threads(before)  # the process-wide count that threads made later start with
        if errors:  # the one that broke the barrier, not the barrier's
            self._executor.shutdown()
            raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])

    def _start(self, make_scratch: Callable[[], S], started: threading.Barrier) -> None:
        torch.get_num_threads()  # this thread takes the process's count first, then lowers its own
        torch.set_num_threads(1)
        try:
            self._local.scratch = make_scratch()
        except BaseException:
            started.abort()  # the others stop waiting for this thread
            raise
        self.scratches.append(self._local.scratch)
        started.wait()

    def run(self, work: Callable[[S, int, int], None]) -> None:
        """`work(scratch, k, threads)` on each thread k, which takes pieces k, k + threads, ... of the work: one
        task per thread, not per piece (a task's hand-off costs tens of microseconds, and each costs Python's
        global lock); returns once all are done and raises the first error any of them raised."""
        futures = [self._executor.submit(self._run, work, k) for k in range(self.threads)]
        for future in futures:
            future.result()

    def _run(self, work: Callable[[S, int, int], None], k: int) -> None:
        work(self._local.scratch, k, self.threads)

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
