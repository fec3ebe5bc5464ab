"""The benchmark cases, their suites, and the order they run in (plain Python, no torch).

A suite lists case names in priority order: the runner runs them in that order and skips what no
longer fits its time budget, so the cases the targets need come first.
"""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.models import MODELS

#: short key -> the `system` label of the result (for DeepSpeed: Lightning's strategy name).
SYSTEMS = {
    "probe": "probe",
    "ceiling": "fwd+bwd ceiling",
    "plain": "plain",
    "ds2": "deepspeed_stage_2_offload",
    "ds3": "deepspeed_stage_3_offload",
    "slide": "lightning-slide",
}
OFFLOAD_SYSTEMS = ("ds2", "ds3", "slide")


@dataclass(frozen=True)
class Case:
    """One measurement: a system training one model at one batch shape under one VRAM cap.

    est_s is the expected wall time of the whole case process on the GPU machine (start-up, model
    build, setup, steps): the runner skips a case when less than that is left of its budget.
    chain names a ladder of growing sizes: once one size fails, the larger ones are not tried.
    known_failure says why the case is not run unless asked (it was seen failing before).
    """

    name: str
    system: str
    model: str
    micro_batch: int = 1
    seq_len: int = 1024
    cap_gib: float | None = 24.0
    tier: str = "none"
    device: str = "cuda"
    warmup: int = 3
    steps: int = 10
    est_s: float = 60.0
    chain: str | None = None
    known_failure: str | None = None
    adam_params: int = 500_000_000
    slide_settings: tuple[tuple[str, object], ...] = ()  # extra SlideStrategy settings, e.g. (("h2d_source", "shadow"),)

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batch * self.seq_len


def case_name(system: str, model: str, micro_batch: int, seq_len: int, cap_gib: float | None,
              tier: str = "none") -> str:
    """Names like `llama3_8b-mb64-cap24-slide-cpu` (seq appears only when it is not 1024)."""
    seq = "" if seq_len == 1024 else f"-seq{seq_len}"
    cap = "capnone" if cap_gib is None else f"cap{cap_gib:g}"
    suffix = f"-{tier}" if system == "slide" else ""
    return f"{model}-mb{micro_batch}{seq}-{cap}-{system}{suffix}"


def make(system: str, model: str, micro_batch: int = 1, seq_len: int = 1024, cap_gib: float | None = 24.0,
         tier: str | None = None, name: str | None = None, **kw: object) -> Case:
    """A case with its canonical name (unless named); slide defaults to the cpu tier, others to none."""
    tier = tier or ("cpu" if system == "slide" else "none")
    name = name or case_name(system, model, micro_batch, seq_len, cap_gib, tier)
    return Case(name, system, model, micro_batch, seq_len, cap_gib, tier, **kw)  # type: ignore[arg-type]


_DS3_8B_HOST_OOM = ("ANCHORS 2026-11-29: host memory climbed to 122 GiB during setup and the process "
                    "was killed before the first step")
_DS3_3B_MB32_OOM = "ANCHORS 2026-11-29: CUDA out of memory allocating 15.66 GiB (the full logits tensor)"


def _targets() -> list[Case]:
    """The cases the four targets need, in priority order: about 8.5 minutes on the GPU machine
    without ZeRO-2, which comes last and runs only if the budget still has room for it."""
    return [
        make("probe", "llama3_8b", cap_gib=None, name="probe", est_s=20),
        make("slide", "llama3_3b", 8, est_s=50),
        make("ds3", "llama3_3b", 8, warmup=2, est_s=150),
        make("ceiling", "llama3_8b", 8, cap_gib=None, est_s=25),
        make("slide", "llama3_8b", 64, warmup=2, est_s=130),
        make("slide", "llama3_8b", 8, est_s=70),
        make("ceiling", "llama3_3b", 8, cap_gib=None, est_s=20),
        make("slide", "llama3_1b", 32, est_s=40),
        make("ceiling", "llama3_1b", 32, cap_gib=None, est_s=15),
        make("plain", "llama3_1b", 32, cap_gib=None, est_s=25),
        make("ds2", "llama3_3b", 8, warmup=2, est_s=80),
    ]


