"""The benchmark entry point: `python -m benchmarks.run --cases targets --out DIR [--budget-s 540]`.

Runs each case in its own process (benchmarks.worker), in the suite's priority order, and skips what
would overrun the time budget. After every case it rewrites DIR/results.jsonl (one JSON object per
case), DIR/summary.md and the plots, so a run cut short still leaves everything it measured; DIR/run.log
holds the tail of every case's output. Those are all the files it writes there (the GPU machine
returns at most 8 files).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

import psutil

from benchmarks import report
from benchmarks.cases import SUITES, Case, resolve
from benchmarks.records import base_record, finalize

REPO = Path(__file__).resolve().parent.parent
GIB = float(1 << 30)
POLL_S = 0.2
LOG_TAIL_LINES = 120


def machine_facts() -> dict:
    """Host facts the parent can read without touching CUDA (the worker adds the GPU's)."""
    cpu = next((line.split(":", 1)[1].strip() for line in _read("/proc/cpuinfo").splitlines()
                if line.startswith("model name")), platform.processor())
    facts = {"cpu": cpu, "cpus": os.cpu_count(), "ram_gib": psutil.virtual_memory().total / GIB,
             "python": platform.python_version()}
    for package in ("torch", "transformers", "lightning", "deepspeed", "triton"):
        try:
            facts[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            facts[package] = None
    return facts


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def git_commit() -> str:
    """HEAD's sha, marked `-dirty` when tracked files differ from it ("unknown" without git or .git:
    the GPU machine gets a copy of the working tree, so pass --commit there)."""
    def git(*args: str) -> str:
        try:
            done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
        except OSError:
            return ""
        return done.stdout.strip() if done.returncode == 0 else ""

    sha = git("rev-parse", "HEAD") or "unknown"
    return sha + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def case_timeout(case: Case) -> float:
    """A hung case (a deadlock, a stuck copy) must not eat the whole budget: allow 2.5x its estimate."""
    return max(2.5 * case.est_s, case.est_s + 60.0)


class Runner:
    """Runs cases one by one under a shared time budget and keeps the output files current."""

    def __init__(self, out: Path, budget_s: float, include_known_failures: bool, command: str,
                 commit: str | None = None) -> None:
        self.out, self.budget_s, self.include_known = out, budget_s, include_known_failures
        self.started = time.monotonic()
        self.records: list[dict] = []
        self.failed_chains: set[str] = set()
        self.scratch = Path(tempfile.mkdtemp(prefix="lsbench-"))
        self.common = {"command": command, "commit": commit or git_commit(),
                       "date": datetime.date.today().isoformat(), "machine": machine_facts()}
        out.mkdir(parents=True, exist_ok=True)
        (out / "run.log").write_text("")

    def remaining(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    def run_all(self, cases: list[Case]) -> list[dict]:
        for case in cases:
            record = {**base_record(case), **self.common}
            skip = self._skip_reason(case)
            if skip:
                record["error"] = skip
            else:
                print(f"[{time.monotonic() - self.started:6.0f} s] {case.name} ...", flush=True)
                record.update(self._run_case(case))
                gpu = {key: record.pop(key) for key in ("gpu", "gpu_mem_gib", "cuda") if key in record}
                record["machine"] = {**record["machine"], **gpu}
            if not record["ok"] and case.chain:
                self.failed_chains.add(case.chain)
            self.records.append(record)
            print(f"         -> {_one_line(record)}", flush=True)
            self.save()
        return self.records

    def _skip_reason(self, case: Case) -> str | None:
        if case.known_failure and not self.include_known:
            return f"skipped: known failure ({case.known_failure}); run with --include-known-failures"
        if case.chain in self.failed_chains:
            return f"skipped: a smaller size of ladder {case.chain} already failed"
        if self.remaining() < case.est_s:
            return f"skipped: time budget ({self.remaining():.0f} s left, case needs about {case.est_s:.0f} s)"
        return None

    def _run_case(self, case: Case) -> dict:
        """Start the worker, poll its process tree's RSS, kill it at the budget's end."""
        result_file, log_file = self.scratch / f"{case.name}.json", self.scratch / f"{case.name}.log"
        argv = [sys.executable, "-m", "benchmarks.worker", "--case", case.name, "--result", str(result_file)]
        started = time.monotonic()
        with log_file.open("w") as log:
            proc = subprocess.Popen(argv, cwd=REPO, env=_child_env(), stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            peak_rss, timed_out = _watch(proc, timeout_s=max(1.0, min(self.remaining(), case_timeout(case))))
        wall = time.monotonic() - started
        tail = _tail(log_file)
        self._append_log(case, tail)
        measured = _read_result(result_file)
        measured.update(case_command=shlex.join(argv), rc=proc.returncode, wall_s=wall, peak_rss_gib=peak_rss / GIB)
        if measured.get("ok") and proc.returncode == 0:
            return measured
        measured["ok"] = False
        measured["error"] = _failure(measured.get("error"), proc.returncode, timed_out, wall, peak_rss)
        measured["log_tail"] = "\n".join(tail.splitlines()[-40:])
        return measured

    def _append_log(self, case: Case, tail: str) -> None:
        with (self.out / "run.log").open("a") as log:
            log.write(f"\n===== {case.name} (last {LOG_TAIL_LINES} lines) =====\n{tail}\n")

    def save(self) -> None:
        """Rewrite results.jsonl, summary.md and the plots from every record so far."""
        finalize(self.records)
        with (self.out / "results.jsonl").open("w") as jsonl:
            for record in self.records:
                jsonl.write(json.dumps(record) + "\n")
        try:
            report.write(self.out, self.records)
        except Exception as error:  # noqa: BLE001 - a plotting bug must not end the run; jsonl is saved
            print(f"report not written: {type(error).__name__}: {error}", flush=True)


def _child_env() -> dict:
    """The worker's environment: the repo importable, one reusable extension build dir, no network."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.setdefault("TORCH_EXTENSIONS_DIR", "/tmp/lsbench-torch-extensions")  # DeepSpeed CPU Adam: built once
    env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    # JIT builds (DeepSpeed's CPU Adam) look for ninja on PATH: the interpreter's own bin may hold it
    env["PATH"] = os.pathsep.join(filter(None, [str(Path(sys.executable).parent), env.get("PATH")]))
    return env


def _watch(proc: subprocess.Popen, timeout_s: float) -> tuple[int, bool]:
    """Peak RSS (bytes) of the process and its children, polled until it exits or times out."""
    deadline, peak = time.monotonic() + timeout_s, 0
    root = psutil.Process(proc.pid)
    while proc.poll() is None:
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)  # the worker's own session: it and its children only
            proc.wait()
            return peak, True
        peak = max(peak, _tree_rss(root))
        time.sleep(POLL_S)
    return peak, False


def _tree_rss(root: psutil.Process) -> int:
    total = 0
    try:
        for proc in [root, *root.children(recursive=True)]:
            total += proc.memory_info().rss
    except psutil.Error:
        pass
    return total


def _read_result(path: Path) -> dict:
    """The worker's result, or nothing if it died before writing it (or while writing it)."""
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _tail(log_file: Path) -> str:
    return "\n".join(log_file.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:])


def _failure(error: str | None, rc: int | None, timed_out: bool, wall: float, peak_rss: int) -> str:
    """The error to record: the worker's own if it wrote one, else what its exit says."""
    if timed_out:
        return f"timeout: killed after {wall:.0f} s (its time limit or the run's budget ran out)"
    if error:
        return error
    if rc is not None and rc < 0 and -rc == signal.SIGKILL:
        total = psutil.virtual_memory().total / GIB
        return (f"killed by SIGKILL after {wall:.0f} s, likely out of host memory "
                f"(peak RSS {peak_rss / GIB:.1f} of {total:.0f} GiB)")
    return f"worker exited with status {rc} and wrote no result"


def _one_line(record: dict) -> str:
    if record["ok"]:
        tps = record.get("tokens_per_s")
        return "ok" + (f", {tps:,.0f} tok/s" if tps else "")
    return str(record["error"]).splitlines()[0][:200]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=["targets"], help="suite or case names (see --list)")
    parser.add_argument("--out", type=Path, help="output folder (flat: results.jsonl, summary.md, PNGs, run.log)")
    parser.add_argument("--budget-s", type=float, default=540.0, help="wall-time budget for all cases")
    parser.add_argument("--include-known-failures", action="store_true",
                        help="also run cases seen failing before (e.g. ds3 on 8B: host out of memory)")
    parser.add_argument("--commit", help="git sha to record (default: this checkout's HEAD, if git is there)")
    parser.add_argument("--list", action="store_true", help="list suites and cases, then exit")
    args = parser.parse_args(argv)
    if args.list:
        for name, cases in SUITES.items():
            print(f"{name} ({len(cases)} cases, about {sum(c.est_s for c in cases) / 60:.0f} min):")
            print("".join(f"  {c.name}{'  [known failure]' if c.known_failure else ''}\n" for c in cases))
        return 0
    if args.out is None:
        parser.error("--out is required")
    command = shlex.join(["python", "-m", "benchmarks.run", *(argv if argv is not None else sys.argv[1:])])
    runner = Runner(args.out, args.budget_s, args.include_known_failures, command, args.commit)
    records = runner.run_all(resolve(args.cases))
    print(report.summary_text(records))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
