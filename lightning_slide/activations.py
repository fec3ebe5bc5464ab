"""Sliding activations: each unit keeps only its input for the backward, on the device or in pinned RAM.

With `activations="cpu"` the input is copied out on the d2h lane right after the unit's forward and copied
back on the h2d lane while the next-later unit runs its backward. Host buffers are pooled by position in
the forward pass, so steady-state steps allocate no pinned memory.
"""

from __future__ import annotations

import torch

from lightning_slide.streams import Lane


class _HostBuffer:
    def __init__(self, like: torch.Tensor, pin: bool) -> None:
        self.tensor = torch.empty(like.shape, dtype=like.dtype, pin_memory=pin)
        self.read_done = None  # h2d event of the last copy back: later writes wait for it


class Saved:
    """One saved input: either the device tensor itself or a host copy that comes back on demand."""

    def __init__(self, store: "ActivationStore", value: torch.Tensor | None, host: _HostBuffer | None, written) -> None:
        self._store, self._host, self._written = store, host, written
        self._value = value
        self._arrived = None

    def prefetch(self) -> None:
        if self._value is not None or self._host is None:
            return
        store = self._store
        self._value = torch.empty(self._host.tensor.shape, dtype=self._host.tensor.dtype, device=store.device)
        with store.h2d():
            store.h2d.wait(self._written)
            self._value.copy_(self._host.tensor, non_blocking=True)
            self._arrived = self._host.read_done = store.h2d.record()
        store.bytes_in += self._value.numel() * self._value.element_size()

    def get(self) -> torch.Tensor:
        self.prefetch()
        self._store.compute.wait(self._arrived)
        value, self._value = self._value, None
        return value


class ActivationStore:
    """Decides per micro-batch where inputs wait: `mode` "device", "cpu", or "auto" (device while they fit)."""

    def __init__(self, mode: str, device: torch.device, compute: Lane, h2d: Lane, d2h: Lane, saves: int) -> None:
        self.mode, self.device, self.saves = mode, device, saves
        self.compute, self.h2d, self.d2h = compute, h2d, d2h
        self._pool: dict[int, _HostBuffer] = {}
        self._offload: bool | None = None
        self.bytes_out = self.bytes_in = 0

    def new_micro_batch(self) -> None:
        self._offload = None

    def save(self, position: int, value: torch.Tensor) -> Saved:
        if self._offload is None:
            self._offload = self._decide(value)
        if not (self._offload and value.is_floating_point()):
            return Saved(self, value, None, None)
        host = self._buffer(position, value)
        produced = self.compute.record()
        with self.d2h():
            self.d2h.wait(produced)
            self.d2h.wait(host.read_done)
            host.tensor.copy_(value, non_blocking=True)
            if value.is_cuda:
                value.record_stream(self.d2h.current())
            written = self.d2h.record()
        self.bytes_out += value.numel() * value.element_size()
        return Saved(self, None, host, written)

    def _decide(self, value: torch.Tensor) -> bool:
        """"auto" keeps inputs on the GPU while all of them take at most half of what is left free there."""
        if self.mode != "auto":
            return self.mode == "cpu"
        if self.device.type != "cuda":
            return False
        fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda _: 1.0)(self.device)
        limit = torch.cuda.get_device_properties(self.device).total_memory * fraction
        needed = self.saves * value.numel() * value.element_size()
        return needed > 0.5 * (limit - torch.cuda.memory_allocated(self.device))

    def _buffer(self, position: int, like: torch.Tensor) -> _HostBuffer:
        buf = self._pool.get(position)
        if buf is None or buf.tensor.shape != like.shape or buf.tensor.dtype != like.dtype:
            buf = self._pool[position] = _HostBuffer(like, pin=like.is_cuda)
        return buf
