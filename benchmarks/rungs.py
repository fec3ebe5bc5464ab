"""A ladder inside the worker: one model and system, growing sizes, until the first failure (imports torch).

The bookkeeping (`Rungs`) is driven from step boundaries, by a Lightning callback for lightning-slide
and DeepSpeed and by a plain loop for plain training, so every system climbs the same way: the
first step of a rung marks it under way and resets the VRAM peaks, the last one records it, writes the
log and frees what can be freed before the next rung is predicted against the time cap.
"""

from __future__ import annotations

import gc
import resource
import time
import traceback
from pathlib import Path

import psutil
import torch

from benchmarks.build import random_tokens
from benchmarks.cases import NVME_PATH, Case
from benchmarks.ladder import LadderLog, next_rung_fits
from benchmarks.models import MODELS, step_flops

GIB = float(1 << 30)


class Rungs:
    """Step-boundary hooks that turn a stream of growing batches into a ladder log."""

    def __init__(self, case: Case, log: LadderLog, result: Path, device: torch.device, sizes: list[int],
                 started: float) -> None:
        self.case, self.log, self.result, self.device = case, log, result, device
        self.sizes, self.started = sizes, started
        self._step_start = 0.0

    def batches(self) -> list[torch.Tensor]:
        """steps_per_rung batches of random tokens per size, in order (a few MiB even at 128k tokens)."""
        spec = MODELS[self.case.model]
        out = []
        for size in self.sizes:
            micro_batch, seq_len = self.case.rung_shape(size)
            out += random_tokens(spec, micro_batch * self.case.steps_per_rung, seq_len).split(micro_batch)
        return out

    def _size(self, index: int) -> int:
        return self.sizes[index // self.case.steps_per_rung]

    def step_started(self, index: int) -> None:
        if index % self.case.steps_per_rung == 0:
            if index == 0:
                self.log.setup_s = time.perf_counter() - self.started
            self.log.start(self._size(index), "step")
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
        self._step_start = time.perf_counter()

    def step_ended(self, index: int) -> bool:
        """Record the rung after its last step; False when the ladder should stop here (all rungs ran, or
        the next one would pass the time cap)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        step_s = time.perf_counter() - self._step_start
        if (index + 1) % self.case.steps_per_rung:
            return True
        size = self._size(index)
        self.log.pass_rung(self._measured(size, step_s))
        self.log.write(self.result)
        _free(self.device)
        following = self.sizes[index // self.case.steps_per_rung + 1:]
        return bool(following) and next_rung_fits(self.case, self.log, following[0],
                                                  time.perf_counter() - self.started)

    def _measured(self, size: int, step_s: float) -> dict:
        """What a rung measured: its shape and step, model TFLOP/s (both formulas), and the peaks of the GPU, the
        process's RSS and the disk tier's files (saved inputs on disk stay there until the next shape)."""
        micro_batch, seq_len = self.case.rung_shape(size)
        tokens, spec = micro_batch * seq_len, MODELS[self.case.model]
        measured = {"size": size, "micro_batch": micro_batch, "seq_len": seq_len, "tokens": tokens,
                    "step_s": step_s, "tokens_per_s": tokens / step_s,
                    "tflops_6nt": step_flops(spec, tokens, seq_len, "6nt") / step_s / 1e12,
                    "tflops_full": step_flops(spec, tokens, seq_len, "full") / step_s / 1e12,
                    "rss_gib": psutil.Process().memory_info().rss / GIB,
                    "maxrss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB,
                    "disk_gib": disk_bytes(Path(NVME_PATH)) / GIB}
        if self.device.type == "cuda":
            measured.update(peak_vram_alloc_gib=torch.cuda.max_memory_allocated(self.device) / GIB,
                            peak_vram_reserved_gib=torch.cuda.max_memory_reserved(self.device) / GIB)
        return measured


def disk_bytes(folder: Path) -> int:
    """Bytes of the files under the disk tier's folder (0 when there is none)."""
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) if folder.is_dir() else 0


def _free(device: torch.device) -> None:
    """Give back what the last rung freed: CUDA cache blocks and, where torch has the call, cached pinned blocks."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        empty_host_cache = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
        if empty_host_cache is not None:
            empty_host_cache()


def run_ladder(case: Case, device: torch.device, result: Path, from_size: int | None, time_cap_s: float,
               started: float) -> dict:
    """Climb the case's rungs (from `from_size` on, for a retry) and return the ladder's result."""
    log = LadderLog.for_case(case, time_cap_s)
    sizes = [size for size in case.rungs if from_size is None or size >= from_size]
    rungs = Rungs(case, log, result, device, sizes, started)
    log.start(sizes[0], "setup")
    log.write(result)
    try:
        if case.system == "plain":
            _climb_plain(case, device, rungs)
        else:
            from benchmarks.lit import climb_lightning

            climb_lightning(case, device, rungs)
        if log.stopped is None and log.trying is None:
            log.stop("all rungs passed")
    except BaseException as error:  # noqa: BLE001 - the first failure is the ladder's result
        traceback.print_exc()
        log.fail(f"{type(error).__name__}: {error}")
    return log.to_result()


def _climb_plain(case: Case, device: torch.device, rungs: Rungs) -> None:
    """Plain training: the model is built on the device once (under the cap that alone may fail)."""
    from benchmarks.loops import make_step

    step = make_step(case, device, max(case.rung_shape(size)[1] for size in rungs.sizes))
    for index, batch in enumerate(rungs.batches()):
        rungs.step_started(index)
        step(batch.to(device))
        if not rungs.step_ended(index):
            return
