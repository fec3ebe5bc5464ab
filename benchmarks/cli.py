"""Run `train.py` exactly as a user does, optionally under a GPU memory cap, and record the process's peaks.

    python -m benchmarks.cli --cap-gib 24 --peaks peaks.json -- model=llama3_8b data.batch_size=8

The cap (`torch.cuda.set_per_process_memory_fraction`) stands for a smaller card; everything after `--` is
train.py's own command line. At exit the process writes its peak RSS and peak VRAM to `--peaks`.
"""

from __future__ import annotations

import argparse
import atexit
import json
import resource
import runpy
import sys
from pathlib import Path

import torch

TRAIN = Path(__file__).resolve().parent.parent / "train.py"
GIB = float(1 << 30)


def _write_peaks(path: str) -> None:
    peaks = {"peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        peaks["peak_vram_alloc_gib"] = torch.cuda.max_memory_allocated() / GIB
        peaks["peak_vram_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
    Path(path).write_text(json.dumps(peaks))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cap-gib", type=float, default=None, help="GPU memory this process may use")
    parser.add_argument("--peaks", default=None, help="JSON file for the peak RSS / VRAM at exit")
    args = parser.parse_args(argv[:split])
    if args.cap_gib and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * GIB / total))
    if args.peaks:
        atexit.register(_write_peaks, args.peaks)
    sys.argv = [str(TRAIN), *argv[split + 1 :]]
    runpy.run_path(str(TRAIN), run_name="__main__")


if __name__ == "__main__":
    main()
