"""The benchmark harness on the CPU: case table, derived bounds and ratios, the model's compute idle
analysis, ladders, report files, tiny cases."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch

from benchmarks import report
from benchmarks.cases import CASES, SUITES, ladder, resolve
from benchmarks.gpu_idle import idle_by_gap, idle_per_step, read_trace
from benchmarks.ladder import LadderLog, conclude, merge_retry, retry_size
from benchmarks.records import base_record, finalize
from benchmarks.run import Runner, plan
from benchmarks.rungs import run_ladder
from benchmarks.timing import WindowClock

ROOT = Path(__file__).resolve().parents[1]


def _record(name: str, **measured: object) -> dict:
    return {**base_record(CASES[name]), "ok": True, **measured}


def _kernel(ts: float, dur: float, stream: int = 7, name: str = "gemm", cat: str = "kernel") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"stream": stream, "device": 0}}


def _trace() -> dict:
    """Markers at 0, 1000, 2000, 3000 µs on stream 7: a lead-in step, then two steps of 1 ms. Step 2: compute
    busy 600 µs (two overlapping kernels), idle 400 µs of which a copy covers 100. Step 3: busy 1000 µs."""
    marker = "void at::cuda::(anonymous namespace)::spin_kernel(long)"
    events = [_kernel(t, 1.0, name=marker) for t in (0.0, 1000.0, 2000.0, 3000.0)]
    events += [_kernel(100.0, 800.0),  # lead-in step: not counted
               _kernel(1000.0, 400.0), _kernel(1300.0, 300.0),  # 1000-1600 busy
               _kernel(1700.0, 100.0, stream=20, name="Memcpy HtoD", cat="gpu_memcpy"),  # during idle
               _kernel(1500.0, 50.0, stream=20, name="cast"),  # side stream, during busy: not idle time
               _kernel(2000.0, 1000.0)]
    events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 5000.0})
    return {"traceEvents": events}


def _run_records() -> list[dict]:
    """A made-up run: probe, 8B ceiling, 8B mb8 and mb64 slide with engine stats and a profile, the 8B ceiling
    with every block recomputed."""
    stats = {"start": {"steps": 3, "h2d_bytes": 0, "d2h_bytes": 0, "wait_update_s": 0.0, "alloc_retries": 4,
                       "update_busy_s": 1.0, "gpu_update_busy_s": 0.0},
             "end": {"steps": 13, "h2d_bytes": 640e9, "d2h_bytes": 320e9, "wait_update_s": 5.0, "alloc_retries": 24,
                     "device_frees": 10, "update_busy_s": 21.0, "gpu_update_busy_s": 10.0,
                     "gpu_updated_units": ["block.1"],
                     "h2d_loads_bytes": 600e9, "h2d_saved_inputs_bytes": 0, "h2d_updates_bytes": 40e9,
                     "d2h_gradients_bytes": 300e9, "d2h_saved_inputs_bytes": 0, "d2h_updates_bytes": 20e9,
                     "load_by_unit_bytes": {"embed": 100e9, "block.0": 300e9, "block.1": 200e9},
                     "wait_update_by_unit_s": {"embed": 3.0, "block.0": 2.0},
                     "update_work_by_unit_s": {"embed": 1.5, "block.0": 1.0, "block.1": 0.9},
                     "wait_landing_by_unit_s": {"embed": 0.5, "block.0": 0.3}}}
    idle = idle_per_step(read_trace(_trace()))
    return [
        _record("probe", adam={"params_per_s": 4e9, "params": 5e8, "threads": 16, "step_s": 0.125},
                pcie={"h2d_gbs": 50.0, "d2h_gbs": 50.0, "bidir_gbs": 90.0}),
        _record("llama3_8b-mb8-capnone-ceiling", tokens_per_s=11000.0, step_s_mean=8192 / 11000.0),
        _record("llama3_8b-mb8-cap24-slide-cpu", tokens_per_s=3000.0, step_s_mean=8192 / 3000.0,
                engine_stats=stats, slide_config={"activations": "auto"}, gpu_idle=idle),
        _record("llama3_8b-mb64-cap24-slide-cpu-slots-auto", tokens_per_s=11000.0, step_s_mean=65536 / 11000.0,
                gpu_idle=idle),
        _record("llama3_8b-mb8-capnone-ceiling-recompute", tokens_per_s=8800.0, step_s_mean=8192 / 8800.0),
    ]


def test_suites_resolve_and_name_the_cases_asked_for() -> None:
    assert [c.name for c in resolve(["targets"])] == [c.name for c in SUITES["targets"]]
    assert resolve(["probe,llama3_8b-mb8-capnone-ceiling"])[1].tokens_per_step == 8192
    wanted = ["llama3_3b-mb8-cap24-ds2", "llama3_8b-mb1-seq16384-cap24-slide-cpu",
              "llama3_8b-mb8-cap24-slide-nvme-moments-0.0", "llama3_8b-mb8-cap24-slide-nvme-moments-0.25",
              "llama3_8b-mb8-cap24-slide-cpu-slots-auto", "llama3_8b-mb64-cap24-slide-cpu-slots-auto",
              "llama3_8b-cap24-slide-cpu-max-mb", "llama3_8b-cap24-slide-cpu-max-seq", "llama3_3b-cap24-ds3-max-mb",
              "llama3_3b-cap24-ds2-max-mb", "llama3_3b-cap24-plain-max-mb", "llama3_8b-cap24-ds3-max-mb",
              *(f"{model}-mb{mb}-cap24-slide-cpu" for model in ("llama3_1b", "llama3_3b", "llama3_8b")
                for mb in (1, 8, 32, 64))]
    assert not [name for name in wanted if name not in CASES]
    nvme = CASES["llama3_8b-mb8-cap24-slide-nvme-moments-0.25"]
    assert nvme.tier == "nvme" and nvme.settings["nvme_path"] == "/tmp/lsbench-nvme"
    assert CASES["llama3_8b-cap24-ds3-max-mb"].known_failure
    with pytest.raises(SystemExit):
        resolve(["no-such-case"])


def test_comparison_suites_run_the_default_before_each_alternative() -> None:
    pairs = {
        "recompute": [("llama3_1b-mb32-cap24-slide-cpu", "llama3_1b-mb32-cap24-slide-cpu-recompute-always"),
                      ("llama3_3b-mb8-cap24-slide-cpu", "llama3_3b-mb8-cap24-slide-cpu-recompute-always")],
        "settings": [("llama3_8b-mb8-cap24-slide-cpu", "llama3_8b-mb8-cap24-slide-cpu-chunk-4194304"),
                     ("llama3_8b-mb64-cap24-slide-cpu", "llama3_8b-mb64-cap24-slide-cpu-gradbufs-6")],
        "baselines": [("llama3_3b-mb8-cap24-slide-cpu", "llama3_3b-mb8-capnone-plain")],
    }
    for suite, comparisons in pairs.items():
        names = [case.name for case in SUITES[suite]]
        for default, alternative in comparisons:
            assert names.index(default) < names.index(alternative), (suite, default, alternative)


def test_suites_are_named_for_what_they_measure() -> None:
    assert set(SUITES) == {"targets", "recompute", "baselines", "grid", "settings", "clipping", "ladders",
                           "long", "tiling", "gpu_updates", "boundary", "touched_rows", "grad_buffers",
                           "compact_moments", "resident_moments", "smoke", "full"}
    assert {c.name for c in SUITES["full"]} == {c.name for name, s in SUITES.items() if name != "smoke" for c in s}


def test_zipf_cases_draw_token_ids_with_texts_skew_and_say_so_in_their_names() -> None:
    from benchmarks.build import random_tokens
    from benchmarks.models import MODELS

    spec = MODELS["llama3_8b"]
    uniform, skewed = (random_tokens(spec, 8, 1024, zipf=z) for z in (None, 1.0))
    assert skewed.shape == uniform.shape and int(skewed.min()) >= 0 and int(skewed.max()) < spec.vocab
    assert skewed.unique().numel() < 0.5 * uniform.unique().numel()
    assert torch.equal(skewed, random_tokens(spec, 8, 1024, zipf=1.0))  # a fixed seed
    assert {c.name for c in SUITES["touched_rows"]} >= {"llama3_8b-mb8-cap24-slide-cpu-zipf1"}


def test_the_long_ladders_tile_their_mlps_and_every_rung_fits_their_time_caps_as_estimated() -> None:
    from benchmarks.cases import ladder_rung_s
    from benchmarks.estimate import setup_s

    for case in SUITES["long"]:
        assert case.settings["mlp_tile_tokens"] == "auto" and case.grow == "seq_len"
        assert setup_s(case.system, case.model) + sum(ladder_rung_s(case, size) for size in case.rungs) \
            <= case.time_cap_s
    assert {c.rungs for c in SUITES["long"]} == {(65536, 131072), (196608, 262144)}


def test_the_tiling_suite_compares_each_shape_untiled_and_tiled() -> None:
    suite = SUITES["tiling"]
    for untiled, tiled in zip(suite[::2], suite[1::2]):
        assert (untiled.model, untiled.seq_len, untiled.micro_batch) == (tiled.model, tiled.seq_len, tiled.micro_batch)
        assert untiled.settings == {"mlp_tile_tokens": None}
    assert all(case.settings == {"mlp_tile_tokens": 8192} for case in suite[1::2])


def test_a_name_means_one_case_in_every_suite() -> None:
    for suite in SUITES.values():
        for case in suite:
            assert CASES[case.name] == case


def test_plan_skips_what_the_budget_cannot_hold() -> None:
    lines = plan(resolve(["full"]), 540.0, include_known=False).splitlines()
    assert lines[0].startswith("run") and "skip" in "".join(lines)


def test_idle_is_the_compute_streams_gaps_between_step_markers() -> None:
    idle = idle_per_step(read_trace(_trace()))
    assert idle["steps"] == 2 and idle["stream"] == 7
    assert idle["step_s"] == pytest.approx([1e-3, 1e-3], abs=1e-9)
    assert idle["busy_s"] == pytest.approx([6e-4, 1e-3], abs=2e-6)
    assert idle["idle_s"] == pytest.approx([4e-4, 0.0], abs=2e-6)
    assert idle["idle_copying_s"] == pytest.approx([1e-4, 0.0], abs=1e-9)
    with pytest.raises(ValueError):
        read_trace({"traceEvents": _trace()["traceEvents"][:2]})


def test_the_last_steps_longest_gaps_name_their_neighbours_and_what_ran_beside() -> None:
    trace = _trace()
    trace["traceEvents"] += [_kernel(2000.0, 300.0, name="embed"), _kernel(2500.0, 500.0, name="head"),
                             _kernel(2350.0, 100.0, stream=20, name="Memcpy DtoH", cat="gpu_memcpy")]
    trace["traceEvents"] = [e for e in trace["traceEvents"] if not (e["ts"] == 2000.0 and e["name"] == "gemm")]
    (gap,) = idle_per_step(read_trace(trace))["gaps"]  # step 3 only: 2300-2500 idle
    assert gap["at_s"] == pytest.approx(3e-4) and gap["idle_s"] == pytest.approx(2e-4)
    assert gap["empty_s"] == pytest.approx(1e-4)  # the copy back ran 2350-2450 of 2300-2500
    assert (gap["before"], gap["after"]) == ("embed", "head")
    assert gap["beside_s"] == {"Memcpy DtoH (stream 20)": pytest.approx(1e-4)}


def test_each_steps_idle_time_is_split_by_the_length_of_its_gaps() -> None:
    """A 30 ms step (after a lead-in one) whose compute leaves gaps of 0.5, 5 and 12 ms; the trace's step 2 idles
    in one 400 µs gap."""
    compute = [(0.0, 1000.0), (1500.0, 2000.0), (7000.0, 8000.0), (20000.0, 30000.0)]
    assert idle_by_gap(compute, [-1.0, 0.0, 30000.0]) == {
        "under_1ms": pytest.approx([5e-4]), "1_to_10ms": pytest.approx([5e-3]), "10ms_up": pytest.approx([1.2e-2])}
    assert idle_per_step(read_trace(_trace()))["idle_by_gap_s"]["under_1ms"] == pytest.approx([4e-4, 0.0])


def test_the_last_steps_short_gaps_are_grouped_by_the_kernel_after_them() -> None:
    """Step 3 (2000-3000 µs) idles 100 µs before each of two "load" kernels (a copy covers half of the first) and
    50 µs before a "norm"."""
    trace = _trace()
    trace["traceEvents"] = [e for e in trace["traceEvents"] if not (e["ts"] == 2000.0 and e["name"] == "gemm")]
    trace["traceEvents"] += [_kernel(2000.0, 100.0), _kernel(2200.0, 100.0, name="load"),
                             _kernel(2400.0, 100.0, name="load"), _kernel(2550.0, 50.0, name="norm"),
                             _kernel(2600.0, 400.0), _kernel(2100.0, 50.0, stream=20, name="Memcpy HtoD",
                                                             cat="gpu_memcpy")]
    grouped = idle_per_step(read_trace(trace))["short_gaps_by_next"]
    assert list(grouped) == ["load", "norm"]
    assert grouped["load"] == {"count": 2, "idle_s": pytest.approx(2e-4), "empty_s": pytest.approx(1.5e-4)}
    assert grouped["norm"] == {"count": 1, "idle_s": pytest.approx(5e-5), "empty_s": pytest.approx(5e-5)}


def _api(ts: float, correlation: int, name: str = "cudaLaunchKernel", dur: float = 5.0, thread: int = 1) -> dict:
    """A host CUDA API call as torch.profiler records it."""
    return {"ph": "X", "cat": "cuda_runtime", "name": name, "ts": ts, "dur": dur, "tid": thread,
            "args": {"correlation": correlation}}


def test_the_last_steps_gaps_are_told_apart_by_when_the_host_launched_the_kernel_after_them() -> None:
    """Step 3 (2000-3000 µs) idles 2100-2200 before a kernel queued at 2050 (it waited on the device), 2300-2500
    before one the host launched only at 2450, after a cudaFree on its thread from 2150, and 2600-2650 before one the
    profile has no launch for. Another thread's long call is not the launching thread's."""
    trace = _trace()
    trace["traceEvents"] = [e for e in trace["traceEvents"] if not (e["ts"] == 2000.0 and e["name"] == "gemm")]
    for ts, dur, correlation in ((2000.0, 100.0, 1), (2200.0, 100.0, 2), (2500.0, 100.0, 3), (2650.0, 350.0, 4)):
        kernel = _kernel(ts, dur)
        kernel["args"]["correlation"] = correlation
        trace["traceEvents"].append(kernel)
    trace["traceEvents"] += [_api(1990.0, 1), _api(2050.0, 2), _api(2450.0, 3),
                             _api(2150.0, 99, name="cudaFree", dur=300.0),
                             _api(2455.0, 98, name="cudaEventSynchronize", dur=500.0, thread=2)]
    causes = idle_per_step(read_trace(trace))["gap_causes"]
    assert causes["idle_s"] == {"launched_late": pytest.approx(2e-4), "queued": pytest.approx(1e-4),
                                "unmatched": pytest.approx(5e-5)}
    assert causes["late_blocked_in_s"] == {"cudaFree": pytest.approx(1.5e-4)}  # 2300-2450 of its 2150-2450


def _idle_in_step_3(beside: dict) -> dict:
    """The trace with step 3 (2000-3000 µs) idle from 2300 to 2500 on the compute stream, `beside` a kernel there."""
    trace = _trace()
    trace["traceEvents"] = [e for e in trace["traceEvents"] if not (e["ts"] == 2000.0 and e["name"] == "gemm")]
    trace["traceEvents"] += [_kernel(2000.0, 300.0), _kernel(2500.0, 500.0), beside,
                             _kernel(2450.0, 30.0, stream=20, name="Memcpy HtoD", cat="gpu_memcpy")]
    return idle_per_step(read_trace(trace))


def test_idle_time_beside_another_streams_kernels_is_told_apart_and_named() -> None:
    """Step 3 idles 2300-2500 µs: an updater's kernel on a second stream runs 2350-2450 of it, and a copy
    2450-2480; step 2's idle time has only a copy beside it."""
    idle = _idle_in_step_3(_kernel(2350.0, 100.0, stream=30, name="fused_adamw"))
    assert idle["idle_s"] == pytest.approx([4e-4, 2e-4])
    assert idle["idle_beside_kernels_s"] == pytest.approx([0.0, 1e-4])
    assert idle["idle_copying_s"] == pytest.approx([1e-4, 1.3e-4])
    assert idle["side_kernels_in_idle_s"] == {"fused_adamw": pytest.approx(1e-4)}


