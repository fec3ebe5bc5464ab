"""Callbacks for fine-tuning runs: throughput and memory in the progress bar, and a Hugging Face export."""

from __future__ import annotations

import resource
import sys
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from transformers import PreTrainedTokenizerBase

from lightning_slide.export import DEFAULT_MAX_SHARD_SIZE, check_settings, export_dtype, save_hf_folder, shard_bytes
from lightning_slide.packing import non_padding_tokens

GIB = 2**30


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


class ThroughputMemoryMonitor(Callback):
    """Logs tokens/s (non-padding tokens over wall time, padded or packed batches), peak host RSS and, on CUDA,
    peak VRAM.

    The rate is measured over windows of `window` batches (default: the trainer's log_every_n_steps) so the
    token count is read from the device once per window, not once per step; validation time is left out.
    """

    def __init__(self, window: int | None = None) -> None:
        self.window = window
        self._metrics: dict[str, float] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.window = self.window or trainer.log_every_n_steps
        self._start_window()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start_window()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: object,
                           batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._tokens = self._tokens + non_padding_tokens(batch)
        self._batches += 1
        if self._batches == self.window:
            self._metrics = {"tokens/s": float(self._tokens) / (time.perf_counter() - self._t0)}
            self._metrics.update(self._memory(pl_module.device))
            self._start_window()
        if self._metrics:
            pl_module.log_dict(self._metrics, prog_bar=True, on_step=True, on_epoch=False)

    def _start_window(self) -> None:
        self._tokens, self._batches, self._t0 = 0, 0, time.perf_counter()

    @staticmethod
    def _memory(device: torch.device) -> dict[str, float]:
        memory = {"rss_peak_GiB": peak_rss_bytes() / GIB}
        if device.type == "cuda":
            memory["vram_peak_GiB"] = torch.cuda.max_memory_allocated(device) / GIB
        return memory


class HFExport(Callback):
    """At the end of training, writes `pl_module.model` as a Hugging Face folder (safetensors shards + tokenizer).

    Runs in `on_train_end`, before the strategy tears down its buffers, and takes the weights from
    `trainer.strategy.lightning_module_state_dict()`, which waits for any in-flight optimizer update. Those are
    views into the strategy's flat host buffers; `save_hf_folder` casts and writes them one shard at a time,
    so the export costs at most one shard of extra host memory. `dtype="auto"` writes the checkpoint's own
    dtype (bf16 for published checkpoints), "float32" the fp32 masters as they are.
    """

    def __init__(self, out_dir: str | Path, tokenizer: PreTrainedTokenizerBase | None = None, dtype: str = "auto",
                 max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> None:
        check_settings(dtype, max_shard_size)
        self.out_dir = Path(out_dir)
        self.tokenizer = tokenizer
        self.dtype = dtype
        self.max_shard_size = max_shard_size

    def host_bytes(self, pl_module: L.LightningModule) -> int:
        """The export's extra host memory at its peak (one shard of casted copies), for the strategy's planner."""
        dtype = export_dtype(pl_module.model, self.dtype)
        unique = {id(p): p for p in pl_module.model.parameters()}.values()
        whole = sum(p.numel() for p in unique) * dtype.itemsize
        return min(whole, shard_bytes(self.max_shard_size))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        state = trainer.strategy.lightning_module_state_dict()
        weights = {name.removeprefix("model."): tensor for name, tensor in state.items() if name.startswith("model.")}
        if trainer.is_global_zero:
            save_hf_folder(pl_module.model, self.out_dir, weights, dtype=self.dtype,
                           max_shard_size=self.max_shard_size, tokenizer=self.tokenizer)
