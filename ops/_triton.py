"""Where a kernel runs: compiled on the GPU, in Triton's CPU interpreter, or not at all.

Triton fixes its mode when it is imported: with `TRITON_INTERPRET=1` in the environment its own
library functions (`tl.sum`, `tl.sigmoid`, ...) become interpreter functions, and compiled kernels
can no longer use them (nor can interpreted kernels use compiled ones). So the variable must be
set before anything imports triton (tests do it in tests/ops/conftest.py). Our kernels follow the
mode triton is in, whatever the import order, and `use_triton` sends CPU tensors to a kernel only
when triton interprets *and* the variable still asks for it (so a test can switch the CPU path to
the pure-PyTorch references by setting it to 0).
"""
from __future__ import annotations

import os
import threading
from functools import partial

import torch
import triton.language.standard as _tl_standard
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

_TRUE = {"1", "true", "yes", "on", "y"}


def triton_interprets() -> bool:
    """True when triton was imported in interpreter mode (its library is interpreted)."""
    return isinstance(_tl_standard.sigmoid, InterpretedFunction)


def interpreting() -> bool:
    """Run kernels on CPU tensors: triton interprets and TRITON_INTERPRET (read now) agrees."""
    flag = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _TRUE
    return flag and triton_interprets()


def use_triton(t: torch.Tensor) -> bool:
    """Triton runs for CUDA tensors, and for CPU tensors only under the interpreter.

    Everything else takes the pure-PyTorch path of each op, so a patched model still trains
    (slowly, but correctly) on a CPU without the interpreter.
    """
    if t.is_cuda:
        return not triton_interprets()
    return t.device.type == "cpu" and interpreting()


class Kernel:
    """A Triton kernel built, at first launch, for the mode triton is in: `Kernel(fn)[grid](...)`.

    `triton.jit` would pick the mode from the environment when our module is imported, which
    need not be the mode triton itself was imported in. Interpreted launches run one at a time: the
    interpreter keeps a launch's grid in process-wide state, which a launch from another thread (a
    background optimizer thread beside the training thread) would overwrite.
    """

    def __init__(self, fn):
        self.fn = fn
        self._built = None

    def __getitem__(self, grid):
        if self._built is None:
            self._built = InterpretedFunction(self.fn) if triton_interprets() else JITFunction(self.fn)
        launch = self._built[grid]
        return partial(_interpreted, launch) if isinstance(self._built, InterpretedFunction) else launch


_INTERPRETER = threading.Lock()


def _interpreted(launch, *args, **kwargs):
    with _INTERPRETER:
        return launch(*args, **kwargs)


def device_function(fn):
    """A helper that kernels call, built for the mode triton is in (imported before us, so known)."""
    return InterpretedFunction(fn) if triton_interprets() else JITFunction(fn)


def launch_options(num_warps: int) -> dict:
    """Launch keywords; the interpreter has no warps, so it gets none."""
    return {} if triton_interprets() else {"num_warps": num_warps}


def next_pow2(n: int) -> int:
    """`triton.next_power_of_2` in plain Python (that one costs ~8 us a call: it is a constexpr function)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors on a CUDA device (a small constant for the interpreter)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4