def test_a_matrix_product_on_a_second_stream_is_the_models_compute() -> None:
    """The fused loss's grad_x GEMM runs 2350-2450 of step 3's compute-stream gap on a stream of its own: the model
    idles only the 100 µs around it; the compute stream's own idle time keeps the whole gap."""
    idle = _idle_in_step_3(_kernel(2350.0, 100.0, stream=30, name="nvjet_sm90_tst_256x128_64x4_1x2_h_bz_splitK_NNT"))
    assert idle["streams"] == [7, 30]
    assert idle["idle_s"] == pytest.approx([4e-4, 1e-4])
    assert idle["idle_compute_stream_s"] == pytest.approx([4e-4, 2e-4])
    assert idle["idle_beside_kernels_s"] == pytest.approx([0.0, 0.0]) and idle["side_kernels_in_idle_s"] == {}
    assert idle["kernels_s"]["nvjet_sm90_tst_256x128_64x4_1x2_h_bz_splitK_NNT"] == pytest.approx(1e-4 / 2)


def test_compute_kernel_time_is_summed_by_name_per_counted_step() -> None:
    trace = _trace()
    trace["traceEvents"].append(_kernel(2100.0, 200.0, name="norm"))
    kernels = idle_per_step(read_trace(trace))["kernels_s"]
    assert list(kernels) == ["gemm", "norm"]  # the lead-in step's kernel is not counted; the side stream's neither
    assert kernels["gemm"] == pytest.approx((400 + 300 + 1000) / 2 / 1e6)
    assert kernels["norm"] == pytest.approx(200 / 2 / 1e6)


