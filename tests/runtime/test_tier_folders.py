"""The disk tier's folders of runs that were killed outright are removed by the next run on the same
nvme_path; a folder that may belong to a live run is never touched."""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from pathlib import Path

import psutil

import lightning_slide.tiers as tiers
from lightning_slide.tiers import OWNER_FILE, TierDirectory, remove_stale_tier_folders
from tests.runtime.processes import killed, running

MIB = 1 << 20


def _tier_with_a_file(root: Path):
    """Child work: a disk tier with a 4 MiB preallocated file, reporting its folder, then training on (it
    holds the tier: returning would let the finalizer remove the folder)."""

    def work(report) -> None:
        directory = TierDirectory(str(root))
        directory.create("moments.bin", 4 * MIB)
        report(directory.path)
        threading.Event().wait()

    return work


def _folders(root: Path) -> set[str]:
    return {str(p) for p in root.iterdir()}


def test_a_killed_runs_folder_is_removed_by_the_next_run_and_live_runs_folders_are_kept(tmp_path, caplog):
    own = TierDirectory(str(tmp_path))
    with running(_tier_with_a_file(tmp_path)) as (_, alive):
        dead = killed(_tier_with_a_file(tmp_path))
        with caplog.at_level(logging.WARNING, logger=tiers.__name__):
            new = TierDirectory(str(tmp_path))
        assert _folders(tmp_path) == {own.path, alive, new.path}
    assert f"Removed {dead}" in caplog.text and "has ended" in caplog.text and "4.0 MiB freed" in caplog.text
    own.close()
    new.close()


def test_removing_stale_folders_reports_the_bytes_freed(tmp_path):
    dead = killed(_tier_with_a_file(tmp_path))
    assert remove_stale_tier_folders(str(tmp_path)) >= 4 * MIB
    assert not os.path.exists(dead)
    assert remove_stale_tier_folders(str(tmp_path / "missing")) == 0


def _folder_owned_by(root: Path, **owner) -> Path:
    folder = root / f"{tiers.TIER_PREFIX}test{len(os.listdir(root))}"
    folder.mkdir()
    (folder / OWNER_FILE).write_text(json.dumps(owner))
    return folder


def test_a_folder_whose_owner_cannot_be_checked_or_still_runs_is_kept(tmp_path):
    me = {"pid": os.getpid(), "host": socket.gethostname(), "started": psutil.Process().create_time()}
    ours = _folder_owned_by(tmp_path, **me)
    elsewhere = _folder_owned_by(tmp_path, **{**me, "host": "another-host", "pid": 1 << 30})
    assert remove_stale_tier_folders(str(tmp_path)) == 0
    assert ours.exists() and elsewhere.exists()


def test_a_folder_whose_owner_pid_now_belongs_to_a_later_process_is_removed(tmp_path):
    me = {"pid": os.getpid(), "host": socket.gethostname(), "started": psutil.Process().create_time() - 3600}
    reused = _folder_owned_by(tmp_path, **me)
    remove_stale_tier_folders(str(tmp_path))
    assert not reused.exists()


def _age(folder: Path, seconds: float) -> None:
    then = time.time() - seconds
    for path in [folder, *folder.iterdir()]:
        os.utime(path, (then, then))


def test_a_folder_without_an_owner_is_removed_only_when_old_and_no_process_has_its_files_open(tmp_path):
    legacy = tmp_path / f"{tiers.TIER_PREFIX}abcd1234"  # as earlier versions made them, with no owner file
    legacy.mkdir()
    (legacy / "moments-0001-layer.bin").write_bytes(b"\0" * 4096)
    remove_stale_tier_folders(str(tmp_path))
    assert legacy.exists()  # written just now: it may be a run making its folder
    _age(legacy, 2 * tiers.UNCLAIMED_GRACE_S)
    with open(legacy / "moments-0001-layer.bin", "rb"):
        remove_stale_tier_folders(str(tmp_path))
        assert legacy.exists()  # old, but a process (this one) has its file open
    assert remove_stale_tier_folders(str(tmp_path)) == 4096
    assert not legacy.exists()


def test_a_stale_folder_that_cannot_be_removed_is_named_with_the_space_it_holds(tmp_path, monkeypatch, caplog):
    dead = killed(_tier_with_a_file(tmp_path))

    def refused(path, onerror) -> None:
        onerror(os.unlink, os.path.join(path, "moments.bin"), (PermissionError, PermissionError("Permission denied"),
                                                              None))

    monkeypatch.setattr(tiers.shutil, "rmtree", refused)
    with caplog.at_level(logging.WARNING, logger=tiers.__name__):
        assert remove_stale_tier_folders(str(tmp_path)) == 0
    assert f"Could not remove {dead}" in caplog.text
    assert "4.0 MiB are still there" in caplog.text and "Permission denied" in caplog.text
    assert "Remove it by hand" in caplog.text


def test_the_owner_file_names_this_process(tmp_path):
    directory = TierDirectory(str(tmp_path))
    owner = json.loads(Path(directory.path, OWNER_FILE).read_text())
    assert owner == {"pid": os.getpid(), "host": socket.gethostname(), "started": psutil.Process().create_time()}
    directory.close()
    assert list(tmp_path.iterdir()) == []


def test_the_plan_of_a_disk_tier_run_sees_the_space_a_killed_runs_folder_held(tmp_path, monkeypatch):
    from torch.utils.data import DataLoader

    from lightning_slide import SlideStrategy
    from lightning_slide.planner import Resources
    from tests.runtime.helpers import CausalLM, tiny_model, token_batches, trainer

    stale = killed(_tier_with_a_file(tmp_path))
    seen: list[bool] = []
    probe = Resources.probe.__func__

    def recording(cls, *args, **kwargs):
        seen.append(os.path.exists(stale))
        return probe(cls, *args, **kwargs)

    monkeypatch.setattr(Resources, "probe", classmethod(recording))
    strategy = SlideStrategy(offload="nvme", nvme_path=str(tmp_path))
    trainer(strategy, 1).fit(CausalLM(tiny_model("llama")), DataLoader(token_batches(1), batch_size=None))
    assert seen and not any(seen)
