"""Flat host storage of one unit: fp32 master weights and Adam state, with module parameters as views.

One contiguous buffer per unit means one DMA per load, one fused Adam call per parameter group, and no
fragmentation. Parameters are laid out grouped by optimizer param group (frozen ones last) so that every
group is one contiguous segment of the buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lightning_slide.master_halves import MasterHalves, parity_bytes
from lightning_slide.moment_codec import MomentCodec, Packed
from lightning_slide.pinned import host_empty, pin_, unpin_
from lightning_slide.tiers import DiskFile


@dataclass(frozen=True)
class Segment:
    """A contiguous range of a unit's buffer that belongs to one optimizer param group."""

    group: int
    start: int
    end: int


class UnitStorage:
    """Host-side state of one unit.

    `master` holds every parameter the unit owns (fp32): pinned RAM, or, given `master_file` (the unit's
    disk-tier file, nvme_master), a shared mapping of the file's first `numel` elements (never pinned).
    `exp_avg`/`exp_avg_sq` cover the trainable prefix, each a `Packed` moment in the run's `moment_precision`
    (in RAM, or mapped from the disk tier: `moments.py`).
    After construction each owned `nn.Parameter` is a view into `master`, so the user's optimizer, the
    module's state_dict and the checkpoint all see the master weights without a copy.
    """

    def __init__(self, index: int, name: str, params: list[nn.Parameter], group_of: dict[int, int],
                 master_file: DiskFile | None = None) -> None:
        self.index, self.name = index, name
        trainable = sorted((p for p in params if id(p) in group_of), key=lambda p: group_of[id(p)])
        frozen = [p for p in params if id(p) not in group_of]
        self.params = trainable + frozen
        self.offsets: dict[int, int] = {}
        self.segments: list[Segment] = []
        offset = 0
        for p in self.params:
            self.offsets[id(p)] = offset
            if id(p) in group_of:
                group = group_of[id(p)]
                if self.segments and self.segments[-1].group == group:
                    self.segments[-1] = Segment(group, self.segments[-1].start, offset + p.numel())
                else:
                    self.segments.append(Segment(group, offset, offset + p.numel()))
            offset += p.numel()
        self.numel = offset
        self.trainable_numel = self.segments[-1].end if self.segments else 0
        self.on_disk = master_file is not None
        self.master = self._adopt(self.params, master_file.map(self.numel) if self.on_disk else host_empty(self.numel))
        self.pinned = not self.on_disk and pin_(self.master)
        self.exp_avg = self.exp_avg_sq = Packed(torch.empty(0))
        self.max_exp_avg_sq: torch.Tensor | None = None
        self.shadow: torch.Tensor | None = None
        self.shadow_pinned = False
        self.halves: MasterHalves | None = None  # the master as planes while it trains (`add_halves`)
        self.grad_acc: torch.Tensor | None = None
        self.acc_pinned = False

    # Bytes per element of each host buffer a unit may have (the shadow is in the compute dtype).
    # The moments' bytes depend on their precision: `moment_codec.moment_bytes`.
    ELEMENT_BYTES = {"master": 4, "amsgrad": 4, "sums": 4}

    @classmethod
    def bytes_for(cls, buffer: str, elements: int, dtype: torch.dtype | None = None) -> int:
        """Host bytes of `buffer` over `elements`: "master" (fp32, all owned parameters), "amsgrad"
        (max_exp_avg_sq), "sums" (fp32 gradient sums of an accumulation window), "shadow" (the compute-dtype
        copy loads read, `dtype`), or "parity" (the master halves' parity plane, `master_halves`)."""
        if buffer == "shadow":
            return elements * dtype.itemsize
        if buffer == "parity":
            return parity_bytes(elements)
        return elements * cls.ELEMENT_BYTES[buffer]

    def _adopt(self, params: list[nn.Parameter], master: torch.Tensor) -> torch.Tensor:
        """Copy parameters into one buffer and repoint them at it; frees each original as it goes.

        A meta-device parameter (a placeholder, see `materialize.py`) becomes a view of uninitialised
        master memory, keeping its identity (the optimizer already holds it); it is listed in `placeholders`.
        """
        self.placeholders: set[int] = set()
        for p in params:
            view = self.view(master, p)
            if p.is_meta:
                torch.utils.swap_tensors(p, nn.Parameter(view, requires_grad=p.requires_grad))
                self.placeholders.add(id(p))
                continue
            with torch.no_grad():
                view.copy_(p.detach().reshape(view.shape))
            p.data = view
        return master

    def view(self, flat: torch.Tensor, p: nn.Parameter) -> torch.Tensor:
        start = self.offsets[id(p)]
        return flat[start : start + p.numel()].view(p.shape)

    def add_shadow(self, dtype: torch.dtype) -> None:
        """A pinned copy in the compute dtype that loads read where the fp32 master is on disk (refreshed after
        updates)."""
        self.shadow = host_empty(self.numel, dtype)  # locked in place: at its own size, as the plan counts it
        self.shadow_pinned = pin_(self.shadow)
        self.shadow.copy_(self.master)

    def add_halves(self, chunk: int, master_bits: int = 32) -> None:
        """Let the master turn into planes while it trains, in chunks of `chunk` elements (`master_halves`, keeping
        `master_bits` of it): a unit in pinned RAM that the GPU updates, computing in bf16."""
        self.halves = MasterHalves(self.master, chunk, self.index, master_bits)

    def add_grad_accumulator(self, dtype: torch.dtype = torch.float32) -> None:
        """The gradients a step holds until its updates run: fp32 sums for accumulation windows (+4 B/param of
        RAM), or a deferred step's single gradient in the dtype it was computed in (+2 B/param under bf16).
        Pinned on CUDA: a window's first gradient is copied straight in, without a pass over host memory."""
        self.grad_acc = host_empty(self.trainable_numel, dtype)
        self.acc_pinned = pin_(self.grad_acc)

    def add_moments(self, codecs: tuple[MomentCodec, MomentCodec]) -> None:
        self.exp_avg, self.exp_avg_sq = (codec.zeros(self.trainable_numel) for codec in codecs)

    def add_amsgrad_state(self) -> None:
        self.max_exp_avg_sq = torch.zeros(self.trainable_numel)

    def release(self) -> None:
        """Unpin the master, the shadow and the sums; parameters stay valid views of (now pageable) host memory."""
        if self.pinned:
            unpin_(self.master)
            self.pinned = False
        if self.shadow_pinned:
            unpin_(self.shadow)
            self.shadow_pinned = False
        if self.acc_pinned:
            unpin_(self.grad_acc)
            self.acc_pinned = False
        if self.halves is not None:
            self.halves.release()