def _copy(ts: float, dur: float, way: str, gb: float) -> dict:
    event = _kernel(ts, dur, stream=30 if way == "HtoD" else 31, name=f"Memcpy {way} (Pinned)", cat="gpu_memcpy")
    event["args"]["bytes"] = gb * 1e9
    return event


def test_copies_are_timed_per_direction_and_both_ways_at_once_per_step() -> None:
    trace = _trace()  # its one copy up: 1700-1800 in step 2, no byte count
    trace["traceEvents"] += [_copy(1750.0, 100.0, "HtoD", 2.0), _copy(1800.0, 300.0, "DtoH", 3.0),
                             _copy(2200.0, 400.0, "DtoH", 1.0), _copy(2500.0, 200.0, "HtoD", 4.0),
                             _copy(2950.0, 100.0, "HtoD", 5.0)]  # starts in step 3, ends after it
    copies = idle_per_step(read_trace(trace))["copies"]
    assert copies["h2d_s"] == pytest.approx([150e-6, 250e-6])  # 1700-1850; 2500-2700 and 2950-3000
    assert copies["d2h_s"] == pytest.approx([200e-6, 500e-6])  # 1800-2000 (of 1800-2100); 2000-2100 and 2200-2600
    assert copies["both_s"] == pytest.approx([50e-6, 100e-6])  # 1800-1850; 2500-2600
    assert copies["h2d_gb"] == pytest.approx([2.0, 9.0]) and copies["d2h_gb"] == pytest.approx([3.0, 1.0])
    by_stream = idle_per_step(read_trace(trace))["copies_by_stream"]  # step 3: up on stream 30, back on 31
    assert by_stream == {"30": {"h2d_s": pytest.approx(250e-6), "h2d_gb": pytest.approx(9.0)},
                         "31": {"d2h_s": pytest.approx(400e-6), "d2h_gb": pytest.approx(1.0)}}


