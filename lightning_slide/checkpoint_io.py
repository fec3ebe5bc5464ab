"""Checkpoint files: one full file per save, written straight from the flat host storage, read back mapped.

`AtomicCheckpointIO` is the strategy's `CheckpointIO`. A save checks the free space first, writes a
temporary file beside the target and renames it into place, so a crash never leaves a torn checkpoint;
the temporaries of saves that were killed (their process is gone) are removed by the next save into the
folder. The tensors are written from the engine's flat buffers: the module's parameters and the Adam
moments are views into them, and torch.save writes each storage it meets whole and once, so views are
first given storages that span exactly the bytes they cover (no copy: see `exact_storages`). A load maps
the file (`torch.load(mmap=True)`) and the strategy copies the mapped tensors straight into the flat
storage: no second copy of the model in RAM on either side.

`LinkedLastCheckpoint` is Lightning's `ModelCheckpoint` whose `save_last="link"` never leaves last.ckpt
pointing at an older state than the newest one.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import socket
import zipfile
from collections.abc import Callable
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_utilities import apply_to_collection

from lightning_slide.tiers import process_alive

#: What a save needs besides the tensors' bytes: the pickled structure and zip records (generous).
OVERHEAD_BYTES, OVERHEAD_PER_TENSOR = 1 << 20, 1024
_TEMPORARY = re.compile(r"\.tmp-(?P<pid>\d+)(?:@(?P<host>.+))?$")  # `<target>.tmp-<pid>[@<host>]`
_REMEDY = ("Point checkpoint.dirpath (or the run folder, hydra.run.dir) at a disk with room, free space there, "
           "or keep fewer checkpoints (a smaller checkpoint.save_top_k).")


class CheckpointDiskError(OSError):
    """A checkpoint cannot be written where it was asked to go (no room, or the OS refused the write)."""


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def _tensors(collection: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    apply_to_collection(collection, torch.Tensor, found.append)
    return found


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


def _storage_range(t: torch.Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.data_ptr() + storage.nbytes()


def _clusters(tensors: list[torch.Tensor], span: Callable[[torch.Tensor], tuple[int, int]],
              touching: bool) -> list[list[torch.Tensor]]:
    """Tensors grouped by overlapping `span`s (also touching ones if `touching`), in address order."""
    groups: list[list[torch.Tensor]] = []
    end = -1
    for t in sorted(tensors, key=lambda t: span(t)[0]):
        start, stop = span(t)
        if groups and (start < end or (touching and start == end)):
            groups[-1].append(t)
            end = max(end, stop)
        else:
            groups.append([t])
            end = stop
    return groups


def _rebase(block: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """The block's tensors as views of one storage of exactly their joint bytes, sharing their memory.

    Nothing is returned when their storage already is exactly that, or when no single storage holds the
    whole range (then torch.save writes them as they are).
    """
    start = min(_byte_range(t)[0] for t in block)
    stop = max(_byte_range(t)[1] for t in block)
    if all(_storage_range(t) == (start, stop) for t in block):
        return {}
    host = next((t for t in block if _storage_range(t)[0] <= start and stop <= _storage_range(t)[1]), None)
    if host is None or any((t.data_ptr() - start) % t.element_size() for t in block):
        return {}
    first = _storage_range(host)[0]
    raw = torch.empty(0, dtype=torch.uint8).set_(host.untyped_storage())
    exact = torch.from_numpy(raw[start - first : stop - first].numpy()).untyped_storage()
    return {id(t): torch.empty(0, dtype=t.dtype).set_(exact, (t.data_ptr() - start) // t.element_size(), t.shape,
                                                     t.stride()) for t in block}


def exact_storages(checkpoint: Any) -> Any:
    """The checkpoint with its host tensors re-based onto storages that hold exactly the bytes they view.

    torch.save writes the whole storage of every tensor it meets, once per storage object. The engine's
    tensors are views into flat per-unit buffers; where the checkpoint does not view a whole buffer, that
    writes bytes nobody asked for. With `nvme_master` it would write the master twice: a unit's file is
    mapped once for its master and once for its moments, and the moments' mapping starts with the master
    (16 instead of 12 bytes per parameter). Re-based tensors share the original memory (a numpy view, no
    copy); views of one dtype that overlap or touch share one storage, as before, and share it again when
    loaded. Views of one buffer in different dtypes (8-bit moments: codes, then fp32 scales) get a storage each,
    since torch.save refuses one storage seen as two types.
    """
    tensors = [t for t in _tensors(checkpoint) if t.device.type == "cpu" and t.layout == torch.strided
               and not t.requires_grad and t.numel() and t.is_contiguous()]
    replaced: dict[int, torch.Tensor] = {}
    for same_memory in _clusters(tensors, _storage_range, touching=False):
        for dtype in {t.dtype for t in same_memory}:  # torch.save keeps one dtype per storage
            for block in _clusters([t for t in same_memory if t.dtype == dtype], _byte_range, touching=True):
                replaced.update(_rebase(block))
    if not replaced:
        return checkpoint
    return apply_to_collection(checkpoint, torch.Tensor, lambda t: replaced.get(id(t), t))


def tensor_bytes(checkpoint: Any) -> int:
    """The tensor data torch.save writes for `checkpoint`: each distinct storage's bytes, once."""
    storages = {_storage_range(t): t.untyped_storage().nbytes() for t in _tensors(checkpoint)}
    return sum(storages.values())


