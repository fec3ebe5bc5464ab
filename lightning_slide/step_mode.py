"""How an optimizer step meets its gradients: decided once per fit, read by the planner and the engine.

Three ways, from the Trainer's settings:
- *eager*: each unit is updated as its gradient arrives from the backward (no gradient is held on the host);
- *accumulating*: several backwards are summed before an update, in fp32 sums on the host;
- *deferred*: every update waits for the step's global gradient norm (clipping) or for the step itself
  (manual optimization, whose backwards come before the step is known); the updates then run in forward order.

A deferred step that is not accumulating holds each unit's one gradient exactly as it came from the device
(the compute dtype, 2 bytes per parameter under bf16), since no sum is formed; fp32 sums (4 bytes) are kept
only where gradients are added together.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepMode:
    """accumulates: some optimizer step of the fit sums several backwards; clip_norm: the global-norm clipping
    threshold (None: no clipping); manual: manual optimization (the step is known only when it is called, and it
    may follow several backwards)."""

    accumulates: bool = False
    clip_norm: float | None = None
    manual: bool = False

    @property
    def deferred(self) -> bool:
        """Updates wait for the end of the step (the norm, or the manual step call)."""
        return self.clip_norm is not None or self.manual

    @property
    def holds_grads(self) -> bool:
        """Gradients wait on the host until the step's updates run."""
        return self.accumulates or self.deferred

    @property
    def sums(self) -> bool:
        """Gradients may be added together on the host (so they are held in fp32)."""
        return self.accumulates or self.manual

    def held_dtype(self, compute: torch.dtype) -> torch.dtype | None:
        """The dtype gradients are held in on the host, or None where they are not held."""
        if not self.holds_grads:
            return None
        return torch.float32 if self.sums else compute

    def describe(self) -> str:
        if self.sums and self.deferred:
            return "deferred, accumulating (fp32 gradient sums)"
        if self.sums:
            return "accumulating (fp32 gradient sums)"
        if self.deferred:
            return "deferred (each unit's gradient held as it came)"
        return "eager (each unit updated as its gradient arrives)"