def test_the_report_shows_each_profiled_cases_copies_and_their_rate() -> None:
    idle = {"copies": {"h2d_s": [1.0, 1.0], "h2d_gb": [40.0, 44.0], "d2h_s": [0.5, 0.5], "d2h_gb": [20.0, 20.0],
                       "both_s": [0.4, 0.2]}}
    record = _record("llama3_8b-mb8-cap24-slide-cpu", tokens_per_s=3000.0, step_s_mean=2.7, gpu_idle=idle)
    assert "| llama3_8b-mb8-cap24-slide-cpu | 1 | 42 | 42 | 0.5 | 20 | 40 | 0.3 |" in report.copies_md([record])


def test_the_report_shows_why_each_profiled_cases_compute_idled() -> None:
    idle = {"gap_causes": {"idle_s": {"launched_late": 0.06, "queued": 0.19},
                           "late_blocked_in_s": {"cudaFree": 0.012}}}
    record = _record("llama3_8b-mb64-cap24-slide-cpu", tokens_per_s=9700.0, step_s_mean=6.7, gpu_idle=idle)
    assert "| llama3_8b-mb64-cap24-slide-cpu | 0.06 | 0.19 | 0 | cudaFree 0.012 |" in report.gap_causes_md([record])


def test_the_8_bit_moments_step_is_measured_against_the_fp32_cpu_adam_bound() -> None:
    case = CASES["llama3_8b-mb8-cap24-slide-cpu-int8-moments"]
    assert case.settings == {"moment_precision": "int8"} and case in SUITES["compact_moments"]
    records = [_record("probe", adam={"params_per_s": 4e9, "params": 5e8, "threads": 16, "step_s": 0.125},
                       pcie={"h2d_gbs": 50.0, "d2h_gbs": 50.0, "bidir_gbs": 90.0}),
               _record(case.name, tokens_per_s=4500.0, step_s_mean=1.5)]
    finalize(records)
    (row,) = [row for row in report.target_rows(records) if row["target"].startswith("8-bit moments")]
    assert row["value"] == pytest.approx(1.5 / (8030261248 / 4e9)) and row["met"] is False


