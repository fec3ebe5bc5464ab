"""Summary table, target ratios and plots from a run: `python -m benchmarks.report DIR [--copy-to D]`.

Reads DIR/results.jsonl, writes DIR/summary.md, DIR/throughput.png and DIR/bounds.png. With
--copy-to it also copies them, plus one JSON file per case, into D (e.g. benchmarks/results), and
with --readme it replaces the block between the result markers of that README with the tables.
"""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from benchmarks.records import EXPOSED_MEANING, HINTS, finalize, tier_label

PLOTS = ("throughput.png", "bounds.png")
MARK_START, MARK_END = "<!-- results:start -->", "<!-- results:end -->"


def _by_case(records: list[dict]) -> dict[str, dict]:
    return {r["case"]: r for r in case_means(records) if r["ok"]}


def case_means(records: list[dict]) -> list[dict]:
    """One record per case, in first-run order: a case run in several rounds stands as its first successful
    record with the rounds' mean throughput, step time and idle share (`rounds`: how many it averages)."""
    groups: dict[str, list[dict]] = {}
    for r in records:
        groups.setdefault(r["case"], []).append(r)
    out = []
    for group in groups.values():
        ran = [r for r in group if r["ok"] and r.get("tokens_per_s")]
        if len(ran) < 2:
            out.append(ran[0] if ran else group[0])
            continue
        mean = {key: sum(r[key] for r in ran) / len(ran) for key in ("tokens_per_s", "step_s_mean")}
        shares = [r["exposed_s"]["share"] for r in ran if (r.get("exposed_s") or {}).get("share") is not None]
        exposed = {**ran[0]["exposed_s"], "share": sum(shares) / len(shares)} if shares else ran[0].get("exposed_s")
        out.append({**ran[0], **mean, "exposed_s": exposed, "rounds": len(ran)})
    return out


def label(record: dict) -> str:
    """A record's case name, with its round where the run had several."""
    return record["case"] + (f" (round {record['round']})" if record.get("round") else "")


def rounds_md(records: list[dict]) -> str:
    """Per case run in several rounds: each round's throughput, the mean and the spread (max / min - 1)."""
    rows = []
    for r in case_means(records):
        if r.get("rounds"):
            each = [x["tokens_per_s"] for x in records if x["case"] == r["case"] and x["ok"] and x.get("tokens_per_s")]
            rows.append([r["case"], " / ".join(f"{t:,.0f}" for t in each), r["tokens_per_s"],
                         f"{100 * (max(each) / min(each) - 1):.1f}%"])
    return _table(["case", "tok/s by round", "mean tok/s", "spread"], rows) if rows else ""


def _slide(name: str, ok: dict[str, dict]) -> str:
    """The slide case as shipped (the default window, slots="auto") when it ran, else the fixed-window one."""
    return f"{name}-slots-auto" if f"{name}-slots-auto" in ok else name


def _ratio(numerator: str, denominator: str) -> Callable[[dict[str, dict]], tuple[float, str] | None]:
    """Throughput of a slide case over another case's, with the slide case's binding bound (and its name)."""
    def measure(ok: dict[str, dict]) -> tuple[float, str] | None:
        name = _slide(numerator, ok)
        if name not in ok or denominator not in ok:
            return None
        return ok[name]["tokens_per_s"] / ok[denominator]["tokens_per_s"], f"{ok[name].get('binding')} ({name})"
    return measure


def _over_cpu_bound(name: str) -> Callable[[dict[str, dict]], tuple[float, str] | None]:
    """Measured step time over the CPU-Adam bound of the same run."""
    def measure(ok: dict[str, dict]) -> tuple[float, str] | None:
        record = ok.get(_slide(name, ok))
        bound = (record or {}).get("bounds_s", {}).get("cpu_update")
        if not bound:
            return None
        return record["step_s_mean"] / bound, f"{record.get('binding')} ({record['case']})"
    return measure


