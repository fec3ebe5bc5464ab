"""Checkpoint files: one full file per save, written from the flat host storage and mapped back on load;
last.ckpt a link that never falls behind; a disk that cannot take a save is named; killed saves leave
nothing behind."""

from __future__ import annotations

import copy
import errno
import os
import pickle
import socket
import threading
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch
from lightning.pytorch import Callback
from torch.utils.data import DataLoader

import lightning_slide.checkpoint_io as checkpoint_io
from lightning_slide import SlideStrategy
from lightning_slide.checkpoint_io import AtomicCheckpointIO, CheckpointDiskError, LinkedLastCheckpoint
from tests.runtime.helpers import CausalLM, relative_difference, tiny_model, token_batches, trainer
from tests.runtime.processes import killed

MEASURED = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, vocab_size=4096)  # 6.0M parameters


def _anon_rss() -> int:
    """Resident memory that is not a file's pages (mapped disk-tier files are read through the page cache)."""
    info = psutil.Process().memory_info()
    return info.rss - info.shared


def _peak_anon_growth(action) -> int:
    """How far anonymous RSS rose above its start while `action` ran (sampled every millisecond)."""
    start, peak, done = _anon_rss(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _anon_rss() - start)
            done.wait(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        action()
    finally:
        done.set()
        sampler.join()
    return peak[0]


@pytest.mark.parametrize("tier", [{}, {"offload": "nvme", "nvme_moments": 1.0},
                                  {"offload": "nvme", "nvme_moments": 1.0, "nvme_master": True}],
                         ids=["ram", "moments-on-disk", "master-and-moments-on-disk"])
def test_a_save_writes_twelve_bytes_per_parameter_straight_from_the_flat_storage(tier, tmp_path):
    """fp32 master + exp_avg + exp_avg_sq, each written once, and no second copy of them in RAM."""
    module = CausalLM(tiny_model("llama", **MEASURED))
    params = sum(p.numel() for p in module.parameters())
    strategy = SlideStrategy(**tier, **({"nvme_path": str(tmp_path / "nvme")} if tier else {}))
    run = trainer(strategy, 1, default_root_dir=tmp_path)
    run.fit(module, DataLoader(token_batches(1), batch_size=None))
    path = tmp_path / "state.ckpt"
    growth = _peak_anon_growth(lambda: run.save_checkpoint(path))
    size = path.stat().st_size
    assert size == pytest.approx(12 * params, rel=0.02)
    assert growth < 0.05 * size


def test_a_view_is_written_as_the_bytes_it_covers_and_views_that_overlap_still_share_when_loaded(tmp_path):
    flat = torch.arange(100_000, dtype=torch.float32)
    state = {"a": flat[1000:2000], "tied": flat[1000:2000], "inside": flat[1500:1510].view(2, 5),
             "apart": flat[50_000:50_100]}
    path = tmp_path / "views.ckpt"
    AtomicCheckpointIO().save_checkpoint(state, path)
    assert path.stat().st_size < 4 * 1100 + 4096  # the 1100 viewed floats, not the 100,000 of the buffer
    loaded = AtomicCheckpointIO().load_checkpoint(path)
    for name, tensor in state.items():
        assert torch.equal(loaded[name], tensor)
    loaded["a"][500] = -1.0
    assert loaded["tied"][500] == -1.0 and loaded["inside"][0, 0] == -1.0
    assert flat[1500] == 1500.0  # the save shared the buffer's memory and did not change it


def _mapped_files(tensor: torch.Tensor) -> set[str]:
    """The files whose mappings in this process hold `tensor`'s first byte."""
    address = tensor.data_ptr()
    files = set()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        start, stop = (int(x, 16) for x in fields[0].split("-"))
        if start <= address < stop and len(fields) == 6:
            files.add(fields[5])
    return files


def test_a_load_maps_the_tensors_from_the_file(tmp_path):
    path = tmp_path / "state.ckpt"
    AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.randn(256, 1024)}}, path)
    loaded = AtomicCheckpointIO().load_checkpoint(path)
    assert _mapped_files(loaded["state_dict"]["w"]) == {str(path)}


