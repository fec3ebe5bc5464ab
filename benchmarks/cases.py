"""The benchmark cases, their suites, and the order they run in (plain Python, no torch).

A suite lists cases in priority order: the runner runs them in that order and, given a wall-time budget
(`--budget-s`), skips what would no longer fit, so the cases a suite exists for come first.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from benchmarks import estimate
from benchmarks.models import MODELS

#: short key -> the `system` label of the result (for DeepSpeed: Lightning's strategy name).
SYSTEMS = {
    "probe": "probe",
    "ceiling": "fwd+bwd ceiling",
    "ceiling-recompute": "fwd+bwd ceiling, every block recomputed",
    "plain": "plain",
    "ds2": "deepspeed_stage_2_offload",
    "ds3": "deepspeed_stage_3_offload",
    "slide": "lightning-slide",
}
OFFLOAD_SYSTEMS = ("ds2", "ds3", "slide")
CEILINGS = ("ceiling", "ceiling-recompute")  # bf16 forward + backward alone, the GPU's most per token
NVME_PATH = "/tmp/lsbench-nvme"  # the disk tier's folder: any local disk (emptied before and after a case)
Settings = tuple[tuple[str, object], ...]
Grow = Literal["micro_batch", "seq_len"]


@dataclass(frozen=True)
class Case:
    """One measurement: a system training one model at one batch shape under one VRAM cap.

    est_s is the expected wall time of the whole case process on an H200 machine (start-up, model
    build, setup, steps; benchmarks.estimate): under `--budget-s` the runner skips a case when less than
    that is left, and it kills a case that overruns its estimate several times over.
    profile_steps run after the timed window under the CUDA profiler (benchmarks.gpu_idle): one that
    leads in, the others measure the model's compute idle time. known_failure says how the case fails
    on an H200 machine (16 cores, 126 GiB RAM); it is recorded as skipped unless asked for. clip is the
    Trainer's gradient_clip_val (train.py's default is 1.0): lightning-slide then updates only after the
    backward, once the global norm is known.
    A ladder (rungs given) trains steps_per_rung steps at each size of `grow` in one process and stops
    at the first failure or when its next rung would pass time_cap_s (benchmarks.ladder).
    """

    name: str
    system: str
    model: str
    micro_batch: int = 1
    seq_len: int = 1024
    cap_gib: float | None = 24.0
    device: str = "cuda"
    warmup: int = 3
    steps: int = 10
    profile_steps: int = 3
    est_s: float = 60.0
    known_failure: str | None = None
    adam_params: int = 500_000_000
    slide_settings: Settings = ()  # SlideStrategy keyword arguments, e.g. (("recompute", "always"),)
    clip: float | None = None
    zipf: float | None = None  # token ids with a Zipf law's skew of this exponent, else uniform (`random_tokens`)
    rungs: tuple[int, ...] = ()
    grow: Grow = "micro_batch"
    steps_per_rung: int = 2
    time_cap_s: float = 0.0

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batch * self.seq_len

    @property
    def settings(self) -> dict[str, object]:
        return dict(self.slide_settings)

    @property
    def tier(self) -> str:
        """Where lightning-slide keeps the training state ("cpu" unless its settings say); "none" for others."""
        return str(self.settings.get("offload", "cpu")) if self.system == "slide" else "none"

    @property
    def is_ladder(self) -> bool:
        return bool(self.rungs)

    def rung_shape(self, size: int) -> tuple[int, int]:
        """(micro_batch, seq_len) of one rung of a ladder."""
        return (size, self.seq_len) if self.grow == "micro_batch" else (self.micro_batch, size)


#: how non-default slide settings show in case names (offload shows as the tier, nvme_path not at all)
_NAME_TAGS = {"slots": "slots-{}", "nvme_moments": "moments-{}", "recompute": "recompute-{}",
              "block_grad_buffers": "gradbufs-{}", "grad_buffers": "landing-{}", "chunk_elems": "chunk-{}",
              "loss_chunk_mib": "loss-{:g}", "activations": "acts-{}", "mlp_tile_tokens": "tiles-{}",
              "gpu_update_blocks": "gpuadam-{}", "moment_precision": "{}-moments", "master_bits": "master{}",
              "resident_moments": "resident-{}"}


def case_name(system: str, model: str, micro_batch: int, seq_len: int, cap_gib: float | None,
              settings: Settings = (), clip: float | None = None, zipf: float | None = None) -> str:
    """Names like `llama3_8b-mb64-cap24-slide-cpu` (seq appears only when it is not 1024, clip and zipf when
    set)."""
    seq = "" if seq_len == 1024 else f"-seq{seq_len}"
    clipped = "" if clip is None else f"-clip{clip:g}"
    skewed = "" if zipf is None else f"-zipf{zipf:g}"
    return f"{model}-mb{micro_batch}{seq}-{_cap(cap_gib)}-{_system_tag(system, settings)}{clipped}{skewed}"


def _cap(cap_gib: float | None) -> str:
    return "capnone" if cap_gib is None else f"cap{cap_gib:g}"


def _system_tag(system: str, settings: Settings) -> str:
    if system != "slide":
        return system
    values = dict(settings)
    tags = [_NAME_TAGS[key].format(value) for key, value in settings if key in _NAME_TAGS]
    return "-".join([system, str(values.get("offload", "cpu")), *tags])


def make(system: str, model: str, micro_batch: int = 1, seq_len: int = 1024, cap_gib: float | None = 24.0,
         name: str | None = None, est_s: float | None = None, warmup: int | None = None,
         slide_settings: Settings = (), **kw: object) -> Case:
    """A case with its canonical name, its estimated wall time and warm-up (unless given): 2 warm-up
    steps when a step takes several seconds, else 3."""
    settings, clip = dict(slide_settings), kw.get("clip")
    if clip is not None and system not in OFFLOAD_SYSTEMS:
        raise ValueError(f"clip applies to the Lightning systems {OFFLOAD_SYSTEMS}, not {system!r}")
    step = estimate.step_s(system, model, micro_batch, seq_len, settings)
    warmup = warmup if warmup is not None else (2 if step >= 3.5 else 3)
    name = name or case_name(system, model, micro_batch, seq_len, cap_gib, slide_settings, clip,  # type: ignore[arg-type]
                             kw.get("zipf"))  # type: ignore[arg-type]
    case = Case(name, system, model, micro_batch, seq_len, cap_gib, warmup=warmup, slide_settings=slide_settings,
                **kw)  # type: ignore[arg-type]
    steps = case.warmup + case.steps + case.profile_steps
    est = est_s if est_s is not None else estimate.case_s(system, model, micro_batch, seq_len, steps, settings)
    return replace(case, est_s=round(est))


def ladder(system: str, model: str, grow: Grow, rungs: tuple[int, ...], time_cap_s: float,
           cap_gib: float | None = 24.0, seq_len: int = 1024, slide_settings: Settings = (), **kw: object) -> Case:
    """A ladder case (`llama3_8b-cap24-slide-cpu-max-mb`), estimated as setup plus every rung, capped.
    The mb ladder runs at seq_len, the seq ladder at micro-batch 1."""
    dimension = "mb" if grow == "micro_batch" else "seq"
    name = f"{model}-{_cap(cap_gib)}-{_system_tag(system, slide_settings)}-max-{dimension}"
    mb, seq = (rungs[0], seq_len) if grow == "micro_batch" else (1, rungs[0])
    case = Case(name, system, model, mb, seq, cap_gib, rungs=rungs, grow=grow, time_cap_s=time_cap_s,
                profile_steps=0, slide_settings=slide_settings, **kw)  # type: ignore[arg-type]
    full = estimate.setup_s(system, model) + sum(ladder_rung_s(case, size) for size in rungs)
    return replace(case, est_s=round(min(full, time_cap_s)))


def ladder_rung_s(case: Case, size: int, measured_step_s: float | None = None, at: int | None = None) -> float:
    """Predicted seconds of one rung: its estimated steps (scaled by how a measured step at size `at`
    compared with its own estimate, when there is one) plus pinning host buffers for the new shape."""
    def step(of: int) -> float:
        return estimate.step_s(case.system, case.model, *case.rung_shape(of), case.settings)

    scale = measured_step_s / step(at) if measured_step_s and at is not None and step(at) > 0 else 1.0
    pin = estimate.pin_s(case.system, case.model, *case.rung_shape(size), case.settings)
    return case.steps_per_rung * step(size) * scale + pin


_DS3_8B_HOST_OOM = ("host memory climbs to 122 GiB of 126 during setup and the process is killed before the "
                    "first step")
_DS3_3B_MB32_OOM = "CUDA out of memory under the 24 GiB cap, allocating 15.66 GiB (the full logits tensor)"
SLOTS_AUTO: Settings = (("slots", "auto"),)
RECOMPUTE_ALWAYS: Settings = (("recompute", "always"),)  # the default ("auto") keeps graphs where VRAM is spare


def nvme(moments: float) -> Settings:
    """The disk tier with `moments` of the Adam moments on disk (0..1)."""
    return (("offload", "nvme"), ("nvme_path", NVME_PATH), ("nvme_moments", moments))


def _probe() -> Case:
    """The machine probe (PCIe and CPU-AdamW rates): the bounds of every case after it in the same run need it."""
    return make("probe", "llama3_8b", cap_gib=None, name="probe", profile_steps=0)


def _targets() -> list[Case]:
    """The cases the four targets need, in priority order: the probe and the ratios' two sides first."""
    return [
        _probe(),
        make("slide", "llama3_3b", 8),
        make("ds3", "llama3_3b", 8),
        make("ceiling", "llama3_8b", 8, cap_gib=None),
        make("slide", "llama3_8b", 64),
        make("slide", "llama3_8b", 8),
        make("ceiling-recompute", "llama3_8b", 8, cap_gib=None),  # the 64k ratio's second yardstick
        make("ceiling", "llama3_3b", 8, cap_gib=None),
        make("slide", "llama3_1b", 32),
        make("ceiling", "llama3_1b", 32, cap_gib=None),
        make("plain", "llama3_1b", 32, cap_gib=None),
        make("ds2", "llama3_3b", 8),
    ]


