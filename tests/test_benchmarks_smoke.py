"""The benchmark harness on the CPU: case table, derived bounds and ratios, report files, one tiny case."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import report
from benchmarks.cases import CASES, SUITES, resolve
from benchmarks.records import base_record, finalize
from benchmarks.run import Runner


def _record(name: str, **measured: object) -> dict:
    return {**base_record(CASES[name]), "ok": True, **measured}


def _run_records() -> list[dict]:
    """A made-up run: probe, 8B ceiling, 8B mb8 slide with engine stats (running totals)."""
    stats = {"start": {"steps": 3, "wait_grads_s": 1.0, "wait_update_s": 2.0, "h2d_bytes": 0, "d2h_bytes": 0},
             "end": {"steps": 13, "wait_grads_s": 2.0, "wait_update_s": 3.0, "h2d_bytes": 640e9, "d2h_bytes": 320e9}}
    return [
        _record("probe", adam={"params_per_s": 4e9, "params": 5e8, "threads": 16, "step_s": 0.125},
                pcie={"h2d_gbs": 50.0, "d2h_gbs": 50.0, "bidir_gbs": 90.0}),
        _record("llama3_8b-mb8-capnone-ceiling", tokens_per_s=11000.0, step_s_mean=8192 / 11000.0),
        _record("llama3_8b-mb8-cap24-slide-cpu", tokens_per_s=3000.0, step_s_mean=8192 / 3000.0,
                engine_stats=stats, slide_config={"h2d_source": "master", "activations": "auto"}),
    ]


def test_suites_resolve_and_name_the_target_cases() -> None:
    assert [c.name for c in resolve(["targets"])] == [c.name for c in SUITES["targets"]]
    assert resolve(["probe,llama3_8b-mb8-capnone-ceiling"])[1].tokens_per_step == 8192
    targets = {c.name for c in SUITES["targets"]}
    for needed in ("llama3_8b-mb64-cap24-slide-cpu", "llama3_3b-mb8-cap24-ds3", "llama3_8b-mb8-capnone-ceiling"):
        assert needed in targets
    with pytest.raises(SystemExit):
        resolve(["no-such-case"])


def test_bounds_exposed_time_and_targets_come_from_the_run() -> None:
    records = _run_records()
    finalize(records)
    slide = records[2]
    assert slide["bounds_s"]["cpu_update"] == pytest.approx(8030261248 / 4e9)
    assert slide["bounds_s"]["pcie"] == pytest.approx(max(64e9 / 50e9, 32e9 / 50e9, 96e9 / 90e9))
    # recompute: the slide step does more work per token than the ceiling, so its bound exceeds the ceiling step
    assert slide["bounds_s"]["gpu_compute"] > records[1]["step_s_mean"]
    assert slide["binding"] == "cpu_update"
    assert slide["exposed_s"]["transfer"] == pytest.approx(0.1)
    assert slide["exposed_s"]["update"] == pytest.approx(0.1)
    assert slide["baseline_of_same_run"]["case"] == "llama3_8b-mb8-capnone-ceiling"
    rows = {row["target"][:6]: row for row in report.target_rows(records)}
    assert rows["8B at "]["value"] == pytest.approx(slide["step_s_mean"] / slide["bounds_s"]["cpu_update"])
    assert rows["8B, 24"]["met"] is None  # mb64 case not in this run


def test_report_writes_summary_plots_and_per_case_json(tmp_path) -> None:
    records = _run_records()
    finalize(records)
    report.write(tmp_path, records)
    assert "| llama3_8b-mb8-cap24-slide-cpu |" in (tmp_path / "summary.md").read_text()
    report.copy_results(tmp_path, tmp_path / "results", records)
    assert json.loads((tmp_path / "results" / "probe.json").read_text())["ok"]


def test_runner_records_skipped_cases_when_the_budget_is_spent(tmp_path) -> None:
    runner = Runner(tmp_path, budget_s=0.0, include_known_failures=False, command="test")
    records = runner.run_all(resolve(["probe-cpu"]))
    assert records[0]["error"].startswith("skipped: time budget")
    assert (tmp_path / "results.jsonl").read_text().count("\n") == 1


def test_tiny_ceiling_case_measures_a_window() -> None:
    from benchmarks.loops import run_ceiling

    result = run_ceiling(CASES["tiny-mb4-seq64-capnone-ceiling"], torch.device("cpu"))
    assert result["tokens_per_s"] > 0 and result["timed_steps"] == 10 and len(result["step_times_s"]) == 10
