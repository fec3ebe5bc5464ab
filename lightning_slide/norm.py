"""The global gradient norm of one clipped step, gathered where the step's gradients are.

A unit's final gradient is either a sum the optimizer thread completes on the host (accumulation windows) or
one gradient the copy thread still has on the GPU (measured there: one reduction kernel instead of a pass over
host memory). So the squared norm has a host part, added to under a lock by the optimizer thread (and by the
training thread when it measures held sums itself), and a device part, added to by the copy thread only. Once
every gradient of the step has arrived, the two are joined and give the coefficient AdamW scales by.

A non-finite norm clips as torch's `clip_grad_norm_` (error_if_nonfinite=False, Lightning's setting) does: an
infinite one scales every gradient by 0 (an infinite element becomes NaN), a NaN one makes every gradient NaN.
Each unit's own square is kept, so such a step can say which units' gradients were not finite.
"""

from __future__ import annotations

import math
import threading

import torch

from lightning_slide.streams import Lane, host_wait

EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s: max_norm / (norm + 1e-6)


class GlobalNorm:
    """The squared global norm of one step's gradients, and the clipping it implies for `max_norm`."""

    def __init__(self, max_norm: float) -> None:
        self.max_norm = max_norm
        self.host = 0.0  # squared norm of gradients measured on the host
        self.device: torch.Tensor | None = None  # squared norm measured on the gradients' device (copy thread)
        self.grad_scale: torch.Tensor | None = None  # 1 / coefficient once known, where it clips (< 1)
        self.units: dict[int, float | torch.Tensor] = {}  # unit -> its squared norm (host float or device scalar)
        self._lock = threading.Lock()

    def add(self, grad: torch.Tensor, unit: int) -> None:
        """Add a host gradient's squared norm, or a chunk's of it (any thread)."""
        value = float(torch.linalg.vector_norm(grad, dtype=torch.float32)) ** 2
        with self._lock:
            self.host += value
            self.units[unit] = self.units.get(unit, 0.0) + value

    def add_on_device(self, grad: torch.Tensor, unit: int) -> None:
        """Add a gradient's squared norm, left on its device (the copy thread only, on its lane)."""
        sq = torch.linalg.vector_norm(grad, dtype=torch.float32).square()
        self.units[unit] = sq
        self.device = sq.clone() if self.device is None else self.device.add_(sq)

    def gather_device(self, lane: Lane) -> None:
        """Join the device part into the host part; call once the copy thread is idle."""
        if self.device is None:
            return
        with lane():
            value = self.device.to("cpu", non_blocking=True)
            event = lane.record()
        host_wait(event)
        self.host += float(value)
        self.device = None

    def coefficient(self) -> float:
        """What clip_grad_norm_ multiplies the gradients by (clipping only where it is below 1)."""
        return self.max_norm / (math.sqrt(self.host) + EPS)

    def finish(self, lane: Lane, unmeasured: dict[int, torch.Tensor]) -> None:
        """Every gradient of the step has arrived: join the device part, measure the `unmeasured` units' sums
        (`gradients.Bookkeeping.end_step`) and settle the scale."""
        self.gather_device(lane)
        for unit, grad in unmeasured.items():
            self.add(grad, unit)
        self.settle()

    def settle(self) -> None:
        """Every gradient is measured: fix the scale AdamW divides the gradients by (none where it does not clip;
        infinite where the coefficient is 0, NaN where it is NaN)."""
        coef = self.coefficient()
        if not coef >= 1.0:
            self.grad_scale = torch.tensor(1.0 / coef if coef != 0.0 else math.inf)

    @property
    def finite(self) -> bool:
        return math.isfinite(self.host)

    def nonfinite_units(self) -> list[int]:
        """The units whose gradients' squared norm is not finite (after `finish`; reads device values)."""
        return sorted(u for u, sq in self.units.items() if not math.isfinite(float(sq)))
