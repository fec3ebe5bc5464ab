"""How long the model's compute sat idle per step: the exposed (non-overlapped) transfer and update time.

Measured on the GPU timeline, for every system alike, with no change to the runtimes: after the timed
window (the timed steps run unprofiled), a few more steps run under torch.profiler with CUDA activity
only. At every step end a marker kernel (torch.cuda._sleep's `spin_kernel`, a few hundred cycles) is
queued on the current stream, the one the model computes on; the markers' starts are the step
boundaries on the GPU timeline. Per step, between two markers:

    idle = step - union of the model's kernel intervals

The model's kernels are those of the compute stream and of every other stream that ran a matrix product
(`MATMUL`): the fused loss runs each block's grad_x GEMM on a second stream, and the compute stream's wait for it
is the model's own compute, not a transfer or an update (neither runs a matrix product). At Llama-3.1-8B 64x1024
on an H100 such waits were 0.10 s of the compute stream's 0.36 s idle a step, and with the second stream off
(`ops.cross_entropy.OVERLAP`) the same run idled 0.10 s less at the same throughput (9,555 against 9,567 tok/s).
`idle_compute_stream_s` keeps the compute stream's own idle time beside it.

Idle is time the compute waited: for a weight load, a gradient slot, the CPU update, or the host
(Python, launch overhead). It is split by what the rest of the GPU did meanwhile: `idle_copying_s`
while a copy or another stream's kernel ran (the compute most likely waited on a transfer), and
`idle_empty_s` while the GPU did nothing at all (it waited on the host). The first profiled step
follows the window's closing synchronisation, so it only leads in and is not counted.

`kernels_s` says what the busy time was: the model's kernel time per counted step by kernel name, the
largest first, so two cases of one model can be told apart kernel by kernel. `gaps` says where the idle time sits:
the longest gaps of the last counted step, each with its offset into the step, how much of it the GPU did nothing
at all, the compute kernels either side of it and what else the GPU ran meanwhile (by name, seconds of overlap), so
a wait at the step boundary can be told from a wait inside the backward (a copy is named with its stream);
`idle_by_gap_s` splits each counted step's idle time by its gaps' lengths (under 1 ms, 1-10 ms, 10 ms or more);
`short_gaps_by_next` groups the last counted step's gaps under 1 ms by the kernel after them. `idle_beside_kernels_s`
is the part of each step's idle time during which another stream ran a kernel (an updater's, a cast of a load),
and `side_kernels_in_idle_s` names those kernels in the last counted step.
`gap_causes` says why the last counted step's gaps ended when they did, from the host's CUDA API calls that the same
profile records: the kernel after a gap was launched only after the gap began (`launched_late`: the host had fallen
behind the GPU, waiting or working in Python) or was queued before it (`queued`: it waited on the device, for a copy
or another stream's event); for the late ones, the launching thread's long API calls during the gap (synchronisations,
frees, pinning), by name.
`copies` says how PCIe was used on the same timeline: per counted step and direction, the time any copy was moving
(the union of the copies' intervals), the bytes moved and their rate while moving, and the time both directions
moved at once, so copies that run slowly can be told from copies that wait; `copies_by_stream` splits the last
counted step's copies by stream, so the engine's lanes (loads, gradients, the GPU updater's sets) can be told apart
by what they carry.
"""

from __future__ import annotations

import bisect
import json
import re
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

MARKER = "spin_kernel"  # the kernel torch.cuda._sleep launches
MARKER_CYCLES = 500
MATMUL = re.compile(r"gemm|nvjet|cutlass|splitKreduce", re.IGNORECASE)  # cuBLAS's and CUTLASS's matmul kernels
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
API_CATEGORIES = ("cuda_runtime", "cuda_driver")  # the host's CUDA calls: kernel launches (ATen's, Triton's) and waits
HOST_BLOCKING_US = 100.0  # an API call this long or longer is a wait (a synchronisation, a free, pinning), not a launch
TOP_BLOCKING = 6  # API call names kept in `gap_causes`
TOP_KERNELS = 15  # kernel names kept in `kernels_s`
TOP_GAPS = 8  # idle gaps kept in `gaps`
TOP_BESIDE = 4  # names of the other work kept per gap
TOP_NEXT = 8  # kernels kept in `short_gaps_by_next`
SHORT_GAP_MS = 1.0  # gaps shorter than this are grouped by the kernel after them (`idle_by_gap_s`'s first class)
NAME_CHARS = 100
Interval = tuple[float, float]
COPY_NAMES = {"h2d": "HtoD", "d2h": "DtoH"}  # how the profiler names a copy up and a copy back
GAP_CLASSES_MS = (("under_1ms", 1.0), ("1_to_10ms", 10.0), ("10ms_up", float("inf")))  # name, upper bound (ms)


