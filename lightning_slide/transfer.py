"""Gradients leave the GPU: a small ring of pinned landing buffers and the copy thread that fills them.

Each unit's gradient goes out in chunks, so pinned memory stays bounded (a few chunks, not one buffer per
unit) and the optimizer starts on chunk k while chunk k+1 is still on the wire. The copy thread, not the
training thread, waits for free landing buffers; the backward waits only for a free GPU gradient buffer, which
its unit's last chunk frees once it has landed (`window.GradBuffer`).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from functools import partial

import torch

from lightning_slide.layer_adam import GradChunk, LayerAdam, StepPlan
from lightning_slide.pinned import host_empty, pin_, unpin_
from lightning_slide.streams import Lane
from lightning_slide.threads import Failure, Worker


def gradient_chunk(chunk_elems: int, trainable: list[int]) -> int:
    """Elements per gradient chunk: `chunk_elems`, or the largest unit's trainable size where that is less."""
    return min(chunk_elems, max(trainable))


class LandingRing:
    """`count` pinned fp32 host buffers of `elems` each (where gradients land from the GPU gradient buffers),
    handed out in order and returned by the optimizer."""

    @staticmethod
    def bytes_for(count: int, elems: int) -> int:
        return count * elems * 4

    def __init__(self, count: int, elems: int, pin: bool, failure: Failure) -> None:
        self.buffers = [host_empty(elems) for _ in range(count)]  # locked in place: at their own size
        self._pinned = [b for b in self.buffers if pin and pin_(b)]
        self.events = [torch.cuda.Event() if pin else None for _ in range(count)]
        self._free = deque(range(count))
        self._lock = threading.Lock()
        self._failure = failure

    @property
    def elems(self) -> int:
        return self.buffers[0].numel()

    def close(self) -> None:
        """Unlock the buffers (after the device has finished with them)."""
        for buffer in self._pinned:
            unpin_(buffer)
        self._pinned.clear()

    def acquire(self) -> int:
        self._failure.wait(lambda: bool(self._free), "a free gradient landing buffer")
        with self._lock:
            return self._free.popleft()

    def release(self, index: int) -> None:
        with self._lock:
            self._free.append(index)
        self._failure.notify()


@dataclass
class Dispatch:
    """A unit's complete gradient, sitting in a GPU slot, to be sent to the optimizer."""

    unit: int
    grads: torch.Tensor  # flat view of the slot's gradient buffer (compute dtype)
    ready: object  # compute-lane event after the last gradient write
    plan: StepPlan | None
    accumulate: bool
    update: bool
    done: object  # callable(event): the slot's gradient buffer may be reused after `event`
    first: bool = False  # the window's first gradient of the unit: it replaces the sums
    sums: torch.Tensor | None = None  # the unit's fp32 sums, when a first gradient can land there directly


class GradPump:
    """The copy thread: chunks each dispatched gradient through the landing ring to Layer-Adam.

    Low-precision gradients bound for the landing ring are widened to fp32 on the device, one chunk at a time,
    on their way out: the CPU optimizer reads fp32 without a conversion pass over host memory, and GPU slots
    stay half the size. A gradient that a deferred step holds as it came goes out in its own dtype.
    Sending bf16 and widening on the CPU halves the PCIe bytes but is slower (Llama-3.1-8B at 8x1024 on an
    H200 host with 16 cores, for every widening piece size tried: docs/alternatives.md): the CPU's conversion
    costs more host time than the halved reads save.
    """

    def __init__(self, ring: LandingRing, d2h: Lane, adam: LayerAdam, failure: Failure,
                 widen_on: torch.device | None) -> None:
        self.ring, self.d2h, self.adam = ring, d2h, adam
        self.widen = torch.empty(ring.elems, device=widen_on) if widen_on is not None else None
        self.bytes = 0
        self.worker: Worker[Dispatch] = Worker("grad-copy", self._handle, failure)

    @staticmethod
    def widen_bytes(chunk: int) -> int:
        """The device buffer a low-precision chunk is widened to fp32 in on its way out."""
        return chunk * 4

    def put(self, item: Dispatch) -> None:
        self.worker.put(item)

    def _handle(self, item: Dispatch) -> None:
        """Send the gradient out in chunks: into landing buffers, or, as a window's first gradient, straight into
        the unit's pinned sums. A first gradient that ends its window is the unit's whole sum: when the step
        clips, its norm is measured here, on the device."""
        n, step = item.grads.numel(), self.ring.elems
        with self.d2h():
            self.d2h.wait(item.ready)
            if item.first and item.plan is not None and item.plan.norm is not None:
                item.plan.norm.add_on_device(item.grads, item.unit)
            for start in range(0, n, step):
                end = min(start + step, n)
                if item.sums is None:
                    i = self.ring.acquire()
                    landing, event, release = self.ring.buffers[i], self.ring.events[i], partial(self.ring.release, i)
                else:
                    landing, event, release = item.sums[start:], None, _keep
                landing = landing[: end - start]
                source = item.grads[start:end]
                if self.widen is not None and landing.dtype != source.dtype:
                    source = self.widen[: end - start].copy_(source)
                landing.copy_(source, non_blocking=True)
                event = self.d2h.record(event)
                self.adam.put(GradChunk(item.unit, start, landing, event, release, item.plan, item.accumulate,
                                        item.update, last=end == n, first=item.first, landed=item.sums is not None))
            item.done(self.d2h.record())
        self.bytes += n * (item.sums.element_size() if item.sums is not None else 4)


def _keep() -> None:
    """A chunk that landed in the sums has no landing buffer to give back."""