class _Payload:
    def __reduce__(self):
        return (print, ("unpickled code ran",))


def test_a_load_refuses_pickled_objects_that_are_not_tensors_or_plain_data(tmp_path):
    path = tmp_path / "untrusted.ckpt"
    torch.save({"state_dict": {}, "hook": _Payload()}, path)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        AtomicCheckpointIO().load_checkpoint(path)


def _stalled_save(folder: Path):
    """Child work: a save whose writer has written part of the file and then hangs, reporting the temporary."""

    def work(report) -> None:
        def stalled(obj, f) -> None:
            f.write(b"x" * 65536)
            f.flush()
            report(f.name)
            threading.Event().wait()

        checkpoint_io.torch.save = stalled  # only in the child: it was forked with its own copy of the module
        AtomicCheckpointIO().save_checkpoint({"w": torch.zeros(4)}, folder / "epoch=0-step=24.ckpt")

    return work


def test_the_temporary_of_a_killed_save_is_removed_by_the_next_save_into_its_folder(tmp_path):
    temporary = Path(killed(_stalled_save(tmp_path)))
    assert temporary.name.startswith("epoch=0-step=24.ckpt.tmp-") and temporary.exists()
    AtomicCheckpointIO().save_checkpoint({"w": torch.ones(4)}, tmp_path / "epoch=0-step=36.ckpt")
    assert sorted(os.listdir(tmp_path)) == ["epoch=0-step=36.ckpt"]


def test_temporaries_that_may_belong_to_a_running_save_are_kept(tmp_path):
    own = f"a.ckpt.tmp-{os.getpid()}@{socket.gethostname()}"  # a save of this very process
    legacy = f"b.ckpt.tmp-{os.getpid()}"  # the name without a host that earlier versions wrote
    elsewhere = "c.ckpt.tmp-1@another-host"  # its process cannot be checked from here
    for name in (own, legacy, elsewhere):
        (tmp_path / name).write_bytes(b"partial")
    AtomicCheckpointIO().save_checkpoint({"w": torch.ones(4)}, tmp_path / "d.ckpt")
    assert sorted(os.listdir(tmp_path)) == sorted([own, legacy, elsewhere, "d.ckpt"])


def test_a_temporary_whose_pid_was_reused_by_a_later_process_is_removed(tmp_path):
    stale = tmp_path / f"a.ckpt.tmp-{os.getpid()}@{socket.gethostname()}"
    stale.write_bytes(b"partial")
    written = psutil.Process().create_time() - 3600  # written an hour before this process started
    os.utime(stale, (written, written))
    AtomicCheckpointIO().save_checkpoint({"w": torch.ones(4)}, tmp_path / "b.ckpt")
    assert sorted(os.listdir(tmp_path)) == ["b.ckpt"]


def test_a_save_the_disk_cannot_hold_is_refused_before_writing_naming_the_folder_and_what_to_change(
        tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint_io.shutil, "disk_usage",
                        lambda path: SimpleNamespace(total=1 << 40, used=1 << 40, free=1000))
    state = {"w": torch.zeros(1 << 20)}  # 4 MiB
    with pytest.raises(CheckpointDiskError, match=(
            rf"(?s)Not enough free space for the checkpoint {tmp_path}/last.ckpt: it needs .* GiB \((\d+) bytes\), "
            rf".* GiB \(1000 bytes\) are free in {tmp_path}\..*checkpoint.dirpath.*checkpoint.save_top_k")) as error:
        AtomicCheckpointIO().save_checkpoint(state, tmp_path / "last.ckpt")
    assert error.value.errno == errno.ENOSPC
    assert int(str(error.value).split("(")[1].split(" bytes")[0]) >= 4 << 20
    assert os.listdir(tmp_path) == []


