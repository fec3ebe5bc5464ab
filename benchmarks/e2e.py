"""The CLI end to end, as a user runs it: train with validation and checkpoints, SIGKILL, resume, finish,
export, reload the export with `from_pretrained` and compare it with the trained weights.

    python -m benchmarks.e2e --model llama3_8b --out DIR [--cap-gib 24] [--crash]

Each `train.py` runs in its own process (`benchmarks.cli`, under the GPU cap), polled every 0.2 s for its peak
RSS, its checkpoint files (when a save starts and ends) and its export folder. With `--crash` the first run is
SIGKILLed once its first checkpoint is complete, and a second run resumes from `last.ckpt` to the end. Without
it, checkpointing is off (`checkpoint=null`: for a model whose checkpoint the disk cannot hold). Writes
DIR/e2e-<model>.json: one record with the command lines, step rate, peaks against the plan, save and export
times (each save's GB/s beside the disk's own sequential write rate, measured in the work folder first), the
reload check and the tail of each run's log (whole logs stay in the work folder).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GIB = float(1 << 30)
POLL_S = 0.2


@dataclass
class Watch:
    """What polling a running CLI process saw."""

    peak_rss_gib: float = 0.0
    peak_anon_gib: float = 0.0  # resident memory not backed by a file (RssAnon + RssShmem), at its highest poll
    saves: dict[str, list] = field(default_factory=dict)  # checkpoint name -> [first seen, complete] (s)
    export_s: list = field(default_factory=list)  # [started, finished]
    killed_at_s: float | None = None


def _memory_gib(pid: int) -> tuple[float, float]:
    """A live process's peak resident set (Linux VmHWM) and its resident memory not backed by files now
    (RssAnon + RssShmem: what the planner counts; a checkpoint loaded with mmap adds clean file pages to the
    resident set, which the kernel drops under pressure); zeros when it has gone."""
    fields: dict[str, float] = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmHWM", "RssAnon", "RssShmem"):
                fields[key] = int(value.split()[0]) * 1024 / GIB
    except (FileNotFoundError, ProcessLookupError):
        pass
    return fields.get("VmHWM", 0.0), fields.get("RssAnon", 0.0) + fields.get("RssShmem", 0.0)


def _observe(run_dir: Path, watch: Watch, t: float) -> None:
    """Note when checkpoint files (written as `<name>.tmp-<pid>`, then renamed) and the export folder appear
    and complete."""
    ckpts = run_dir / "checkpoints"
    for f in ckpts.iterdir() if ckpts.is_dir() else []:
        name, writing = f.name.split(".tmp-")[0], ".tmp-" in f.name
        span = watch.saves.setdefault(name, [t, None])
        if not writing and span[1] is None:
            span[1] = t
    if (run_dir / ".hf_model.partial").exists() and not watch.export_s:  # the export writes there, then renames
        watch.export_s = [t, None]
    if (run_dir / "hf_model").is_dir() and watch.export_s and watch.export_s[1] is None:
        watch.export_s[1] = t


def _saved(watch: Watch) -> bool:
    """A checkpoint is complete and `last.ckpt` names it."""
    return watch.saves.get("last.ckpt", [0, None])[1] is not None and any(
        end is not None for name, (_, end) in watch.saves.items() if name != "last.ckpt")


def run_cli(name: str, overrides: list[str], work: Path, run_dir: Path, cap_gib: float | None,
            kill_after_save: bool = False, timeout_s: float = 540) -> dict:
    """One `train.py` process; with `kill_after_save`, SIGKILL it once its first checkpoint is complete. Its log
    and peaks go to `work`; the record keeps the log's tail."""
    peaks = work / f"{name}-peaks.json"
    cmd = [sys.executable, "-m", "benchmarks.cli", *(["--cap-gib", str(cap_gib)] if cap_gib else []),
           "--peaks", str(peaks), "--", *overrides, f"hydra.run.dir={run_dir}"]
    log = (work / f"{name}.log").open("w")
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=_env())
    watch = Watch()
    while proc.poll() is None and time.perf_counter() - start < timeout_s:
        t = time.perf_counter() - start
        hwm, anon = _memory_gib(proc.pid)
        watch.peak_rss_gib, watch.peak_anon_gib = max(watch.peak_rss_gib, hwm), max(watch.peak_anon_gib, anon)
        _observe(run_dir, watch, t)
        if kill_after_save and _saved(watch):
            proc.send_signal(signal.SIGKILL)
            watch.killed_at_s = t
        time.sleep(POLL_S)
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    log.close()
    _observe(run_dir, watch, time.perf_counter() - start)
    record = {"name": name, "command": " ".join(cmd), "rc": proc.returncode, "wall_s": time.perf_counter() - start,
              "peak_rss_gib_polled": watch.peak_rss_gib,
              "peak_anon_rss_gib_polled": watch.peak_anon_gib, "killed_at_s": watch.killed_at_s,
              "saves_s": {n: b - a for n, (a, b) in watch.saves.items() if b is not None},
              "export_s": watch.export_s[1] - watch.export_s[0] if watch.export_s and watch.export_s[1] else None}
    if peaks.is_file():
        record.update(json.loads(peaks.read_text()))
    text = (work / f"{name}.log").read_text(errors="replace")
    record["log_tail"] = text.splitlines()[-40:]
    plan = re.findall(r"expected peak host RSS of the run: ([\d.]+) GiB", text)
    record["planned_peak_rss_gib"] = float(plan[-1]) if plan else None
    record.update(_metrics(run_dir))
    return record


