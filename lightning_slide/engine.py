"""The sliding engine: trains a model larger than the GPU by streaming units through a window of GPU slots.

Each intercepted module call (a *part* of a unit) runs as one autograd node (`parts.py`). Its forward loads
the unit's weights into a slot, computes under no-grad and keeps only the part's input. Its backward fetches
that input back, recomputes the part with its weights as fresh leaves, writes the weight gradients into a GPU
gradient buffer, and, once every part of a unit is done, hands the unit's gradient to the copy thread and
Layer-Adam (`gradients.py`). The next forward needs the units in ascending order and the backward finishes
them in descending order, so where the updates run behind the backward the lowest blocks (as many as there are
block gradient buffers: they hold their own) wait for the backward's last gradient and then go lowest first: the
updates the next forward waits for come before those it does not. Where device memory is spare, a call keeps its
graph instead and its backward skips the recompute (`graphs.py`). The engine imports no Lightning: the strategy
(or any plain loop) drives it through `begin_step`, `end_step`, `synchronize` and the state methods.
"""

from __future__ import annotations

import math
import tempfile
import time
import warnings
import weakref
from contextlib import suppress
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_slide import master_halves, touched_rows
from lightning_slide.activations import ActivationStore, Saved
from lightning_slide.adapters import UnsupportedModelError, causal_lm_units, find_causal_lm
from lightning_slide.available import available_ram, available_vram, host_headroom
from lightning_slide.config import SlideConfig
from lightning_slide.device_update import (
    FP32_MOMENT_BYTES,
    DeviceUpdater,
    SlotWrite,
    fitted_units,
    fp32_link_bytes,
    gpu_updated_units,
    gpu_updates_on,
    hidden_update_s,
    rates_note,
    updates_keep_pace,
)
from lightning_slide.gradients import GradRouter
from lightning_slide.graphs import GraphBudget
from lightning_slide.layer_adam import (
    DeferredUpdate,
    LayerAdam,
    StepPlan,
    UntouchedRows,
    snapshot,
    validate_optimizer,
)
from lightning_slide.materialize import materialize_
from lightning_slide.moment_state import load_unit, saved_entries, state_entries, without_moments
from lightning_slide.moments import Moments, disk_units, unit_file
from lightning_slide.norm import GlobalNorm
from lightning_slide.parts import Binding, Call, Part, PartFunction, run_part
from lightning_slide.step_mode import StepMode
from lightning_slide.storage import UnitStorage
from lightning_slide.streams import Lane
from lightning_slide.threads import Failure
from lightning_slide.tiers import DiskFile, TierDirectory, direct_io
from lightning_slide.touched_rows import TouchedRows
from lightning_slide.transfer import GradPump, LandingRing, gradient_chunk
from lightning_slide.window import Slot, Window

VRAM_HEADROOM = 0.1  # of the usable GPU memory, kept free when slots="auto" grows the window


