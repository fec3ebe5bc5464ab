"""The autograd node of one intercepted module call (a *part* of a unit).

A part's forward loads its units' weights into slots, computes under no-grad and keeps only its input (or,
where the graph budget admits it, its whole graph). Its backward fetches that input back, recomputes the part
with its weights as fresh leaves and hands the weight gradients over. The call speaks to the engine only
through `PartHost`: enter and leave a part, compute it, save an input, store gradients, and the graph budget.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.autograd.function import once_differentiable
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_slide.activations import Saved
from lightning_slide.graphs import GraphBudget, SlotViews
from lightning_slide.window import Slot


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


class PartHost(Protocol):
    """What a part's call needs of the engine."""

    device: torch.device
    graphs: GraphBudget

    def enter(self, part: Part, direction: int) -> dict[int, Slot]: ...

    def leave(self, part: Part, slots: dict[int, Slot], direction: int) -> None: ...

    def compute_part(self, part: Part, slots: dict[int, Slot], leaves: list, spec: Any, weights: dict) -> Any: ...

    def save_input(self, index: int, value: torch.Tensor) -> Saved: ...

    def inputs_back(self, unit: int, saved: list[Saved]) -> None: ...

    def store_grads(self, part: Part, bindings: list[Binding], grads: tuple[torch.Tensor | None, ...]) -> None: ...

    def allocated(self) -> int: ...


@contextmanager
def bound(bindings: list[Binding], tensors: list[torch.Tensor]) -> Iterator[None]:
    """Temporarily let each module see a slot tensor where its parameter is."""
    for b, t in zip(bindings, tensors):
        b.module._parameters[b.name] = t
    try:
        yield
    finally:
        for b in bindings:
            b.module._parameters[b.name] = b.param


def run_part(part: Part, slots: dict[int, Slot], leaves: list, spec: Any, weights: dict) -> Any:
    """Call the part's module with each parameter bound to its slot view (or to a fresh leaf in `weights`)."""
    tensors = [weights.get(id(b)) if id(b) in weights else b.view(slots[b.owner].params) for b in part.bindings]
    with bound(part.bindings, tensors):
        args, kwargs = tree_unflatten(leaves, spec)
        return part.forward(*args, **kwargs)


class PartFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, call: Call, anchor: torch.Tensor, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.call = call
        outputs = call.forward(inputs)
        ctx.mark_non_differentiable(*(o for o in outputs if not o.is_floating_point()))
        return outputs

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (None, None, *ctx.call.backward(grads))


_TENSOR = object()  # marks where an output tensor goes when a call's output structure is rebuilt


class Call:
    """One forward call of a part, remembered until its backward: its input (recomputed then), or, when the
    graph budget admits it, its whole graph (`graph_bytes` reserved for it)."""

    def __init__(self, host: PartHost, part: Part, args: tuple, kwargs: dict) -> None:
        self.host, self.part = host, part
        self.leaves, self.spec = tree_flatten((args, kwargs))
        self.grad_positions = [i for i, x in enumerate(self.leaves) if isinstance(x, torch.Tensor) and x.requires_grad]
        self.elements = sum(x.numel() for x in self.leaves if isinstance(x, torch.Tensor))
        self.saved: list[Saved] = []
        self.graph_bytes: int | None = None  # bytes reserved for this call's kept graph; None: recomputed
        self.graph: Any = None
        self.prev: weakref.ref | None = None
        self.out_leaves: list[Any] = []
        self.out_spec = None

    @property
    def keeps_graph(self) -> bool:
        return self.graph_bytes is not None

    def grad_inputs(self) -> list[torch.Tensor]:
        return [self.leaves[i] for i in self.grad_positions]

    def forward(self, inputs: tuple[torch.Tensor, ...], backward: bool = True) -> tuple[torch.Tensor, ...]:
        """Compute the call; for its `backward` (a call with no gradient to give needs none) keep its inputs, which
        the backward recomputes from, or its graph where the budget admits one."""
        host = self.host
        slots = host.enter(self.part, +1)
        self.graph_bytes = host.graphs.admit(self.part, self.elements) if backward else None
        if not backward:
            out = host.compute_part(self.part, slots, self.leaves, self.spec, {})
        elif not self.keeps_graph:  # the backward recomputes: keep only the inputs
            self.saved = [host.save_input(i, x.detach()) for i, x in enumerate(inputs)]
            self.autocast = _autocast_state(host.device)
            self.rng = _rng_state(host.device) if self.part.needs_rng else None
            out = host.compute_part(self.part, slots, self.leaves, self.spec, {})
        else:
            out = self.graph = self._record(slots, [x.detach().requires_grad_(True) for x in inputs], keep=True)
        host.leave(self.part, slots, +1)
        for i in self.grad_positions:  # the saved copy (or the graph) is the only reference the backward needs
            self.leaves[i] = None
        leaves, self.out_spec = tree_flatten(out)
        # Keep no output tensor here: an output holds this node, which holds this call (a leaking cycle).
        self.out_leaves = [_TENSOR if isinstance(x, torch.Tensor) else x for x in leaves]
        return tuple(x.detach() if self.keeps_graph else x for x in leaves if isinstance(x, torch.Tensor))

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
            return self.host.compute_part(self.part, slots, leaves, self.spec, self.weights)

    def rebuild(self, tensors: tuple[torch.Tensor, ...]) -> Any:
        it = iter(tensors)
        return tree_unflatten([next(it) if x is _TENSOR else x for x in self.out_leaves], self.out_spec)

    def prefetch(self) -> None:
        for s in self.saved:
            s.prefetch()

    @property
    def prefetches_late(self) -> bool:
        """Whether this call's saved inputs come back after the next-later call's backward (`Saved.late`)."""
        return any(s.late for s in self.saved)

    def backward(self, grad_outputs: tuple[torch.Tensor, ...]) -> list[torch.Tensor | None]:
        host, part = self.host, self.part
        slots = host.enter(part, -1)
        self.prefetch()  # own inputs first: saved inputs come back in exactly the reverse order of saving
        prev = self.prev() if self.prev is not None else None
        early = prev is not None and not prev.prefetches_late
        if early:
            prev.prefetch()
        out = self._graph_again(slots)
        pairs = [
            (o, g)
            for o, g in zip((x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)), grad_outputs)
            if g is not None and o.requires_grad
        ]
        grads = torch.autograd.grad(
            [o for o, _ in pairs], [*self.inputs, *self.weights.values()], [g for _, g in pairs], allow_unused=True
        )
        host.leave(part, slots, -1)  # the next units' loads go before the gradients, which may wait for a buffer
        host.store_grads(part, self.trainable, grads[len(self.inputs) :])
        if prev is not None and not early:
            prev.prefetch()
        self.saved, self.leaves, self.inputs, self.trainable, self.weights, self.views = [], [], [], [], {}, None
        return list(grads[: len(self.grad_positions)])

    def _graph_again(self, slots: dict[int, Slot]) -> Any:
        """The forward's graph for the backward: recomputed from the saved inputs, or the kept one."""
        host, part = self.host, self.part
        if not self.keeps_graph:
            inputs = [s.get().detach().requires_grad_(True) for s in self.saved]
            host.inputs_back(part.unit, self.saved)
            before = host.allocated()
            with _restored(self.autocast, self.rng, host.device):
                out = self._record(slots, inputs)
            host.graphs.measured(part, host.allocated() - before, self.elements)
            return out
        out, self.graph = self.graph, None
        self.views.slots = slots  # the units' weights are where they are now
        host.graphs.release(self.graph_bytes)
        return out


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
