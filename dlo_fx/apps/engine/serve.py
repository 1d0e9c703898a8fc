"""`serve`: the engine over ranks started by ``torchrun`` (one node or several).

Every rank of the job calls ``serve(...)`` with the same arguments. Rank 0 hosts the
front end: it gets an `Engine` back, and its own share of every wave runs on a worker
thread beside it. Every other rank serves waves until rank 0's engine closes, then gets
``None``::

    engine = dlo_fx.apps.engine.serve("my_pipelines.wan:build", sp_size=2)
    if engine is not None:          # rank 0
        with engine:
            results = engine.generate(requests)

The control plane lives in the job's rendezvous store, every message authenticated with
the job's secret (``DLO_FX_ENGINE_SECRET`` or ``DLO_FX_ENGINE_SECRET_FILE`` on every
rank; see [Note: the control plane's trust model] in channel.py), so nothing here needs
a port of its own. Workers on other nodes are not this process's
children: a dead remote rank is noticed through the collective timeout of its peers or
the wave timeout, not by polling. After a failed wave the job cannot start fresh
workers by itself; the engine then fails every later wave with a message saying so, and
``torchrun --max-restarts`` restarts the job.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import threading
from typing import Any, Callable, Mapping, Optional, Union

import torch

from .engine import Engine
from .store_channel import StoreFront, StoreWorker, secret_from_environment
from .worker_set import WaveFailed, WorkerSet
from .worker import (WaveServer, WorkerSpec, failure_report, process_group_backend,
                     rank_device)

log = logging.getLogger(__name__)


class TorchrunWorkers(WorkerSet):
    """The ranks of a torchrun job, seen from rank 0; rank 0's worker runs on a thread."""

    def __init__(self, store: Any, secret: bytes, spec: WorkerSpec, device: str) -> None:
        super().__init__(StoreFront(store, secret, spec.topology.world_size), spec)
        self._launched = False
        self._stopped = False
        channel = StoreWorker(store, secret, 0, timeout_s=spec.timeout_s)
        self._thread = threading.Thread(target=self._rank0, args=(channel, device),
                                        daemon=True, name="dlo-engine-rank0")
        self._thread.start()

    def _rank0(self, channel: StoreWorker, device: str) -> None:
        try:
            server = WaveServer(channel, self.spec, 0, device)
            server.ready()
            server.serve()
        except BaseException as exc:  # the front end, in this process, logs it
            _report(channel, failure_report(0, self.spec.topology, exc))

    def launch(self, spec: WorkerSpec) -> WorkerSet:
        if self._launched:
            raise WaveFailed("the ranks of this torchrun job were shut down after a failed "
                             "wave and cannot be restarted from inside the job; restart it "
                             "(torchrun --max-restarts does so automatically)")
        self._launched = True
        return self

    def dead(self) -> list[str]:
        if self._thread.is_alive() or self._stopped:
            return []
        return ["rank 0's worker thread stopped"]

    def close(self, *, kill: bool) -> None:
        if self._stopped:
            return
        self._stopped = True
        try:
            self.stop()  # ranks blocked in a collective fail by its timeout instead
        except Exception:
            pass
        if not kill:
            self._thread.join(timeout=10)


def _report(channel: StoreWorker, report: dict) -> None:
    """Tell the front end why this worker stops; when the control plane itself failed,
    the log is the only trace."""
    try:
        channel.send({"kind": "fatal", "rank": report["rank"], "report": report})
    except Exception as exc:
        log.error("dlo engine: worker rank %d could not report its failure (%s):\n%s",
                  report["rank"], exc, report["traceback"])


def _agreed_gather(spec: WorkerSpec) -> str:
    """``gather="auto"`` resolved alike on every rank: each node's ranks' shares of the
    weights over SP fit its RAM, on every node (one MIN all-reduce over the world)."""
    import torch.distributed as dist

    from .engine import _preflight, sp_share_fits

    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", spec.topology.world_size))
    weight_bytes = _preflight(spec.pipeline, spec.topology, spec.pipeline_kwargs)
    fits = torch.tensor([int(sp_share_fits(spec.topology, weight_bytes, ranks))])
    dist.all_reduce(fits, op=dist.ReduceOp.MIN)
    return spec.topology.choose_gather("auto", sp_share_fits=bool(fits.item()))


def serve(pipeline: Union[str, Callable[..., Any]], *, sp_size: int = 1, cfg_size: int = 1,
          gather: str = "auto",
          options: Optional[Mapping[str, Any]] = None, backend: Optional[str] = None,
          wave_timeout_s: float = 600.0, pipeline_kwargs: Optional[Mapping[str, Any]] = None,
          num_threads: Optional[int] = None, device: Optional[str] = None,
          plan: Optional[str] = None) -> Optional[Engine]:
    """Join the torchrun job described by ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/
    ``MASTER_PORT`` as one engine of ``WORLD_SIZE / (cfg_size x sp_size)`` replicas. Returns the
    `Engine` on rank 0 and ``None`` on the other ranks once it closes. The arguments are
    those of `Engine`; the control-plane secret comes from the environment (see
    `secret_from_environment`). ``gather="auto"`` is chosen alike on every node: over the
    world wherever one node's RAM cannot hold its ranks' (``LOCAL_WORLD_SIZE``) shares of
    the weights gathered over SP (see [Note: the gather group of a topology])."""
    import torch.distributed as dist

    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
               if k not in os.environ]
    if missing:
        raise ValueError(f"dlo_fx.apps.engine.serve runs under torchrun, but {', '.join(missing)} "
                         "is not set; start the script with torchrun, or use Engine(...) "
                         "on a single node")
    secret = secret_from_environment()
    world = int(os.environ["WORLD_SIZE"])
    if world % (sp_size * cfg_size):
        raise ValueError(f"cfg_size={cfg_size} x sp_size={sp_size} does not divide "
                         f"WORLD_SIZE={world}")
    replicas = world // (sp_size * cfg_size)
    common = dict(sp_size=sp_size, cfg_size=cfg_size, gather=gather, options=options,
                  backend=backend,
                  wave_timeout_s=wave_timeout_s, pipeline_kwargs=pipeline_kwargs,
                  num_threads=num_threads, device=device, plan=plan)
    spec = Engine(pipeline, replicas, **common).spec  # validates every argument
    if spec.num_threads is not None:
        torch.set_num_threads(spec.num_threads)
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    device_name = rank_device(spec.device, int(os.environ.get("LOCAL_RANK", rank)))
    if device_name != "cpu":
        torch.get_device_module(torch.device(device_name).type).set_device(device_name)
    dist.init_process_group(process_group_backend(device_name, backend),
                            store=dist.PrefixStore("pg", store), rank=rank, world_size=world,
                            timeout=timeout)
    if spec.gather is not None and gather == "auto" and plan is None:  # a plan: alike
        common["gather"] = _agreed_gather(spec)
        spec = dataclasses.replace(spec, gather=common["gather"])
    control = dist.PrefixStore("dlo_engine", store)
    if rank == 0:
        workers = TorchrunWorkers(control, secret, spec, device_name)
        return Engine(pipeline, replicas, launcher=workers.launch, **common)
    channel = StoreWorker(control, secret, rank, timeout_s=spec.timeout_s)
    try:
        server = WaveServer(channel, spec, rank, device_name)
        server.ready()
        server.serve()
    except BaseException as exc:
        log.error("dlo engine: worker rank %d failed", rank, exc_info=True)
        _report(channel, failure_report(rank, spec.topology, exc))
        raise
    finally:
        dist.destroy_process_group()
    return None