class IdleProbe:
    """Profiles the steps after the timed window; never raises (a profiler failure is recorded instead)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.error: str | None = None
        self._profiler: torch.profiler.profile | None = None

    def start(self) -> None:
        """Called at the window's last tick, right after its synchronisation: the GPU is idle."""
        try:
            self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            self._profiler.start()
            self.mark()
        except Exception as error:  # noqa: BLE001 - the timed result must survive a profiler failure
            self.error = f"profiler start: {type(error).__name__}: {error}"

    def mark(self) -> None:
        if self.error is None:
            torch.cuda._sleep(MARKER_CYCLES)

    def finish(self) -> dict:
        """Stop after the last profiled step and read the idle time per step from the trace."""
        if self.error is not None:
            return {"error": self.error}
        try:
            torch.cuda.synchronize(self.device)
            self._profiler.stop()
            with tempfile.TemporaryDirectory(prefix="lsbench-trace-") as folder:
                path = Path(folder) / "trace.json"
                self._profiler.export_chrome_trace(str(path))
                trace = json.loads(path.read_text())
            return idle_per_step(read_trace(trace))
        except Exception as error:  # noqa: BLE001 - as above
            return {"error": f"profile: {type(error).__name__}: {error}"}


@dataclass
class Activity:
    """GPU intervals of a profile (µs): the model's kernels (the compute stream's and those of the streams that
    ran a matrix product), all other GPU work, the markers."""

    stream: object  # the compute stream, which the markers ran on
    streams: list  # the model's: the compute stream first, then any other that ran a matrix product
    compute: list[Interval]
    compute_stream: list[Interval]  # the compute stream's kernels alone (a part of `compute`)
    other: list[Interval]
    boundaries: list[float]
    names: list[str]  # the model's kernels' names, in the order of `compute`
    other_names: list[str]  # the other work's names, in the order of `other`
    side: list[Interval]  # the kernels of the other streams (a part of `other`)
    side_names: list[str]  # their names, in the order of `side`
    copies: dict[str, list[tuple[Interval, float, object]]]  # "h2d" / "d2h" -> (interval, bytes, stream) of each
    correlations: list[object]  # the model's kernels' launch correlation ids, in the order of `compute`
    launches: dict[object, tuple[float, object]]  # correlation id -> (when the host called the launch, its thread)
    host_calls: list[tuple[Interval, str, object]]  # the host's API calls of HOST_BLOCKING_US or more: name, thread


def read_trace(trace: dict) -> Activity:
    """The GPU events of a chrome trace (torch.profiler's export): kernels, copies and memsets by stream."""
    spans = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    events = [e for e in spans if e.get("cat") in GPU_CATEGORIES]
    api = [e for e in spans if e.get("cat") in API_CATEGORIES]
    markers = [e for e in events if e["cat"] == "kernel" and MARKER in e.get("name", "")]
    if len(markers) < 3:
        raise ValueError(f"{len(markers)} step markers in the profile; at least 3 are needed for one step")
    stream = Counter(_stream(e) for e in markers).most_common(1)[0][0]
    every = [e for e in events if e["cat"] == "kernel"]
    streams = [stream] + sorted({_stream(e) for e in every if MATMUL.search(e.get("name", ""))} - {stream}, key=str)
    on_model = [e for e in every if _stream(e) in streams]
    kernels = [e for e in on_model if MARKER not in e.get("name", "")]
    others = [e for e in events if not (e["cat"] == "kernel" and _stream(e) in streams)]
    side = [e for e in others if e["cat"] == "kernel"]
    return Activity(
        stream=stream,
        streams=streams,
        compute=[_interval(e) for e in kernels],
        compute_stream=[_interval(e) for e in kernels if _stream(e) == stream],
        other=[_interval(e) for e in others],
        boundaries=sorted(_interval(e)[0] for e in markers if _stream(e) == stream),
        names=[e.get("name", "?")[:NAME_CHARS] for e in kernels],
        other_names=[_other_name(e) for e in others],
        side=[_interval(e) for e in side],
        side_names=[e.get("name", "?")[:NAME_CHARS] for e in side],
        copies={way: [(_interval(e), float((e.get("args") or {}).get("bytes", 0)), _stream(e)) for e in events
                      if e["cat"] == "gpu_memcpy" and tag in e.get("name", "")]
                for way, tag in COPY_NAMES.items()},
        correlations=[_correlation(e) for e in kernels],
        launches={_correlation(e): (float(e["ts"]), e.get("tid")) for e in api if _correlation(e) is not None},
        host_calls=[(_interval(e), e.get("name", "?"), e.get("tid")) for e in api
                    if float(e.get("dur", 0.0)) >= HOST_BLOCKING_US],
    )


