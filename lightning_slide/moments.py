"""Where each unit's Adam moments live: RAM, or the disk tier, streamed through the optimizer thread.

A unit on disk keeps `exp_avg | exp_avg_sq` in its own preallocated file, after its fp32 master when that
goes to disk too (`nvme_master`: `master | exp_avg | exp_avg_sq`), each moment in the run's
`moment_precision` (`moment_codec`: values, then an 8-bit moment's block scales). The optimizer thread updates it
chunk by chunk (the chunks its gradient arrives in): when a step starts, the order of its updates is known
(backward order, or forward order for deferred updates), so the reader fetches the state of the next
chunks while earlier ones are being updated, and each updated chunk is written behind. The unit's
`exp_avg`/`exp_avg_sq` (and master) are shared mappings of the same file, which is what the optimizer's
state_dict, the module's parameters and so every checkpoint read: nothing of it is resident in RAM during
training.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from functools import partial

import torch

from lightning_slide.moment_codec import MomentPrecision, Packed, codecs, moment_bytes
from lightning_slide.storage import UnitStorage
from lightning_slide.threads import Failure
from lightning_slide.tiers import DiskFile, Region, Spill, TierDirectory

READ_AHEAD = 3  # chunk buffers: one being updated, the rest filling or draining


def disk_units(trainable: Sequence[int], fraction: float) -> list[int]:
    """The units (in index order) whose moments go to disk: the fewest that reach `fraction` of all moments.

    `trainable` is each unit's trainable element count (the planner and the engine share this choice).
    """
    total, chosen, placed = sum(trainable), [], 0
    for unit, n in enumerate(trainable):
        if n and placed < fraction * total - 0.5:
            chosen.append(unit)
            placed += n
    return chosen


def unit_file_bytes(master: int, trainable: int, precision: MomentPrecision = "fp32") -> int:
    """A unit's disk-tier file: `master` fp32 master elements (0 when it stays in RAM), then the moments."""
    return 4 * master + moment_bytes(precision, trainable)


def unit_file(directory: TierDirectory, index: int, name: str, master: int, trainable: int,
              precision: MomentPrecision = "fp32") -> DiskFile:
    """The disk-tier file of one unit (`unit_file_bytes`, aligned by the tier)."""
    label = "state" if master else "moments"
    return directory.create(f"{label}-{index:04d}-{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}.bin",
                            unit_file_bytes(master, trainable, precision))


class Moments:
    """Hands the optimizer thread each chunk's master and moments (RAM views, or disk buffers) and takes them
    back. `files` holds the disk units' files (`unit_file`); a unit whose storage maps its master from its file
    (`UnitStorage.on_disk`) has the master read and written with its moments. `precision` is the moments'
    (`moment_codec`); `codecs` are theirs."""

    def __init__(self, storages: list[UnitStorage], files: dict[int, DiskFile], chunk: int, failure: Failure,
                 precision: MomentPrecision = "fp32") -> None:
        self.storages, self.chunk, self.on_disk = storages, chunk, set(files)
        self.precision, self.codecs = precision, codecs(precision)
        with_master = any(storages[u].on_disk for u in files)
        buffer = self.buffer_bytes(with_master, chunk, precision)
        self.spill = Spill("Adam state", READ_AHEAD, buffer, False, failure) if files else None
        for s in storages:
            if s.index in files:
                self._map(s, files[s.index])
            elif s.trainable_numel:
                s.add_moments(self.codecs)

    def _map(self, s: UnitStorage, file: DiskFile) -> None:
        """The unit's moments as views of its file; each chunk's regions: [master,] exp_avg, exp_avg_sq, laid
        out in the chunk's buffer as in the file (one chunk's worth of each apart)."""
        t, m = s.trainable_numel, s.numel if s.on_disk else 0
        sizes = [c.bytes_for(t) for c in self.codecs]
        mapped = file.map(4 * m + sum(sizes), torch.uint8)
        words = file.map(m + sum(sizes) // 4) if self.precision == "int8" else None  # the scales' own mapping
        s.exp_avg, s.exp_avg_sq = (
            c.from_bytes(mapped[4 * m + at :], t, None if words is None else words[m + at // 4 :])
            for c, at in zip(self.codecs, (0, sizes[0])))
        layout = self._chunk_layout(bool(m))
        for start, n in self.spans(s.index):
            regions = [Region(file, 4 * start, 4 * n, 0)] if m else []
            for codec, file_at, at in zip(self.codecs, (0, sizes[0]), layout):
                regions += [Region(file, 4 * m + file_at + offset, nbytes, at + buffer_at)
                            for offset, nbytes, buffer_at in codec.piece_bytes(t, start, n)]
            self.spill.regions[(s.index, start)] = tuple(regions)

    def _chunk_layout(self, with_master: bool) -> tuple[int, int]:
        """Where exp_avg and exp_avg_sq start in a chunk's buffer: after a chunk's fp32 master, if it has one."""
        first = 4 * self.chunk if with_master else 0
        return first, first + self.codecs[0].bytes_for(self.chunk)

    @staticmethod
    def buffer_bytes(with_master: bool, chunk: int, precision: MomentPrecision = "fp32") -> int:
        """One read-ahead buffer: a chunk's moments (`moment_bytes`), and its fp32 master with nvme_master."""
        return (4 * chunk if with_master else 0) + moment_bytes(precision, chunk)

    @classmethod
    def read_ahead_bytes(cls, with_master: bool, chunk: int, precision: MomentPrecision = "fp32") -> int:
        return READ_AHEAD * cls.buffer_bytes(with_master, chunk, precision)

    def spans(self, unit: int) -> list[tuple[int, int]]:
        """(start, length) of each update of `unit`: chunks on disk, the whole trainable range in RAM."""
        t = self.storages[unit].trainable_numel
        if unit not in self.on_disk:
            return [(0, t)]
        return [(start, min(self.chunk, t - start)) for start in range(0, t, self.chunk)]

    def plan(self, units: Iterable[int]) -> None:
        """The units about to be updated, in update order: start reading those on disk."""
        if self.spill is not None:
            self.spill.plan((u, start) for u in units if u in self.on_disk for start, _ in self.spans(u))

    def open(self, unit: int, start: int, n: int) -> tuple[tuple[torch.Tensor, Packed, Packed], Callable[[], None]]:
        """(master, exp_avg, exp_avg_sq) of [start, start + n) of `unit`, and the call that hands them back."""
        s = self.storages[unit]
        if unit not in self.on_disk:
            piece = slice(start, start + n)
            return (s.master[piece], s.exp_avg[piece], s.exp_avg_sq[piece]), _nothing
        raw = self.spill.take((unit, start))
        master = raw[: 4 * n].view(torch.float32) if s.on_disk else s.master[start : start + n]
        moments = (c.from_bytes(raw[at:], n) for c, at in zip(self.codecs, self._chunk_layout(s.on_disk)))
        return (master, *moments), partial(self.spill.write_back, (unit, start), raw)

    def drain(self) -> float:
        return self.spill.drain() if self.spill is not None else 0.0

    @property
    def disk_bytes(self) -> tuple[int, int]:
        return (self.spill.bytes_read, self.spill.bytes_written) if self.spill is not None else (0, 0)

    def close(self) -> None:
        if self.spill is not None:
            self.spill.close()


def _nothing() -> None:
    pass

