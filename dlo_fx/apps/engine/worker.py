"""The worker side of the engine: build the pipeline once, then serve waves.

Each worker is one global rank. It reads every wave the front end broadcasts, runs the
request its replica was given (see [Note: the forward clock of a wave] in clock.py for the
warm-up and padding forwards around it) and, if it is the first rank of its replica,
replies with the output or the error. An error that leaves the collectives out of step
(a forward cut short, a warm-up or padding forward failing, or any error in a pipeline
without a forward clock) ends the worker: it reports why (``fatal``) and stops, because
its process group is unusable. The front end then fails the wave closed and starts
fresh workers. See [Note: the wave protocol] in channel.py.
"""

from __future__ import annotations

import ctypes
import datetime
import importlib
import logging
import os
import select
import signal
import socket
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

import torch

from ...config import DLOConfig, split_options
from .channel import LocalWorker, encode_output
from .clock import keeps_clock
from .limits import Limits
from .progress import compile_seconds
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
    """dlo options; each rank's ``shard_group`` (its group under ``gather``) and ``device``
    are added unless given."""
    gather: Optional[str] = "dp"
    """The group each rank's weights are gathered over (``"sp"``, ``"dp"``, ``"world"``,
    ``"none"``: `Topology.gather_group`), or ``None`` where ``options`` give the
    ``shard_group``."""
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
    progress: bool = False
    """Rank 0 shows the denoising steps as a progress bar (engine/progress.py)."""


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
    """The dlo options of ``rank``: its gather group as shard group (see [Note: the gather
    group of a topology] in topology.py), its device."""
    options = dict(spec.options)
    if spec.gather is not None:
        options.setdefault("shard_group", list(spec.topology.gather_group(rank, spec.gather)))
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


# [Note: refused requests fail alone]
# A request its pipeline refuses before any forward fails alone, and every rank still runs
# the same forwards as its peers. Once its forwards began, a request of a pipeline without
# a forward clock cannot fail alone: its rank's collectives would fall out of step (see
# [Note: failing closed] in engine.py). A pipeline may provide ``check(request)``, which
# raises for such a request (a diffusers pipeline's own ``check_inputs``). Every rank
# checks every request of the wave, deterministically, so all agree on the refused set
# without a message: the first rank assigned a refused request replies with its error, and
# every rank whose request was refused runs one of the kept requests in its place (same
# wave key, so the same forwards as its peers), its reply not sent, as a spare replica
# does. A wave whose every request is refused runs no forward.
class WaveServer:
    """One rank's pipeline and what it remembers between waves."""

    def __init__(self, channel: Any, spec: WorkerSpec, rank: int, device: str) -> None:
        self.channel = channel
        self.spec = spec
        self.rank = rank
        self.topology = spec.topology
        options = worker_options(spec, rank, device)
        timeout_s = DLOConfig.from_options(split_options(options)[0]).collective_timeout_s
        set_worker_context(WorkerContext(rank=rank, topology=self.topology, device=device,
                                         progress=spec.progress and rank == 0,
                                         collective_timeout_s=timeout_s))
        self._compile_s = compile_seconds()  # counting from here: the first wave's compile
        factory = load_factory(spec.pipeline)
        self.pipeline = factory(options, **dict(spec.pipeline_kwargs))
        self.mixed = keeps_clock(self.pipeline)
        self.limits = Limits.from_value(getattr(self.pipeline, "limits", None))
        self.warmed: set[str] = set()
        """Graph keys every rank has compiled (the ranks see the same waves, so agree)."""

    def ready(self) -> None:
        self.channel.send({"kind": "ready", "rank": self.rank, "pid": os.getpid(),
                           "mixed": self.mixed, "limits": self.limits.to_dict()})

    def serve(self) -> None:
        """Serve waves until a stop message."""
        while True:
            message = self.channel.receive()
            if message.get("kind") == "stop":
                return
            with torch.inference_mode():
                self.run_wave(message)

    def run_wave(self, message: dict) -> None:
        requests = [Request.from_dict(r) for r in message["requests"]]
        assign = message["assign"]
        dp_rank = self.topology.dp_rank(self.rank)
        index = assign[dp_rank]
        self._compile_s = compile_seconds()
        refused = self._refused(requests)
        if refused:  # see [Note: refused requests fail alone]
            if index in refused and assign.index(index) == dp_rank:
                self._reply(message, index, error=refused[index])
            kept = [i for i in range(len(requests)) if i not in refused]
            index = kept[dp_rank % len(kept)] if kept else None
        pipeline, clock = self.pipeline, getattr(self.pipeline, "clock", None)
        target = begin = 0
        if self.mixed:
            for request in requests:
                key = str(pipeline.graph_key(request))
                if key not in self.warmed:
                    pipeline.warmup(request)
                    self.warmed.add(key)
            target = max(int(pipeline.forwards(r)) for r in requests)
            begin = clock.finished
        if index is not None:
            self._run_request(message, requests, index, assign.index(index) == dp_rank)
        if self.mixed:
            done = clock.finished - begin
            if done > target:
                raise RuntimeError(f"the request on dp rank {dp_rank} ran {done} forwards, more "
                                   f"than the {target} its pipeline's forwards() declared")
            clock.pad(target - done)
        self.channel.send({"kind": "done", "seq": message["seq"], "rank": self.rank})

    def _refused(self, requests: list) -> dict[int, str]:
        """Index -> error of the requests of a wave the pipeline's ``check`` refuses (every
        rank checks every request, so the ranks agree without talking)."""
        check = getattr(self.pipeline, "check", None)
        refused = {}
        if callable(check):
            for i, request in enumerate(requests):
                try:
                    check(request)
                except Exception as exc:
                    refused[i] = f"{type(exc).__name__}: {exc}"
        return refused

    def _reply(self, message: dict, index: int, error: str) -> None:
        if self.topology.replies(self.rank):
            log.warning("dlo engine: request %d of wave %d refused by the pipeline: %s", index,
                        message["wave"], error)
            self.channel.send(self._header(message, index, error=error,
                                           info={"pid": os.getpid()}), b"")

    def _header(self, message: dict, index: int, **fields: Any) -> dict:
        return {"kind": "reply", "seq": message["seq"], "wave": message["wave"],
                "index": index, "rank": self.rank, "dp_rank": self.topology.dp_rank(self.rank),
                **fields}

    def _run_request(self, message: dict, requests: list, index: int, primary: bool) -> None:
        start = time.perf_counter()
        header = self._header(message, index)
        try:
            payload = encode_output(self.pipeline(requests[index]))
        except Exception as exc:
            clock = getattr(self.pipeline, "clock", None)
            if not self.mixed or not clock.in_step:
                raise  # the collectives are out of step: see [Note: the forward clock of a wave]
            report = failure_report(self.rank, self.topology, exc)
            log.warning("dlo engine: request %d of wave %d failed on rank %d:\n%s", index,
                        message["wave"], self.rank, report["traceback"])
            header["error"] = f"{report['error']} (at {report['where']})"
            payload = b""
        header["info"] = {**describe(self.pipeline), "pid": os.getpid(),
                          "compute_s": time.perf_counter() - start,
                          "compile_s": compile_seconds() - self._compile_s}
        if primary and self.topology.replies(self.rank):
            self.channel.send(header, payload)


