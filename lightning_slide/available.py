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


def available_ram() -> int:
    return int(psutil.virtual_memory().available)


def host_headroom() -> int:
    """Host RAM a plan leaves to the rest of the machine: 5% of it (6.3 GiB of 126), at least 1 GiB."""
    return max(HEADROOM_MIN, int(HEADROOM_FRACTION * psutil.virtual_memory().total))


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