def _correlation(event: dict) -> object:
    return (event.get("args") or {}).get("correlation")


def _other_name(event: dict) -> str:
    """A side event's name; a copy's with its stream, which tells the engine's lanes apart (loads, gradients, the
    GPU updater's sets)."""
    name = event.get("name", "?")[:NAME_CHARS]
    return f"{name} (stream {_stream(event)})" if event["cat"] == "gpu_memcpy" else name


def _stream(event: dict) -> object:
    return (event.get("args") or {}).get("stream", event.get("tid"))


def _interval(event: dict) -> Interval:
    start = float(event["ts"])
    return start, start + float(event.get("dur", 0.0))


def idle_per_step(activity: Activity) -> dict:
    """Seconds per profiled step (the lead-in step, before the second marker, left out)."""
    compute, other, side = union(activity.compute), union(activity.other), union(activity.side)
    own = union(activity.compute_stream)
    rows: dict[str, list[float]] = {"step_s": [], "busy_s": [], "idle_s": [], "idle_copying_s": [],
                                    "idle_empty_s": [], "idle_beside_kernels_s": [], "idle_compute_stream_s": []}
    for lo, hi in zip(activity.boundaries[1:], activity.boundaries[2:]):
        idle = gaps(compute, lo, hi)
        copying = length(intersect(idle, other))
        for key, value in (("step_s", hi - lo), ("busy_s", hi - lo - length(idle)), ("idle_s", length(idle)),
                           ("idle_copying_s", copying), ("idle_empty_s", length(idle) - copying),
                           ("idle_beside_kernels_s", length(intersect(idle, side))),
                           ("idle_compute_stream_s", length(gaps(own, lo, hi)))):
            rows[key].append(value / 1e6)
    steps, last = len(rows["step_s"]), LastStep.of(activity, compute, other)
    return {**rows, "stream": activity.stream, "streams": activity.streams, "steps": steps,
            "kernels_s": kernel_times(activity, steps),
            "gaps": largest_gaps(activity, last), "idle_by_gap_s": idle_by_gap(compute, activity.boundaries),
            "short_gaps_by_next": short_gaps_by_next(activity, last),
            "side_kernels_in_idle_s": side_kernels_in_idle(activity, last), "gap_causes": gap_causes(activity, last),
            "copies": copy_times(activity), "copies_by_stream": copy_streams(activity)}


@dataclass
class LastStep:
    """The last counted step's gaps in the model's compute, found once for the analyses that look into them: the
    step's start, the gaps, the model's kernels in start order (their indices and starts, to find the kernels
    either side of a gap), and how much of a span the other GPU work covers."""

    lo: float
    idle: list[Interval]
    order: list[int]
    starts: list[float]
    busy_elsewhere: Callable[[float, float], float]

    @classmethod
    def of(cls, activity: Activity, compute: list[Interval], other: list[Interval]) -> LastStep:
        """`compute` and `other`: the unions of the model's kernel intervals and of all other GPU work."""
        lo, hi = activity.boundaries[-2], activity.boundaries[-1]
        order = sorted(range(len(activity.compute)), key=lambda i: activity.compute[i])
        return cls(lo, gaps(compute, lo, hi), order, [activity.compute[i][0] for i in order], _coverage(other))

    def around(self, end: float) -> tuple[int | None, int | None]:
        """The model's kernels either side of a gap ending at `end` (indices into `Activity.compute`; None where the
        step has none on that side)."""
        after = bisect.bisect_left(self.starts, end)
        return (self.order[after - 1] if after > 0 else None,
                self.order[after] if after < len(self.order) else None)