def _more() -> list[Case]:
    """The other fixed cases: remaining baselines and micro-batches, the long sequence, capped plain."""
    cases = [
        make("plain", "llama3_3b", 8, cap_gib=None, est_s=25),
        make("slide", "llama3_1b", 32, est_s=40),
        make("slide", "llama3_8b", 1, seq_len=16384, est_s=90),
        make("slide", "llama3_8b", 8, tier="nvme", est_s=120),
        make("ceiling", "llama3_1b", 32, cap_gib=None, est_s=20),
        make("plain", "llama3_1b", 16, est_s=20),
        make("plain", "llama3_3b", 8, est_s=20),
        make("ds3", "llama3_8b", 8, warmup=2, est_s=180, known_failure=_DS3_8B_HOST_OOM),
        make("ds3", "llama3_3b", 32, warmup=2, est_s=120, known_failure=_DS3_3B_MB32_OOM),
    ]
    for model, slow in (("llama3_1b", 1.0), ("llama3_3b", 1.5), ("llama3_8b", 3.0)):
        for mb in (1, 8, 32, 64):
            cases.append(make("slide", model, mb, est_s=30 * slow + mb * slow / 2))
        cases.append(make("plain", model, 8, cap_gib=None, est_s=20 * slow))
    return cases


def _ladders() -> list[Case]:
    """Largest micro-batch (seq 1024) and longest single sequence under the 24 GiB cap, 3B and 8B.

    One case per size, each in its own process; a ladder stops at its first failure.
    """
    cases = []
    for model, slow in (("llama3_3b", 1.0), ("llama3_8b", 2.5)):
        for system, mbs in (("slide", (64, 128, 256)), ("ds3", (16, 32)), ("ds2", (16, 32, 64))):
            chain = f"{model}-{system}-max-mb"
            cases += [make(system, model, mb, warmup=1, steps=2, chain=chain, est_s=60 * slow + mb / 2)
                      for mb in mbs]
        for system, seqs in (("slide", (16384, 32768, 65536)), ("ds3", (8192, 16384)), ("ds2", (8192, 16384))):
            chain = f"{model}-{system}-max-seq"
            cases += [make(system, model, 1, seq_len=seq, warmup=1, steps=2, chain=chain,
                           est_s=60 * slow + seq / 1024) for seq in seqs]
    return cases


def _smoke() -> list[Case]:
    """A tiny Llama on the CPU: exercises every code path of the harness in seconds, no GPU needed."""
    cpu = dict(cap_gib=None, device="cpu", warmup=2, steps=10, est_s=30)
    return [
        make("probe", "tiny", name="probe-cpu", adam_params=2_000_000, **cpu),
        make("ceiling", "tiny", 4, seq_len=64, **cpu),
        make("plain", "tiny", 4, seq_len=64, **cpu),
        make("slide", "tiny", 4, seq_len=64, **cpu),
    ]


def _unique(cases: list[Case]) -> list[Case]:
    """Drop repeated names, keeping the first (highest-priority) occurrence."""
    seen: dict[str, Case] = {}
    for case in cases:
        seen.setdefault(case.name, case)
    return list(seen.values())


SUITES: dict[str, list[Case]] = {
    "targets": _targets(),
    "more": _unique([c for c in _more() if c.name not in {t.name for t in _targets()}]),
    "ladders": _ladders(),
    "smoke": _smoke(),
    # what a load reads from host memory: the pinned fp32 master (default) or a pinned bf16 shadow copy
    "h2d": [make("slide", "llama3_8b", 8, name="llama3_8b-mb8-cap24-slide-cpu-shadow", est_s=90,
                 slide_settings=(("h2d_source", "shadow"),))],
}
SUITES["full"] = _unique(SUITES["targets"] + SUITES["more"] + SUITES["ladders"])
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
