"""Compact moments updated on the GPU: a chunk's fp32 master and compact moments go up, the update runs there,
and both come back; a gradient that is still on the GPU (an eager step's) never leaves it.

Why: on the CPU an 8-bit element costs some twenty torch ops (decode, fused AdamW, encode), which ran at 1.22 G
elements/s on the H200 machine's 16 cores against fp32's 4.72 in one fused call, so 8-bit moments made an 8B step
at 8x1024 take 9.2 s against 2.8. On the GPU the same ops are a few memory-bound kernels per chunk; what is left
for the host is the copies, 6 bytes per parameter each way with 8-bit moments (fp32 master, codes, scales), where
the CPU update read and wrote about 28 plus the gradient's 4.

The arithmetic is `layer_adam.adam_pieces`, the CPU path's own, on device tensors. Its codec steps are exact
integer and IEEE operations, so given the same inputs they give the same bits on either device; their rounding
draws its noise exactly as the CPU path's pieces do (`noise_for`). The fused AdamW call is torch's CUDA kernel.
Units whose moments are on disk keep the CPU path (their chunks come and go through the disk tier's buffers).

With fp32 moments the same path can take some decoder blocks' updates (`gpu_update_blocks`) off a CPU that bounds
the step: 24 bytes per parameter of PCIe (master and moments, up and back; about 20 with the master as planes)
instead of the CPU update's host-memory traffic and compute. The CPU and the GPU then update at once, on threads
of their own (`LayerAdam`), and "auto" splits the blocks between them so that both finish together
(`balanced_blocks`) at the rates this machine shows when the run starts (`measured_rates`: a fused CPU AdamW,
pinned copies both ways at once, and a bf16 matmul). At the first micro-batch the split is fitted to its size
(`fitted_units`): updates that end within the compute they run beside cost nothing, so large steps give the GPU
fewer blocks, or none, and keep the link for the loads the compute waits for.

Computing in bf16, the units' masters are kept as planes while they train (`master_halves`): a chunk's low halves
and parities go up, the unit's GPU slot (or, without one, its weights plane) gives the rest, and the same come back,
the new weights into the slot; 2 1/8 bytes an element of master each way instead of 4.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from importlib import import_module
from typing import Literal

import torch

from lightning_slide import master_halves
from lightning_slide.layer_adam import StepPlan, adam_pieces, groups_of
from lightning_slide.master_halves import LOW_DTYPES, MasterHalves, parity_bytes
from lightning_slide.moment_codec import (
    BLOCK,
    NOISE_PERIOD,
    MomentCodec,
    Packed,
    noise_position,
    scripted,
    table_bytes,
    work_views,
)
from lightning_slide.pinned import host_empty, pin_, unpin_
from lightning_slide.storage import UnitStorage
from lightning_slide.streams import Lane, host_wait
from lightning_slide.touched_rows import TouchedRows, rows_of

CHUNK_ELEMS = 1 << 23  # elements a buffer set updates at once (8M: 176 MiB a set, 8-bit moments coded by the kernels)
FP32_SETS = 2  # buffer sets, each on its own stream, for fp32 blocks (four slowed the CPU's share: design.md)
COMPACT_SETS = 4  # ... and for compact moments, where the link binds: four chunks in flight (two left it idle)
COMPACT_PRIORITY = -1  # their streams' kernels run ahead of the backward's queued on the compute stream
ANY_POSITION = 1 << 62  # a period no position reaches: the chunk's noise is already laid out
FP32_MOMENT_BYTES = 8  # each way, per element of an fp32 update on the GPU: both moments
CPU_UNIT_LINK_BYTES = 4  # each way, per element of a unit the CPU updates: its fp32 gradient down, a load up
PROBE_ELEMS = 1 << 25  # the rate probes' size: 128 MiB a tensor, past any CPU cache
PROBE_COPIES = 4  # copies each way, to outlast the probe's CPU AdamW
PROBE_MATMUL = 8192  # the matmul probe's square size (bf16): 1.1 TFLOP a product, long past any launch cost
PROBE_WARMUP = 20  # products before the matmul probe times any: 30 ms on an H200
PACE = 2 * FP32_SETS  # chunks of the untouched rows' pass in flight, so that the backward's updates queue behind few


@dataclass
class _Pass:
    """An update queued chunk by chunk (`DeviceUpdater._advance`): what its chunks need, the next one to queue, and
    (where it is paced) the events after those in flight."""

    storage: UnitStorage
    plan: StepPlan
    start: int
    n: int
    grad: torch.Tensor | None  # None: a zero gradient
    ready: object
    free: object  # the event the slot (or the weights plane) is free to write after
    master: torch.Tensor
    moments: tuple[Packed, Packed]
    weights: torch.Tensor | None  # the slot's range, where the new weights go
    halves: MasterHalves | None
    scale: float | None
    groups: tuple[list[list[float]], list[list[bool]], list[int]]
    hidden: int = 1
    kept: torch.Tensor | None = None  # rows whose slot weights stay, and each chunk's bounds among them
    bounds: torch.Tensor | None = None
    next: int = 0
    in_flight: deque = field(default_factory=deque)


@dataclass
class SlotWrite:
    """A unit's GPU weight slot that its update on the GPU also writes the new weights into (in the compute dtype,
    as a load casts them), so that the next step need not load them again. The window hands it out and may take
    the slot back while the update has not started (`drop`); once the updater has taken it (`take`), the window
    waits for the writes instead."""

    params: torch.Tensor  # the slot's view of the unit's trainable range
    free: object  # compute event after the slot's last reader
    _state: str = "pending"  # -> "writing" (the updater took it) or "dropped" (the window took the slot back)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def take(self) -> bool:
        """The updater: write into the slot, unless the window has taken it back."""
        with self._lock:
            if self._state == "pending":
                self._state = "writing"
            return self._state == "writing"

    def drop(self, before: Callable[[], None] | None = None) -> bool:
        """The window: take the slot back, unless the updater writes into it already (then wait for the update).
        `before` runs first where it does take it back (the slot's weights written back to the host for the update
        to read), so that the updater, finding the slot taken back, finds that done."""
        with self._lock:
            if self._state == "pending":
                if before is not None:
                    before()
                self._state = "dropped"
            return self._state == "dropped"


def _planes_of(storage: UnitStorage) -> MasterHalves | None:
    """The unit's master halves where its master is planes now (`master_halves`), else None."""
    return storage.halves if storage.halves is not None and storage.halves.planes else None