def idle_by_gap(compute: list[Interval], boundaries: list[float]) -> dict[str, list[float]]:
    """Per counted step, the idle seconds in gaps of each length class (`GAP_CLASSES_MS`): many short gaps are the
    host launching kernels or small waits between them, a few long ones a wait for a transfer or an update."""
    out: dict[str, list[float]] = {name: [] for name, _ in GAP_CLASSES_MS}
    for lo, hi in zip(boundaries[1:], boundaries[2:]):
        found = gaps(compute, lo, hi)
        for (name, below), above in zip(GAP_CLASSES_MS, [0.0] + [b for _, b in GAP_CLASSES_MS]):
            out[name].append(sum(b - a for a, b in found if above * 1e3 <= b - a < below * 1e3) / 1e6)
    return out


def short_gaps_by_next(activity: Activity, last: LastStep) -> dict[str, dict]:
    """The last counted step's gaps under `SHORT_GAP_MS`, by the compute kernel that ends them (the `TOP_NEXT` with
    the most idle time): how many, their idle seconds, and how much of that the GPU did nothing at all. Many short
    waits before one kernel (a block's first, after its load) tell a transfer just too late from the host's launch
    pace (the GPU empty)."""
    found: dict[str, dict] = {}
    for start, end in last.idle:
        _, after = last.around(end)
        if end - start >= SHORT_GAP_MS * 1e3 or after is None:
            continue
        row = found.setdefault(activity.names[after], {"count": 0, "idle_s": 0.0, "empty_s": 0.0})
        row["count"] += 1
        row["idle_s"] += (end - start) / 1e6
        row["empty_s"] += (end - start - last.busy_elsewhere(start, end)) / 1e6
    return dict(sorted(found.items(), key=lambda kv: -kv[1]["idle_s"])[:TOP_NEXT])


def gap_causes(activity: Activity, last: LastStep) -> dict[str, dict[str, float]]:
    """The last counted step's idle time (s) by why its gaps ended when they did (`launched_late`, `queued`, or
    `unmatched` where the profile has no launch for the kernel after the gap), and the launching thread's long API
    calls during the gaps whose kernel came late, s by name (`late_blocked_in_s`)."""
    seconds: Counter[str] = Counter()
    blocked: Counter[str] = Counter()
    for start, end in last.idle:
        _, after = last.around(end)
        launch = activity.launches.get(activity.correlations[after]) if after is not None else None
        if launch is None:
            seconds["unmatched"] += end - start
            continue
        at, thread = launch
        if at <= start:
            seconds["queued"] += end - start
            continue
        seconds["launched_late"] += end - start
        for (a, b), name, tid in activity.host_calls:
            if tid == thread and a < at and b > start:
                blocked[name] += min(b, at) - max(a, start)
    return {"idle_s": {cause: t / 1e6 for cause, t in seconds.most_common()},
            "late_blocked_in_s": {name: t / 1e6 for name, t in blocked.most_common(TOP_BLOCKING)}}


def side_kernels_in_idle(activity: Activity, last: LastStep) -> dict[str, float]:
    """The last counted step's idle seconds during which each kernel outside the model's streams ran (the
    `TOP_NEXT` names with the most): an updater's own kernels, the casts of loads."""
    idle = _coverage(last.idle)
    found: Counter[str] = Counter()
    for (a, b), name in zip(activity.side, activity.side_names):
        found[name] += idle(a, b) / 1e6
    return {name: seconds for name, seconds in found.most_common(TOP_NEXT) if seconds > 0}


def copy_streams(activity: Activity) -> dict[str, dict[str, float]]:
    """The last counted step's copies by stream and direction: the seconds that stream's copies moved and their
    GB (copies counted in the step they started in), so the engine's lanes can be told apart by what they carry."""
    lo, hi = activity.boundaries[-2], activity.boundaries[-1]
    out: dict[str, dict[str, float]] = {}
    for way, copies in activity.copies.items():
        for stream in {s for _, _, s in copies}:
            mine = [c for c in copies if c[2] == stream and lo <= c[0][0] < hi]
            if mine:
                moving, gb = _moved(mine, lo, hi)
                out.setdefault(str(stream), {}).update({f"{way}_s": length(moving) / 1e6, f"{way}_gb": gb})
    return out