def watch_front_end(front_end_pid: int) -> None:
    """Exit at once when the front end dies, wherever it is in a wave.

    A worker's parent is the fork server (see [Note: workers fork from a fork server] in
    worker_set.py), which exits when the front end does: a parent-death signal covers that
    path. A thread also waits on the front end's own pid (a pidfd, so a reused pid cannot
    fool it; where there is none, ``kill(pid, 0)`` every 0.25 s)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    try:
        pidfd = os.pidfd_open(front_end_pid)
    except (AttributeError, OSError):
        pidfd = None
        if not _alive(front_end_pid):
            os._exit(1)

    def watch() -> None:
        if pidfd is not None:
            select.select([pidfd], [], [])  # readable once the process has exited
        else:
            while _alive(front_end_pid):
                time.sleep(0.25)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="dlo-engine-front-end-watch").start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def loopback_gloo() -> None:
    """Bind gloo to the loopback interface (unless the user chose one)."""
    names = {name for _, name in socket.if_nameindex()}
    if "GLOO_SOCKET_IFNAME" not in os.environ and "lo" in names:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"


def spawned_worker(rank: int, spec: WorkerSpec, address: tuple, secret: bytes,
                   rendezvous: str, front_end_pid: int, env: Mapping[str, str]) -> None:
    """Entry point of a worker process started by `Engine` on this node: forked from the
    fork server, it takes the front end's environment of the start, as a spawned process
    would (the server's is that of the first start)."""
    import torch.distributed as dist

    watch_front_end(front_end_pid)
    os.environ.clear()
    os.environ.update(env)
    if spec.num_threads is not None:
        torch.set_num_threads(spec.num_threads)
    channel = LocalWorker(address, secret, rank)
    try:
        device = rank_device(spec.device, rank)
        if device != "cpu":
            torch.get_device_module(torch.device(device).type).set_device(device)
        loopback_gloo()
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        store = dist.FileStore(rendezvous, spec.topology.world_size)
        dist.init_process_group(process_group_backend(device, spec.backend), store=store,
                                rank=rank, world_size=spec.topology.world_size,
                                timeout=timeout)
        server = WaveServer(channel, spec, rank, device)
        server.ready()
        server.serve()
    except EOFError:  # the front end closed the connection: nothing to report to
        os._exit(1)
    except BaseException as exc:  # tell the front end (it logs the traceback), then stop
        report = failure_report(rank, spec.topology, exc)
        try:
            channel.send({"kind": "fatal", "rank": rank, "report": report})
        except Exception:  # the front end is gone: this log is the only trace
            log.error("dlo engine: worker rank %d failed:\n%s", rank, report["traceback"])
        os._exit(1)
    # Stopped: exit at once. Tearing the process group down would wait on peers that
    # may already be gone, and nothing here needs flushing.
    os._exit(0)
