"""Benchmark the `ops` kernels against PyTorch eager, torch.compile, Liger-Kernel and Cut Cross-Entropy.

Each case times forward+backward (median of CUDA-event timings, each step launched on an idle,
synchronised GPU, so host-side launch costs count) and measures memory: `transient` is the peak
allocation above the inputs and the gradients that remain afterwards, i.e. what the op needs on
top of what any implementation must hold; `persistent` is what the warm-up left allocated for
good (cuBLAS keeps a workspace per stream, for instance). Elementwise kernels are also timed with
the GPU's queue filled before the step starts (`device_ms`: the GPU time a training step sees,
where the host runs ahead of the GPU) and report achieved bandwidth (the bytes an ideal fused
kernel must move, divided by that time) against a measured device-to-device copy. The fused loss
runs in several of our variants (`LCE_VARIANTS`: schedule, overlap on or off, chunk budget)
beside the baselines, so one run decides the default. One JSON file per case goes to --out, plus a
plot. `--only` restricts the run to some kernels (`KERNELS`), e.g. the loss alone.

    python benchmarks/bench_ops.py --out /tmp/ops                      # H200: about 3-4 minutes
    python benchmarks/bench_ops.py --out /tmp/lce --only linear_cross_entropy
    python benchmarks/bench_ops.py --out /tmp/smoke --smoke            # CPU, Triton interpreter, tiny
    python benchmarks/bench_ops.py --plot /tmp/ops                     # redraw the plot from its JSON files

A system that cannot run a case (not installed, out of memory, unsupported) is recorded with
`"ok": false` and its error, not skipped.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20
KERNELS = ("copy", "linear_cross_entropy", "rms_norm", "rope", "swiglu")  # the values of Case.kernel


def _kernel_names(text: str) -> frozenset[str]:
    names = frozenset(n.strip() for n in text.split(",") if n.strip())
    if not names or names - set(KERNELS):
        raise argparse.ArgumentTypeError(f"expected some of {','.join(KERNELS)}, got {text!r}")
    return names


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under the Triton interpreter")
    p.add_argument("--plot", type=Path, help="only redraw the plot from the JSON files in this folder")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile baselines")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--only", type=_kernel_names, help=f"comma-separated kernels to run, of {','.join(KERNELS)}")
    p.add_argument("--tokens", type=lambda s: tuple(int(t) for t in s.split(",")), default=(4096, 16384, 65536),
                   help="token counts of the fused-loss problems (comma-separated)")
    p.add_argument("--commit", default=os.environ.get("GIT_COMMIT"))
    return p.parse_args()


ARGS = _parse() if __name__ == "__main__" else None
if ARGS is not None and ARGS.smoke:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(ROOT))
from lightning_slide import ops  # noqa: E402

# ---------------------------------------------------------------- measurement


class Case:
    """One system on one problem: `setup()` (untimed) then `step()` -> bytes of gradients kept."""

    def __init__(self, name: str, system: str, kernel: str, shapes: dict, setup: Callable[[], None],
                 step: Callable[[], int], ideal_bytes: int | None = None, flops: float | None = None):
        self.name, self.system, self.kernel, self.shapes = name, system, kernel, shapes
        self.setup, self.step, self.ideal_bytes, self.flops = setup, step, ideal_bytes, flops


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


QUEUE_FILL_CYCLES = 10_000_000  # ~5 ms of GPU sleep: the host queues a whole elementwise step meanwhile


def _time_once(case: Case, device: torch.device, fill_queue: bool = False) -> float:
    case.setup()
    if device.type != "cuda":
        t = time.perf_counter()
        case.step()
        return (time.perf_counter() - t) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    _sync(device)
    if fill_queue:  # the GPU sleeps while the host queues the step: launch gaps vanish from the timing
        torch.cuda._sleep(QUEUE_FILL_CYCLES)
    start.record()
    case.step()
    end.record()
    _sync(device)
    return start.elapsed_time(end)


def _memory(case: Case, device: torch.device) -> dict:
    if device.type != "cuda":
        return {"transient_mib": None, "peak_above_inputs_mib": None}
    case.setup()
    gc.collect()
    _sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    kept = case.step()
    _sync(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    return {"transient_mib": (peak - kept) / MIB, "peak_above_inputs_mib": peak / MIB}


def _allocated(case: Case, device: torch.device) -> int:
    case.setup()
    gc.collect()
    _sync(device)
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def measure(case: Case, device: torch.device, iters: int, warmup: int) -> dict:
    before = _allocated(case, device)
    t0 = time.perf_counter()
    for _ in range(warmup):
        _time_once(case, device)
    warmup_s = time.perf_counter() - t0
    persistent = _allocated(case, device) - before
    memory = _memory(case, device)
    times = sorted(_time_once(case, device) for _ in range(iters))
    median = statistics.median(times)
    out = {"median_ms": median, "p10_ms": times[len(times) // 10], "p90_ms": times[-1 - len(times) // 10],
           "iters": iters, "warmup_s": warmup_s, **memory,
           "persistent_mib": persistent / MIB if device.type == "cuda" else None}
    if case.ideal_bytes:
        device_ms = statistics.median(_time_once(case, device, fill_queue=device.type == "cuda")
                                      for _ in range(iters))
        out.update(device_ms=device_ms, ideal_bytes=case.ideal_bytes,
                   achieved_gbps=case.ideal_bytes / (device_ms * 1e-3) / 1e9,
                   launch_bound_gbps=case.ideal_bytes / (median * 1e-3) / 1e9)
    if case.flops:
        out["tflops_6thv"] = case.flops / (median * 1e-3) / 1e12
    return out


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _grad_bytes(*tensors: torch.Tensor) -> int:
    return sum(t.grad.numel() * t.grad.element_size() for t in tensors if t.grad is not None)


def _clear(*tensors: torch.Tensor) -> None:
    for t in tensors:
        t.grad = None


# ---------------------------------------------------------------- systems


def _compiled(fn: Callable, enabled: bool, why: str = "--no-compile or --smoke") -> Callable:
    if not enabled:
        raise RuntimeError(f"torch.compile baseline not run here ({why})")
    return torch.compile(fn, dynamic=False)


def _liger(name: str):
    import liger_kernel.transformers as lt
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    return {"flce": lambda: lt.LigerFusedLinearCrossEntropyLoss(),
            "rms": lambda n, eps: lt.LigerRMSNorm(n, eps=eps),
            "rope": lambda: lt.liger_rotary_pos_emb,
            "swiglu": lambda: LigerSiLUMulFunction.apply}[name]


def _cce():
    from cut_cross_entropy import linear_cross_entropy

    return linear_cross_entropy


def _eager_lce(x, w, y):
    """What HF does: bf16 logits, upcast to fp32, mean cross-entropy over non-ignored labels."""
    return F.cross_entropy(F.linear(x, w).float(), y, ignore_index=-100)


# our fused loss as run side by side: system name -> keyword arguments of ops.linear_cross_entropy
LCE_VARIANTS = {
    "lightning-slide": {},  # the default: tiles of 512 rows x half the vocabulary, grad_x beside grad_W
    "lightning-slide-serial": {"overlap": False},  # the same tiles on one stream
    "lightning-slide-rows": {"schedule": "rows"},  # chunks of whole rows: 6 T·H·V FLOPs, grad_W read per chunk
    "lightning-slide-vocab": {"schedule": "vocab"},  # vocabulary slices: grad_W written once, 4 GEMMs
    "lightning-slide-256mib": {"schedule": "rows", "chunk_mib": 256},  # what 4x the memory buys
}


def _ours_lce(options: dict) -> Callable:
    return lambda x, w, y: ops.linear_cross_entropy(x, w, y, **options)


def _liger_lce() -> Callable:
    """Liger's fused loss, built once; it takes the weight first."""
    loss = _liger("flce")()
    return lambda x, w, y: loss(w, x, y)