def copy_times(activity: Activity) -> dict[str, list[float]]:
    """Per counted step: for each direction the seconds some copy moved (`<way>_s`) and the GB moved (`<way>_gb`,
    a copy counted in the step it started in), and the seconds both directions moved at once (`both_s`)."""
    out: dict[str, list[float]] = {key: [] for way in COPY_NAMES for key in (f"{way}_s", f"{way}_gb")}
    out["both_s"] = []
    for lo, hi in zip(activity.boundaries[1:], activity.boundaries[2:]):
        moving = {}
        for way, copies in activity.copies.items():
            moving[way], gb = _moved(copies, lo, hi)
            out[f"{way}_s"].append(length(moving[way]) / 1e6)
            out[f"{way}_gb"].append(gb)
        out["both_s"].append(length(intersect(moving["h2d"], moving["d2h"])) / 1e6)
    return out


def _moved(copies: list[tuple[Interval, float, object]], lo: float, hi: float) -> tuple[list[Interval], float]:
    """When some of `copies` moved within [lo, hi], and the GB of those that started there."""
    return (intersect(union([i for i, _, _ in copies]), [(lo, hi)]),
            sum(n for (start, _), n, _ in copies if lo <= start < hi) / 1e9)


def largest_gaps(activity: Activity, last: LastStep) -> list[dict]:
    """The last counted step's `TOP_GAPS` longest gaps in the model's compute, longest first: offset into the step and
    length (s), how much of it the GPU did nothing at all (s), the compute kernels before and after, and the other
    work that overlapped it (s per name)."""
    out = []
    for start, end in sorted(last.idle, key=lambda g: g[0] - g[1])[:TOP_GAPS]:
        before, after = last.around(end)
        beside: Counter[str] = Counter()
        for (a, b), name in zip(activity.other, activity.other_names):
            if a < end and b > start:
                beside[name] += (min(b, end) - max(a, start)) / 1e6
        out.append({"at_s": (start - last.lo) / 1e6, "idle_s": (end - start) / 1e6,
                    "empty_s": (end - start - last.busy_elsewhere(start, end)) / 1e6,
                    "before": activity.names[before] if before is not None else None,
                    "after": activity.names[after] if after is not None else None,
                    "beside_s": dict(beside.most_common(TOP_BESIDE))})
    return out


def _coverage(intervals: list[Interval]) -> Callable[[float, float], float]:
    """How much of a span [start, end) the sorted, disjoint `intervals` cover: found by bisection, so that thousands
    of gaps can each be measured against a step's thousands of intervals."""
    ends = [b for _, b in intervals]

    def covered(start: float, end: float) -> float:
        total, k = 0.0, bisect.bisect_right(ends, start)  # the first interval ending after `start`
        while k < len(intervals) and intervals[k][0] < end:
            total += min(end, intervals[k][1]) - max(start, intervals[k][0])
            k += 1
        return total

    return covered


def kernel_times(activity: Activity, steps: int) -> dict[str, float]:
    """Seconds per counted step of each of the model's kernel names (the largest `TOP_KERNELS`)."""
    lo, hi = activity.boundaries[1], activity.boundaries[-1]
    totals: Counter[str] = Counter()
    for (start, end), name in zip(activity.compute, activity.names):
        if lo <= start < hi:
            totals[name] += (end - start) / 1e6
    return {name: seconds / max(steps, 1) for name, seconds in totals.most_common(TOP_KERNELS)}


def union(intervals: list[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same time."""
    merged: list[Interval] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def gaps(busy: list[Interval], lo: float, hi: float) -> list[Interval]:
    """The parts of [lo, hi] that sorted, disjoint `busy` intervals leave uncovered."""
    out, at = [], lo
    for start, end in busy:
        if end <= at or start >= hi:
            continue
        if start > at:
            out.append((at, start))
        at = max(at, end)
    if at < hi:
        out.append((at, hi))
    return out


def intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """Overlap of two sorted, disjoint interval lists."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def length(intervals: list[Interval]) -> float:
    return sum(end - start for start, end in intervals)