def _recompute() -> list[Case]:
    """Kept graphs (`recompute="auto"`, the default) against `recompute="always"` at 1B 32x1024 and 3B 8x1024,
    with the 1B ceiling and 3B ZeRO-3 offload of the same run."""
    return [
        _probe(),
        make("slide", "llama3_3b", 8),
        make("ds3", "llama3_3b", 8),
        make("slide", "llama3_1b", 32),
        make("slide", "llama3_1b", 32, slide_settings=RECOMPUTE_ALWAYS),
        make("ceiling", "llama3_1b", 32, cap_gib=None),
        make("slide", "llama3_3b", 8, slide_settings=RECOMPUTE_ALWAYS),
    ]


def _baselines() -> list[Case]:
    """lightning-slide at 3B 8x1024 beside ZeRO-2 offload and plain training (capped and uncapped), the
    ceilings the targets run leaves out, and the DeepSpeed shapes known to fail."""
    return [
        make("slide", "llama3_3b", 8),
        make("ds2", "llama3_3b", 8),
        *(make("plain", model, 8, cap_gib=None) for model in ("llama3_3b", "llama3_8b", "llama3_1b")),
        make("ceiling", "llama3_3b", 8, cap_gib=None),
        make("plain", "llama3_1b", 32, cap_gib=None),
        make("plain", "llama3_1b", 16),
        make("plain", "llama3_3b", 8),
        make("ds3", "llama3_8b", 8, known_failure=_DS3_8B_HOST_OOM),
        make("ds3", "llama3_3b", 32, known_failure=_DS3_3B_MB32_OOM),
    ]