def test_cpu_runs_are_not_profiled_and_record_no_idle_time() -> None:
    clock = WindowClock(2, 3, torch.device("cpu"), profile_steps=3)
    assert clock.total_steps == 5
    for _ in range(clock.total_steps):
        clock.tick()
    assert clock.summary(64)["gpu_idle"] is None


def test_bounds_idle_time_and_targets_come_from_the_run() -> None:
    records = _run_records()
    finalize(records)
    slide = records[2]
    assert slide["bounds_s"]["cpu_update"] == pytest.approx(8030261248 / 4e9)
    assert slide["bounds_s"]["pcie"] == pytest.approx(max(64e9 / 50e9, 32e9 / 50e9, 96e9 / 90e9))
    # recompute: the slide step does more work per token than the ceiling, so its bound exceeds the ceiling step
    assert slide["bounds_s"]["gpu_compute"] > records[1]["step_s_mean"]
    assert slide["binding"] == "cpu_update"
    assert slide["exposed_s"]["total"] == pytest.approx(2e-4, abs=2e-6)
    assert slide["exposed_s"]["share"] == pytest.approx(0.2, abs=1e-3)
    assert slide["baseline_of_same_run"]["case"] == "llama3_8b-mb8-capnone-ceiling"
    rows = {row["target"][:6]: row for row in report.target_rows(records)}
    assert rows["8B at "]["value"] == pytest.approx(slide["step_s_mean"] / slide["bounds_s"]["cpu_update"])
    assert "slots-auto" in rows["8B, 24"]["binding"]  # the shipped window's case stands for the 64k target
    assert rows["the sa"]["value"] == pytest.approx(11000.0 / 8800.0) and rows["the sa"]["met"]
    assert rows["expose"]["value"] == pytest.approx(0.2, abs=1e-3) and rows["expose"]["met"] is False
    assert rows["expose"]["hint"].startswith("the step boundary") and rows["8B at "]["hint"].startswith("fewer host")
    assert "slots-auto" in rows["expose"]["binding"]
    assert "(0.000 s of it beside other streams' kernels)" in rows["expose"]["binding"]


def test_report_writes_summary_plots_ladders_and_per_case_json(tmp_path) -> None:
    records = _run_records()
    climbed = LadderLog.for_case(CASES["llama3_8b-cap24-slide-cpu-max-mb"])
    climbed.pass_rung({"size": 64, "tokens": 65536, "step_s": 6.0, "peak_vram_alloc_gib": 20.0, "rss_gib": 108.0})
    climbed.start(96, "step")
    records.append({**base_record(CASES["llama3_8b-cap24-slide-cpu-max-mb"]),
                    **conclude(climbed.to_result(), "killed by SIGKILL after 99 s, likely out of host memory")})
    finalize(records)
    report.write(tmp_path, records)
    summary = (tmp_path / "summary.md").read_text()
    assert "| llama3_8b-mb8-cap24-slide-cpu |" in summary and "cpu, slots=auto" in summary
    assert "96 failed (step): killed by SIGKILL" in summary and (tmp_path / "bounds.png").exists()
    assert "| 0.5 | embed 0.300, block.0 0.200 | embed 0.150, block.0 0.100 | 2 / 1 |" in summary
    assert "| 60 | 0 | 4 | 30 | 0 | 2 | block.0 30.00, block.1 20.00, embed 10.00 |" in summary
    report.copy_results(tmp_path, tmp_path / "results", records)
    assert json.loads((tmp_path / "results" / "probe.json").read_text())["ok"]


def test_the_summary_splits_each_optimizer_threads_time_by_the_units_it_updates() -> None:
    records = _run_records()
    finalize(records)
    summary = report.summary_md(records)
    assert "| llama3_8b-mb8-cap24-slide-cpu | 2.73 | CPU | 2 | 2 | 0.25 | 0.08 | 0.1 | 0.15 | - |" in summary
    assert "| llama3_8b-mb8-cap24-slide-cpu | 2.73 | GPU | 1 | 1 | 0.09 | 0 | 0.09 | - | - |" in summary


def test_a_ladder_stops_at_its_first_failure_and_keeps_what_passed(tmp_path, monkeypatch) -> None:
    import benchmarks.loops

    build = benchmarks.loops.make_step

    def failing_at_8(case, device, seq_len):
        step = build(case, device, seq_len)

        def checked(ids: torch.Tensor) -> torch.Tensor:
            if ids.shape[0] >= 8:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            return step(ids)

        return checked

    monkeypatch.setattr(benchmarks.loops, "make_step", failing_at_8)
    case = ladder("plain", "tiny", "micro_batch", (2, 4, 8, 16), time_cap_s=60, seq_len=32, cap_gib=None,
                  device="cpu")
    result = run_ladder(case, torch.device("cpu"), tmp_path / "r.json", None, case.time_cap_s, time.perf_counter())
    climbed = result["ladder"]
    assert result["ok"] and climbed["max_passed"] == 4 and [r["size"] for r in climbed["passed"]] == [2, 4]
    assert climbed["first_failure"]["size"] == 8 and "simulated" in climbed["first_failure"]["error"]
    assert json.loads((tmp_path / "r.json").read_text())["ladder"]["max_passed"] == 4  # written as it climbed


def test_a_ladder_does_not_start_a_rung_past_its_time_cap(tmp_path) -> None:
    case = ladder("plain", "tiny", "seq_len", (16, 32), time_cap_s=60, cap_gib=None, device="cpu")
    started = -1e9  # the cap is long gone once the first rung has run
    result = run_ladder(case, torch.device("cpu"), tmp_path / "r.json", None, 60.0, started)
    assert result["ladder"]["max_passed"] == 16 and result["ladder"]["stopped"].startswith("time cap")


