"""How much host RAM a run may plan for: the machine's, or its memory cgroup's (a container, systemd's MemoryMax)."""

from pathlib import Path

import psutil

import lightning_slide.available as available
from lightning_slide.available import cgroup_memory

GiB = 1 << 30


def _cgroup(root: Path, path: str, files: dict[str, str]) -> None:
    folder = root.joinpath(*[p for p in path.split("/") if p])
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)


def _membership(tmp_path: Path, text: str) -> str:
    (tmp_path / "cgroup").write_text(text)
    return str(tmp_path / "cgroup")


def test_a_v2_limit_gives_its_room_without_the_inactive_page_cache(tmp_path):
    root = tmp_path / "fs"
    _cgroup(root, "/", {"memory.max": "max"})
    _cgroup(root, "/user.slice/run.scope", {"memory.max": str(64 * GiB), "memory.current": str(10 * GiB),
                                           "memory.stat": f"anon {8 * GiB}\ninactive_file {2 * GiB}\n"})
    got = cgroup_memory(str(root), _membership(tmp_path, "0::/user.slice/run.scope\n"))
    assert got == (64 * GiB, 8 * GiB)


def test_the_tightest_limit_among_the_ancestors_binds(tmp_path):
    root = tmp_path / "fs"
    _cgroup(root, "/outer", {"memory.max": str(32 * GiB), "memory.current": str(4 * GiB)})
    _cgroup(root, "/outer/inner", {"memory.max": "max", "memory.current": str(3 * GiB)})
    assert cgroup_memory(str(root), _membership(tmp_path, "0::/outer/inner\n")) == (32 * GiB, 4 * GiB)


def test_a_v1_memory_controller_limit_is_read(tmp_path):
    root = tmp_path / "fs"
    _cgroup(root, "/memory/docker/abc", {"memory.limit_in_bytes": str(48 * GiB),
                                         "memory.usage_in_bytes": str(5 * GiB),
                                         "memory.stat": f"cache {GiB}\ntotal_inactive_file {GiB}\n"})
    membership = _membership(tmp_path, "5:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/\n")
    assert cgroup_memory(str(root), membership) == (48 * GiB, 4 * GiB)


def test_no_limit_anywhere_is_none(tmp_path):
    root = tmp_path / "fs"
    _cgroup(root, "/", {"memory.max": "max"})
    _cgroup(root, "/memory", {"memory.limit_in_bytes": "9223372036854771712"})
    assert cgroup_memory(str(root), _membership(tmp_path, "4:memory:/\n0::/\n")) is None


def test_the_planner_sees_at_most_the_cgroups_room_and_its_limit_as_the_machine(monkeypatch):
    monkeypatch.setattr(available, "cgroup_memory", lambda: (2 * GiB, GiB // 2))
    assert available.available_ram() == min(psutil.virtual_memory().available, 2 * GiB - GiB // 2)
    assert available.host_ram() == min(psutil.virtual_memory().total, 2 * GiB)
    assert available.host_headroom() == available.HEADROOM_MIN
