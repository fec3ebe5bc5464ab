"""Sliding activations: each unit keeps only its input for the backward, on the device, in pinned RAM, or on disk.

Off the device, the input is copied out on the d2h lane right after the unit's forward and copied back on
the h2d lane while the next-later unit runs its backward; an input in RAM of LATE_PREFETCH_BYTES or more is
copied back once that backward is done instead, so that its peak does not hold it too: the copy of 1.5 GiB
(Llama-3.2-3B at 262,144 tokens) takes ~30 ms at PCIe's rate, against seconds of a block's backward there.
In RAM, host buffers are pooled by position in the forward pass, so steady-state steps allocate no pinned
memory. On disk (offload="nvme"), a few staging
buffers hold each input on its way to its file region and back: writes go behind the forward, and when the
backward starts every input is read ahead in the order the backward will want them. The staging buffers are
pinned host memory, or GPU memory when the disk tier moves device memory directly (`tiers.direct_io`):
then the copies in and out of them stay on the GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch

from lightning_slide.available import available_vram
from lightning_slide.pinned import host_empty, pin_, unpin_
from lightning_slide.streams import Lane, host_wait
from lightning_slide.threads import Failure
from lightning_slide.tiers import Region, Spill, TierDirectory, align

DISK_BUFFERS = 4  # pinned staging buffers of the disk path: in flight to or from the disk at once
LATE_PREFETCH_BYTES = 1 << 30  # a saved input in RAM this large comes back after the backward before its own
OFFLOAD_SHARE = 0.5  # the share of the free GPU memory saved inputs may take before "auto" offloads them


class _HostBuffer:
    """A saved input's host memory, kept for the inputs saved under its key later: each that fits is a view of it.

    Pinned buffers are page-locked in place at their own size (`cudaHostRegister`): `pin_memory=True` takes them
    from torch's caching host allocator, which rounds each up to a power of two (a Qwen3-14B input at 64 x 1024
    tokens, 640 MiB, would take 1 GiB)."""

    def __init__(self, nbytes: int, pin: bool) -> None:
        self.raw = host_empty(nbytes, torch.uint8)
        self.pinned = pin and pin_(self.raw)
        self.tensor = self.raw  # the current input's view
        self.read_done = None  # h2d event of the last copy back: later writes wait for it

    def holds(self, like: torch.Tensor) -> torch.Tensor | None:
        """A view for `like` (None if it does not fit), which becomes the buffer's current input."""
        if like.numel() * like.element_size() > self.raw.numel():
            return None
        self.tensor = _as(self.raw, like.shape, like.dtype)
        return self.tensor

    def release(self) -> None:
        """Unlock the pages (no copy may be in flight): the memory is freed with the last view of it."""
        if self.pinned:
            unpin_(self.raw)
            self.pinned = False


class Saved:
    """One saved input: the device tensor itself, a host copy, or a disk region, that comes back on demand.

    A host copy's buffer is free from the moment the input is back on the device (`host_tensor`) until the next
    forward saves into it: the engine may lend it to the unit's gradient in between."""

    def __init__(self, store: ActivationStore, value: torch.Tensor | None = None, host: _HostBuffer | None = None,
                 written: object = None, disk: tuple[Hashable, torch.Size, torch.dtype] | None = None) -> None:
        self._store, self._host, self._written, self._disk = store, host, written, disk
        self._value = value
        self._arrived = None

    def prefetch(self) -> None:
        if self._value is not None or (self._host is None and self._disk is None):
            return
        store = self._store
        source = self._host.tensor if self._host is not None else store.take_from_disk(*self._disk)
        # Allocated for the compute stream, whose queued work may still use the block (the caching allocator
        # hands out memory freed in the host's order): the copy on the h2d lane waits for that work first.
        self._value = torch.empty(source.shape, dtype=source.dtype, device=store.device)
        queued = store.compute.record()
        with store.h2d():
            store.h2d.wait(self._written)
            store.h2d.wait(queued)
            self._value.copy_(source, non_blocking=True)
            self._arrived = store.h2d.record()
        if self._host is not None:
            self._host.read_done = self._arrived
        else:
            store.disk.release(source, self._arrived)
        if not source.is_cuda:  # PCIe bytes (a direct disk read already landed in GPU memory)
            store.bytes_in += self._value.numel() * self._value.element_size()

    @property
    def late(self) -> bool:
        """Whether this input comes back only after the backward that precedes its own (`prefetches_late`)."""
        return self._host is not None and ActivationStore.prefetches_late(self._host.tensor.nbytes, "cpu")

    def get(self) -> torch.Tensor:
        self.prefetch()
        self._store.compute.wait(self._arrived)
        value, self._value = self._value, None
        return value

    @property
    def host_tensor(self) -> torch.Tensor | None:
        """The pooled host buffer this input waited in, if it waited in RAM (free once `get` has run: work
        ordered after the compute that consumes the input may overwrite it)."""
        return None if self._host is None else self._host.tensor