class _FillsUp:
    """A file object that takes `room` bytes and then fails as a full disk does."""

    def __init__(self, f, room: int) -> None:
        self.f, self.room = f, room

    def write(self, data) -> int:
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def test_a_disk_that_fills_up_while_saving_names_the_path_and_the_os_error_and_leaves_no_temporary(
        tmp_path, monkeypatch):
    save = torch.save
    monkeypatch.setattr(checkpoint_io.torch, "save", lambda obj, f: save(obj, _FillsUp(f, 4096)))
    path = tmp_path / "epoch=0-step=24.ckpt"
    with pytest.raises(CheckpointDiskError) as error:
        AtomicCheckpointIO().save_checkpoint({"w": torch.zeros(1 << 16)}, path)
    message = str(error.value)
    assert error.value.errno == errno.ENOSPC
    assert f"Could not write the checkpoint {path}" in message and "No space left on device" in message
    assert "free in" in message and "checkpoint.dirpath" in message and "enforce fail" not in message
    assert os.listdir(tmp_path) == []


class _ScriptedValidation(CausalLM):
    """Logs the val_loss that the test chose for each global step: whether a validation improves is known."""

    def __init__(self, model: torch.nn.Module, val_loss: dict[int, float]) -> None:
        super().__init__(model)
        self.val_loss = val_loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", self.val_loss[self.trainer.global_step])


def _entry(path: Path) -> str:
    """`-> target` for a link, `step N` for a file (the step it holds)."""
    if path.is_symlink():
        return f"-> {os.readlink(path)}"
    return f"step {torch.load(path, weights_only=True, mmap=True)['global_step']}"


def _layout(folder: Path) -> dict[str, str]:
    return {p.name: _entry(p) for p in sorted(folder.iterdir())}


class _Layouts(Callback):
    """The checkpoint folder as each epoch's validation left it, by step (seen as the next epoch starts:
    Lightning runs checkpoint callbacks after all others)."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.seen = folder, {}

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if trainer.global_step:
            self.seen[trainer.global_step] = _layout(self.folder)


def _fit_with_checkpoints(module: CausalLM, folder: Path, steps: int, callbacks=(), ckpt_path=None) -> None:
    """Two batches per epoch, a validation at each epoch's end (steps 2, 4, 6, ...)."""
    checkpoints = LinkedLastCheckpoint(folder, monitor="val_loss", save_top_k=1, save_last="link")
    run = trainer("slideformer", steps, default_root_dir=folder.parent, enable_checkpointing=True,
                  callbacks=[checkpoints, *callbacks], limit_val_batches=1)
    batches = token_batches(2)
    run.fit(module, DataLoader(batches, batch_size=None), DataLoader(batches[:1], batch_size=None),
            ckpt_path=ckpt_path)


@pytest.fixture
def full_writes(monkeypatch) -> list[tuple[int, str]]:
    """(global step, file name) of every full checkpoint file written."""
    writes, save = [], AtomicCheckpointIO.save_checkpoint

    def recorded(self, checkpoint, path, storage_options=None):
        writes.append((checkpoint["global_step"], os.path.basename(path)))
        save(self, checkpoint, path, storage_options)

    monkeypatch.setattr(AtomicCheckpointIO, "save_checkpoint", recorded)
    return writes


def test_last_links_to_its_validations_file_or_is_that_steps_only_file_when_val_loss_did_not_improve(
        tmp_path, full_writes):
    folder = tmp_path / "checkpoints"
    layouts = _Layouts(folder)
    module = _ScriptedValidation(tiny_model("llama"), {2: 1.0, 4: 2.0, 6: 0.5})
    _fit_with_checkpoints(module, folder, 6, [layouts])
    assert layouts.seen == {
        2: {"epoch=0-step=2.ckpt": "step 2", "last.ckpt": "-> epoch=0-step=2.ckpt"},
        4: {"epoch=0-step=2.ckpt": "step 2", "last.ckpt": "step 4"},  # no better: the best stays, last is new
    }
    assert _layout(folder) == {"epoch=2-step=6.ckpt": "step 6", "last.ckpt": "-> epoch=2-step=6.ckpt"}
    assert full_writes == [(2, "epoch=0-step=2.ckpt"), (4, "last.ckpt"), (6, "epoch=2-step=6.ckpt")]
    assert max(Counter(step for step, _ in full_writes).values()) == 1  # never two full files for one step


