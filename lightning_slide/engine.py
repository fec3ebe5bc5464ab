"""The sliding engine: trains a model larger than the GPU by streaming units through a window of GPU slots.

Each intercepted module call (a *part* of a unit) runs as one autograd node. Its forward loads the unit's
weights into a slot, computes under no-grad and keeps only the part's input. Its backward fetches that
input back, recomputes the part with its weights as fresh leaves, writes the weight gradients into the
slot, and, once every part of a unit is done, hands the unit's gradient to the copy thread and Layer-Adam.
The next forward needs the units in ascending order and the backward finishes them in descending order, so
the lowest blocks (as many as there are gradient buffers: they hold their own) wait for the backward's last
gradient and then go lowest first: the updates the next forward waits for come before those it does not.
Where device memory is spare, a call keeps its graph instead and its backward skips the recompute (`graphs.py`).
The engine imports no Lightning: the strategy (or any plain loop) drives it through `begin_step`,
`end_step`, `synchronize` and the state methods.
"""

from __future__ import annotations

import math
import tempfile
import weakref
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any, Iterator

import torch
from torch import nn
from torch.autograd.function import once_differentiable
from torch.optim import Optimizer
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_slide.activations import ActivationStore, Saved
from lightning_slide.adapters import UnsupportedModelError, causal_lm_units, find_causal_lm
from lightning_slide.available import available_vram
from lightning_slide.config import SlideConfig
from lightning_slide.graphs import GraphBudget, SlotViews
from lightning_slide.layer_adam import DeferredUpdate, LayerAdam, StepPlan, snapshot, validate_optimizer
from lightning_slide.materialize import materialize_
from lightning_slide.moments import Moments, disk_units, unit_file
from lightning_slide.step_mode import StepMode
from lightning_slide.storage import UnitStorage
from lightning_slide.streams import Lane
from lightning_slide.threads import Failure
from lightning_slide.tiers import DiskFile, TierDirectory, direct_io
from lightning_slide.transfer import Dispatch, GradPump, LandingRing
from lightning_slide.window import GradBuffer, Slot, Window


@dataclass(frozen=True)
class Binding:
    """One parameter as a part uses it: where it lives in its owner unit's slot."""

    module: nn.Module
    name: str
    param: nn.Parameter
    owner: int
    offset: int
    trainable: bool

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.offset : self.offset + self.param.numel()].view(self.param.shape)


@dataclass
class Part:
    unit: int
    module: nn.Module
    forward: Any  # the module's own forward, called with slot tensors bound in place of its parameters
    bindings: list[Binding]
    needs_rng: bool
    own_forward: Any = None  # an instance-level forward that was there before ours (e.g. a kernel patch)

    @property
    def owners(self) -> list[int]:
        return sorted({b.owner for b in self.bindings} | {self.unit})

    @property
    def trainable_owners(self) -> list[int]:
        return sorted({b.owner for b in self.bindings if b.trainable})


@contextmanager
def _bound(bindings: list[Binding], tensors: list[torch.Tensor]) -> Iterator[None]:
    """Temporarily let each module see a slot tensor where its parameter is."""
    for b, t in zip(bindings, tensors):
        b.module._parameters[b.name] = t
    try:
        yield
    finally:
        for b in bindings:
            b.module._parameters[b.name] = b.param


class _PartFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, call: "_Call", anchor: torch.Tensor, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.call = call
        outputs = call.forward(inputs)
        ctx.mark_non_differentiable(*(o for o in outputs if not o.is_floating_point()))
        return outputs

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (None, None, *ctx.call.backward(grads))


VRAM_HEADROOM = 0.1  # of the usable GPU memory, kept free when slots="auto" grows the window
_TENSOR = object()  # marks where an output tensor goes when a call's output structure is rebuilt


