"""`Engine`: serve N requests at once, one per DP replica, in waves that fail closed.

The AllGather of a wave gathers weights, not activations, so the DP ranks can each run a
different request while staying in lock-step for the gathers. The engine forms waves of
compatible requests (see [Note: the wave key] in request.py), broadcasts each wave to
every worker, and matches the replicas' replies to the requests (see [Note: the wave
protocol] in channel.py). A partial wave repeats requests on the spare replicas, so
every rank runs the same number of forwards, and drops their duplicate replies.

[Note: failing closed]
A rank that raises, dies or hangs leaves its peers blocked inside a weight AllGather,
and the process group is unusable afterwards. So the first sign of trouble (an error
posted by a worker, a worker process that exited, the wave timeout) ends the wave: every
request of it gets an error `Result` (none is lost, none is answered twice), all workers
of the generation are killed, and the next call starts a fresh generation. Worker
processes are polled every few milliseconds, so a dead worker is noticed at once, not
at the timeout.
"""

from __future__ import annotations

import importlib.util
import logging
import time
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch

from ..config import DLOConfig
from .request import Request, check_wave, plan_waves
from .result import Result
from .topology import Topology
from .workers import LocalWorkers, WaveFailed, WorkerSet
from .worker import WorkerSpec, split_factory

log = logging.getLogger(__name__)


