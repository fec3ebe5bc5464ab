"""`SlideFabricStrategy`: the sliding engine under Lightning Fabric (`Fabric(strategy="slideformer")`).

Fabric loops look like plain PyTorch: `fabric.backward(loss)` comes before the loop decides whether this is
the step's last micro-batch, so the engine runs as under the Trainer's manual optimization
(`StepMode(accumulates=True, manual=True)`): every backward adds its gradients into fp32 sums on the host, and
`optimizer.step()` clips (if `fabric.clip_gradients` asked for it; that call returns the global norm) and updates
every unit on the CPU.
Gradient accumulation therefore needs nothing but several backwards before a step
(`fabric.no_backward_sync` is a no-op on one device, as for Fabric's own single-device strategy).

The module's parameters become views of the engine's flat fp32 host storage. Hooks on the module keep the
usual PyTorch calls right while updates run on the optimizer thread: `state_dict()` waits for the queued
updates, `load_state_dict()` waits before it writes and reloads the GPU window after; the optimizer's
`load_state_dict()` (also under `fabric.load`) puts the loaded state into the engine's flat Adam state.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager, nullcontext
from types import SimpleNamespace
from typing import Any

import torch
from lightning.fabric.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.fabric.strategies import STRATEGY_REGISTRY, SingleDeviceStrategy
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_slide.checkpoint_io import AtomicCheckpointIO
from lightning_slide.config import SlideConfig
from lightning_slide.engine import SlideEngine
from lightning_slide.materialize import meta_parameters
from lightning_slide.planner import Plan
from lightning_slide.precision import SUPPORTED, SlidePrecision, _unsupported, adopted
from lightning_slide.step_mode import StepMode
from lightning_slide.strategy import SlideStrategy, _token_shape, refuse_compiled

#: Fabric decides nothing ahead of the loop: every backward adds to fp32 host sums, updates wait for the step.
FABRIC_MODE = StepMode(accumulates=True, clip_norm=None, manual=True)
#: What the Trainer strategy's planning reads of a Trainer: its callbacks (those that export add host memory).
_NO_CALLBACKS = SimpleNamespace(callbacks=())


class SlideFabricPrecision(Precision):
    """Fabric's precision for slideformer: the module keeps its fp32 masters (no cast, no fp32 init change);
    the forward runs as under the Trainer's `SlidePrecision` (autocast for bf16-mixed, bf16 inputs for bf16-true),
    and the engine computes in `compute_dtype`."""

    forward_context = SlidePrecision.forward_context
    convert_input = SlidePrecision.convert_input
    compute_dtype = SlidePrecision.compute_dtype

    def __init__(self, precision: str = "32-true") -> None:
        if precision not in SUPPORTED:
            raise ValueError(_unsupported(precision))
        self.precision = precision  # type: ignore[assignment]
        self.device_type = "cpu"  # the strategy sets the compute device's type at setup

    @classmethod
    def adopt(cls, plugin: Precision) -> SlideFabricPrecision:
        """Turn the plugin Fabric built from `Fabric(precision=...)` into ours, or say why not."""
        return adopted(cls, plugin, (Precision, MixedPrecision, HalfPrecision))


class SlideFabricStrategy(SingleDeviceStrategy):
    """Full-parameter training of a causal LM larger than the GPU under Fabric: layers slide through a GPU window.

    Settings are those of :class:`lightning_slide.config.SlideConfig`, as a ``SlideConfig``, as keywords, or both
    (keywords win), as for the Trainer's ``SlideStrategy``::

        Fabric(strategy="slideformer", precision="bf16-mixed")
        Fabric(strategy=SlideFabricStrategy(SlideConfig(recompute="always"), offload="nvme", nvme_path="/mnt/nvme"))

    Set up the model and exactly one torch Adam/AdamW together
    (``fabric.setup(model, optimizer)``); a model set up alone is evaluated only.
    """

    strategy_name = "slideformer"

    def __init__(
        self,
        config: SlideConfig | None = None,
        *,
        device: str | torch.device | None = None,
        accelerator: Any = None,
        checkpoint_io: Any = None,
        precision: Precision | None = None,
        **settings: Any,
    ) -> None:
        """
        Args:
            config: the runtime's settings; None: SlideConfig's defaults.
            device: the compute device; None: Fabric's ``accelerator`` and ``devices`` decide.
            accelerator, precision: as for Fabric's ``SingleDeviceStrategy``.
            checkpoint_io: how `fabric.save` writes; default: atomically (a temporary file, then renamed).
            **settings: SlideConfig fields that replace those of ``config`` (``offload="nvme"``, ``slots=4``).
        """
        self.config = SlideConfig.for_strategy(config, **settings)
        if self.config.offload == "none":
            raise ValueError("offload='none' is plain single-device training: use Fabric's own strategy "
                             "(Fabric(strategy='auto')) instead of slideformer.")
        super().__init__(device or "cpu", accelerator, checkpoint_io or AtomicCheckpointIO(), precision)
        self.parallel_devices: list[torch.device] | None = None if device is None else [torch.device(device)]
        self.engine: SlideEngine | None = None
        self.plan: Plan | None = None
        self._planned: tuple | None = None  # (model shape, setup): what micro-batches are checked against
        self._checked_tokens = 0  # the largest micro-batch checked so far
        self._process_bytes = 0  # host memory the process held besides the model's weights at setup
        self.mode = FABRIC_MODE  # what the planning and the engine read
        self._hooks: list[RemovableHandle] = []
        self._loading_optimizer = False  # the engine's own load_state_dict call is under way

    # The Trainer strategy's own definitions, which read only what this class sets up the same way: the names
    # "slideformer" and "slideformer_nvme", the device Fabric's connector hands over, the micro-batch check and
    # the engine's notes for the log.
    register_strategies = classmethod(SlideStrategy.register_strategies.__func__)
    root_device = SlideStrategy.root_device
    _check_batch = SlideStrategy._check_batch
    _log_engine_notes = SlideStrategy._log_engine_notes

    @property
    def precision(self) -> SlideFabricPrecision:
        if self._precision is None:
            self._precision = SlideFabricPrecision()
        return self._precision

    @precision.setter
    def precision(self, plugin: Precision | None) -> None:
        self._precision = None if plugin is None else SlideFabricPrecision.adopt(plugin)

    # ------------------------------------------------------------------------------------------ setup
    def module_init_context(self, empty_init: bool | None = None) -> Any:
        """Build models on the CPU in fp32: they become the host master weights.

        With `fabric.init_module(empty_init=True)` parameters are meta-device placeholders instead: the engine
        fills them unit by unit, straight into its flat storage, from the local checkpoint folder in
        `model.config.name_or_path` or with the model's initialiser (the model never exists twice in RAM).
        """
        return self._host_init(bool(empty_init))

    @contextmanager
    def _host_init(self, empty_init: bool) -> Generator[None, None, None]:
        with meta_parameters() if empty_init else nullcontext(), torch.device("cpu"):
            yield

    def module_to_device(self, module: nn.Module) -> None:
        """Weights stay on the host; the engine moves buffers and streams units to the device."""

    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any = None
    ) -> tuple[nn.Module, list[Optimizer], Any]:
        if len(optimizers) != 1:
            raise ValueError(
                f"The slideformer strategy trains with exactly one optimizer; fabric.setup got {len(optimizers)}. "
                "Put all parameters in one torch.optim.AdamW (param groups are fine).")
        self._start_engine(module, optimizers[0])
        return module, optimizers, scheduler

    def setup_module(self, module: nn.Module) -> nn.Module:
        """A model set up without an optimizer is evaluated only (forward passes through the window)."""
        self._start_engine(module, None)
        return module

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        raise NotImplementedError(
            "The slideformer engine lays out the optimizer state together with the model: set them up together "
            "with `model, optimizer = fabric.setup(model, optimizer)`.")

    def _start_engine(self, module: nn.Module, optimizer: Optimizer | None) -> None:
        if self.parallel_devices and len(self.parallel_devices) > 1:
            raise ValueError(f"The slideformer strategy trains on one device, but Fabric was given "
                             f"{len(self.parallel_devices)}: pass Fabric(devices=1).")
        if self.engine is not None:
            raise RuntimeError("The slideformer strategy trains one model: it was already set up in this Fabric.")
        refuse_compiled(module)
        self.precision.device_type = self.root_device.type
        rank_zero_info(f"slideformer steps: {self.mode.describe()}")
        config = self._plan_memory(module, optimizer)
        self.engine = SlideEngine(module, optimizer, config, self.root_device, self.precision.compute_dtype, self.mode)
        self._hooks = [
            module.register_forward_pre_hook(self._before_forward, with_kwargs=True),
            module.register_state_dict_pre_hook(lambda *_: self.engine.synchronize()),
            module.register_load_state_dict_pre_hook(lambda *_: self.engine.synchronize()),
            module.register_load_state_dict_post_hook(lambda *_: self.engine.master_changed()),
        ]
        if optimizer is not None:
            self._hooks += [
                optimizer.register_state_dict_pre_hook(lambda _: self.engine.synchronize()),
                optimizer.register_load_state_dict_pre_hook(lambda *_: self.engine.synchronize()),
                optimizer.register_load_state_dict_post_hook(self._optimizer_loaded),
            ]

    def _optimizer_loaded(self, optimizer: Optimizer) -> None:
        """torch's `load_state_dict` gave the optimizer new state tensors: copy them into the engine's flat Adam
        state, which the updates read (the engine loads through `load_state_dict` itself: not twice)."""
        if self._loading_optimizer:
            return
        self._loading_optimizer = True
        try:
            self.engine.load_optimizer_state(optimizer.state_dict())
        finally:
            self._loading_optimizer = False

    def _plan_memory(self, module: nn.Module, optimizer: Optimizer | None) -> SlideConfig:
        """Log what will live where and refuse (PlanError) a run whose weights and state cannot fit: the Trainer
        strategy's planning, for a loop with no export callbacks (HFExport is a Trainer callback). Returns the
        settings the run uses (`SlideStrategy._plan_memory`)."""
        return SlideStrategy._plan_memory(self, _NO_CALLBACKS, module, optimizer, self.precision.compute_dtype)

    def _before_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """A training forward starts a micro-batch: the engine forgets a graph never backpropagated and sizes the
        window for it; the largest micro-batch so far is checked against the memory first. Forwards without
        gradients (evaluation) leave a pending graph alone."""
        if not torch.is_grad_enabled():
            return
        self._log_engine_notes()
        shape = _token_shape((args, kwargs))
        self.engine.new_micro_batch(None if shape is None else shape[0] * shape[1])
        if shape is not None and shape[0] * shape[1] > self._checked_tokens:
            self._check_batch(shape)

    # ----------------------------------------------------------------------------------------- steps
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """Clip (when asked since the last step) and update from the sums of every backward since the last step.

        The updates run on the optimizer thread; the next forward waits for each unit's own update only.
        """
        self._check_optimizer(optimizer)
        closure: Callable[[], Any] | None = kwargs.pop("closure", None)
        if kwargs:
            raise TypeError(f"slideformer's optimizer.step() takes only a closure, got {sorted(kwargs)}.")
        result = None
        if closure is not None:
            with torch.enable_grad():
                result = closure()
        self.engine.begin_step()
        self.engine.end_step(backward_ran=True)
        optimizer._opt_called = True  # what optimizer.step() tells LR schedulers (torch.optim.lr_scheduler)
        return result

    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        """Clip the next `optimizer.step()` by the global L2 norm of its gradients (all of them, every unit), and
        return that norm before clipping, as torch's `clip_grad_norm_` does (a CPU tensor).

        The gradients sit in the engine's fp32 host sums, not in `param.grad`: the call waits until the last
        backward's gradients have landed there and measures them, which the step would otherwise do itself (it
        reuses this measure), so returning the norm costs no extra work, only that wait comes before the step.
        """
        self._check_optimizer(optimizer)
        if float(norm_type) != 2.0:
            raise ValueError(f"slideformer clips by the global L2 norm only: use norm_type=2 (got {norm_type}).")
        norm = torch.tensor(self.engine.clip_next(float(max_norm), measure=True))
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(f"The global gradient norm is {float(norm)}, so it cannot be clipped. Pass "
                               "error_if_nonfinite=False to fabric.clip_gradients to step anyway (unclipped).")
        return norm

    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: float | int) -> None:
        raise ValueError("slideformer clips by the global gradient norm only: use "
                         "fabric.clip_gradients(model, optimizer, max_norm=...) instead of clip_val.")

    def _check_optimizer(self, optimizer: Any) -> None:
        if self.engine is None or self.engine.optimizer is None:
            raise RuntimeError("Set up the model and its optimizer together first: "
                               "`model, optimizer = fabric.setup(model, optimizer)`.")
        if optimizer is not self.engine.optimizer:
            raise ValueError("This optimizer is not the one set up with the model in fabric.setup(model, optimizer).")

    # ------------------------------------------------------------------------------------ checkpoints
    def get_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        self._synchronize()
        return module.state_dict()

    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """torch's Adam state_dict format (as the Trainer strategy's checkpoints), read from the flat state."""
        self._synchronize()
        return optimizer.state_dict()

    def synchronize(self) -> None:
        """Wait for every queued copy and update: parameters and optimizer state are then current."""
        self._synchronize()

    def _synchronize(self) -> None:
        if self.engine is not None:
            self.engine.synchronize()

    # ----------------------------------------------------------------------------------- lifecycle
    def teardown(self) -> None:
        """Finish the queued updates, stop the engine's threads and give its memory back (the parameters stay
        readable host tensors)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        super().teardown()


if SlideFabricStrategy.strategy_name not in STRATEGY_REGISTRY:
    SlideFabricStrategy.register_strategies(STRATEGY_REGISTRY)
