"""A background worker that stops making progress stops fit with its stack; Ctrl-C ends a run within seconds."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

import lightning_slide.layer_adam as layer_adam
import lightning_slide.threads as threads
import lightning_slide.tiers as tiers
from lightning_slide import SlideStrategy
from lightning_slide.threads import Failure, Worker, WorkerStalled
from tests.runtime.helpers import CausalLM, tiny_model, token_batches, trainer

ROOT = Path(__file__).resolve().parents[2]
LIMIT_S = 1.0


@pytest.fixture
def gate():
    """What a stalled call blocks on; opened after the test so that the abandoned thread can end."""
    event = threading.Event()
    yield event
    event.set()


def _fit(strategy: SlideStrategy, steps: int = 2) -> None:
    trainer(strategy, steps).fit(CausalLM(tiny_model()), DataLoader(token_batches(steps), batch_size=None))


def test_an_optimizer_step_that_never_returns_stops_fit_naming_the_thread_and_its_stack(monkeypatch, gate, deadline):
    def adam_that_never_returns(*args, **kwargs):
        gate.wait()

    monkeypatch.setattr(layer_adam, "adam_", adam_that_never_returns)
    start = time.perf_counter()
    with pytest.raises(WorkerStalled, match=r"(?s)no background worker made progress.*stall_timeout_s=1\.0.*"
                                            r"slideformer-layer-adam has been on (GradChunk|DeferredUpdate)\(unit=.*"
                                            r"in adam_that_never_returns\n\s+gate\.wait\(\)"):
        _fit(SlideStrategy(stall_timeout_s=LIMIT_S))
    assert time.perf_counter() - start < 20


def test_a_disk_read_that_never_returns_stops_fit_naming_the_reader(monkeypatch, gate, deadline, tmp_path):
    def read_that_never_returns(self, dst, offset):
        gate.wait()

    monkeypatch.setattr(tiers.DiskFile, "read", read_that_never_returns)
    strategy = SlideStrategy(offload="nvme", nvme_path=str(tmp_path), nvme_moments=1.0, stall_timeout_s=LIMIT_S)
    with pytest.raises(WorkerStalled, match=r"(?s)slideformer-Adam state-reader has been on \(\d+, \d+\) for .*"
                                            r"in read_that_never_returns.*"
                                            r"slideformer-layer-adam waits for Adam state read of"):
        _fit(strategy, steps=3)
    assert not list(tmp_path.glob("lightning-slide-*")), "the disk tier's files were left behind"


def test_a_slow_worker_that_keeps_finishing_items_does_not_trip_the_watchdog(monkeypatch, deadline):
    real, calls, delay = layer_adam.adam_, [], 0.4 * LIMIT_S

    def slow_adam(*args, **kwargs):
        calls.append(time.sleep(delay))
        real(*args, **kwargs)

    monkeypatch.setattr(layer_adam, "adam_", slow_adam)
    steps = 2
    _fit(SlideStrategy(stall_timeout_s=LIMIT_S), steps)
    assert len(calls) * delay > steps * LIMIT_S  # each step's updates took longer than the limit, item by item


def test_the_automatic_stall_limit_is_the_floor_until_the_longest_item_scales_it(monkeypatch):
    failure = Failure()
    assert failure.stall_limit_s == threads.STALL_FLOOR_S
    worker: Worker[float] = Worker("sleeper", time.sleep, failure)
    worker.put(0.2)
    failure.wait(worker.idle, "the sleeper")
    worker.stop()
    assert failure.stall_limit_s == threads.STALL_FLOOR_S
    monkeypatch.setattr(threads, "STALL_FLOOR_S", 0.1)
    assert threads.STALL_ITEMS * 0.2 <= failure.stall_limit_s < threads.STALL_ITEMS * 0.3


@pytest.mark.parametrize("value", [0, -5.0, True, "soon"])
def test_a_stall_timeout_that_is_not_a_positive_number_is_refused_by_name(value):
    with pytest.raises(ValueError, match="stall_timeout_s.*positive number of seconds"):
        SlideStrategy(stall_timeout_s=value)


CHILD = textwrap.dedent("""
    import signal, sys, threading
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from torch.utils.data import DataLoader
    import lightning_slide.layer_adam as layer_adam
    from lightning_slide import SlideStrategy
    from tests.runtime.helpers import CausalLM, tiny_model, token_batches, trainer

    real, stalled = layer_adam.adam_, threading.Event()

    def adam_(*args, **kwargs):
        if stalled.is_set():
            print("stalled", flush=True)
            threading.Event().wait()
        real(*args, **kwargs)

    class StallInTheThirdStep(Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if batch_idx == 2:
                stalled.set()

    layer_adam.adam_ = adam_
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as at a terminal, also when started in the background
    nvme, checkpoints = sys.argv[1:]
    strategy = SlideStrategy(offload="nvme", nvme_path=nvme, nvme_moments=1.0, stall_timeout_s=600)
    callbacks = [ModelCheckpoint(checkpoints, every_n_train_steps=1, save_top_k=-1), StallInTheThirdStep()]
    trainer(strategy, 4, enable_checkpointing=True, callbacks=callbacks).fit(
        CausalLM(tiny_model()), DataLoader(token_batches(4), batch_size=None))
""")


def test_ctrl_c_during_a_stall_ends_the_run_within_seconds_keeping_the_checkpoint(tmp_path, deadline):
    nvme, checkpoints = tmp_path / "nvme", tmp_path / "checkpoints"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(nvme), str(checkpoints)], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output = []
        while not output or output[-1].strip() != "stalled":
            line = child.stdout.readline()
            assert line, "the run ended before it stalled:\n" + "".join(output)
            output.append(line)
        time.sleep(0.5)  # the training loop is now waiting for the stalled optimizer
        child.send_signal(signal.SIGINT)
        start = time.perf_counter()
        rest, _ = child.communicate(timeout=30)
        took = time.perf_counter() - start
    finally:
        child.kill()
    assert took < 12, f"Ctrl-C took {took:.1f} s to end the run:\n{rest}"
    assert child.returncode != 0 and "KeyboardInterrupt" in rest
    saved = sorted(p.name for p in checkpoints.iterdir())
    assert saved == ["epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt"], saved
    last = torch.load(checkpoints / saved[-1], weights_only=False)
    assert last["global_step"] == 2 and last["optimizer_states"][0]["state"]
    assert not list(nvme.glob("lightning-slide-*")), "the disk tier's files were left behind"
