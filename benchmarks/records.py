"""Result records (one JSON object per case, each naming its command, commit, date and machine) and what
is derived from a whole run.

Derived fields are computed from the run's own measurements, never from constants: the GPU compute
bound from this run's fwd+bwd ceiling of the same model, the PCIe bound from this run's pinned copy
bandwidth, the CPU update bound from this run's fused CPU AdamW rate. Plain Python (no torch).
"""

from __future__ import annotations

import dataclasses

from benchmarks.cases import OFFLOAD_SYSTEMS, SYSTEMS, Case
from benchmarks.models import FLOP_FORMULAS, MODELS, step_flops

#: running counts besides the seconds and bytes that `engine_per_step` turns into per-step figures: the CUDA
#: allocator's device-wide synchronisations (`lit.allocator_stats`)
COUNTS = ("alloc_retries", "device_frees")

BOUNDS_FORMULA = {
    "gpu_compute": "work FLOPs (FLOP_FORMULAS['full'], with one more block forward when the system recomputes) "
                   "/ the FLOP rate of this run's fwd+bwd ceiling of the same model",
    "pcie": "max(h2d bytes / h2d GB/s, d2h bytes / d2h GB/s, all bytes / both-ways GB/s), pinned rates of this "
            "run; bytes as the engine counted them when it reports h2d_bytes/d2h_bytes, else the traffic model",
    "cpu_update": "N (all params) / this run's torch.optim.AdamW(fused=True) CPU rate on 5e8 params",
}
TRAFFIC = {
    "slide": "h2d: weights twice per step (fwd, bwd) as the fp32 master (4 B/param); d2h: fp32 grads (4 B/param; "
             "our runtime sends fp32 grads); + unit inputs both ways when activations='cpu'",
    "ds2": "h2d: bf16 params after the CPU update (2 B/param); d2h: bf16 grads (2 B/param)",
    "ds3": "h2d: bf16 params fetched for fwd and bwd (4 B/param); d2h: bf16 grads (2 B/param)",
}
HINTS = {
    "gpu_compute": "recompute costs 8NT instead of 6NT: keep more activations in spare VRAM, fuse kernels",
    "pcie": "fewer PCIe bytes per param: more units resident (slots), fewer bytes per parameter each way "
            "(docs/alternatives.md lists what lost)",
    "cpu_update": "fewer host-memory bytes per param in and around the update, or a faster update where the "
                  "optimizer thread is not busy most of the step (docs/alternatives.md lists what lost)",
}
EXPOSED_MEANING = (
    "idle time of the model's compute per step, from a CUDA profile of steps after the timed window: the profiled "
    "step minus the union of the model's kernels, those of the stream it computes on and of any other stream that "
    "ran a matrix product (the fused loss's grad_x GEMMs; benchmarks/gpu_idle.py); idle_copying: while copies or "
    "other streams' kernels ran (idle_beside_kernels: those kernels, a part of it), idle_empty: while the GPU did "
    "nothing; compute_stream_idle: the compute stream's own idle time, its waits for the loss's second stream "
    "included")


def base_record(case: Case) -> dict:
    """Everything known before the case runs: its identity, shape and the FLOP formula used."""
    spec = MODELS[case.model]
    return {
        "case": case.name, "system": SYSTEMS[case.system], "system_key": case.system,
        "ok": False, "error": None, "model": spec.label, "model_key": case.model,
        "model_config": {**dataclasses.asdict(spec), "attention": "sdpa", "init": "N(0, 0.02), norms 1"},
        "params": spec.params, "params_no_embedding": spec.params_no_embedding,
        "micro_batch": case.micro_batch, "seq_len": case.seq_len, "tokens_per_step": case.tokens_per_step,
        "accumulate": 1, "gradient_clip_val": case.clip, "vram_cap_gib": case.cap_gib, "tier": case.tier,
        "slide_settings": case.settings,
        "device": case.device, "timed_steps": case.steps, "warmup_steps": case.warmup,
        "profile_steps": case.profile_steps,
        "flop_formula": FLOP_FORMULAS["6nt"], "flop_formula_full": FLOP_FORMULAS["full"],
        "data": ("uniform random token ids" if case.zipf is None else f"token ids with a Zipf law's skew "
                 f"(exponent {case.zipf:g}, ranks shuffled over the vocabulary)") + ", fixed seed, every token "
                "real (no padding)",
    }


