"""Where each unit's Adam moments live: RAM, or the disk tier, streamed through the optimizer thread.

A unit on disk keeps `exp_avg | exp_avg_sq` in its own preallocated file. The optimizer thread updates it
chunk by chunk (the chunks its gradient arrives in): when a step starts, the order of its updates is known
(backward order, or forward order for deferred updates), so the reader fetches the moments of the next
chunks while earlier ones are being updated, and each updated chunk is written behind. The unit's
`exp_avg`/`exp_avg_sq` are shared mappings of the same file, which is what the optimizer's state_dict (and
so every checkpoint) reads: nothing of it is resident in RAM during training.
"""

from __future__ import annotations

import re
from functools import partial
from typing import Callable, Iterable, Sequence

import torch

from lightning_slide.storage import UnitStorage
from lightning_slide.threads import Failure
from lightning_slide.tiers import Region, Spill, TierDirectory

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


class Moments:
    """Hands the optimizer thread each chunk's moments (RAM views, or disk buffers) and takes them back."""

    def __init__(self, storages: list[UnitStorage], on_disk: list[int], directory: TierDirectory | None,
                 chunk: int, failure: Failure) -> None:
        self.storages, self.chunk, self.on_disk = storages, chunk, set(on_disk)
        self.spill = Spill("Adam moments", READ_AHEAD, 8 * chunk, False, failure) if on_disk else None
        for s in storages:
            if s.index in self.on_disk:
                self._map(s, directory)
            elif s.trainable_numel:
                s.add_moments()

    def _map(self, s: UnitStorage, directory: TierDirectory) -> None:
        t = s.trainable_numel
        file = directory.create(f"moments-{s.index:04d}-{re.sub(r'[^A-Za-z0-9_.-]', '_', s.name)}.bin", 8 * t)
        mapped = file.map(2 * t)
        s.exp_avg, s.exp_avg_sq = mapped[:t], mapped[t:]
        for start, n in self.spans(s.index):
            self.spill.regions[(s.index, start)] = (
                Region(file, 4 * start, 4 * n), Region(file, 4 * (t + start), 4 * n, 4 * self.chunk))

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

    def open(self, unit: int, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor, Callable[[], None]]:
        """exp_avg and exp_avg_sq of [start, start + n) of `unit`, and the call that hands them back."""
        s = self.storages[unit]
        if unit not in self.on_disk:
            return s.exp_avg[start : start + n], s.exp_avg_sq[start : start + n], _nothing
        raw = self.spill.take((unit, start))
        flat = raw.view(torch.float32)
        return flat[:n], flat[self.chunk : self.chunk + n], partial(self.spill.write_back, (unit, start), raw)

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
