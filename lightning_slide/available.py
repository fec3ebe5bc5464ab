"""What the machine has free right now: host RAM, this process's share of the GPU, disk space.

The planner checks a run against these before anything is allocated; the engine and the activation store
ask the same questions when they size the window and decide where saved inputs wait.
"""

from __future__ import annotations

import os
import shutil

import psutil
import torch

HEADROOM_FRACTION = 0.05  # of the machine's RAM, left free by every plan (at least HEADROOM_MIN)
HEADROOM_MIN = 1 << 30


CGROUP_ROOT = "/sys/fs/cgroup"


def available_ram() -> int:
    """Host RAM free for this process: the machine's available memory, or less where the process's memory cgroup
    (a container's memory limit, systemd's MemoryMax) leaves less room below its limit."""
    free = int(psutil.virtual_memory().available)
    limit = cgroup_memory()
    return free if limit is None else min(free, limit[0] - limit[1])


def host_ram() -> int:
    """The host RAM this process can have in all: the machine's, or its memory cgroup's limit if lower."""
    total = int(psutil.virtual_memory().total)
    limit = cgroup_memory()
    return total if limit is None else min(total, limit[0])


def host_headroom() -> int:
    """Host RAM a plan leaves to the rest of the machine: 5% of it (6.3 GiB of 126), at least 1 GiB."""
    return max(HEADROOM_MIN, int(HEADROOM_FRACTION * host_ram()))


def cgroup_memory(root: str | None = None, membership: str = "/proc/self/cgroup") -> tuple[int, int] | None:
    """(limit, usage) in bytes of the tightest memory limit among this process's cgroup and its ancestors (usage
    without the inactive page cache, which the kernel reclaims before it fails an allocation); None without a
    limit. cgroup v2 (memory.max) and v1 (memory.limit_in_bytes); `membership` lists the process's cgroups."""
    root = root or CGROUP_ROOT
    try:
        with open(membership) as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return None
    found = []
    for _, controllers, path in lines:
        if controllers == "":
            found += _limits(root, path, "memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):
            found += _limits(os.path.join(root, "memory"), path, "memory.limit_in_bytes", "memory.usage_in_bytes",
                             "total_inactive_file")
    return min(found, key=lambda lu: lu[0] - lu[1], default=None)


def _limits(root: str, path: str, max_file: str, usage_file: str, inactive_key: str) -> list[tuple[int, int]]:
    """(limit, usage) of each cgroup from `path` up to the root (as mounted here) that has a limit."""
    found = []
    parts = [p for p in path.split("/") if p]
    for depth in range(len(parts), -1, -1):
        folder = os.path.join(root, *parts[:depth])
        limit = _read_int(os.path.join(folder, max_file))
        if limit is None or limit >= 1 << 60:  # "max", or v1's "no limit" (close to 2^63)
            continue
        usage = _read_int(os.path.join(folder, usage_file)) or 0
        found.append((limit, max(0, usage - _stat(os.path.join(folder, "memory.stat"), inactive_key))))
    return found


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat(path: str, key: str) -> int:
    try:
        with open(path) as f:
            return next((int(v) for k, v in (line.split() for line in f if line.strip()) if k == key), 0)
    except (OSError, ValueError):
        return 0


def process_rss() -> int:
    return int(psutil.Process().memory_info().rss)


def available_vram(device: torch.device) -> int:
    """What this process may still allocate: its memory-fraction cap, the card's free memory, and the cache."""
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda _: 1.0)(device)
    reserved, allocated = torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device)
    capped = int(torch.cuda.get_device_properties(device).total_memory * fraction) - allocated
    return min(capped, torch.cuda.mem_get_info(device)[0] + reserved - allocated)


def available_disk(path: str) -> int:
    """Free space where `path` is or will be made (its nearest existing ancestor)."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free
