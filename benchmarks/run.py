"""The benchmark entry point: `python -m benchmarks.run --cases targets --out DIR [--budget-s S]`.

Runs each case in its own process (benchmarks.worker), in the suite's priority order; given a wall-time
budget it skips the cases whose estimate would overrun it. After every case it rewrites DIR/results.jsonl
(one JSON object per case), DIR/summary.md and the plots, so a run cut short still leaves everything it
measured; DIR/run.log holds the tail of every case's output.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import psutil

from benchmarks import report
from benchmarks.cases import NVME_PATH, SUITES, Case, resolve
from benchmarks.ladder import LadderLog, conclude, merge_retry, retry_size
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


def case_timeout(case: Case, cap_s: float | None = None) -> float:
    """A hung case (a deadlock, a stuck copy) must not stall the run: allow 2.5x its estimate;
    a ladder stops itself at its time cap (`cap_s`, else the case's), so it gets that and half again for
    the rung in flight."""
    if case.is_ladder:
        return 1.5 * (case.time_cap_s if cap_s is None else cap_s) + 30.0
    return max(2.5 * case.est_s, case.est_s + 60.0)


@dataclass
class Exit:
    """How a worker process ended, as the parent saw it."""

    argv: list[str]
    rc: int | None
    timed_out: bool
    wall_s: float
    peak_rss: int
    tail: str

    @property
    def host_killed(self) -> bool:
        return not self.timed_out and self.rc == -signal.SIGKILL

    def error(self, reported: str | None) -> str:
        return _failure(reported, self.rc, self.timed_out, self.wall_s, self.peak_rss)

    def fields(self) -> dict:
        return {"case_command": shlex.join(self.argv), "rc": self.rc, "wall_s": self.wall_s,
                "peak_rss_gib": self.peak_rss / GIB}


def skip_reason(case: Case, left_s: float, include_known: bool) -> str | None:
    """Why a case is not run: seen failing before (unless asked), or its estimate no longer fits."""
    if case.known_failure and not include_known:
        return f"skipped: known failure ({case.known_failure}); run with --include-known-failures"
    if left_s < case.est_s:
        return f"skipped: time budget ({left_s:.0f} s left, case needs about {case.est_s:.0f} s)"
    return None


def plan(cases: list[Case], budget_s: float, include_known: bool) -> str:
    """What a run would do if every case took its estimate: the lines of `--plan`."""
    left, lines = budget_s, []
    for case in cases:
        skip = skip_reason(case, left, include_known)
        left -= 0 if skip else case.est_s
        lines.append(f"{'skip' if skip else 'run ':<5}{case.est_s:5.0f} s  {case.name}")
    total = "no budget" if math.isinf(budget_s) else f"{budget_s:.0f} s"
    used = sum(case.est_s for case, line in zip(cases, lines) if line.startswith("run"))
    return "\n".join(lines + [f"about {used:.0f} s of {total}"])


class Runner:
    """Runs cases one by one (under a wall-time budget, when given) and keeps the output files current."""

    def __init__(self, out: Path, budget_s: float, include_known_failures: bool, command: str,
                 commit: str | None = None) -> None:
        self.out, self.budget_s, self.include_known = out, budget_s, include_known_failures
        self.started = time.monotonic()
        self.records: list[dict] = []
        self.scratch = Path(tempfile.mkdtemp(prefix="lsbench-"))
        self.common = {"command": command, "commit": commit or git_commit(),
                       "date": datetime.date.today().isoformat(), "machine": machine_facts()}
        out.mkdir(parents=True, exist_ok=True)
        (out / "run.log").write_text("")

    def remaining(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    def run_all(self, cases: list[Case], rounds: int = 1) -> list[dict]:
        """Every case, in order, `rounds` times over (each record then names its `round`, from 1)."""
        for turn, case in itertools.product(range(rounds), cases):
            record = {**base_record(case), **self.common, **({"round": turn + 1} if rounds > 1 else {})}
            skip = skip_reason(case, self.remaining(), self.include_known)
            if skip:
                record["error"] = skip
            else:
                print(f"[{time.monotonic() - self.started:6.0f} s] {case.name} ...", flush=True)
                record.update(self._run_case(case))
                gpu = {key: record.pop(key) for key in ("gpu", "gpu_mem_gib", "cuda") if key in record}
                record["machine"] = {**record["machine"], **gpu}
            self.records.append(record)
            print(f"         -> {_one_line(record)}", flush=True)
            self.save()
        return self.records

    def _run_case(self, case: Case) -> dict:
        """One case: its worker's result plus what the parent saw (exit, wall time, peak RSS)."""
        if case.is_ladder:
            return self._run_ladder(case)
        measured, end = self._spawn(case, [], min(self.remaining(), case_timeout(case)))
        measured.update(end.fields())
        if measured.get("ok") and end.rc == 0:
            return measured
        return {**measured, "ok": False, "error": end.error(measured.get("error")), "log_tail": _last(end.tail, 40)}

    def _run_ladder(self, case: Case) -> dict:
        """A ladder, and once more from its killed rung in a fresh process when a host-RAM kill may have
        been caused by the earlier rungs' buffers (benchmarks.ladder.retry_size)."""
        cap = min(case.time_cap_s, self.remaining())
        first, end = self._climb(case, cap, None)
        log = LadderLog.from_result(first)
        left = min(cap - end.wall_s, self.remaining())
        size = retry_size(case, log, end.host_killed, left) if log else None
        if size is None:
            return first
        second, end = self._climb(case, left, size)
        return {**second, **merge_retry(log, second), "wall_s": first["wall_s"] + end.wall_s,
                "peak_rss_gib": max(first["peak_rss_gib"], second["peak_rss_gib"])}

    def _climb(self, case: Case, cap: float, from_size: int | None) -> tuple[dict, Exit]:
        extra = ["--time-cap-s", f"{cap:.0f}"] + (["--from-size", str(from_size)] if from_size else [])
        measured, end = self._spawn(case, extra, min(self.remaining(), case_timeout(case, cap)))
        result = {**measured, **conclude(measured, end.error(None) if end.rc else None), **end.fields()}
        if not result["ok"] or (result.get("ladder") or {}).get("first_failure"):
            result["log_tail"] = _last(end.tail, 40)
        return result, end

    def _spawn(self, case: Case, extra: list[str], timeout_s: float) -> tuple[dict, Exit]:
        """Start the worker, poll its process tree's RSS, kill it at the timeout; its result file's content."""
        result_file, log_file = self.scratch / f"{case.name}.json", self.scratch / f"{case.name}.log"
        result_file.unlink(missing_ok=True)
        argv = [sys.executable, "-m", "benchmarks.worker", "--case", case.name, "--result", str(result_file), *extra]
        _clear_disk_tier(case)
        started = time.monotonic()
        with log_file.open("w") as log:
            proc = subprocess.Popen(argv, cwd=REPO, env=_child_env(), stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            peak_rss, timed_out = _watch(proc, timeout_s=max(1.0, timeout_s))
        end = Exit(argv, proc.returncode, timed_out, time.monotonic() - started, peak_rss, _tail(log_file))
        _clear_disk_tier(case)
        self._append_log(case, end.tail)
        return _read_result(result_file), end

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


def _clear_disk_tier(case: Case) -> None:
    """The disk tier's folder is the harness's own: a killed worker must not leave its files to the next case."""
    if case.tier == "nvme":
        shutil.rmtree(NVME_PATH, ignore_errors=True)


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
    """Peak RSS (bytes) of the process and its children, polled until it exits or times out. The worker runs in a
    session of its own, which a signal to the runner's group does not reach: if the runner ends first (SIGTERM from
    `timeout`, Ctrl-C), the worker is killed with it rather than left measuring beside the next command."""
    deadline, peak = time.monotonic() + timeout_s, 0
    try:
        root = psutil.Process(proc.pid)
        while proc.poll() is None:
            if time.monotonic() > deadline:
                return peak, True
            peak = max(peak, _tree_rss(root))
            time.sleep(POLL_S)
        return peak, False
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the worker's own session: it and its children only
            proc.wait()


def _exit_on_sigterm() -> None:
    """SIGTERM ends the runner through SystemExit, so that `_watch` kills the running worker on the way out."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


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
    return _last(log_file.read_text(errors="replace"), LOG_TAIL_LINES)


def _last(text: str, lines: int) -> str:
    return "\n".join(text.splitlines()[-lines:])


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
    ladder = record.get("ladder")
    if ladder:
        ending = (ladder.get("first_failure") or {}).get("error") or ladder.get("stopped") or record["error"]
        return f"largest {ladder['grow']} that ran: {ladder['max_passed']}; then {str(ending).splitlines()[0][:160]}"
    if record["ok"]:
        tps = record.get("tokens_per_s")
        return "ok" + (f", {tps:,.0f} tok/s" if tps else "")
    return str(record["error"]).splitlines()[0][:200]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=["targets"], help="suite or case names (see --list)")
    parser.add_argument("--out", type=Path, help="output folder (flat: results.jsonl, summary.md, PNGs, run.log)")
    parser.add_argument("--budget-s", type=float, default=math.inf,
                        help="wall time for all cases: a case whose estimate no longer fits is skipped (default: none)")
    parser.add_argument("--include-known-failures", action="store_true",
                        help="also run cases seen failing before (e.g. ds3 on 8B: host out of memory)")
    parser.add_argument("--commit", help="git sha to record (default: this checkout's HEAD, if git is there)")
    parser.add_argument("--list", action="store_true", help="list suites and cases with estimates, then exit")
    parser.add_argument("--plan", action="store_true", help="show which cases the budget would run, then exit")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the cases this many times over, in turn (A B A B), to compare them past the "
                             "spread between processes; targets and plots use each case's mean")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: give 1 or more")
    if args.list:
        for name, cases in SUITES.items():
            minutes = sum(c.est_s for c in cases if not c.known_failure) / 60
            print(f"{name} ({len(cases)} cases, about {minutes:.0f} min without the known failures):")
            print("".join(f"  {c.est_s:5.0f} s  {c.name}{'  [known failure]' if c.known_failure else ''}\n"
                          for c in cases))
        return 0
    if args.plan:
        print(plan(resolve(args.cases) * args.rounds, args.budget_s, args.include_known_failures))
        return 0
    if args.out is None:
        parser.error("--out is required")
    _exit_on_sigterm()
    command = shlex.join(["python", "-m", "benchmarks.run", *(argv if argv is not None else sys.argv[1:])])
    runner = Runner(args.out, args.budget_s, args.include_known_failures, command, args.commit)
    records = runner.run_all(resolve(args.cases), args.rounds)
    print(report.summary_text(records))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