class Engine:
    """Run requests through ``dp_size`` replicas of a pipeline, one request per replica.

    Args:
        pipeline: the factory every worker calls to build its pipeline, as
            ``"package.module:function"`` (or that function itself). It is called as
            ``factory(options, **pipeline_kwargs)`` and returns a callable
            ``pipeline(request) -> Tensor | dict[str, Tensor]``; typically it builds or
            ``dlo_fx.load``\\ s the DiT, compiles it with
            ``torch.compile(model, backend="dlo", options=options)`` and wraps it in a
            sampling loop. An optional ``pipeline.describe() -> dict`` is attached to
            every reply as `Result.info`.
        dp_size: number of replicas, i.e. requests per wave.
        sp_size: ranks per replica (sequence parallelism inside the pipeline); each
            replica's ranks run the same request. Default 1.
        options: dlo options handed to the factory; each rank gets its DP group as
            ``shard_group`` (strided when ``sp_size > 1``) and its ``device`` unless set.
        backend: process group backend; ``None`` follows the device (gloo on CPU).
        wave_timeout_s: a wave (and the start of a generation of workers) taking longer
            fails closed. The first wave of a generation includes compilation.
        pipeline_kwargs: extra keyword arguments of the factory (JSON-like values).
        num_threads: ``torch.set_num_threads`` of each worker (``None``: torch default).
        device: device type the workers compute on; default ``options["device"]`` or
            ``"cpu"``. Accelerator ranks use device index ``rank % device_count``.

    Workers start on the first call (or `start`) as processes on this node; use
    `dlo_fx.engine.serve` for ranks started by ``torchrun``. Use the engine as a context
    manager, or call `close`, to stop them.
    """

    def __init__(self, pipeline: Union[str, Callable[..., Any]], dp_size: int, *,
                 sp_size: int = 1, options: Optional[Mapping[str, Any]] = None,
                 backend: Optional[str] = None, wave_timeout_s: float = 600.0,
                 pipeline_kwargs: Optional[Mapping[str, Any]] = None,
                 num_threads: Optional[int] = 1, device: Optional[str] = None) -> None:
        self.topology = Topology(dp_size, sp_size)
        _check_seconds("wave_timeout_s", wave_timeout_s)
        options = dict(options or {})
        DLOConfig.from_options(options)  # a bad option fails here, not in every worker
        device = device or options.get("device") or "cpu"
        try:
            device_type = torch.device(device).type
        except (RuntimeError, TypeError):
            raise ValueError(f"device={device!r} is not a torch device") from None
        if num_threads is not None and (isinstance(num_threads, bool) or
                                        not isinstance(num_threads, int) or num_threads < 1):
            raise ValueError(f"num_threads={num_threads!r} is not allowed: expected an "
                             "integer >= 1 or None")
        self.wave_timeout_s = float(wave_timeout_s)
        self.spec = WorkerSpec(pipeline=_factory_name(pipeline), topology=self.topology,
                               options=options, pipeline_kwargs=dict(pipeline_kwargs or {}),
                               backend=backend, device=device_type, num_threads=num_threads,
                               timeout_s=max(self.wave_timeout_s, 60.0))
        self._launch: Callable[[WorkerSpec], WorkerSet] = LocalWorkers
        self._workers: Optional[WorkerSet] = None
        self._next_wave_id = 0
        self.generations = 0
        """How many generations of workers were started (a failed wave ends one)."""

    @property
    def dp_size(self) -> int:
        return self.topology.dp_size

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        """Start the workers and wait until every rank built its pipeline; raises
        ``RuntimeError`` when one fails to (the workers are then shut down)."""
        try:
            self._ensure_workers()
        except WaveFailed as exc:
            raise RuntimeError(f"dlo engine: starting the workers failed: {exc}") from None

    def _ensure_workers(self) -> WorkerSet:
        if self._workers is not None:
            problem = self._workers.problem()
            if problem is None:
                return self._workers
            log.warning("dlo engine: the workers broke while idle (%s); starting fresh ones",
                        problem)
            self._shutdown(kill=True)
        self.generations += 1
        try:
            self._workers = self._launch(self.spec)
            self._workers.wait_ready(self.wave_timeout_s)
        except BaseException:
            self._shutdown(kill=True)
            raise
        return self._workers

    def _shutdown(self, *, kill: bool) -> None:
        workers, self._workers = self._workers, None
        if workers is not None:
            workers.close(kill=kill)

    def close(self) -> None:
        """Stop the workers (they finish the wave in flight, if any, first)."""
        self._shutdown(kill=False)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self._shutdown(kill=True)
        except Exception:
            pass

    # -- waves --------------------------------------------------------------------------
    def run_wave(self, requests: Sequence[Request], *,
                 timeout_s: Optional[float] = None) -> list[Result]:
        """Run one wave of at most ``dp_size`` compatible requests; one `Result` each, in
        order. An incompatible wave raises ``ValueError`` naming the differing fields
        before anything reaches a worker. ``timeout_s`` overrides ``wave_timeout_s``."""
        requests = check_wave(requests, self.dp_size)
        if timeout_s is not None:
            _check_seconds("timeout_s", timeout_s)
        timeout = self.wave_timeout_s if timeout_s is None else float(timeout_s)
        wave_id = self._next_wave_id
        self._next_wave_id += 1
        start = time.perf_counter()
        try:
            workers = self._ensure_workers()
            start = time.perf_counter()
            replies = workers.run(wave_id, requests, timeout)
        except WaveFailed as exc:
            self._shutdown(kill=True)
            message = (f"wave {wave_id} failed closed: {exc}; the engine shut its workers "
                       "down and the next call starts fresh ones")
            log.error("dlo engine: %s", message)
            seconds = time.perf_counter() - start
            return [Result(request=r, wave_id=wave_id, error=message, seconds=seconds)
                    for r in requests]
        except BaseException:  # KeyboardInterrupt, a lost store: no worker state is trusted
            self._shutdown(kill=True)
            raise
        seconds = time.perf_counter() - start
        results = []
        for index, request in enumerate(requests):
            # dp_rank d ran request d % len(requests): replica `index` answers request
            # `index`; replicas >= len(requests) ran duplicates, which are dropped.
            output, meta = replies[index]
            if meta.get("wave_id") != wave_id or meta.get("request_index") != index:
                self._shutdown(kill=True)
                raise RuntimeError(f"dlo engine: reply of dp rank {index} is for wave "
                                   f"{meta.get('wave_id')} request {meta.get('request_index')}"
                                   f", expected wave {wave_id} request {index}")
            results.append(Result(request=request, wave_id=wave_id, output=output,
                                  dp_rank=index, seconds=seconds, info=meta.get("info", {})))
        return results

    def generate(self, requests: Sequence[Request], *,
                 timeout_s: Optional[float] = None) -> list[Result]:
        """Run any number of requests: compatible ones are grouped into waves of at most
        ``dp_size``; one `Result` per request, in request order. A failed wave fails
        its own requests only; later waves run on fresh workers."""
        requests = list(requests)
        for index, request in enumerate(requests):
            if not isinstance(request, Request):
                raise ValueError(f"request {index} is a {type(request).__name__}; expected "
                                 "dlo_fx.engine.Request (Request.from_dict builds one)")
        results: list[Optional[Result]] = [None] * len(requests)
        for wave in plan_waves(requests, self.dp_size):
            for index, result in zip(wave, self.run_wave([requests[i] for i in wave],
                                                         timeout_s=timeout_s)):
                results[index] = result
        return results  # type: ignore[return-value]


def _factory_name(pipeline: Union[str, Callable[..., Any]]) -> str:
    if callable(pipeline) and not isinstance(pipeline, str):
        module, name = getattr(pipeline, "__module__", None), getattr(pipeline, "__qualname__", "")
        if not module or module == "__main__" or "<" in name:
            raise ValueError(f"pipeline={pipeline!r} cannot be imported by a worker process; "
                             "define the factory at the top level of an importable module "
                             "and pass it or 'package.module:function'")
        pipeline = f"{module}:{name}"
    module, _ = split_factory(pipeline)
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        found = None
    if found is None:
        raise ValueError(f"pipeline={pipeline!r}: module {module!r} cannot be found; check "
                         "the name and that it is importable in the workers' environment")
    return pipeline


def _check_seconds(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name}={value!r} is not allowed: expected a number of seconds > 0")