def _scale_of(plan: StepPlan) -> float | None:
    """The step's gradient scale (clipping) as a number, read once per update rather than per chunk."""
    return None if plan.grad_scale is None else float(plan.grad_scale)


def gpu_updates_on(device: torch.device) -> torch.device | None:
    """Where a run computing on `device` can update on the GPU: the GPU itself, or nowhere (None)."""
    return device if device.type == "cuda" else None


def master_link_bytes(plane_bits: int | None) -> float:
    """Bytes per element of a master an update on the GPU moves each way: fp32 (`plane_bits` None), or as planes
    (`master_halves`: the low part, 2 bytes or 1 with 24 bits, and the parity bit; a resident unit's weights stay in
    its slot)."""
    return 4.0 if plane_bits is None else LOW_DTYPES[plane_bits].itemsize + 1 / 8


def fp32_link_bytes(plane_bits: int | None) -> float:
    """PCIe bytes per element of an fp32 update on the GPU, up and back: both moments and the master (whole, or as
    planes of `plane_bits`: `master_link_bytes`)."""
    return 2 * (FP32_MOMENT_BYTES + master_link_bytes(plane_bits))


def gpu_updated_units(precision: str, gpu_update_blocks: int | Literal["auto"], dedicated: Sequence[bool],
                      on_disk: Collection[int], trainable: Sequence[int], device: torch.device,
                      plane_bits: int | None = None, amsgrad: bool = False) -> list[int]:
    """The units whose updates run on the GPU `device` (`gpu_updates_on`), none with `amsgrad` (its running maximum
    of exp_avg_sq lives on the host, where the CPU updates it): with compact moments every unit whose
    moments are in RAM; with fp32 ones `gpu_update_blocks` of the decoder blocks in RAM, spread evenly over them
    ("auto": as many as `balanced_blocks` finds at this machine's `measured_rates` for updates that move the
    master whole or as planes of `plane_bits`; none where the rates cannot be measured). Spread, because the
    backward holds only a few gradients at a time: were the GPU's blocks the last the backward reaches, it would
    reach them only after the CPU had taken the others' gradients, one by one. "auto" is an upper bound that the
    first micro-batch may lower (`fitted_units`)."""
    if amsgrad:
        return []
    in_ram = [u for u in range(len(dedicated)) if u not in on_disk]
    if precision != "fp32":
        return in_ram
    blocks = [u for u in in_ram if not dedicated[u] and trainable[u]]
    if gpu_update_blocks != "auto":
        return spread(blocks, min(gpu_update_blocks, len(blocks)))
    rates = measured_rates(device)
    if rates is None:
        return []
    link = fp32_link_bytes(plane_bits)
    first = bool(dedicated) and dedicated[0] and trainable[0] and 0 in in_ram and embedding_first(rates, link)
    return ([0] if first else []) + _balanced(blocks, trainable, rates, link)  # the embedding besides the blocks


def spread(blocks: Sequence[int], k: int) -> list[int]:
    """`k` of `blocks`, evenly spaced over them."""
    return [blocks[int((j + 0.5) * len(blocks) / k)] for j in range(k)]


def fitted_units(units: Collection[int], dedicated: Sequence[bool], trainable: Sequence[int], device: torch.device,
                 link_bytes: float, hidden_s: float) -> list[int]:
    """Of the fp32 `units` "auto" gave the GPU `device`, those to keep once a step is known to hide `hidden_s`
    seconds of updates behind its compute (`hidden_update_s`): the balanced blocks among them again
    (`balanced_blocks` at `measured_rates`), now counting the updates that end by then as free, and the embedding
    wherever it was given (it is about the step's boundary, not the CPU's share). The CPU takes the others, and
    keeps the units outside `units`."""
    rates = measured_rates(device)
    if rates is None:
        return sorted(units)
    blocks = sorted(u for u in units if not dedicated[u])
    return sorted(u for u in units if dedicated[u]) + _balanced(blocks, trainable, rates, link_bytes, hidden_s)


def _balanced(blocks: list[int], trainable: Sequence[int], rates: UpdateRates, link_bytes: float,
              hidden_s: float = 0.0) -> list[int]:
    """Of `blocks`, the `balanced_blocks` the GPU takes, spread over them; the CPU updates every other trainable
    element whatever the split."""
    kept = sum(trainable) - sum(trainable[u] for u in blocks)
    return spread(blocks, balanced_blocks(kept, [trainable[u] for u in blocks], rates, link_bytes, hidden_s))


def hidden_update_s(device: torch.device, block_params: int, tokens: int, deferred: bool, recomputed: bool) -> float:
    """Seconds of compute on `device` that a step's updates run beside, for micro-batches of `tokens` through
    blocks of `block_params` parameters in all: eager updates start as the last micro-batch's backward hands over
    gradients and run beside the rest of it (4 flops per parameter and token, 6 where the blocks are `recomputed`:
    their forward runs again first), deferred ones (clipped steps) beside the next forward, which takes the units
    in the order they are updated (2). At the probe's matmul rate (`measured_rates`), which the model's kernels do
    not reach: the estimate errs short, towards the GPU's share. 0 where the rates cannot be measured."""
    rates = measured_rates(device)
    flops = 2 if deferred else 6 if recomputed else 4
    return 0.0 if rates is None else flops * block_params * tokens / rates.gpu_flops_s


def updates_keep_pace(units: Collection[int], trainable: Sequence[int], device: torch.device, link_bytes: float,
                      hidden_s: float) -> bool:
    """Whether a step's updates, the GPU's `units` and the CPU's the rest, end within the `hidden_s` seconds of
    compute they run beside (`hidden_update_s`) at `measured_rates`: the optimizer threads then keep pace with
    the backward, and nothing is queued ahead of the lowest blocks' gradients when they come. False where the
    rates cannot be measured."""
    rates = measured_rates(device)
    if rates is None:
        return False
    gpu = sum(trainable[u] for u in units)
    return _finish_s(gpu, sum(trainable) - gpu, rates, link_bytes) <= hidden_s


