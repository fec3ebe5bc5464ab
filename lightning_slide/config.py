"""One place for every setting of the sliding runtime (the engine reads only this)."""

from __future__ import annotations

import tempfile
import types
import typing
from dataclasses import asdict, dataclass, fields, make_dataclass, replace
from typing import Any, Literal, Union

Offload = Literal["none", "cpu", "nvme"]
MomentPrecision = Literal["fp32", "bf16", "int8"]
INT8_BLOCK = 256  # elements per scale of 8-bit moments (moment_codec.BLOCK)


@dataclass(frozen=True)
class SlideConfig:
    """Where training state lives and how the GPU window slides over the model.

    offload: where the fp32 master weights and the Adam state live. "cpu": in host RAM, with the model's units
        streamed through the GPU and updated on the CPU; "nvme": also the disk tier (part of the moments, and
        optionally of the masters and activations, in files); "none": everything on the compute device, as
        plain training (every other setting is then unused).
    slots: GPU weight slots in the ring that decoder blocks slide through (>= 2: one computing, one loading),
        or "auto": start with 3 and, after the first step has shown the batch's peak memory, add as many as
        the spare VRAM holds (up to one per block: blocks then stay resident from forward to backward and cross
        PCIe once per step instead of twice); a later micro-batch with more tokens gives the added slots back
        before its forward and sizes them again.
    activations: where each unit's saved input waits for its backward: "device" (GPU memory), "cpu"
        (pinned host RAM, copied out and prefetched back asynchronously), "nvme" (files of the disk tier), or
        "auto" (the device while all inputs take at most half the free GPU memory, else the offload tier).
    recompute: what a part's backward does for the intermediate tensors of its forward. "always": the
        forward keeps only the part's input and the backward recomputes the part (least memory); "never":
        every part keeps its autograd graph on the device until its backward, as training without
        checkpointing does (weights excepted: they are read back from the window's slots); "auto": the first
        step recomputes and measures each part's graph, then parts keep their graphs (in forward order) in
        the device memory left after the window has grown (CUDA; on the CPU "auto" recomputes).
    block_grad_buffers: GPU buffers, each one block in the compute dtype, that hold a block's gradient from its
        backward until it has left for the CPU (>= 2: one being written, one leaving); more let the backward
        run further ahead of a slower CPU update, at one block of VRAM each.
    chunk_elems: elements per gradient chunk on its way to the CPU optimizer: the size of each pinned landing
        buffer, so it bounds that memory, and the grain at which device-to-host copies pipeline with updates.
    grad_buffers: pinned host landing buffers of chunk_elems each, shared by all units (>= 2, so one copy
        lands while the optimizer reads another).
    use_kernels: patch the model with the Triton kernels of `lightning_slide.ops` (RMSNorm, RoPE, SwiGLU, a linear
        cross-entropy that never materialises the logits) when the compute device is CUDA.
    mlp_tile_tokens: when a decoder block's SwiGLU MLP runs over sequence tiles (`lightning_slide.ops.tiled_mlp`):
        each tile computed and let go, only the MLP's input kept, each tile recomputed in the backward, so no
        tokens x intermediate tensor of the whole micro-batch exists (at 131,072 tokens one is 3.5 GiB for
        Llama-3.1-8B, and an untiled MLP holds several). "auto": on CUDA, untiled where the micro-batch's memory
        plan fits untiled, else in equal tiles of at most 256 MiB such tensors (the strategy decides it per
        micro-batch size; an engine driven without it tiles where one such tensor would take over 1 GiB, Llama-3.1-8B
        in bf16 beyond 37,449 tokens); an int: tiles of that many tokens whenever a micro-batch has more, on any
        device; None: never. A tiled MLP runs its gate and up projections once more in the backward.
    loss_chunk_mib: the fused loss's logits buffer (MiB) with the kernels. The loss head computes the logits a
        block at a time into this one buffer, so it bounds the loss's transient GPU memory (63 keeps it under
        64 MiB); a larger buffer means fewer, larger GEMMs: at 64k tokens, hidden 4096 and vocab 128256 (bf16
        forward + backward on an H200), 424 ms within 63 MiB against 334 ms with 256 MiB of whole rows.
    nvme_path: directory for the disk tier (offload="nvme"; default: the system temporary directory). The
        run's files go in a private directory there, preallocated, removed when training ends (also after an
        error, and by the next run after a kill); a fast local disk, since the moments on disk move with every
        update.
    nvme_moments: with offload="nvme", the fraction (0..1) of the Adam moments kept on disk (whole units, in
        index order) instead of RAM; None lets the strategy choose the least that fits the free RAM.
    nvme_master: with offload="nvme", the units whose moments are on disk keep their fp32 master weights in
        the same file too (read ahead and written behind with the moments by each update), and only a pinned
        copy in the compute dtype in RAM, which loads read: 2 bytes of RAM per such parameter instead of the
        master's 4 under bf16 (none saved under 32-true, where the copy is fp32 too).
        For machines whose disk is much larger than their RAM; every update then also moves the master.
    gds: with activations on disk, whether their staging buffers are GPU memory that kvikio moves straight to
        and from the files ("auto": where kvikio runs GPUDirect Storage; "on": wherever kvikio is installed and
        the device is CUDA, bouncing through kvikio's own host buffers where GDS is missing; "off": pinned
        host buffers, copied over PCIe by the runtime). Direct costs the staging buffers' GPU memory.
    moment_precision: how Adam's exp_avg and exp_avg_sq are stored (in RAM and on disk); the fp32 master
        weights stay fp32 whatever this is. "fp32": exactly torch's AdamW (8 B/param of moments); "bf16": bf16
        moments rounded stochastically on each write-back (4 B/param); "int8": bitsandbytes-style blockwise
        dynamic 8-bit moments, one absmax scale per 256 elements, rounded stochastically (2 B/param). Given the
        moments as stored, each update of the master is torch's AdamW's; only the moments lose precision. For
        runs that host RAM (or the disk tier) limits: at 8B, host state drops from 12 to 6 B/param with "int8".
        Compact moments support Adam and AdamW without amsgrad; checkpoints hold them compact and load into a run
        of any moment_precision (converted where the precision differs). On CUDA, compact moments in RAM are
        updated on the GPU (page-locked, copied up and back per chunk; `device_update`), elsewhere by a CPU thread pool.
    gpu_update_blocks: with fp32 moments on CUDA, how many decoder blocks (spread evenly over the model, so that
        both sides work from the backward's start) have their AdamW run on the GPU while the CPU updates the rest: their
        master and moments are page-locked and go up and back per update (24 bytes/param of PCIe), the gradient
        never leaves the GPU, and the new weights go straight into the block's slot. This takes CPU update work
        (and about 36 bytes/param of host-memory traffic) off steps that the CPU update bounds. "auto": as many as
        make the CPU's and the GPU's shares take equally long at the fused CPU AdamW and pinned-copy rates the run
        measures when it starts (`device_update.balanced_blocks`), then, at the first training micro-batch, only
        as many of those as the step's compute does not hide anyway (at a bf16 matmul rate it also measures:
        large steps keep the link for loads); "auto" also gives the GPU the embedding's update where it ends
        sooner there (the next forward's first need), which a count leaves on the CPU; 0: every fp32 update on
        the CPU, as with amsgrad (its running maximum lives on the host). Compact moments are always updated on
        the GPU where there is one.
    resident_moments: with fp32 moments updated on the GPU, how many of the decoder blocks it updates (the lowest
        first: their updates end the step) keep both Adam moments in GPU memory between steps (8 bytes/param of
        VRAM) instead of page-locked host RAM: their updates then move only the master over PCIe (4 bytes/param
        each way, or 2 1/8 as planes, instead of 12 or 10 1/8), a step's host copy refreshed whenever the state is
        read (checkpoints, `state_dict`). Taken after the first step from the VRAM it left spare, before the window
        grows into the rest (fewer blocks where less is spare); 0: none.
    master_bits: how many bits of the fp32 master weights the units the GPU updates keep while they train. 32:
        the fp32 master, exact (on the host as planes: the bf16 weights, the low 16 bits and a parity bit,
        `master_halves`). 24 (opt-in, not exact): after each update the master is rounded stochastically to 24 bits
        (bf16 and an 8-bit compensation: the low 8 bits cleared, the value rounded up with the probability they
        gave), so an update moves 1 1/8 bytes of master over PCIe each way instead of 2 1/8, where the link binds
        (compact moments at small steps). Applies where the GPU updates masters as planes (CUDA, bf16 compute,
        moment_precision 'int8'/'bf16' or gpu_update_blocks > 0); units the CPU updates keep 32. Checkpoints hold
        fp32 masters whose low 8 bits are zero; they resume exactly and load into a run of either setting.
    stall_timeout_s: seconds without any background worker (optimizer, copy, disk threads) starting or finishing
        an item, while training waits for them, after which fit stops with an error naming the stalled worker,
        its item and its stack (a hung disk or a deadlock ends the run instead of hanging it); None:
        max(300 s, 10 x the longest item so far).
    """

    offload: Offload = "cpu"
    slots: int | Literal["auto"] = "auto"
    activations: Literal["auto", "device", "cpu", "nvme"] = "auto"
    recompute: Literal["auto", "always", "never"] = "auto"
    block_grad_buffers: int = 3
    chunk_elems: int = 1 << 25
    grad_buffers: int = 3
    use_kernels: bool = True
    mlp_tile_tokens: int | Literal["auto"] | None = "auto"
    loss_chunk_mib: float = 63.0
    nvme_path: str | None = None
    nvme_moments: float | None = None
    nvme_master: bool = False
    gds: Literal["auto", "on", "off"] = "auto"
    moment_precision: MomentPrecision = "fp32"
    gpu_update_blocks: int | Literal["auto"] = "auto"
    resident_moments: int = 0
    master_bits: Literal[32, 24] = 32
    stall_timeout_s: float | None = None

    def __post_init__(self) -> None:
        checks = {
            "offload": self.offload in ("none", "cpu", "nvme"),
            "slots": self.slots == "auto" or (isinstance(self.slots, int) and self.slots >= 2),
            "activations": self.activations in ("auto", "device", "cpu") or (
                self.activations == "nvme" and self.offload == "nvme"),
            "recompute": self.recompute in ("auto", "always", "never"),
            "block_grad_buffers": self.block_grad_buffers >= 2,
            "chunk_elems": self.chunk_elems >= 1024 and (
                self.moment_precision != "int8" or self.chunk_elems % INT8_BLOCK == 0),
            "mlp_tile_tokens": self.mlp_tile_tokens in (None, "auto") or (
                type(self.mlp_tile_tokens) is int and self.mlp_tile_tokens >= 1),
            "loss_chunk_mib": self.loss_chunk_mib >= 1,
            "grad_buffers": self.grad_buffers >= 2,
            "nvme_moments": self.nvme_moments is None or (0 <= self.nvme_moments <= 1 and self.offload == "nvme"),
            "nvme_master": not self.nvme_master or self.offload == "nvme",
            "gds": self.gds in ("auto", "on", "off"),
            "moment_precision": self.moment_precision in ("fp32", "bf16", "int8"),
            "gpu_update_blocks": self.gpu_update_blocks == "auto" or (
                type(self.gpu_update_blocks) is int and self.gpu_update_blocks >= 0),
            "resident_moments": type(self.resident_moments) is int and self.resident_moments >= 0 and (
                self.resident_moments == 0 or self.moment_precision == "fp32"),
            "master_bits": type(self.master_bits) is int and self.master_bits in (32, 24),
            "stall_timeout_s": self.stall_timeout_s is None or (
                isinstance(self.stall_timeout_s, (int, float)) and not isinstance(self.stall_timeout_s, bool)
                and self.stall_timeout_s > 0),
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            name = bad[0]
            raise ValueError(f"SlideConfig.{name}={getattr(self, name)!r} is not valid. {_HINTS[name]}")

    @property
    def initial_slots(self) -> int:
        return 3 if self.slots == "auto" else self.slots

    def mlp_tiling(self, device_type: str) -> int | Literal["auto"] | None:
        """The MLP tile setting that applies on a device: "auto" on CUDA only (as the kernels), an int anywhere."""
        return None if self.mlp_tile_tokens == "auto" and device_type != "cuda" else self.mlp_tile_tokens

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> SlideConfig:
        """Build from loose keyword arguments (Hydra, registry init params), naming any unknown key."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"Unknown slideformer setting(s) {unknown}; valid settings are {sorted(known)}.")
        return cls(**kwargs)  # type: ignore[arg-type]

    @classmethod
    def for_strategy(cls, config: SlideConfig | None = None, **overrides: object) -> SlideConfig:
        """A strategy's settings: `config` (default: the defaults) with keyword overrides, and the disk tier's
        folder the system temporary directory when none is given."""
        merged = cls.from_kwargs(**{**asdict(config or cls()), **overrides})
        if merged.offload == "nvme" and merged.nvme_path is None:
            merged = replace(merged, nvme_path=tempfile.gettempdir())
        return merged


def omegaconf_schema() -> type:
    """SlideConfig's fields and defaults as a dataclass that OmegaConf can type-check: train.py's `offload`
    settings are made from it, so the command line knows every setting, its default and its type
    (`offload.chunk_elems=abc` is refused at composition, naming the key) without a second copy of them.
    OmegaConf has no Literal: a Literal becomes the type of its values, which SlideConfig checks."""
    hints = typing.get_type_hints(SlideConfig)
    settings = [(f.name, _omegaconf_type(hints[f.name]), f.default) for f in fields(SlideConfig)]
    return make_dataclass("SlideSettings", settings)


def _omegaconf_type(hint: Any) -> Any:
    """The nearest type OmegaConf validates: Literal["a", "b"] -> str, int | Literal["auto"] -> Union[int, str]."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        kinds = {type(value) for value in typing.get_args(hint)}
        return kinds.pop() if len(kinds) == 1 else Any
    if origin in (Union, types.UnionType):
        members = tuple(dict.fromkeys(_omegaconf_type(arg) for arg in typing.get_args(hint)))
        return members[0] if len(members) == 1 else Union[members]  # noqa: UP007 - built from a runtime tuple
    return hint


_HINTS = {
    "offload": "Choose 'cpu' (host RAM), 'nvme' (disk tier) or 'none' (everything on the GPU).",
    "slots": "The window needs at least 2 GPU slots (one computing, one loading), or 'auto'.",
    "activations": "Choose 'auto', 'device', 'cpu', or 'nvme' together with offload='nvme'.",
    "recompute": "Choose 'auto' (keep graphs where VRAM is spare), 'always' (least memory) or 'never'.",
    "block_grad_buffers": "Use at least 2 GPU gradient buffers (one being written, one leaving for the CPU).",
    "chunk_elems": f"Use at least 1024 elements per gradient chunk, a multiple of {INT8_BLOCK} with "
                   "moment_precision='int8' (a chunk's update then covers whole 8-bit blocks).",
    "mlp_tile_tokens": "Give a positive number of tokens per MLP tile, 'auto' (long micro-batches on CUDA) or None.",
    "loss_chunk_mib": "Give the fused loss's logits buffer at least 1 MiB (63 keeps the loss under 64 MiB).",
    "grad_buffers": "Use at least 2 pinned gradient landing buffers so copies overlap the update.",
    "nvme_moments": "Give a fraction between 0 and 1, together with offload='nvme' (the disk tier).",
    "nvme_master": "The master weights go to disk only with offload='nvme' (the disk tier).",
    "gds": "Choose 'auto' (GPUDirect Storage where kvikio uses it), 'on' or 'off' (pinned host staging).",
    "moment_precision": "Choose 'fp32' (exact AdamW), 'bf16' (stochastically rounded) or 'int8' (blockwise 8-bit).",
    "gpu_update_blocks": "Give a whole number of decoder blocks (0 or more) whose fp32 AdamW runs on the GPU, "
                         "or 'auto' (the split that balances the CPU's and the GPU's update time).",
    "resident_moments": "Give a count of GPU-updated blocks (>= 0) whose moments stay in GPU memory; with "
                        "moment_precision='fp32' only (compact moments are already small on the link).",
    "master_bits": "Give 32 (the fp32 master, exact) or 24 (bf16 and an 8-bit compensation, rounded stochastically).",
    "stall_timeout_s": "Give a positive number of seconds, or None to scale it from the longest item (at least 300 s).",
}
