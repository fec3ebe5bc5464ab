"""Step timing with no synchronisation on the measured path (worker side: imports torch).

`tick(loss)` is called at the end of every step. It only reads the host clock, keeps the step's loss
tensor and, on CUDA, records an event on the current stream: none of that waits for the GPU. The device is
synchronised exactly twice, when the warm-up ends and when the last timed step ends, so the window's wall time
is exact and tokens/s = timed steps x tokens per step / window. Per-step times come from the events (the GPU
timeline, which also shows any gap where the GPU waited for the host); on the CPU from the host clock.
The losses are read once, in `summary()`: a run whose loss went NaN or infinite timed arithmetic on NaN (GEMMs on
constant bit patterns draw less power and run at higher clocks: on an H200, an 8B step at 64x1024 tokens took
5.8 s once its loss was NaN against 7.0 s with finite weights), so `summary()` says where it happened.
After the window, `profile_steps` more steps run under the CUDA profiler to measure how long the compute
stream sat idle (benchmarks.gpu_idle); they are not timed, and on the CPU they are not run.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from benchmarks.gpu_idle import IdleProbe


class WindowClock:
    """Counts steps; times the `steps` that follow `warmup` untimed ones, then profiles `profile_steps`."""

    def __init__(self, warmup: int, steps: int, device: torch.device, profile_steps: int = 0) -> None:
        self.warmup, self.steps, self.device = warmup, steps, device
        self.profile_steps = profile_steps if device.type == "cuda" else 0
        self.gpu_idle: dict | None = None
        self._probe: IdleProbe | None = None
        self.ticks = 0
        self.host: list[float] = []
        self.events: list[torch.cuda.Event] = []
        self.losses: list[torch.Tensor] = []
        self.first_step_at = 0.0
        self.on_window_start: Callable[[], None] | None = None
        self.on_window_end: Callable[[], None] | None = None

    @property
    def done(self) -> bool:
        """The timed window is complete (profiled steps may follow)."""
        return self.ticks >= self.warmup + self.steps

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps + self.profile_steps

    def tick(self, loss: torch.Tensor | None = None) -> None:
        """End of one step: mark it and keep its loss; at the window's two ends, synchronise once and call the
        hooks."""
        self.ticks += 1
        if loss is not None:
            self.losses.append(loss.detach().reshape(()))
        if self.ticks == 1:
            self.first_step_at = time.perf_counter()
        if self.ticks > self.warmup + self.steps:
            self._profile_tick()
            return
        if self.ticks < self.warmup:
            return
        at_end = self.ticks == self.warmup + self.steps
        if self.ticks == self.warmup or at_end:
            self._sync()
        self.host.append(time.perf_counter())
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.events.append(event)
        hook = self.on_window_start if self.ticks == self.warmup else self.on_window_end if at_end else None
        if hook is not None:
            hook()
        if at_end and self.profile_steps:
            self._probe = IdleProbe(self.device)
            self._probe.start()

    def _profile_tick(self) -> None:
        if self._probe is None:
            return
        self._probe.mark()
        if self.ticks == self.total_steps:
            self.gpu_idle = self._probe.finish()
            self._probe = None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def summary(self, tokens_per_step: int) -> dict:
        """tokens/s over the window and step-time percentiles (needs the window to be complete)."""
        if not self.done:
            raise RuntimeError(f"timing window incomplete: {self.ticks} of {self.warmup + self.steps} steps ran")
        window = self.host[-1] - self.host[0]
        host_steps = [b - a for a, b in zip(self.host, self.host[1:])]
        steps = ([a.elapsed_time(b) / 1e3 for a, b in zip(self.events, self.events[1:])]
                 if self.events else host_steps)
        deciles = statistics.quantiles(steps, n=10, method="inclusive")
        return {
            "tokens_per_s": self.steps * tokens_per_step / window,
            "step_s_mean": window / self.steps,
            "step_s_median": statistics.median(steps),
            "step_s_p10": deciles[0],
            "step_s_p90": deciles[-1],
            "timed_steps": self.steps,
            "warmup_steps": self.warmup,
            "step_times_s": steps,
            "host_step_times_s": host_steps,
            "step_time_source": "cuda events" if self.events else "host clock",
            "gpu_idle": self.gpu_idle,
            **self.loss_summary(),
        }

    def loss_summary(self) -> dict:
        """Every step's loss (warm-up, timed and profiled steps, in order) and the first that was not finite."""
        if not self.losses:
            return {}
        losses = torch.stack(self.losses).float().cpu()
        bad = (~torch.isfinite(losses)).nonzero()
        return {"loss_steps": losses.tolist(), "loss_last": losses[-1].item(),
                "first_nonfinite_step": int(bad[0]) + 1 if len(bad) else None}
