"""Copy lanes: CUDA side streams ordered by events, or synchronous stand-ins on the CPU.

The engine speaks only of lanes and events, so the same schedule runs on a GPU (asynchronous, overlapped)
and on the CPU fallback that CI tests (every copy finishes before the call returns).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch


class Lane:
    """One ordered queue of device work: compute (the current stream), host-to-device or device-to-host."""

    def __init__(self, device: torch.device, side: bool, priority: int = 0) -> None:
        """`side`: a stream of its own (else the current one); `priority`: its kernels' claim on the GPU's
        multiprocessors against other streams' (lower runs first; CUDA clamps it to the device's range)."""
        self.cuda = device.type == "cuda"
        self._side = side
        self.stream = torch.cuda.Stream(device, priority=priority) if self.cuda and side else None

    def current(self) -> torch.cuda.Stream | None:
        if not self.cuda:
            return None
        return self.stream if self._side else torch.cuda.current_stream()

    def __call__(self) -> AbstractContextManager:
        """Context in which work is queued on this lane."""
        return torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()

    def record(self, event: torch.cuda.Event | None = None) -> torch.cuda.Event | None:
        """Mark the work queued so far; returns the event to wait on (None on the CPU: work is done)."""
        if not self.cuda:
            return None
        event = event if event is not None else torch.cuda.Event()
        event.record(self.current())
        return event

    def wait(self, event: torch.cuda.Event | None) -> None:
        """Order this lane's later work after `event`, without blocking the host."""
        if event is not None:
            self.current().wait_event(event)


def host_wait(event: torch.cuda.Event | None) -> None:
    """Block the calling (background) thread until `event` has completed."""
    if event is not None:
        event.synchronize()
