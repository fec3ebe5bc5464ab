"""Expected wall time of a case on an H200 machine (16 cores), for `--plan` and `--budget-s` (no torch).

Fitted to the case times of H200 runs (`wall_s` of the records in benchmarks/results/): a case costs a fixed setup
(interpreter start, model build, strategy setup; the first DeepSpeed case of a run also JIT-builds its
CPU Adam) plus its steps. A step costs a floor (the CPU update) and a per-token GPU cost: overlapped
(the larger of the two) for lightning-slide, added for DeepSpeed, whose update does not overlap compute.
The per-token cost grows with the attention share at long sequences (the FLOP formula's ratio).
Lightning-slide also pins host buffers for saved inputs at each new shape (about 1.6 GB/s), and the disk
tier writes and reads the moments it holds once per step; saved inputs on disk add their writes (a long
sequence's forward is shorter than them; their reads hide behind the backward). The runner skips a case whose
estimate no longer fits a given budget and kills one at 2.5x it, so these err long rather than short.
"""

from __future__ import annotations

from benchmarks.models import MODELS, step_flops

#: seconds from process start to the first step, less that step
SETUP_S: dict[str, dict[str, float]] = {
    "probe": {"any": 20.0},
    "ceiling": {"any": 15.0},
    "ceiling-recompute": {"any": 15.0},
    "plain": {"any": 17.0},
    "slide": {"llama3_1b": 36.0, "llama3_3b": 38.0, "llama3_8b": 52.0, "any": 5.0},
    "ds2": {"llama3_3b": 100.0, "llama3_8b": 150.0, "any": 100.0},
    "ds3": {"llama3_3b": 110.0, "llama3_8b": 180.0, "any": 110.0},
}
#: (floor s, s per token at seq 1024): slide floors are the measured small-batch steps (1.48x the
#: CPU-Adam bound), its per-token costs the measured large-batch steps; DeepSpeed's from its 3B mb8 runs.
STEP: dict[tuple[str, str], tuple[float, float]] = {
    ("ceiling", "llama3_1b"): (0.0, 1.43e-5), ("ceiling", "llama3_3b"): (0.0, 3.6e-5),
    ("ceiling", "llama3_8b"): (0.0, 7.7e-5), ("ceiling-recompute", "llama3_8b"): (0.0, 1.0e-4),
    ("plain", "llama3_1b"): (0.0, 1.59e-5), ("plain", "llama3_3b"): (0.0, 5.5e-5),
    ("plain", "llama3_8b"): (0.0, 1.2e-4),
    ("slide", "llama3_1b"): (0.41, 2.2e-5), ("slide", "llama3_3b"): (1.21, 4.7e-5),
    ("slide", "llama3_8b"): (3.02, 8.9e-5),
    ("ds2", "llama3_3b"): (3.5, 4.7e-5), ("ds3", "llama3_3b"): (4.45, 4.7e-5),
    ("ds2", "llama3_8b"): (9.0, 8.9e-5), ("ds3", "llama3_8b"): (11.0, 8.9e-5),
}
PIN_GBS = 1.0  # pinning rate the 8B mb64 case implies (pin_memory=True alone reaches about 1.6 GB/s)
DISK_GBS = 1.5  # a virtio disk, read or write (1.2-2.5 GB/s measured on the H200 machine)


def setup_s(system: str, model: str) -> float:
    table = SETUP_S[system]
    return table.get(model, table["any"])


def step_s(system: str, model: str, micro_batch: int, seq_len: int, settings: dict) -> float:
    """One training step of this shape (unknown pairs, e.g. the CPU smoke model, cost a tenth of a second)."""
    floor, per_token = STEP.get((system, model), (0.1, 0.0))
    tokens = micro_batch * seq_len
    gpu = per_token * tokens * _attention_factor(model, tokens, seq_len)
    step = max(floor, gpu) if system in ("slide", "ceiling", "ceiling-recompute", "plain") else floor + gpu
    disk = 2.0 * _moment_disk_bytes(model, settings)  # read + write, not overlapped
    if settings.get("activations") == "nvme" and model in MODELS:
        disk += _saved_input_bytes(model, tokens)  # written behind a forward shorter than the writes
    return step + disk / (DISK_GBS * 1e9)


def pin_s(system: str, model: str, micro_batch: int, seq_len: int, settings: dict) -> float:
    """Pinning host buffers for lightning-slide's saved inputs the first time a shape runs (on disk: only the
    four staging buffers, one input each)."""
    if system != "slide" or model not in MODELS:
        return 0.0
    pinned = _saved_input_bytes(model, micro_batch * seq_len)
    if settings.get("activations") == "nvme":
        pinned *= 4 / MODELS[model].layers
    return pinned / (PIN_GBS * 1e9)


def case_s(system: str, model: str, micro_batch: int, seq_len: int, steps: int, settings: dict) -> float:
    """A whole case: setup, pinning, moments written to disk once, `steps` steps."""
    moments_out = _moment_disk_bytes(model, settings) / (DISK_GBS * 1e9)
    return (setup_s(system, model) + pin_s(system, model, micro_batch, seq_len, settings) + moments_out
            + steps * step_s(system, model, micro_batch, seq_len, settings))


def _attention_factor(model: str, tokens: int, seq_len: int) -> float:
    if model not in MODELS:
        return 1.0
    spec = MODELS[model]
    return step_flops(spec, tokens, seq_len, "full", True) / step_flops(spec, tokens, 1024, "full", True)


def _saved_input_bytes(model: str, tokens: int) -> float:
    spec = MODELS[model]
    return float(spec.layers * tokens * spec.hidden * 2)


def _moment_disk_bytes(model: str, settings: dict) -> float:
    if settings.get("offload") != "nvme" or model not in MODELS:
        return 0.0
    return 8.0 * MODELS[model].params * float(settings.get("nvme_moments") or 0.0)