def test_a_host_ram_kill_ends_a_ladder_and_may_be_retried_fresh() -> None:
    case = CASES["llama3_8b-cap24-slide-cpu-max-mb"]
    log = LadderLog.for_case(case)
    log.pass_rung({"size": 64, "step_s": 6.0})
    log.start(96, "step")
    killed = LadderLog.from_result(conclude(log.to_result(), "killed by SIGKILL"))
    assert killed.first_failure == {"size": 96, "phase": "step", "error": "killed by SIGKILL"}
    assert retry_size(case, killed, host_killed=True, left_s=500.0) == 96
    assert retry_size(case, killed, host_killed=True, left_s=10.0) is None
    assert retry_size(case, killed, host_killed=False, left_s=500.0) is None
    fresh = LadderLog.for_case(case)
    fresh.pass_rung({"size": 96, "step_s": 9.0})
    fresh.fail("OutOfMemoryError")
    merged = merge_retry(killed, fresh.to_result())["ladder"]
    assert merged["max_passed"] == 96 and merged["retried"]["error"] == "killed by SIGKILL"


def test_runner_records_skipped_cases_when_the_budget_is_spent(tmp_path) -> None:
    runner = Runner(tmp_path, budget_s=0.0, include_known_failures=False, command="test")
    records = runner.run_all(resolve(["probe-cpu"]))
    assert records[0]["error"].startswith("skipped: time budget")
    assert (tmp_path / "results.jsonl").read_text().count("\n") == 1


def test_runner_runs_the_cases_in_turn_for_each_round(tmp_path) -> None:
    runner = Runner(tmp_path, budget_s=0.0, include_known_failures=False, command="test")
    records = runner.run_all(resolve(["probe-cpu", "tiny-mb4-seq64-capnone-ceiling"]), rounds=2)
    assert [(r["case"], r["round"]) for r in records] == [("probe-cpu", 1), ("tiny-mb4-seq64-capnone-ceiling", 1),
                                                          ("probe-cpu", 2), ("tiny-mb4-seq64-capnone-ceiling", 2)]


def test_rounds_enter_the_targets_as_each_cases_mean_and_show_their_spread(tmp_path) -> None:
    slide, ds3 = "llama3_3b-mb8-cap24-slide-cpu", "llama3_3b-mb8-cap24-ds3"
    records = [_record(slide, tokens_per_s=9000.0, step_s_mean=0.91, round=1),
               _record(ds3, tokens_per_s=2000.0, step_s_mean=4.1, round=1),
               _record(slide, tokens_per_s=9900.0, step_s_mean=0.83, round=2),
               _record(ds3, tokens_per_s=2000.0, step_s_mean=4.1, round=2)]
    finalize(records)
    (row,) = [row for row in report.target_rows(records) if row["target"].startswith("3B mb8")]
    assert row["value"] == pytest.approx(9450.0 / 2000.0)
    summary = report.summary_md(records)
    assert f"| {slide} (round 2) |" in summary and f"| {slide} | 9,000 / 9,900 | 9,450 | 10.0% |" in summary
    report.copy_results(tmp_path, tmp_path / "copy", records)
    assert (tmp_path / "copy" / f"{slide}-round2.json").exists()


def test_runner_climbs_a_tiny_slide_ladder_in_one_worker(tmp_path) -> None:
    case = CASES["tiny-capnone-slide-cpu-max-mb"]
    records = Runner(tmp_path, budget_s=300.0, include_known_failures=False, command="test").run_all([case])
    climbed = records[0]["ladder"]
    assert records[0]["ok"] and climbed["max_passed"] == 8 and climbed["stopped"] == "all rungs passed"
    assert "--time-cap-s" in records[0]["case_command"]


def test_tiny_ceiling_case_measures_a_window() -> None:
    from benchmarks.loops import run_timed

    result = run_timed(CASES["tiny-mb4-seq64-capnone-ceiling"], torch.device("cpu"))
    assert result["tokens_per_s"] > 0 and result["timed_steps"] == 10 and len(result["step_times_s"]) == 10
    assert result["gpu_idle"] is None and result["first_nonfinite_step"] is None
    assert len(result["loss_steps"]) == result["warmup_steps"] + 10 and result["loss_last"] == result["loss_steps"][-1]


def test_the_clock_keeps_every_steps_loss_and_names_the_first_that_was_not_finite() -> None:
    clock = WindowClock(warmup=1, steps=2, device=torch.device("cpu"))
    for loss in (2.5, 2.4, float("nan")):
        clock.tick(torch.tensor(loss))
    summary = clock.summary(tokens_per_step=8)
    assert summary["loss_steps"][:2] == pytest.approx([2.5, 2.4]) and summary["first_nonfinite_step"] == 3


def test_a_timed_case_whose_loss_went_nan_is_a_failure_that_says_so() -> None:
    from benchmarks.worker import _trained

    assert _trained({"loss_steps": [2.0, 2.0], "first_nonfinite_step": None}) == (True, None)
    ok, error = _trained({"loss_steps": [2.0, float("nan"), float("nan")], "first_nonfinite_step": 2})
    assert not ok and "not finite from step 2 of 3" in error