def _grid() -> list[Case]:
    """lightning-slide at micro-batch 1/8/32/64 for 1B, 3B and 8B (seq 1024), cheapest first, then one
    sequence of 16k tokens at 8B."""
    cases = [make("slide", model, mb) for model in ("llama3_1b", "llama3_3b", "llama3_8b") for mb in (1, 8, 32, 64)]
    return sorted(cases, key=lambda case: case.est_s) + [make("slide", "llama3_8b", 1, seq_len=16384)]


def _settings() -> list[Case]:
    """lightning-slide's non-default settings at 8B, each after the default of the same shape."""
    return [
        _probe(),
        make("slide", "llama3_8b", 8),
        make("slide", "llama3_8b", 8, slide_settings=SLOTS_AUTO),
        make("slide", "llama3_8b", 8, slide_settings=(("chunk_elems", 1 << 22),)),
        make("slide", "llama3_8b", 8, slide_settings=nvme(0.0)),
        make("slide", "llama3_8b", 8, slide_settings=nvme(0.25)),
        make("slide", "llama3_8b", 64),
        make("slide", "llama3_8b", 64, slide_settings=SLOTS_AUTO),
        make("slide", "llama3_8b", 64, slide_settings=(("block_grad_buffers", 6),)),
        make("slide", "llama3_8b", 64, slide_settings=(("loss_chunk_mib", 256),)),
    ]


