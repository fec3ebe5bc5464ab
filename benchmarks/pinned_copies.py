"""Copy rates over PCIe by how the host buffer was page-locked: the caching host allocator (`pin_memory=True`,
cudaHostAlloc), locked in place (`lightning_slide.pinned`: cudaHostRegister over malloc'd pages), and locked in
place over transparent huge pages (madvise(MADV_HUGEPAGE) before the pages are touched); and how fast each
locks (`lock_gbs`: for `pin_memory=True` the allocation itself, for the others cudaHostRegister of touched pages).

Why: the runtime locks its host state, gradient landing buffers and staging in place, while the probe and most
peers copy through `pin_memory=True`. Where the device reaches host memory through an IOMMU (a virtual machine),
each 4 KiB page is one translation, so the same bytes on 2 MiB pages may move faster.

    python -m benchmarks.pinned_copies --out DIR      # DIR/pinned_copies.jsonl, one line per way of locking
"""

from __future__ import annotations

import argparse
import ctypes
import json
import time
from pathlib import Path

import torch

from benchmarks.loops import copy_rates
from lightning_slide.pinned import PAGE, host_empty, pin_, unpin_

GIB = 2**30
HUGE = 2 * 2**20
MADV_HUGEPAGE = 14
REPS = 8


def _aligned(nbytes: int, huge: bool) -> torch.Tensor:
    """`nbytes` of uninitialised host memory starting on a 2 MiB boundary, advised onto huge pages if `huge` (the
    kernel backs them at first touch, which the fill below is)."""
    buf = host_empty(nbytes, torch.uint8, align=HUGE)  # as the runtime allocates what it locks in place
    if huge:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.madvise(ctypes.c_void_p(buf.data_ptr()), ctypes.c_size_t(nbytes), MADV_HUGEPAGE) != 0:
            raise OSError(ctypes.get_errno(), "madvise(MADV_HUGEPAGE) refused")
    buf.fill_(1)
    return buf


def _anon_huge_kib() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:"))


def _thp(name: str) -> str:
    try:
        return Path(f"/sys/kernel/mm/transparent_hugepage/{name}").read_text().strip()
    except OSError:
        return "unknown"


def measure(nbytes: int) -> list[dict]:
    devs = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(2)]
    records = []
    for way in ("pin_memory", "registered", "registered-huge"):
        before = _anon_huge_kib()
        if way == "pin_memory":
            start = time.perf_counter()
            hosts = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        else:
            hosts = [_aligned(nbytes, huge=way == "registered-huge") for _ in range(2)]
            start = time.perf_counter()
            if not all(pin_(h) for h in hosts):
                raise RuntimeError("cudaHostRegister refused a buffer: raise the locked-memory limit (ulimit -l)")
        lock_gbs = 2 * nbytes / (time.perf_counter() - start) / 1e9
        huge = (_anon_huge_kib() - before) * 1024 / (2 * nbytes)
        records.append({"way": way, "bytes": nbytes, "huge_page_share": round(huge, 3), "lock_gbs": lock_gbs,
                        **copy_rates(hosts, devs, REPS)})
        if way != "pin_memory":
            for h in hosts:
                unpin_(h)
        del hosts
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--gib", type=float, default=1.0, help="bytes per buffer, GiB")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.pinned_copies measures copies to and from a CUDA device: none is available")
    nbytes = int(args.gib * GIB) // PAGE * PAGE
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "thp_enabled": _thp("enabled"),
            "thp_defrag": _thp("defrag")}
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "pinned_copies.jsonl", "w") as f:
        for record in measure(nbytes):
            line = json.dumps({**meta, **record})
            print(line)
            f.write(line + "\n")


if __name__ == "__main__":
    main()