def _worst_exposed(ok: dict[str, dict]) -> tuple[float, str] | None:
    """The largest idle share of the model's compute in the profiled step among slide cases at >= 32k tokens."""
    shares = [(record["exposed_s"]["share"], record) for record in ok.values()
              if record["system_key"] == "slide" and record["tokens_per_step"] >= 32768
              and (record.get("exposed_s") or {}).get("share") is not None]
    if not shares:
        return None
    share, record = max(shares, key=lambda item: item[0])
    idle = record["exposed_s"]
    beside, own = idle.get("idle_beside_kernels"), idle.get("compute_stream_idle")
    kernels = "" if beside is None else f" ({beside:.3f} s of it beside other streams' kernels)"
    alone = "" if own is None else f"; the compute stream alone idled {own:.3f} s"
    return share, (f"{record.get('binding') or '-'} ({record['case']}; idle {idle['idle_copying']:.3f} s "
                   f"while copying{kernels}, {idle['idle_empty']:.3f} s with the GPU empty{alone})")


#: what leaves the model's compute idle at large steps, whatever bound binds the step as a whole
BOUNDARY_HINT = ("the step boundary: the next forward's first units (embedding, first blocks) wait for updates "
                 "that start only when the backward ends; the table of waits per unit says which")

#: (what, measure, goal, True when higher is better, hint when missed: None for the binding bound's)
TARGETS = [
    ("8B, 24 GiB cap, 64x1024 tok/step vs the fwd+bwd ceiling (8B mb8, uncapped)",
     _ratio("llama3_8b-mb64-cap24-slide-cpu", "llama3_8b-mb8-capnone-ceiling"), 0.9, True, None),
    ("the same vs the ceiling of the same work (8B mb8, uncapped, every block recomputed as under the cap)",
     _ratio("llama3_8b-mb64-cap24-slide-cpu", "llama3_8b-mb8-capnone-ceiling-recompute"), 0.9, True, None),
    ("3B mb8, 24 GiB cap vs deepspeed_stage_3_offload",
     _ratio("llama3_3b-mb8-cap24-slide-cpu", "llama3_3b-mb8-cap24-ds3"), 5.0, True, None),
    ("8B at 8k tok/step: step time / CPU-Adam bound",
     _over_cpu_bound("llama3_8b-mb8-cap24-slide-cpu"), 1.2, False, None),
    ("exposed transfer + update (the model's compute idle) / step at >= 32k tok/step, worst slide case",
     _worst_exposed, 0.03, False, BOUNDARY_HINT),
    ("8-bit moments, 8B at 8k tok/step: step time / the fp32 CPU-Adam bound",
     _over_cpu_bound("llama3_8b-mb8-cap24-slide-cpu-int8-moments"), 0.7, False, None),
    ("24-bit masters with 8-bit moments, 8B at 8k tok/step: step time / the fp32 CPU-Adam bound",
     _over_cpu_bound("llama3_8b-mb8-cap24-slide-cpu-int8-moments-master24"), 0.7, False, None),
]


def target_rows(records: list[dict]) -> list[dict]:
    """One row per target: the measured value, the goal, whether it is met, and what binds."""
    ok = _by_case(records)
    rows = []
    for what, measure, goal, higher, hint in TARGETS:
        got = measure(ok)
        value, binding = got if got else (None, None)
        met = None if value is None else (value >= goal if higher else value <= goal)
        rows.append({"target": what, "value": value, "goal": f"{'>=' if higher else '<='} {goal:g}", "met": met,
                     "binding": binding,
                     "hint": None if met or not binding else hint or HINTS.get(binding.split()[0])})
    return rows


def _f(value: object, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 1000:
            return f"{value:.0f}"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.{digits}f}" if abs(value) >= 1 or value == 0 else f"{value:.3g}"
    return str(value)