def _ladders() -> list[Case]:
    """How far each system goes under the 24 GiB cap (largest micro-batch at seq 1024, longest single sequence),
    lightning-slide first; ZeRO-3 offload at 8B is a known failure (host RAM during setup)."""
    seqs = (8192, 16384, 32768)
    return [
        ladder("slide", "llama3_3b", "micro_batch", (64, 96, 128), time_cap_s=120),
        ladder("slide", "llama3_8b", "micro_batch", (64, 96, 128), time_cap_s=130),
        ladder("slide", "llama3_8b", "seq_len", (32768, 65536, 131072), time_cap_s=130, steps_per_rung=1),
        ladder("slide", "llama3_3b", "seq_len", (32768, 65536, 131072), time_cap_s=150, steps_per_rung=1),
        ladder("ds3", "llama3_3b", "micro_batch", (8, 16, 24, 32), time_cap_s=200),
        ladder("ds2", "llama3_3b", "micro_batch", (8, 12, 16), time_cap_s=170),
        ladder("ds3", "llama3_3b", "seq_len", seqs, time_cap_s=200, steps_per_rung=1),
        ladder("ds2", "llama3_3b", "seq_len", seqs, time_cap_s=170, steps_per_rung=1),
        ladder("ds2", "llama3_8b", "micro_batch", (1, 2, 4, 8), time_cap_s=220),
        ladder("ds2", "llama3_8b", "seq_len", seqs, time_cap_s=220, steps_per_rung=1),
        *(ladder("plain", model, grow, rungs, time_cap_s=60)
          for model in ("llama3_3b", "llama3_8b")
          for grow, rungs in (("micro_batch", (1, 2, 4, 8)), ("seq_len", seqs))),
        *(ladder("ds3", "llama3_8b", grow, rungs, time_cap_s=200, steps_per_rung=1, known_failure=_DS3_8B_HOST_OOM)
          for grow, rungs in (("micro_batch", (1, 4, 8)), ("seq_len", seqs))),
    ]


#: the disk tier for saved inputs only (the Adam moments stay in RAM), staged through pinned RAM
ACTIVATIONS_ON_DISK: Settings = (("offload", "nvme"), ("nvme_path", NVME_PATH), ("nvme_moments", 0.0),
                                 ("activations", "nvme"), ("gds", "off"))


def _long() -> list[Case]:
    """The longest single sequences with the MLP over sequence tiles (`mlp_tile_tokens="auto"`), one step a rung.

    8B at 65,536 and 131,072 tokens: its saved inputs (34 x 1 GiB at 131,072) do not fit beside the 92 GiB of
    fp32 state in 126 GiB of RAM, so they go to the disk tier; two ring slots and two gradient buffers leave
    0.8 GiB more of the cap to the block's recompute. 3B at 196,608 and 262,144 tokens, saved inputs in pinned
    RAM (45 GiB at 262,144). Llama-3.2-3B's config declares 131,072 positions: the benchmark config stretches
    RoPE linearly past that (`benchmarks.build.hf_config`), as a run beyond the declared context must. A rung
    the planner refuses fails at once with its message, which names the longest sequence that fits.
    """
    tiles: Settings = (("mlp_tile_tokens", "auto"),)
    return [
        ladder("slide", "llama3_8b", "seq_len", (65536, 131072), time_cap_s=220, steps_per_rung=1,
               slide_settings=(*ACTIVATIONS_ON_DISK, ("slots", 2), ("block_grad_buffers", 2), *tiles)),
        ladder("slide", "llama3_3b", "seq_len", (196608, 262144), time_cap_s=410, steps_per_rung=1,
               slide_settings=tiles),
    ]


def _tiling() -> list[Case]:
    """What tiling costs end to end: 8B at one 32,768-token sequence with the MLP in tiles of 8,192 tokens and
    untiled (there "auto" leaves it untiled), three timed steps each; and 8B at 64 x 1024 tokens in tiles of
    8,192 and untiled (which "auto" picks there, its plan fitting untiled), profiled (kernel time by name)."""
    long = [make("slide", "llama3_8b", 1, seq_len=32768, warmup=1, steps=3, profile_steps=0,
                 slide_settings=(("mlp_tile_tokens", tiles),)) for tiles in (None, 8192)]
    wide = [make("slide", "llama3_8b", 64, warmup=2, steps=4, profile_steps=3,
                 slide_settings=(("mlp_tile_tokens", tiles),)) for tiles in (None, 8192)]
    return long + wide


def _smoke() -> list[Case]:
    """A tiny Llama on the CPU: exercises every code path of the harness in seconds, no GPU needed."""
    cpu = dict(cap_gib=None, device="cpu", warmup=2, steps=10, est_s=30)
    return [
        make("probe", "tiny", name="probe-cpu", adam_params=2_000_000, **cpu),
        make("ceiling", "tiny", 4, seq_len=64, **cpu),
        make("plain", "tiny", 4, seq_len=64, **cpu),
        make("slide", "tiny", 4, seq_len=64, **cpu),
        ladder("slide", "tiny", "micro_batch", (2, 4, 8), time_cap_s=60, seq_len=64, cap_gib=None, device="cpu"),
    ]


