"""Kept graphs: parts whose backward reuses their forward's autograd graph instead of recomputing it.

Recomputing a part costs one more forward of it in the backward (a quarter of its compute); keeping its graph
costs device memory for its intermediate tensors until its backward. What a graph may not keep is its
weights: they live in a window slot that other units may use between the part's forward and backward. So a
kept graph saves every tensor that lives in a slot as its place there (`SlotViews`) and reads it back from
whichever slot holds the unit when the backward runs. `GraphBudget` decides which calls keep their graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

Recompute = Literal["auto", "always", "never"]
KERNEL_BLOCK_FACTOR = 0.75  # a block's recompute workspace with the Triton kernels, relative to HF's modules


def block_graph_per_token(hidden: int, q: int, kv: int, intermediate: int, compute_bytes: int, kernels: bool,
                          mlp_tiled: bool = False) -> int:
    """Bytes per token a Llama-style decoder block's forward keeps for its backward (its graph, kept or recomputed).

    Per token: its RMSNorm outputs and fp32 intermediates, q/k/v (`q`, `kv` wide) and their rotary copies, the
    SDPA output (flash/efficient kernels: no seq x seq scores), the SwiGLU gate, up, activation and product, and
    its residuals; the coefficients match the peak measured for HF's LlamaDecoderLayer forward + backward on the
    CPU (fp32 and bf16, within 3%). With the Triton kernels of `ops` (CUDA) a block keeps less:
    KERNEL_BLOCK_FACTOR of that, measured on the H200 (peak allocated of Llama-3.1-8B under a 24 GiB cap at 8 and
    64 x 1024 tokens: 191 KB per token against the formula's 254 KB; the same factor then predicts 3B at
    8 x 1024 and 1B at 32 x 1024 within 2-4%, over). With the MLP tiled (`ops.tiled_mlp`) the MLP keeps only its
    input, so the SwiGLU terms go (`block_workspace_bytes` adds the tile's buffers instead).
    """
    mlp = 0 if mlp_tiled else 4 * intermediate
    per_token = (7 * hidden + 3 * q + 4 * kv + mlp) * compute_bytes + 3 * hidden * 4
    return int(per_token * KERNEL_BLOCK_FACTOR) if kernels else per_token


def block_workspace_bytes(tokens: int, hidden: int, q: int, kv: int, intermediate: int, compute_bytes: int,
                          kernels: bool, mlp_tile_bytes: int | None = None) -> int:
    """Transient bytes of recomputing one decoder block in its backward, besides its weight gradients: its graph
    for `tokens` tokens and, with the MLP tiled, the buffers of one tile (`mlp_tile_bytes`,
    `ops.tiled_mlp.tile_bytes`), whatever the number of tokens."""
    tiled = mlp_tile_bytes is not None
    graph = tokens * block_graph_per_token(hidden, q, kv, intermediate, compute_bytes, kernels, tiled)
    return graph + (mlp_tile_bytes or 0)


def head_workspace(tokens: int, hidden: int, vocab: int, compute_bytes: int, loss_chunk_bytes: int | None) -> int:
    """Transient bytes of the loss head's recompute and backward: the fused loss (`loss_chunk_bytes`, one logits
    chunk) or full logits (compute dtype, then fp32 log-softmax and gradient), a vocabulary-sized weight
    gradient, and its input and output hidden states."""
    logits = loss_chunk_bytes if loss_chunk_bytes is not None else tokens * vocab * (2 * compute_bytes + 8)
    return logits + vocab * hidden * compute_bytes + 2 * tokens * hidden * compute_bytes


@dataclass(frozen=True)
class _InSlot:
    owner: int
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


class SlotViews:
    """Saved-tensor hooks of one part call: slot tensors are saved as places, everything else as itself.

    `slots` (unit -> object with `.params`, the slot's flat tensor) is what pack matches against; before the
    backward unpacks, the engine points it at the slots that hold the units then.
    """

    def __init__(self, slots: dict[int, Any]) -> None:
        self.slots = slots

    def _pack(self, tensor: torch.Tensor) -> Any:
        where = tensor.untyped_storage().data_ptr()
        for owner, slot in self.slots.items():
            if slot.params.untyped_storage().data_ptr() == where:
                return _InSlot(owner, tensor.size(), tensor.stride(), tensor.storage_offset())
        return tensor

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _InSlot):
            return self.slots[packed.owner].params.as_strided(packed.size, packed.stride, packed.offset)
        return packed

    def __enter__(self) -> SlotViews:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


class GraphBudget:
    """Which part calls keep their graph: "never" recompute (all keep), "always" (none), or "auto".

    With "auto", nothing is kept until `allow` grants device memory (the engine does after the first step,
    from what that step left spare); then calls keep their graph in forward order while the graphs fit, each
    estimated from its part's graph as measured at that part's first recompute, scaled by the size of the
    call's inputs (a longer sequence keeps a proportionally larger graph). The measure is the device memory
    the recompute left allocated (everything its graph holds, also what autograd Functions keep on `ctx`).
    """

    def __init__(self, mode: Recompute) -> None:
        self.mode = mode
        self.limit = math.inf if mode == "never" else 0.0
        self.used = 0
        self.kept = 0  # calls that kept their graph, since the start
        self._graph: dict[int, tuple[int, int]] = {}  # id(part) -> (graph bytes, input elements) when measured

    def admit(self, part: object, elements: int) -> int | None:
        """Reserve room for a call's graph (`elements`: of its tensor arguments): its estimated bytes, or None
        when it must recompute."""
        if self.mode == "never":
            self.kept += 1
            return 0
        measured = self._graph.get(id(part))
        if measured is None or self.limit <= 0:
            return None
        estimate = math.ceil(measured[0] * elements / max(measured[1], 1))
        if self.used + estimate > self.limit:
            return None
        self.used += estimate
        self.kept += 1
        return estimate

    def release(self, estimate: int) -> None:
        self.used -= estimate

    def measured(self, part: object, graph_bytes: int, elements: int) -> None:
        """The first measure of a part's graph is the one estimates scale from."""
        self._graph.setdefault(id(part), (graph_bytes, elements))

    def allow(self, nbytes: float) -> None:
        """Grant "auto" this much device memory for kept graphs."""
        if self.mode == "auto":
            self.limit = max(0.0, nbytes)

    def new_micro_batch(self) -> None:
        """Graphs of a forward that was never backpropagated are gone with its outputs."""
        self.used = 0