def disk_write_gbs(folder: Path, gib: float = 4.0) -> float:
    """The disk's sequential write rate into `folder` (GB/s): `gib` GiB of random bytes in 64 MiB writes, then
    fsync, as a checkpoint save writes and syncs its file."""
    block = os.urandom(64 << 20)
    path = folder / "disk-probe.bin"
    start = time.perf_counter()
    with path.open("wb") as f:
        for _ in range(int(gib * (1 << 30)) // len(block)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    path.unlink()
    return gib * (1 << 30) / seconds / 1e9


def save_rates(run: dict, checkpoints: Path) -> dict[str, float]:
    """GB/s of each save the run finished whose file is still there (a link's is its target's)."""
    rates = {}
    for name, seconds in run["saves_s"].items():
        path = checkpoints / name
        if seconds > 0 and path.is_file() and not path.is_symlink():
            rates[name] = path.stat().st_size / seconds / 1e9
    return rates


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false"}


def _metrics(run_dir: Path) -> dict:
    """Step rate and losses from the run's CSV log: tokens/s of each logging window after the first."""
    path = run_dir / "csv" / "metrics.csv"
    if not path.is_file():
        return {}
    rows = list(csv.DictReader(path.open()))
    rates = [float(r["tokens/s"]) for r in rows if r.get("tokens/s")]
    vals = [(int(r["step"]), float(r["val/loss"])) for r in rows if r.get("val/loss")]
    train = [(int(r["step"]), float(r["train/loss"])) for r in rows if r.get("train/loss")]
    return {"tokens_per_s_windows": rates, "tokens_per_s": statistics.median(rates[1:]) if len(rates) > 1 else None,
            "val_loss": vals, "train_loss_last": train[-1][1] if train else None, "train_loss": train}


def loss_gap(reference: dict, run: dict) -> dict:
    """A run's logged train losses beside the reference run's at the same steps."""
    expected = dict(map(tuple, reference.get("train_loss", [])))
    pairs = [(step, loss, expected[step]) for step, loss in run.get("train_loss", []) if step in expected]
    return {"steps_compared": [p[0] for p in pairs],
            "max_abs_loss_diff": max((abs(a - b) for _, a, b in pairs), default=None),
            "losses_equal": bool(pairs) and all(a == b for _, a, b in pairs)}


def resume_gaps(uninterrupted: dict, first: dict, resumed: dict) -> dict:
    """The resumed run against the uninterrupted one, beside the killed run's steps against it: two runs of the
    same seed differ by what the GPU's non-deterministic kernels leave (bf16 atomics), which bounds the first."""
    return {"resumed": loss_gap(uninterrupted, resumed), "before_the_kill": loss_gap(uninterrupted, first)}


def reload_check(folder: Path, checkpoint: Path | None, seq_len: int, batch_size: int) -> dict:
    """Load the export with `from_pretrained` (its own dtype) on the GPU; compare its logits with the trained
    fp32 weights (from the final checkpoint) in the same dtype, or, without one, report its validation loss."""
    import torch
    from transformers import AutoModelForCausalLM

    from lightning_slide.data import TextDataModule, load_tokenizer

    if not (folder / "config.json").is_file():
        return {"error": f"no export in {folder} (the run did not reach its end)"}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).to(device).eval()
    record = {"reload_s": time.perf_counter() - start, "dtype": str(next(model.parameters()).dtype),
              "shards": len(list(folder.glob("*.safetensors"))),
              "bytes": sum(f.stat().st_size for f in folder.glob("*.safetensors"))}
    data = TextDataModule(load_tokenizer(folder), seq_len=seq_len, batch_size=batch_size)
    data.setup("fit")
    batch = next(iter(data.val_dataloader()))
    ids = batch["input_ids"][:2].to(device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
        record["val_loss_first_batch"] = float(model(input_ids=ids, labels=batch["labels"][:2].to(device)).loss)
    if checkpoint is not None:
        state = torch.load(checkpoint, map_location="cpu", mmap=True, weights_only=True)["state_dict"]
        trained = {k.removeprefix("model."): v for k, v in state.items()}
        loaded = model.load_state_dict({k: v.to(model.dtype) for k, v in trained.items()}, strict=False)
        record["keys_not_in_checkpoint"] = loaded.missing_keys  # tied weights only
        with torch.no_grad():
            reference = model(input_ids=ids).logits.float()
        record["max_abs_logit_diff"] = float((logits - reference).abs().max())
        record["logits_equal"] = bool(torch.equal(logits, reference))
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="llama3_8b")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/lightning-slide-e2e"))
    parser.add_argument("--cap-gib", type=float, default=24.0)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--val-every", type=int, default=10)
    parser.add_argument("--crash", action="store_true", help="SIGKILL after the first checkpoint, then resume")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="a further Hydra override of every train.py run (repeatable), e.g. "
                             "offload.moment_precision=int8")
    parser.add_argument("--name", default=None, help="the record's name (default: e2e-<model>)")
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--deadline-s", type=float, default=540, help="the whole run's time limit")
    parser.add_argument("--reload", nargs=4, metavar=("FOLDER", "CKPT", "SEQ", "BATCH"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.reload:
        folder, ckpt, seq, batch = args.reload
        print(json.dumps(reload_check(Path(folder), Path(ckpt) if ckpt != "-" else None, int(seq), int(batch))))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    run_dir, logs = args.work / args.model, args.work / f"{args.model}-logs"
    shutil.rmtree(run_dir, ignore_errors=True)
    logs.mkdir(parents=True, exist_ok=True)
    disk_gbs = disk_write_gbs(logs)
    end = time.perf_counter() + args.deadline_s
    overrides = [f"model={args.model}", f"data.batch_size={args.batch_size}", f"data.seq_len={args.seq_len}",
                 f"trainer.max_steps={args.steps}", f"trainer.val_check_interval={args.val_every}",
                 "trainer.log_every_n_steps=5", "+trainer.limit_val_batches=4", *args.override]
    if not args.crash:
        overrides.append("checkpoint=null")
    else:  # every step's loss, and the same run uninterrupted (no checkpoints, no export) to compare it with
        overrides[overrides.index("trainer.log_every_n_steps=5")] = "trainer.log_every_n_steps=1"
        plain_dir = args.work / f"{args.model}-uninterrupted"
        shutil.rmtree(plain_dir, ignore_errors=True)
        plain = run_cli("uninterrupted", [*overrides, "checkpoint=null", "export=null"], logs, plain_dir,
                        args.cap_gib, timeout_s=end - time.perf_counter())
        shutil.rmtree(plain_dir, ignore_errors=True)
    runs = [run_cli("first", overrides, logs, run_dir, args.cap_gib, kill_after_save=args.crash,
                    timeout_s=end - time.perf_counter())]
    if args.crash:
        runs.append(run_cli("resumed", [*overrides, f"resume={run_dir / 'checkpoints' / 'last.ckpt'}"], logs,
                            run_dir, args.cap_gib, timeout_s=end - time.perf_counter()))
    if args.crash:
        runs.insert(0, plain)
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    for run in runs:
        run["save_gbs"] = save_rates(run, ckpt.parent)
    try:
        check = subprocess.run([sys.executable, "-m", "benchmarks.e2e", "--out", str(args.out), "--reload",
                                str(run_dir / "hf_model"), str(ckpt) if ckpt.exists() else "-", str(args.seq_len),
                                str(args.batch_size)], cwd=REPO, capture_output=True, text=True, env=_env(),
                               timeout=max(10.0, end - time.perf_counter()))
        reload = (json.loads(check.stdout.strip().splitlines()[-1]) if check.returncode == 0
                  else {"error": check.stderr[-2000:]})
    except subprocess.TimeoutExpired:
        reload = {"error": "the reload check ran past the deadline"}
    from lightning_slide.available import cgroup_memory  # torch, only now: the parent stays small while it polls

    name = args.name or f"e2e-{args.model}"
    limit = cgroup_memory()
    record = {"case": name, "system": "lightning-slide CLI (train.py)", "model_key": args.model,
              "micro_batch": args.batch_size, "seq_len": args.seq_len, "vram_cap_gib": args.cap_gib,
              "steps": args.steps, "crash_and_resume": args.crash, "overrides": args.override,
              "host_memory_limit_gib": None if limit is None else limit[0] / GIB, "disk_write_gbs": disk_gbs,
              "runs": runs, "reload": reload,
              "resume": resume_gaps(*runs) if args.crash else None,
              "commit": args.commit, "date": datetime.date.today().isoformat(), "machine": machine()}
    (args.out / f"{name}.json").write_text(json.dumps(record, indent=1))
    print(json.dumps(record, indent=1))
    shutil.rmtree(run_dir, ignore_errors=True)
    finished = [r for r in runs if r["name"] != "first"]  # the first of a crash cycle is killed on purpose
    return 0 if all(r["rc"] == 0 for r in finished) and "error" not in reload else 1


def machine() -> dict:
    """The GPU, CPU, cores, RAM, torch and Python of this machine, for a result record."""
    import platform

    import psutil
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"gpu": gpu, "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "ram_gib": round(psutil.virtual_memory().total / GIB, 1), "torch": torch.__version__,
            "python": platform.python_version()}


if __name__ == "__main__":
    sys.exit(main())