def _unique(cases: list[Case]) -> list[Case]:
    """Drop repeated names, keeping the first (highest-priority) occurrence."""
    seen: dict[str, Case] = {}
    for case in cases:
        seen.setdefault(case.name, case)
    return list(seen.values())


SUITES: dict[str, list[Case]] = {
    "targets": _targets(),
    "recompute": _recompute(),
    "baselines": _baselines(),
    "grid": _grid(),
    "settings": _settings(),
    # gradient clipping at 1.0 (train.py's default) against none, same shapes, in one run
    "clipping": [make("slide", model, mb, clip=clip)
                 for model, mb in (("llama3_8b", 8), ("llama3_3b", 8), ("llama3_8b", 64)) for clip in (1.0, None)],
    "ladders": _ladders(),
    "long": _long(),
    "tiling": _tiling(),
    # fp32 blocks updated on the GPU while the CPU updates the rest, where the CPU update bounds the step, beside the
    # probe: none, the default's balanced split ("auto"), fewer (8B) and more than it chooses, and (3B) every block
    "gpu_updates": [_probe()] + [
        make("slide", model, 8, slide_settings=() if blocks == "auto" else (("gpu_update_blocks", blocks),))
        for model, counts in (("llama3_3b", ("auto", 0, 20, 28)), ("llama3_8b", ("auto", 0, 8, 12, 20, 24)))
        for blocks in counts],
    # the step boundary at 64 x 1024 tokens: the default's split ("auto": the embedding's update on the GPU and as
    # many blocks' as the step's compute does not hide, fitted at the first micro-batch) against every update on
    # the CPU
    "boundary": [make("slide", "llama3_8b", 64, slide_settings=settings)
                 for settings in ((), (("gpu_update_blocks", 0),))],
    # the embedding's untouched rows updated ahead of its gradient (`touched_rows`), at 8B 8x1024 and 64x1024, over
    # uniform token ids and over ids with text's skew (a Zipf law of exponent 1: far fewer rows touched)
    "touched_rows": [make("slide", "llama3_8b", mb, zipf=zipf) for mb in (8, 64) for zipf in (None, 1.0)],
    # 8x1024, where the backward waits for free gradient buffers: the default 3 GPU buffers against 6, and 40 pinned
    # landing buffers (5 GiB) against 3, room for the backward's gradients to land ahead of the CPU, at 3B and 8B
    "grad_buffers": [make("slide", model, 8, slide_settings=settings) for model in ("llama3_3b", "llama3_8b")
                     for settings in ((), (("block_grad_buffers", 6),), (("grad_buffers", 40),))],
    # 8-bit Adam moments, updated on the GPU, against the fp32 CPU-AdamW bound of the probe, beside fp32 moments,
    # and with 24-bit masters (`master_bits`)
    "compact_moments": [_probe()] + [make("slide", "llama3_8b", 8, slide_settings=settings)
                                     for settings in ((), (("moment_precision", "int8"),),
                                                      (("moment_precision", "int8"), ("master_bits", 24)))],
    # fp32 moments of the lowest GPU-updated blocks kept in device memory (`resident_moments`) at 3B 8x1024, where
    # every block holds a slot and the link and the CPU bound the step, beside the default and ZeRO-3 offload
    "resident_moments": [make("slide", "llama3_3b", 8, slide_settings=settings)
                         for settings in ((), (("resident_moments", 2),), (("resident_moments", 4),))]
                        + [make("ds3", "llama3_3b", 8)],
    "smoke": _smoke(),
}
SUITES["full"] = _unique([case for name, suite in SUITES.items() if name != "smoke" for case in suite])
CASES: dict[str, Case] = {c.name: c for suite in SUITES.values() for c in suite}


def resolve(selection: list[str]) -> list[Case]:
    """Suite names and case names (space or comma separated) to cases, in the order given."""
    names = [part for item in selection for part in item.split(",") if part]
    cases: list[Case] = []
    for name in names:
        if name in SUITES:
            cases += SUITES[name]
        elif name in CASES:
            cases.append(CASES[name])
        else:
            raise SystemExit(f"Unknown case or suite {name!r}; `python -m benchmarks.run --list` lists them.")
    missing = [c.model for c in cases if c.model not in MODELS]
    if missing:
        raise SystemExit(f"Unknown model(s) {missing}")
    return _unique(cases)