def test_the_recompute_ceiling_checkpoints_every_layer_and_computes_the_same_losses(monkeypatch) -> None:
    import transformers

    from benchmarks.cases import make
    from benchmarks.loops import run_timed

    enabled = []
    original = transformers.PreTrainedModel.gradient_checkpointing_enable
    monkeypatch.setattr(transformers.PreTrainedModel, "gradient_checkpointing_enable",
                        lambda self, *a, **kw: (enabled.append(type(self).__name__), original(self, *a, **kw))[1])
    shape = {"seq_len": 64, "cap_gib": None, "device": "cpu", "warmup": 1, "steps": 2, "est_s": 30}
    torch.manual_seed(0)  # the same random weights for both
    plain = run_timed(make("ceiling", "tiny", 4, **shape), torch.device("cpu"))
    torch.manual_seed(0)
    recomputed = run_timed(make("ceiling-recompute", "tiny", 4, **shape), torch.device("cpu"))
    assert enabled and recomputed["loss_steps"] == pytest.approx(plain["loss_steps"], rel=1e-5)


def test_engine_figures_per_step_include_the_waits_per_unit() -> None:
    from benchmarks.records import engine_per_step

    stats = {"start": {"steps": 3, "wait_update_s": 1.0, "wait_update_by_unit_s": {"embed": 1.0}, "kept_graphs": 4},
             "end": {"steps": 13, "wait_update_s": 6.0, "wait_update_by_unit_s": {"embed": 3.0, "block.0": 3.0}}}
    assert engine_per_step(stats) == {"wait_update_s": 0.5, "wait_update_by_unit_s": {"embed": 0.2, "block.0": 0.3}}



def test_a_clipped_case_trains_with_the_trainers_gradient_clipping(monkeypatch) -> None:
    import benchmarks.lit as lit
    from benchmarks.cases import make

    clips, trainer = [], lit.pl.Trainer
    monkeypatch.setattr(lit.pl, "Trainer", lambda **kw: (clips.append(kw["gradient_clip_val"]), trainer(**kw))[1])
    case = make("slide", "tiny", 4, seq_len=64, cap_gib=None, device="cpu", warmup=1, steps=2, est_s=30, clip=1.0)
    assert case.name == "tiny-mb4-seq64-capnone-slide-cpu-clip1"
    assert lit.run_lightning(case, torch.device("cpu"))["tokens_per_s"] > 0 and clips == [1.0]
    with pytest.raises(ValueError, match="clip applies to the Lightning systems"):
        make("plain", "tiny", 4, seq_len=64, cap_gib=None, device="cpu", clip=1.0)


