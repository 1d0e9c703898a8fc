"""Host memory figures read from /proc and the cgroup (None where not readable)."""

from __future__ import annotations

import os
from typing import Callable, Optional


def smaps_rollup(pid: int | str = "self") -> dict[str, int]:
    """Fields of ``/proc/PID/smaps_rollup`` in bytes (empty when unreadable)."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and parts[2] == "kB":
                    out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    except OSError:
        pass
    return out


def process_memory(pid: int | str = "self") -> dict[str, Optional[int]]:
    roll = smaps_rollup(pid)
    private = None
    shared = None
    if roll:
        private = roll.get("Private_Clean", 0) + roll.get("Private_Dirty", 0)
        shared = roll.get("Shared_Clean", 0) + roll.get("Shared_Dirty", 0)
    return {"rss": roll.get("Rss"), "pss": roll.get("Pss"), "private": private, "shared": shared}


def _cgroup_dir() -> Optional[str]:
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                if line.startswith("0::"):
                    path = "/sys/fs/cgroup" + line.strip()[3:]
                    return path if os.path.isdir(path) else "/sys/fs/cgroup"
    except OSError:
        return None
    return None


def cgroup_memory() -> dict[str, Optional[int]]:
    """``memory.current`` and ``memory.peak`` of this process's cgroup (v2)."""
    out: dict[str, Optional[int]] = {"current": None, "peak": None}
    base = _cgroup_dir()
    if base is None:
        return out
    for key in out:
        try:
            with open(os.path.join(base, f"memory.{key}")) as f:
                out[key] = int(f.read().strip())
        except (OSError, ValueError):
            pass
    return out


def meminfo() -> dict[str, int]:
    """Fields of ``/proc/meminfo`` in bytes (empty when unreadable)."""
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 2:
                    out[parts[0].rstrip(":")] = int(parts[1]) * (1024 if parts[-1] == "kB" else 1)
    except (OSError, ValueError):
        pass
    return out


def memory_limit() -> Optional[int]:
    """``memory.max`` of this process's cgroup (v2); None without a limit or a cgroup."""
    base = _cgroup_dir()
    if base is None:
        return None
    try:
        with open(os.path.join(base, "memory.max")) as f:
            limit = f.read().strip()
        return None if limit == "max" else int(limit)
    except (OSError, ValueError):
        return None


def _cgroup_left(used: "Callable[[str], Optional[int]]") -> Optional[int]:
    """The cgroup's ``memory.max`` less ``used(cgroup dir)``; None without a limit."""
    limit = memory_limit()
    if limit is None:
        return None
    try:
        taken = used(_cgroup_dir())
    except (OSError, ValueError):
        return None
    return None if taken is None else limit - taken


def _least(a: Optional[int], b: Optional[int]) -> Optional[int]:
    return b if a is None else a if b is None else min(a, b)


def free_memory() -> Optional[int]:
    """Memory free without evicting anything: the host's ``MemFree``, or the cgroup's
    ``memory.max - memory.current`` when that is less (page cache is charged to the cgroup)."""
    return _least(meminfo().get("MemFree"), _cgroup_left(lambda _: cgroup_memory()["current"]))


def _cgroup_anon(base: str) -> Optional[int]:
    with open(os.path.join(base, "memory.stat")) as f:
        for line in f:
            if line.startswith("anon "):
                return int(line.split()[1])
    return None


def available_memory() -> Optional[int]:
    """Memory the page cache may use without swapping: the host's ``MemAvailable``, or the
    cgroup's ``memory.max`` less its anonymous memory when that is less."""
    return _least(meminfo().get("MemAvailable"), _cgroup_left(_cgroup_anon))


def anon_memory() -> dict[str, Optional[int]]:
    """This process's anonymous memory: ``RssAnon`` (``/proc/self/status``) and
    ``Private_Dirty`` (``smaps_rollup``), in bytes."""
    rss_anon = None
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    rss_anon = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return {"rss_anon": rss_anon, "private_dirty": smaps_rollup().get("Private_Dirty")}


def tree_pss(root_pid: int) -> int:
    """PSS summed over ``root_pid`` and all its descendants (bytes)."""
    return tree_rollup(root_pid, ("Pss",))["Pss"]


def tree_rollup(root_pid: int, fields: tuple[str, ...]) -> dict[str, int]:
    """``fields`` of `smaps_rollup` (``Pss``, ``Pss_Anon``, ``Locked`` ...) each summed over
    ``root_pid`` and all its descendants (bytes)."""
    total = dict.fromkeys(fields, 0)
    stack = [root_pid]
    while stack:
        pid = stack.pop()
        roll = smaps_rollup(pid)
        for key in fields:
            total[key] += roll.get(key, 0)
        try:
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                stack.extend(int(c) for c in f.read().split())
        except OSError:
            pass
    return total