def remove_stale_temporaries(folder: str) -> list[str]:
    """Remove the temporaries of saves into `folder` whose process is gone (killed mid-write); their paths.

    A temporary is `<target>.tmp-<pid>@<host>`: one of this host whose pid is not running, or is running
    but started after the file was last written (the pid was reused), is left over.
    """
    removed = []
    with os.scandir(folder) as entries:
        for entry in entries:
            match = _TEMPORARY.search(entry.name)
            if match is None or entry.is_dir(follow_symlinks=False):  # files, and links of `_replace_with_link`
                continue
            if process_alive(int(match["pid"]), match["host"], entry.stat(follow_symlinks=False).st_mtime):
                continue
            _remove_if_there(entry.path)  # (another save may have removed it first)
            removed.append(entry.path)
    return removed


def check_free_space(folder: str, nbytes: int, path: str) -> None:
    """Refuse a save of `nbytes` into `folder` that the disk cannot hold, before anything is written."""
    free = shutil.disk_usage(folder).free
    if nbytes > free:
        raise CheckpointDiskError(errno.ENOSPC, f"Not enough free space for the checkpoint {path}: it needs "
                                  f"{_gib(nbytes)} ({nbytes} bytes), {_gib(free)} ({free} bytes) are free in "
                                  f"{folder}. {_REMEDY}")


