"""`SlideStrategy`: Lightning's face of the sliding engine (`Trainer(strategy="slideformer")`).

The LightningModule's parameters stay on the host as fp32 masters (views into the engine's flat storage),
so `configure_optimizers`, LR schedulers, `state_dict` and checkpoints see ordinary CPU tensors; only the
engine moves weights to the GPU, one unit at a time, and runs the optimizer on the CPU.

With `offload="none"` there is no engine: the strategy is Lightning's single-device training.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from typing import Any

import torch
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning_utilities import apply_to_collection
from torch.utils.hooks import RemovableHandle

from lightning_slide.callbacks import HFExport
from lightning_slide.checkpoint_io import AtomicCheckpointIO
from lightning_slide.config import SlideConfig
from lightning_slide.engine import SlideEngine
from lightning_slide.materialize import meta_parameters
from lightning_slide.planner import (
    Plan,
    Resources,
    Setup,
    check_batch,
    fit_moments,
    plan_for_run,
    resident_bytes,
    resolve_batch_setup,
)
from lightning_slide.precision import SlidePrecision
from lightning_slide.step_mode import StepMode
from lightning_slide.tiers import backend_name, direct_io, remove_stale_tier_folders


def _token_shape(batch: Any) -> tuple[int, int] | None:
    """(micro-batch, sequence length) of the first 2-D integer tensor in a batch (the token ids).

    Lightning's collection walk, not torch's pytree: it also opens Mappings such as the `BatchEncoding`
    that Hugging Face tokenizers and collators return.
    """
    found: list[tuple[int, int]] = []

    def visit(t: torch.Tensor) -> None:
        if t.ndim == 2 and not t.is_floating_point():
            found.append((int(t.shape[0]), int(t.shape[1])))

    apply_to_collection(batch, torch.Tensor, visit)
    return found[0] if found else None


def refuse_compiled(module: torch.nn.Module) -> None:
    if any(isinstance(m, torch._dynamo.eval_frame.OptimizedModule) for m in module.modules()):
        raise ValueError("torch.compile is not supported with slideformer (the engine drives each layer itself).")


class SlideStrategy(SingleDeviceStrategy):
    """Full-parameter training of a causal LM larger than the GPU: layers slide through a GPU window.

    Every setting of the sliding runtime is a field of :class:`~lightning_slide.config.SlideConfig`, whose
    docstring says what each does; pass them as a ``SlideConfig``, as keywords, or both (keywords win)::

        Trainer(strategy="slideformer")                                 # SlideConfig's defaults
        Trainer(strategy=SlideStrategy(offload="nvme", nvme_path="/mnt/nvme", slots=4))
        Trainer(strategy=SlideStrategy(SlideConfig(recompute="always"), activations="cpu"))

    The Trainer's ``precision`` flag is honoured (``"bf16-mixed"``, ``"bf16-true"`` or ``"32-true"``).
    ``offload="none"`` is plain single-device training, exactly as Lightning's ``SingleDeviceStrategy``: no
    engine, the module and the optimizer state on the compute device, any torch optimizer, and Lightning's own
    precision plugins, gradient clipping and accumulation. The other settings are then unused.
    """

    strategy_name = "slideformer"

    def __init__(
        self,
        config: SlideConfig | None = None,
        *,
        device: str | torch.device | None = None,
        accelerator: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Precision | None = None,
        **settings: Any,
    ) -> None:
        """
        Args:
            config: the runtime's settings; None: SlideConfig's defaults.
            device: the compute device; None: the Trainer's ``accelerator`` and ``devices`` decide.
            accelerator, precision_plugin: as for Lightning's ``SingleDeviceStrategy``.
            checkpoint_io: how checkpoints are written; default: atomically (a temporary file, then renamed).
            **settings: SlideConfig fields that replace those of ``config`` (``offload="nvme"``, ``slots=4``);
                the registry's ``strategy="slideformer_nvme"`` passes ``offload="nvme"`` so. An unknown name is
                refused with the list of valid ones.
        """
        self.config = SlideConfig.for_strategy(config, **settings)
        super().__init__(device or "cpu", accelerator, checkpoint_io or AtomicCheckpointIO(), precision_plugin)
        self.parallel_devices: list[torch.device] | None = None if device is None else [torch.device(device)]
        self.engine: SlideEngine | None = None
        self.plan: Plan | None = None
        self._planned: tuple | None = None  # (model shape, setup): what micro-batches are checked against
        self._checked_tokens = 0  # the largest micro-batch checked so far
        self._process_bytes = 0  # host memory the process held besides the model's weights at setup
        self._hooks: list[RemovableHandle] = []

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="Layer-sliding GPU window with fp32 masters and Adam on the CPU"
        )
        strategy_registry.register(
            f"{cls.strategy_name}_nvme", cls, offload="nvme",
            description="slideformer with the disk tier (sliding activations and Adam moments in files)",
        )

    @property
    def root_device(self) -> torch.device:
        return self.parallel_devices[0] if self.parallel_devices else self._root_device

    @property
    def sliding(self) -> bool:
        """False with offload="none": then every hook below is Lightning's own (the `super()` calls)."""
        return self.config.offload != "none"

    @property
    def precision_plugin(self) -> Precision:
        if self._precision_plugin is None and self.sliding:
            self._precision_plugin = SlidePrecision()
        return super().precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        self._precision_plugin = SlidePrecision.adopt(plugin) if plugin is not None and self.sliding else plugin

    # ------------------------------------------------------------------------------------------ setup
    def setup(self, trainer: Trainer) -> None:
        if self.parallel_devices and len(self.parallel_devices) > 1:
            raise ValueError("The slideformer strategy trains on one device: pass Trainer(devices=1).")
        if not self.sliding:
            rank_zero_info(f"offload=none: everything on {self.root_device}")
            return super().setup(trainer)
        self.accelerator.setup(trainer)
        module = self.lightning_module
        self._validate(trainer, module)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self.setup_optimizers(trainer)
            if len(self.optimizers) != 1:
                raise ValueError(
                    f"The slideformer strategy trains with exactly one optimizer; configure_optimizers returned "
                    f"{len(self.optimizers)}. Put all parameters in one torch.optim.AdamW (param groups are fine)."
                )
        precision = self.precision_plugin
        precision.device_type = self.root_device.type
        optimizer = self.optimizers[0] if fitting else None
        self.mode = StepMode(self._accumulates(trainer), self._clip_norm(trainer), not module.automatic_optimization)
        rank_zero_info(f"slideformer steps: {self.mode.describe()}")
        config = self._plan_memory(trainer, module, optimizer, precision.compute_dtype)
        self.engine = SlideEngine(module, optimizer, config, self.root_device, precision.compute_dtype, self.mode)
        precision.engine, precision.automatic = self.engine, module.automatic_optimization
        self._hooks = self._state_hooks()
        self.setup_precision_plugin()

    def _state_hooks(self) -> list[RemovableHandle]:
        """A callback's `state_dict()` of the module (or of the model in it) waits for the updates and reads fp32
        masters (those the GPU updates are planes while training runs: `master_halves`); its `load_state_dict()`
        reloads the window. On the model only: torch runs a module's state hooks also for a call on a parent."""
        model = self.engine.model
        return [model.register_state_dict_pre_hook(lambda *_: self.engine.synchronize()),
                model.register_load_state_dict_pre_hook(lambda *_: self.engine.synchronize()),
                model.register_load_state_dict_post_hook(lambda *_: self.engine.master_changed())]

    def _plan_memory(self, trainer: Trainer, module: LightningModule, optimizer: Any,
                     dtype: torch.dtype) -> SlideConfig:
        """Log what will live where and refuse (PlanError) a run whose weights and state cannot fit. Returns the
        settings this run uses: the strategy's, with `nvme_moments` fitted to the free RAM where it is left to the
        planner (the strategy keeps its own, so that a later fit fits it again)."""
        config = self.config
        setup = Setup(
            config, self.root_device.type, dtype, training=optimizer is not None, mode=self.mode,
            amsgrad=optimizer is not None and any(g.get("amsgrad", False) for g in optimizer.param_groups),
            export_bytes=sum(cb.host_bytes(module) for cb in trainer.callbacks if isinstance(cb, HFExport)),
        )
        shape, self.plan = plan_for_run(module, optimizer, setup)
        if config.offload == "nvme":  # folders of killed runs: their space counts as free
            remove_stale_tier_folders(config.nvme_path)
        resources = Resources.probe(self.root_device, config.nvme_path, resident_bytes(module))
        if config.offload == "nvme" and config.nvme_moments is None and optimizer is not None:
            config = replace(config, nvme_moments=fit_moments(shape, setup, resources))
            setup = replace(setup, config=config)
            self.plan = Plan.static(shape, setup)
        self._planned, self._checked_tokens, self._process_bytes = (shape, setup), 0, resources.process
        rank_zero_info(self.plan.describe())
        if config.offload == "nvme":
            state = ("no Adam state (evaluation)" if optimizer is None else
                     f"{config.nvme_moments:.0%} of the Adam moments on disk"
                     + (" with their units' fp32 master weights" if config.nvme_master else ""))
            rank_zero_info(f"slideformer disk tier: {backend_name(direct_io(config.gds, self.root_device))}, files "
                           f"under {config.nvme_path}, {state}")
        self.plan.check(resources)
        return config

    def _validate(self, trainer: Trainer, module: LightningModule) -> None:
        refuse_compiled(module)
        if trainer.gradient_clip_val and trainer.gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            raise ValueError(
                "slideformer clips by the global gradient norm only: use gradient_clip_algorithm='norm'."
            )
        if module.automatic_optimization and is_overridden("configure_gradient_clipping", module):
            rank_zero_warn("slideformer clips in its engine, by the global norm at Trainer(gradient_clip_val=...): "
                           "your configure_gradient_clipping override is not used (its clip_gradients calls do "
                           "nothing). Set gradient_clip_val to clip.")

    @staticmethod
    def _accumulates(trainer: Trainer) -> bool:
        """Whether any optimizer step of this fit sums several backwards (also later epochs of a
        GradientAccumulationScheduler): the host then keeps gradient sums from the start."""
        factors = [trainer.accumulate_grad_batches] + [
            factor for cb in trainer.callbacks if isinstance(cb, GradientAccumulationScheduler)
            for factor in cb.scheduling.values()]
        return max(factors) > 1

    @staticmethod
    def _clip_norm(trainer: Trainer) -> float | None:
        value = trainer.gradient_clip_val
        return float(value) if value else None

    def model_to_device(self) -> None:
        """Weights stay on the host; the engine moves buffers and streams units to the device.

        With offload="none" the whole module moves to the device, as in Lightning.
        """
        if not self.sliding:
            super().model_to_device()

    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """Build models on the CPU in fp32: they become the host master weights.

        With `trainer.init_module(empty_init=True)` parameters are meta-device placeholders instead: the
        engine fills them unit by unit, straight into its flat storage, from the local checkpoint folder in
        `model.config.name_or_path` or with the model's initialiser (the model never exists twice in RAM).
        With offload="none" this is Lightning's own context: the compute device, and empty_init skips the
        initialisation (real tensors, no meta placeholders).
        """
        if not self.sliding:
            with super().tensor_init_context(empty_init):
                yield
            return
        with meta_parameters() if empty_init else nullcontext(), torch.device("cpu"):
            yield

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if not self.sliding:
            return super().training_step(*args, **kwargs)
        self._log_engine_notes()
        shape = _token_shape(args[0] if args else None)
        tokens = None if shape is None else shape[0] * shape[1]
        self.engine.new_micro_batch(tokens)
        if self._planned is not None and tokens is not None and tokens > self._checked_tokens:
            self._check_batch(shape)
        return super().training_step(*args, **kwargs)

    def _log_engine_notes(self) -> None:
        """What the engine decided from the first micro-batches (the GPU's share of the updates, the window's
        slots, kept graphs), logged once, before the next micro-batch."""
        while self.engine.notes:
            rank_zero_info(f"slideformer {self.engine.notes.pop(0)}")

    def _check_batch(self, tokens: tuple[int, int]) -> None:
        """Before the forward of the largest micro-batch so far allocates: refuse it if its activations and
        workspace cannot fit (the engine has given back what it grew for smaller ones)."""
        shape, setup = self._planned
        self._checked_tokens = tokens[0] * tokens[1]
        resources = Resources.probe(self.root_device, self.config.nvme_path)  # the disk holds saved inputs too
        gpu_free = None if resources.gpu is None else resources.gpu + self.plan.total("gpu")  # slots are in already
        runs, needs = resolve_batch_setup(self.plan, shape, setup, *tokens, resources, gpu_free)
        decided = ""
        if runs.config.mlp_tile_tokens != setup.config.mlp_tile_tokens:  # "auto", decided for this size
            tiles = runs.config.mlp_tile_tokens
            self.engine.tile_mlps(tiles)
            decided = f"\n  mlp_tile_tokens='auto': {'untiled' if tiles is None else f'tiles of {tiles} tokens'}"
        self.engine.group_attention(runs.grouped_attention)
        if runs.grouped_attention:
            decided += "\n  attention over groups of key/value heads (it does not fit in one call)"
        whole = Plan(self.plan.entries + needs.entries)
        peak = whole.peak_rss(replace(resources, process=self._process_bytes))
        rank_zero_info(f"micro-batch of {tokens[0]} x {tokens[1]} tokens: " + needs.describe()
                       + f"\n  expected peak host RSS of the run: {peak / 2**30:.2f} GiB" + decided)
        check_batch(needs, self.plan, shape, runs, *tokens, resources, gpu_free)

    # ------------------------------------------------------------------------------------ checkpoints
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return self.sliding or super().restore_checkpoint_after_setup

    def lightning_module_state_dict(self) -> dict[str, Any]:
        self._synchronize()
        return super().lightning_module_state_dict()

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        self._synchronize()
        return super().optimizer_state(optimizer)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Load into the engine's flat host state (the base class would move the state to the GPU)."""
        if not self.sliding:
            return super().load_optimizer_state_dict(checkpoint)
        states = checkpoint["optimizer_states"]
        if len(states) != 1 or self.engine is None:
            raise ValueError("This checkpoint holds optimizer states that do not match the slideformer run.")
        self.engine.load_optimizer_state(states[0])

    def _synchronize(self) -> None:
        if self.engine is not None:
            self.engine.synchronize()

    # ----------------------------------------------------------------------------------- lifecycle
    def teardown(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self.engine is not None:
            self.engine.close()
            self.engine = None
            self.precision_plugin.engine = None
        module = self.lightning_module
        placeholders = module is not None and any(p.is_meta for p in module.parameters())
        if placeholders:  # setup failed before the engine filled them: nothing to move, and the error must show
            self._lightning_module = None
        try:
            super().teardown()
        finally:
            if placeholders:
                self._lightning_module = module
