"""The precision plugin of the slideformer strategy: weights are computed in bf16 (or fp32) from fp32 masters.

Lightning's own plugins would cast the module (destroying the fp32 master) or step the optimizer
themselves; this one leaves both to the engine and only frames each optimizer step for it.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, TypeVar

import torch
from lightning.fabric.utilities.types import Steppable
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning_utilities import apply_to_collection
from torch import nn

import lightning_slide.engine as engine_module
from lightning_slide.planner import SMALLER_TOKENS

SUPPORTED = ("32-true", "bf16-mixed", "bf16-true")
P = TypeVar("P")
OUT_OF_MEMORY = (
    "slideformer: the GPU ran out of memory in a step whose plan fit at setup. To fit, change: recompute='always' "
    "(kept graphs fill the VRAM the first step left spare), a fixed slots=N (slots='auto' grows into it too), "
    f"activations='cpu', mlp_tile_tokens=8192 (MLPs over sequence tiles), or {SMALLER_TOKENS}; "
    "if much of the memory above is reserved but unallocated (fragmentation), start the process with "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True."
)


class SlidePrecision(Precision):
    def __init__(self, precision: str = "32-true") -> None:
        if precision not in SUPPORTED:
            raise ValueError(_unsupported(precision))
        self.precision = precision  # type: ignore[assignment]
        self.engine: engine_module.SlideEngine | None = None
        self.device_type = "cpu"
        self.automatic = True  # the module's automatic_optimization (the strategy sets it at setup)

    @classmethod
    def adopt(cls, plugin: Precision) -> SlidePrecision:
        """Turn the plugin Lightning built from `Trainer(precision=...)` into ours, or say why not."""
        return adopted(cls, plugin, (Precision, MixedPrecision, HalfPrecision))

    @property
    def compute_dtype(self) -> torch.dtype:
        return torch.float32 if self.precision == "32-true" else torch.bfloat16

    def forward_context(self) -> AbstractContextManager:
        if self.precision == "bf16-mixed":
            return torch.autocast(self.device_type, dtype=torch.bfloat16)
        return nullcontext()

    def convert_input(self, data: Any) -> Any:
        if self.precision != "bf16-true":
            return data
        return apply_to_collection(data, torch.Tensor, lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t)

    def optimizer_step(  # type: ignore[override]
        self, optimizer: Steppable, model: nn.Module, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        """The backward inside `closure` ends an accumulation window: the engine updates as gradients arrive.

        Under automatic optimization a closure that returns None ran no backward (training_step returned None).
        """
        engine = self.engine
        engine.begin_step()
        try:
            result = closure()
        except torch.OutOfMemoryError as error:
            raise torch.OutOfMemoryError(f"{error}\n{OUT_OF_MEMORY}") from error
        self._after_closure(model, optimizer)
        engine.end_step(backward_ran=result is not None or not self.automatic)
        optimizer._opt_called = True  # what optimizer.step() tells LR schedulers (torch.optim.lr_scheduler)
        return result

    def clip_gradients(
        self,
        optimizer: Any,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """Automatic optimization: the engine clips by the global norm it was given at setup, so this call (from
        Lightning's loop) has nothing left to do. Manual optimization: the call comes between the backward and
        `opt.step()`, and clips that step by the global norm."""
        if not clip_val or self.engine is None or self.automatic:
            return
        if GradClipAlgorithmType(gradient_clip_algorithm) != GradClipAlgorithmType.NORM:
            raise ValueError("slideformer clips by the global gradient norm only: use gradient_clip_algorithm='norm'.")
        self.engine.clip_next(float(clip_val))


def adopted(cls: type[P], plugin: object, plain: tuple[type, ...]) -> P:
    """`plugin` as a `cls`: itself, or a new one of its precision where Lightning built one of the `plain` plugins
    from a precision flag; any other plugin is refused."""
    if isinstance(plugin, cls):
        return plugin
    if type(plugin) in plain:
        return cls(str(plugin.precision))
    raise ValueError(f"The slideformer strategy cannot use the {type(plugin).__name__} plugin. {_unsupported('')}")


def _unsupported(precision: str) -> str:
    hint = (
        "fp16 needs loss scaling with skipped steps, which per-unit eager updates cannot undo; "
        if precision.startswith("16")
        else ""
    )
    return (f"Unsupported precision {precision!r} for slideformer: {hint}use one of {list(SUPPORTED)} "
            "(bf16-mixed on GPUs).")
