"""Packing against padding: the same SFT examples, of long-tailed lengths, trained with `data.packing` on and off
(the same model, settings and GPU cap); for each the padding of its batches and its real (non-pad) tokens/s.

    python -m benchmarks.packing --model llama3_1b --seq-len 2048 --batch-size 8 --out DIR

The examples are prompt/response records cut from the built-in corpus (Python standard-library source; the
byte-level tokenizer makes one token per byte): total lengths lognormal with median `--median` tokens, cut at
seq_len by the data module as any record is; the prompt, a random 10-50% of each, carries no loss. Each mode
trains through `TextDataModule`, `CausalLMModule` and the sliding strategy (`offload=cpu`, its defaults) from
random weights, in bf16-mixed under the cap. After `--warmup` steps it times `--steps` more (the device is
synchronised only at the window's two ends, `benchmarks.timing.WindowClock`) and counts the real tokens of
those batches on the device. Padding runs first, then packing, each with a fresh model and strategy. Writes
DIR/packing-<model>.json: both modes (padding, real and all tokens/s, step time, peaks) and the ratio of real
tokens/s, packed over padded.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import inspect
import json
import math
import random
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch

from benchmarks.e2e import machine
from benchmarks.timing import WindowClock
from lightning_slide import SlideStrategy
from lightning_slide.data import BUILTIN_MODULES, TextDataModule, byte_tokenizer
from lightning_slide.lm import CausalLMModule
from lightning_slide.models import build_model, model_config
from lightning_slide.packing import non_padding_tokens

GIB = float(1 << 30)


def sft_records(count: int, median: int, sigma: float, seed: int) -> list[dict[str, str]]:
    """Prompt/response records cut from the built-in corpus, total lengths lognormal around `median`."""
    corpus = "\n".join(inspect.getsource(importlib.import_module(name)) for name in BUILTIN_MODULES)
    rng = random.Random(seed)
    records = []
    for _ in range(count):
        length = max(8, min(len(corpus) // 2, round(rng.lognormvariate(math.log(median), sigma))))
        start = rng.randrange(len(corpus) - length)
        text, prompt = corpus[start : start + length], round(length * rng.uniform(0.1, 0.5))
        records.append({"prompt": text[:prompt], "response": text[prompt:]})
    return records


class TokenWindow(pl.Callback):
    """Ticks the window clock after every step and sums the real and all tokens of the timed steps' batches; counts
    the timed batches larger than any before (the engine sizes its window again for each: a step that recomputes
    every block and grows the window back after it)."""

    def __init__(self, clock: WindowClock) -> None:
        self.clock = clock
        self.real: torch.Tensor | int = 0
        self.tokens = 0
        self.largest = 0
        self.larger_batches = 0

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: object,
                           batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.clock.tick(outputs["loss"])
        size = batch["input_ids"].numel()
        if self.clock.warmup < self.clock.ticks <= self.clock.warmup + self.clock.steps:
            self.real = self.real + non_padding_tokens(batch)
            self.tokens += size
            self.larger_batches += size > self.largest
        self.largest = max(self.largest, size)


def run_mode(args: argparse.Namespace, data_path: Path, packing: bool, device: torch.device) -> dict:
    """One training run with packing on or off; what it measured."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    data = TextDataModule(byte_tokenizer(), str(data_path), seq_len=args.seq_len, batch_size=args.batch_size,
                          val_fraction=0.01, packing=packing, seed=args.seed)
    data.setup("fit")
    window = TokenWindow(WindowClock(args.warmup, args.steps, device))
    torch.manual_seed(args.seed)  # the engine fills the placeholders with the model's initialiser
    module = CausalLMModule(build_model(args.model, meta=True), lr=1e-5, warmup_steps=0)
    trainer = pl.Trainer(strategy=SlideStrategy(), accelerator=device.type, devices=1,
                         precision="bf16-mixed" if device.type == "cuda" else "32-true",
                         max_steps=args.warmup + args.steps, limit_val_batches=0, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[window])
    trainer.fit(module, datamodule=data)
    timing = window.clock.summary(tokens_per_step=window.tokens / args.steps)
    real = int(window.real)
    return {"packing": packing, "report": data.packing_report() if packing else None,
            "attention": module.model.config._attn_implementation,
            "batches_per_epoch": len(data.train_dataloader()), "timed_steps": args.steps,
            "timed_batches_larger_than_any_before": window.larger_batches,
            "real_tokens": real, "tokens": window.tokens, "padding": 1 - real / window.tokens,
            "real_tokens_per_s": real / (timing["step_s_mean"] * args.steps), "tokens_per_s": timing["tokens_per_s"],
            "step_s_mean": timing["step_s_mean"], "step_s_median": timing["step_s_median"],
            "loss_last": timing["loss_last"], "first_nonfinite_step": timing["first_nonfinite_step"],
            "wall_s": time.perf_counter() - started, **_peaks(device)}


def _peaks(device: torch.device) -> dict:
    if device.type != "cuda":
        return {}
    return {"peak_vram_alloc_gib": torch.cuda.max_memory_allocated(device) / GIB,
            "peak_vram_reserved_gib": torch.cuda.max_memory_reserved(device) / GIB}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3_1b", help="a name of lightning_slide.models.MODELS")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--examples", type=int, default=2000)
    parser.add_argument("--median", type=int, default=200, help="median total length of an example, in tokens")
    parser.add_argument("--sigma", type=float, default=1.0, help="the lognormal's sigma (the tail's weight)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--cap-gib", type=float, default=24.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", type=Path, default=Path("/tmp/lightning-slide-packing"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--commit", default="unknown")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")  # CPU: a smoke test
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * GIB / total), device)
    args.work.mkdir(parents=True, exist_ok=True)
    data_path = args.work / "sft.jsonl"
    records = sft_records(args.examples, args.median, args.sigma, args.seed)
    data_path.write_text("".join(json.dumps(r) + "\n" for r in records))
    padded, packed = (run_mode(args, data_path, packing, device) for packing in (False, True))
    config = model_config(args.model)
    record = {
        "case": f"packing-{args.model}", "command": " ".join([sys.executable, "-m", "benchmarks.packing",
                                                              *(sys.argv[1:] if argv is None else argv)]),
        "commit": args.commit, "date": datetime.date.today().isoformat(), "machine": machine(),
        "model": args.model, "model_config": {k: getattr(config, k) for k in (
            "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
            "vocab_size", "tie_word_embeddings")} | {"attention": packed["attention"], "init": "random"},
        "vram_cap_gib": args.cap_gib if device.type == "cuda" else None, "seq_len": args.seq_len,
        "micro_batch": args.batch_size, "precision": "bf16-mixed" if device.type == "cuda" else "32-true",
        "data": {"examples": args.examples, "lengths": f"lognormal, median {args.median} tokens, sigma {args.sigma}, "
                 f"cut at seq_len {args.seq_len}", "source": "built-in corpus, byte-level tokenizer",
                 "prompt": "10-50% of each example, no loss"},
        "padding": padded, "packing": packed,
        "real_tokens_per_s_ratio": packed["real_tokens_per_s"] / padded["real_tokens_per_s"],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"packing-{args.model}.json").write_text(json.dumps(record, indent=1))
    print(json.dumps({k: record[k] for k in ("case", "real_tokens_per_s_ratio")} | {
        mode: {k: record[mode][k] for k in ("padding", "real_tokens_per_s", "step_s_mean")}
        for mode in ("padding", "packing")}, indent=1))
    return record


if __name__ == "__main__":
    main()
