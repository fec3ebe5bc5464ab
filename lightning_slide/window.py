"""The GPU window: a ring of pre-allocated weight slots that decoder blocks slide through, and a few
gradient buffers.

A slot holds one unit's weights in the compute dtype. The vocabulary-sized units (embedding, head) get a
dedicated slot each, so ring slots are sized to a decoder block. Gradients need a buffer only from a unit's
backward until its gradient has left for the host, so a small ring of gradient buffers serves every block
(and the ring of weight slots can grow to hold every block without doubling for gradients). A load is one
pinned-host-to-device copy (plus an on-device cast from the fp32 master, or none from a master's weights plane:
`master_halves`) on the h2d lane, ordered by events against the compute that last read the slot. Where an update on
the GPU left a unit's newest weights in its slot only, the slot is written back to the weights plane before it
takes another unit. Nothing is allocated after warm-up: with slots="auto" the ring
grows after the first step has shown the batch's peak memory (and is sized again only when a larger
micro-batch comes).
"""

from __future__ import annotations

import threading

import torch

from lightning_slide.device_update import SlotWrite
from lightning_slide.layer_adam import LayerAdam
from lightning_slide.storage import UnitStorage
from lightning_slide.streams import Lane


def _bytes(numel: int, dtype: torch.dtype) -> int:
    return numel * dtype.itemsize


class Slot:
    """A unit's weights on the device, in the compute dtype."""

    bytes_for = staticmethod(_bytes)

    def __init__(self, capacity: int, dtype: torch.dtype, device: torch.device) -> None:
        self.params = torch.empty(capacity, dtype=dtype, device=device)
        self.unit: int | None = None
        self.version = -1
        self.loaded = None  # h2d event: weights are in
        self.params_free = None  # compute event: the last reader of the weights has run
        self.pending_write: tuple[int, SlotWrite] | None = None  # a unit whose GPU update writes its weights here


class GradBuffer:
    """A unit's weight gradient on the device (compute dtype), from its backward until it has left for the host."""

    bytes_for = staticmethod(_bytes)

    def __init__(self, capacity: int, dtype: torch.dtype, device: torch.device) -> None:
        self.grads = torch.empty(capacity, dtype=dtype, device=device)
        self.free = None  # d2h event: the last gradient has left
        self.idle = threading.Event()
        self.idle.set()

    def release(self, event: object) -> None:
        self.free = event
        self.idle.set()