def finalize(records: list[dict]) -> None:
    """Fill in TFLOP/s, bounds, binding bound, exposed time and same-run baseline of every timed case, in
    place. The binding bound needs all three bounds: with one missing (no probe or no ceiling of that
    model in the run) it is None rather than the larger of the other two."""
    probe = next((r for r in records if r["system_key"] == "probe" and r["ok"]), None)
    for record in records:
        if not record["ok"] or record["system_key"] == "probe" or record.get("ladder"):
            continue
        _add_tflops(record)
        record["exposed_s"] = exposed(record.get("gpu_idle"))
        if record.get("engine_stats"):
            record["engine_per_step"] = engine_per_step(record["engine_stats"])
        record["bounds_s"] = _bounds(record, probe, _ceiling(records, record["model_key"]))
        record["bounds_formula"] = {**BOUNDS_FORMULA, "traffic": TRAFFIC.get(record["system_key"], "none")}
        bounds = record["bounds_s"]
        record["binding"] = None if None in bounds.values() else max(bounds, key=bounds.get)
        record["baseline_of_same_run"] = _baseline(records, record)


def _add_tflops(record: dict) -> None:
    spec = MODELS[record["model_key"]]
    for formula in ("6nt", "full"):
        flops = step_flops(spec, record["tokens_per_step"], record["seq_len"], formula)
        record[f"tflops_{formula}"] = flops / record["step_s_mean"] / 1e12


def _ceiling(records: list[dict], model: str) -> dict | None:
    """This run's fwd+bwd ceiling of the model (the one with the most tokens per step)."""
    ceilings = [r for r in records if r["ok"] and r["system_key"] == "ceiling" and r["model_key"] == model]
    return max(ceilings, key=lambda r: r["tokens_per_step"], default=None)


def recomputes(record: dict) -> bool:
    """Whether the system runs each block's forward twice (per-unit recompute / checkpointing)."""
    if record["system_key"] == "slide":
        return bool(_engine_value(record, "recompute", default=True))
    return record["system_key"] in ("ds2", "ds3")


def _bounds(record: dict, probe: dict | None, ceiling: dict | None) -> dict:
    spec = MODELS[record["model_key"]]
    gpu = None
    if ceiling is not None:
        rate = step_flops(spec, ceiling["tokens_per_step"], ceiling["seq_len"], "full") / ceiling["step_s_mean"]
        gpu = step_flops(spec, record["tokens_per_step"], record["seq_len"], "full", recomputes(record)) / rate
    offload = record["system_key"] in OFFLOAD_SYSTEMS
    pcie = cpu = 0.0 if not offload else None
    if offload and probe is not None:
        cpu = spec.params / probe["adam"]["params_per_s"]
        pcie = _pcie_s(record, probe.get("pcie"))
    return {"gpu_compute": gpu, "pcie": pcie, "cpu_update": cpu}


def _pcie_s(record: dict, pcie: dict | None) -> float | None:
    if not pcie:
        return None
    h2d, d2h = traffic_bytes(record)
    return max(h2d / (pcie["h2d_gbs"] * 1e9), d2h / (pcie["d2h_gbs"] * 1e9), (h2d + d2h) / (pcie["bidir_gbs"] * 1e9))


def traffic_bytes(record: dict) -> tuple[float, float]:
    """Bytes per step host->device and device->host: as the engine counted them if it did, else by
    the system's traffic model (TRAFFIC)."""
    engine = engine_per_step(record.get("engine_stats") or {})
    if "h2d_bytes" in engine and "d2h_bytes" in engine:
        return float(engine["h2d_bytes"]), float(engine["d2h_bytes"])
    n = record["params"]
    system = record["system_key"]
    if system == "ds2":
        return 2.0 * n, 2.0 * n
    if system == "ds3":
        return 4.0 * n, 2.0 * n
    config = record.get("slide_config") or {}
    spec = MODELS[record["model_key"]]
    activations = spec.layers * record["tokens_per_step"] * spec.hidden * 2 if config.get("activations") == "cpu" else 0
    return 8.0 * n + activations, 4.0 * n + activations


