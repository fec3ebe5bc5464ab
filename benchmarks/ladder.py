"""Ladders: the largest micro-batch or the longest sequence a system fits, found in one process (no torch).

A ladder builds the model and the system once, then trains `steps_per_rung` steps at each growing size
(a rung), synchronising after every step: capacity is measured here, not overlap. It stops at the first
failure (CUDA out of memory or any other error) and records the largest size that passed and that
failure's error: both are results. The log is written to the result file after every rung, so a
host-RAM kill, which takes the process down, still leaves the rungs that passed; the runner then records
the kill as the failure (`conclude`). A time cap keeps a slow system from eating the run: a rung whose
predicted time no longer fits is not started (`stopped`).

Rungs share a process, so a rung starts with what the earlier ones left: freed CUDA memory and cached
pinned blocks are returned between rungs, but lightning-slide's pooled pinned buffers of the previous
shape stay until the new shape replaces them. A host-RAM kill at a later rung may be the ladder's own
doing, so the runner tries that rung once more in a fresh process when the cap allows (`retry_size`).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from benchmarks.cases import Case, ladder_rung_s
from benchmarks.estimate import setup_s


@dataclass
class LadderLog:
    """What a ladder did so far; `to_result()` is the worker's result (the JSON the runner reads)."""

    grow: str
    rungs: list[int]
    steps_per_rung: int
    time_cap_s: float
    passed: list[dict] = field(default_factory=list)
    trying: dict | None = None  # {"size", "phase": "setup" | "step"} while a rung is under way
    first_failure: dict | None = None  # {"size", "phase", "error"}
    stopped: str | None = None  # why the ladder ended before a failure or the last rung
    setup_s: float | None = None  # process start to the first rung's first step
    retried: dict | None = None  # the failure a fresh process was started to retry

    @classmethod
    def for_case(cls, case: Case, time_cap_s: float | None = None) -> LadderLog:
        return cls(case.grow, list(case.rungs), case.steps_per_rung, time_cap_s or case.time_cap_s)

    @classmethod
    def from_result(cls, result: dict) -> LadderLog | None:
        data = result.get("ladder")
        if not isinstance(data, dict):
            return None
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    @property
    def max_passed(self) -> int | None:
        return max((rung["size"] for rung in self.passed), default=None)

    def start(self, size: int, phase: str) -> None:
        self.trying = {"size": size, "phase": phase}

    def pass_rung(self, measured: dict) -> None:
        """A rung's every step ran: record what it measured (size, tokens, step_s, memory peaks)."""
        self.passed.append(measured)
        self.trying = None

    def fail(self, error: str) -> None:
        self.first_failure = {**(self.trying or {"size": None, "phase": "unknown"}), "error": error[:4000]}
        self.trying = None

    def stop(self, reason: str) -> None:
        self.stopped = reason
        self.trying = None

    def to_result(self) -> dict:
        """ok when at least one rung passed; a ladder where nothing fit is a failure with that error."""
        ok = bool(self.passed)
        error = None if ok else (self.first_failure or {}).get("error") or self.stopped
        return {"ok": ok, "error": error, "ladder": {**asdict(self), "max_passed": self.max_passed}}

    def write(self, path: Path) -> None:
        write_json(path, self.to_result())


def write_json(path: Path, data: dict) -> None:
    """Replace a result file atomically: a kill mid-write must not lose what an earlier write saved."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def next_rung_fits(case: Case, log: LadderLog, size: int, elapsed_s: float) -> bool:
    """Whether rung `size` should still fit the cap, predicted from the last rung's measured step."""
    last = log.passed[-1] if log.passed else None
    predicted = ladder_rung_s(case, size, last and last["step_s"], last and last["size"])
    if elapsed_s + predicted <= log.time_cap_s:
        return True
    log.stop(f"time cap: rung {size} predicted {predicted:.0f} s, {log.time_cap_s - elapsed_s:.0f} s of "
             f"{log.time_cap_s:.0f} s left")
    return False


def conclude(result: dict, exit_error: str | None) -> dict:
    """The ladder's result once its process ended. A death mid-rung (host-RAM kill, timeout), which the
    worker could not record, becomes the first failure at the rung it was trying."""
    log = LadderLog.from_result(result)
    if log is None:
        return {**result, "ok": False, "error": result.get("error") or exit_error}
    if log.trying is not None and exit_error:
        log.fail(exit_error)
    return log.to_result()


def retry_size(case: Case, log: LadderLog, host_killed: bool, left_s: float) -> int | None:
    """The rung to try again in a fresh process: one a host-RAM kill stopped after earlier rungs passed in
    the same process (their pinned buffers may be what ran out), once, if setup and the rung fit the cap."""
    failure = log.first_failure
    if not host_killed or not failure or not log.passed or log.retried is not None or failure["size"] is None:
        return None
    last = log.passed[-1]
    needed = (log.setup_s or setup_s(case.system, case.model)) + ladder_rung_s(
        case, failure["size"], last["step_s"], last["size"])
    return failure["size"] if needed <= left_s else None


def merge_retry(first: LadderLog, second: dict) -> dict:
    """One result from a ladder and its fresh-process retry: the rungs both passed, the retry's ending."""
    log = LadderLog.from_result(second)
    if log is None:  # the fresh process died before its first write (while importing)
        return {**first.to_result(), "retry_error": second.get("error")}
    log.passed = first.passed + log.passed
    log.retried = first.first_failure
    return log.to_result()