def lce_cases(tokens: int, vocab: int, hidden: int, device, dtype, compile_ok: bool) -> list[Case]:
    x = (0.5 * torch.randn(tokens, hidden, device=device)).to(dtype).requires_grad_()
    w = (0.02 * torch.randn(vocab, hidden, device=device)).to(dtype).requires_grad_()
    y = torch.randint(0, vocab, (tokens,), device=device)
    y[::9] = -100
    shapes = {"tokens": tokens, "hidden": hidden, "vocab": vocab}
    name = f"lce-v{vocab}-t{tokens}"

    def case(system: str, make: Callable[[], Callable]) -> Case:
        holder = {}

        def step() -> int:
            fn = holder.setdefault("fn", make())
            fn(x, w, y).backward()
            return _grad_bytes(x, w)
        return Case(f"{name}", system, "linear_cross_entropy", shapes, lambda: _clear(x, w), step,
                    flops=6.0 * tokens * hidden * vocab)

    return [case(system, lambda o=options: _ours_lce(o)) for system, options in LCE_VARIANTS.items()] + [
        case("torch-eager", lambda: _eager_lce),
        case("torch-compile", lambda: _compiled(_eager_lce, compile_ok and tokens == 16384 and vocab == 128256,
                                                "only at 16k tokens x vocab 128256, to bound compile time")),
        case("liger-kernel", _liger_lce),
        case("cut-cross-entropy", _cce),
    ]


