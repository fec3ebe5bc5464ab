"""The planner: what the sliding runtime will allocate, where, and whether it fits, before anything is allocated.

It sums the engine's allocations, each sized where it is allocated (`bytes_for` and its kin in storage.py,
moments.py, window.py, transfer.py, layer_adam.py, activations.py, gradients.py), so a run that cannot fit is
refused at setup with the numbers and the setting to change, instead of dying of an OOM
halfway through the first step. Two parts: the static plan (weights, optimizer state, slots, buffers) is
known from the model and the settings alone; the batch plan (saved inputs, compute workspace) needs the
micro-batch and sequence length, which only the first batch tells.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Literal

import torch
from torch import nn

from lightning_slide import master_halves
from lightning_slide.activations import DISK_BUFFERS, ActivationStore
from lightning_slide.adapters import causal_lm_units, find_causal_lm
from lightning_slide.available import (
    available_disk,
    available_ram,
    available_vram,
    cgroup_memory,
    host_headroom,
    process_rss,
)
from lightning_slide.config import SlideConfig
from lightning_slide.device_update import (
    DeviceUpdater,
    buffer_sets,
    code_kernels_on,
    gpu_updated_units,
    gpu_updates_on,
)
from lightning_slide.gradients import GradRouter
from lightning_slide.graphs import block_graph_per_token, block_workspace_bytes, head_workspace
from lightning_slide.layer_adam import LayerAdam
from lightning_slide.moment_codec import moment_bytes, table_bytes
from lightning_slide.moments import READ_AHEAD, Moments, disk_units, unit_file_bytes
from lightning_slide.step_mode import StepMode
from lightning_slide.storage import UnitStorage
from lightning_slide.tiers import align, direct_io
from lightning_slide.transfer import GradPump, LandingRing, gradient_chunk
from lightning_slide.window import GradBuffer, Slot, Window

Where = Literal["gpu", "pinned", "ram", "disk"]
LOCATIONS: tuple[Where, ...] = ("gpu", "pinned", "ram", "disk")
GiB = 2**30
# the remedies that name the batch: the micro-batch is the DataLoader's batch (`data.batch_size` in train.py)
SMALLER_BATCH = "a smaller micro-batch (the DataLoader's batch_size; data.batch_size in train.py)"
SMALLER_TOKENS = ("a smaller micro-batch or sequence length (the DataLoader's batch_size or its rows' length; "
                  "data.batch_size or data.seq_len in train.py)")


class PlanError(MemoryError):
    """The plan does not fit the machine; raised before anything is allocated."""


@dataclass(frozen=True)
class Entry:
    """One allocation: what it is, where it lives, its size, and the setting that shrinks or moves it."""

    what: str
    where: Where
    bytes: int
    remedy: str = ""


@dataclass(frozen=True)
class UnitSize:
    """A unit's owned parameters (a tied head weight belongs to the embedding unit, as in the engine)."""

    name: str
    numel: int
    trainable: int
    dedicated: bool