class SlideEngine:
    """Owns the flat host storage, the GPU window, the copy and optimizer threads, and the schedule.

    Args:
        root: the module to train (a LightningModule or an HF causal LM); must contain one causal LM that
            holds every parameter.
        optimizer: a torch Adam/AdamW over root's parameters, or None for evaluation only.
        config: the window, tier and chunking settings.
        device: the compute device (CUDA, or the CPU fallback).
        dtype: the dtype weights are computed in (bf16 for bf16 precisions, fp32 for 32-true).
        mode: how steps meet their gradients (eager, accumulating, deferred; the clipping threshold), decided
            once for the fit (`step_mode.py`); `clip_next` clips a single step of manual optimization.
    """

    def __init__(
        self,
        root: nn.Module,
        optimizer: Optimizer | None,
        config: SlideConfig,
        device: torch.device,
        dtype: torch.dtype,
        mode: StepMode = StepMode(),
    ) -> None:
        if device.type == "cuda" and device.index is None:  # memory queries need the index
            device = torch.device("cuda", torch.cuda.current_device())
        self.config, self.device, self.dtype, self.optimizer = config, device, dtype, optimizer
        self.failure = Failure(config.stall_timeout_s)
        self._setup_mode(mode)
        try:
            self._setup_model(root, optimizer)
            files = self._setup_host_state(root, optimizer)
            self._setup_lanes()
            self._setup_optimizer_and_window(files)
            self._setup_transfer()
            self._setup_activations()
            self._setup_step_state()
            if optimizer is not None:
                self._bind_optimizer_state()
        except BaseException:  # give back what setup took as far as it got: nothing of it outlives the error
            self._stop_threads()
            self._release()
            raise
        for part in self.parts:
            part.module.forward = partial(self._forward, part)

    # ----------------------------------------------------------------------------------------- setup
    def _setup_mode(self, mode: StepMode) -> None:
        self.mode, self.clip_norm, self._clip_once = mode, mode.clip_norm, None
        self._measured_norm: GlobalNorm | None = None  # the next step's norm, measured when the clip was asked for
        self.deferred = mode.deferred

    def _setup_model(self, root: nn.Module, optimizer: Optimizer | None) -> None:
        """The causal LM inside `root`, which parameters the optimizer trains, and the model made ready."""
        self.model = find_causal_lm(root)
        _check_all_parameters_inside(root, self.model)
        self._optimized = [p for g in optimizer.param_groups for p in g["params"]] if optimizer is not None else []
        self._trains = [p.requires_grad for p in self._optimized]
        self._prepare_model()

    def _setup_host_state(self, root: nn.Module, optimizer: Optimizer | None) -> dict[int, DiskFile]:
        """Flat host storage per unit (parameters become views of it), the parts that bind them, the disk tier."""
        specs = causal_lm_units(self.model)
        group_of = _group_index(optimizer, root, self.config.moment_precision) if optimizer is not None else {}
        owner, owned = _ownership(specs)
        config = self.config
        self.tier = TierDirectory(config.nvme_path or tempfile.gettempdir()) if config.offload == "nvme" else None
        files = self._disk_files(specs, owned, group_of) if self.tier and optimizer is not None else {}
        self.storages = [UnitStorage(i, spec.name, owned[i], group_of, files.get(i) if config.nvme_master else None)
                         for i, spec in enumerate(specs)]
        materialize_(self.model, [spec.parts for spec in specs], set().union(*(s.placeholders for s in self.storages)),
                     self.device)
        self.parts = [self._part(u, m, owner, group_of) for u, spec in enumerate(specs) for m in spec.parts]
        self._dedicated = [spec.dedicated for spec in specs]
        self._add_host_state(optimizer)
        self._move_buffers(root)
        return files

    def _setup_lanes(self) -> None:
        self.compute = Lane(self.device, side=False)
        self.h2d, self.d2h = Lane(self.device, side=True), Lane(self.device, side=True)

    def _setup_optimizer_and_window(self, files: dict[int, DiskFile]) -> None:
        """The Adam state's tiers, the optimizer thread, and the GPU window of weight slots and gradient buffers."""
        config = self.config
        self.moments = Moments(self.storages, files, self._chunk_elems(), self.failure, config.moment_precision)
        self.adam = LayerAdam(self.storages, self.moments, self.failure, self._device_updater())
        self.window = Window(self.storages, self._dedicated, config.initial_slots, self.dtype, self.device,
                             self.h2d, self.adam, self.optimizer is not None, config.chunk_elems,
                             config.block_grad_buffers)

    def _device_updater(self) -> DeviceUpdater | None:
        """The GPU takes a training run's compact updates, and those of `gpu_update_blocks` fp32 blocks, where
        there is one (`device_update`); computing in bf16, their masters turn into planes while they train
        (`master_halves`, from the first forward on: `enter`)."""
        on, config = gpu_updates_on(self.device), self.config
        self._unfitted_link: float | None = None  # an fp32 "auto" split's link bytes, until fitted to a micro-batch
        if self.optimizer is None:
            return None
        trainable = [s.trainable_numel for s in self.storages]
        bits = master_halves.plane_bits(self.dtype, self._chunk_elems(), max(trainable), config.master_bits)
        amsgrad = any(g["amsgrad"] for g in self.optimizer.param_groups)
        units = [] if on is None else gpu_updated_units(config.moment_precision, config.gpu_update_blocks,
                                                        self._dedicated, self.moments.on_disk, trainable, on, bits,
                                                        amsgrad)
        master_halves.require_planes(config.master_bits, bits if units else None)
        if not units:
            return None
        if config.moment_precision == "fp32" and config.gpu_update_blocks == "auto":
            self._unfitted_link = fp32_link_bytes(bits)
        largest = max(self.storages[u].trainable_numel for u in units)
        table = self._untied_table(units)
        updater = DeviceUpdater(on, self.moments.codecs, largest,
                                LayerAdam.widen_elems(largest, config.moment_precision), plane_bits=bits,
                                row=None if table is None else table[1])
        updater.serve(self.storages, units)
        for u in units if bits is not None else ():
            self.storages[u].add_halves(updater.chunk, bits)
        if table is not None and touched_rows.applies(updater.chunk, table[1], bits):
            updater.rows = TouchedRows(0, *table, on, bits, lambda: available_ram() - host_headroom(),
                                       self.mode.held_dtype(self.dtype))
        return updater

    def _untied_table(self, units: list[int]) -> tuple[int, int] | None:
        """(vocab, hidden) of an embedding whose untouched rows the GPU can update ahead (`touched_rows`): the
        first unit, a plain `nn.Embedding` whose weight is its only trainable range, read by no other part, its
        update on the GPU with fp32 moments in RAM, in steps that update each unit whole (eager steps, or clipped
        ones after the backward; not eager accumulation, whose sums are updated as they land, chunk by chunk) and
        are known before their last backward (not manual optimization, nor Fabric)."""
        parts = [p for p in self.parts if 0 in p.owners]
        storage = self.storages[0]
        chunked = self.mode.holds_grads and not self.mode.deferred
        if (0 not in units or self.config.moment_precision != "fp32" or chunked or self.mode.manual
                or len(parts) != 1 or parts[0].unit != 0 or len(storage.params) != 1):
            return None
        module, weight = parts[0].module, storage.params[0]
        plain = type(module) is nn.Embedding and module.max_norm is None and module.weight is weight
        if not plain or weight.ndim != 2 or weight.numel() != storage.trainable_numel:
            return None
        return weight.shape[0], weight.shape[1]

    def _chunk_elems(self) -> int:
        """Elements per gradient chunk: `chunk_elems`, or the largest unit's trainable size where that is less."""
        return gradient_chunk(self.config.chunk_elems, [s.trainable_numel for s in self.storages])

    def _setup_transfer(self) -> None:
        """The copy thread and its pinned landing ring (training only)."""
        device, dtype = self.device, self.dtype
        pin = device.type == "cuda"
        widen_on = device if device.type == "cuda" and dtype != torch.float32 else None
        self.pump = None
        if self.optimizer is not None:
            ring = LandingRing(self.config.grad_buffers, self._chunk_elems(), pin, self.failure)
            self.pump = GradPump(ring, self.d2h, self.adam, self.failure, widen_on)

    def _setup_activations(self) -> None:
        direct = self.tier is not None and direct_io(self.config.gds, self.device)
        self.activations = ActivationStore(self.config.activations, self.device, self.compute, self.h2d, self.d2h,
                                           len(self.parts), self.failure, self.tier, direct)

    def _setup_step_state(self) -> None:
        """The gradient routing and its bookkeeping, the step counter, the window's adaptation, the kept graphs."""
        self._anchor = torch.empty(0, device=self.device, requires_grad=True)
        self.grads = GradRouter(self.storages, self.window, self.compute, self.adam, self.pump, self.moments,
                                self.mode, self.dtype, self.device, self.failure)
        self.activations.before_reuse = self.grads.reclaim
        self._forward_calls = 0  # part calls the last backpropagated forward recorded (`save_input`)
        self._reads_planned = False  # the disk tier reads ahead for the next updates (kept over a skipped step)
        self._rows_sent = False  # this step's untouched rows are queued for their update
        self._step = 0
        self._adapted = False
        self._adapted_tokens = 0  # the largest micro-batch (tokens) of the step the adaptation measured
        self._step_tokens = 0
        self._moments_placed = False  # `_keep_moments` has run
        self._kept_after_peak = 0  # device bytes it took since the peak `_adapt` reads was measured
        self.notes: list[str] = []  # what the engine decided from the first micro-batches, for the log
        self.graphs = GraphBudget(self.config.recompute)
        self._step_tensors: list[torch.Tensor] = []
        self.wait_drain_s = 0.0
        self.planes_s = 0.0  # the training thread's time turning masters into planes and back (`master_halves`)
        self._masters_rounded = False  # master_bits=24 has rounded the masters the slots were loaded from

    @property
    def _rows(self) -> TouchedRows | None:
        """The embedding's `touched_rows`, which the device updater owns (None where none applies)."""
        return None if self.adam.on_device is None else self.adam.on_device.rows

    @property
    def wait_grads_s(self) -> float:
        """Seconds the training thread waited for gradient buffers and for the updates of lent buffers."""
        return self.grads.wait_s

    def _prepare_model(self) -> None:
        """Per-unit recompute replaces HF gradient checkpointing; KV caches have no place in training
        (`_without_cache`).

        On CUDA the Triton kernels of `ops` go in first (the fused loss never builds the logits; attention over
        groups of heads waits for `group_attention`), and the MLPs that `mlp_tile_tokens` tiles (on any device
        with an int), so that the engine wraps the patched modules.
        """
        checkpointing = "is_activation_checkpointing" if hasattr(self.model, "is_activation_checkpointing") else (
            "is_gradient_checkpointing")  # the older name (a deprecation warning where both exist)
        if getattr(self.model, checkpointing, False):
            self.model.gradient_checkpointing_disable()
        # a call that does not ask for a KV cache gets none (training has no use for one, and an evaluation's would
        # hold every layer's keys and values on the GPU); the config, which an export writes, stays as it is
        self._no_cache = self.model.register_forward_pre_hook(_without_cache, with_kwargs=True)
        self._kernels = None
        kernels = self.config.use_kernels and self.device.type == "cuda"
        tiles = self.config.mlp_tiling(self.device.type)
        if kernels or tiles is not None:
            from lightning_slide import ops  # imports triton: only where kernels run or MLPs are tiled

            if kernels or ops.supports(self.model):
                self._kernels = ops.patch(self.model, rms_norm=kernels, rope=kernels, swiglu=kernels,
                                          cross_entropy=kernels, chunk_mib=self.config.loss_chunk_mib,
                                          mlp_tile_tokens=tiles, grouped_attention=False)

    def _part(self, unit: int, module: nn.Module, owner: dict[int, int], group_of: dict[int, int]) -> Part:
        """Every parameter use inside one intercepted module, located in its owner unit's buffer."""
        bindings = [
            Binding(m, name, p, owner[id(p)], self.storages[owner[id(p)]].offsets[id(p)], id(p) in group_of)
            for m in module.modules()
            for name, p in m._parameters.items()
            if p is not None
        ]
        needs_rng = any(isinstance(m, nn.Dropout) and m.p > 0 for m in module.modules()) or (
            float(getattr(self.model.config, "attention_dropout", 0.0) or 0.0) > 0
        )
        return Part(unit, module, module.forward, bindings, needs_rng, module.__dict__.get("forward"))

    def _disk_files(self, specs: list, owned: list[list[nn.Parameter]],
                    group_of: dict[int, int]) -> dict[int, DiskFile]:
        """The disk-tier file of each unit whose moments (and, with nvme_master, fp32 master) live on disk."""
        numel = [sum(p.numel() for p in params) for params in owned]
        trainable = [sum(p.numel() for p in params if id(p) in group_of) for params in owned]
        return {u: unit_file(self.tier, u, specs[u].name, numel[u] if self.config.nvme_master else 0, trainable[u],
                             self.config.moment_precision)
                for u in disk_units(trainable, self.config.nvme_moments or 0.0)}

    def _add_host_state(self, optimizer: Optimizer | None) -> None:
        """A master on disk is loaded from a pinned copy in the compute dtype (the shadow), refreshed by updates."""
        amsgrad = optimizer is not None and any(g["amsgrad"] for g in optimizer.param_groups)
        for s in self.storages:
            if s.on_disk:
                s.add_shadow(self.dtype)
            if self.mode.sums and optimizer is not None:  # held single gradients find a home at first use
                s.add_grad_accumulator()
            if amsgrad:
                s.add_amsgrad_state()

    def _move_buffers(self, root: nn.Module) -> None:
        for m in root.modules():
            for name, buf in m._buffers.items():
                if buf is not None:
                    m._buffers[name] = buf.to(self.device)

    def _bind_optimizer_state(self) -> None:
        """Expose the flat Adam state as torch's own per-parameter state, so state_dict() is standard (with
        compact moments in the form `moment_state` describes): each parameter has its own step tensor, as in
        torch's AdamW, which increments them in place after loading."""
        self._step_tensors = []
        for s in self.storages:
            for p in (q for q in s.params if s.offsets[id(q)] < s.trainable_numel):
                self._step_tensors.append(step := torch.tensor(float(self._step)))
                state = {"step": step, **state_entries(s, p, self.moments.codecs)}
                if s.max_exp_avg_sq is not None:
                    state["max_exp_avg_sq"] = s.view(s.max_exp_avg_sq, p)
                self.optimizer.state[p] = state

    # ---------------------------------------------------------------------------------- the schedule
    def _forward(self, part: Part, *args: Any, **kwargs: Any) -> Any:
        self.failure.check()
        if (kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None) and torch.is_grad_enabled():
            raise ValueError("slideformer trains without a KV cache: call the model with use_cache=False.")
        call = Call(self, part, args, kwargs)
        if not (torch.is_grad_enabled() and (part.trainable_owners or call.grad_positions)):
            return call.rebuild(call.forward((), backward=False))
        if self._rows is not None and part.unit == self._rows.unit:
            self._rows.see(args[0] if args else kwargs["input"])
        book = self.grads.book
        call.prev = book.last_call
        outputs = PartFunction.apply(call, self._anchor, *call.grad_inputs())
        book.last_call = weakref.ref(call)
        book.position += 1
        self.grads.expect(part)
        return call.rebuild(outputs)

    # What a part's call needs of the engine (`parts.PartHost`).
    def enter(self, part: Part, direction: int) -> dict[int, Slot]:
        """The slots of every unit the part reads, loaded (or loading) and ordered before the part's compute."""
        if self._fp32_masters:
            self._masters_to_planes()
        if direction < 0:
            self._forward_calls = self.grads.book.position
        protect = set(part.owners)
        slots = {u: self.window.ensure(u, part.unit, direction, protect) for u in part.owners}
        for slot in slots.values():
            self.compute.wait(slot.loaded)
        return slots

    def leave(self, part: Part, slots: dict[int, Slot], direction: int) -> None:
        """The part's compute is queued: its slots are free after it; load the next units of the pass ahead, and in
        the backward, the dedicated units the CPU has updated (`Window.refresh_dedicated`)."""
        done = self.compute.record()
        for slot in slots.values():
            slot.params_free = done
        ahead = range(part.unit + direction, part.unit + direction * (self.window.lookahead + 1), direction)
        protect = set(part.owners)
        for u in (u for u in ahead if 0 <= u < len(self.storages)):
            protect.add(u)
            if not self.adam.ready(u):  # a prefetch neither waits for an update (at a step's start: the unit's call
                break  # will) nor passes it: the loads' lane is first in, first out, and the pass needs this unit first
            self.window.ensure(u, part.unit, direction, protect)
        if direction < 0:
            self.window.refresh_dedicated()

    def compute_part(self, part: Part, slots: dict[int, Slot], leaves: list, spec: Any, weights: dict) -> Any:
        return run_part(part, slots, leaves, spec, weights)

    def save_input(self, index: int, value: torch.Tensor) -> Saved:
        """Keep the `index`-th input of the forward's current call for its backward. The forward's last call (as
        many calls in as the last backpropagated forward had) keeps it on the device: its backward is the first,
        which would otherwise wait for the input's way out and back (at 8B 64x1024 the head's, 0.54 GB)."""
        position = self.grads.book.position
        return self.activations.save((position, index), value, keep=position == self._forward_calls - 1)

    def inputs_back(self, unit: int, saved: list[Saved]) -> None:
        self.grads.inputs_back(unit, saved)

    def store_grads(self, part: Part, bindings: list[Binding], grads: tuple[torch.Tensor | None, ...]) -> None:
        self._update_untouched_rows()
        self.grads.store(part, bindings, grads)

    def _update_untouched_rows(self) -> None:
        """The step's last backward has begun and will reach the embedding (its forward ran: were its gradient
        not to come, `end_step` stops the run): the rows its tokens did not touch are updated now, beside the
        backward (`touched_rows`)."""
        rows, book = self._rows, self.grads.book
        if (rows is None or not rows.reserved or self._rows_sent or book.plan is None or not book.pending[rows.unit]
                or not self.adam.updates_on_device(rows.unit)):
            return
        self._rows_sent = True
        slot = self.window.holding(rows.unit)
        if slot is None or slot.unit != rows.unit:
            return
        rows.send(self.compute)
        write = SlotWrite(slot.params[: self.storages[rows.unit].trainable_numel], self.compute.record())
        self.adam.put(UntouchedRows(rows.unit, book.plan, write))

    def tile_mlps(self, setting: int | None) -> None:
        """Run the patched MLPs untiled (None) or in tiles of `setting` tokens: a runtime that plans memory per
        micro-batch decides `mlp_tile_tokens="auto"` this way (`planner.resolve_batch_setup`)."""
        if self._kernels is not None:
            self._kernels.tile_mlps(setting)

    def group_attention(self, on: bool) -> None:
        """Let long attention run over groups of heads (`ops.grouped_attention`): a runtime that plans memory per
        micro-batch turns it on where the micro-batch does not fit without (`planner.resolve_batch_setup`)."""
        if self._kernels is not None:
            self._kernels.group_attention(on)

    # ------------------------------------------------------------------------------ the step protocol
    def new_micro_batch(self, tokens: int | None = None) -> None:
        """Forget a graph that was never backpropagated (its parts will not report back). `tokens`, when the
        caller knows them: a micro-batch larger than the one the window was sized for sizes it again."""
        self.grads.abandon()
        self.grads.book.new_micro_batch()
        self.activations.new_micro_batch()
        self.graphs.new_micro_batch()
        if tokens is not None:
            self._fit_gpu_split(tokens)
            if self._adapted and tokens > self._adapted_tokens:
                self._reopen_adaptation()
            self._step_tokens = max(self._step_tokens, tokens)

    def clip_next(self, max_norm: float, measure: bool = False) -> float | None:
        """Clip the next step's gradients to this global norm (manual optimization's `clip_gradients`, which
        comes after the backward and before the step it is for; manual optimization always defers updates).

        With `measure`, return that norm now (before clipping, as torch's `clip_grad_norm_` returns it): this waits
        for the gradients in flight to land in their host sums and measures the sums, which the step would do
        anyway; the step then clips by this measure. A backward after it makes the step measure afresh.
        """
        self._clip_once = max_norm
        if not measure:
            return None
        self.wait_drain_s += self.drain()
        book = self.grads.book
        self._measured_norm = GlobalNorm(max_norm)
        for unit in sorted(book.stepped):
            self._measured_norm.add(book.holding[unit], unit)
        book.measured = set(book.stepped)  # until a backward adds to the sums
        return math.sqrt(self._measured_norm.host)

    def begin_step(self) -> None:
        """The next backward ends an accumulation window: freeze this step's hyperparameters now."""
        self.failure.check()
        self._check_trainable()
        clip, self._clip_once = self._clip_once or self.clip_norm, None
        measured, self._measured_norm = self._measured_norm, None
        plan = self.grads.book.plan = snapshot(self.optimizer, self._step + 1, clip)
        if measured is not None and self.grads.book.measured == self.grads.book.stepped:
            plan.norm = measured
        else:  # the step measures afresh what its window's last backward does not
            self.grads.book.measured.clear()
        if not self.deferred and not self._reads_planned:  # the order this step's backward hands units over
            self.moments.plan(self.grads.update_order)
            self._reads_planned = True

    def _check_trainable(self) -> None:
        """Which parameters train is fixed when the run starts: their optimizer state is laid out then."""
        changed = [p for p, trains in zip(self._optimized, self._trains) if p.requires_grad != trains]
        if changed:
            names = {id(p): n for n, p in self.model.named_parameters()}
            raise RuntimeError(
                f"slideformer fixes which parameters train when fit starts, but {len(changed)} parameter(s) of the "
                f"optimizer changed requires_grad since (e.g. {names.get(id(changed[0]), '?')}). Freeze or unfreeze "
                "before trainer.fit; to change it later, start a new fit.")

    def end_step(self, backward_ran: bool = True) -> None:
        """The window's last backward has run, or was skipped (`backward_ran` False: training_step returned None).

        As in Lightning's own loop, a skipped backward leaves the step to what the window's other micro-batches
        accumulated. A window whose gradients reached no parameter (skipped, or a loss that does not depend on
        the model) updates nothing: AdamW leaves parameters without a gradient, and their step counts, as they are.
        """
        book = self.grads.book
        plan, book.plan = book.plan, None
        if not backward_ran:
            self.grads.abandon()
        if book.in_backward:
            missing = [self.storages[u].name for u, n in enumerate(book.pending) if n]
            raise RuntimeError(f"The backward did not reach units {missing}: their parameters got no gradient.")
        if not book.stepped:
            return
        units, unmeasured = book.end_step()
        self._reads_planned = self._rows_sent = False
        self._step += 1
        if self.deferred:
            self._launch_deferred(plan, units, unmeasured)
        book.holding.clear()  # eager accumulation: the updates read the sums themselves
        self._keep_moments()
        if "auto" in (self.config.slots, self.config.recompute) and not self._adapted:  # first step at this size
            self._adapted, self._adapted_tokens = True, self._step_tokens
            self._adapt()
        self._reserve_rows()
        self._step_tokens = 0

    def allocated(self) -> int:
        """Device memory held by tensors now (a host-side counter: no synchronisation); 0 off CUDA."""
        return torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0

    def _spare_vram(self) -> float:
        """Device bytes the steps leave spare: the free memory and what tensors hold, less the headroom and the
        step's peak (since torch.cuda's peak statistics were last reset); infinite off CUDA."""
        if self.device.type != "cuda":
            return math.inf
        limit = available_vram(self.device) + self.allocated()
        return limit * (1 - VRAM_HEADROOM) - torch.cuda.max_memory_allocated(self.device)

    def _keep_moments(self) -> None:
        """After the first step: the moments of up to `resident_moments` blocks the GPU updates, the lowest first
        (their updates end the step), into device memory the step left spare (`DeviceUpdater.keep_moments`); they
        stay there for the run."""
        updater, wanted = self.adam.on_device, self.config.resident_moments
        if not wanted or self._moments_placed:
            return
        self._moments_placed = True
        if updater is None:
            self.notes.append(f"resident_moments={wanted} unused: no update runs on the GPU here")
            return
        blocks = sorted(u for u in updater.units if not self._dedicated[u])[:wanted]
        spare, kept = self._spare_vram(), []
        self.wait_drain_s += self.drain()  # the first step's updates may still be writing them
        for u in blocks:
            need = FP32_MOMENT_BYTES * self.storages[u].trainable_numel
            if need > spare:
                break
            updater.keep_moments(self.storages[u])
            spare -= need
            self._kept_after_peak += need
            kept.append(self.storages[u].name)
        self.notes.append(f"Adam moments in GPU memory for {len(kept)} of the {wanted} blocks asked "
                          f"(resident_moments): {', '.join(kept) or 'none'}")

    def _adapt(self) -> None:
        """The first step showed this batch's peak memory: spend what is spare (less the moments `_keep_moments`
        placed since) on block slots, then kept graphs.

        More resident blocks mean fewer loads: a block that stays in its slot from its forward to its
        backward is read from host memory once per step instead of twice. A kept graph saves a part's
        recompute (a quarter of its compute). On the CPU the slots grow to every block and graphs are not
        kept (there is no device memory to spend).
        """
        grow = max(0, self.window.blocks - len(self.window.ring)) if self.config.slots == "auto" else 0
        if self.device.type == "cuda":
            spare = self._spare_vram() - self._kept_after_peak
            grow = max(0, min(grow, int(spare // max(self.window.slot_bytes, 1))))
            self.graphs.allow(spare - grow * self.window.slot_bytes)
        self.window.grow(grow)
        graphs = ("every part keeps its graph" if math.isinf(self.graphs.limit)
                  else f"{self.graphs.limit / 2**30:.2f} GiB for kept graphs (recompute={self.config.recompute!r})")
        size = f"micro-batches of up to {self._adapted_tokens} tokens: " if self._adapted_tokens else ""
        self.notes.append(f"window sized for {size}{len(self.window.ring)} of {self.window.blocks} blocks have a GPU "
                          f"slot ({grow} added, {grow * self.window.slot_bytes / 2**30:.2f} GiB); {graphs}")

    def _fit_gpu_split(self, tokens: int) -> None:
        """At the first training micro-batch of an fp32 "auto" split: the CPU takes back the blocks whose updates
        a step of micro-batches of `tokens` hides behind its compute anyway (`device_update.fitted_units`), and
        where all of them are hidden, the lowest blocks' gradients go as they come instead of waiting for the
        backward's last (`GradRouter.hold_back`): the CPU then updates them beside the backward's tail rather than
        one after another at the boundary. Blocks count as recomputed unless `recompute="never"`: "auto" recomputes
        every block in the first step and keeps graphs later only in VRAM left spare."""
        updater, link = self.adam.on_device, self._unfitted_link
        if updater is None or link is None:
            return
        self._unfitted_link = None
        blocks = sum(s.numel for s, dedicated in zip(self.storages, self._dedicated) if not dedicated)
        hidden = hidden_update_s(updater.device, blocks, tokens, self.deferred, self.config.recompute != "never")
        trainable = [s.trainable_numel for s in self.storages]
        before = len(updater.units)
        self._leave_gpu_updates(updater.units.difference(
            fitted_units(updater.units, self._dedicated, trainable, updater.device, link, hidden)))
        self.notes.append(f"fp32 updates on the GPU for micro-batches of {tokens} tokens: {len(updater.units)} of the "
                          f"{before} units 'auto' gave it (about {hidden:.2f} s of compute hides updates; "
                          f"{rates_note(updater.device)})")
        if not self.deferred and updates_keep_pace(updater.units, trainable, updater.device, link, hidden):
            self.grads.hold_back(set())
            self.notes.append("the updates keep pace with the backward: each goes as its gradient comes, the lowest "
                              "blocks' too")

    def _reserve_rows(self) -> None:
        """After the first step, whose buffers then hold their host memory: the staging of the embedding's touched
        rows (`touched_rows`), sized by the rows that step touched (the updater grows it where a later step touches
        more), or none where they are too many or host RAM is short (the embedding then updates whole)."""
        rows = self._rows
        if rows is None or rows.reserved:
            return
        touched = rows.first_touched()
        if not touched:  # no training forward looked the embedding up yet
            return
        refused = rows.reserve(touched)
        if refused is None:
            self.notes.append(f"the embedding's rows no token touched are updated ahead of its gradient (staging for "
                              f"{rows.capacity} touched rows, {rows.staging_bytes(rows.capacity) / 2**30:.2f} GiB "
                              "pinned)")
        else:
            self.adam.on_device.rows = None
            rows.close()
            self.notes.append(f"the embedding updates whole at the step's end: {refused}")

    def _leave_gpu_updates(self, units: set[int]) -> None:
        """The CPU takes over the updates of `units`: their masters whole again and their planes released."""
        if any(self.storages[u].halves is not None and self.storages[u].halves.planes for u in units):
            self.synchronize()  # planes made by an evaluation before training turn back into whole masters
        for u in units:
            if self.storages[u].halves is not None:
                self.storages[u].halves.release()
                self.storages[u].halves = None
        self.adam.on_device.release_moments(self.storages, units)
        self.adam.on_device.units -= units

    def _reopen_adaptation(self) -> None:
        """A micro-batch larger than the one the adaptation measured: its activations and workspace need the
        memory the grown slots and kept graphs took. Give both back before its forward, and size them again
        after this step, from its own peak (the step recomputes every part, as the first one did; measuring
        that peak resets torch.cuda's peak-memory statistics)."""
        if self.config.slots == "auto":
            self.window.shrink(self.config.initial_slots)
        self.graphs.allow(0.0)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._kept_after_peak = 0  # the next peak includes the kept moments
        self._adapted = False

    def _launch_deferred(self, plan: StepPlan, units: list[int], unmeasured: list[int]) -> None:
        """All gradients summed on the host: clip by the global norm, then update `units` (those that got a
        gradient in this window; AdamW skips the others) in forward order.

        The norm comes with the window's last gradients: a unit's only gradient of the window is measured on the
        device by the copy thread, a sum of several by the optimizer thread as it adds the last; the sums of the
        `unmeasured` units (their last gradient came before the step was known, in manual optimization or a
        skipped backward, or the window's last backward did not reach them) are measured here instead.
        """
        self.wait_drain_s += self.drain()
        holding = self.grads.book.holding
        if plan.norm is not None:
            plan.norm.finish(self.d2h, {u: holding[u] for u in unmeasured})
            if not plan.norm.finite:
                self._warn_nonfinite(plan.norm)
        self.moments.plan(units)
        for u in units:
            self.adam.schedule(u)
            self.adam.put(DeferredUpdate(u, plan, holding.pop(u), self.window.claim(u)))

    def _warn_nonfinite(self, norm: GlobalNorm) -> None:
        names = [self.storages[u].name for u in norm.nonfinite_units()]
        warnings.warn(
            f"Step {self._step}: the global gradient norm is {math.sqrt(norm.host)} (the gradients of {names} are "
            "not finite). As torch's clip_grad_norm_ does, the clipped gradients are 0 (inf norm) or NaN (NaN norm) "
            "in this step's update.", RuntimeWarning, stacklevel=2)

    def drain(self) -> float:
        """Wait for every queued gradient copy and update, leaving the masters as they train (planes where they
        are); returns the seconds waited."""
        waited = self.failure.wait(self.pump.worker.idle, "the gradient copies") if self.pump else 0.0
        return waited + self.adam.drain()

    def synchronize(self) -> None:
        """Wait for every queued copy and update (before reading weights or optimizer state): the fp32 masters
        are then whole and current."""
        self.wait_drain_s += self.drain()
        for step in self._step_tensors:
            step.fill_(float(self._step))
        self._planes_to_masters()
        if self.adam.on_device is not None:
            self.adam.on_device.moments_to_host(self.storages)

    @property
    def _halves(self) -> list[master_halves.MasterHalves]:
        return [s.halves for s in self.storages if s.halves is not None]

    @property
    def _fp32_masters(self) -> bool:
        """Some unit's master is fp32 that trains as planes (`master_halves`): at the first forward after a
        `synchronize`, or the run's first."""
        return any(not h.planes for h in self._halves)

    def _masters_to_planes(self) -> None:
        """Turn the masters of the units the GPU updates into planes, once copies still reading them are done."""
        start = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.adam.on_device.convert(self._halves, planes=True, step=self._step)
        if self.config.master_bits != 32 and not self._masters_rounded:
            self.window.reset()  # slots loaded from the unrounded masters load their weights planes again
            self._masters_rounded = True  # later conversions split rounded masters: nothing changes
        self.planes_s += time.perf_counter() - start

    def _planes_to_masters(self) -> None:
        """The masters whole again: the slots' newest weights written back to their planes first."""
        if not any(h.planes for h in self._halves):
            return
        start = time.perf_counter()
        self.window.write_back(settle=self.failure.error is None)
        self.adam.on_device.convert(self._halves, planes=False)
        self.planes_s += time.perf_counter() - start

    # -------------------------------------------------------------------------------------- state
    def master_changed(self) -> None:
        """The fp32 master weights were overwritten (e.g. load_state_dict): reload every slot."""
        self.synchronize()
        for s in self.storages:
            if s.shadow is not None:
                s.shadow.copy_(s.master)
        self.window.reset()
        self._masters_rounded = False  # the new masters are rounded at their conversion

    def load_optimizer_state(self, state_dict: dict) -> None:
        """Load a torch Adam state_dict into the flat state (keeps torch's own id/group mapping). Its moments may
        be in any `moment_precision`: they are converted to this run's (`moment_state`)."""
        self.synchronize()
        saved = saved_entries(state_dict, self.optimizer)
        self.optimizer.load_state_dict(without_moments(state_dict))
        steps = []
        for s in self.storages:
            load_unit(s, saved, self.moments.codecs)
            for p in s.params:
                state = self.optimizer.state.get(p)
                if not state or s.offsets[id(p)] >= s.trainable_numel:
                    continue
                if s.max_exp_avg_sq is not None and "max_exp_avg_sq" in state:
                    s.view(s.max_exp_avg_sq, p).copy_(state["max_exp_avg_sq"])
                steps.append(int(state["step"]))
        self._step = max(steps, default=0)
        self._bind_optimizer_state()
        if self.adam.on_device is not None:
            self.adam.on_device.moments_to_device(self.storages)

    def stats(self) -> dict[str, object]:
        """Cumulative transfer and overlap figures (bytes moved, in total and by what moved them, loads also per
        unit; thread busy time, exposed waits; the wait for updates also per unit, by name, which says what a
        step boundary waits for, and beside it the optimizer thread's own time per unit, which says how much of
        that wait was the unit's update itself)."""
        updater = self.adam.on_device
        h2d = {"loads": self.window.bytes, "saved_inputs": self.activations.bytes_in,
               "updates": updater.bytes_up if updater else 0}
        d2h = {"gradients": self.pump.bytes if self.pump else 0, "saved_inputs": self.activations.bytes_out,
               "updates": updater.bytes_down if updater else 0, "weights_back": self.window.written_back_bytes}
        return {
            "steps": self._step,
            "h2d_bytes": sum(h2d.values()),
            "d2h_bytes": sum(d2h.values()),
            **{f"h2d_{what}_bytes": n for what, n in h2d.items()},
            **{f"d2h_{what}_bytes": n for what, n in d2h.items()},
            "load_by_unit_bytes": {s.name: n for s, n in zip(self.storages, self.window.load_bytes) if n},
            "update_busy_s": self.adam.worker.busy_s,  # the CPU updates' thread
            "gpu_update_busy_s": self.adam.device_worker.busy_s if self.adam.device_worker else 0.0,
            "copy_busy_s": self.pump.worker.busy_s if self.pump else 0.0,
            "wait_update_s": sum(self.window.waits),
            "wait_update_by_unit_s": {s.name: w for s, w in zip(self.storages, self.window.waits) if w},
            "update_work_by_unit_s": {s.name: w for s, w in zip(self.storages, self.adam.work_s) if w},
            # the optimizer threads' waits for gradient chunks whose copies to the host were queued, per unit
            "wait_landing_by_unit_s": {s.name: w for s, w in zip(self.storages, self.adam.landing_s) if w},
            "wait_grads_s": self.wait_grads_s,
            "wait_drain_s": self.wait_drain_s,
            "planes_s": self.planes_s,
            "kept_graphs": self.graphs.kept,
            # the units whose AdamW runs on the GPU's optimizer thread (the others': the CPU's)
            "gpu_updated_units": [s.name for s in self.storages if updater is not None and s.index in updater.units],
            "steps_rows_ahead": self._rows.steps_ahead if self._rows else 0,  # `touched_rows`
            "rows_staged": self._rows.capacity if self._rows else 0,  # ... the rows its staging holds now
            "block_slots": len(self.window.ring),  # blocks with a GPU slot (grown by the first step's adaptation)
            "disk_read_bytes": self.moments.disk_bytes[0] + self.activations.disk_bytes[0],
            "disk_write_bytes": self.moments.disk_bytes[1] + self.activations.disk_bytes[1],
        }

    def close(self) -> None:
        """Finish queued updates, stop the threads, restore the modules, unpin host memory (the GPU's buffers go
        with the engine)."""
        self.failure.finish(self.synchronize)  # bounded after Ctrl-C; skipped after a worker failed
        self._stop_threads()
        self._quiesce()
        with suppress(RuntimeError):  # a CUDA error that failed the run fails this too: the failure is reported
            self._planes_to_masters()
        self._release()

    def _stop_threads(self) -> None:
        """End the copy and optimizer threads after their queued items (those setup made: `vars`, as in
        `_release`)."""
        made = vars(self)
        if made.get("pump") is not None:
            self.pump.worker.stop()
        if "adam" in made:
            self.adam.stop()

    def _release(self) -> None:
        """Give back what setup took, after the threads have stopped: the updaters' page-locked pages and pools,
        the disk tier's folder, the modules' own forwards and kernels, page-locked masters, the GPU window. Also
        after a setup that failed part of the way (`vars`: only what it made)."""
        made = vars(self)
        for name in ("adam", "moments", "activations", "tier"):
            if made.get(name) is not None:
                made[name].close()
        if made.get("pump") is not None:
            self.pump.ring.close()
        for part in made.get("parts", []):
            part.module.__dict__.pop("forward", None)
            if part.own_forward is not None:
                part.module.forward = part.own_forward
        if made.get("_kernels") is not None:
            self._kernels.unpatch()
        if made.get("_no_cache") is not None:
            self._no_cache.remove()
        for s in made.get("storages", []):
            s.release()
        self.window = None  # type: ignore[assignment]

    def _quiesce(self) -> None:
        """Let the GPU finish the copies it was given, which may target host memory that closing unpins next: a
        failure skips the drain, and an exception in a step leaves its loads and saved inputs' copies queued. An
        error raised here is a failure's own, already reported."""
        if self.device.type == "cuda":
            with suppress(RuntimeError):
                torch.cuda.synchronize(self.device)


def _without_cache(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The causal LM's forward pre-hook: `use_cache=False` unless the call says otherwise (generate does)."""
    return args, kwargs if kwargs.get("use_cache") is not None else {**kwargs, "use_cache": False}


def _ownership(specs: list) -> tuple[dict[int, int], list[list[nn.Parameter]]]:
    """Give each parameter to the first unit that uses it (a tied lm_head weight to the embedding)."""
    owner: dict[int, int] = {}
    owned: list[list[nn.Parameter]] = [[] for _ in specs]
    for u, spec in enumerate(specs):
        for module in spec.parts:
            for p in module.parameters():
                if id(p) not in owner:
                    owner[id(p)] = u
                    owned[u].append(p)
    return owner, owned


def _group_index(optimizer: Optimizer, root: nn.Module, precision: str = "fp32") -> dict[int, int]:
    """param id -> index of its optimizer group, for trainable params; checks the optimizer fits the model."""
    validate_optimizer(optimizer, precision)
    in_model = {id(p) for p in root.parameters()}
    group_of: dict[int, int] = {}
    for g, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in in_model:
                raise ValueError("The optimizer holds a parameter that is not part of the model being trained.")
            if id(p) in group_of:
                raise ValueError("A parameter appears in two optimizer param groups.")
            if p.requires_grad:
                group_of[id(p)] = g
    return group_of


def _check_all_parameters_inside(root: nn.Module, model: nn.Module) -> None:
    inside = {id(p) for p in model.parameters()}
    outside = [n for n, p in root.named_parameters() if id(p) not in inside]
    if outside:
        raise UnsupportedModelError(
            f"Parameters outside the causal LM are not supported by slideformer: {outside[:5]}. Keep every "
            "trainable weight inside the transformers model."
        )
