"""Where each unit's gradient goes between its backward and its update, and the bookkeeping that decides it.

A unit's gradient is written into a GPU gradient buffer part by part; when its last part has reported, the
gradient is complete and is dispatched: to the copy thread (an update now, or a sum to add to), or held back
(the lowest blocks wait for the backward's last gradient, so the updates the next forward waits for come
first). A step that holds its gradients on the host (clipping, accumulation, manual optimization) gives each
unit a home there: fp32 sums, or, for one gradient as it came, the host buffer its saved input just left.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from lightning_slide.activations import Saved
from lightning_slide.layer_adam import DeviceGrad, LayerAdam, StepPlan
from lightning_slide.moments import Moments
from lightning_slide.parts import Binding, Part
from lightning_slide.step_mode import StepMode
from lightning_slide.storage import UnitStorage
from lightning_slide.streams import Lane
from lightning_slide.threads import Failure
from lightning_slide.transfer import Dispatch, GradPump
from lightning_slide.window import GradBuffer, Window


@dataclass
class Bookkeeping:
    """The state of the current micro-batch (its tape and backward) and of the current step's gradients.

    A new micro-batch resets the first group, the end of a step the second; `lent` lasts until the updates
    that read the lent buffers are done."""

    units: int
    # the micro-batch: its forward's tape and its backward's progress
    pending: list[int] = field(init=False)  # unit -> part calls whose backward has not reported yet
    position: int = 0  # part calls recorded by this forward (the key of their saved inputs)
    last_call: weakref.ref | None = None  # the forward's latest call: a backward prefetches the one before it
    written: set[int] = field(default_factory=set)  # params whose gradient this backward has written
    receiving: dict[int, GradBuffer] = field(default_factory=dict)  # unit -> the GPU buffer its gradient fills
    held: list[Dispatch | DeviceGrad] = field(default_factory=list)  # complete gradients held for the backward's last
    spare: dict[int, torch.Tensor] = field(default_factory=dict)  # unit -> a host buffer its backward freed
    # the step: what the optimizer step will read
    plan: StepPlan | None = None  # this step's hyperparameters, once the step is known
    stepped: set[int] = field(default_factory=set)  # units that got a gradient since the last optimizer step
    holding: dict[int, torch.Tensor] = field(default_factory=dict)  # unit -> where its gradient waits
    measured: set[int] = field(default_factory=set)  # units whose gradient the step's norm measured as it came
    lent: dict[int, int] = field(default_factory=dict)  # data_ptr of a saved-input buffer -> unit it holds

    def __post_init__(self) -> None:
        self.pending = [0] * self.units

    @property
    def in_backward(self) -> bool:
        return any(self.pending)

    def new_micro_batch(self) -> None:
        self.position, self.last_call = 0, None
        self.spare.clear()

    def abandon_backward(self) -> None:
        """Forget a backward that will not come: its parts will not report back."""
        self.pending = [0] * self.units
        self.written.clear()
        self.receiving.clear()

    def end_step(self) -> tuple[list[int], list[int]]:
        """The units that got a gradient since the last step, and those of them whose gradient the step's norm has
        not measured (sorted): their last gradient came before the step was known, or a later micro-batch of the
        window did not reach them."""
        units, unmeasured = sorted(self.stepped), sorted(self.stepped - self.measured)
        self.stepped, self.measured = set(), set()
        return units, unmeasured


class GradRouter:
    """Takes each part's weight gradients into GPU buffers and dispatches each unit's complete gradient."""

    def __init__(self, storages: list[UnitStorage], window: Window, compute: Lane, adam: LayerAdam,
                 pump: GradPump | None, moments: Moments, mode: StepMode, dtype: torch.dtype, device: torch.device,
                 failure: Failure) -> None:
        self.storages, self.window, self.compute, self.adam, self.pump = storages, window, compute, adam, pump
        self.moments, self.mode, self.dtype, self.device, self.failure = moments, mode, dtype, device, failure
        self.book = Bookkeeping(len(storages))
        ring_units = [u for u, s in enumerate(storages) if s.trainable_numel and u not in window.dedicated]
        self.hold_back(set(ring_units[: len(window.block_grads)]))
        self.wait_s = 0.0  # the training thread's waits for gradient buffers and for updates of lent buffers

    def hold_back(self, units: set[int]) -> None:
        """The lowest blocks whose gradients wait for the backward's last one and then go lowest first
        (`release_held`): where the optimizer threads run behind the backward, the updates the next forward waits
        for then come first; where they keep pace, none (each update then runs as its gradient comes, and only the
        last ones are left for the step's end). `update_order` is the order the backward then hands units over."""
        self.held_back = units
        self.update_order = [u for u in reversed(range(len(self.storages))) if u not in units] + sorted(units)

    @staticmethod
    def home_bytes(trainable: int, dtype: torch.dtype) -> int:
        """A held single gradient of a unit, in the compute dtype: its own buffer, or a lent saved-input buffer
        at least this large (`_gradient_home`)."""
        return trainable * dtype.itemsize

    def expect(self, part: Part) -> None:
        """The forward recorded a call of `part`: its backward will report each trainable owner's gradient."""
        for u in part.trainable_owners:
            self.book.pending[u] += 1

    def store(self, part: Part, bindings: list[Binding], grads: tuple[torch.Tensor | None, ...]) -> None:
        """Write (or add) a part's weight gradients into their units' GPU buffers; dispatch completed units."""
        book = self.book
        for u in part.trainable_owners:
            if u not in book.receiving:
                buffer = book.receiving[u] = self.window.grads_for(u)
                self.wait_s += self.failure.wait(buffer.idle.is_set, "a free gradient buffer")
                self.compute.wait(buffer.free)
        for b, g in zip(bindings, grads):
            dst = b.view(book.receiving[b.owner].grads)
            first = id(b.param) not in book.written
            book.written.add(id(b.param))
            if g is None:
                if first:
                    dst.zero_()
            elif first:
                dst.copy_(g)
            else:
                dst.add_(g)
        for u in part.trainable_owners:
            book.pending[u] -= 1
            if book.pending[u] == 0:
                self._dispatch(u)

    def _dispatch(self, unit: int) -> None:
        """A unit's gradient is complete: send it to the optimizer (update now, or accumulate)."""
        book, storage, holds = self.book, self.storages[unit], self.mode.holds_grads
        self._check_dispatch(unit)
        first = holds and unit not in book.stepped
        sums = None
        if first:
            home, pinned = self._gradient_home(unit)
            book.holding[unit] = home
            sums = home if self._lands_directly(pinned) else None  # else through the landing ring
        if sums is not None:
            # the window's first gradient lands in the sums, which the unit's last update must have read (its
            # forward waited for that update, so this returns at once)
            self.adam.wait_applied(unit)
        update = book.plan is not None and not self.mode.deferred
        if update:
            self.adam.schedule(unit)
        book.stepped.add(unit)
        if book.plan is not None:  # measured as it leaves (or as it is added to the sums)
            book.measured.add(unit)
        else:  # the sums change after any measure taken
            book.measured.discard(unit)
        buffer = book.receiving.pop(unit)
        buffer.idle.clear()
        book.written.difference_update(id(p) for p in storage.params)
        grads, ready = buffer.grads[: storage.trainable_numel], self.compute.record()
        item = (DeviceGrad(unit, grads, ready, book.plan, buffer.release, self.window.claim(unit))
                if update and not holds and self.adam.updates_on_device(unit)  # the gradient stays on the GPU
                else Dispatch(unit, grads, ready, book.plan, holds, update, buffer.release, first, sums))
        if unit in self.held_back:
            book.held.append(item)
        else:
            self._send(item)
        if not book.in_backward:  # the backward's last gradient
            self._check_planned_reads()
            self.release_held()

    def _check_dispatch(self, unit: int) -> None:
        """A gradient outside a step needs sums to wait in; a second one before the step needs sums to add to."""
        book = self.book
        if book.plan is None and not self.mode.holds_grads:
            raise RuntimeError("A backward ran outside an optimizer step, but this run keeps no gradient sums: "
                               "gradient accumulation must be known when fit starts (accumulate_grad_batches, or a "
                               "GradientAccumulationScheduler among the Trainer's callbacks).")
        if self.mode.holds_grads and unit in book.stepped and not self.mode.sums:
            raise RuntimeError(
                f"Unit {self.storages[unit].name} got a second gradient before its optimizer step, but this fit "
                "holds one gradient per unit and step (no accumulation was announced): set accumulate_grad_batches "
                "> 1 (or a GradientAccumulationScheduler) when fit starts to sum several backwards.")

    def _gradient_home(self, unit: int) -> tuple[torch.Tensor, bool]:
        """Where the window's gradient of `unit` waits on the host, and whether that memory is pinned (a copy
        from the GPU goes straight in only then; else it would stall).

        fp32 sums have their own buffer. A step that holds one gradient as it came puts it in the host buffer of
        the unit's saved input that its backward has just freed, where that is large enough (at 64 x 1024 tokens
        a Llama-3.1-8B block's input takes 512 MiB, its bf16 gradient 436 MB) and the gradient can land there
        directly (page-locked, or no GPU): it then costs no memory of its own. The next forward saves into that
        buffer only after the unit's update (`reclaim`). Other units get a buffer of their own at first use.
        """
        storage = self.storages[unit]
        spare = self.book.spare.pop(unit, None)
        nbytes = self.home_bytes(storage.trainable_numel, self.dtype)
        if (not self.mode.sums and spare is not None and spare.numel() * spare.element_size() >= nbytes
                and self._lands_directly(spare.is_pinned())):  # else it would come through the landing ring
            self.book.lent[spare.data_ptr()] = unit
            return spare.view(-1).view(torch.uint8)[:nbytes].view(self.dtype), spare.is_pinned()
        if storage.grad_acc is None:
            storage.add_grad_accumulator(self.mode.held_dtype(self.dtype))
        return storage.grad_acc, storage.acc_pinned

    def _lands_directly(self, pinned: bool) -> bool:
        """A copy from the GPU goes straight into host memory only where that is pinned (else it would stall)."""
        return pinned or self.device.type != "cuda"

    def inputs_back(self, unit: int, saved: list[Saved]) -> None:
        """A part's saved inputs are back on the device: the largest host buffer among them may hold the unit's
        gradient (work on the d2h lane after this backward is ordered after the compute that read them)."""
        if self.mode.sums or not self.mode.holds_grads:
            return
        spare = self.book.spare
        for t in (s.host_tensor for s in saved):
            best = spare.get(unit)
            if t is not None and (best is None or t.numel() * t.element_size() > best.numel() * best.element_size()):
                spare[unit] = t

    def reclaim(self, buffer: torch.Tensor) -> None:
        """A forward is about to save an input into `buffer`: if a unit's gradient waits there, its update first."""
        unit = self.book.lent.pop(buffer.data_ptr(), None)
        if unit is not None:
            self.wait_s += self.adam.wait_applied(unit)

    def _check_planned_reads(self) -> None:
        """Updates during the backward read their disk state in an order planned when the step began (reads run
        ahead of the backward): a unit on disk that got no gradient would leave its planned reads untaken."""
        if self.mode.deferred or self.book.plan is None:
            return
        idle = [self.storages[u].name for u in self.moments.on_disk if u not in self.book.stepped]
        if idle:
            raise RuntimeError(
                f"With Adam state on disk every trainable unit needs a gradient in each step, but {idle} got none "
                "(is the model fed inputs_embeds made outside it?). Clip gradients or accumulate (updates then "
                "follow the backward and skip such units), or keep the state in RAM (offload='cpu').")

    def release_held(self) -> None:
        """Hand the held-back gradients over, lowest unit first (the order the next forward loads them)."""
        for item in sorted(self.book.held, key=lambda d: d.unit):
            self._send(item)
        self.book.held.clear()

    def _send(self, item: Dispatch | DeviceGrad) -> None:
        """A gradient the GPU updates goes to its optimizer thread at once; the others to the copy thread. Behind
        the copy thread it would wait for the CPU's gradients queued ahead of it, which wait for landing buffers the
        CPU's updates free: the embedding's, the backward's last and the next forward's first, would start only
        when the CPU had nearly caught up."""
        if isinstance(item, DeviceGrad):
            self.adam.put(item)
        else:
            self.pump.put(item)

    def abandon(self) -> None:
        """Forget a forward that no backward will follow; complete gradients of it still go to the optimizer."""
        if self.book.in_backward:
            self.book.abandon_backward()
            self.release_held()  # complete gradients, as the units the abandoned backward did dispatch