def _os_error(error: BaseException) -> OSError | None:
    """The OSError behind an error of torch.save (its zip writer reports a failed write as a RuntimeError)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def _temporary(path: str) -> str:
    """Where `path` is written before the rename that puts it in place: this process's, named as `_TEMPORARY`
    reads it."""
    return f"{path}.tmp-{os.getpid()}@{socket.gethostname()}"


def _remove_if_there(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)


def _fsync_folder(folder: str) -> None:
    """Make the rename durable: a power loss after the save returns still finds the new file (best effort:
    some filesystems cannot sync a folder, and the file itself is already synced)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Checks the room first, writes a temporary file and renames it into place (a crash never leaves a torn
    checkpoint, and the next save removes a killed save's temporary); loads map the file."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options (got {storage_options!r}).")
        path = os.fspath(path)
        folder = os.path.dirname(path) or "."
        os.makedirs(folder, exist_ok=True)
        remove_stale_temporaries(folder)
        checkpoint = exact_storages(checkpoint)
        needed = tensor_bytes(checkpoint) + OVERHEAD_BYTES + OVERHEAD_PER_TENSOR * len(_tensors(checkpoint))
        check_free_space(folder, needed, path)
        tmp = _temporary(path)
        try:
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            _fsync_folder(folder)
        except (OSError, RuntimeError) as error:
            cause = _os_error(error)
            if cause is None:
                raise
            _remove_if_there(tmp)  # before the error measures the free space
            raise self._write_error(cause, path, tmp, folder, needed) from error
        finally:
            _remove_if_there(tmp)

    @staticmethod
    def _write_error(cause: OSError, path: str, tmp: str, folder: str, needed: int) -> CheckpointDiskError:
        message = f"Could not write the checkpoint {path} (writing {tmp}): {cause.strerror or cause}."
        if cause.errno in (errno.ENOSPC, errno.EDQUOT):
            message += (f" It needs {_gib(needed)}, {_gib(shutil.disk_usage(folder).free)} are free in {folder} "
                        f"now that the partial file is removed. {_REMEDY}")
        return CheckpointDiskError(cause.errno or errno.EIO, message)

    def load_checkpoint(self, path: _PATH, map_location: Any = lambda storage, loc: storage,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Tensors mapped from the file (torch.load(mmap=True)), and only tensors and plain data unless the
        caller explicitly passes weights_only=False."""
        weights_only = weights_only is not False
        if not _is_local_file_protocol(path):
            return super().load_checkpoint(path, map_location, weights_only)
        if not os.path.exists(path):
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        return torch.load(path, map_location=map_location, weights_only=weights_only, mmap=zipfile.is_zipfile(path))


class LinkedLastCheckpoint(ModelCheckpoint):
    """`ModelCheckpoint` whose `save_last="link"` keeps last.ckpt at the newest state without a second copy.

    Lightning 2.6 links last.ckpt to the newest file it saved, also at a validation that saved none
    (val/loss did not improve): last.ckpt then holds an older step, and a resume from it loses the steps
    since. Here such a validation writes last.ckpt itself, the one full file of that step; one that saved
    a top-k file makes last.ckpt a relative symlink to it; and a fit that ends between validations writes
    last.ckpt at its last step. Links are replaced atomically, and a top-k file
    that last.ckpt points to is removed only after last.ckpt points to the newer one, so a crash at any
    point leaves a last.ckpt to resume from. Other `save_last` values behave exactly as Lightning's.
    """

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """After a resume, the first validation must update last.ckpt even if it saves no top-k file (the
        base class only does that once it has saved something itself)."""
        super().on_train_start(trainer, pl_module)
        if self.save_last == "link" and not self._last_checkpoint_saved and trainer.ckpt_path:
            self._last_checkpoint_saved = str(trainer.ckpt_path)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """A fit that ends between validations writes last.ckpt at its last step (the base class writes it at the
        end only where the run, or the run it resumed, saved nothing: a resume from it would lose those steps)."""
        if self.save_last == "link" and self._last_global_step_saved != trainer.global_step:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
        else:
            super().on_train_end(trainer, pl_module)

    def _save_last_checkpoint(self, trainer: Trainer, monitor_candidates: dict[str, torch.Tensor]) -> None:
        if self.save_last == "link" and self._last_global_step_saved != trainer.global_step:
            self._last_checkpoint_saved = None  # nothing of this step to link to: last.ckpt gets the full state
        super()._save_last_checkpoint(trainer, monitor_candidates)

    @staticmethod
    def _link_checkpoint(trainer: Trainer, filepath: str, linkpath: str) -> None:
        if trainer.is_global_zero and os.path.abspath(filepath) != os.path.abspath(linkpath):
            _replace_with_link(filepath, linkpath)
        trainer.strategy.barrier()

    def _remove_checkpoint(self, trainer: Trainer, filepath: str) -> None:
        last, newest = self.last_model_path, self._last_checkpoint_saved
        if (trainer.is_global_zero and self.save_last == "link" and last and os.path.islink(last) and newest
                and os.path.realpath(last) == os.path.realpath(filepath) and os.path.exists(newest)
                and os.path.realpath(newest) != os.path.realpath(filepath)):
            _replace_with_link(newest, last)
        super()._remove_checkpoint(trainer, filepath)


def _replace_with_link(target: str, linkpath: str) -> None:
    """Point `linkpath` at `target` in one rename: a relative symlink, or a hard link where the filesystem
    has no symlinks (never a copy)."""
    tmp = _temporary(linkpath)
    if os.path.isdir(linkpath) and not os.path.islink(linkpath):
        shutil.rmtree(linkpath)
    try:
        os.symlink(os.path.relpath(target, os.path.dirname(linkpath) or "."), tmp)
    except OSError:
        os.link(target, tmp)
    os.replace(tmp, linkpath)
