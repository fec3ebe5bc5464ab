"""The Lightning cases: DeepSpeed ZeRO offload and lightning-slide, driven by one tiny LightningModule.

Both get the same model (fp32 weights on the CPU, as a user who loaded a checkpoint has them), the
same random tokens and `precision="bf16-mixed"`. What differs is only what each strategy requires:
DeepSpeed's offload wants `DeepSpeedCPUAdam` and runs with gradient checkpointing (its usual setting,
and without it 3B does not fit the cap); lightning-slide takes a plain `torch.optim.AdamW`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.build import build_model, random_tokens
from benchmarks.cases import NVME_PATH, SYSTEMS, Case
from benchmarks.models import MODELS
from benchmarks.rungs import Rungs, disk_bytes
from benchmarks.timing import WindowClock

LR = 1e-5


class CausalLMModule(pl.LightningModule):
    """training_step returns the model's own loss; the optimizer is what the strategy requires."""

    def __init__(self, model: torch.nn.Module, deepspeed_adam: bool) -> None:
        super().__init__()
        self.model = model
        self.deepspeed_adam = deepspeed_adam

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids = batch[0]
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.deepspeed_adam:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            return DeepSpeedCPUAdam(self.parameters(), lr=LR)
        return torch.optim.AdamW(self.parameters(), lr=LR)


class ClockCallback(pl.Callback):
    """Ticks the window clock after every optimizer step; snapshots engine stats at the window ends."""

    def __init__(self, clock: WindowClock) -> None:
        self.clock = clock
        self.stats: dict[str, dict] = {}
        self.disk_bytes = 0
        self._trainer: pl.Trainer | None = None
        clock.on_window_start = lambda: self._snapshot("start")
        clock.on_window_end = lambda: self._snapshot("end")

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        self._trainer = trainer
        self.clock.tick(outputs["loss"])

    def _snapshot(self, when: str) -> None:
        stats = engine_stats(self._trainer.strategy) if self._trainer else {}
        self.stats[when] = {**stats, **allocator_stats()} if stats else {}  # counted per engine step
        self.disk_bytes = disk_bytes(Path(NVME_PATH))


def engine_stats(strategy: object) -> dict:
    """`strategy.engine.stats()` if the strategy has one (lightning-slide), as plain JSON values."""
    stats = getattr(getattr(strategy, "engine", None), "stats", None)
    if not callable(stats):
        return {}
    return {key: _jsonable(value) for key, value in dict(stats()).items()}


def allocator_stats() -> dict:
    """The CUDA caching allocator's running counts of what synchronises the whole device: allocations retried
    after freeing its cache (`alloc_retries`) and blocks handed back to the driver (`device_frees`, each a
    cudaFree). Empty without CUDA."""
    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    return {"alloc_retries": stats.get("num_alloc_retries", 0), "device_frees": stats.get("num_device_free", 0)}


def _jsonable(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (int, float, str, bool, type(None))):
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return repr(value)


def _strategy(case: Case) -> tuple[object, dict]:
    """The Trainer's strategy argument, and how it was configured (for the record)."""
    if case.system in ("ds2", "ds3"):
        return SYSTEMS[case.system], {}
    from lightning_slide import SlideStrategy

    strategy = SlideStrategy(**case.settings)
    config = getattr(strategy, "config", None)
    return strategy, (dataclasses.asdict(config) if dataclasses.is_dataclass(config) else {})


def _fit(case: Case, device: torch.device, data: DataLoader, max_steps: int, seq_len: int,
         callback: pl.Callback) -> dict:
    """Build the model (fp32 on the CPU) and the case's strategy, and fit; returns the strategy's config."""
    deepspeed = case.system in ("ds2", "ds3")
    strategy, config = _strategy(case)
    model = build_model(MODELS[case.model], seq_len, torch.device("cpu"), torch.float32)
    if deepspeed:
        model.gradient_checkpointing_enable()
    module = CausalLMModule(model, deepspeed_adam=deepspeed)
    del model  # the strategy may repack the weights: keep no second reference alive
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the GPU-drawn init noise must not count as the strategy's memory
        torch.cuda.reset_peak_memory_stats(device)
    trainer = pl.Trainer(strategy=strategy, accelerator="gpu" if device.type == "cuda" else "cpu", devices=1,
                         precision="bf16-mixed", max_steps=max_steps, gradient_clip_val=case.clip,
                         logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                         callbacks=[callback])
    trainer.fit(module, data)
    return config


def run_lightning(case: Case, device: torch.device) -> dict:
    """Fit warm-up, timed and profiled steps with the case's strategy; the clock callback does the timing."""
    clock = WindowClock(case.warmup, case.steps, device, case.profile_steps)
    callback = ClockCallback(clock)
    rows = clock.total_steps * case.micro_batch
    data = DataLoader(TensorDataset(random_tokens(MODELS[case.model], rows, case.seq_len, zipf=case.zipf)),
                      batch_size=case.micro_batch)
    config = _fit(case, device, data, clock.total_steps, case.seq_len, callback)
    return {**clock.summary(case.tokens_per_step), "first_step_at": clock.first_step_at,
            "engine_stats": callback.stats, "slide_config": config, "disk_bytes": callback.disk_bytes,
            "kernels": "slide config use_kernels" if config.get("use_kernels") else "hf-llama-sdpa",
            "gradient_checkpointing": case.system in ("ds2", "ds3")}


class RungCallback(pl.Callback):
    """Feeds a ladder's step boundaries to its Rungs; stops the fit when the ladder ends."""

    def __init__(self, rungs: Rungs) -> None:
        self.rungs = rungs

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self.rungs.step_started(batch_idx)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        if not self.rungs.step_ended(batch_idx):
            trainer.should_stop = True


def _as_batch(items: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each dataset item is already a whole batch (sizes grow along the ladder)."""
    return items


def climb_lightning(case: Case, device: torch.device, rungs: Rungs) -> None:
    """One fit whose batches grow rung by rung: the strategy is set up once for the whole ladder."""
    batches = rungs.batches()
    data = DataLoader(batches, batch_size=1, collate_fn=_as_batch)
    seq_len = max(case.rung_shape(size)[1] for size in rungs.sizes)
    _fit(case, device, data, len(batches), seq_len, RungCallback(rungs))
