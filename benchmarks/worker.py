"""One case in one process: `python -m benchmarks.worker --case NAME --result FILE [--time-cap-s S]`.

The runner starts this for every case, so an out-of-memory error, a host-RAM kill or a broken CUDA
state ends only this case. It writes what it measured to FILE (also when it fails, with the error),
and the runner adds what only the parent can see (the process tree's peak RSS, the exit status).
A ladder writes FILE after every rung too, so what it passed survives a kill (benchmarks.ladder).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import sys
import time
import traceback
from pathlib import Path

import torch

from benchmarks.cases import CASES, CEILINGS, Case
from benchmarks.ladder import write_json

GIB = float(1 << 30)


def _setup_device(case: Case) -> torch.device:
    """The compute device, with the case's VRAM cap set before anything is allocated on it."""
    if case.device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("this case needs CUDA and none is available (run the smoke suite on a CPU machine)")
    device = torch.device("cuda", 0)
    if case.cap_gib is not None:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, case.cap_gib * GIB / total), device)
    return device


def _measure(case: Case, device: torch.device) -> dict:
    if case.system == "probe":
        from benchmarks.loops import run_probe

        return run_probe(case, device)
    if case.system in (*CEILINGS, "plain"):
        from benchmarks.loops import run_timed

        return run_timed(case, device)
    from benchmarks.lit import run_lightning

    return run_lightning(case, device)


def _trained(measured: dict) -> tuple[bool, str | None]:
    """A timed case counts only if its loss stayed finite: on NaN weights the same step is another workload."""
    step = measured.get("first_nonfinite_step")
    if step is None:
        return True, None
    return False, (f"the loss was not finite from step {step} of {len(measured['loss_steps'])} on: the timings measure "
                   "arithmetic on NaN, not training")


def _device_facts(device: torch.device) -> dict:
    """What the child alone can read: the GPU, its memory peaks, the CUDA build."""
    facts: dict = {"child_maxrss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB}
    if device.type == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(device)
        facts.update(gpu=props.name, gpu_mem_gib=props.total_memory / GIB, cuda=torch.version.cuda,
                     peak_vram_alloc_gib=torch.cuda.max_memory_allocated(device) / GIB,
                     peak_vram_reserved_gib=torch.cuda.max_memory_reserved(device) / GIB)
    return facts


def _prefer_oom_kill() -> None:
    """Make this process, not the runner, the one the kernel kills when host memory runs out."""
    with contextlib.suppress(OSError):
        Path("/proc/self/oom_score_adj").write_text("1000")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--case", required=True, choices=sorted(CASES))
    parser.add_argument("--result", required=True, type=Path)
    parser.add_argument("--time-cap-s", type=float, help="a ladder's time cap (default: the case's)")
    parser.add_argument("--from-size", type=int, help="a ladder's first rung (a retry in a fresh process)")
    args = parser.parse_args(argv)
    case = CASES[args.case]
    _prefer_oom_kill()
    started = time.perf_counter()
    out: dict = {"ok": False, "error": None}
    device = torch.device(case.device)
    try:
        device = _setup_device(case)
        if case.is_ladder:
            from benchmarks.rungs import run_ladder

            out.update(run_ladder(case, device, args.result, args.from_size, args.time_cap_s or case.time_cap_s,
                                  started))
        else:
            out.update(_measure(case, device))
            out["ok"], out["error"] = _trained(out)
    except BaseException as error:  # noqa: BLE001 - every failure is a result to record
        traceback.print_exc()
        out["error"] = f"{type(error).__name__}: {error}"[:4000]
    try:
        out.update(_device_facts(device))
    except Exception as error:  # noqa: BLE001 - a broken CUDA context must not cost the case its result
        out["device_facts_error"] = str(error)[:500]
    if "first_step_at" in out:
        out["time_to_first_step_s"] = out.pop("first_step_at") - started
    out["worker_wall_s"] = time.perf_counter() - started
    write_json(args.result, out)
    sys.stdout.flush()
    os._exit(0 if out["ok"] else 1)  # skip interpreter teardown: strategy threads must not hang the exit


if __name__ == "__main__":
    raise SystemExit(main())
