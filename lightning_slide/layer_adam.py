"""Layer-Adam: the optimizer thread that updates one unit (chunk) at a time with torch's fused AdamW.

The math is torch's own (`torch._fused_adamw_` / `torch._fused_adam_`, the kernels behind
`torch.optim.AdamW(fused=True)`, 4x faster than foreach on the CPU), applied per contiguous param-group
segment of a unit's flat buffer. Compact moments (`moment_precision` "bf16" or "int8") are widened to fp32 a
piece at a time for that call and written back after it (`moment_codec`): on the GPU where there is one
(`device_update`), else by a pool of single-core threads (`piece_pool`). An update's loop over its pieces runs
in TorchScript, without Python's global lock, which the training thread holds most of the time.
Hyperparameters are snapshotted when a step is launched, because Lightning steps the LR scheduler while this
thread may still be updating that step's units.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch
from torch.optim import Adam, AdamW, Optimizer

from lightning_slide.moment_codec import (
    BLOCK,
    NOISE_PERIOD,
    SCRATCH_ELEMS,
    MomentCodec,
    MomentPrecision,
    Packed,
    decode_piece,
    encode_piece,
    noise_position,
    scripted,
    work_views,
)
from lightning_slide.moments import Moments
from lightning_slide.norm import GlobalNorm
from lightning_slide.piece_pool import PiecePool, pool_threads
from lightning_slide.storage import UnitStorage
from lightning_slide.streams import host_wait
from lightning_slide.threads import Failure, Worker

if TYPE_CHECKING:
    from lightning_slide.device_update import DeviceUpdater, SlotWrite

# A low-precision gradient reaches AdamW in fp32 pieces of 4M elements (16 MiB). Over one Llama-3.1-8B block
# (218M parameters) on the H200 machine's 16 cores, fused AdamW took 44.6 ms with fp32 gradients in 32M-element
# calls, and 73.6 / 53.0 / 45.7 / 54.7 ms with bf16 gradients widened in pieces of 256K / 1M / 4M / 16M.
WIDEN_ELEMS = 1 << 22


@dataclass(frozen=True)
class GroupHyper:
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool
    amsgrad: bool
    maximize: bool


@dataclass
class StepPlan:
    """Everything one optimizer step needs, frozen at launch."""

    step: int
    groups: list[GroupHyper]
    norm: GlobalNorm | None = None  # the step's global norm, when it clips
    step_tensor: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.step_tensor = torch.tensor(float(self.step))

    @property
    def grad_scale(self) -> torch.Tensor | None:
        """What AdamW divides the gradients by: 1 / clip coefficient, once the global norm is known."""
        return self.norm.grad_scale if self.norm is not None else None


def snapshot(optimizer: Optimizer, step: int, clip_norm: float | None) -> StepPlan:
    groups = [
        GroupHyper(
            lr=float(g["lr"]),
            beta1=float(g["betas"][0]),
            beta2=float(g["betas"][1]),
            eps=float(g["eps"]),
            weight_decay=float(g["weight_decay"]),
            decoupled=bool(g.get("decoupled_weight_decay", isinstance(optimizer, AdamW))),
            amsgrad=bool(g["amsgrad"]),
            maximize=bool(g["maximize"]),
        )
        for g in optimizer.param_groups
    ]
    return StepPlan(step, groups, GlobalNorm(clip_norm) if clip_norm is not None else None)


def validate_optimizer(optimizer: Optimizer, precision: MomentPrecision = "fp32") -> None:
    """Only what Layer-Adam reproduces exactly (or, with compact moments, runs on them) may pass."""
    if not isinstance(optimizer, Adam):
        raise TypeError(
            f"The slideformer strategy runs the optimizer step itself and supports torch.optim.AdamW and "
            f"torch.optim.Adam; got {type(optimizer).__name__}. Return `torch.optim.AdamW(...)` from "
            "configure_optimizers (param groups and any LR scheduler are fine)."
        )
    for g in optimizer.param_groups:
        if g.get("capturable") or g.get("differentiable"):
            raise ValueError("Adam(capturable=True) / Adam(differentiable=True) are not supported by slideformer.")
        if g["amsgrad"] and precision != "fp32":
            raise ValueError(
                f"moment_precision={precision!r} keeps Adam's moments compact, which amsgrad's running maximum of "
                "exp_avg_sq is not: use moment_precision='fp32' with amsgrad=True, or amsgrad=False.")


def adam_(storage: UnitStorage, plan: StepPlan, start: int, grad: torch.Tensor, master: torch.Tensor,
          moments: tuple[Packed, Packed], codecs: tuple[MomentCodec, MomentCodec], scratch: Scratch,
          piece: int, first: int = 0, stride: int = 1) -> None:
    """AdamW over [start, start + len(grad)) of a unit's trainable range: the pieces first, first + stride, ...
    of `piece` elements, each decoded (compact moments), updated by one fused call per group segment and
    encoded again, all in one TorchScript call (`adam_pieces`).

    `master` and the moments cover the same range (views of RAM, or buffers read from the disk tier); the shadow
    copy that loads read is refreshed from `master` while it is at hand.
    """
    hyper, flags, bounds = groups_of(storage, plan)
    scripted(adam_pieces)(
        first, stride, piece, start, grad, master, codecs[0].precision, [m.values for m in moments],
        [m.scales for m in moments], [c.shift for c in codecs], codecs[0].noise,
        [noise_position(plan.step, storage.index, k, start) for k in range(2)], NOISE_PERIOD, BLOCK,
        scratch.moments, scratch.moment_bits, scratch.work, scratch.work_f, scratch.work_d, scratch.wide_for(grad),
        bounds, hyper, flags, storage.max_exp_avg_sq, plan.step_tensor, plan.grad_scale, storage.shadow)


def groups_of(storage: UnitStorage, plan: StepPlan) -> tuple[list[list[float]], list[list[bool]], list[int]]:
    """Each param-group segment of the unit: its hyperparameters, its flags, and its bounds (start, end pairs),
    as `adam_pieces` takes them."""
    groups = [plan.groups[seg.group] for seg in storage.segments]
    return ([[h.lr, h.beta1, h.beta2, h.eps, h.weight_decay] for h in groups],
            [[h.decoupled, h.amsgrad, h.maximize] for h in groups],
            [b for seg in storage.segments for b in (seg.start, seg.end)])


def adam_pieces(first: int, stride: int, piece: int, start: int, grad: torch.Tensor, master: torch.Tensor,
                 precision: str, values: list[torch.Tensor], scales: list[torch.Tensor | None], shifts: list[int],
                 noise: torch.Tensor, positions: list[int], period: int, block: int, out: list[torch.Tensor],
                 out_bits: list[torch.Tensor], work: torch.Tensor, work_f: torch.Tensor, work_d: torch.Tensor,
                 wide: torch.Tensor, bounds: list[int], hyper: list[list[float]], flags: list[list[bool]],
                 max_exp_avg_sq: torch.Tensor | None, step_tensor: torch.Tensor, grad_scale: torch.Tensor | None,
                 shadow: torch.Tensor | None) -> list[list[torch.Tensor]]:
    """`adam_`'s loop, compiled by TorchScript: its interpreter runs the ops without Python's global lock (see
    `moment_codec`), so an update costs the lock once per call, not once per op. Returns the master pieces the
    fused calls updated: TorchScript's dead-code pass does not see writes through a list of views, and would drop
    the calls if nothing used their lists."""
    updated: list[list[torch.Tensor]] = []
    n = grad.numel()
    a = first * piece
    while a < n:
        b = min(a + piece, n)
        piece_scales: list[torch.Tensor | None] = []
        wide_moments: list[torch.Tensor] = []
        for k in range(2):
            s = scales[k]
            piece_scales.append(None if s is None else s[a // block : (b + block - 1) // block])
            wide_moments.append(decode_piece(precision, values[k][a:b], piece_scales[k], out[k], out_bits[k], k == 0,
                                             shifts[k], block))
        g = grad[a:b] if grad.dtype == torch.float32 else wide[: b - a].copy_(grad[a:b])
        for seg in range(len(hyper)):
            lo, hi = max(start + a, bounds[2 * seg]), min(start + b, bounds[2 * seg + 1])
            if lo >= hi:
                continue
            i, j = lo - start - a, hi - start - a
            h, decoupled, amsgrad, maximize = hyper[seg], flags[seg][0], flags[seg][1], flags[seg][2]
            kept: list[torch.Tensor] = []
            if amsgrad and max_exp_avg_sq is not None:
                kept = [max_exp_avg_sq[lo:hi]]
            p, d, m, v = [master[a + i : a + j]], [g[i:j]], [wide_moments[0][i:j]], [wide_moments[1][i:j]]
            if decoupled:
                torch._fused_adamw_(p, d, m, v, kept, [step_tensor], lr=h[0], beta1=h[1], beta2=h[2],
                                    weight_decay=h[4], eps=h[3], amsgrad=amsgrad, maximize=maximize,
                                    grad_scale=grad_scale, found_inf=None)
            else:
                torch._fused_adam_(p, d, m, v, kept, [step_tensor], lr=h[0], beta1=h[1], beta2=h[2],
                                   weight_decay=h[4], eps=h[3], amsgrad=amsgrad, maximize=maximize,
                                   grad_scale=grad_scale, found_inf=None)
            updated.append(p)
        if shadow is not None:
            shadow[start + a : start + b].copy_(master[a:b])
        if precision != "fp32":
            for k in range(2):
                encode_piece(precision, wide_moments[k], out_bits[k][: b - a], values[k][a:b], piece_scales[k], work,
                             work_f, work_d, k == 0, shifts[k], block, noise, (positions[k] + a) % period)
        a += stride * piece
    return updated


@dataclass
class GradChunk:
    """A slice of one unit's gradient that has landed (or is landing) in a pinned host buffer."""

    unit: int
    start: int
    grad: torch.Tensor
    ready: object  # event to wait on before reading `grad` (None on the CPU)
    release: object  # callable returning the landing buffer
    plan: StepPlan | None
    accumulate: bool
    update: bool
    last: bool
    first: bool = False  # the window's first gradient of the unit: it replaces the sums (its norm is measured)
    landed: bool = False  # `grad` is the unit's sums already: a first gradient copied there directly