def _restoring(sources: list[torch.Tensor]) -> tuple[list[torch.Tensor], Callable[[], None]]:
    """Leaf copies of `sources` and a setup that restores them (Liger writes some in place)."""
    leaves = [s.clone().requires_grad_() for s in sources]

    def setup() -> None:
        with torch.no_grad():
            for leaf, src in zip(leaves, sources):
                leaf.copy_(src)
        _clear(*leaves)
    return leaves, setup


def rms_cases(tokens: int, hidden: int, device, dtype, compile_ok: bool) -> list[Case]:
    src = [torch.randn(tokens, hidden, device=device, dtype=dtype),
           (1 + 0.1 * torch.randn(hidden, device=device)).to(dtype)]
    dy = torch.randn(tokens, hidden, device=device, dtype=dtype)
    shapes, elem = {"tokens": tokens, "hidden": hidden}, dy.element_size()
    ideal = 5 * tokens * hidden * elem  # fwd: read x, write y; bwd: read x, dy, write dx

    def case(system: str, make: Callable[[], Callable]) -> Case:
        (x, w), setup = _restoring(src)
        holder = {}

        def step() -> int:
            fn = holder.setdefault("fn", make())
            fn(x, w).backward(dy)
            return _grad_bytes(x, w)
        return Case(f"rmsnorm-t{tokens}-h{hidden}", system, "rms_norm", shapes, setup, step, ideal_bytes=ideal)

    def liger():
        module = _liger("rms")(hidden, 1e-6).to(device=device, dtype=dtype)

        def fn(x, w):
            module._parameters["weight"] = w  # our leaf, so its gradient is measured like the others'
            return module(x)
        return fn

    return [
        case("lightning-slide", lambda: ops.rms_norm),
        case("torch-eager", lambda: ops.rms_norm_reference),
        case("torch-compile", lambda: _compiled(ops.rms_norm_reference, compile_ok)),
        case("liger-kernel", liger),
    ]