def _table(header: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_f(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def targets_md(records: list[dict]) -> str:
    rows = [[r["target"], r["value"], r["goal"], {True: "yes", False: "NO", None: "not measured"}[r["met"]],
             r["binding"], r["hint"]] for r in target_rows(records)]
    return _table(["target", "measured", "goal", "met", "binding bound", "what would move it"], rows)


def cases_md(records: list[dict]) -> str:
    """Every timed case that ran: throughput, memory, the three bounds next to the measured step, and the
    model's compute idle time per profiled step (seconds and share of that step)."""
    rows = []
    for r in records:
        if not r["ok"] or r["system_key"] == "probe" or r.get("ladder"):
            continue
        bounds, idle = r.get("bounds_s") or {}, r.get("exposed_s") or {}
        share = idle.get("share")
        rows.append([label(r), r["system"], tier_label(r), r["tokens_per_step"], r["vram_cap_gib"],
                     r["tokens_per_s"], r["step_s_mean"], r.get("tflops_6nt"), r.get("tflops_full"),
                     r.get("peak_vram_alloc_gib"), r.get("peak_vram_reserved_gib"), r.get("peak_rss_gib"),
                     bounds.get("gpu_compute"), bounds.get("pcie"), bounds.get("cpu_update"), r.get("binding"),
                     idle.get("total"), None if share is None else f"{100 * share:.1f}%"])
    header = ["case", "system", "tier", "tok/step", "cap GiB", "tok/s", "step s", "TFLOP/s 6NT", "TFLOP/s full",
              "VRAM alloc GiB", "VRAM res GiB", "RSS GiB", "GPU bound s", "PCIe bound s", "CPU-Adam bound s",
              "binds", "idle s", "idle %"]
    return _table(header, rows)


def probe_md(records: list[dict]) -> str:
    probe = next((r for r in records if r["system_key"] == "probe" and r["ok"]), None)
    if probe is None:
        return "No machine probe in this run: PCIe and CPU-Adam bounds are missing."
    adam, pcie = probe["adam"], probe.get("pcie") or {}
    return (f"Machine probe: CPU AdamW(fused) {adam['params_per_s'] / 1e9:.2f} Gparam/s "
            f"({adam['threads']} threads, {adam['params']:.2g} params); pinned PCIe h2d "
            f"{_f(pcie.get('h2d_gbs'), 1)} GB/s, d2h {_f(pcie.get('d2h_gbs'), 1)} GB/s, "
            f"both ways {_f(pcie.get('bidir_gbs'), 1)} GB/s.")


def ladders_md(records: list[dict]) -> str:
    """Per ladder: the largest size that ran (with its step and memory) and what ended the ladder."""
    rows = []
    for r in records:
        ladder = r.get("ladder")
        if not ladder:
            continue
        best = max(ladder["passed"], key=lambda rung: rung["size"], default={})
        rows.append([r["case"], r["system"], tier_label(r), ladder["grow"], best.get("size"), best.get("tokens"),
                     best.get("step_s"), best.get("tokens_per_s"), best.get("tflops_full"),
                     best.get("peak_vram_alloc_gib"), best.get("rss_gib"), best.get("disk_gib"), _ending(ladder)])
    header = ["ladder", "system", "tier", "grows", "largest that ran", "tokens", "step s", "tok/s", "TFLOP/s full",
              "VRAM alloc GiB", "RSS GiB", "disk GiB", "then"]
    return _table(header, rows) if rows else ""


def rungs_md(records: list[dict]) -> str:
    """Every rung that ran, of every ladder: its step, throughput, model TFLOP/s and memory peaks."""
    rows = [[r["case"], rung["size"], rung["tokens"], rung["step_s"], rung.get("tokens_per_s"), rung.get("tflops_6nt"),
             rung.get("tflops_full"), rung.get("peak_vram_alloc_gib"), rung.get("rss_gib"), rung.get("disk_gib")]
            for r in records for rung in (r.get("ladder") or {}).get("passed", [])]
    header = ["ladder", "rung", "tokens", "step s", "tok/s", "TFLOP/s 6NT", "TFLOP/s full", "VRAM alloc GiB",
              "RSS GiB", "disk GiB"]
    return _table(header, rows) if rows else ""


def _ending(ladder: dict) -> str:
    """What ended a ladder: its first failure (size, phase, error), the time cap, or the last rung."""
    failure = ladder.get("first_failure")
    text = (f"{failure['size']} failed ({failure['phase']}): {str(failure['error']).splitlines()[0][:160]}"
            if failure else str(ladder.get("stopped")))
    retried = ladder.get("retried")
    if retried:
        text += f" [retried fresh after: {retried['size']} {str(retried['error']).splitlines()[0][:80]}]"
    return text


def _engine_steps(records: list[dict], counter: str) -> Iterator[tuple[str, dict]]:
    """(case, per-step engine counters) of each case that ran and recorded `counter`."""
    for r in records:
        engine = r.get("engine_per_step") or {}
        if r["ok"] and counter in engine:
            yield label(r), engine


def waits_md(records: list[dict]) -> str:
    """Per lightning-slide case, per step: how busy the optimizer and copy threads were, how long the training
    thread waited for a free gradient buffer and for updates, the units whose updates it waited for most, the
    optimizer thread's own time on those units (a wait longer than that was spent on other work first), and the
    CUDA allocator's retries and cudaFree calls (each synchronises the whole device)."""
    rows = []
    for case, engine in _engine_steps(records, "wait_update_s"):
        units = sorted((engine.get("wait_update_by_unit_s") or {}).items(), key=lambda kv: -kv[1])[:3]
        work = engine.get("update_work_by_unit_s") or {}
        syncs = (None if "alloc_retries" not in engine
                 else f"{engine['alloc_retries']:.3g} / {engine.get('device_frees', 0):.3g}")
        rows.append([case, engine.get("update_busy_s"), engine.get("copy_busy_s"), engine.get("wait_grads_s"),
                     engine["wait_update_s"], ", ".join(f"{name} {s:.3f}" for name, s in units) or "-",
                     ", ".join(f"{name} {work[name]:.3f}" for name, _ in units if name in work) or "-", syncs])
    header = ["case", "update busy s", "copies busy s", "waited for a gradient buffer s", "waited for updates s",
              "updates waited for most (s)", "optimizer thread's time on them (s)",
              "allocator retries / device frees"]
    return _table(header, rows) if rows else ""


def _on_thread(by_unit: dict[str, float] | None, on_gpu: list[str], gpu: bool) -> dict[str, float]:
    """The units of a per-unit stat that the GPU's optimizer thread updates (`gpu`), or the CPU's."""
    return {u: s for u, s in (by_unit or {}).items() if (u in on_gpu) == gpu}


def threads_md(records: list[dict]) -> str:
    """Per lightning-slide case, per step, each optimizer thread: how busy it was, how many units it updates (all of
    a unit's updates run on one thread: the GPU's for the units the engine's `gpu_updated_units` names), their own
    time and the thread's waits for their gradients to land (busy time holds both), the mean of its decoder blocks'
    own time, and the embedding's and the head's where it has them. Set against the step, the CPU thread's busy time
    says whether its update binds."""
    rows = []
    for r in records:
        engine = r.get("engine_per_step") or {}
        on_gpu = ((r.get("engine_stats") or {}).get("end") or {}).get("gpu_updated_units")
        if not r["ok"] or "update_work_by_unit_s" not in engine or not isinstance(on_gpu, list):
            continue  # records from before the engine named the GPU's units
        for thread, busy in (("CPU", engine.get("update_busy_s")), ("GPU", engine.get("gpu_update_busy_s"))):
            units, landing = (_on_thread(engine.get(stat), on_gpu, thread == "GPU")
                              for stat in ("update_work_by_unit_s", "wait_landing_by_unit_s"))
            blocks = [s for u, s in units.items() if u.startswith("block.")]
            rows.append([label(r), r.get("step_s_mean"), thread, busy, len(units), sum(units.values()),
                         sum(landing.values()) if "wait_landing_by_unit_s" in engine else None,
                         sum(blocks) / len(blocks) if blocks else None, units.get("embed"), units.get("head")])
    header = ["case", "step s", "optimizer thread", "busy s", "units", "their own time s",
              "waited for gradients to land s", "per block s", "embedding s", "head s"]
    return _table(header, rows) if rows else ""


def traffic_md(records: list[dict]) -> str:
    """Per lightning-slide case, per step: the GB each kind of copy moved each way across PCIe, and the units whose
    loads moved most (a unit loaded again is one whose slot was taken or whose new weights no update wrote there)."""
    rows = []
    for case, engine in _engine_steps(records, "h2d_loads_bytes"):
        loads = sorted((engine.get("load_by_unit_bytes") or {}).items(), key=lambda kv: -kv[1])[:3]
        rows.append([case, *(engine[f"h2d_{k}_bytes"] / 1e9 for k in ("loads", "saved_inputs", "updates")),
                     *(engine[f"d2h_{k}_bytes"] / 1e9 for k in ("gradients", "saved_inputs", "updates")),
                     ", ".join(f"{name} {n / 1e9:.2f}" for name, n in loads) or "-"])
    header = ["case", "up: loads GB", "up: saved inputs GB", "up: updates GB", "back: gradients GB",
              "back: saved inputs GB", "back: updates GB", "loaded most (GB)"]
    return _table(header, rows) if rows else ""


def copies_md(records: list[dict]) -> str:
    """Per profiled case, per step: how long copies moved each way on the GPU timeline, what they moved, their
    rate while moving, and how long both directions moved at once (`gpu_idle.copy_times`)."""
    rows = []
    for r in records:
        copies = (r.get("gpu_idle") or {}).get("copies") if r["ok"] else None
        if not copies or not copies["both_s"]:
            continue
        mean = {key: sum(values) / len(values) for key, values in copies.items()}
        rows.append([label(r), *(v for way in ("h2d", "d2h") for v in (
            mean[f"{way}_s"], mean[f"{way}_gb"], mean[f"{way}_gb"] / mean[f"{way}_s"] if mean[f"{way}_s"] else None)),
            mean["both_s"]])
    header = ["case", "up: moving s", "up: GB", "up: GB/s while moving", "back: moving s", "back: GB",
              "back: GB/s while moving", "both ways at once s"]
    return _table(header, rows) if rows else ""


def gap_causes_md(records: list[dict]) -> str:
    """Per profiled case, the last counted step's idle time by why its gaps ended (`gpu_idle.gap_causes`)."""
    rows = []
    for r in records:
        causes = (r.get("gpu_idle") or {}).get("gap_causes") if r["ok"] else None
        if not causes:
            continue
        blocked = ", ".join(f"{name} {t:.3f}" for name, t in causes["late_blocked_in_s"].items()) or "-"
        rows.append([label(r), *(causes["idle_s"].get(k, 0.0) for k in ("launched_late", "queued", "unmatched")),
                     blocked])
    header = ["case", "kernel launched after the gap began s", "kernel queued, waiting on the device s",
              "no launch in the profile s", "the host's long CUDA calls in the late gaps (s)"]
    return _table(header, rows) if rows else ""


def failures_md(records: list[dict]) -> str:
    rows = [[label(r), r["system"], str(r["error"]).splitlines()[0][:240] if r["error"] else "-"]
            for r in records if not r["ok"]]
    return _table(["case", "system", "error"], rows) if rows else "None."


def tables_md(records: list[dict]) -> str:
    """The tables the README embeds (no header, no images)."""
    parts = [probe_md(records), "### Targets", targets_md(records), "### Cases", cases_md(records)]
    rounds = rounds_md(records)
    if rounds:
        parts += ["### Rounds (the targets and plots use each case's mean)", rounds]
    ladders = ladders_md(records)
    if ladders:
        parts += ["### Largest that fits under the cap", ladders, "### Every rung that ran", rungs_md(records)]
    waits = waits_md(records)
    if waits:
        parts += ["### What the training thread waited for (per step)", waits]
    threads = threads_md(records)
    if threads:
        parts += ["### The optimizer threads (per step)", threads]
    traffic = traffic_md(records)
    if traffic:
        parts += ["### What crossed PCIe (per step)", traffic]
    copies = copies_md(records)
    if copies:
        parts += ["### PCIe on the GPU timeline (per profiled step)", copies]
    causes = gap_causes_md(records)
    if causes:
        parts += ["### Why the model's compute idled (the last profiled step)", causes]
    parts += ["### Failed or not run (a result in its own right)", failures_md(records)]
    return "\n\n".join(parts)


def summary_md(records: list[dict]) -> str:
    first = records[0] if records else {}
    machine = first.get("machine", {})
    gpu = next((r["machine"].get("gpu") for r in records if r.get("machine", {}).get("gpu")), "no GPU")
    head = (f"# Benchmark summary\n\n{first.get('date')}, commit `{first.get('commit')}`; {gpu}, "
            f"{machine.get('cpu')} ({machine.get('cpus')} CPUs, {_f(machine.get('ram_gib'), 0)} GiB); torch "
            f"{machine.get('torch')}, transformers {machine.get('transformers')}, lightning "
            f"{machine.get('lightning')}, deepspeed {machine.get('deepspeed')}.\n\nCommand: `{first.get('command')}`\n"
            "TFLOP/s 6NT: " + str(first.get("flop_formula")) + "; full: " + str(first.get("flop_formula_full"))
            + f"\n\n`idle s` and `idle %` (the exposed transfer + update time): {EXPOSED_MEANING}.")
    plots = "\n\n![throughput](throughput.png)\n\n![step time vs bounds](bounds.png)\n"
    return head + "\n\n" + tables_md(records) + plots


def summary_text(records: list[dict]) -> str:
    """A short plain-text view for the end of the run's output."""
    lines = [f"{'case':<44} {'tok/s':>9} {'step s':>7}  error"]
    for r in records:
        if r["system_key"] == "probe":
            continue
        if r.get("ladder"):
            lines.append(f"{r['case']:<44} largest {r['ladder']['max_passed']}, then {_ending(r['ladder'])[:90]}")
            continue
        error = "" if r["ok"] else str(r["error"]).splitlines()[0][:70]
        lines.append(f"{label(r):<44} {_f(r.get('tokens_per_s')):>9} {_f(r.get('step_s_mean')):>7}  {error}")
    lines += [f"target: {row['target']}: {_f(row['value'])} (goal {row['goal']}, binds: {row['binding']})"
              for row in target_rows(records)]
    return "\n".join(lines)


def write(out: Path, records: list[dict]) -> None:
    """summary.md and the plots into `out` (plots are skipped with a note if matplotlib is missing)."""
    (out / "summary.md").write_text(summary_md(records))
    try:
        from benchmarks.plots import plot_bounds, plot_throughput
    except ImportError as error:
        print(f"plots skipped: {error}")
        return
    means = case_means(records)
    plot_throughput(means, out / PLOTS[0])
    plot_bounds(means, out / PLOTS[1])


def load(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines() if line.strip()]


def copy_results(src: Path, dest: Path, records: list[dict]) -> None:
    """The run's files plus one `<case>.json` per record (each readable on its own; `<case>-round<k>.json` where
    the run had rounds) into `dest`."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("results.jsonl", "summary.md", *PLOTS):
        if (src / name).exists():
            shutil.copy2(src / name, dest / name)
    for record in records:
        suffix = f"-round{record['round']}" if record.get("round") else ""
        (dest / f"{record['case']}{suffix}.json").write_text(json.dumps(record, indent=1) + "\n")


def update_readme(readme: Path, records: list[dict]) -> None:
    """Replace the text between the result markers of a README with this run's tables."""
    text = readme.read_text()
    if MARK_START not in text or MARK_END not in text:
        raise SystemExit(f"{readme} has no {MARK_START} ... {MARK_END} block to fill")
    before, rest = text.split(MARK_START, 1)
    after = rest.split(MARK_END, 1)[1]
    readme.write_text(f"{before}{MARK_START}\n{tables_md(records)}\n{MARK_END}{after}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dir", type=Path, help="a run's output folder (holding results.jsonl)")
    parser.add_argument("--copy-to", type=Path, help="also copy the results there (e.g. benchmarks/results)")
    parser.add_argument("--readme", type=Path, help="README whose result block gets this run's tables")
    args = parser.parse_args(argv)
    records = load(args.dir)
    finalize(records)
    write(args.dir, records)
    if args.copy_to:
        copy_results(args.dir, args.copy_to, records)
    if args.readme:
        update_readme(args.readme, records)
    print(summary_text(records))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