def test_a_run_resumed_from_the_last_link_continues_exactly_and_keeps_last_current(tmp_path):
    val_loss = {2: 1.0, 4: 0.5, 6: 3.0, 8: 4.0}  # last.ckpt is a link at step 4; later steps do not improve
    model = tiny_model("llama")
    straight = _ScriptedValidation(copy.deepcopy(model), val_loss)
    _fit_with_checkpoints(straight, tmp_path / "straight", 8)
    folder = tmp_path / "checkpoints"
    _fit_with_checkpoints(_ScriptedValidation(copy.deepcopy(model), val_loss), folder, 4)
    assert (folder / "last.ckpt").is_symlink()
    resumed = _ScriptedValidation(tiny_model("llama", seed=123), val_loss)  # everything must come from the file
    layouts = _Layouts(folder)
    _fit_with_checkpoints(resumed, folder, 8, [layouts], ckpt_path=str(folder / "last.ckpt"))
    assert relative_difference(straight.model, resumed.model) <= 1e-6
    assert layouts.seen[6] == {"epoch=1-step=4.ckpt": "step 4", "last.ckpt": "step 6"}
    assert _layout(folder) == {"epoch=1-step=4.ckpt": "step 4", "last.ckpt": "step 8"}


def test_a_resumed_fit_that_ends_before_its_first_validation_leaves_last_at_its_last_step(tmp_path):
    """Validations every 2 steps; the first fit stops at 4 (last.ckpt links to step 4's file), the resumed one at 5,
    before its first validation: last.ckpt holds step 5 (Lightning's own would still point to step 4)."""
    folder, batches = tmp_path / "checkpoints", token_batches(8)

    def fit_to(steps: int, ckpt_path: str | None = None) -> None:
        checkpoints = LinkedLastCheckpoint(folder, monitor="val_loss", save_top_k=1, save_last="link")
        run = trainer("slideformer", steps, enable_checkpointing=True, callbacks=[checkpoints], limit_val_batches=1,
                      val_check_interval=2, check_val_every_n_epoch=None)
        run.fit(_ScriptedValidation(tiny_model("llama"), {2: 1.0, 4: 0.5}), DataLoader(batches, batch_size=None),
                DataLoader(batches[:1], batch_size=None), ckpt_path=ckpt_path)

    fit_to(4)
    assert _layout(folder) == {"epoch=0-step=4.ckpt": "step 4", "last.ckpt": "-> epoch=0-step=4.ckpt"}
    fit_to(5, str(folder / "last.ckpt"))
    assert _layout(folder) == {"epoch=0-step=4.ckpt": "step 4", "last.ckpt": "step 5"}


def test_train_py_writes_checkpoints_to_checkpoint_dirpath_with_last_a_link(tmp_path):
    import runpy

    from hydra import compose, initialize_config_dir

    root = Path(__file__).resolve().parents[2]
    train = runpy.run_path(str(root / "train.py"))["train"]  # registers the config nodes train.yaml composes
    with initialize_config_dir(config_dir=str(root / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=[f"checkpoint.dirpath={tmp_path / 'elsewhere'}", "trainer.max_steps=2",
                                          "trainer.val_check_interval=2", "+trainer.limit_val_batches=1"])
    train(cfg, tmp_path / "run")
    assert _layout(tmp_path / "elsewhere") == {"epoch=0-step=2.ckpt": "step 2", "last.ckpt": "-> epoch=0-step=2.ckpt"}
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_best_file_is_removed_only_once_last_links_to_the_newer_one(tmp_path, monkeypatch):
    """A crash between the two leaves a last.ckpt to resume from (Lightning removes first, then relinks)."""
    folder, seen = tmp_path / "checkpoints", []
    remove = AtomicCheckpointIO.remove_checkpoint

    def recorded(self, path) -> None:
        seen.append((os.path.basename(path), os.readlink(folder / "last.ckpt")))
        remove(self, path)

    monkeypatch.setattr(AtomicCheckpointIO, "remove_checkpoint", recorded)
    _fit_with_checkpoints(_ScriptedValidation(tiny_model("llama"), {2: 1.0, 4: 0.5}), folder, 4)
    assert seen == [("epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt")]