def rope_cases(tokens: int, heads: int, kv_heads: int, head_dim: int, device, dtype, compile_ok) -> list[Case]:
    q = torch.randn(1, tokens, heads, head_dim, device=device, dtype=dtype).transpose(1, 2)
    k = torch.randn(1, tokens, kv_heads, head_dim, device=device, dtype=dtype).transpose(1, 2)
    inv = 1.0 / (500000 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    emb = torch.cat([torch.arange(tokens, device=device).float()[:, None] * inv] * 2, -1)[None]
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    shapes = {"tokens": tokens, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim}
    ideal = 4 * (q.numel() + k.numel()) * q.element_size()  # read + write q, k; forward and backward

    def case(system: str, make: Callable[[], Callable]) -> Case:
        qk = [q.clone().requires_grad_(), k.clone().requires_grad_()]  # clone keeps HF's strides
        holder = {}

        def setup() -> None:
            with torch.no_grad():
                qk[0].copy_(q)
                qk[1].copy_(k)
            _clear(*qk)

        def step() -> int:
            fn = holder.setdefault("fn", make())
            qo, ko = fn(qk[0], qk[1], cos, sin)
            torch.autograd.backward((qo, ko), (gq, gk))
            return _grad_bytes(*qk)
        return Case(f"rope-t{tokens}-h{heads}-kv{kv_heads}-d{head_dim}", system, "rope", shapes, setup, step,
                    ideal_bytes=ideal)

    return [
        case("lightning-slide", lambda: ops.apply_rotary_pos_emb),
        case("torch-eager", lambda: ops.rope_reference),
        case("torch-compile", lambda: _compiled(ops.rope_reference, compile_ok)),
        case("liger-kernel", lambda: _liger("rope")()),
    ]


def swiglu_cases(tokens: int, width: int, device, dtype, compile_ok: bool) -> list[Case]:
    src = [2 * torch.randn(tokens, width, device=device, dtype=dtype),
           torch.randn(tokens, width, device=device, dtype=dtype)]
    dout = torch.randn(tokens, width, device=device, dtype=dtype)
    shapes = {"tokens": tokens, "intermediate": width}
    ideal = 8 * tokens * width * dout.element_size()  # fwd: read 2, write 1; bwd: read 3, write 2

    def case(system: str, make: Callable[[], Callable]) -> Case:
        (gate, up), setup = _restoring(src)
        holder = {}

        def step() -> int:
            fn = holder.setdefault("fn", make())
            fn(gate, up).backward(dout)
            return _grad_bytes(gate, up)
        return Case(f"swiglu-t{tokens}-i{width}", system, "swiglu", shapes, setup, step, ideal_bytes=ideal)

    return [
        case("lightning-slide", lambda: ops.swiglu),
        case("torch-eager", lambda: ops.swiglu_reference),
        case("torch-compile", lambda: _compiled(ops.swiglu_reference, compile_ok)),
        case("liger-kernel", lambda: _liger("swiglu")()),
    ]


# ---------------------------------------------------------------- the run


def d2d_copy_case(device, nbytes: int) -> Case:
    """The bandwidth ceiling: one large device-to-device copy (read + write counted)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)

    def step() -> int:
        dst.copy_(src)
        return 0
    return Case(f"d2d-copy-{nbytes // MIB}mib", "torch-copy", "copy", {"bytes": nbytes}, lambda: None, step,
                ideal_bytes=2 * nbytes)


def _version(package: str) -> str | None:
    try:
        from importlib.metadata import version
        return version(package)
    except Exception:
        return None


def machine(device: torch.device) -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "triton": _version("triton"),
            "transformers": _version("transformers"), "liger_kernel": _version("liger-kernel"),
            "cut_cross_entropy": _version("cut-cross-entropy"), "cpu": platform.processor() or platform.machine()}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    return info


def _commit(given: str | None) -> str | None:
    if given:
        return given
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except Exception:
        return None


def all_cases(device, smoke: bool, compile_ok: bool) -> list[Case]:
    dt = torch.bfloat16
    if smoke:
        return ([d2d_copy_case(device, MIB)] + lce_cases(48, 96, 32, device, dt, False)
                + rms_cases(40, 48, device, dt, False) + rope_cases(8, 4, 2, 16, device, dt, False)
                + swiglu_cases(16, 96, device, dt, False))
    cases = [d2d_copy_case(device, 2048 * MIB)]
    for vocab in (128256, 151936):
        for tokens in (4096, 16384, 65536):
            cases += lce_cases(tokens, vocab, 4096, device, dt, compile_ok)
    cases += rms_cases(16384, 4096, device, dt, compile_ok)
    cases += rope_cases(16384, 32, 8, 128, device, dt, compile_ok)
    cases += swiglu_cases(16384, 4096, device, dt, compile_ok)
    cases += swiglu_cases(16384, 14336, device, dt, compile_ok)
    return cases


def _lazy_cases(device, smoke: bool, compile_ok: bool, only: frozenset[str] | None = None,
                tokens: tuple[int, ...] = (4096, 16384, 65536)):
    """Cases one problem at a time, so a problem's tensors are freed before the next one's.

    With `only`, just those kernels' cases (the others' problems are not even built).
    """
    if smoke:
        yield from (c for c in all_cases(device, smoke, compile_ok) if only is None or c.kernel in only)
        return
    dt = torch.bfloat16
    problems = [("copy", lambda: [d2d_copy_case(device, 2048 * MIB)])]
    problems += [("linear_cross_entropy", lambda t=count, v=vocab: lce_cases(t, v, 4096, device, dt, compile_ok))
                 for vocab in (128256, 151936) for count in tokens]
    problems += [("rms_norm", lambda: rms_cases(16384, 4096, device, dt, compile_ok)),
                 ("rope", lambda: rope_cases(16384, 32, 8, 128, device, dt, compile_ok)),
                 ("swiglu", lambda: swiglu_cases(16384, 4096, device, dt, compile_ok)),
                 ("swiglu", lambda: swiglu_cases(16384, 14336, device, dt, compile_ok))]
    for kernel, make in problems:
        if only is None or kernel in only:
            yield from make()
            _free(device)


def run_case(case: Case, device, iters: int) -> dict:
    result = {"case": case.name, "system": case.system, "kernel": case.kernel, "shapes": case.shapes,
              "dtype": "bf16", "ok": True, "error": None}
    try:
        result.update(measure(case, device, iters=iters, warmup=2 if device.type == "cuda" else 1))
    except Exception as e:  # OOM, missing package, unsupported: a result in its own right
        result.update(ok=False, error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500])
        if not isinstance(e, (ImportError, torch.cuda.OutOfMemoryError)):
            result["traceback"] = traceback.format_exc(limit=4)[-2000:]
    finally:
        case.setup = case.step = None
        _free(device)
    return result


def _warm_cublas(device: torch.device) -> None:
    """cuBLAS makes its workspace for a stream at first use: not a cost of the first case to matmul."""
    if device.type == "cuda":
        a = torch.ones(64, 64, device=device, dtype=torch.bfloat16)
        a @ a
        _sync(device)


def main() -> None:
    args = ARGS
    if args.plot:
        plot(args.plot)
        return
    device = torch.device("cpu" if args.smoke else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --smoke for the CPU check")
    args.out.mkdir(parents=True, exist_ok=True)
    common = {"command": "python " + " ".join(shlex.quote(a) for a in sys.argv), "commit": _commit(args.commit),
              "date": datetime.date.today().isoformat(), "machine": machine(device), "smoke": args.smoke}
    started = time.perf_counter()
    _warm_cublas(device)
    ceiling = None
    for case in _lazy_cases(device, args.smoke, not (args.no_compile or args.smoke), args.only, args.tokens):
        result = run_case(case, device, args.iters if not args.smoke else 2)
        if case.kernel == "copy" and result["ok"]:
            ceiling = result["achieved_gbps"]
        if ceiling and result.get("achieved_gbps") and case.kernel != "copy":
            result["pct_of_d2d_copy"] = 100 * result["achieved_gbps"] / ceiling
        result.update(common)
        slug = f"ops_{result['case']}_{result['system']}".replace("/", "-")
        (args.out / f"{slug}.json").write_text(json.dumps(result, indent=2) + "\n")
        print(_summary(result), flush=True)
    print(f"total {time.perf_counter() - started:.0f} s", flush=True)
    plot(args.out)


def _summary(r: dict) -> str:
    if not r["ok"]:
        return f"{r['case']:<34} {r['system']:<32} FAILED {r['error'][:90]}"
    mem = f"{r['transient_mib']:9.1f} MiB" if r.get("transient_mib") is not None else "        - MiB"
    if r.get("persistent_mib"):
        mem += f" (+{r['persistent_mib']:.1f} kept)"
    extra = f" device {r['device_ms']:.3f} ms {r['achieved_gbps']:5.0f} GB/s" if "device_ms" in r else ""
    extra += f" {r['tflops_6thv']:6.0f} TFLOP/s" if "tflops_6thv" in r else ""
    return f"{r['case']:<34} {r['system']:<32} {r['median_ms']:9.3f} ms {mem}{extra}"


# ---------------------------------------------------------------- plot


def _load(folder: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("ops_*.json"))]


def plot(folder: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib missing: redraw later with  python benchmarks/bench_ops.py --plot {folder}")
        return
    results = [r for r in _load(folder) if r["ok"]]
    fig, axes = plt.subplots(2, 2, figsize=(14, 10))
    _plot_lce(axes[0], results)
    _plot_elementwise(axes[1], results)
    fig.suptitle(_title(results))
    fig.tight_layout()
    fig.savefig(folder / "ops_bench.png", dpi=110)
    print("wrote", folder / "ops_bench.png")


def _title(results: list[dict]) -> str:
    m = results[0]["machine"] if results else {}
    return (f"ops fwd+bwd, bf16 - {m.get('gpu', 'CPU (interpreter smoke)')}, torch {m.get('torch')}, "
            f"triton {m.get('triton')}, {results[0]['date'] if results else ''}")


def _plot_lce(axes, results: list[dict]) -> None:
    lce = [r for r in results if r["kernel"] == "linear_cross_entropy"]
    vocab = max((r["shapes"]["vocab"] for r in lce), default=0)
    vocab = 128256 if any(r["shapes"]["vocab"] == 128256 for r in lce) else vocab
    for system in sorted({r["system"] for r in lce}):
        rows = sorted((r for r in lce if r["system"] == system and r["shapes"]["vocab"] == vocab),
                      key=lambda r: r["shapes"]["tokens"])
        tokens = [r["shapes"]["tokens"] for r in rows]
        axes[0].plot(tokens, [r["median_ms"] for r in rows], "o-", label=system)
        if rows and rows[0].get("transient_mib") is not None:
            axes[1].plot(tokens, [max(r["transient_mib"], 1e-2) for r in rows], "o-", label=system)
    hidden = next((r["shapes"]["hidden"] for r in lce), 0)
    axes[0].set(xscale="log", yscale="log", xlabel="tokens", ylabel="ms (fwd+bwd)",
                title=f"linear cross-entropy, hidden {hidden}, vocab {vocab}: time")
    axes[1].set(xscale="log", yscale="log", xlabel="tokens", ylabel="MiB above inputs + grads",
                title="linear cross-entropy: transient memory")
    axes[1].axhline(64, color="grey", ls="--", lw=1)
    for ax in axes:
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, which="both")


def _plot_elementwise(axes, results: list[dict]) -> None:
    kinds = [r for r in results if r["kernel"] in ("rms_norm", "rope", "swiglu")]
    cases = sorted({r["case"] for r in kinds})
    systems = sorted({r["system"] for r in kinds})
    width = 0.8 / max(len(systems), 1)
    for i, system in enumerate(systems):
        by_case = {r["case"]: r for r in kinds if r["system"] == system}
        xs = [c + i * width for c in range(len(cases))]
        axes[0].bar(xs, [by_case[c].get("device_ms", by_case[c]["median_ms"]) if c in by_case else 0 for c in cases],
                    width, label=system)
        axes[1].bar(xs, [by_case[c].get("achieved_gbps", 0) if c in by_case else 0 for c in cases], width,
                    label=system)
    ceiling = [r["achieved_gbps"] for r in results if r["kernel"] == "copy"]
    if ceiling:
        axes[1].axhline(ceiling[0], color="grey", ls="--", lw=1, label=f"d2d copy {ceiling[0]:.0f} GB/s")
    for ax, label in ((axes[0], "ms (fwd+bwd, GPU queue filled)"), (axes[1], "GB/s (ideal bytes / time)")):
        ax.set_xticks([c + 0.4 - width / 2 for c in range(len(cases))], cases, rotation=15, fontsize=8)
        ax.set(ylabel=label, title=f"elementwise kernels: {label.split(' ')[0]}")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, axis="y")


if __name__ == "__main__":
    main()