@dataclass
class DeviceGrad:
    """A unit's whole gradient, still in its GPU buffer: an eager step whose update runs on the GPU."""

    unit: int
    grads: torch.Tensor = field(repr=False)
    ready: object  # compute-lane event after the gradient's last write
    plan: StepPlan
    done: object  # callable(event): the GPU buffer may be reused after `event`
    slot: SlotWrite | None = None  # the unit's weight slot, for the new weights


@dataclass
class UntouchedRows:
    """The step's update of an embedding's rows that no token touched, ahead of its gradient (`touched_rows`)."""

    unit: int
    plan: StepPlan
    slot: SlotWrite  # the unit's weight slot (its `free`: the compute event after the forwards that read it)
    resume: bool = False  # the rest of a pass that gave way to the items queued behind it


@dataclass
class TouchedRowsBack:
    """Put an embedding's touched rows, updated at the step's end, back in place on the host (`touched_rows`)."""

    unit: int


@dataclass
class DeferredUpdate:
    """Update a whole unit from the gradient its step held on the host (after clipping or manual optimization):
    fp32 sums, or the one gradient as it came."""

    unit: int
    plan: StepPlan
    grads: torch.Tensor = field(repr=False)
    slot: SlotWrite | None = None  # the unit's weight slot, for the new weights (an update on the GPU)