class Window:
    def __init__(
        self,
        storages: list[UnitStorage],
        dedicated: list[bool],
        slots: int,
        dtype: torch.dtype,
        device: torch.device,
        h2d: Lane,
        adam: LayerAdam,
        with_grads: bool,
        staging_elems: int,
        grad_slots: int = 3,
    ) -> None:
        self.storages, self.h2d, self.adam, self.dtype, self.device = storages, h2d, adam, dtype, device
        self.dedicated = {i: Slot(s.numel, dtype, device) for i, s in enumerate(storages) if dedicated[i]}
        self.capacity = max((s.numel for i, s in enumerate(storages) if not dedicated[i]), default=0)
        self.blocks = sum(not d for d in dedicated)
        self.ring = [Slot(self.capacity, dtype, device) for _ in range(min(slots, self.blocks))]
        self.lookahead = len(self.ring) - 1  # units loaded ahead of the pass (a grown ring keeps the same distance)
        # GPU gradient buffers (the host's landing buffers are `transfer.LandingRing`): one per dedicated unit,
        # and a ring that every block's gradient passes through
        self.dedicated_grads = {i: GradBuffer(storages[i].numel, dtype, device)
                                for i in self.dedicated} if with_grads else {}
        self.block_grads = [GradBuffer(self.capacity, dtype, device) for _ in range(grad_slots)] if with_grads else []
        self._next_grads = 0
        needs_cast = device.type == "cuda" and dtype != torch.float32 and any(s.shadow is None for s in storages)
        largest = max(s.numel for s in storages)
        self.piece = self.staging_elems(staging_elems, largest)  # elements a load copies at a time, where it must
        self.staging = torch.empty(self.piece, device=device) if needs_cast else None
        self.load_bytes = [0] * len(storages)  # bytes each unit's loads copied to the device
        self.written_back_bytes = 0  # weights copied back from slots to their masters' weights planes
        self.waits = [0.0] * len(storages)  # seconds loads of each unit waited for its update
        self._partial: dict[int, tuple[int, int]] = {}  # a dedicated unit's refresh under way: (version, elements in)

    @staticmethod
    def staging_elems(staging_elems: int, largest: int) -> int:
        """The fp32 load staging buffer (cast to the compute dtype on the device): no larger than the largest unit."""
        return min(staging_elems, largest)

    @staticmethod
    def staging_bytes(staging_elems: int, largest: int) -> int:
        return 4 * Window.staging_elems(staging_elems, largest)

    def grads_for(self, unit: int) -> GradBuffer:
        """The buffer `unit`'s gradient is written into (blocks take the ring's buffers in backward order)."""
        if unit in self.dedicated_grads:
            return self.dedicated_grads[unit]
        buffer = self.block_grads[self._next_grads]
        self._next_grads = (self._next_grads + 1) % len(self.block_grads)
        return buffer

    @property
    def bytes(self) -> int:
        """Bytes every load copied to the device."""
        return sum(self.load_bytes)

    @property
    def slot_bytes(self) -> int:
        return self.capacity * self.ring[0].params.element_size() if self.ring else 0

    def grow(self, count: int) -> None:
        """Add `count` block slots (slots="auto"; the engine sizes it): more blocks stay resident."""
        self.ring += [Slot(self.capacity, self.dtype, self.device) for _ in range(count)]

    def shrink(self, count: int) -> None:
        """Keep the first `count` ring slots: a larger batch needs the memory of the others back.

        Their memory returns to the compute stream's pool, so that stream first waits for any copy still using
        them (loads in, write-backs out: the h2d lane's, `_settle`'s included) and any update writing into them; the
        units they held load again when next needed.
        """
        events = []
        for slot in self.ring[count:]:
            events.append(self._settle(slot, None))
            if slot.unit is not None:
                self._write_back(slot, slot.unit)
            slot.unit = None
        events.append(self.h2d.record())
        for event in events:
            if event is not None:
                torch.cuda.current_stream(self.device).wait_event(event)
        del self.ring[count:]

    def holding(self, unit: int) -> Slot | None:
        if unit in self.dedicated:
            return self.dedicated[unit]
        return next((s for s in self.ring if s.unit == unit), None)

    def ensure(self, unit: int, position: int, direction: int, protect: set[int]) -> Slot:
        """The slot holding `unit`'s current weights, loading them (asynchronously) if needed."""
        slot = self.holding(unit) or self._victim(position, direction, protect)
        written = self._settle(slot, unit)
        if slot.unit != unit or slot.version != self.adam.scheduled[unit]:
            self._load(slot, unit, written, start=self._resume(unit))
        return slot

    def refresh_dedicated(self) -> None:
        """Load, a piece a call, every dedicated unit (the embedding, the head) whose update the CPU has applied since
        its slot was filled. Called once a backward part's next loads are queued: such a unit's gradient was
        complete, so its slot is not read again before the next forward, which would otherwise wait for the whole
        load at its end (the head's fp32 master is 2.1 GB at Llama-3's vocabulary, two blocks' worth, ahead of one
        block's compute). A piece a call keeps the blocks' loads behind it on the lane from waiting for all of it;
        the unit's forward copies what is left (`ensure`)."""
        for unit, slot in self.dedicated.items():
            version = self.adam.scheduled[unit]
            if (slot.unit != unit or slot.pending_write is not None or slot.version == version
                    or self.adam.updates_on_device(unit) or not self.adam.ready(unit)):
                continue
            start = self._resume(unit)
            self._load(slot, unit, start=start, end=min(start + self.piece, self.storages[unit].numel))
            return

    def _resume(self, unit: int) -> int:
        """Elements of `unit`'s current weights that a paced refresh has already copied into its slot."""
        version, done = self._partial.get(unit, (-1, 0))
        return done if version == self.adam.scheduled[unit] else 0

    def claim(self, unit: int) -> SlotWrite | None:
        """The slot holding `unit`, for the unit's update (already scheduled) to write the new weights into where
        that update runs on the GPU: the slot holds that update's version from now on, and its next use waits for
        the writes. None where the update runs on the CPU or no slot holds the unit. The unit's forward has settled
        its earlier claim (`ensure`); were one left, its writes would still come first, on the updater's lanes."""
        slot = self.holding(unit)
        if not self.adam.updates_on_device(unit) or slot is None or slot.unit != unit:
            return None
        write = SlotWrite(slot.params[: self.storages[unit].trainable_numel], slot.params_free)
        slot.version, slot.pending_write = self.adam.scheduled[unit], (unit, write)
        return write

    def _settle(self, slot: Slot, unit: int | None) -> object:
        """Resolve the slot's claim before `unit` (None: nothing) uses it: for the claiming unit, or where the
        updater writes already, wait until the update is queued and return the event after its writes (the slot's
        weights are in after it); else take the slot back, and the update leaves it alone."""
        if slot.pending_write is None:
            return None
        (owner, write), slot.pending_write = slot.pending_write, None
        if owner != unit and write.drop(lambda: self._write_back(slot, owner)):
            slot.version = -1  # the claiming unit's new weights will not be here
            return None
        self.waits[owner] += self.adam.wait_applied(owner)
        slot.loaded = self.adam.landed[owner]
        return slot.loaded

    def _victim(self, position: int, direction: int, protect: set[int]) -> Slot:
        """Prefer an empty slot, then the unit furthest behind the pass, then the one needed last."""

        def rank(s: Slot) -> tuple[int, int]:
            if s.unit is None:
                return (2, 0)
            behind = (position - s.unit) * direction
            return (1, behind) if behind > 0 else (0, -behind)

        return max((s for s in self.ring if s.unit not in protect), key=rank)

    def _load(self, slot: Slot, unit: int, written: object = None, start: int = 0, end: int | None = None) -> None:
        """Load `unit`'s elements [start, end) (to its last by default) into `slot` after its last reader and after
        `written` (an update's writes into it); the slot holds the unit once its last element is queued. Where the
        CPU is still updating the unit, its master goes piece by piece as the update writes it (`_copy_in`)."""
        follows = not self.adam.ready(unit) and not self.adam.updates_on_device(unit)
        if not follows:
            self.waits[unit] += self.adam.wait_applied(unit)
        if slot.unit is not None and slot.unit != unit:
            self._write_back(slot, slot.unit)
        storage = self.storages[unit]
        end = storage.numel if end is None else end
        dst = slot.params[: storage.numel]
        planes = storage.halves is not None and storage.halves.planes
        source = storage.master if storage.shadow is None else storage.shadow
        with self.h2d():
            self.h2d.wait(slot.params_free)
            self.h2d.wait(written)
            self.h2d.wait(self.adam.landed[unit])  # an update queued on the GPU writes the master read here
            if planes:  # the weights plane, chunk by chunk
                for at, weights, _ in storage.halves.pieces(start, end):
                    dst[at : at + weights.numel()].copy_(weights, non_blocking=True)
            else:
                self._copy_in(dst, source, unit, follows, start, end)
            if end == storage.numel:
                slot.loaded = self.h2d.record()
        self.load_bytes[unit] += (end - start) * (dst.element_size() if planes else source.element_size())
        if end < storage.numel:
            self._partial[unit] = (self.adam.scheduled[unit], end)
            return
        self._partial.pop(unit, None)
        slot.unit, slot.version = unit, self.adam.scheduled[unit]

    def _write_back(self, slot: Slot, unit: int) -> object:
        """Where the slot holds `unit`'s newest weights and its master's weights plane does not (`MasterHalves.stale`),
        copy them there (on the h2d lane: the next load into the slot follows them) and return the event after."""
        halves = self.storages[unit].halves
        if halves is None or not halves.stale:
            return None
        n = self.storages[unit].trainable_numel
        with self.h2d():
            self.h2d.wait(slot.loaded)
            for at, weights, _ in halves.pieces(0, n):
                weights.copy_(slot.params[at : at + weights.numel()], non_blocking=True)
            halves.written_back = self.h2d.record()
        halves.stale = False
        self.written_back_bytes += n * slot.params.element_size()
        return halves.written_back

    def write_back(self, settle: bool = True) -> None:
        """Every slot's weights that its unit's weights plane lacks, to the host (then wait for them): before the
        masters turn back into fp32. `settle`: first wait for the updates still writing into slots; not after a
        worker failed, when no more will be queued and the device has finished those that were (the planes then
        hold each unit's newest weights that an update wrote)."""
        for slot in [*self.ring, *self.dedicated.values()]:
            if slot.unit is not None:
                if slot.pending_write is not None and settle:
                    self._settle(slot, slot.unit)
                slot.pending_write = None
                self._write_back(slot, slot.unit)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _copy_in(self, dst: torch.Tensor, source: torch.Tensor, unit: int, follows: bool, start: int, end: int) -> None:
        """Elements [start, end) of the master (or its shadow) into a slot: an fp32 master for bf16 compute through the
        device staging, cast there (no CPU-side conversion), piece by piece; else in one copy. Where the unit's update
        still runs on the CPU (`follows`), in pieces of a gradient chunk, each once the update has written it: the
        load then ends about one piece after the update (for the first blocks at a step's start, whose updates end
        last), not a whole unit's copy after it."""
        cast = source.dtype != dst.dtype and self.staging is not None
        trainable = self.storages[unit].trainable_numel
        step = self.piece if cast or follows else max(end - start, 1)  # one copy (none for an empty range)
        for a in range(start, end, step):
            b = min(a + step, end)
            if follows:
                self.waits[unit] += self.adam.wait_written(unit, min(b, trainable))
            if cast:
                stage = self.staging[: b - a]
                stage.copy_(source[a:b], non_blocking=True)
                dst[a:b].copy_(stage)
            else:
                dst[a:b].copy_(source[a:b], non_blocking=True)

    def reset(self) -> None:
        """Forget what the slots hold (after the master weights were overwritten from outside)."""
        for slot in [*self.ring, *self.dedicated.values()]:
            slot.unit, slot.version = None, -1
        self._partial.clear()
