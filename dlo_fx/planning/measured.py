"""The policy applied to a real run: probe bandwidths, choose the mode, predict bytes.

`choose_mode` is what ``mode="auto"`` runs when a graph is first scheduled: it measures
the H2D (on CPU: copy) bandwidth and the AllGather bandwidth on the real shard group with
a short probe, agrees on one set of figures across the group (so every rank decides the
same), and simulates both modes on the plan's blocks (`dlo_fx.planning.modes`, through
the schedule simulator the device budget and the dump's timeline use).
`predicted_weight_bytes` gives the plan's host-shard and slot bytes for a runtime, which
`memory_report` prints beside the measured ones. The device budget uses the same
bandwidth probe, and `probe_matmul_flops` (the device's matmul rate, agreed the same
way) for the compute time of each block. Nothing here imports the planning study
(`dlo_fx.apps.study`) or sympy.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from typing import Sequence

import torch

from ..runtime import platform
from ..runtime.collectives import ShardGroup, exchange_json, gather_in_place
from .modes import decide, predict_modes, weight_bytes

log = logging.getLogger(__name__)

GB = 1e9
PROBE_BYTES = 16 * 2**20


def _median_seconds(fn, device: torch.device, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats + 1):  # the first run warms up
        if device.type != "cpu":
            platform.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type != "cpu":
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
    limit = 1024 if device.type == "cpu" else 4096
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
        if device.type != "cpu":
            platform.synchronize(device)
        times.append(time.perf_counter() - start)
    rate = 2 * n**3 / max(min(times), 1e-9)
    if group.dp > 1:
        rate = min(exchange_json(rate, group, f"the measured {dtype} matmul rate"))
    return float(rate)


def host_ram_bytes() -> int:
    limit = None
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            text = f.read().strip()
            limit = None if text == "max" else int(text)
    except (OSError, ValueError):
        pass
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min(total, limit) if limit else total


def choose_mode(device: torch.device, group: ShardGroup, block_bytes: Sequence[int],
                num_slots: int) -> tuple[str, str]:
    """The mode ``mode="auto"`` runs, and why: both modes simulated with the measured
    bandwidths (`dlo_fx.planning.modes`)."""
    if group.dp == 1:
        return "rank_local", "one rank in the shard group: nothing to gather"
    h2d, gather = probe_bandwidths(device, group)
    figures = predict_modes(block_bytes, dp=group.dp, num_slots=num_slots, h2d_gbps=h2d,
                            gather_gbps=min(gather, 1e6))
    memory = platform.device_memory_bytes(device) or host_ram_bytes()
    mode, why = decide(figures, host_ram=host_ram_bytes(), device_memory=memory)
    reason = (f"{why} [measured H2D {h2d:.2f} GB/s, AllGather {gather:.2f} GB/s per "
              f"rank; {len(block_bytes)} blocks, {sum(block_bytes) / GB:.3f} GB, dp={group.dp}]")
    return mode, reason


def predicted_weight_bytes(mode: str, block_bytes: Sequence[int], dp: int,
                           num_slots: int) -> dict[str, int]:
    """The plan's host bytes per rank and slot bytes (`dlo_fx.planning.modes`)."""
    host, slots = weight_bytes(mode, block_bytes, dp, num_slots)
    return {"host_shard_bytes": host, "slot_bytes": slots}  # no activations, no residents