Item = GradChunk | DeferredUpdate | DeviceGrad | UntouchedRows | TouchedRowsBack  # what the optimizer threads take


class Scratch:
    """One thread's buffers for an update's pieces: both moments decoded to fp32 (and their int32 views), the
    codecs' int32 work room, and the gradient widened to fp32 (made on first use without compact moments: a run
    whose gradients are fp32 never needs it)."""

    def __init__(self, moment_elems: int, elems: int) -> None:
        self.moments = [torch.empty(moment_elems) for _ in range(2)]
        self.moment_bits = [m.view(torch.int32) for m in self.moments]
        self.work = torch.empty(2, moment_elems, dtype=torch.int32)
        self.work_f, self.work_d = work_views(self.work)
        self.elems = elems
        self._wide: torch.Tensor | None = torch.empty(elems) if moment_elems else None

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (*self.moments, self.work, self._wide) if t is not None]

    def wide_for(self, grad: torch.Tensor) -> torch.Tensor:
        """Room for `grad`'s pieces in fp32 (an empty tensor when `grad` is fp32 already)."""
        if grad.dtype == torch.float32:
            return torch.empty(0)
        if self._wide is None:
            self._wide = torch.empty(self.elems)
        return self._wide


class LayerAdam:
    """Owns the unit storages' optimizer state and the threads that update them: one for the units updated on the
    CPU, one for those updated on the GPU (`on_device`), so that neither kind waits in the other's queue (behind a
    CPU backlog, a GPU block's update would start only once the CPU's ahead of it had ended).

    `scheduled[u]` counts updates launched for unit u, `applied[u]` those the CPU has finished or the GPU has been
    given (queued on its lanes; `landed[u]` is the event after the last): a unit's weights may be loaded for compute
    only when the two agree, and on the device after `landed[u]`.
    """

    def __init__(self, storages: list[UnitStorage], moments: Moments, failure: Failure,
                 on_device: DeviceUpdater | None = None) -> None:
        self.storages, self.moments, self.on_device = storages, moments, on_device
        self.failure = failure
        self.scheduled = [0] * len(storages)
        self.applied = [0] * len(storages)
        # a unit's last update on the GPU: its host master and moments (and the weight slot it was given) are
        # written once this event has passed (loads wait for it on the device; `drain` on the host)
        self.landed: list[object] = [None] * len(storages)
        # elements of each unit's latest update the CPU has written, from its start: chunks come in order (the copy
        # thread sends a gradient's chunks from its first element on, deferred updates go span by span), so a load
        # may copy a piece as soon as this passes it (`Window._load`)
        self.written = [0] * len(storages)
        self.work_s = [0.0] * len(storages)  # this thread's time per unit: sums, updates, their disk reads
        self.landing_s = [0.0] * len(storages)  # ... and its waits for the unit's gradient chunks to land
        largest = max((s.trainable_numel for s in storages), default=0)
        self.compact = moments.precision != "fp32"
        self.piece = piece = self.widen_elems(largest, moments.precision)
        self.scratch = Scratch(0, piece)  # this thread's: fp32 moments need no scratch
        self.pool = PiecePool(pool_threads(), lambda: Scratch(piece, piece)) if self.compact else None
        scripted(adam_pieces)  # compiled here, before any update waits for it
        self.worker: Worker[Item] = Worker("layer-adam", self._handle, failure)
        self.device_worker: Worker[Item] | None = None
        if on_device is not None:
            self.device_worker = Worker("layer-adam-gpu", self._handle, failure)

    @property
    def workers(self) -> list[Worker]:
        return [w for w in (self.worker, self.device_worker) if w is not None]

    @staticmethod
    def widen_elems(largest_trainable: int, precision: MomentPrecision = "fp32") -> int:
        """The piece an update runs in where something is widened to fp32 (`_update`): compact moments, or a
        gradient held in the compute dtype."""
        return min(SCRATCH_ELEMS if precision != "fp32" else WIDEN_ELEMS, largest_trainable)

    @classmethod
    def scratch_bytes(cls, largest_trainable: int, precision: MomentPrecision) -> int:
        """Compact moments: every pool thread's scratch (two fp32 moments, two int32 work rows, a widened gradient)."""
        return 0 if precision == "fp32" else 5 * 4 * cls.widen_elems(largest_trainable, precision) * pool_threads()

    @classmethod
    def widen_bytes(cls, largest_trainable: int, precision: MomentPrecision = "fp32") -> int:
        """The fp32 buffer a gradient held in the compute dtype is widened in by fp32 updates (compact ones
        widen in their pool threads' scratch, `scratch_bytes`)."""
        return 0 if precision != "fp32" else 4 * cls.widen_elems(largest_trainable, precision)

    def schedule(self, unit: int) -> None:
        self.scheduled[unit] += 1
        self.written[unit] = 0

    def put(self, item: Item) -> None:
        """Queue `item` on the thread of its unit's kind (CPU or GPU update)."""
        on_device = self.device_worker is not None and self.updates_on_device(item.unit)
        (self.device_worker if on_device else self.worker).put(item)

    def updates_on_device(self, unit: int) -> bool:
        """The unit's update runs on the GPU (`device_update.gpu_updated_units`)."""
        return self.on_device is not None and unit in self.on_device.units

    def ready(self, unit: int) -> bool:
        """Every update launched for `unit` is applied, or queued on the GPU (a load then waits for `landed` on the
        device, not on the host)."""
        return self.applied[unit] >= self.scheduled[unit]

    def wait_applied(self, unit: int) -> float:
        return self.failure.wait(lambda: self.ready(unit), f"the update of unit {unit}")

    def wait_written(self, unit: int, end: int) -> float:
        """Wait until the CPU has written elements [0, end) of the unit's latest update (or all of it)."""
        return self.failure.wait(lambda: self.ready(unit) or self.written[unit] >= end, f"the update of unit {unit}")

    def drain(self) -> float:
        waited = sum(self.failure.wait(w.idle, f"the optimizer thread {w.name}") for w in self.workers)
        waited += self.moments.drain()
        for unit, event in enumerate(self.landed):
            if event is not None:
                waited += self.failure.wait(event.query, f"the GPU update of unit {unit}")
                self.landed[unit] = None
        return waited

    def _handle(self, item: Item) -> None:
        if isinstance(item, DeviceGrad):  # queued on the GPU, not waited for: the next unit's chunks follow at once
            with self._working_on(item.unit):
                event = self._update(item.unit, item.plan, 0, item.grads, item.ready, wait=False, slot=item.slot)
            item.done(event)
            self._finish(item.unit)
            self._put_back_later(item.unit)
            return
        if isinstance(item, TouchedRowsBack):
            with self._working_on(item.unit):
                self.on_device.put_back()
            return
        if isinstance(item, UntouchedRows):
            with self._working_on(item.unit):
                complete = self._untouched_rows(item)
            if not complete:  # the items waiting go first, then the rest of the pass
                self.device_worker.put(replace(item, resume=True))
            return
        if isinstance(item, DeferredUpdate):
            with self._working_on(item.unit):
                for start, n in self.moments.spans(item.unit):
                    self._update(item.unit, item.plan, start, item.grads[start : start + n], slot=item.slot)
                    self._wrote(item.unit, start + n)
            self._finish(item.unit)
            self._put_back_later(item.unit)
            return
        start = time.perf_counter()
        host_wait(item.ready)
        self.landing_s[item.unit] += time.perf_counter() - start
        with self._working_on(item.unit):
            grad = item.grad
            if item.accumulate and not item.landed:
                grad = self._accumulate(item)
            if item.update:
                self._update(item.unit, item.plan, item.start, grad)
        if item.update:
            self._wrote(item.unit, item.start + item.grad.numel())
        item.release()
        if item.update and item.last:
            self._finish(item.unit)

    def _put_back_later(self, unit: int) -> None:
        """An embedding's touched rows just updated on the GPU go back in place on the host by an item of their own,
        off the path of the next forward, which waits for the unit's update (`DeviceUpdater.put_back`)."""
        if self.on_device is not None and self.on_device.rows is not None and self.on_device.rows.back is not None:
            self.device_worker.put(TouchedRowsBack(unit))

    def _untouched_rows(self, item: UntouchedRows) -> bool:
        """Queue (more of) the pass over an embedding's untouched rows; whether it is all queued."""
        if item.resume:
            return self.on_device.resume_untouched(self.device_worker.waiting)
        (master, *moments), done = self.moments.open(item.unit, 0, self.storages[item.unit].trainable_numel)
        complete = self.on_device.run_untouched(self.storages[item.unit], item.plan, item.slot.free, master,
                                                tuple(moments), item.slot, self.device_worker.waiting)
        done()
        return complete

    @contextmanager
    def _working_on(self, unit: int) -> Iterator[None]:
        """Count the block's time against `unit` (the wait for its gradient's copy is not counted)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.work_s[unit] += time.perf_counter() - start

    def _update(self, unit: int, plan: StepPlan, start: int, grad: torch.Tensor, ready: object = None,
                wait: bool = True, slot: SlotWrite | None = None) -> object:
        """AdamW over [start, start + len(grad)) of `unit`: on the GPU (`device_update`, the new weights also into
        `slot`; returns the event after which `grad` may be reused and the host holds the result, waited for unless
        `wait` is False, and kept in `landed`), or on the CPU in pieces where something is widened to fp32 first:
        compact moments (the pool's threads taking every threads-th piece each) or a gradient held in the compute
        dtype (torch's fused AdamW takes fp32 grads for fp32 weights)."""
        (master, *moments), done = self.moments.open(unit, start, grad.numel())
        if self.updates_on_device(unit):  # RAM moments: `done` hands nothing back
            event = self.on_device.run(self.storages[unit], plan, start, grad, ready, master, tuple(moments), slot)
            if wait:
                host_wait(event)
            self.landed[unit] = event
            done()
            return event
        args = (self.storages[unit], plan, start, grad, master, tuple(moments), self.moments.codecs)
        if self.pool is not None:
            self.pool.run(lambda scratch, first, stride: adam_(*args, scratch, self.piece, first, stride))
        else:
            adam_(*args, self.scratch, self.piece if grad.dtype != torch.float32 else max(grad.numel(), 1))
        done()
        return None

    def _accumulate(self, item: GradChunk) -> torch.Tensor:
        """Start the sums with the window's first gradient, or add a later one and measure the sums when they are
        final and clipped (a first gradient's norm is measured on the device)."""
        acc = self.storages[item.unit].grad_acc[item.start : item.start + item.grad.numel()]
        if item.first:
            return acc.copy_(item.grad)
        acc.add_(item.grad)
        if item.plan is not None and item.plan.norm is not None:
            item.plan.norm.add(acc, item.unit)
        return acc

    def buffers(self) -> list[torch.Tensor]:
        """Every scratch buffer of this thread and the pool's."""
        scratches = [self.scratch, *(self.pool.scratches if self.pool is not None else [])]
        return [t for scratch in scratches for t in scratch.tensors()]

    def stop(self) -> None:
        """End the optimizer threads after their queued items."""
        for worker in self.workers:
            worker.stop()

    def close(self) -> None:
        """Stop the pool threads (after the optimizer threads have stopped) and unlock the device updater's pages."""
        if self.pool is not None:
            self.pool.close()
        if self.on_device is not None:
            self.on_device.close()

    def _wrote(self, unit: int, end: int) -> None:
        """The CPU's update of `unit` has written [0, end): a load waiting for a piece of it may go on."""
        if not self.updates_on_device(unit):
            self.written[unit] = end
            self.failure.notify()

    def _finish(self, unit: int) -> None:
        self.applied[unit] += 1