def embedding_first(rates: UpdateRates, link_bytes: float = fp32_link_bytes(None)) -> bool:
    """Whether the embedding's update, the next forward's first need and complete only when the backward ends,
    is ready sooner on the GPU, where the link is otherwise idle by then: its master and moments go up
    (`link_bytes` / 2 per element, `fp32_link_bytes`; the update and the copies back follow chunk by chunk). On the
    CPU its gradient comes down as the update runs, then its new weights go up (`CPU_UNIT_LINK_BYTES` each way)."""
    direction = rates.link_bytes_s / 2
    gpu = link_bytes / 2 / direction
    cpu = max(1 / rates.cpu_elems_s, CPU_UNIT_LINK_BYTES / direction) + CPU_UNIT_LINK_BYTES / direction
    return gpu < cpu


@dataclass(frozen=True)
class UpdateRates:
    """What fp32 updates cost on either side, each measured while the other ran: the CPU's fused AdamW
    (elements/s) and pinned copies to and from the GPU at once (bytes/s, both directions together); and the GPU's
    bf16 matmul rate (flops/s), which sets how long a step's compute hides updates (`hidden_update_s`)."""

    cpu_elems_s: float
    link_bytes_s: float
    gpu_flops_s: float


def balanced_blocks(kept: int, blocks: Sequence[int], rates: UpdateRates,
                    link_bytes: float = fp32_link_bytes(None), hidden_s: float = 0.0) -> int:
    """How many of the decoder `blocks` (their trainable sizes) to update on the GPU so that a step's updates end
    soonest, the CPU's and the link's running at once: the fewest of those that end by `hidden_s`, the compute
    they run beside (`hidden_update_s`), where the split does not matter and the GPU's copies would compete with
    the loads. Each direction of the link carries `link_bytes` / 2 per element the GPU updates (master and moments,
    `fp32_link_bytes`) and `CPU_UNIT_LINK_BYTES` per element the CPU updates (its fp32 gradient down, its new
    weights up on the next load); the CPU updates `kept` elements besides the blocks it keeps. The GPU's kernels
    are not counted: a few memory-bound passes, far below either."""
    def finish(k: int) -> float:
        return max(_finish_s(sum(blocks[:k]), kept + sum(blocks[k:]), rates, link_bytes), hidden_s)
    return min(range(len(blocks) + 1), key=finish)  # the first of equals: the fewest blocks


def _finish_s(gpu: int, cpu: int, rates: UpdateRates, link_bytes: float) -> float:
    """When a step's updates end, `gpu` elements updated on the GPU and `cpu` on the CPU at once: the CPU's update,
    or the link carrying the GPU's master and moments (`link_bytes` / 2 per element each way) and the CPU's
    gradients down and weights up (`CPU_UNIT_LINK_BYTES` each way), whichever takes longer."""
    link = (gpu * link_bytes / 2 + cpu * CPU_UNIT_LINK_BYTES) / (rates.link_bytes_s / 2)
    return max(cpu / rates.cpu_elems_s, link)


def rates_note(device: torch.device) -> str:
    """The `measured_rates` a split is fitted at, for the run's notes: read beside the engine's per-unit update
    times, they show where the step's own rates differ from them."""
    rates = measured_rates(device)
    if rates is None:
        return "no rates measured"
    return (f"measured as the run started: fused CPU AdamW {rates.cpu_elems_s / 1e9:.2f} G elements/s beside copies, "
            f"copies both ways {rates.link_bytes_s / 1e9:.0f} GB/s, bf16 matmul {rates.gpu_flops_s / 1e12:.0f} TFLOP/s")


def measured_rates(device: torch.device) -> UpdateRates | None:
    """This machine's `UpdateRates` for a CUDA `device` (measured once per process and device), None elsewhere."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return _probe_rates(torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index))


@functools.cache
def _probe_rates(device: torch.device) -> UpdateRates:
    """The best of three: `PROBE_COPIES` pinned copies of 4 x `PROBE_ELEMS` bytes each way, and, while they run, one
    fused CPU AdamW over `PROBE_ELEMS` fp32 elements: in a step the two share the host's memory. Then the best of
    three bf16 matmuls of `PROBE_MATMUL` squared."""
    master, grad, exp_avg, exp_avg_sq = (torch.zeros(PROBE_ELEMS) for _ in range(4))
    step = torch.zeros(())
    host = host_empty(2 * 4 * PROBE_ELEMS, torch.uint8).view(2, -1)
    pinned = pin_(host)
    gpu = torch.empty_like(host, device=device)
    up, down = torch.cuda.Stream(device), torch.cuda.Stream(device)
    cpu_s = link_s = float("inf")
    for _ in range(3):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(PROBE_COPIES):
            with torch.cuda.stream(up):
                gpu[0].copy_(host[0], non_blocking=True)
            with torch.cuda.stream(down):
                host[1].copy_(gpu[1], non_blocking=True)
        adam = time.perf_counter()
        torch._fused_adamw_([master], [grad], [exp_avg], [exp_avg_sq], [], [step], lr=1e-3, beta1=0.9, beta2=0.999,
                            weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)
        cpu_s = min(cpu_s, time.perf_counter() - adam)
        torch.cuda.synchronize(device)
        link_s = min(link_s, time.perf_counter() - start)
    if pinned:
        unpin_(host)
    del gpu
    flops_s = _matmul_rate(device)
    torch.cuda.empty_cache()
    return UpdateRates(PROBE_ELEMS / cpu_s, 2 * PROBE_COPIES * host[0].numel() / link_s, flops_s)


def _matmul_rate(device: torch.device) -> float:
    """Flops/s of the best of three bf16 matmuls of `PROBE_MATMUL` squared on `device`, after `PROBE_WARMUP` to
    raise an idle GPU's clocks (a rate measured low would count more compute hiding updates than there is)."""
    a = torch.randn(PROBE_MATMUL, PROBE_MATMUL, device=device, dtype=torch.bfloat16)
    out, best = torch.empty_like(a), float("inf")
    for _ in range(PROBE_WARMUP):
        torch.mm(a, a, out=out)
    for _ in range(3):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        torch.mm(a, a, out=out)
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * PROBE_MATMUL**3 / best


def code_kernels_on(device: torch.device) -> bool:
    """Compact moments on `device` are decoded and encoded by `ops.moment_codes` (CUDA, or the CPU under Triton's
    interpreter), else by the codec's torch ops."""
    try:
        from lightning_slide.ops.moment_codes import applies
    except ImportError:  # no triton
        return False
    return applies(device)


