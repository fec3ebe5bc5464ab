"""The capacity run: full-parameter AdamW (fp32 master and moments) of a model too big for this box's RAM,
with part of the moments on disk, under a 24 GiB GPU cap; also any model/tier, to set measured peaks next
to the planner's prediction.

    python -m benchmarks.capacity --model qwen3_14b --steps 3 --micro-batch 8 --out $OUT
    python -m benchmarks.capacity --model llama3_8b --nvme-moments 0.1 --activations nvme --out $OUT
    python -m benchmarks.capacity --model llama3_8b --offload cpu --moment-precision int8 --clip 1.0 --out $OUT

Writes `capacity-<model>-<offload>.json`: step times, tokens/s, the planner's prediction of what lives where next to
the measured peaks (host RSS polled every 0.2 s, VRAM allocated/reserved, bytes of the disk tier's files),
the engine's transfer and disk counters (running totals, and each step's own: the first steps load every unit
and grow the window, so the totals' mean is not a steady step's), and the machine. The model is built on the meta
device and filled unit by unit straight into the engine's storage (random init on the GPU), so it never exists twice.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

import lightning.pytorch as pl
import psutil
import torch
from torch.utils.data import DataLoader

from benchmarks.lit import allocator_stats
from benchmarks.records import engine_per_step
from lightning_slide import SlideStrategy
from lightning_slide.lm import CausalLMModule
from lightning_slide.models import build_model
from lightning_slide.tiers import backend_name

GiB = 2**30


class Peaks(threading.Thread):
    """Polls host RSS and the disk tier's bytes on disk; the peaks are what the run really needed."""

    def __init__(self, folder: Path) -> None:
        super().__init__(daemon=True)
        self.folder, self.rss, self.disk, self.stop = folder, 0, 0, threading.Event()
        self.start()

    def run(self) -> None:
        me = psutil.Process()
        while not self.stop.wait(0.2):
            self.rss = max(self.rss, me.memory_info().rss)
            self.disk = max(self.disk, sum(f.stat().st_size for f in self.folder.rglob("*") if f.is_file()))


class StepClock(pl.Callback):
    """Wall time per optimizer step (the first includes setup's tail) and the engine's counters after each."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.stats: dict = {}
        self.by_step: list[dict] = []  # the counters' growth over each step
        self._last = time.perf_counter()

    def on_train_batch_end(self, trainer, *args) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # a capacity run's steps take tens of seconds: a sync per step is noise
        now = time.perf_counter()
        self.times.append(now - self._last)
        self._last = now
        before, self.stats = self.stats, {**trainer.strategy.engine.stats(), **allocator_stats()}
        self.by_step.append(engine_per_step({"start": before or {"steps": 0}, "end": self.stats}))
        print(f"step {len(self.times)}: {self.times[-1]:.1f} s, rss {psutil.Process().memory_info().rss / GiB:.1f} GiB,"
              f" {self.stats}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3_14b")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--cap-gib", type=float, default=24.0)
    parser.add_argument("--offload", default="nvme", choices=["cpu", "nvme"])
    parser.add_argument("--activations", default="auto", choices=["auto", "device", "cpu", "nvme"])
    parser.add_argument("--nvme-path", default="/tmp/lsbench-nvme")
    parser.add_argument("--nvme-moments", type=float, default=None, help="default: the least that fits RAM")
    parser.add_argument("--nvme-master", action="store_true", help="the disk units' fp32 master on disk too")
    parser.add_argument("--moment-precision", default="fp32", choices=["fp32", "bf16", "int8"])
    parser.add_argument("--clip", type=float, default=None, help="gradient_clip_val (global norm)")
    parser.add_argument("--out", default=".")
    parser.add_argument("--commit", default="unknown")
    args = parser.parse_args()

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")  # CPU: a smoke test
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * GiB / total), device)
    folder = Path(args.nvme_path)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    peaks, clock = Peaks(folder), StepClock()

    started = time.perf_counter()
    model = build_model(args.model, meta=True)
    module = CausalLMModule(model, lr=1e-5, warmup_steps=0)
    vocab = model.config.vocab_size
    tokens = torch.randint(0, vocab, (args.steps * args.micro_batch, args.seq_len),
                           generator=torch.Generator().manual_seed(0))
    data = DataLoader([{"input_ids": t, "attention_mask": torch.ones_like(t), "labels": t} for t in tokens],
                      batch_size=args.micro_batch)
    disk = dict(nvme_path=str(folder), nvme_moments=args.nvme_moments,
                nvme_master=args.nvme_master) if args.offload == "nvme" else {}
    strategy = SlideStrategy(offload=args.offload, activations=args.activations, slots="auto",
                             moment_precision=args.moment_precision, **disk)
    trainer = pl.Trainer(strategy=strategy, accelerator=device.type, devices=1,
                         precision="bf16-mixed" if device.type == "cuda" else "32-true",
                         max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, callbacks=[clock],
                         gradient_clip_val=args.clip)
    error = None
    try:
        trainer.fit(module, data)
    except Exception as e:  # noqa: BLE001 - the failure is a result of the run
        error = repr(e)
    peaks.stop.set()
    peaks.join()

    n = sum(p.numel() for p in model.parameters())
    steady = clock.times[1:] or clock.times
    plan = strategy.plan
    record = {
        "command": " ".join([sys.executable, "-m", "benchmarks.capacity", *sys.argv[1:]]),
        "commit": args.commit, "date": time.strftime("%Y-%m-%d"), "ok": error is None, "error": error,
        "machine": {"gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                    "cpu": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count(), "ram_gib": psutil.virtual_memory().total / GiB,
                    "torch": torch.__version__, "disk_io": backend_name()},
        "model": args.model, "params": n, "micro_batch": args.micro_batch, "seq_len": args.seq_len,
        "tokens_per_step": args.micro_batch * args.seq_len, "vram_cap_gib": args.cap_gib,
        "gradient_clip_val": args.clip, "peak_rss_bytes_per_param": peaks.rss / n,
        "settings": asdict(strategy.config), "wall_s": time.perf_counter() - started,
        "step_s": clock.times,
        "tokens_per_s": args.micro_batch * args.seq_len / (sum(steady) / len(steady)) if steady else None,
        "measured": {"peak_rss_gib": peaks.rss / GiB, "peak_disk_gib": peaks.disk / GiB, **_vram(device)},
        "planned": None if plan is None else {
            "entries": [{"what": e.what, "where": e.where, "gib": e.bytes / GiB} for e in plan.entries],
            "total_gib": {w: plan.total(w) / GiB for w in ("gpu", "pinned", "ram", "disk")}},
        "engine": clock.stats,
        "engine_by_step": clock.by_step,
    }
    variant = (f"-mb{args.micro_batch}" if args.micro_batch != 8 else "") + ("-master" if args.nvme_master else "") + (
        f"-{args.moment_precision}" if args.moment_precision != "fp32" else "") + ("-clip" if args.clip else "")
    out = Path(args.out) / f"capacity-{args.model}-{args.offload}{variant}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2))
    print(json.dumps({k: record[k] for k in ("ok", "error", "step_s", "tokens_per_s", "measured",
                                             "peak_rss_bytes_per_param")}, indent=2))


def _vram(device: torch.device) -> dict:
    if device.type != "cuda":
        return {}
    return {"peak_vram_alloc_gib": torch.cuda.max_memory_allocated(device) / GiB,
            "peak_vram_reserved_gib": torch.cuda.max_memory_reserved(device) / GiB}


if __name__ == "__main__":
    main()
