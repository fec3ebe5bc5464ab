"""Compact Adam moments (`moment_precision`) against exact fp32: training quality, and the CPU update's speed.

    python -m benchmarks.compact quality --out $OUT    # Llama-3.2-1B's config, random init, the built-in corpus
    python -m benchmarks.compact update --out $OUT     # the optimizer thread's rate per precision on this CPU

`quality` trains the same model from the same seed on the same batches once per precision (fp32, bf16,
int8) for `--steps` optimizer steps, validating every `--val-every`, then fine-tunes: each precision
continues the fp32 run's final weights and Adam state (converted to its own precision on load, as a
checkpoint of an fp32 run loads into a compact run) on a different data mix for `--finetune-steps`.
`--precisions` picks the compact ones (fp32 always runs, first; `int8-master24`: 8-bit moments and 24-bit
masters, `master_bits`, which apply on a GPU); `--phases` one phase alone (a fine-tuning
comparison still pretrains fp32 to continue from). Writes `compact-quality-<precisions>[-<phase>].json`
(final train loss: the mean of the last 20 steps; final validation loss; the curves; step times) and a .png of
the curves together. `update` times Layer-Adam over one unit
of Llama-3.1-8B block shapes (218M parameters, fp32 gradients) per precision and per compact piece size,
and writes `compact-update.json`. The capacity side (peak host RSS per parameter at 8B) is
`benchmarks.capacity --moment-precision`.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import platform
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import psutil
import torch

import lightning_slide.layer_adam as layer_adam
from lightning_slide import SlideStrategy
from lightning_slide.data import TextDataModule, byte_tokenizer
from lightning_slide.device_update import DeviceUpdater
from lightning_slide.layer_adam import DeferredUpdate, DeviceGrad, LayerAdam, snapshot
from lightning_slide.lm import CausalLMModule
from lightning_slide.models import build_model, model_config
from lightning_slide.moments import Moments
from lightning_slide.storage import UnitStorage
from lightning_slide.threads import Failure

GiB = 2**30
PRECISIONS = ("fp32", "bf16", "int8")
#: what `quality` can run beside fp32: each compact precision, and 8-bit moments with 24-bit masters
VARIANTS = {"fp32": {}, "bf16": {"moment_precision": "bf16"}, "int8": {"moment_precision": "int8"},
            "int8-master24": {"moment_precision": "int8", "master_bits": 24}}
#: The fine-tuning mix: standard-library modules that the built-in corpus does not hold.
FINETUNE_MODULES = ("email.message", "http.client", "unittest.case", "asyncio.base_events", "tarfile", "zipfile",
                    "urllib.parse", "configparser", "datetime", "statistics", "fractions", "difflib")
BLOCK_SHAPES = ((4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (14336, 4096), (14336, 4096),
                (4096, 14336), (4096,), (4096,))  # one Llama-3.1-8B decoder block


def machine() -> dict:
    return {"gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "ram_gib": psutil.virtual_memory().total / GiB,
            "torch": torch.__version__}


def record_base(args: argparse.Namespace) -> dict:
    return {"command": " ".join([sys.executable, "-m", "benchmarks.compact", *sys.argv[1:]]),
            "commit": args.commit, "date": time.strftime("%Y-%m-%d"), "machine": machine()}


# ---------------------------------------------------------------------------------------------------- quality
class Curves(pl.Callback):
    """Train loss and wall time per step, validation loss at each validation."""

    def __init__(self) -> None:
        self.train: list[float] = []
        self.step_s: list[float] = []
        self.val: list[tuple[int, float]] = []
        self._last = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.train.append(float(outputs["loss"]))  # a sync per step: the step time includes it for every precision
        now = time.perf_counter()
        self.step_s.append(now - self._last)
        self._last = now

    def on_validation_end(self, trainer, module) -> None:
        if not trainer.sanity_checking and "val/loss" in trainer.callback_metrics:
            self.val.append((trainer.global_step, float(trainer.callback_metrics["val/loss"])))
        self._last = time.perf_counter()  # validation time is not a step's


class StartFrom(pl.Callback):
    """Load a checkpoint's weights and Adam state into the run before its first step, through the strategy's own
    loading (which converts the moments to the run's precision); the run keeps its own data and schedule."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_start(self, trainer, module) -> None:
        checkpoint = trainer.strategy.checkpoint_io.load_checkpoint(self.path)
        trainer.strategy.load_model_state_dict(checkpoint)
        trainer.strategy.load_optimizer_state_dict(checkpoint)


def finetune_data(folder: Path, seq_len: int, batch: int) -> TextDataModule:
    """Text records of `FINETUNE_MODULES`' source, cut into pieces of about `seq_len` bytes."""
    path = folder / "finetune.jsonl"
    with open(path, "w") as f:
        for name in FINETUNE_MODULES:
            source = inspect.getsource(importlib.import_module(name))
            for i in range(0, len(source) - seq_len, seq_len):
                f.write(json.dumps({"text": source[i : i + seq_len]}) + "\n")
    return TextDataModule(byte_tokenizer(), str(path), seq_len=seq_len, batch_size=batch, seed=0)


def run(args: argparse.Namespace, precision: str, data: TextDataModule, steps: int, warmup: int, lr: float,
        start: Path | None = None, save: Path | None = None) -> dict:
    """One training run of the benchmark's model; its curves and timings."""
    pl.seed_everything(0, verbose=False)
    config = model_config(args.model, **_shape_overrides(args))
    module = CausalLMModule(build_model(config, meta=True), lr=lr, warmup_steps=warmup)
    curves = Curves()
    trainer = pl.Trainer(strategy=SlideStrategy(**VARIANTS[precision]), accelerator="auto", devices=1,
                         precision="bf16-mixed" if torch.cuda.is_available() else "32-true", max_steps=steps,
                         val_check_interval=min(args.val_every, steps), limit_val_batches=args.val_batches,
                         num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False,
                         callbacks=[curves] + ([StartFrom(start)] if start is not None else []))
    started = time.perf_counter()
    trainer.fit(module, data)
    if save is not None:
        trainer.save_checkpoint(save)
    steady = curves.step_s[5:] or curves.step_s
    return {"precision": precision, "steps": len(curves.train), "wall_s": time.perf_counter() - started,
            "first_train_loss": curves.train[0], "final_train_loss": sum(curves.train[-20:]) / len(curves.train[-20:]),
            "final_val_loss": curves.val[-1][1] if curves.val else None, "step_s_mean": sum(steady) / len(steady),
            "train_loss": curves.train, "val_loss": curves.val,
            "engine": {k: v for k, v in trainer.strategy.engine.stats().items() if not isinstance(v, dict)}
            if trainer.strategy.engine is not None else None}


def _shape_overrides(args: argparse.Namespace) -> dict[str, object]:
    """The config fields the command line changes: fewer blocks, or a larger vocabulary tied to the head (the
    byte tokenizer then leaves most of its rows unused, as a subword vocabulary's rare tokens are)."""
    overrides: dict[str, object] = {"num_hidden_layers": args.layers} if args.layers else {}
    if args.vocab_size:
        overrides.update(vocab_size=args.vocab_size, tie_word_embeddings=True)
    return overrides


def quality(args: argparse.Namespace) -> None:
    out = Path(args.out)
    ckpt = Path(args.scratch) / "fp32-pretrained.ckpt"
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * GiB / total))
    pretrain = TextDataModule(byte_tokenizer(), None, seq_len=args.seq_len, batch_size=args.micro_batch, seed=0)
    finetune = finetune_data(ckpt.parent, args.seq_len, args.micro_batch)
    record = {**record_base(args), "model": args.model, "layers": args.layers, "vocab_size": args.vocab_size,
              "micro_batch": args.micro_batch,
              "seq_len": args.seq_len, "vram_cap_gib": args.cap_gib, "data": {
                  "pretrain": "the built-in corpus (lightning_slide.data.BUILTIN_MODULES), byte tokenizer, 5% held out",
                  "finetune": f"source of {list(FINETUNE_MODULES)}, {args.seq_len}-byte text records, 5% held out"},
              "pretrain": {}, "finetune": {}}
    precisions = record["precisions"] = ["fp32", *args.precisions]
    record["phases"] = args.phases
    for precision in precisions if "pretrain" in args.phases else ["fp32"]:  # fp32's run makes the checkpoint
        record["pretrain"][precision] = run(args, precision, pretrain, args.steps, 20, args.lr,
                                            save=ckpt if precision == "fp32" and "finetune" in args.phases else None)
        _write(out, record)
    for precision in precisions if "finetune" in args.phases else []:
        record["finetune"][precision] = run(args, precision, finetune, args.finetune_steps, 5, args.lr / 3,
                                            start=ckpt)
        _write(out, record)
    ckpt.unlink(missing_ok=True)
    record["summary"] = _summary(record)
    _write(out, record)
    _plot(record, out / _name(record, "png"))
    print(json.dumps(record["summary"], indent=2))