class _Call:
    """One forward call of a part, remembered until its backward: its input (recomputed then), or, when the
    graph budget admits it, its whole graph (`kept`)."""

    def __init__(self, engine: "SlideEngine", part: Part, args: tuple, kwargs: dict) -> None:
        self.engine, self.part = engine, part
        self.leaves, self.spec = tree_flatten((args, kwargs))
        self.grad_positions = [i for i, x in enumerate(self.leaves) if isinstance(x, torch.Tensor) and x.requires_grad]
        self.elements = sum(x.numel() for x in self.leaves if isinstance(x, torch.Tensor))
        self.saved: list[Saved] = []
        self.kept: int | None = None  # bytes reserved for this call's kept graph; None: recomputed
        self.graph: Any = None
        self.prev: weakref.ref | None = None
        self.out_leaves: list[Any] = []
        self.out_spec = None

    def grad_inputs(self) -> list[torch.Tensor]:
        return [self.leaves[i] for i in self.grad_positions]

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        engine = self.engine
        slots = engine._enter(self.part, +1)
        self.kept = engine.graphs.admit(self.part, self.elements)
        if self.kept is None:  # the backward recomputes: keep only the inputs
            self.saved = [engine.activations.save((engine._tape_position, i), x.detach()) for i, x in enumerate(inputs)]
            self.autocast = _autocast_state(engine.device)
            self.rng = _rng_state(engine.device) if self.part.needs_rng else None
            out = engine._compute(self.part, slots, self.leaves, self.spec, {})
        else:
            out = self.graph = self._record(slots, [x.detach().requires_grad_(True) for x in inputs], keep=True)
        engine._leave(self.part, slots, +1)
        for i in self.grad_positions:  # the saved copy (or the graph) is the only reference the backward needs
            self.leaves[i] = None
        leaves, self.out_spec = tree_flatten(out)
        # Keep no output tensor here: an output holds this node, which holds this call (a leaking cycle).
        self.out_leaves = [_TENSOR if isinstance(x, torch.Tensor) else x for x in leaves]
        return tuple(x.detach() if self.kept is not None else x for x in leaves if isinstance(x, torch.Tensor))

    def _record(self, slots: dict[int, Slot], inputs: list[torch.Tensor], keep: bool = False) -> Any:
        """Run the part with its inputs and trainable weights as fresh leaves, recording its graph.

        A graph kept until the backward saves slot tensors as places (`SlotViews`), so the slots may serve
        other units in between; a recompute's graph is used at once and needs no hooks.
        """
        self.inputs = inputs
        leaves = list(self.leaves)
        for i, x in zip(self.grad_positions, inputs):
            leaves[i] = x
        self.trainable = [b for b in self.part.bindings if b.trainable]
        self.weights = {id(b): b.view(slots[b.owner].params).detach().requires_grad_(True) for b in self.trainable}
        self.views = SlotViews(slots) if keep else None
        with torch.enable_grad(), self.views or nullcontext():
            return self.engine._compute(self.part, slots, leaves, self.spec, self.weights)

    def rebuild(self, tensors: tuple[torch.Tensor, ...]) -> Any:
        it = iter(tensors)
        return tree_unflatten([next(it) if x is _TENSOR else x for x in self.out_leaves], self.out_spec)

    def prefetch(self) -> None:
        for s in self.saved:
            s.prefetch()

    def backward(self, grad_outputs: tuple[torch.Tensor, ...]) -> list[torch.Tensor | None]:
        engine, part = self.engine, self.part
        slots = engine._enter(part, -1)
        self.prefetch()  # own inputs first: saved inputs come back in exactly the reverse order of saving
        prev = self.prev() if self.prev is not None else None
        if prev is not None:
            prev.prefetch()
        if self.kept is None:
            inputs = [s.get().detach().requires_grad_(True) for s in self.saved]
            engine._inputs_back(part.unit, self.saved)
            before = engine.allocated()
            with _restored(self.autocast, self.rng, engine.device):
                out = self._record(slots, inputs)
            engine.graphs.measured(part, engine.allocated() - before, self.elements)
        else:
            out, self.graph = self.graph, None
            self.views.slots = slots  # the units' weights are where they are now
            engine.graphs.release(self.kept)
        pairs = [
            (o, g)
            for o, g in zip((x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)), grad_outputs)
            if g is not None and o.requires_grad
        ]
        grads = torch.autograd.grad(
            [o for o, _ in pairs], [*self.inputs, *self.weights.values()], [g for _, g in pairs], allow_unused=True
        )
        engine._store_grads(part, self.trainable, grads[len(self.inputs) :])
        engine._leave(part, slots, -1)
        self.saved, self.leaves, self.inputs, self.trainable, self.weights, self.views = [], [], [], [], {}, None
        return list(grads[: len(self.grad_positions)])


