"""What a run measures of its machine for planning: bandwidths, the matmul rate, host RAM.

`probe_bandwidths` measures the H2D (on CPU: copy) bandwidth and the AllGather bandwidth
on the real shard group with a short probe, and `probe_matmul_flops` the device's matmul
rate; each agrees on one figure across the group, so every rank plans the same.
``mode="auto"`` (`dlo_fx.planning.modes.choose_mode`) and the device budget
(`dlo_fx.planning.budget`) take these figures; planning itself measures nothing.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
import torch

from .device import platform, procfs
from .ranks.collectives import ShardGroup, exchange_json, gather_in_place

log = logging.getLogger(__name__)

GB = 1e9
PROBE_BYTES = 16 * 2**20


def _median_seconds(fn, device: torch.device, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats + 1):  # the first run warms up
        if platform.has_streams(device):
            platform.synchronize(device)
        start = time.perf_counter()
        fn()
        if platform.has_streams(device):
            platform.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def probe_bandwidths(device: torch.device, group: ShardGroup,
                     nbytes: int = PROBE_BYTES) -> tuple[float, float]:
    """(H2D GB/s, AllGather GB/s per rank) measured here, agreed over the group."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=platform.can_pin(device))
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    h2d = nbytes / _median_seconds(lambda: dev.copy_(host, non_blocking=True), device) / GB
    gather = float("inf")
    if group.dp > 1:
        shard = -(-nbytes // group.dp)
        flat = torch.zeros(shard * group.dp, dtype=torch.uint8, device=device)
        seconds = _median_seconds(lambda: gather_in_place(flat, shard, group, "the probe"),
                                  device)
        gather = shard * (group.dp - 1) / seconds / GB
        figures = exchange_json((h2d, gather), group, "the measured bandwidths")
        h2d = statistics.median(f[0] for f in figures)
        gather = min(f[1] for f in figures)
    return h2d, gather


def probe_matmul_flops(device: torch.device, dtype: torch.dtype, group: ShardGroup,
                       repeats: int = 5) -> float:
    """FLOP/s of a square matmul of ``dtype`` on ``device``, agreed over the group.

    The size doubles from 128 until one product takes 0.5 ms (at most 1024 on CPU, 4096
    on a device); then the fastest of ``repeats`` runs after a warm-up (the device's rate
    when nothing else holds it: on a shared machine a median swings with other
    processes): a few ms in all. Each rank times its own device (no collective in the
    timing); the ranks then take the slowest rank's rate, so a plan built from it is the
    same on every rank."""
    limit = 4096 if platform.has_streams(device) else 1024
    n = 128
    while True:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        seconds = _median_seconds(lambda: torch.mm(a, b), device, repeats=1)
        if seconds >= 5e-4 or n >= limit:
            break
        n *= 2
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        if platform.has_streams(device):
            platform.synchronize(device)
        times.append(time.perf_counter() - start)
    rate = 2 * n**3 / max(min(times), 1e-9)
    if group.dp > 1:
        rate = min(exchange_json(rate, group, f"the measured {dtype} matmul rate"))
    return float(rate)


def host_ram_bytes() -> int:
    """The host's RAM, or its cgroup's ``memory.max`` when that is less."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = procfs.memory_limit()
    return min(total, limit) if limit else total


def machine_figures(device: torch.device, group: ShardGroup) -> dict[str, float]:
    """What ``mode="auto"`` weighs, measured and agreed over ``group``: the H2D and
    AllGather bandwidths (GB/s per rank), the device memory and the host RAM (bytes)."""
    h2d, gather = probe_bandwidths(device, group)
    host = host_ram_bytes()
    return {"h2d_gbps": h2d, "gather_gbps": gather, "host_ram": host,
            "device_memory": platform.device_memory_bytes(device) or host}
