"""Timing helpers shared by the benchmarks in this folder.

Every latency figure of the benchmarks is a *ratio measured in one run*: the variants
being compared are called in turn inside each repetition (A, B, then B, A, ...), so slow
drift of the machine (frequency, other processes, page cache) lands on every variant
alike, and the figure is the median over the repetitions.

Nothing here imports dlo_fx, so other benchmarks can use it as is.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Sequence

__all__ = [
    "CpuLoad", "Samples", "interleaved", "machine_info", "median", "timed_call",
]


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def timed_call(fn: Callable[[], object]) -> float:
    """Seconds ``fn()`` took (CPU work is synchronous, so no device sync is needed)."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@dataclass
class Samples:
    """Per-variant latencies of one interleaved measurement, in seconds."""

    times: dict[str, list[float]] = field(default_factory=dict)
    warmup: int = 0

    @property
    def reps(self) -> int:
        return min((len(v) for v in self.times.values()), default=0)

    def median(self, name: str) -> float:
        return median(self.times[name])

    def paired_ratio(self, num: str, den: str) -> float:
        """Median over repetitions of ``num / den`` measured in the same repetition."""
        return median([a / b for a, b in zip(self.times[num], self.times[den])])

    def summary(self) -> dict:
        out = {}
        for name, values in self.times.items():
            ordered = sorted(values)
            out[name] = {
                "median_s": median(values),
                "min_s": ordered[0],
                "max_s": ordered[-1],
                "n": len(values),
                "samples_s": list(values),
            }
        return out


def interleaved(variants: Mapping[str, Callable[[], object]], *, reps: int, warmup: int = 1,
                collect: bool = True, alternate: bool = True) -> Samples:
    """Time every variant once per repetition, in turn.

    ``warmup`` untimed rounds come first. With ``alternate`` the order is reversed on every
    other repetition (A B, B A, A B, ...), which also cancels a linear drift and any
    effect of one variant on the variant called right after it (a trailing background
    copy, a warm cache). ``collect`` runs the garbage collector before each repetition,
    outside the timed region.
    """
    names = list(variants)
    for _ in range(warmup):
        for name in names:
            variants[name]()
    samples = Samples(times={name: [] for name in names}, warmup=warmup)
    for rep in range(reps):
        order = names[::-1] if alternate and rep % 2 else names
        if collect:
            gc.collect()
        for name in order:
            samples.times[name].append(timed_call(variants[name]))
    return samples


# -- the machine ------------------------------------------------------------------------
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _loadavg() -> Optional[tuple[float, float, float]]:
    try:
        return os.getloadavg()
    except OSError:
        return None


def cpu_text(machine: dict) -> str:
    """The CPU of a `machine_info` for a benchmark's machine line: model and vector ISA."""
    return f"{machine['cpu_model']}, {machine['cpu_isa']}"


def machine_info() -> dict:
    import torch

    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        affinity = os.cpu_count()
    return {
        "nproc": affinity,
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
        # The vector ISA torch dispatches to: bfloat16 matmuls are fast with AVX-512 and a
        # slow path on an AVX2-only host, so figures of the two are not comparable.
        "cpu_isa": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "torch_parallel": "OpenMP" if "OpenMP" in torch.__config__.parallel_info() else "other",
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg": _loadavg(),
    }


class CpuLoad:
    """How busy the machine was with *other* processes while the block ran.

    ``other_cores``: CPU seconds the whole machine spent busy (``/proc/stat``) minus what
    this process used (``os.times``), per second of wall time. 0 on an idle machine; a
    benchmark on a 2-core machine with ``other_cores = 1`` effectively had one core.
    """

    def __init__(self) -> None:
        self.wall_s = 0.0
        self.own_cpu_s = 0.0
        self.machine_busy_s: Optional[float] = None

    @staticmethod
    def _busy() -> Optional[float]:
        try:
            with open("/proc/stat") as f:
                fields = f.readline().split()[1:]
        except OSError:
            return None
        ticks = [int(x) for x in fields]
        idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
        guest = sum(ticks[8:10]) if len(ticks) > 9 else 0  # already counted in user/nice
        return (sum(ticks) - idle - guest) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _own() -> float:
        t = os.times()
        return t.user + t.system

    def __enter__(self) -> "CpuLoad":
        self._t0, self._own0, self._busy0 = time.perf_counter(), self._own(), self._busy()
        return self

    def __exit__(self, *exc) -> None:
        self.wall_s = time.perf_counter() - self._t0
        self.own_cpu_s = self._own() - self._own0
        busy = self._busy()
        if busy is not None and self._busy0 is not None:
            self.machine_busy_s = busy - self._busy0

    @property
    def other_cores(self) -> Optional[float]:
        if self.machine_busy_s is None or self.wall_s <= 0:
            return None
        return max(0.0, (self.machine_busy_s - self.own_cpu_s) / self.wall_s)

    def as_dict(self) -> dict:
        return {"wall_s": self.wall_s, "own_cpu_s": self.own_cpu_s,
                "machine_busy_cpu_s": self.machine_busy_s, "other_cores": self.other_cores}


def wait_quiet(max_wait_s: float, *, threshold_cores: float = 0.3, window_s: float = 2.0,
               log: Optional[Callable[[str], None]] = None) -> Optional[float]:
    """Wait (at most ``max_wait_s``) until other processes use < ``threshold_cores`` cores.

    Samples ``CpuLoad`` over ``window_s`` windows while this process sleeps. Returns the
    last sample (``None`` where /proc/stat is unreadable). On a shared machine this keeps
    a benchmark from timing another job; it never fails, it only waits.
    """
    deadline = time.perf_counter() + max_wait_s
    logged = float("-inf")
    while True:
        with CpuLoad() as load:
            time.sleep(window_s)
        other = load.other_cores
        if other is None or other < threshold_cores or time.perf_counter() >= deadline:
            return other
        if log is not None and time.perf_counter() - logged >= 30:
            logged = time.perf_counter()
            log(f"other processes use {other:.2f} cores; waiting for a quiet machine "
                f"({deadline - time.perf_counter():.0f} s left)")


def write_json(path: str, result: object, *, indent: int = 2) -> None:
    """Write a benchmark's result, creating the folder it goes into."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=indent, default=str)