def engine_per_step(stats: dict) -> dict:
    """Per-step seconds and bytes from the engine's stats snapshots at the window's start and end.

    If the snapshots carry a step counter `steps`, the values are read as running totals and the
    window's difference is divided by its steps; otherwise the end snapshot is taken as per-step. A dict of
    such values (e.g. waits per unit) is treated the same way, key by key.
    """
    start, end = stats.get("start") or {}, stats.get("end") or {}
    steps = end.get("steps", 0) - start.get("steps", 0) if isinstance(start.get("steps"), (int, float)) else 0

    def per_step(now: object, before: object) -> object:
        if isinstance(now, dict):
            before = before if isinstance(before, dict) else {}
            return {k: per_step(v, before.get(k, 0)) for k, v in now.items()}
        return (now - before) / steps if steps > 0 else now

    return {k: per_step(v, start.get(k, 0)) for k, v in end.items() if (k.endswith(("_s", "_bytes")) or k in COUNTS)
            and (isinstance(v, dict) or (isinstance(v, (int, float)) and not isinstance(v, bool)))}


def _engine_value(record: dict, key: str, default: object) -> object:
    return ((record.get("engine_stats") or {}).get("end") or {}).get(key, default)


def exposed(gpu_idle: dict | None) -> dict | None:
    """Mean seconds per profiled step of the model's idle time (EXPOSED_MEANING), and its share of the
    profiled step; None when nothing was profiled (CPU runs), the profile's error when it failed."""
    if not gpu_idle:
        return None
    if gpu_idle.get("error") or not gpu_idle.get("steps"):
        return {"total": None, "error": gpu_idle.get("error") or "no profiled step"}

    def mean(key: str) -> float:
        return sum(gpu_idle[key]) / len(gpu_idle[key])

    return {"total": mean("idle_s"), "share": sum(gpu_idle["idle_s"]) / sum(gpu_idle["step_s"]),
            "idle_copying": mean("idle_copying_s"), "idle_empty": mean("idle_empty_s"),
            "idle_beside_kernels": mean("idle_beside_kernels_s") if "idle_beside_kernels_s" in gpu_idle else None,
            "compute_stream_idle": mean("idle_compute_stream_s") if "idle_compute_stream_s" in gpu_idle else None,
            "compute_busy": mean("busy_s"), "profiled_step": mean("step_s"), "steps": gpu_idle["steps"],
            "meaning": EXPOSED_MEANING}


def tier_label(record: dict) -> str:
    """The tier and any non-default setting that shapes it: `nvme, nvme_moments=0.25`, `cpu, slots=auto`,
    `cpu, clip=1` (the Trainer's gradient clipping)."""
    extra = [f"{k}={v}" for k, v in (record.get("slide_settings") or {}).items() if k not in ("offload", "nvme_path")]
    clip = record.get("gradient_clip_val")
    return ", ".join([str(record.get("tier")), *extra, *([f"clip={clip:g}"] if clip is not None else [])])


def _baseline(records: list[dict], record: dict) -> dict | None:
    """The same run's reference for this case: for lightning-slide, DeepSpeed ZeRO-3 (else ZeRO-2, else
    plain) on the same shape, else the model's fwd+bwd ceiling; None for the baselines themselves."""
    if record["system_key"] != "slide":
        return None
    shape = ("model_key", "micro_batch", "seq_len")
    same = [r for r in records if r["ok"] and all(r[k] == record[k] for k in shape)]
    for system in ("ds3", "ds2", "plain"):
        match = next((r for r in same if r["system_key"] == system), None)
        if match:
            return {"case": match["case"], "tokens_per_s": match["tokens_per_s"],
                    "ratio": record["tokens_per_s"] / match["tokens_per_s"]}
    ceiling = _ceiling(records, record["model_key"])
    if ceiling is None:
        return None
    return {"case": ceiling["case"], "tokens_per_s": ceiling["tokens_per_s"],
            "ratio": record["tokens_per_s"] / ceiling["tokens_per_s"]}
