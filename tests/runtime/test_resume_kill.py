"""`python train.py` killed with SIGKILL mid-epoch, then resumed with `resume=<checkpoint>`, ends bit-equal to a run
that was never interrupted: data order, Adam state, LR schedule, clipping and dropout's RNG all carry over.

Epochs are cut to 7 batches (`limit_train_batches`) so that the resumed part crosses epoch boundaries too.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lightning_slide.data import byte_tokenizer
from lightning_slide.models import build_model, model_config

ROOT = Path(__file__).resolve().parents[2]
STEPS, EVERY, BATCH, EPOCH_BATCHES = 12, 2, 4, 7
SHORT_RUN = [
    f"trainer.max_steps={STEPS}", f"data.batch_size={BATCH}", "data.seq_len=32", "trainer.log_every_n_steps=1",
    f"+trainer.limit_train_batches={EPOCH_BATCHES}", "trainer.val_check_interval=5", "+trainer.limit_val_batches=1",
    "+trainer.enable_progress_bar=false", "checkpoint.monitor=null", "checkpoint.save_top_k=-1",
    f"+checkpoint.every_n_train_steps={EVERY}",
]
pytestmark = pytest.mark.slow


def start(run_dir: Path, overrides: list[str]) -> subprocess.Popen:
    """`python train.py` as a user starts it, its output in run_dir.log (a pipe could fill up and stall it)."""
    log = open(f"{run_dir}.log", "wb")  # noqa: SIM115 (the child holds it; closed by the caller's wait)
    cmd = [sys.executable, "train.py", "model=tiny", f"hydra.run.dir={run_dir}", *SHORT_RUN, *overrides]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})


def finish(process: subprocess.Popen, run_dir: Path) -> Path:
    """Waits for a run to end by itself; its checkpoint of the last step."""
    assert process.wait(timeout=300) == 0, Path(f"{run_dir}.log").read_text()[-3000:]
    return step_checkpoint(run_dir, STEPS)


def kill_after_checkpoint(process: subprocess.Popen, run_dir: Path, step: int) -> Path:
    """SIGKILLs the run as soon as its checkpoint of `step` exists (files appear complete: written, then renamed)."""
    deadline = time.monotonic() + 300
    while not (found := list((run_dir / "checkpoints").glob(f"epoch=*-step={step}.ckpt"))):
        assert process.poll() is None, Path(f"{run_dir}.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint within 300 s"
        time.sleep(0.005)
    os.kill(process.pid, signal.SIGKILL)
    assert process.wait() == -signal.SIGKILL
    assert not list((run_dir / "checkpoints").glob(f"epoch=*-step={STEPS}.ckpt")), "killed only after the last step"
    return found[0]


def step_checkpoint(run_dir: Path, step: int) -> Path:
    (path,) = (run_dir / "checkpoints").glob(f"epoch=*-step={step}.ckpt")
    return path


def assert_bit_equal(resumed: object, straight: object, where: str = "checkpoint") -> None:
    """Every tensor and number of `resumed` equals `straight`'s exactly, at every nesting level."""
    if isinstance(straight, torch.Tensor):
        same = torch.equal(resumed, straight)
        assert same, f"{where} differs"
    elif isinstance(straight, dict):
        assert resumed.keys() == straight.keys(), where
        for key in straight:
            assert_bit_equal(resumed[key], straight[key], f"{where}[{key!r}]")
    elif isinstance(straight, (list, tuple)):
        assert len(resumed) == len(straight), where
        for i, (r, s) in enumerate(zip(resumed, straight)):
            assert_bit_equal(r, s, f"{where}[{i}]")
    else:
        assert resumed == straight, where


def kill_and_resume_matches_uninterrupted(tmp_path: Path, overrides: list[str]) -> None:
    """The uninterrupted run and the one to be killed start together; the killed one resumes in a new process."""
    straight, killed = start(tmp_path / "straight", overrides), start(tmp_path / "killed", overrides)
    interrupted = kill_after_checkpoint(killed, tmp_path / "killed", EVERY)
    mid_epoch = torch.load(interrupted, weights_only=True)["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert len(mid_epoch) == 1 and 0 < mid_epoch[0]["samples"] < EPOCH_BATCHES * BATCH
    resumed = start(tmp_path / "resumed", [*overrides, f"resume='{interrupted}'"])  # quoted: the name has '='s
    final, expected = finish(resumed, tmp_path / "resumed"), finish(straight, tmp_path / "straight")
    final, expected = torch.load(final, weights_only=True), torch.load(expected, weights_only=True)
    for key in ("state_dict", "optimizer_states", "lr_schedulers", "rng_states"):
        assert_bit_equal(final[key], expected[key], key)
    assert final["loops"]["fit_loop"]["state_dict"] == expected["loops"]["fit_loop"]["state_dict"]


def test_plain_run_resumes_exactly(tmp_path):
    """The RAM tier, gradient clipping at 1.0 and warmup + cosine LR, as configured by default."""
    kill_and_resume_matches_uninterrupted(tmp_path, [])


def test_run_with_accumulation_loader_workers_and_dropout_resumes_exactly(tmp_path):
    """A local model folder whose config has attention dropout (the global RNG state is in the checkpoint), two
    batches per step, and workers that prefetch batches ahead of the step: those must not count as trained on."""
    pretrained = tmp_path / "pretrained"
    build_model(model_config("tiny", attention_dropout=0.25)).save_pretrained(pretrained)
    byte_tokenizer().save_pretrained(pretrained)
    kill_and_resume_matches_uninterrupted(tmp_path, [f"model.pretrained={pretrained}", "data.num_workers=2",
                                                     "trainer.accumulate_grad_batches=2"])


def test_disk_tier_run_resumes_exactly(tmp_path):
    kill_and_resume_matches_uninterrupted(tmp_path, ["offload=nvme", f"offload.nvme_path={tmp_path / 'nvme'}",
                                                     "offload.nvme_moments=0.5"])