def _summary(record: dict) -> dict:
    """Each compact precision's final losses relative to fp32's in the same phase, and its step time's ratio."""
    summary = {}
    for phase in record["phases"]:
        base = record[phase]["fp32"]
        for precision in [p for p in record[phase] if p != "fp32"]:
            run_ = record[phase][precision]
            summary[f"{phase}/{precision}"] = {
                "train_loss_vs_fp32": run_["final_train_loss"] / base["final_train_loss"] - 1,
                "val_loss_vs_fp32": (run_["final_val_loss"] / base["final_val_loss"] - 1)
                if run_["final_val_loss"] and base["final_val_loss"] else None,
                "step_time_vs_fp32": run_["step_s_mean"] / base["step_s_mean"]}
    return summary


def _write(out: Path, record: dict) -> None:
    (out / _name(record, "json")).write_text(json.dumps(record, indent=1))


def _name(record: dict, suffix: str) -> str:
    """compact-quality-<the compact precisions>[-<phase>].<suffix>: one file per comparison."""
    phase = "" if len(record["phases"]) == 2 else f"-{record['phases'][0]}"
    return f"compact-quality-{'-'.join(record['precisions'][1:])}{phase}.{suffix}"


def _plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = record["phases"]
    fig, axes = plt.subplots(1, len(phases), figsize=(6.5 * len(phases), 4.5), squeeze=False)
    for ax, phase in zip(axes[0], phases):
        for precision, run_ in record[phase].items():
            losses = torch.tensor(run_["train_loss"])
            smooth = losses.unfold(0, 10, 1).mean(1) if len(losses) >= 10 else losses
            line, = ax.plot(range(len(smooth)), smooth.tolist(), label=f"{precision} train (mean of 10)", lw=1)
            if run_["val_loss"]:
                steps, values = zip(*run_["val_loss"])
                ax.plot(steps, values, "o--", color=line.get_color(), label=f"{precision} validation")
        ax.set(title=f"{phase}: {record['model']}, {record['micro_batch']}x{record['seq_len']} tokens/step",
               xlabel="optimizer step", ylabel="loss (nats/token)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ----------------------------------------------------------------------------------------------------- update
def _time_update(params: list[torch.nn.Parameter], optimizer: torch.optim.AdamW, grad: torch.Tensor, precision: str,
                 piece: int | None, threads: int | None, repeats: int, device: torch.device | None = None,
                 code_kernels: bool | None = None) -> dict:
    """Best and mean seconds of one unit's update (the first, warm-up, not counted); compact moments in pieces of
    `piece` elements over a pool of `threads` (fp32: one fused call with all intra-op threads), or on `device`
    (`device_update`: the master and moments copied up and back, the gradient already there)."""
    storage = UnitStorage(0, "block", params, {id(p): 0 for p in params})
    pieces, before = layer_adam.SCRATCH_ELEMS, torch.get_num_threads()
    layer_adam.SCRATCH_ELEMS = piece or pieces
    torch.set_num_threads(threads or before)  # what the pool's size is taken from
    try:
        moments = Moments([storage], {}, storage.trainable_numel, Failure(None), precision)
        updater = None if device is None else DeviceUpdater(device, moments.codecs, storage.trainable_numel,
                                                            LayerAdam.widen_elems(storage.trainable_numel, precision),
                                                            code_kernels)
        if updater is not None:
            updater.serve([storage], {storage.index})
        adam = LayerAdam([storage], moments, Failure(None), updater)
    finally:
        layer_adam.SCRATCH_ELEMS = pieces
        torch.set_num_threads(before)
    on_device = grad.to(device) if device is not None else None
    times = []
    for step in range(1, repeats + 2):
        plan = snapshot(optimizer, step, None)
        started = time.perf_counter()
        adam.schedule(0)
        adam.put(DeferredUpdate(0, plan, grad) if on_device is None else
                 DeviceGrad(0, on_device, None, plan, lambda event: None))
        adam.drain()
        times.append(time.perf_counter() - started)
    adam.stop()
    adam.close()
    storage.release()  # unlocked before its memory is freed: a later buffer may take the same addresses
    best = min(times[1:])
    return {"elements": storage.trainable_numel, "best_s": best, "mean_s": sum(times[1:]) / len(times[1:]),
            "gelem_per_s": storage.trainable_numel / best / 1e9}


def update(args: argparse.Namespace) -> None:
    """Layer-Adam over one unit of 8B block shapes, per precision and compact piece size."""
    g = torch.Generator().manual_seed(0)
    shapes = BLOCK_SHAPES if args.elements is None else ((args.elements,),)
    params = [torch.nn.Parameter(torch.randn(*s, generator=g) * 0.02) for s in shapes]
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    grad = torch.randn(sum(p.numel() for p in params), generator=g) * 1e-3
    results = []
    cases = [("fp32", None, None)] + [(p, piece, threads) for p in PRECISIONS if p != "fp32"
                                      for piece in args.pieces for threads in args.threads]
    for precision, piece, threads in cases:
        results.append({"precision": precision, "piece_elems": piece, "pool_threads": threads,
                        **_time_update(params, optimizer, grad, precision, piece, threads, args.repeats)})
        print(json.dumps(results[-1]), flush=True)
    if torch.cuda.is_available():  # compact moments coded by ops.moment_codes, and by the codec's torch ops
        for precision, kernels in [(p, k) for p in PRECISIONS[1:] for k in (True, False)]:
            results.append({"precision": precision, "on": "cuda", "code_kernels": kernels, **_time_update(
                params, optimizer, grad.to(torch.bfloat16), precision, None, None, args.repeats,
                torch.device("cuda"), kernels)})
            print(json.dumps(results[-1]), flush=True)
    record = {**record_base(args), "grad_dtype": "float32 (bf16 on the GPU, as a step's gradient is)",
              "results": results, "what": "one Layer-Adam update of the unit (decode, torch._fused_adamw_, encode) "
              "by the CPU pool, or on the GPU with the master and moments copied up and back; best of repeats"}
    (Path(args.out) / "compact-update.json").write_text(json.dumps(record, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["quality", "update"])
    parser.add_argument("--model", default="llama3_1b")
    parser.add_argument("--layers", type=int, default=None, help="fewer decoder blocks than the config's")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="quality: this vocabulary, tied to the head, instead of the config's")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--precisions", nargs="+", choices=list(VARIANTS)[1:], default=list(PRECISIONS[1:]),
                        help="quality: the compact precisions to run beside fp32 (one call of the GPU script "
                             "holds one at 500 steps)")
    parser.add_argument("--finetune-steps", type=int, default=100)
    parser.add_argument("--phases", nargs="+", choices=["pretrain", "finetune"], default=["pretrain", "finetune"],
                        help="quality: the phases to compare (fine-tuning alone still pretrains fp32 for --steps, "
                             "to continue from)")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--val-every", type=int, default=100)
    parser.add_argument("--val-batches", type=int, default=16)
    parser.add_argument("--cap-gib", type=float, default=24.0)
    parser.add_argument("--scratch", default="/tmp/lsbench-compact", help="where the fp32 checkpoint waits")
    parser.add_argument("--elements", type=int, default=None, help="update: one unit of this many (default: 8B block)")
    parser.add_argument("--threads", type=int, nargs="+", default=None,
                        help="update: pool sizes to try (default: 1, 2, 4, ... up to torch's thread count)")
    parser.add_argument("--pieces", type=int, nargs="+", default=[1 << 14, 1 << 16, 1 << 17, 1 << 18],
                        help="compact piece sizes to try, up to moment_codec.LARGEST_PIECE (bf16's noise table)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=".")
    parser.add_argument("--commit", default="unknown")
    args = parser.parse_args()
    if args.threads is None:
        most = torch.get_num_threads()
        args.threads = sorted({min(1 << i, most) for i in range(most.bit_length())})
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (quality if args.what == "quality" else update)(args)


if __name__ == "__main__":
    main()