class ActivationStore:
    """Decides per micro-batch where inputs wait: `mode` "device", "cpu", "nvme", or "auto" (device while they
    fit, else the offload tier: disk with offload="nvme", pinned RAM otherwise)."""

    def __init__(self, mode: str, device: torch.device, compute: Lane, h2d: Lane, d2h: Lane, saves: int,
                 failure: Failure, tier: TierDirectory | None = None, direct: bool = False) -> None:
        self.mode, self.device, self.saves, self.tier, self.failure = mode, device, saves, tier, failure
        self.direct = direct
        self.compute, self.h2d, self.d2h = compute, h2d, d2h
        self._pool: dict[Hashable, _HostBuffer] = {}
        self.before_reuse: Callable[[torch.Tensor], None] | None = None  # called before a host buffer is rewritten
        self._where: str | None = None
        self.disk: Spill | None = None
        self._region_bytes = 0
        self._saved_keys: list[Hashable] = []
        self._reading = False
        self._disk_read = self._disk_written = 0
        self.bytes_out = self.bytes_in = 0

    @staticmethod
    def input_bytes(tokens: int, hidden: int, dtype: torch.dtype) -> int:
        """One saved input: a micro-batch's hidden states."""
        return tokens * hidden * dtype.itemsize

    @staticmethod
    def offloads(needed: int, gpu_free: int) -> bool:
        """The "auto" rule: saved inputs leave the GPU when all of them take over OFFLOAD_SHARE of its free memory."""
        return needed > OFFLOAD_SHARE * gpu_free

    @staticmethod
    def prefetches_late(input_bytes: int, where: str) -> bool:
        """Inputs waiting in RAM ("cpu") of at least LATE_PREFETCH_BYTES are prefetched after the backward before
        their own, not during it (a disk read, much slower, still starts early)."""
        return where == "cpu" and input_bytes >= LATE_PREFETCH_BYTES

    @classmethod
    def in_flight_bytes(cls, input_bytes: int, where: str) -> int:
        """Hidden states on the device besides the saved ones: a part's input and output; with the inputs
        offloaded, also the one being copied out, and the input being prefetched unless it comes back late."""
        if where == "device":
            return 2 * input_bytes
        return (3 if cls.prefetches_late(input_bytes, where) else 4) * input_bytes

    @staticmethod
    def region_bytes(input_bytes: int) -> int:
        """A saved input's disk region and staging buffer: the input, aligned for direct I/O."""
        return align(input_bytes)

    @classmethod
    def disk_bytes_for(cls, saves: int, input_bytes: int) -> int:
        """The disk files of one forward pass: a region per saved input."""
        return saves * cls.region_bytes(input_bytes)

    @classmethod
    def staging_bytes(cls, input_bytes: int, pinned: bool) -> int:
        """The disk path's staging buffers: pinned RAM (`pinned`: from torch's caching host allocator, which rounds
        each up to a power of two), or GPU memory with direct I/O."""
        region = cls.region_bytes(input_bytes)
        return DISK_BUFFERS * (1 << (region - 1).bit_length() if pinned else region)

    def new_micro_batch(self) -> None:
        self._where = None
        self._saved_keys.clear()
        self._reading = False

    def save(self, key: Hashable, value: torch.Tensor, keep: bool = False) -> Saved:
        """`value` kept for the backward where this micro-batch's inputs wait, or, with `keep`, on the device."""
        if self._where is None:
            self._where = self._decide(value)
        if keep:
            self._drop(key)
        if keep or self._where == "device" or not value.is_floating_point():
            return Saved(self, value)
        produced = self.compute.record()
        if self._where == "nvme":
            return self._save_to_disk(key, value, produced)
        host = self._buffer(key, value)
        if self.before_reuse is not None:
            self.before_reuse(host.tensor)
        with self.d2h():
            self.d2h.wait(produced)
            self.d2h.wait(host.read_done)
            written = self._copy_out(host.tensor, value)
        return Saved(self, host=host, written=written)

    def _copy_out(self, dst: torch.Tensor, value: torch.Tensor) -> object:
        dst.copy_(value, non_blocking=True)
        if value.is_cuda:
            value.record_stream(self.d2h.current())
        if not dst.is_cuda:
            self.bytes_out += value.numel() * value.element_size()
        return self.d2h.record()

    def _save_to_disk(self, key: Hashable, value: torch.Tensor, produced: object) -> Saved:
        spill = self._disk_for(key, value)
        raw = spill.acquire()
        with self.d2h():
            self.d2h.wait(produced)
            written = self._copy_out(_as(raw, value.shape, value.dtype), value)
        spill.write_back(key, raw, written)
        self._saved_keys.append(key)
        return Saved(self, disk=(key, value.shape, value.dtype))

    def take_from_disk(self, key: Hashable, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """The staged host copy of `key`, read ahead: the backward wants inputs in reverse order of saving."""
        if not self._reading:
            self._reading = True
            self.disk.plan(reversed(self._saved_keys))
        return _as(self.disk.take(key), shape, dtype)

    def _disk_for(self, key: Hashable, value: torch.Tensor) -> Spill:
        """The disk spill, (re)built when an input is larger than its regions; a file region per key."""
        if self.disk is None or value.numel() * value.element_size() > self._region_bytes:
            self._close_disk()
            self._region_bytes = self.region_bytes(value.numel() * value.element_size())
            self.disk = Spill("activations", DISK_BUFFERS, self._region_bytes, value.is_cuda, self.failure,
                              value.device if self.direct else None)
        if key not in self.disk.regions:
            index = len(self.disk.regions)
            if index % self.saves == 0:  # one file per `saves` regions: enough for one forward pass
                self._file = self.tier.create(f"activations-{index // self.saves}.bin", self.saves * self._region_bytes)
            size = self._region_bytes  # whole regions: a later, smaller input of this key fits in it too
            self.disk.regions[key] = (Region(self._file, (index % self.saves) * size, size),)
        return self.disk

    def _close_disk(self) -> None:
        """Retire the spill and its files (a larger input needs larger regions)."""
        if self.disk is not None:
            if self.failure.error is None:  # after a failure there is nothing worth finishing
                self.disk.drain()
            self.disk.close()
            self._disk_read += self.disk.bytes_read
            self._disk_written += self.disk.bytes_written
            for file in {r.file for regions in self.disk.regions.values() for r in regions}:
                self.tier.remove(file)
            self.disk = None

    def close(self) -> None:
        """After the device's work has finished (the engine synchronizes first)."""
        self._close_disk()
        for buf in self._pool.values():
            buf.release()
        self._pool.clear()

    @property
    def disk_bytes(self) -> tuple[int, int]:
        live = (self.disk.bytes_read, self.disk.bytes_written) if self.disk is not None else (0, 0)
        return self._disk_read + live[0], self._disk_written + live[1]

    def _decide(self, value: torch.Tensor) -> str:
        """"auto" keeps inputs on the GPU while all of them take at most half of what is left free there."""
        offload = "nvme" if self.tier is not None else "cpu"
        if self.mode != "auto":
            return self.mode
        if self.device.type != "cuda":
            return "device"
        needed = self.saves * value.numel() * value.element_size()
        return offload if self.offloads(needed, available_vram(self.device)) else "device"

    def _drop(self, key: Hashable) -> None:
        """The key's inputs stay on the device from now on: its host buffer goes, once a gradient lent it has been
        applied (`before_reuse`) and its last copy back is done."""
        buf = self._pool.pop(key, None)
        if buf is None:
            return
        if self.before_reuse is not None:
            self.before_reuse(buf.tensor)
        host_wait(buf.read_done)
        buf.release()

    def _buffer(self, key: Hashable, like: torch.Tensor) -> _HostBuffer:
        """The key's buffer, holding `like` from now on; replaced by a larger one when `like` does not fit (after
        the device has finished with the old one: growing is rare, and unlocking pages under a copy is not safe)."""
        buf = self._pool.get(key)
        if buf is not None and buf.holds(like) is not None:
            return buf
        if buf is not None:
            if like.is_cuda:
                torch.cuda.synchronize(like.device)
            buf.release()
        buf = self._pool[key] = _HostBuffer(like.numel() * like.element_size(), pin=like.is_cuda)
        buf.holds(like)
        return buf


def _as(raw: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A typed view of the front of a byte buffer."""
    return raw[: shape.numel() * dtype.itemsize].view(dtype).view(shape)