@dataclass(frozen=True)
class ModelShape:
    """Per-unit parameter counts and the dimensions the batch plan needs."""

    units: tuple[UnitSize, ...]
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_config(cls, config: object) -> ModelShape:
        """From a Hugging Face config, for full fine-tuning: the model is built on the meta device (no memory)."""
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        return cls.from_model(model, {id(p) for p in model.parameters()})

    @classmethod
    def from_model(cls, root: nn.Module, trainable: set[int]) -> ModelShape:
        """From a built model; `trainable` holds the ids of the parameters the optimizer updates."""
        model = find_causal_lm(root)
        owner: dict[int, nn.Parameter] = {}
        units = []
        for spec in causal_lm_units(model):
            owned = {id(p): p for m in spec.parts for p in m.parameters() if id(p) not in owner}
            owner.update(owned)
            units.append(UnitSize(spec.name, sum(p.numel() for p in owned.values()),
                                  sum(p.numel() for i, p in owned.items() if i in trainable), spec.dedicated))
        c = model.config
        heads = c.num_attention_heads
        return cls(tuple(units), c.hidden_size, c.intermediate_size, heads,
                   getattr(c, "num_key_value_heads", None) or heads,
                   getattr(c, "head_dim", None) or c.hidden_size // heads, c.vocab_size)

    @property
    def numel(self) -> int:
        return sum(u.numel for u in self.units)

    @property
    def trainable(self) -> int:
        return sum(u.trainable for u in self.units)

    @property
    def saves(self) -> int:
        """Saved inputs per micro-batch: one per decoder block, two for the head unit (norm and lm_head)."""
        return sum(not u.dedicated for u in self.units) + 2


@dataclass(frozen=True)
class Setup:
    """The run settings that change what the engine allocates."""

    config: SlideConfig
    device: str = "cuda"  # the compute device type: "cuda", or "cpu" (slots then live in host RAM)
    dtype: torch.dtype = torch.bfloat16  # compute dtype: bf16 for bf16 precisions, fp32 for "32-true"
    training: bool = True  # an optimizer exists (fit); False for validate/predict
    mode: StepMode = StepMode()  # eager, accumulating or deferred: whether and how gradients wait on the host
    amsgrad: bool = False
    export_bytes: int = 0  # host memory the end-of-training export adds at its peak (one shard of copies)
    grouped_attention: bool = False  # a micro-batch's attention over groups of heads (`resolve_batch_setup`)

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    @property
    def low_precision(self) -> bool:
        return self.dtype != torch.float32

    @property
    def compute_bytes(self) -> int:
        return self.dtype.itemsize

    @property
    def on_device(self) -> Where:
        return "gpu" if self.cuda else "ram"

    @property
    def pinned(self) -> Where:
        return "pinned" if self.cuda else "ram"


@dataclass(frozen=True)
class Resources:
    """What the machine has free, in bytes per location (None: not there, or not needed)."""

    ram: int
    gpu: int | None = None
    disk: int | None = None
    resident: int = 0  # host bytes the model's weights already hold: the engine copies them into the master
    process: int = 0  # host bytes this process holds besides those weights (Python, libraries, CUDA runtime)
    headroom: int = 0  # host RAM a plan must leave free (the page cache, the data loader, the rest of the system)
    ram_limit: int | None = None  # the process's memory cgroup limit, where it has one (a container, MemoryMax)

    @classmethod
    def probe(cls, device: torch.device, nvme_path: str | None = None, resident: int = 0) -> Resources:
        gpu = available_vram(device) if device.type == "cuda" else None  # first: it may start the CUDA runtime
        disk = available_disk(nvme_path) if nvme_path else None
        limit = cgroup_memory()
        return cls(available_ram(), gpu, disk, resident, max(0, process_rss() - resident), host_headroom(),
                   None if limit is None else limit[0])

    def free(self, pool: str) -> int | None:
        """What a plan may take from the pool: the host keeps `headroom` free."""
        return {"host": self.ram + self.resident - self.headroom, "gpu": self.gpu, "disk": self.disk}[pool]


# Host RAM and pinned memory come out of the same physical RAM; the check groups locations this way.
_POOLS = {"host": ("pinned", "ram"), "gpu": ("gpu",), "disk": ("disk",)}
_POOL_NAMES = {"host": "host RAM", "gpu": "GPU memory", "disk": "disk"}


@dataclass(frozen=True)
class Plan:
    """Every allocation of a run, with a readable table and a fit check."""

    entries: tuple[Entry, ...]

    @classmethod
    def static(cls, shape: ModelShape, setup: Setup) -> Plan:
        """Weights, optimizer state, GPU slots and transfer buffers: all the engine allocates at construction."""
        return cls(tuple(e for e in (*_host_state(shape, setup), *_window(shape, setup), *_transfer(shape, setup))
                         if e.bytes > 0))

    def batch(self, shape: ModelShape, setup: Setup, micro_batch: int, seq_len: int,
              gpu_free: int | None = None) -> Plan:
        """What one micro-batch adds: saved part inputs and the workspace of recomputing one unit.

        `gpu_free` is what the GPU had before this plan; it decides `activations="auto"` as the engine will.
        """
        tokens = micro_batch * seq_len
        acts = shape.saves * ActivationStore.input_bytes(tokens, shape.hidden, setup.dtype)
        where = _saved_inputs_go(setup, acts, None if gpu_free is None else gpu_free - self.total("gpu"))
        batch = (*_activations(shape, setup, tokens, acts, where), *_held_gradients(shape, setup, tokens, where),
                 _workspace(shape, setup, tokens), _kept_graphs(shape, setup, tokens))
        return Plan(tuple(e for e in batch if e.bytes > 0))

    def with_batch(self, shape: ModelShape, setup: Setup, micro_batch: int, seq_len: int,
                   gpu_free: int | None = None) -> Plan:
        return replace(self, entries=self.entries + self.batch(shape, setup, micro_batch, seq_len, gpu_free).entries)

    @classmethod
    def estimate(cls, shape: ModelShape, setup: Setup, micro_batch: int, seq_len: int,
                 resources: Resources | None = None) -> Plan:
        """The whole plan of a run whose batch shape is known."""
        gpu_free = resources.gpu if resources is not None else None
        return cls.static(shape, setup).with_batch(shape, setup, micro_batch, seq_len, gpu_free)

    def total(self, *where: str) -> int:
        return sum(e.bytes for e in self.entries if e.where in where)

    def describe(self) -> str:
        """One line per allocation, then one per location (GiB)."""
        width = max((len(e.what) for e in self.entries), default=10)
        lines = ["slideformer memory plan:"]
        lines += [f"  {e.what:<{width}}  {e.where:<6}  {e.bytes / GiB:9.3f} GiB" for e in self.entries]
        lines += [f"  {'total':<{width}}  {w:<6}  {self.total(w) / GiB:9.3f} GiB" for w in LOCATIONS if self.total(w)]
        return "\n".join(lines)

    def peak_rss(self, resources: Resources) -> int:
        """The process's expected peak resident set: what the plan puts in host memory, plus what the process
        held besides the model's weights when it was probed."""
        return self.total(*_POOLS["host"]) + resources.process

    def check(self, resources: Resources) -> None:
        """Raise PlanError naming the first pool that overflows: needed, available, and what to change."""
        for pool, locations, needed, free in self._overflows(resources):
            raise PlanError(self._refusal(pool, locations, needed, free, resources))

    def fits(self, resources: Resources) -> bool:
        return not any(self._overflows(resources))

    def _overflows(self, resources: Resources) -> Iterator[tuple[str, tuple[str, ...], int, int]]:
        for pool, locations in _POOLS.items():  # a pool the plan takes nothing from fits, whatever is free
            needed, free = self.total(*locations), resources.free(pool)
            if free is not None and needed > 0 and needed > free:
                yield pool, locations, needed, free

    def _refusal(self, pool: str, locations: tuple[str, ...], needed: int, free: int, resources: Resources) -> str:
        items = sorted((e for e in self.entries if e.where in locations), key=lambda e: -e.bytes)
        there = f"{free / GiB:.2f} GiB available"
        if pool == "host" and resources.headroom:
            there += f" after the {resources.headroom / GiB:.2f} GiB kept free for the rest of the system"
        if pool == "host" and resources.ram_limit is not None:
            there += f" (this process's memory cgroup allows it {resources.ram_limit / GiB:.2f} GiB)"
        if pool == "host" and resources.resident:
            there += (f" ({resources.ram / GiB:.2f} GiB free + {resources.resident / GiB:.2f} GiB the model's "
                      "weights already hold, which become the fp32 master)")
        largest = "; ".join(f"{e.what} {e.bytes / GiB:.2f} GiB" for e in items[:4])
        remedies = list(dict.fromkeys(e.remedy for e in items if e.remedy))
        return (f"slideformer cannot fit this run in {_POOL_NAMES[pool]}: it needs {needed / GiB:.2f} GiB, "
                f"{there}. Largest items: {largest}. To fit, change: " + "; or ".join(remedies) + ".")


def _saved_inputs_go(setup: Setup, acts: int, gpu_left: int | None) -> str:
    """The engine's `activations="auto"` rule: offload when the inputs take over half of the free GPU."""
    if setup.config.activations != "auto":
        return setup.config.activations
    offload = setup.cuda and gpu_left is not None and ActivationStore.offloads(acts, gpu_left)
    return ("nvme" if setup.config.offload == "nvme" else "cpu") if offload else "device"


def _host_state(shape: ModelShape, setup: Setup) -> list[Entry]:
    """storage.py + moments.py: fp32 master (pinned on CUDA, or on disk), Adam moments (RAM or disk), extras."""
    n, t = shape.numel, shape.trainable if setup.training else 0
    disk = _moments_on_disk(shape, setup)
    on_disk = [shape.units[u] for u in disk]
    master_on_disk = sum(u.numel for u in on_disk) if setup.config.nvme_master else 0
    precision = setup.config.moment_precision
    in_ram = sum(moment_bytes(precision, u.trainable) for i, u in enumerate(shape.units) if i not in disk)
    more_disk = ("a larger nvme_moments" if setup.config.offload == "nvme"
                 else "offload='nvme' with nvme_moments > 0 to keep part of it on disk")
    if precision != "int8":
        more_disk += ", or moment_precision='int8' (2 B/param instead of 8, bf16: 4)"
    served = _gpu_updated(shape, setup, disk)
    if setup.training:
        master_halves.require_planes(setup.config.master_bits, _plane_bits(shape, setup) if served else None)
    locked = sum(moment_bytes(precision, shape.units[u].trainable) for u in served)  # page-locked for the GPU
    all_locked = bool(served) and locked == in_ram
    entries = [
        Entry("fp32 master weights", setup.pinned, UnitStorage.bytes_for("master", n - master_on_disk),
              "offload='nvme' with nvme_master=True and a larger nvme_moments" if setup.training else ""),
        Entry(f"Adam exp_avg + exp_avg_sq ({precision})", setup.pinned if all_locked else "ram",
              (in_ram if all_locked else in_ram - locked) if setup.training else 0, more_disk),
    ]
    if locked and not all_locked:
        entries.append(Entry(f"Adam exp_avg + exp_avg_sq ({precision}) of the {len(served)} blocks updated on the "
                             "GPU", setup.pinned, locked, "a smaller gpu_update_blocks"))
    if setup.training and precision != "fp32":
        largest = max(u.trainable for u in shape.units)
        what = f"{precision} moments' fp32 update scratch" + (" + rounding table" if precision == "bf16" else "")
        entries.append(Entry(what, "ram", LayerAdam.scratch_bytes(largest, precision) + table_bytes(precision)))
    if served and _plane_bits(shape, setup) is not None:
        entries.append(Entry("parity planes of the masters the GPU updates (master_halves)", setup.pinned,
                             sum(UnitStorage.bytes_for("parity", shape.units[u].numel) for u in served)))
    if served:
        largest = max(shape.units[u].trainable for u in served)
        piece = LayerAdam.widen_elems(largest, precision)
        entries.append(Entry(f"{precision} moments' update buffers ({buffer_sets(precision)} chunks)", "gpu",
                             DeviceUpdater.bytes_for(largest, piece, precision,
                                                     code_kernels_on(torch.device(setup.device)),
                                                     _plane_bits(shape, setup)),
                             "gpu_update_blocks=0" if precision == "fp32" else ""))
    if on_disk:
        entries += _disk_state(shape, setup, on_disk, bool(master_on_disk))
    if setup.training and setup.mode.sums:
        entries.append(Entry("fp32 gradient sums", setup.pinned, UnitStorage.bytes_for("sums", t),
                             "accumulate_grad_batches=1 and automatic optimization"))
    if setup.training and setup.export_bytes:
        entries.append(Entry("Hugging Face export at the end (one shard being written)", "ram", setup.export_bytes,
                             "a smaller export.max_shard_size"))
    if setup.training and setup.amsgrad:
        entries.append(Entry("Adam max_exp_avg_sq (amsgrad)", "ram", UnitStorage.bytes_for("amsgrad", t),
                             "amsgrad=False"))
    if master_on_disk:
        entries.append(Entry("shadow weights of the masters on disk (compute dtype, what loads read)", setup.pinned,
                             UnitStorage.bytes_for("shadow", master_on_disk, setup.dtype)))
    return entries


def _disk_state(shape: ModelShape, setup: Setup, on_disk: list[UnitSize], with_master: bool) -> list[Entry]:
    """moments.py: the disk units' files (moments, and the master with nvme_master) and the read-ahead buffers."""
    what = "fp32 master + Adam moments" if with_master else "Adam exp_avg + exp_avg_sq"
    precision = setup.config.moment_precision
    files = sum(align(unit_file_bytes(u.numel if with_master else 0, u.trainable, precision)) for u in on_disk)
    chunk = _gradient_chunk(shape, setup)
    return [Entry(f"{what} ({precision}) on disk", "disk", files, "a smaller nvme_moments"),
            Entry(f"disk state read-ahead buffers ({READ_AHEAD} x chunk)", "ram",
                  Moments.read_ahead_bytes(with_master, chunk, precision), "a smaller chunk_elems")]


def _gradient_chunk(shape: ModelShape, setup: Setup) -> int:
    return gradient_chunk(setup.config.chunk_elems, [u.trainable for u in shape.units])


def _gpu_updated(shape: ModelShape, setup: Setup, on_disk: list[int]) -> list[int]:
    """The units whose updates the engine runs on the GPU (`device_update.gpu_updated_units`)."""
    on = gpu_updates_on(torch.device(setup.device))
    if not setup.training or on is None:
        return []
    return gpu_updated_units(setup.config.moment_precision, setup.config.gpu_update_blocks,
                             [u.dedicated for u in shape.units], on_disk, [u.trainable for u in shape.units], on,
                             _plane_bits(shape, setup), setup.amsgrad)


def _plane_bits(shape: ModelShape, setup: Setup) -> int | None:
    """The bits of their masters the units the GPU updates keep as planes (`master_halves.plane_bits`)."""
    return master_halves.plane_bits(setup.dtype, _gradient_chunk(shape, setup), max(u.trainable for u in shape.units),
                                    setup.config.master_bits)


def _moments_on_disk(shape: ModelShape, setup: Setup) -> list[int]:
    """The units whose moments the engine puts on disk (the same whole-unit choice)."""
    if not setup.training or setup.config.offload != "nvme":
        return []
    return disk_units([u.trainable for u in shape.units], setup.config.nvme_moments or 0.0)


def fit_moments(shape: ModelShape, setup: Setup, resources: Resources) -> float:
    """The least fraction of the moments on disk (whole units) whose static plan leaves the host's headroom free.
    What the micro-batches need besides is not known yet: the first is checked before its forward (`check_batch`)."""
    trainable = [u.trainable for u in shape.units]
    total, budget = sum(trainable), resources.free("host")
    placed = 0
    for n in [0, *trainable]:
        placed += n
        config = replace(setup.config, nvme_moments=placed / total if total else 0.0)
        if Plan.static(shape, replace(setup, config=config)).total(*_POOLS["host"]) <= budget:
            return config.nvme_moments
    return 1.0


def _window(shape: ModelShape, setup: Setup) -> list[Entry]:
    """window.py: a dedicated slot per vocabulary-sized unit, a ring of block-sized slots, fp32 staging."""
    dtype, grads = setup.dtype, setup.training  # weights, plus a GPU gradient buffer each when training
    slots = [Entry(f"{u.name} slot (weights{' + grads' if grads else ''})", setup.on_device,
                   Slot.bytes_for(u.numel, dtype) + (GradBuffer.bytes_for(u.numel, dtype) if grads else 0))
             for u in shape.units if u.dedicated]
    block = max((u.numel for u in shape.units if not u.dedicated), default=0)
    ring = min(setup.config.initial_slots, sum(not u.dedicated for u in shape.units))
    grows = " (slots='auto': grows into spare VRAM after step 1)" if setup.config.slots == "auto" else ""
    slots.append(Entry(f"ring: {ring} block weight slots{grows}", setup.on_device, ring * Slot.bytes_for(block, dtype),
                       f"slots={ring - 1}" if ring > 2 else ""))
    if setup.training:
        count = setup.config.block_grad_buffers
        slots.append(Entry(f"{count} block gradient buffers", setup.on_device,
                           count * GradBuffer.bytes_for(block, dtype),
                           "block_grad_buffers=2" if count > 2 else ""))
    if setup.cuda and setup.low_precision:
        staging = Window.staging_bytes(setup.config.chunk_elems, max(u.numel for u in shape.units))
        slots.append(Entry("fp32 load staging", "gpu", staging, "a smaller chunk_elems"))
    return slots


def _transfer(shape: ModelShape, setup: Setup) -> list[Entry]:
    """transfer.py: the gradient landing ring (pinned on CUDA) and the device-side fp32 widening buffer."""
    if not setup.training:
        return []
    chunk, count = _gradient_chunk(shape, setup), setup.config.grad_buffers
    entries = [Entry(f"gradient landing ring ({count} x fp32 chunk)", setup.pinned,
                     LandingRing.bytes_for(count, chunk), "fewer grad_buffers or a smaller chunk_elems")]
    if setup.cuda and setup.low_precision:
        entries.append(Entry("fp32 gradient widening buffer", "gpu", GradPump.widen_bytes(chunk),
                             "a smaller chunk_elems"))
    return entries


def _activations(shape: ModelShape, setup: Setup, tokens: int, acts: int, where: str) -> list[Entry]:
    """activations.py: each part's input waits for its backward on the device, in pinned RAM, or on disk."""
    hidden = ActivationStore.input_bytes(tokens, shape.hidden, setup.dtype)
    if where == "device":
        remedy = "activations='cpu' or " + SMALLER_BATCH if setup.cuda else SMALLER_BATCH
        return [Entry(f"saved part inputs ({shape.saves})", setup.on_device, acts, remedy),
                Entry("hidden states in flight", setup.on_device, ActivationStore.in_flight_bytes(hidden, where),
                      SMALLER_BATCH)]
    in_flight = Entry("hidden states in flight + prefetched inputs", setup.on_device,
                      ActivationStore.in_flight_bytes(hidden, where), SMALLER_BATCH)
    if where == "nvme":
        return [Entry(f"saved part inputs ({shape.saves}), on disk", "disk",
                      ActivationStore.disk_bytes_for(shape.saves, hidden), SMALLER_TOKENS),
                _disk_staging(setup, hidden), in_flight]
    return [Entry(f"saved part inputs ({shape.saves}), offloaded", setup.pinned, acts,
                  "activations='nvme' with offload='nvme', or " + SMALLER_TOKENS), in_flight]


def _held_gradients(shape: ModelShape, setup: Setup, tokens: int, where: str) -> list[Entry]:
    """gradients.py `GradRouter._gradient_home`: a deferred step without sums holds each unit's gradient in the
    compute dtype, in the pinned buffer of one of the unit's saved inputs where that is large enough (every unit but the
    embedding saves hidden states), else in a buffer of its own."""
    if not (setup.training and setup.mode.holds_grads) or setup.mode.sums:
        return []
    lendable = ActivationStore.input_bytes(tokens, shape.hidden, setup.dtype) if where == "cpu" else 0
    homes = [GradRouter.home_bytes(u.trainable, setup.dtype) for u in shape.units]
    own = sum(home for i, home in enumerate(homes) if i == 0 or home > lendable)
    dtype = str(setup.dtype).removeprefix("torch.")
    entries = [Entry(f"held gradients ({dtype}, for the step's norm; the rest in saved-input buffers)",
                     setup.pinned, own, "gradient_clip_val=None (no clipping)")]
    if setup.low_precision:
        entries.append(Entry("fp32 widening piece of held gradients", "ram",
                             LayerAdam.widen_bytes(max(u.trainable for u in shape.units),
                                                   setup.config.moment_precision)))
    return entries


def _disk_staging(setup: Setup, hidden: int) -> Entry:
    """Activations stage on their way to disk in GPU memory with direct (GPUDirect) I/O, else in pinned RAM."""
    if direct_io(setup.config.gds, torch.device(setup.device)):
        return Entry(f"disk staging buffers ({DISK_BUFFERS}), direct I/O", "gpu",
                     ActivationStore.staging_bytes(hidden, False),
                     "gds='off' (staging in pinned RAM) or " + SMALLER_BATCH)
    return Entry(f"disk staging buffers ({DISK_BUFFERS})", setup.pinned,
                 ActivationStore.staging_bytes(hidden, setup.cuda), SMALLER_BATCH)


def _workspace(shape: ModelShape, setup: Setup, tokens: int) -> Entry:
    """Transient memory of recomputing the costliest unit (a decoder block or the loss head) in its backward:
    a block's graph and, with its MLP tiled, one tile's buffers (`graphs.block_workspace_bytes`), less what its
    attention's backward holds less over groups of heads (where the setup has them), and its weight gradients, which
    exist once more before the engine copies them into the slot; or the head's (`graphs.head_workspace`)."""
    tile = _mlp_tile(shape, setup, tokens)
    block = block_workspace_bytes(tokens, shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim,
                                  shape.intermediate, setup.compute_bytes, _kernels(setup), tile and tile[1])
    if setup.grouped_attention and _kernels(setup):
        block -= _attention_saving(shape, setup, tokens)
    block += Slot.bytes_for(max((u.numel for u in shape.units if not u.dedicated), default=0), setup.dtype)
    head = head_workspace(tokens, shape.hidden, shape.vocab, setup.compute_bytes,
                          int(setup.config.loss_chunk_mib * 2**20) if _kernels(setup) else None)
    return Entry("compute workspace (one unit's recompute + backward)", setup.on_device, max(block, head),
                 SMALLER_TOKENS + _tiling_remedy(setup, tile and tile[0]))


def _kernels(setup: Setup) -> bool:
    return setup.cuda and setup.config.use_kernels


def _attention_saving(shape: ModelShape, setup: Setup, tokens: int) -> int:
    """What grouping a block's attention saves at this many tokens (`ops.grouped_attention.workspace_saving`)."""
    from lightning_slide.ops.grouped_attention import workspace_saving

    return workspace_saving(tokens, shape.heads, shape.kv_heads, shape.head_dim, setup.compute_bytes)


def _mlp_tile(shape: ModelShape, setup: Setup, tokens: int) -> tuple[int, int] | None:
    """Tokens per MLP tile of a micro-batch of `tokens`, as the engine's patched MLPs will choose, and the tile's
    buffers in bytes; None: untiled."""
    setting = setup.config.mlp_tiling(setup.device)
    if setting is None:
        return None
    from lightning_slide.ops.tiled_mlp import tile_bytes, tile_for  # imports triton: only where MLPs are tiled

    tile = tile_for(setting, tokens, shape.intermediate, setup.compute_bytes)
    return None if tile is None else (tile, tile_bytes(tile, shape.intermediate, setup.compute_bytes))


def _tiling_remedy(setup: Setup, tile: int | None) -> str:
    """The MLP setting that shrinks the workspace: tiling where it is off, smaller tiles where they are set."""
    if setup.config.mlp_tiling(setup.device) is None:
        return ", or mlp_tile_tokens=8192 (MLPs over sequence tiles)"
    if tile is not None and setup.config.mlp_tile_tokens != "auto":
        return f", or mlp_tile_tokens below {tile}"
    return ""


def _block_graph_per_token(shape: ModelShape, setup: Setup, tokens: int) -> int:
    """Bytes per token a decoder block of this model keeps for its backward (`graphs.block_graph_per_token`)."""
    return block_graph_per_token(shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim,
                                 shape.intermediate, setup.compute_bytes, _kernels(setup),
                                 _mlp_tile(shape, setup, tokens) is not None)


def _kept_graphs(shape: ModelShape, setup: Setup, tokens: int) -> Entry:
    """recompute="never": every block keeps its graph until its backward ("auto" fits them to what is spare)."""
    blocks = sum(not u.dedicated for u in shape.units) if setup.config.recompute == "never" else 0
    return Entry(f"kept graphs of {blocks} blocks (recompute='never')", setup.on_device,
                 blocks * tokens * _block_graph_per_token(shape, setup, tokens),
                 "recompute='auto', or " + SMALLER_BATCH)


def check_batch(needs: Plan, static: Plan, shape: ModelShape, setup: Setup, micro_batch: int, seq_len: int,
                resources: Resources, gpu_free: int | None) -> None:
    """Raise PlanError when a micro-batch's plan (`needs`, beside the allocated `static` plan) does not fit, naming
    also the longest sequence that would fit at this micro-batch."""
    try:
        needs.check(resources)
    except PlanError as error:
        longest = longest_seq_len(static, shape, setup, micro_batch, resources, gpu_free, seq_len)
        fits = (f"the longest sequence that fits at a micro-batch of {micro_batch} is {longest:,} tokens"
                if longest else f"no sequence fits at a micro-batch of {micro_batch}")
        raise PlanError(f"{error} This micro-batch has {micro_batch} x {seq_len:,} tokens; {fits}.") from None


def resolve_batch_setup(static: Plan, shape: ModelShape, setup: Setup, micro_batch: int, seq_len: int,
                        resources: Resources, gpu_free: int | None) -> tuple[Setup, Plan]:
    """What one micro-batch runs with, and its plan: the MLP's tiles (`resolve_mlp_tiles`), then, with the
    kernels, attention over groups of heads where the plan does not fit without and grouping saves memory
    (`ops.grouped_attention`: ATen's flash kernels over groups, slower than the one call SDPA makes: 1.46x a
    Llama-3.2-3B block's time at 262,144 tokens on an H200, where SDPA runs cuDNN's)."""
    setup, needs = resolve_mlp_tiles(static, shape, setup, micro_batch, seq_len, resources, gpu_free)
    tokens = micro_batch * seq_len
    if needs.fits(resources) or not _kernels(setup) or not _attention_saving(shape, setup, tokens):
        return setup, needs
    grouped = replace(setup, grouped_attention=True)
    return grouped, static.batch(shape, grouped, micro_batch, seq_len, gpu_free)


def resolve_mlp_tiles(static: Plan, shape: ModelShape, setup: Setup, micro_batch: int, seq_len: int,
                      resources: Resources, gpu_free: int | None) -> tuple[Setup, Plan]:
    """`mlp_tile_tokens="auto"` on CUDA decided for one micro-batch: untiled where the micro-batch's plan fits
    untiled (a tiled MLP runs its gate and up projections once more in the backward: about an eighth more of a
    block's compute), else in equal tiles (`tiled_mlp.even_tiles`). Any other setting stands as given. Returns the
    setup the micro-batch runs with and its plan."""
    if setup.config.mlp_tiling(setup.device) != "auto":
        return setup, static.batch(shape, setup, micro_batch, seq_len, gpu_free)
    from lightning_slide.ops.tiled_mlp import even_tiles  # imports triton: only where MLPs may be tiled

    untiled = replace(setup, config=replace(setup.config, mlp_tile_tokens=None))
    needs = static.batch(shape, untiled, micro_batch, seq_len, gpu_free)
    tile = even_tiles(micro_batch * seq_len, shape.intermediate, setup.compute_bytes)
    if tile is None or needs.fits(resources):
        return untiled, needs
    tiled = replace(setup, config=replace(setup.config, mlp_tile_tokens=tile))
    return tiled, static.batch(shape, tiled, micro_batch, seq_len, gpu_free)


def longest_seq_len(static: Plan, shape: ModelShape, setup: Setup, micro_batch: int, resources: Resources,
                    gpu_free: int | None, below: int) -> int:
    """The longest sequence shorter than `below` whose batch plan at `micro_batch` fits (0 if none does)."""
    def fits(seq_len: int) -> bool:
        try:
            static.batch(shape, setup, micro_batch, seq_len, gpu_free).check(resources)
        except PlanError:
            return False
        return True

    low, high = 0, below  # low fits (nothing at all), high does not
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def plan_for_run(root: nn.Module, optimizer: torch.optim.Optimizer | None, setup: Setup) -> tuple[ModelShape, Plan]:
    """The static plan of a built model: the strategy calls this before the engine allocates anything."""
    trainable = set() if optimizer is None else {
        id(p) for g in optimizer.param_groups for p in g["params"] if p.requires_grad}
    shape = ModelShape.from_model(root, trainable)
    return shape, Plan.static(shape, setup)


def resident_bytes(root: nn.Module) -> int:
    """Host bytes the model's parameters hold now (the master copy frees them as it goes)."""
    unique = {id(p): p for p in root.parameters() if p.device.type == "cpu"}
    return sum(p.numel() * p.element_size() for p in unique.values())