def _autocast_state(device: torch.device) -> tuple[bool, torch.dtype]:
    return torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type)


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


@contextmanager
def _restored(autocast: tuple[bool, torch.dtype], rng: tuple | None, device: torch.device) -> Iterator[None]:
    """Recompute under the autocast and RNG state of the original forward (dropout masks must match)."""
    with ExitStack() as stack:
        stack.enter_context(torch.autocast(device.type, dtype=autocast[1], enabled=autocast[0]))
        if rng is not None:
            stack.enter_context(torch.random.fork_rng(devices=[device] if device.type == "cuda" else []))
            torch.set_rng_state(rng[0])
            if rng[1] is not None:
                torch.cuda.set_rng_state(rng[1], device)
        yield


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
        self.mode, self.clip_norm, self._clip_once = mode, mode.clip_norm, None
        self.deferred = mode.deferred
        self.needs_acc = mode.holds_grads
        self.model = find_causal_lm(root)
        _check_all_parameters_inside(root, self.model)
        self._optimized = [p for g in optimizer.param_groups for p in g["params"]] if optimizer is not None else []
        self._trains = [p.requires_grad for p in self._optimized]
        self._prepare_model()
        specs = causal_lm_units(self.model)
        group_of = _group_index(optimizer, root) if optimizer is not None else {}
        owner, owned = _ownership(specs)
        training = optimizer is not None
        self.tier = TierDirectory(config.nvme_path or tempfile.gettempdir()) if config.offload == "nvme" else None
        files = self._disk_files(specs, owned, group_of) if self.tier and training else {}
        self.storages = [UnitStorage(i, spec.name, owned[i], group_of, files.get(i) if config.nvme_master else None)
                         for i, spec in enumerate(specs)]
        materialize_(self.model, [spec.parts for spec in specs], set().union(*(s.placeholders for s in self.storages)),
                     device)
        self.parts = [self._part(u, m, owner, group_of) for u, spec in enumerate(specs) for m in spec.parts]
        self._add_host_state(optimizer)
        self._move_buffers(root)
        self.compute = Lane(device, side=False)
        self.h2d, self.d2h = Lane(device, side=True), Lane(device, side=True)
        chunk = min(config.chunk_elems, max(s.trainable_numel for s in self.storages))
        self.moments = Moments(self.storages, files, chunk, self.failure)
        self.adam = LayerAdam(self.storages, self.moments, self.failure)
        self.window = Window(self.storages, [s.dedicated for s in specs], config.initial_slots, dtype, device,
                             self.h2d, self.adam, training, config.chunk_elems, config.block_grad_buffers)
        pin = device.type == "cuda"
        widen_on = device if device.type == "cuda" and dtype != torch.float32 else None
        self.pump = GradPump(LandingRing(config.grad_buffers, chunk, pin, self.failure), self.d2h, self.adam,
                             self.failure, widen_on) if training else None
        direct = self.tier is not None and direct_io(config.gds, device)
        self.activations = ActivationStore(config.activations, device, self.compute, self.h2d, self.d2h, len(self.parts),
                                          self.tier, self.failure, direct)
        self.activations.before_reuse = self._reclaim
        self._anchor = torch.empty(0, device=device, requires_grad=True)
        self._pending = [0] * len(self.storages)
        ring_units = [u for u, s in enumerate(self.storages) if s.trainable_numel and u not in self.window.dedicated]
        self._held_back = set(ring_units[: len(self.window.grad_ring)])
        self._held: list[Dispatch] = []
        self._update_order = [u for u in reversed(range(len(self.storages))) if u not in self._held_back]
        self._update_order += sorted(self._held_back)
        self._written: set[int] = set()
        self._receiving: dict[int, GradBuffer] = {}
        self._holding: dict[int, torch.Tensor] = {}  # unit -> where its gradient waits for this step's update
        self._spare: dict[int, torch.Tensor] = {}  # unit -> a host buffer its backward freed (`_gradient_home`)
        self._lent: dict[int, int] = {}  # data_ptr of a saved-input buffer -> the unit whose gradient it holds
        self._plan: StepPlan | None = None
        self._window_units: set[int] = set()  # units that got a gradient since the last optimizer step
        self._norms_measured = False  # the final sums were measured as they came (they came under a plan)
        self._reads_planned = False  # the disk tier reads ahead for the next updates (kept over a skipped step)
        self._step = 0
        self._adapted = False
        self._adapted_tokens = 0  # the largest micro-batch (tokens) of the step the adaptation measured
        self._step_tokens = 0
        self.adaptation: str | None = None  # what the last adaptation did, for the log
        self.graphs = GraphBudget(config.recompute)
        self._step_tensors: list[torch.Tensor] = []
        self._tape_position = 0
        self._last_call: weakref.ref | None = None
        self.wait_grads_s = 0.0
        self.wait_drain_s = 0.0
        if optimizer is not None:
            self._bind_optimizer_state()
        for part in self.parts:
            part.module.forward = partial(self._forward, part)

    # ----------------------------------------------------------------------------------------- setup
    def _prepare_model(self) -> None:
        """Per-unit recompute replaces HF gradient checkpointing; KV caches have no place in training.

        On CUDA the Triton kernels of `ops` go in first (the fused loss never builds the logits), so that
        the engine wraps the patched modules.
        """
        checkpointing = "is_activation_checkpointing" if hasattr(self.model, "is_activation_checkpointing") else (
            "is_gradient_checkpointing")  # the older name (a deprecation warning where both exist)
        if getattr(self.model, checkpointing, False):
            self.model.gradient_checkpointing_disable()
        if getattr(self.model.config, "use_cache", False):
            self.model.config.use_cache = False
        self._kernels = None
        if self.config.use_kernels and self.device.type == "cuda":
            from lightning_slide import ops  # imports triton: only where kernels run

            self._kernels = ops.patch(self.model, chunk_mib=self.config.loss_chunk_mib)

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

    def _disk_files(self, specs: list, owned: list[list[nn.Parameter]], group_of: dict[int, int]) -> dict[int, DiskFile]:
        """The disk-tier file of each unit whose moments (and, with nvme_master, fp32 master) live on disk."""
        numel = [sum(p.numel() for p in params) for params in owned]
        trainable = [sum(p.numel() for p in params if id(p) in group_of) for params in owned]
        return {u: unit_file(self.tier, u, specs[u].name, numel[u] if self.config.nvme_master else 0, trainable[u])
                for u in disk_units(trainable, self.config.nvme_moments or 0.0)}

    def _add_host_state(self, optimizer: Optimizer | None) -> None:
        """A master on disk is loaded from a pinned copy in the compute dtype (the shadow), refreshed by updates."""
        amsgrad = optimizer is not None and any(g["amsgrad"] for g in optimizer.param_groups)
        for s in self.storages:
            if s.on_disk or (self.config.h2d_source == "shadow" and self.dtype != torch.float32):
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
        """Expose the flat Adam state as torch's own per-parameter state, so state_dict() is standard: each
        parameter has its own step tensor, as in torch's AdamW, which increments them in place after loading."""
        self._step_tensors = []
        for s in self.storages:
            for p in (q for q in s.params if s.offsets[id(q)] < s.trainable_numel):
                self._step_tensors.append(step := torch.tensor(float(self._step)))
                state = {"step": step, "exp_avg": s.view(s.exp_avg, p), "exp_avg_sq": s.view(s.exp_avg_sq, p)}
                if s.max_exp_avg_sq is not None:
                    state["max_exp_avg_sq"] = s.view(s.max_exp_avg_sq, p)
                self.optimizer.state[p] = state

    # ---------------------------------------------------------------------------------- the schedule
    def _forward(self, part: Part, *args: Any, **kwargs: Any) -> Any:
        self.failure.check()
        if kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
            if torch.is_grad_enabled():
                raise ValueError("slideformer trains without a KV cache: call the model with use_cache=False.")
        call = _Call(self, part, args, kwargs)
        if not (torch.is_grad_enabled() and (part.trainable_owners or call.grad_positions)):
            return call.rebuild(call.forward(()))
        call.prev = self._last_call
        outputs = _PartFunction.apply(call, self._anchor, *call.grad_inputs())
        self._last_call = weakref.ref(call)
        self._tape_position += 1
        for u in part.trainable_owners:
            self._pending[u] += 1
        return call.rebuild(outputs)

    def _enter(self, part: Part, direction: int) -> dict[int, Slot]:
        protect = set(part.owners)
        slots = {u: self.window.ensure(u, part.unit, direction, protect) for u in part.owners}
        for slot in slots.values():
            self.compute.wait(slot.loaded)
        return slots

    def _leave(self, part: Part, slots: dict[int, Slot], direction: int) -> None:
        done = self.compute.record()
        for slot in slots.values():
            slot.params_free = done
        ahead = range(part.unit + direction, part.unit + direction * (self.window.lookahead + 1), direction)
        protect = set(part.owners)
        for u in (u for u in ahead if 0 <= u < len(self.storages)):
            protect.add(u)
            if self.adam.ready(u):  # a prefetch never waits for an update (at a step's start): the unit's call will
                self.window.ensure(u, part.unit, direction, protect)

    def _compute(self, part: Part, slots: dict[int, Slot], leaves: list, spec: Any, weights: dict) -> Any:
        tensors = [weights.get(id(b)) if id(b) in weights else b.view(slots[b.owner].params) for b in part.bindings]
        with _bound(part.bindings, tensors):
            args, kwargs = tree_unflatten(leaves, spec)
            return part.forward(*args, **kwargs)

    def _store_grads(self, part: Part, bindings: list[Binding], grads: tuple[torch.Tensor | None, ...]) -> None:
        for u in part.trainable_owners:
            if u not in self._receiving:
                buffer = self._receiving[u] = self.window.grads_for(u)
                self.wait_grads_s += self.failure.wait(buffer.idle.is_set, "a free gradient buffer")
                self.compute.wait(buffer.free)
        for b, g in zip(bindings, grads):
            dst = b.view(self._receiving[b.owner].grads)
            first = id(b.param) not in self._written
            self._written.add(id(b.param))
            if g is None:
                if first:
                    dst.zero_()
            elif first:
                dst.copy_(g)
            else:
                dst.add_(g)
        for u in part.trainable_owners:
            self._pending[u] -= 1
            if self._pending[u] == 0:
                self._dispatch(u)

    def _dispatch(self, unit: int) -> None:
        """A unit's gradient is complete: send it to the optimizer (update now, or accumulate)."""
        if self._plan is None and not self.needs_acc:
            raise RuntimeError("A backward ran outside an optimizer step, but this run keeps no gradient sums: "
                               "gradient accumulation must be known when fit starts (accumulate_grad_batches, or a "
                               "GradientAccumulationScheduler among the Trainer's callbacks).")
        storage = self.storages[unit]
        first = self.needs_acc and unit not in self._window_units
        if self.needs_acc and not first and not self.mode.sums:
            raise RuntimeError(
                f"Unit {storage.name} got a second gradient before its optimizer step, but this fit holds one "
                "gradient per unit and step (no accumulation was announced): set accumulate_grad_batches > 1 "
                "(or a GradientAccumulationScheduler) when fit starts to sum several backwards.")
        sums = None
        if first:
            home, pinned = self._gradient_home(unit)
            self._holding[unit] = home
            sums = home if self._lands_directly(pinned) else None  # else through the landing ring
        if sums is not None:
            # the window's first gradient lands in the sums, which the unit's last update must have read (its
            # forward waited for that update, so this returns at once)
            self.adam.wait_applied(unit)
        update = self._plan is not None and not self.deferred
        if update:
            self.adam.schedule(unit)
        self._window_units.add(unit)
        self._norms_measured = self._plan is not None
        buffer = self._receiving.pop(unit)
        buffer.idle.clear()
        self._written.difference_update(id(p) for p in storage.params)
        dispatch = Dispatch(unit, buffer.grads[: storage.trainable_numel], self.compute.record(), self._plan,
                            self.needs_acc, update, buffer.release, first, sums)
        if unit in self._held_back:
            self._held.append(dispatch)
        else:
            self.pump.put(dispatch)
        if not any(self._pending):  # the backward's last gradient
            self._check_planned_reads()
            self._release_held()

    def _gradient_home(self, unit: int) -> tuple[torch.Tensor, bool]:
        """Where the window's gradient of `unit` waits on the host, and whether that memory is pinned (a copy
        from the GPU goes straight in only then; else it would stall).

        fp32 sums have their own buffer. A step that holds one gradient as it came puts it in the host buffer of
        the unit's saved input that its backward has just freed, where that is large enough (at 64 x 1024 tokens
        a Llama-3.1-8B block's input takes 512 MiB, its bf16 gradient 436 MB): the gradient then costs no memory
        of its own. The next forward saves into that buffer only after the unit's update (`_reclaim`). Other
        units get a buffer of their own at first use.
        """
        storage = self.storages[unit]
        spare = self._spare.pop(unit, None)
        nbytes = storage.trainable_numel * torch.empty(0, dtype=self.dtype).element_size()
        if not self.mode.sums and spare is not None and spare.numel() * spare.element_size() >= nbytes:
            self._lent[spare.data_ptr()] = unit
            return spare.view(-1).view(torch.uint8)[:nbytes].view(self.dtype), spare.is_pinned()
        if storage.grad_acc is None:
            storage.add_grad_accumulator(self.mode.held_dtype(self.dtype))
        return storage.grad_acc, storage.acc_pinned

    def _lands_directly(self, pinned: bool) -> bool:
        """A copy from the GPU goes straight into host memory only where that is pinned (else it would stall)."""
        return pinned or self.device.type != "cuda"

    def _inputs_back(self, unit: int, saved: list[Saved]) -> None:
        """A part's saved inputs are back on the device: the largest host buffer among them may hold the unit's
        gradient (work on the d2h lane after this backward is ordered after the compute that read them)."""
        if self.mode.sums or not self.mode.holds_grads:
            return
        for t in (s.host_tensor for s in saved):
            best = self._spare.get(unit)
            if t is not None and (best is None or t.numel() * t.element_size() > best.numel() * best.element_size()):
                self._spare[unit] = t

    def _reclaim(self, buffer: torch.Tensor) -> None:
        """A forward is about to save an input into `buffer`: if a unit's gradient waits there, its update first."""
        unit = self._lent.pop(buffer.data_ptr(), None)
        if unit is not None:
            self.wait_grads_s += self.adam.wait_applied(unit)

    def _check_planned_reads(self) -> None:
        """Updates during the backward read their disk state in an order planned when the step began (reads run
        ahead of the backward): a unit on disk that got no gradient would leave its planned reads untaken."""
        if self.deferred or self._plan is None:
            return
        idle = [self.storages[u].name for u in self.moments.on_disk if u not in self._window_units]
        if idle:
            raise RuntimeError(
                f"With Adam state on disk every trainable unit needs a gradient in each step, but {idle} got none "
                "(is the model fed inputs_embeds made outside it?). Clip gradients or accumulate (updates then "
                "follow the backward and skip such units), or keep the state in RAM (offload='cpu').")

    def _release_held(self) -> None:
        """Hand the held-back gradients over, lowest unit first (the order the next forward loads them)."""
        for dispatch in sorted(self._held, key=lambda d: d.unit):
            self.pump.put(dispatch)
        self._held.clear()

    # ------------------------------------------------------------------------------ the step protocol
    def new_micro_batch(self, tokens: int | None = None) -> None:
        """Forget a graph that was never backpropagated (its parts will not report back). `tokens`, when the
        caller knows them: a micro-batch larger than the one the window was sized for sizes it again."""
        self._abandon_graph()
        self._tape_position = 0
        self._last_call = None
        self._spare.clear()
        self.activations.new_micro_batch()
        self.graphs.new_micro_batch()
        if tokens is not None:
            if self._adapted and tokens > self._adapted_tokens:
                self._reopen_adaptation()
            self._step_tokens = max(self._step_tokens, tokens)

    def _abandon_graph(self) -> None:
        """Forget a forward that no backward will follow: its parts will not report back."""
        if any(self._pending):
            self._pending = [0] * len(self.storages)
            self._written.clear()
            self._receiving.clear()
            self._release_held()  # complete gradients, as the units the abandoned backward did dispatch

    def clip_next(self, max_norm: float) -> None:
        """Clip the next step's gradients to this global norm (manual optimization's `clip_gradients`, which
        comes after the backward and before the step it is for; manual optimization always defers updates)."""
        self._clip_once = max_norm

    def begin_step(self) -> None:
        """The next backward ends an accumulation window: freeze this step's hyperparameters now."""
        self.failure.check()
        self._check_trainable()
        clip, self._clip_once = self._clip_once or self.clip_norm, None
        self._plan = snapshot(self.optimizer, self._step + 1, clip)
        if not self.deferred and not self._reads_planned:  # the order this step's backward hands units over
            self.moments.plan(self._update_order)
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
        plan, self._plan = self._plan, None
        if not backward_ran:
            self._abandon_graph()
        if any(self._pending):
            missing = [self.storages[u].name for u, n in enumerate(self._pending) if n]
            raise RuntimeError(f"The backward did not reach units {missing}: their parameters got no gradient.")
        if not self._window_units:
            return
        measured, self._norms_measured = self._norms_measured, False
        units, self._window_units, self._reads_planned = sorted(self._window_units), set(), False
        self._step += 1
        if self.deferred:
            self._launch_deferred(plan, units, norm_of_sums=not measured)
        self._holding.clear()  # eager accumulation: the updates read the sums themselves
        if "auto" in (self.config.slots, self.config.recompute) and not self._adapted:  # first step at this size
            self._adapted, self._adapted_tokens = True, self._step_tokens
            self._adapt()
        self._step_tokens = 0

    def allocated(self) -> int:
        """Device memory held by tensors now (a host-side counter: no synchronisation); 0 off CUDA."""
        return torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0

    def _adapt(self) -> None:
        """The first step showed this batch's peak memory: spend what is spare on block slots, then kept graphs.

        More resident blocks mean fewer loads: a block that stays in its slot from its forward to its
        backward is read from host memory once per step instead of twice. A kept graph saves a part's
        recompute (a quarter of its compute). On the CPU the slots grow to every block and graphs are not
        kept (there is no device memory to spend).
        """
        grow = self.window.blocks - len(self.window.ring) if self.config.slots == "auto" else 0
        if self.device.type == "cuda":
            limit = available_vram(self.device) + self.allocated()
            spare = limit * (1 - VRAM_HEADROOM) - torch.cuda.max_memory_allocated(self.device)
            grow = max(0, min(grow, int(spare // max(self.window.slot_bytes, 1))))
            self.graphs.allow(spare - grow * self.window.slot_bytes)
        self.window.grow(grow)
        graphs = ("every part keeps its graph" if math.isinf(self.graphs.limit)
                  else f"{self.graphs.limit / 2**30:.2f} GiB for kept graphs (recompute={self.config.recompute!r})")
        size = f"micro-batches of up to {self._adapted_tokens} tokens: " if self._adapted_tokens else ""
        self.adaptation = (f"{size}{len(self.window.ring)} of {self.window.blocks} blocks have a GPU slot "
                           f"({grow} added, {grow * self.window.slot_bytes / 2**30:.2f} GiB); {graphs}")

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
        self._adapted = False

    def _launch_deferred(self, plan: StepPlan, units: list[int], norm_of_sums: bool = False) -> None:
        """All gradients summed on the host: clip by the global norm, then update `units` (those that got a
        gradient in this window; AdamW skips the others) in forward order.

        The norm comes with the window's last gradients: a unit's only gradient of the window is measured on the
        device by the copy thread, a sum of several by the optimizer thread as it adds the last; when they came
        before the step was known (manual optimization) or that backward was skipped, `norm_of_sums` measures the
        sums here instead.
        """
        self.wait_drain_s += self._drain()
        if plan.clip_norm is not None:
            plan.sq_norm += self.pump.sq_norm_on_device(plan)
            if norm_of_sums:
                for u in units:
                    plan.add_sq_norm(self._holding[u])
            coef = plan.clip_norm / (math.sqrt(plan.sq_norm) + 1e-6)
            if coef < 1.0:
                plan.grad_scale = torch.tensor(1.0 / coef)
        self.moments.plan(units)
        for u in units:
            self.adam.schedule(u)
            self.adam.put(DeferredUpdate(u, plan, self._holding.pop(u)))

    def _drain(self) -> float:
        waited = self.failure.wait(self.pump.worker.idle, "the gradient copies") if self.pump else 0.0
        return waited + self.adam.drain()

    def synchronize(self) -> None:
        """Wait for every queued copy and update (before reading weights or optimizer state)."""
        self.wait_drain_s += self._drain()
        self._lent.clear()  # every update has read its gradient
        for step in self._step_tensors:
            step.fill_(float(self._step))

    # -------------------------------------------------------------------------------------- state
    def master_changed(self) -> None:
        """The fp32 master weights were overwritten (e.g. load_state_dict): reload every slot."""
        self.synchronize()
        for s in self.storages:
            if s.shadow is not None:
                s.shadow.copy_(s.master)
        self.window.reset()

    def load_optimizer_state(self, state_dict: dict) -> None:
        """Load a torch Adam state_dict into the flat state (keeps torch's own id/group mapping)."""
        self.synchronize()
        self.optimizer.load_state_dict(state_dict)
        steps = []
        for s in self.storages:
            for p in s.params:
                state = self.optimizer.state.get(p)
                if not state or s.offsets[id(p)] >= s.trainable_numel:
                    continue
                for key, flat in (("exp_avg", s.exp_avg), ("exp_avg_sq", s.exp_avg_sq), ("max_exp_avg_sq", s.max_exp_avg_sq)):
                    if flat is not None and key in state:
                        s.view(flat, p).copy_(state[key])
                steps.append(int(state["step"]))
        self._step = max(steps, default=0)
        self._bind_optimizer_state()

    def stats(self) -> dict[str, object]:
        """Cumulative transfer and overlap figures (bytes moved, thread busy time, exposed waits; the wait for
        updates also per unit, by name, which says what a step boundary waits for, and beside it the optimizer
        thread's own time per unit, which says how much of that wait was the unit's update itself)."""
        return {
            "steps": self._step,
            "h2d_bytes": self.window.bytes + self.activations.bytes_in,
            "d2h_bytes": (self.pump.bytes if self.pump else 0) + self.activations.bytes_out,
            "update_busy_s": self.adam.worker.busy_s,
            "copy_busy_s": self.pump.worker.busy_s if self.pump else 0.0,
            "wait_update_s": sum(self.window.waits),
            "wait_update_by_unit_s": {s.name: w for s, w in zip(self.storages, self.window.waits) if w},
            "update_work_by_unit_s": {s.name: w for s, w in zip(self.storages, self.adam.work_s) if w},
            "wait_grads_s": self.wait_grads_s,
            "wait_drain_s": self.wait_drain_s,
            "kept_graphs": self.graphs.kept,
            "disk_read_bytes": self.moments.disk_bytes[0] + self.activations.disk_bytes[0],
            "disk_write_bytes": self.moments.disk_bytes[1] + self.activations.disk_bytes[1],
        }

    def close(self) -> None:
        """Finish queued updates, stop the threads, restore the modules, unpin host memory, drop GPU slots."""
        self.failure.finish(self.synchronize)  # bounded after Ctrl-C; skipped after a worker failed
        for worker in (self.pump.worker if self.pump else None, self.adam.worker):
            if worker is not None:
                worker.stop()
        self.moments.close()
        self.activations.close()
        if self.tier is not None:
            self.tier.close()
        for part in self.parts:
            part.module.__dict__.pop("forward", None)
            if part.own_forward is not None:
                part.module.forward = part.own_forward
        if self._kernels is not None:
            self._kernels.unpatch()
        for s in self.storages:
            s.release()
        self.window = None  # type: ignore[assignment]


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


def _group_index(optimizer: Optimizer, root: nn.Module) -> dict[int, int]:
    """param id -> index of its optimizer group, for trainable params; checks the optimizer fits the model."""
    validate_optimizer(optimizer)
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
