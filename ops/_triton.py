"""Where a kernel runs: compiled on the GPU, in Triton's CPU interpreter, or not at all.

`triton.jit` decides between compiler and interpreter when a kernel is *defined*, from the
`TRITON_INTERPRET` variable. Tests set that variable in a conftest that may run after some other
module imported `ops`, so our kernels decide when they are *launched* instead (`Kernel`).
"""
from __future__ import annotations

import os

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

_TRUE = {"1", "true", "yes", "on", "y"}


def interpreting() -> bool:
    """True when TRITON_INTERPRET asks for the CPU interpreter (read now, not at import)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _TRUE


def use_triton(t: torch.Tensor) -> bool:
    """Triton runs for CUDA tensors, and for CPU tensors only under the interpreter.

    Everything else takes the pure-PyTorch path of each op, so a patched model still trains
    (slowly, but correctly) on a CPU without the interpreter.
    """
    return t.is_cuda or (t.device.type == "cpu" and interpreting())


class Kernel:
    """A Triton kernel that picks compiler or interpreter at launch: `Kernel(fn)[grid](...)`."""

    def __init__(self, fn):
        self.fn = fn
        self._built: dict[bool, object] = {}

    def __getitem__(self, grid):
        mode = interpreting()
        built = self._built.get(mode)
        if built is None:
            built = InterpretedFunction(self.fn) if mode else JITFunction(self.fn)
            self._built[mode] = built
        return built[grid]


def launch_options(num_warps: int) -> dict:
    """Launch keywords; the interpreter has no warps, so it gets none."""
    return {} if interpreting() else {"num_warps": num_warps}


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(n)


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors on a CUDA device (a small constant for the interpreter)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4
