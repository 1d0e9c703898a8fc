"""The worker side of the engine: build the pipeline once, then run one request per wave.

Each worker is one global rank. It reads every wave the front end broadcasts, runs
``requests[dp_rank % len(requests)]`` through its pipeline (see `Topology`), and, if it
is the first rank of its replica, posts the output. Any exception ends the worker: it
posts why (``fatal``) and stops, because after a failed or abandoned collective its
process group is unusable. The front end then fails the wave closed and starts fresh
workers. See [Note: the wave protocol] in channel.py.
"""

from __future__ import annotations

import datetime
import importlib
import logging
import os
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

import torch

from .channel import WaveChannel, encode_output
from .request import Request
from .topology import Topology, WorkerContext, set_worker_context

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSpec:
    """What every worker of an engine needs to build its pipeline."""

    pipeline: str
    """The factory, ``"package.module:function"``."""
    topology: Topology
    options: Mapping[str, Any] = field(default_factory=dict)
    """dlo options; each rank's ``shard_group`` (its DP group) and ``device`` are added
    unless given."""
    pipeline_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Keyword arguments of the factory after ``options``."""
    backend: Optional[str] = None
    """Process group backend; ``None`` follows the device."""
    device: str = "cpu"
    """Device type the pipeline computes on."""
    num_threads: Optional[int] = 1
    """``torch.set_num_threads`` of each worker; ``None`` leaves torch's default."""
    timeout_s: float = 600.0
    """Timeout of the worker's default process group."""


def split_factory(spec: str) -> tuple[str, str]:
    """``"package.module:attr"`` -> ``("package.module", "attr")``; ``ValueError`` else."""
    module_name, sep, attr = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if not sep or not module_name or not attr:
        raise ValueError(f"pipeline={spec!r} is not allowed: expected 'package.module:function'")
    return module_name, attr


def load_factory(spec: str) -> Callable[..., Any]:
    """Import ``"package.module:attr"`` and return the attribute."""
    module_name, attr = split_factory(spec)
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"pipeline={spec!r} names a {type(obj).__name__}, not a callable")
    return obj


def process_group_backend(device: str, backend: Optional[str] = None) -> str:
    """``backend`` if given; else gloo on CPU, and gloo for CPU tensors plus the device's
    own collective library for device tensors."""
    if backend:
        return backend
    kind = torch.device(device).type
    if kind == "cpu":
        return "gloo"
    import torch.distributed as dist

    native = dist.Backend.default_device_backend_map.get(kind)
    if native is None:
        raise ValueError(f"no process group backend is known for device {device!r}; pass "
                         "Engine(..., backend=...) naming one")
    return f"cpu:gloo,{kind}:{native}"


def rank_device(device: str, local_rank: int) -> str:
    """The device of the worker with ``local_rank`` on its node."""
    dev = torch.device(device)
    if dev.type == "cpu" or dev.index is not None:
        return str(dev)
    count = torch.get_device_module(dev.type).device_count()
    return f"{dev.type}:{local_rank % max(count, 1)}"


def worker_options(spec: WorkerSpec, rank: int, device: str) -> dict:
    """The dlo options of ``rank``: its DP group as shard group, its device."""
    options = dict(spec.options)
    options.setdefault("shard_group", list(spec.topology.dp_group(rank)))
    options.setdefault("device", device)
    return options


def failure_report(rank: int, topology: Topology, exc: BaseException) -> dict:
    frames = traceback.extract_tb(exc.__traceback__)
    where = f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else "?"
    return {"rank": rank, "dp_rank": topology.dp_rank(rank),
            "error": f"{type(exc).__name__}: {exc}", "where": where,
            "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))}


def describe(pipeline: Any) -> dict:
    fn = getattr(pipeline, "describe", None)
    return dict(fn()) if callable(fn) else {}


def run_worker_loop(channel: WaveChannel, spec: WorkerSpec, rank: int, device: str) -> None:
    """Build the pipeline, then serve waves until a stop message."""
    topology = spec.topology
    set_worker_context(WorkerContext(rank=rank, topology=topology, device=device))
    factory = load_factory(spec.pipeline)
    pipeline = factory(worker_options(spec, rank, device), **dict(spec.pipeline_kwargs))
    channel.post_ready(rank)
    dp_rank = topology.dp_rank(rank)
    seq = 0
    while True:
        message = channel.next_message(seq)
        if message.get("stop"):
            return
        requests = [Request.from_dict(r) for r in message["requests"]]
        index = topology.request_index(rank, len(requests))
        start = time.perf_counter()
        with torch.inference_mode():
            output = pipeline(requests[index])
        compute_s = time.perf_counter() - start
        if topology.replies(rank):
            meta = {"wave_id": message["wave_id"], "dp_rank": dp_rank, "rank": rank,
                    "request_index": index, "info": {**describe(pipeline), "pid": os.getpid(),
                                                      "compute_s": compute_s}}
            channel.post_reply(seq, dp_rank, encode_output(output, meta))
        seq += 1


def spawned_worker(rank: int, spec: WorkerSpec, host: str, port: int) -> None:
    """Entry point of a worker process started by `Engine` on this node."""
    import torch.distributed as dist

    if spec.num_threads is not None:
        torch.set_num_threads(spec.num_threads)
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    channel = WaveChannel(store)
    try:
        device = rank_device(spec.device, rank)
        if device != "cpu":
            torch.get_device_module(torch.device(device).type).set_device(device)
        dist.init_process_group(process_group_backend(device, spec.backend),
                                store=dist.PrefixStore("pg", store), rank=rank,
                                world_size=spec.topology.world_size, timeout=timeout)
        run_worker_loop(channel, spec, rank, device)
    except BaseException as exc:  # tell the front end (it logs the traceback), then stop
        report = failure_report(rank, spec.topology, exc)
        try:
            channel.post_fatal(rank, report)
        except Exception:  # the front end is gone: this log is the only trace
            log.error("dlo engine: worker rank %d failed:\n%s", rank, report["traceback"])
        os._exit(1)
    try:
        dist.destroy_process_group()
    except Exception:
        pass