def buffer_sets(precision: str) -> int:
    """How many chunks of a unit the updater has in flight with moments of `precision`."""
    return FP32_SETS if precision == "fp32" else COMPACT_SETS


def chunk_elems(largest_trainable: int, piece: int, plane_bits: int | None = None, row: int | None = None) -> int:
    """A buffer set's elements: a whole number of the CPU path's pieces (so the rounding noise lines up), at most
    CHUNK_ELEMS unless one piece is larger, and no more than the largest unit needs; with the masters as planes
    (`plane_bits`) a multiple of 8, whole parity bytes (a chunk that is one piece covers a unit's trainable range).
    fp32 moments draw no noise: with a `row` (an embedding's hidden size, a multiple of 8) the chunk is whole rows
    instead (`touched_rows`)."""
    if row is not None and row <= min(CHUNK_ELEMS, largest_trainable):
        return min(CHUNK_ELEMS, largest_trainable) // row * row
    pieces = max(1, min(CHUNK_ELEMS, largest_trainable) // piece)
    chunk = min(pieces * piece, -(-largest_trainable // piece) * piece)
    return chunk if plane_bits is None else -(-chunk // 8) * 8


class _Buffers:
    """One chunk's device room: the master, its planes (`master_halves`: weights, low halves, parities), both
    moments' stored values and scales, both decoded to fp32 (and their int32 views), the gradient as it arrives and
    widened to fp32; where the codec's torch ops code the moments (not `code_kernels`), their work rows, and the
    rounding noise and what gathers it (each element's piece start and offset in it, and the table index)."""

    def __init__(self, n: int, codecs: tuple[MomentCodec, MomentCodec], device: torch.device, piece: int,
                 code_kernels: bool, plane_bits: int | None) -> None:
        int8_ops = codecs[0].precision == "int8" and not code_kernels  # the codec's torch ops
        rounding_ops = codecs[0].precision != "fp32" and not code_kernels  # ... and the noise they round with
        self.master = torch.empty(n, device=device)
        planes = 0 if plane_bits is None else n
        self.weights = torch.empty(planes, dtype=torch.bfloat16, device=device)
        self.low = torch.empty(planes, dtype=LOW_DTYPES[plane_bits or 32], device=device)
        self.parity = torch.empty(parity_bytes(planes), dtype=torch.uint8, device=device)
        self.values = [torch.empty(n, dtype=c.dtype, device=device) for c in codecs]
        self.scales = [torch.empty(-(-n // BLOCK), device=device) if codecs[0].precision == "int8" else None
                       for _ in codecs]
        self.out = [torch.empty(n, device=device) for _ in codecs]
        self.out_bits = [o.view(torch.int32) for o in self.out]
        self.work = torch.empty(2, n if int8_ops else 0, dtype=torch.int32, device=device)
        self.work_f, self.work_d = work_views(self.work)
        self.grad = torch.empty(4 * n, dtype=torch.uint8, device=device)  # a host gradient's copy, in its dtype
        self.wide = torch.empty(n, device=device)
        self.noise = torch.empty(2 * n if rounding_ops else 0, dtype=torch.int32, device=device)
        e = torch.arange(n if rounding_ops else 0, dtype=torch.int32, device=device)
        self.offsets = e % piece
        self.first = e - self.offsets
        self.index = torch.empty_like(e)

    @staticmethod
    def bytes_for(n: int, precision: str, code_kernels: bool, plane_bits: int | None) -> int:
        stored = {"int8": 1, "bf16": 2, "fp32": 4}[precision]
        scales = 2 * 4 * -(-n // BLOCK) if precision == "int8" else 0
        work = 2 * 4 * n if precision == "int8" and not code_kernels else 0
        noise = (2 + 3) * 4 * n if precision != "fp32" and not code_kernels else 0
        planes = 0 if plane_bits is None else 2 * n + LOW_DTYPES[plane_bits].itemsize * n + parity_bytes(n)
        return 4 * n + planes + 2 * stored * n + scales + 2 * 4 * n + work + 4 * n + 4 * n + noise


def _planes_up(room: _Buffers, halves: MasterHalves, start: int, n: int, with_weights: bool) -> torch.Tensor:
    """Elements [start, start + n) of a master's planes copied into `room`: the low halves, the weights where the
    slot does not hold them, and the parities (returned)."""
    for at, host_weights, host_low in halves.pieces(start, start + n):
        piece = slice(at - start, at - start + host_low.numel())
        room.low[piece].copy_(host_low, non_blocking=True)
        if with_weights:
            room.weights[piece].copy_(host_weights, non_blocking=True)
    parity = slice(start // 8, start // 8 + parity_bytes(n))
    return room.parity[: parity_bytes(n)].copy_(halves.parity[parity], non_blocking=True)


def _planes_back(room: _Buffers, halves: MasterHalves, start: int, n: int, with_weights: bool) -> None:
    """`_planes_up`'s way back: `room`'s planes of elements [start, start + n) into the host's."""
    for at, host_weights, host_low in halves.pieces(start, start + n):
        piece = slice(at - start, at - start + host_low.numel())
        host_low.copy_(room.low[piece], non_blocking=True)
        if with_weights:
            host_weights.copy_(room.weights[piece], non_blocking=True)
    parity = slice(start // 8, start // 8 + parity_bytes(n))
    halves.parity[parity].copy_(room.parity[: parity_bytes(n)], non_blocking=True)


class DeviceUpdater:
    """Runs the AdamW of the units it serves on `device` (`run`); pins the RAM moments it copies (`serve`)."""

    def __init__(self, device: torch.device, codecs: tuple[MomentCodec, MomentCodec], largest_trainable: int,
                 piece: int, code_kernels: bool | None = None, plane_bits: int | None = None,
                 row: int | None = None) -> None:
        """`code_kernels`: compact moments decoded and encoded by `ops.moment_codes`, and masters split and joined
        by `ops.master_halves` (None: wherever those run), or by torch ops (a pass over the chunk per op).
        `plane_bits`: the units' masters train as planes (`master_halves`) keeping that many of their bits (32, or
        24: the low plane of a byte, rounded stochastically), with room for them in each buffer set. `row`: chunks
        of whole rows of this many elements (fp32 moments; `chunk_elems`), for an embedding's `touched_rows`."""
        self.device, self.codecs, self.piece = device, codecs, piece
        self.chunk = chunk_elems(largest_trainable, piece, plane_bits, row)
        self.rows: TouchedRows | None = None  # the embedding's, where its untouched rows are updated ahead
        compact = codecs[0].precision != "fp32"
        self.code_kernels = compact and (code_kernels_on(device) if code_kernels is None else code_kernels)
        self.kernels = import_module("lightning_slide.ops.moment_codes") if self.code_kernels else None
        # the master's planes split and joined by one Triton pass each where the kernels run, else by torch ops
        self.planes = (import_module("lightning_slide.ops.master_halves")
                       if (code_kernels_on(device) if code_kernels is None else code_kernels) else master_halves)
        self.lanes = [Lane(device, side=True, priority=COMPACT_PRIORITY if compact else 0)
                      for _ in range(buffer_sets(codecs[0].precision))]
        self.sets = [_Buffers(self.chunk, codecs, device, piece, self.code_kernels, plane_bits)
                     for _ in self.lanes]
        self.table = codecs[0].noise.to(device)
        self._pinned: list[torch.Tensor] = []
        self.units: set[int] = set()  # the units whose updates run here (`serve`)
        self.resident: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # unit -> its fp32 moments kept here
        self.bytes_up = self.bytes_down = 0  # state (and held gradients) copied to the device and back
        if device.type == "cuda":  # the buffers' index rows were made on this thread's stream, not the lanes'
            torch.cuda.synchronize(device)

    @staticmethod
    def bytes_for(largest_trainable: int, piece: int, precision: str, code_kernels: bool,
                  plane_bits: int | None = None) -> int:
        """Device bytes of the buffer sets and the rounding noise's table (`code_kernels`: as `code_kernels_on`
        says)."""
        table = table_bytes(precision)  # the host table, copied up whole
        one = _Buffers.bytes_for(chunk_elems(largest_trainable, piece, plane_bits), precision, code_kernels, plane_bits)
        return buffer_sets(precision) * one + table

    def serve(self, storages: list[UnitStorage], units: Collection[int]) -> None:
        """Take the updates of `units` (RAM moments): their moments are page-locked in place, so that their
        copies run asynchronously (CUDA only)."""
        self.units = set(units)
        if self.device.type != "cuda":
            return
        for s in storages:
            if s.trainable_numel and s.index in self.units:
                for packed in (s.exp_avg, s.exp_avg_sq):
                    for t in (packed.values, packed.scales):
                        if t is not None and pin_(t):
                            self._pinned.append(t)

    def keep_moments(self, storage: UnitStorage) -> None:
        """Keep the fp32 moments of `storage` (a unit updated here) in device memory from now on: its updates read
        and write them there, and only its master crosses the link (`moments_to_host` brings the host copy up to
        date)."""
        self.resident[storage.index] = tuple(
            m.values.to(self.device, non_blocking=True, copy=True) for m in (storage.exp_avg, storage.exp_avg_sq))
        self._settle()

    def moments_to_host(self, storages: Sequence[UnitStorage]) -> None:
        """The moments kept in device memory into their host copies (before the state is read); returns once
        they are there."""
        for unit, kept in self.resident.items():
            for host, device in zip((storages[unit].exp_avg, storages[unit].exp_avg_sq), kept):
                host.values.copy_(device, non_blocking=True)
        self._settle()

    def moments_to_device(self, storages: Sequence[UnitStorage]) -> None:
        """The host copies into the moments kept in device memory (after a state was loaded into them)."""
        for unit, kept in self.resident.items():
            for host, device in zip((storages[unit].exp_avg, storages[unit].exp_avg_sq), kept):
                device.copy_(host.values, non_blocking=True)
        self._settle()

    def release_moments(self, storages: Sequence[UnitStorage], units: Collection[int]) -> None:
        """`units` keep their moments on the host again (the CPU takes their updates over)."""
        if not self.resident.keys() & set(units):
            return
        self.moments_to_host(storages)
        for unit in units:
            self.resident.pop(unit, None)

    def _settle(self) -> None:
        """Wait for copies queued on this thread's stream (a state copy between steps: rare, and read next); none
        where no moments are kept here."""
        if self.resident and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def close(self) -> None:
        """Unlock what `serve` locked and the touched rows' staging (after the device has finished with them)."""
        for t in self._pinned:
            unpin_(t)
        self._pinned.clear()
        if self.rows is not None:
            self.rows.close()

    def run(self, storage: UnitStorage, plan: StepPlan, start: int, grad: torch.Tensor, ready: object,
            master: torch.Tensor, moments: tuple[Packed, Packed], slot: SlotWrite | None = None) -> object:
        """Queue AdamW over [start, start + len(grad)) of `storage`'s trainable range: `master` and `moments` are
        that range's host copies (the master's planes instead, where the unit holds them), `grad` is on the device
        (after `ready`) or on the host; the new weights also go into `slot` unless the window took it back.
        Returns the event after which the host copies (and the slot) hold the result and `grad` may be reused; an
        embedding's touched rows (`run_untouched`) reach the host copies only with `put_back`, on this thread."""
        rows = self.rows
        if rows is not None and rows.ahead is not None and rows.ahead[0] == (storage.index, plan.step):
            return self._run_touched(storage, plan, grad, ready, master, moments, slot, rows)
        return self._run(storage, plan, start, grad.numel(), grad, ready, master, moments, slot)

    def run_untouched(self, storage: UnitStorage, plan: StepPlan, after: object, master: torch.Tensor,
                      moments: tuple[Packed, Packed], slot: SlotWrite | None, waiting: Callable[[], bool]) -> bool:
        """The step's update of the embedding whose `rows` were sent (`TouchedRows.send`), ahead of its gradient:
        the touched rows' old state into the staging, then the whole table updated with a zero gradient (after
        the compute event `after`, the forwards that read the slot). The touched rows come out wrong here, and
        right at the boundary (`run`), from the staging. Nothing happens where the staging cannot hold them.

        The backward's own updates go first: the pass queues `PACE` chunks at most and stops where other items
        are `waiting` for this thread. Returns whether it is complete; else `resume_untouched` goes on with it."""
        rows = self.rows
        touched = rows.touched()
        if touched is None or slot is None or not slot.take():
            return True
        halves = _planes_of(storage)
        staged = rows.gather(touched, rows_of(master, halves, tuple(m.values for m in moments), rows.hidden))
        rows.ahead = ((storage.index, plan.step), touched, staged)
        rows.steps_ahead += 1
        rows.underway = self._begin(storage, plan, 0, master.numel(), None, after, master, moments, slot,
                                    touched if halves is not None else None, rows.hidden)
        return self.resume_untouched(waiting)

    def resume_untouched(self, waiting: Callable[[], bool] | None = None) -> bool:
        """Queue more of the untouched rows' pass (all of it without `waiting`); whether it is complete."""
        underway = self.rows.underway if self.rows is not None else None
        if underway is None or self._advance(underway, waiting):
            if self.rows is not None:
                self.rows.underway = None
            return True
        return False

    def _run(self, storage: UnitStorage, plan: StepPlan, start: int, n: int, grad: torch.Tensor,
             ready: object, master: torch.Tensor, moments: tuple[Packed, Packed], slot: SlotWrite | None) -> object:
        """`run` over whole chunks."""
        self._advance(self._begin(storage, plan, start, n, grad, ready, master, moments, slot))
        return self._joined()

    def _begin(self, storage: UnitStorage, plan: StepPlan, start: int, n: int, grad: torch.Tensor | None,
               ready: object, master: torch.Tensor, moments: tuple[Packed, Packed], slot: SlotWrite | None,
               kept: torch.Tensor | None = None, hidden: int = 1) -> _Pass:
        """A pass over [start, start + n) (`grad` None: a zero gradient) whose chunks `_advance` queues. The slot's
        weights of rows `kept` (of `hidden` elements, sorted) stay as they were: a master as planes joins them with
        the staged low plane later."""
        weights = slot.params[start : start + n] if slot is not None and slot.take() else None
        halves = _planes_of(storage)
        if halves is not None:
            self._check_planes(halves, start, storage.name, weights is not None)
        free = slot.free if weights is not None else None if halves is None else halves.written_back
        work = _Pass(storage, plan, start, n, grad, ready, free, master, moments, weights, halves, _scale_of(plan),
                     groups_of(storage, plan), hidden)
        if kept is not None:
            work.bounds = torch.searchsorted(kept, torch.arange(0, n + self.chunk, self.chunk) // hidden)
            work.kept = self.rows.on_device = self._to_lanes(kept)  # held until the boundary waited for the lanes
        return work

    def _advance(self, work: _Pass, waiting: Callable[[], bool] | None = None) -> bool:
        """Queue `work`'s next chunks: all of them, or, while nothing is `waiting`, with `PACE` at most in flight.
        Returns whether all are queued."""
        while work.next * self.chunk < work.n:
            if waiting is not None:
                if waiting():
                    return False
                if len(work.in_flight) >= PACE:
                    host_wait(work.in_flight.popleft())
                    continue
            self._queue_chunk(work, work.next)
            work.next += 1
            if waiting is not None:
                work.in_flight.append(self.lanes[(work.next - 1) % len(self.lanes)].record())
        return True

    def _queue_chunk(self, work: _Pass, i: int) -> None:
        a = i * self.chunk
        b = min(a + self.chunk, work.n)
        lane, room, weights = self.lanes[i % len(self.lanes)], self.sets[i % len(self.sets)], work.weights
        with lane():
            lane.wait(work.ready)
            lane.wait(work.free)
            grad = room.wide[: b - a].zero_() if work.grad is None else work.grad[a:b]
            rows = None if work.kept is None else work.kept[work.bounds[i] : work.bounds[i + 1]] - a // work.hidden
            old = None if rows is None else weights[a:b].view(-1, work.hidden).index_select(0, rows)
            self._chunk(room, work.storage, work.plan, work.groups, work.start + a, grad, work.master[a:b],
                        tuple(m[a:b] for m in work.moments), work.scale, None if weights is None else weights[a:b],
                        work.halves)
            if old is not None:
                weights[a:b].view(-1, work.hidden).index_copy_(0, rows, old)

    def _to_lanes(self, host: torch.Tensor) -> torch.Tensor:
        """A small host tensor on the device for every lane: copied on the first, which the others wait for."""
        if self.device.type != "cuda":
            return host
        with self.lanes[0]():
            device = host.pin_memory().to(self.device, non_blocking=True)
        copied = self.lanes[0].record()
        for lane in self.lanes[1:]:
            lane.wait(copied)
        return device

    def _joined(self) -> object:
        """The event after everything queued on the lanes."""
        for lane in self.lanes[1:]:
            self.lanes[0].wait(lane.record())
        return self.lanes[0].record()

    def _run_touched(self, storage: UnitStorage, plan: StepPlan, grad: torch.Tensor, ready: object,
                     master: torch.Tensor, moments: tuple[Packed, Packed], slot: SlotWrite | None,
                     rows: TouchedRows) -> object:
        """The boundary's part of `run_untouched`: the touched rows from the staging, with their gradient rows,
        updated and their new weights written into the slot, their state back into the staging; `put_back` then
        puts it in place on the host (the next forward does not wait for that)."""
        self.resume_untouched()  # what of the pass is left goes first
        (_, touched, staged), rows.ahead = rows.ahead, None
        if slot is None or not slot.take():
            raise RuntimeError(f"The update of {storage.name}'s touched rows has no GPU slot to write.")
        hidden, per = rows.hidden, self.chunk // rows.hidden
        table = slot.params[: master.numel()].view(-1, hidden)
        grads = grad.view(-1, hidden)
        if rows.grads is not None:  # held on the host: the touched rows' gradient goes up with their state
            grads = torch.index_select(grads, 0, touched, out=rows.grads[: touched.numel()])
        index = self._to_lanes(touched)
        halves, scale, groups = _planes_of(storage), _scale_of(plan), groups_of(storage, plan)
        staged_grads = rows.grads is not None
        for i, a in enumerate(range(0, touched.numel(), per)):
            b = min(a + per, touched.numel())
            lane, room = self.lanes[i % len(self.lanes)], self.sets[i % len(self.sets)]
            with lane():
                lane.wait(ready)
                lane.wait(slot.free)
                self._rows_chunk(room, plan, groups, index[a:b], grads[a:b] if staged_grads else grads, table,
                                 [s[a:b] for s in staged], scale, halves, staged_grads)
        done = self._joined()
        rows.back = (done, touched, rows_of(master, halves, tuple(m.values for m in moments), hidden), staged)
        return done

    def put_back(self) -> None:
        """The touched rows' state, once back in the staging, into its places on the host (before anything reads
        it there: the next pass over the untouched rows, a `drain`)."""
        if self.rows is None or self.rows.back is None:
            return
        (done, touched, places, staged), self.rows.back = self.rows.back, None
        host_wait(done)
        self.rows.scatter(touched, places, staged)

    def _rows_chunk(self, room: _Buffers, plan: StepPlan, groups: tuple[list[list[float]], list[list[bool]],
                    list[int]], index: torch.Tensor, grads: torch.Tensor, table: torch.Tensor,
                    staged: list[torch.Tensor], scale: float | None, halves: MasterHalves | None,
                    staged_grads: bool) -> None:
        """Rows `index` of an embedding on the current lane: their staged state up, their gradient rows and slot
        weights gathered on the device, the update, the new weights scattered into the slot, the state back."""
        k, hidden = index.numel(), table.shape[1]
        n = k * hidden
        *master_rows, m_rows, v_rows = staged
        values = [v[:n].copy_(s.view(-1), non_blocking=True) for v, s in zip(room.values, (m_rows, v_rows))]
        if halves is None:
            gm = room.master[:n].copy_(master_rows[0].view(-1), non_blocking=True)
        else:
            weights = torch.index_select(table, 0, index, out=room.weights[:n].view(k, hidden))
            low = room.low[:n].copy_(master_rows[0].view(-1), non_blocking=True)
            parity = room.parity[: n // 8].copy_(master_rows[1].view(-1), non_blocking=True)
            gm = self.planes.join(weights.view(-1), low, parity, room.master[:n])
        g = room.grad[: n * grads.element_size()].view(grads.dtype).view(k, hidden)
        if staged_grads:  # the chunk's rows of a gradient held on the host, gathered there
            g.copy_(grads, non_blocking=True)
        else:  # the whole table's gradient on the device
            torch.index_select(grads, 0, index, out=g)
        self._adam(room, plan, groups, 0, g.view(-1), gm, "fp32", values, [None, None], room.noise, scale)
        if halves is None:
            table.index_copy_(0, index, gm.view(k, hidden).to(table.dtype))
            master_rows[0].view(-1).copy_(gm, non_blocking=True)
        else:
            self.planes.split(gm, room.weights[:n], room.low[:n], room.parity[: n // 8], halves.seed(plan.step))
            table.index_copy_(0, index, room.weights[:n].view(k, hidden))
            master_rows[0].view(-1).copy_(room.low[:n], non_blocking=True)
            master_rows[1].view(-1).copy_(room.parity[: n // 8], non_blocking=True)
        for s, v in zip((m_rows, v_rows), values):
            s.view(-1).copy_(v, non_blocking=True)
        state = 8 * n + (4 * n if halves is None else room.low.element_size() * n + n // 8)
        self.bytes_up, self.bytes_down = self.bytes_up + state, self.bytes_down + state

    @staticmethod
    def _check_planes(halves: MasterHalves, start: int, name: str, into_slot: bool) -> None:
        """An update of a unit whose master is planes: on whole parity bytes (two chunks never share one), from a
        weights plane that holds the unit's weights unless the slot does; its new weights stay in the slot."""
        if start % 8:
            raise RuntimeError(f"The update of {name} starts at element {start}, inside a byte of its master's parity "
                               "plane: the master halves need gradient chunks of a multiple of 8 elements.")
        if not into_slot and halves.stale:
            raise RuntimeError(f"The update of {name} has no GPU slot to write, but its newest weights are still "
                               "in one: the window gave the slot up without writing them back.")
        halves.stale = into_slot

    def _chunk(self, room: _Buffers, storage: UnitStorage, plan: StepPlan,
               groups: tuple[list[list[float]], list[list[bool]], list[int]], start: int, grad: torch.Tensor,
               master: torch.Tensor, moments: tuple[Packed, ...], scale: float | None,
               weights: torch.Tensor | None, halves: MasterHalves | None) -> None:
        """One chunk on the current stream (a lane's: everything it allocates is ordered there): copies up, the
        update, copies back (and the new weights into their slot)."""
        n = grad.numel()
        gm = self._master_up(room, master, halves, start, weights)
        kept = self.resident.get(storage.index)
        if kept is not None:  # fp32 moments in device memory: updated where they are
            values, scales, state = [k[start : start + n] for k in kept], [None, None], 0
        else:
            values = [v[:n].copy_(m.values, non_blocking=True) for v, m in zip(room.values, moments)]
            scales = [None if s is None else s[: m.scales.numel()].copy_(m.scales, non_blocking=True)
                      for s, m in zip(room.scales, moments)]
            state = sum(m.values.numel() * m.values.element_size() + (
                0 if m.scales is None else m.scales.numel() * 4) for m in moments)
        state += 4 * n if halves is None else (
            halves.low_dtype.itemsize * n + parity_bytes(n) + (0 if weights is not None else 2 * n))
        self.bytes_up, self.bytes_down = self.bytes_up + state, self.bytes_down + state
        if grad.device != self.device:
            self.bytes_up += n * grad.element_size()
            grad = room.grad[: n * grad.element_size()].view(grad.dtype).copy_(grad, non_blocking=True)
        if self.code_kernels:  # the moments decoded and encoded in one pass each; AdamW between, on fp32 moments
            coding, moments_in, scales_in = "fp32", self._decode(room, values, scales, n), [None, None]
            noise = room.noise  # unused: fp32 moments are not rounded
        else:  # the codec's torch ops inside the update
            coding, moments_in, scales_in = self.codecs[0].precision, values, scales
            noise = self.noise_for(room, plan.step, storage.index, start, n)
        self._adam(room, plan, groups, start, grad, gm, coding, moments_in, scales_in, noise, scale)
        if self.code_kernels:
            self._encode(moments_in, values, scales, plan.step, storage.index, start)
        self._master_back(room, gm, master, halves, start, weights, plan.step)
        for m, v, s in zip(moments, values, scales) if kept is None else ():
            m.values.copy_(v, non_blocking=True)
            if s is not None:
                m.scales.copy_(s, non_blocking=True)

    def _adam(self, room: _Buffers, plan: StepPlan, groups: tuple[list[list[float]], list[list[bool]], list[int]],
              start: int, grad: torch.Tensor, master: torch.Tensor, coding: str, moments: list[torch.Tensor],
              scales: list[torch.Tensor | None], noise: torch.Tensor, scale: float | None) -> None:
        """`layer_adam.adam_pieces` over a chunk on the device (the first element `start` of the unit's range)."""
        n = grad.numel()
        step = torch.full((), float(plan.step), device=self.device)
        grad_scale = None if scale is None else torch.full((), scale, device=self.device)
        wide = room.wide if grad.dtype != torch.float32 else torch.empty(0, device=self.device)
        hyper, flags, bounds = groups
        scripted(adam_pieces)(0, 1, max(n, 1), start, grad, master, coding, moments, scales,
                              [c.shift for c in self.codecs], noise, [0, n], ANY_POSITION, BLOCK, room.out,
                              room.out_bits, room.work, room.work_f, room.work_d, wide, bounds, hyper, flags, None,
                              step, grad_scale, None)

    def _master_up(self, room: _Buffers, master: torch.Tensor, halves: MasterHalves | None, start: int,
                   weights: torch.Tensor | None) -> torch.Tensor:
        """A chunk's fp32 master on the device: copied up whole, or joined from its planes (the low halves and
        parities up, the weights from the slot or up from their plane)."""
        n = master.numel()
        if halves is None:
            return room.master[:n].copy_(master, non_blocking=True)
        parity = _planes_up(room, halves, start, n, with_weights=weights is None)
        return self.planes.join(room.weights[:n] if weights is None else weights, room.low[:n], parity,
                                room.master[:n])

    def _master_back(self, room: _Buffers, gm: torch.Tensor, master: torch.Tensor, halves: MasterHalves | None,
                     start: int, weights: torch.Tensor | None, step: int) -> None:
        """The updated master to the host, whole or as planes (24 bits of it rounded with the noise of `step`), and
        its weights into the slot (as a load casts them: rounded to nearest-even); without a slot, a unit's weights
        plane takes them."""
        n = gm.numel()
        if halves is None:
            master.copy_(gm, non_blocking=True)
            if weights is not None:
                weights.copy_(gm)
            return
        self.planes.split(gm, room.weights[:n] if weights is None else weights, room.low[:n],
                          room.parity[: parity_bytes(n)], halves.seed(step), start)
        _planes_back(room, halves, start, n, with_weights=weights is None)

    def convert(self, units: Sequence[MasterHalves], planes: bool, step: int = 0) -> None:
        """Turn the fp32 masters of `units` into planes (`planes`; 24 bits of them rounded with the noise of `step`),
        or the planes into fp32 masters, chunk by chunk in place: a chunk goes up, is split or joined, and comes back
        into its own bytes (on the link, both ways at once; on the host, no pass at all). Returns once all are
        back."""
        k = 0
        for halves in (h for h in units if h.planes != planes):
            for a, b in halves.chunks():
                lane, room = self.lanes[k % len(self.lanes)], self.sets[k % len(self.sets)]
                k += 1
                with lane():
                    lane.wait(halves.written_back)
                    self._convert_chunk(room, halves, a, b, planes, step)
            halves.planes = planes
        for lane in self.lanes:
            host_wait(lane.record())

    def _convert_chunk(self, room: _Buffers, halves: MasterHalves, a: int, b: int, planes: bool, step: int) -> None:
        """One chunk of `convert`, on the current lane."""
        n = b - a
        master, weights, low = room.master[:n], room.weights[:n], room.low[:n]
        if planes:
            master.copy_(halves.master[a:b], non_blocking=True)
            self.planes.split(master, weights, low, room.parity[: parity_bytes(n)], halves.seed(step), a)
            _planes_back(room, halves, a, n, with_weights=True)
        else:
            parity = _planes_up(room, halves, a, n, with_weights=True)
            halves.master[a:b].copy_(self.planes.join(weights, low, parity, master), non_blocking=True)

    def _decode(self, room: _Buffers, values: list[torch.Tensor], scales: list[torch.Tensor | None],
                n: int) -> list[torch.Tensor]:
        """Both moments of a chunk as fp32, in the buffer set's decode rows (`ops.moment_codes`; bf16 widens)."""
        if self.codecs[0].precision == "bf16":
            return [out[:n].copy_(v) for v, out in zip(values, room.out)]
        return [self.kernels.decode_int8(v, sc, out, c.moment == 0, c.shift, BLOCK)
                for v, sc, out, c in zip(values, scales, room.out, self.codecs)]

    def _encode(self, fp32: list[torch.Tensor], values: list[torch.Tensor], scales: list[torch.Tensor | None],
                step: int, unit: int, start: int) -> None:
        """Both moments of a chunk stored back from fp32 (`ops.moment_codes`): 8-bit codes or bf16, rounded with
        the noise the CPU path's pieces draw for these elements."""
        for x, v, sc, c in zip(fp32, values, scales, self.codecs):
            position = noise_position(step, unit, c.moment, start)
            if c.precision == "bf16":
                self.kernels.encode_bf16(x, v, self.table, position, NOISE_PERIOD, self.piece)
            else:
                self.kernels.encode_int8(x, v, sc, c.moment == 0, c.shift, BLOCK, self.table, position, NOISE_PERIOD,
                                         self.piece)

    def noise_for(self, room: _Buffers, step: int, unit: int, start: int, n: int) -> torch.Tensor:
        """Both moments' rounding noise for elements [start, start + n) of `unit`, laid out one after the other:
        what the CPU path's pieces of `piece` elements draw (`adam_pieces` starts each piece's draw at its position
        in the table, `noise_position`), gathered here for the whole chunk. Empty where the kernels round (they
        gather their own) and for fp32."""
        if room.noise.numel() == 0:
            return room.noise
        index = room.index[:n]
        for k in range(2):
            torch.add(room.first[:n], noise_position(step, unit, k, start), out=index)
            index.remainder_(NOISE_PERIOD).add_(room.offsets[:n])
            torch.index_select(self.table, 0, index, out=room.noise[k * n : (k + 1) * n])
        return room.noise[: 2 * n]
