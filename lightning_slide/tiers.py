"""The disk tier: preallocated files that a reader thread fills host buffers from ahead of need, and a
writer thread writes back behind.

I/O goes through kvikio when it is installed (GPUDirect Storage where the machine has it, its POSIX
compatibility mode elsewhere) and through plain `os.preadv`/`os.pwritev` otherwise; `backend_name()` says
which. Adam runs on the CPU, so the moments' buffers are host memory. Activations live on the GPU: with
GPUDirect Storage their staging buffers are device memory that kvikio reads and writes straight from the
disk (`direct_io`); without it they pass through pinned host buffers, since kvikio's compatibility mode
would bounce device memory through its own host buffers anyway, one more copy. Files live in a private
directory under `nvme_path` that is removed on close, at interpreter exit and when the owner is garbage
collected, so an exception never leaves them behind. A process killed outright (SIGKILL, the OOM killer)
runs none of that: its directory names its owner (pid, host, start time), and the next run on that
`nvme_path` removes the directories of owners that are gone (`remove_stale_tier_folders`). A short read or
write is an error naming the file, never silent.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Hashable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import psutil
import torch

from lightning_slide.streams import host_wait
from lightning_slide.threads import Failure, Worker

ALIGN = 4096  # file regions start on page (and O_DIRECT block) boundaries
IO_THREADS = 8
TIER_PREFIX = "lightning-slide-"  # the private directories under nvme_path
OWNER_FILE = "owner"  # in each: {"pid", "host", "started"} of the process that made it
UNCLAIMED_GRACE_S = 60.0  # a directory without an owner file is left alone this long after its last write

log = logging.getLogger(__name__)


class DiskTierError(OSError):
    """The disk tier cannot be used as configured (unwritable or full path, short read or write)."""


def align(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _kvikio():
    """kvikio, if installed and usable: it asks the CUDA driver about every buffer, so it needs libcuda."""
    try:
        import kvikio
        import kvikio.defaults

        ctypes.CDLL("libcuda.so.1")
    except (ImportError, OSError):
        return None
    return kvikio


def gds_available() -> bool:
    """kvikio is usable and would move device memory with GPUDirect Storage (not its compatibility mode)."""
    kvikio = _kvikio()
    return kvikio is not None and not kvikio.defaults.is_compat_mode_preferred()


def direct_io(setting: str, device: torch.device) -> bool:
    """Whether activations go between GPU memory and their files without pinned host staging.

    "auto": where GPUDirect Storage is in use; "on": wherever the device is CUDA and kvikio is installed
    (without GDS, kvikio bounces device memory through its own host buffers); "off": never.
    """
    if setting == "off" or device.type != "cuda":
        if setting == "on":
            raise ValueError(f"gds='on' needs a CUDA compute device, not {device.type!r}; use gds='auto' or 'off'.")
        return False
    if setting == "on" and _kvikio() is None:
        raise ValueError("gds='on' needs kvikio (pip install kvikio-cu12 or kvikio-cu13); use gds='auto' or 'off'.")
    return setting == "on" or gds_available()


def backend_name(direct: bool = False) -> str:
    """Which I/O path the disk tier uses here, for the plan and the logs."""
    kvikio = _kvikio()
    if kvikio is None:
        return "POSIX pread/pwrite (kvikio not installed)"
    mode = "POSIX compatibility mode" if kvikio.defaults.is_compat_mode_preferred() else "GPUDirect Storage"
    staging = "GPU memory" if direct else "pinned host memory"
    return f"kvikio {kvikio.__version__}, {mode}; activations staged in {staging}"


class _Posix:
    """The fallback: positional reads and writes on a thread pool, one future per request."""

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="slideformer-posix-io")

    def open(self, path: str) -> int:
        return os.open(path, os.O_RDWR)

    def read(self, handle: int, view: memoryview, offset: int) -> Callable[[], int]:
        return self.pool.submit(_whole, os.preadv, handle, view, offset).result

    def write(self, handle: int, view: memoryview, offset: int) -> Callable[[], int]:
        return self.pool.submit(_whole, os.pwritev, handle, view, offset).result

    def close(self, handle: int) -> None:
        os.close(handle)


def _whole(call: Callable, handle: int, view: memoryview, offset: int) -> int:
    """Repeat a positional read/write until done or the file ends (a short count is the caller's error)."""
    done = 0
    while done < len(view):
        n = call(handle, [view[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


class _Kvikio:
    """kvikio's CuFile: its own thread pool splits each request into parallel tasks."""

    def __init__(self, kvikio) -> None:
        self.kvikio = kvikio
        if "KVIKIO_NTHREADS" not in os.environ:
            kvikio.defaults.set("num_threads", IO_THREADS)

    def open(self, path: str):
        return self.kvikio.CuFile(path, "r+")

    def read(self, handle, view, offset: int) -> Callable[[], int]:
        return handle.pread(view, len(view), offset).get

    def write(self, handle, view, offset: int) -> Callable[[], int]:
        return handle.pwrite(view, len(view), offset).get

    def close(self, handle) -> None:
        handle.close()


def _bytes(tensor: torch.Tensor):
    """What kvikio and os.preadv take: a byte view of a contiguous host tensor (any dtype, bf16 included),
    or a device tensor itself (kvikio reads its `__cuda_array_interface__`)."""
    raw = tensor.view(torch.uint8)
    return raw if raw.is_cuda else memoryview(raw.numpy()).cast("B")


def process_alive(pid: int, host: str | None = None, since: float | None = None) -> bool:
    """Whether the process `pid` of `host` (None: this host) that was running at time `since` may still run.

    A process of another host may (nothing here can tell). A pid that now belongs to a process started
    after `since` was reused: the one that was meant is gone. A zombie is gone.
    """
    if host is not None and host != socket.gethostname():
        return True
    try:
        process = psutil.Process(pid)
        return process.status() != psutil.STATUS_ZOMBIE and (since is None or process.create_time() <= since + 1.0)
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


def _claimed_folder(root: str) -> str:
    """A new private directory under `root` with its owner file (this process) written."""
    path = tempfile.mkdtemp(prefix=TIER_PREFIX, dir=root)
    owner = {"pid": os.getpid(), "host": socket.gethostname(), "started": psutil.Process().create_time()}
    try:
        with open(os.path.join(path, OWNER_FILE), "w") as f:
            json.dump(owner, f)
    except OSError:
        shutil.rmtree(path, ignore_errors=True)
        raise
    return path


def _file_stats(folder: str) -> list[os.stat_result]:
    """lstat of every file under `folder` (those removed meanwhile left out)."""
    stats = []
    for parent, _, names in os.walk(folder):
        for name in names:
            with contextlib.suppress(OSError):
                stats.append(os.lstat(os.path.join(parent, name)))
    return stats


def _allocated_bytes(folder: str) -> int:
    """The disk space the files under `folder` hold (allocated blocks: the disk tier's files are preallocated)."""
    return sum(st.st_blocks * 512 for st in _file_stats(folder))


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def _last_write(folder: str) -> float:
    return max([os.lstat(folder).st_mtime] + [st.st_mtime for st in _file_stats(folder)])


def _open_by_a_process(folder: str) -> bool:
    """Whether a process we can see has a file under `folder` open (a live disk tier holds all of its open)."""
    prefix = os.path.realpath(folder) + os.sep
    for process in psutil.process_iter():
        try:
            if any(f.path.startswith(prefix) for f in process.open_files()):
                return True
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return False


def _why_stale(folder: str) -> str | None:
    """Why `folder` belongs to a run that is over, or None where it may be a live run's (or cannot be told)."""
    try:
        with open(os.path.join(folder, OWNER_FILE)) as f:
            owner = json.load(f)
        pid, host, started = int(owner["pid"]), str(owner["host"]), float(owner["started"])
    except (OSError, ValueError, KeyError, TypeError):  # an older version's, or its owner died making it
        age = time.time() - _last_write(folder)
        if age < UNCLAIMED_GRACE_S or _open_by_a_process(folder):
            return None
        return f"no owner recorded, nothing written for {age / 60:.0f} min and no process has its files open"
    if process_alive(pid, host, started):
        if host != socket.gethostname():
            log.info("Keeping %s: it belongs to process %d of host %s, which cannot be checked from here.",
                     folder, pid, host)
        return None
    return f"its process {pid} on {host} has ended"


def remove_stale_tier_folders(root: str) -> int:
    """Remove the disk-tier directories under `root` of runs that are over; returns the bytes freed.

    A run killed outright (SIGKILL, the out-of-memory killer) leaves its directory, full of preallocated
    files, behind. A directory is removed only when its owner file names a process of this host that has
    ended, or, without an owner file, when nothing was written there for `UNCLAIMED_GRACE_S` and no process
    has its files open; other users' directories are never touched. Each removal is logged with the bytes
    it freed, and a directory that cannot be removed with the bytes it still holds. Nothing here fails the
    run: a directory that cannot be examined is named in a warning and kept.
    """
    if not os.path.isdir(root):
        return 0
    with os.scandir(root) as entries:
        candidates = [e.path for e in entries if e.name.startswith(TIER_PREFIX) and e.is_dir(follow_symlinks=False)
                      and e.stat(follow_symlinks=False).st_uid == os.getuid()]
    freed = 0
    for folder in candidates:
        try:
            freed += _remove_if_stale(folder)
        except FileNotFoundError:  # another run removed it meanwhile
            continue
        except OSError as error:
            log.warning("Could not tell whether %s, a disk-tier directory, belongs to a run that is over (%s); "
                        "it is kept.", folder, error)
    return freed


def _remove_if_stale(folder: str) -> int:
    """Remove `folder` if its run is over; the bytes freed."""
    why = _why_stale(folder)
    if why is None:
        return 0
    held = _allocated_bytes(folder)
    errors: list[str] = []
    shutil.rmtree(folder, onerror=lambda _, path, info: errors.append(f"{path}: {info[1]}"))
    left = _allocated_bytes(folder) if os.path.lexists(folder) else 0
    if errors and os.path.lexists(folder):
        log.warning("Could not remove %s, the disk-tier directory of a run that is over (%s): %s are still "
                    "there (%s). Remove it by hand to free the space.", folder, why, _size(left), errors[0])
    else:
        log.warning("Removed %s, the disk-tier directory of a run that is over (%s): %s freed.",
                    folder, why, _size(held - left))
    return held - left


class TierDirectory:
    """A private directory of preallocated files under the user's `nvme_path`, removed when done.

    Its owner file names this process, so that a later run can tell it was left behind; making one first
    removes the directories that earlier runs left behind (`remove_stale_tier_folders`).
    """

    def __init__(self, root: str) -> None:
        try:
            os.makedirs(root, exist_ok=True)
            remove_stale_tier_folders(root)
            self.path = _claimed_folder(root)
        except OSError as error:
            raise DiskTierError(f"nvme_path={root!r} is not a writable directory ({error.strerror}). Point "
                                "nvme_path at a directory on a local disk you can write to.") from error
        kvikio = _kvikio()
        self.io = _Kvikio(kvikio) if kvikio is not None else _Posix()
        self.files: list[DiskFile] = []
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.path, True)

    def create(self, name: str, nbytes: int) -> DiskFile:
        file = DiskFile(os.path.join(self.path, name), align(nbytes), self.io)
        self.files.append(file)
        return file

    def remove(self, file: DiskFile) -> None:
        file.close()
        os.remove(file.path)
        self.files.remove(file)

    @property
    def bytes(self) -> int:
        return sum(f.nbytes for f in self.files)

    def close(self) -> None:
        for f in self.files:
            f.close()
        self.files.clear()
        self._cleanup()


class DiskFile:
    """One file, its full size reserved up front (a full disk fails here, not halfway through training)."""

    def __init__(self, path: str, nbytes: int, io) -> None:
        self.path, self.nbytes, self._io = path, nbytes, io
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, max(nbytes, 1))
        except OSError as error:
            os.close(fd)
            os.remove(path)
            if error.errno in (errno.ENOSPC, errno.EDQUOT):
                free = shutil.disk_usage(os.path.dirname(path)).free
                raise DiskTierError(f"The disk under {os.path.dirname(os.path.dirname(path))!r} is full: "
                                    f"{path} needs {nbytes / 2**30:.2f} GiB, {free / 2**30:.2f} GiB are free. "
                                    "Free space there, point nvme_path at a larger disk, or put less on disk "
                                    "(a smaller nvme_moments).") from error
            raise
        os.close(fd)
        self.handle = io.open(path)

    def read(self, dst: torch.Tensor, offset: int) -> Callable[[], None]:
        """Start reading len(dst) bytes at `offset` into `dst`; the returned call waits for them.

        The file's size is checked first: kvikio 26.10 can abort the process on a read past the end.
        """
        size, nbytes = os.path.getsize(self.path), dst.numel() * dst.element_size()
        if offset + nbytes > size:
            raise DiskTierError(f"Short read of {self.path}: {nbytes} bytes at offset {offset} but the file holds "
                                f"{size} (was it truncated or replaced while training?).")
        return self._checked("read", self._io.read(self.handle, _bytes(dst), offset), dst, offset)

    def write(self, src: torch.Tensor, offset: int) -> Callable[[], None]:
        return self._checked("write", self._io.write(self.handle, _bytes(src), offset), src, offset)

    def _checked(self, what: str, wait: Callable[[], int], buffer: torch.Tensor, offset: int) -> Callable[[], None]:
        expected = buffer.numel() * buffer.element_size()

        def result() -> None:  # holds `buffer` alive until the I/O has finished
            try:
                done = wait()
            except (OSError, RuntimeError) as error:  # kvikio reports EOF and I/O errors as RuntimeError
                raise DiskTierError(f"Failed {what} of {self.path} at offset {offset}: {error}") from error
            if done != expected:
                raise DiskTierError(f"Short {what} of {self.path}: {done} of {expected} bytes at offset {offset}.")

        return result

    def map(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The file's first `numel` elements as a tensor backed by a shared mapping (for checkpoint I/O)."""
        return torch.from_file(self.path, shared=True, size=numel, dtype=dtype)

    def close(self) -> None:
        if self.handle is not None:
            self._io.close(self.handle)
            self.handle = None


@dataclass(frozen=True)
class Region:
    """Bytes [offset, offset + nbytes) of `file` <-> bytes [at, at + nbytes) of a buffer."""

    file: DiskFile
    offset: int
    nbytes: int
    at: int = 0


class Spill:
    """Buffers that are read ahead in a planned order and written behind, for one kind of state.

    The consumer plans the order in which it will `take` keys, takes each (waiting only if the disk is
    behind), and hands the buffer back either with `write_back` (written, then freed) or `release` (freed
    once `event` has passed). A key is never read while an earlier write of it is still in flight.
    """

    def __init__(self, name: str, buffers: int, buffer_bytes: int, pin: bool, failure: Failure,
                 device: torch.device | None = None) -> None:
        """Host buffers (pinned if `pin`), or device buffers on `device` for GPUDirect I/O."""
        self.name, self.failure = name, failure
        self.buffers = [torch.empty(buffer_bytes, dtype=torch.uint8, device=device, pin_memory=pin and device is None)
                        for _ in range(buffers)]
        self._free = deque(range(buffers))
        self._ready: dict[Hashable, int] = {}
        self._expected: deque[Hashable] = deque()
        self._writes: dict[Hashable, int] = {}  # key -> writes queued and not finished
        self._lock = threading.Lock()
        self._closed = False
        self.regions: dict[Hashable, tuple[Region, ...]] = {}
        self.bytes_read = self.bytes_written = 0
        self.reader: Worker[Hashable] = Worker(f"{name}-reader", self._read, failure)
        self.writer: Worker[tuple[Hashable | None, int, object]] = Worker(f"{name}-writer", self._write, failure)

    # ---------------------------------------------------------------------------------- consumer side
    def plan(self, keys: Iterable[Hashable]) -> None:
        """The order of the next `take`s: the reader fills buffers in this order, as they come free."""
        for key in keys:
            self._expected.append(key)
            self.reader.put(key)

    def take(self, key: Hashable) -> torch.Tensor:
        """The buffer holding `key`'s bytes, once read."""
        if not self._expected or self._expected[0] != key:
            nxt = self._expected[0] if self._expected else None
            raise RuntimeError(f"slideformer {self.name}: {key!r} taken out of the planned order (next: {nxt!r}).")
        self._expected.popleft()
        self.failure.wait(lambda: key in self._ready, f"{self.name} read of {key!r} from disk")
        with self._lock:
            return self.buffers[self._ready.pop(key)]

    def acquire(self) -> torch.Tensor:
        """A free buffer to fill and `write_back` (waits while every buffer is busy: the disk is behind)."""
        self.failure.wait(lambda: bool(self._free), f"a free {self.name} buffer (the disk is behind)")
        with self._lock:
            return self.buffers[self._free.popleft()]

    def write_back(self, key: Hashable, buffer: torch.Tensor, event: object = None) -> None:
        """Write `buffer` to `key`'s regions once `event` has passed, then free the buffer."""
        with self._lock:
            self._writes[key] = self._writes.get(key, 0) + 1
        self.writer.put((key, self._index(buffer), event))

    def release(self, buffer: torch.Tensor, event: object = None) -> None:
        """Free `buffer` without writing, once `event` (e.g. its copy to the GPU) has passed."""
        self.writer.put((None, self._index(buffer), event))

    def drain(self) -> float:
        """Wait for queued writes (before reading the files another way; reads ahead change nothing)."""
        return self.failure.wait(self.writer.idle, f"{self.name} writes to disk")

    def close(self) -> None:
        """Stop both threads, also when planned reads were never taken (training stopped mid-step)."""
        self._closed = True
        self.failure.notify()
        for worker in (self.reader, self.writer):
            worker.stop()

    # ---------------------------------------------------------------------------------- I/O threads
    def _index(self, buffer: torch.Tensor) -> int:
        return next(i for i, b in enumerate(self.buffers) if b.data_ptr() == buffer.data_ptr())

    def _read(self, key: Hashable) -> None:
        self.failure.wait(lambda: not self._writes.get(key), f"{self.name} write of {key!r} before re-reading it")
        self.failure.wait(lambda: bool(self._free) or self._closed, f"a free {self.name} buffer")
        if self._closed:
            return
        with self._lock:
            index = self._free.popleft()
        buffer = self.buffers[index]
        for wait in [r.file.read(buffer[r.at : r.at + r.nbytes], r.offset) for r in self.regions[key]]:
            wait()
        self.bytes_read += sum(r.nbytes for r in self.regions[key])
        with self._lock:
            self._ready[key] = index

    def _write(self, item: tuple[Hashable | None, int, object]) -> None:
        key, index, event = item
        host_wait(event)
        if key is not None:
            buffer = self.buffers[index]
            for wait in [r.file.write(buffer[r.at : r.at + r.nbytes], r.offset) for r in self.regions[key]]:
                wait()
            self.bytes_written += sum(r.nbytes for r in self.regions[key])
        with self._lock:
            self._free.append(index)
            if key is not None:
                self._writes[key] -= 1