def test_the_packing_benchmark_trains_both_modes_and_packing_pads_less(tmp_path) -> None:
    from benchmarks import packing

    record = packing.main(["--model", "tiny", "--seq-len", "64", "--batch-size", "2", "--examples", "80",
                           "--median", "20", "--warmup", "1", "--steps", "2", "--work", str(tmp_path / "work"),
                           "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "packing-tiny.json").read_text())
    assert saved["real_tokens_per_s_ratio"] == record["real_tokens_per_s_ratio"] > 0
    padded, packed = saved["padding"], saved["packing"]
    assert packed["padding"] < padded["padding"] and packed["real_tokens"] > padded["real_tokens"]
    assert packed["report"].startswith("packing: ") and padded["report"] is None
    assert {"command", "commit", "date", "machine", "model_config", "vram_cap_gib"} <= set(saved)


def _compact(argv: list[str]) -> None:
    """`python -m benchmarks.compact ...` in this process."""
    import sys

    from benchmarks import compact

    sys_argv, sys.argv = sys.argv, argv
    try:
        compact.main()
    finally:
        sys.argv = sys_argv


def test_the_compact_moments_benchmark_compares_each_precision_with_fp32_in_both_phases(tmp_path) -> None:
    """A tiny model on the CPU: pretraining from one seed, then fine-tuning from the fp32 run's checkpoint."""
    argv = ["compact", "quality", "--model", "tiny", "--steps", "4", "--finetune-steps", "3", "--val-every", "2",
            "--val-batches", "1", "--micro-batch", "2", "--seq-len", "32", "--out", str(tmp_path),
            "--scratch", str(tmp_path / "scratch")]
    _compact(argv)
    record = json.loads((tmp_path / "compact-quality-bf16-int8.json").read_text())
    assert set(record["summary"]) == {f"{phase}/{p}" for phase in ("pretrain", "finetune") for p in ("bf16", "int8")}
    starts = {p: run["first_train_loss"] for p, run in record["pretrain"].items()}
    assert len(set(starts.values())) == 1  # same model, seed and first batch for every precision
    assert all(len(run["train_loss"]) == 3 for run in record["finetune"].values())
    finetune_starts = {run["first_train_loss"] for run in record["finetune"].values()}
    assert len(finetune_starts) == 1  # each precision starts from the fp32 run's weights
    assert (tmp_path / "compact-quality-bf16-int8.png").exists()
    assert not (tmp_path / "scratch" / "fp32-pretrained.ckpt").exists()


def test_a_compact_fine_tuning_comparison_alone_pretrains_only_the_fp32_run_it_continues(tmp_path) -> None:
    argv = ["compact", "quality", "--model", "tiny", "--steps", "3", "--finetune-steps", "2", "--val-every", "2",
            "--val-batches", "1", "--micro-batch", "2", "--seq-len", "32", "--precisions", "int8",
            "--phases", "finetune", "--out", str(tmp_path), "--scratch", str(tmp_path / "scratch")]
    _compact(argv)
    record = json.loads((tmp_path / "compact-quality-int8-finetune.json").read_text())
    assert list(record["pretrain"]) == ["fp32"] and list(record["finetune"]) == ["fp32", "int8"]
    assert set(record["summary"]) == {"finetune/int8"}


def test_the_compact_update_benchmark_times_each_precision_per_piece_and_pool_size(tmp_path) -> None:
    argv = ["compact", "update", "--elements", "8192", "--pieces", "1024", "--threads", "1", "2", "--repeats", "1",
            "--out", str(tmp_path)]
    _compact(argv)
    results = json.loads((tmp_path / "compact-update.json").read_text())["results"]
    assert [(r["precision"], r["pool_threads"]) for r in results] == [
        ("fp32", None), ("bf16", 1), ("bf16", 2), ("int8", 1), ("int8", 2)]
    assert all(r["gelem_per_s"] > 0 for r in results)


def test_the_disk_probe_writes_syncs_and_removes_its_file(tmp_path) -> None:
    from benchmarks.e2e import disk_write_gbs

    assert disk_write_gbs(tmp_path, gib=1 / 16) > 0
    assert list(tmp_path.iterdir()) == []


def test_a_save_rate_is_its_file_size_over_its_time_and_links_have_none(tmp_path) -> None:
    from benchmarks.e2e import save_rates

    (tmp_path / "epoch=0-step=6.ckpt").write_bytes(b"x" * 4000)
    (tmp_path / "last.ckpt").symlink_to("epoch=0-step=6.ckpt")
    run = {"saves_s": {"epoch=0-step=6.ckpt": 2e-6, "last.ckpt": 1e-6, "gone.ckpt": 1.0}}
    assert save_rates(run, tmp_path) == {"epoch=0-step=6.ckpt": pytest.approx(2.0)}


def test_a_gpu_session_skips_what_starts_past_its_deadline_and_still_packs_its_archive(tmp_path) -> None:
    out = tmp_path / "out"
    python = Path(sys.executable).parent
    env = {**os.environ, "OUT": str(out), "DEADLINE": "0", "PATH": f"{python}:{os.environ['PATH']}"}
    steps = ["check", "ab:tiny-mb4-seq64-capnone-slide-cpu:.:."]
    subprocess.run(["bash", str(ROOT / "scripts" / "gpu_session.sh"), *steps], env=env, check=True,
                   capture_output=True, timeout=120)
    said = (out / "session.txt").read_text()
    assert [line.split("] ", 1)[1] for line in said.splitlines()[:2]] == [f"skipped: {step}" for step in steps]
    with tarfile.open(out / "session.tgz") as archive:
        assert "./session.txt" in archive.getnames() and "./setup.log" in archive.getnames()


def test_a_gpu_session_stopped_mid_step_leaves_the_steps_that_ended_in_its_archive(tmp_path) -> None:
    """A command's wall-clock limit kills the session: what the steps before the one running wrote must come back.
    The session runs from a tree whose `scripts/gpu.sh` stands in: `quick` writes a file, `slow` sleeps."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "gpu_session.sh").write_text((ROOT / "scripts" / "gpu_session.sh").read_text())
    stand_in = 'mkdir -p "$OUT"; case $1 in setup) ;; slow) sleep 60 ;; *) echo $1 > "$OUT/x" ;; esac\n'
    (tmp_path / "scripts" / "gpu.sh").write_text(stand_in)
    out = tmp_path / "out"
    session = subprocess.Popen(["bash", str(tmp_path / "scripts" / "gpu_session.sh"), "quick", "slow"],
                               env={**os.environ, "OUT": str(out)}, start_new_session=True)
    deadline = time.monotonic() + 30
    while not (out / "session.tgz").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)
    assert session.poll() is None  # still in `slow`
    os.killpg(session.pid, 9)
    session.wait(timeout=30)
    with tarfile.open(out / "session.tgz") as archive:
        assert archive.extractfile("./1-quick/x").read() == b"quick\n"
    assert "quick: exit 0" in (out / "session.txt").read_text()


def test_gpu_sh_refuses_a_command_it_does_not_have(tmp_path) -> None:
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu.sh"), "benchh"], capture_output=True, text=True,
                          env={**os.environ, "OUT": str(tmp_path)}, timeout=60)
    assert done.returncode == 2 and "no command 'benchh'" in done.stderr


def test_a_runner_ended_by_sigterm_kills_the_worker_it_was_watching():
    """Workers run in sessions of their own, which `timeout`'s signal to the runner's group does not reach: a runner
    ended mid-case must not leave its worker measuring beside whatever runs next."""
    script = ("import subprocess\n"
              "from benchmarks.run import _exit_on_sigterm, _watch\n"
              "_exit_on_sigterm()\n"
              "worker = subprocess.Popen(['sleep', '120'], start_new_session=True)\n"
              "print(worker.pid, flush=True)\n"
              "_watch(worker, timeout_s=600)\n")
    runner = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    worker = int(runner.stdout.readline())
    time.sleep(1.0)  # the runner is inside `_watch` by then
    runner.terminate()
    assert runner.wait(timeout=30) == 128 + 15
    time.sleep(0.2)
    with pytest.raises(ProcessLookupError):
        os.kill(worker, 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_pinned_copies_says_it_needs_a_cuda_device(tmp_path) -> None:
    done = subprocess.run([sys.executable, "-m", "benchmarks.pinned_copies", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "measures copies to and from a CUDA device" in done.stderr
    assert not (tmp_path / "pinned_copies.jsonl").exists()


def test_pinned_copies_host_buffers_start_on_a_huge_page_boundary() -> None:
    from benchmarks.pinned_copies import HUGE, _aligned

    for huge in (False, True):
        buffer = _aligned(3 * HUGE, huge=huge)
        assert buffer.data_ptr() % HUGE == 0 and buffer.numel() == 3 * HUGE and bool((buffer == 1).all())
