"""`Engine`: serve N requests at once, one per DP replica, in waves.

The AllGather of a wave gathers weights, not activations, so the DP ranks can each run a
different request while staying in lock-step for the gathers. Before any wave the engine
checks every request against the limits the pipeline declared (`Limits`). It packs the
requests into waves (any requests together when the pipeline keeps a forward clock, see
[Note: the forward clock of a wave] in clock.py; equal wave keys otherwise, see [Note: the wave
key] in request.py), broadcasts each wave to every worker and matches the replies to the
requests (see [Note: the wave protocol] in channel.py). A request that raises in its
worker gets its own error `Result`; the others of its wave complete on the same workers.

[Note: failing closed]
A wave whose collectives may be out of step ends: none of its requests is lost or answered
twice, and the next wave starts on fresh workers. A rank that dies, hangs, or leaves its
collectives out of step (an error inside a forward; any error in a pipeline without a
forward clock) leaves its peers blocked inside a weight AllGather, and the process group is
unusable afterwards. So every request of the wave that has no reply yet gets an error
`Result` (the replies that did arrive are kept), all workers of the generation are killed,
and the next wave starts a fresh generation. Worker processes and their connections are
polled every few milliseconds, so a dead worker is noticed at once, not at the timeout.
"""

from __future__ import annotations

import importlib.util
import logging
import time
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch

from ...config import split_options
from .factories import DIFFUSERS
from .limits import Limits
from .request import Request, check_wave, plan_waves
from .result import Result
from .topology import Topology
from .worker_set import LocalWorkers, WaveFailed, WorkerSet
from .worker import WorkerSpec, split_factory

log = logging.getLogger(__name__)


class Engine:
    """Run requests through ``dp_size`` replicas of a pipeline, one request per replica.

    Args:
        pipeline: the factory every worker calls to build its pipeline, as
            ``"package.module:function"`` (or that function itself). It is called as
            ``factory(options, **pipeline_kwargs)`` and returns a callable
            ``pipeline(request) -> Tensor | dict[str, Tensor]``; typically it builds or
            ``dlo_fx.load``\\ s the DiT, gives each option to its verb
            (`dlo_fx.config.split_options`: the runtime's to ``dlo_fx.load`` or
            ``dlo_fx.offload``, the compile's to ``torch.compile(model, backend="dlo",
            options=...)``) and wraps the model in a sampling loop. An optional
            ``pipeline.describe() -> dict`` is attached to every reply as `Result.info`;
            an optional ``pipeline.limits`` (`Limits`) declares what it serves;
            ``clock``, ``forwards``, ``graph_key`` and ``warmup`` let requests of any
            shapes share a wave (see [Note: the forward clock of a wave]).
        dp_size: number of replicas, i.e. requests per wave.
        sp_size: ranks per replica; each replica's ranks run the same request, and the
            diffusers factory splits its sequence over them with diffusers' context
            parallelism (a user factory: ``worker_context().sp_mesh``, see
            context_parallel.py). The diffusers factory refuses a transformer that cannot,
            naming its class, before any worker starts. Default 1.
        cfg_size: 2 to compute the guidance branches on two ranks of a replica, one
            branch each, the noise predictions exchanged (`dlo_fx.cfg_parallel`; the world
            is ``dp_size x cfg_size x sp_size``). The diffusers factory does it for a
            pipeline that calls its denoiser once with the batch [uncond; cond] (SD3,
            PixArt, Sana, LTX, ...: split) and for one that calls it once per branch (Wan,
            Flux's ``true_cfg_scale``: the two calls paired), and refuses one with a third
            call per step (LTX-2), naming it, before any worker starts; the reference
            DiT pipeline calls its model once per guided step with both branches (see
            [Note: the reference pipeline's guidance on two ranks]); a user factory reads
            ``worker_context().cfg_group``. Default 1.
        gather: the ranks each rank's weights are gathered over: ``"sp"`` (its SP group),
            ``"cfg"`` (its CFG pair), ``"replica"`` (both), ``"dp"`` (one rank per
            replica), ``"world"``, ``"none"`` (rank-local), or ``"auto"``, chosen from the
            topology (see [Note: the gather group of a topology] in topology.py). Default
            ``"auto"``.
        plan: with ``gather="auto"``, the presets of ``dlo-fx plan`` that describe the
            node and the workload (``"b300-8gpu,minimax-h3"``): the gather group is then
            the one the planner's route model chooses on their figures for this topology
            (`dlo_fx.planning.routes`, the denoisers' bytes where the engine knows them),
            kept with its reason as ``gather_reason``. ``None`` (default): the host-memory
            rule of [Note: the gather group of a topology]. The route model
            prices the dp and sp routes only: with ``cfg_size`` 2 it is refused.
        options: dlo options of both kinds (a runtime's and a compile's, as
            `compile_pipeline` takes them) handed to the factory; each rank gets its
            gather group as ``shard_group`` (``options["shard_group"]`` instead replaces
            ``"auto"``) and its ``device`` unless set.
        backend: process group backend; ``None`` follows the device (gloo on CPU).
        wave_timeout_s: a wave (and the start of a generation of workers) taking longer
            fails closed. The first wave of a generation includes compilation.
        pipeline_kwargs: extra keyword arguments of the factory (JSON-like values).
        num_threads: ``torch.set_num_threads`` of each worker (``None``: torch default).
        device: device type the workers compute on; default ``options["device"]`` or
            ``"cpu"``. Accelerator ranks use device index ``rank % device_count``.
        launcher: how a generation of workers starts; default: worker processes on this
            node. `serve` passes the ranks of a torchrun job.
        progress: rank 0 shows each request's denoising steps as a progress bar on its
            stderr (``dlo-fx generate`` on a terminal). Default False.

    Workers start on the first call (or `start`) as processes on this node; use
    `dlo_fx.apps.engine.serve` for ranks started by ``torchrun``. Use the engine as a context
    manager, or call `close`, to stop them.
    """

    def __init__(self, pipeline: Union[str, Callable[..., Any]], dp_size: int, *,
                 sp_size: int = 1, cfg_size: int = 1, gather: str = "auto",
                 options: Optional[Mapping[str, Any]] = None,
                 backend: Optional[str] = None, wave_timeout_s: float = 600.0,
                 pipeline_kwargs: Optional[Mapping[str, Any]] = None,
                 num_threads: Optional[int] = 1, device: Optional[str] = None,
                 launcher: Optional[Callable[[WorkerSpec], WorkerSet]] = None,
                 progress: bool = False, plan: Optional[str] = None) -> None:
        self.topology = Topology(dp_size, sp_size, cfg_size)
        _check_seconds("wave_timeout_s", wave_timeout_s)
        options = dict(options or {})
        split_options(options, "dlo_fx.Engine")  # a bad option fails here, not in every worker
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
        pipeline = _factory_name(pipeline)
        pipeline_kwargs = dict(pipeline_kwargs or {})
        weight_bytes = _preflight(pipeline, self.topology, pipeline_kwargs)
        self.gather_reason = "given"
        """Why the gather group is the one it is (the planner's reason with ``plan``)."""
        chosen = _gather(self.topology, gather, options, weight_bytes)
        if plan is not None and (gather != "auto" or chosen is None):
            raise ValueError(f"plan={plan!r} chooses the gather group of gather='auto', but "
                             + (f"gather={gather!r} names it" if gather != "auto" else
                                "options['shard_group'] names it") + "; pass one of them")
        if plan is not None:
            chosen, self.gather_reason = planned_gather(self.topology, plan, weight_bytes)
            log.info("dlo engine: gather over %s: %s", chosen, self.gather_reason)
        elif gather == "auto" and chosen is not None:
            self.gather_reason = "the host-memory rule of the topology"
        self.spec = WorkerSpec(pipeline=pipeline, topology=self.topology, options=options,
                               gather=chosen,
                               pipeline_kwargs=pipeline_kwargs,
                               backend=backend, device=device_type, num_threads=num_threads,
                               timeout_s=max(self.wave_timeout_s, 60.0),
                               progress=bool(progress))
        self._launch: Callable[[WorkerSpec], WorkerSet] = launcher or LocalWorkers
        self._workers: Optional[WorkerSet] = None
        self._next_wave = 0
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
    @property
    def limits(self) -> Limits:
        """What the pipeline serves, as its workers declared it (starts them if needed)."""
        self.start()
        assert self._workers is not None
        return self._workers.limits

    def _check(self, requests: Sequence[Request], what: str) -> list[Request]:
        requests = list(requests)
        for index, request in enumerate(requests):
            if not isinstance(request, Request):
                raise ValueError(f"{what} {index} is a {type(request).__name__}; expected "
                                 "dlo_fx.apps.engine.Request (Request.from_dict builds one)")
        return requests

    def run_wave(self, requests: Sequence[Request], *,
                 timeout_s: Optional[float] = None) -> list[Result]:
        """Run one wave of at most ``dp_size`` requests; one `Result` each, in order. A
        request outside the pipeline's limits, or (for a pipeline without a forward
        clock) requests that may not share a wave, raise ``ValueError`` naming the field
        before anything reaches a worker. ``timeout_s`` overrides ``wave_timeout_s``."""
        requests = self._check(requests, "request")
        if len(requests) > self.dp_size:
            check_wave(requests, self.dp_size, mixed=True)  # raises, naming the count
        timeout = self._timeout(timeout_s)
        try:
            workers = self._ensure_workers()
        except WaveFailed as exc:
            return self._failed(requests, self._take_wave(), str(exc), {}, 0.0)
        check_wave(requests, self.dp_size, mixed=workers.mixed)
        for index, request in enumerate(requests):
            workers.limits.check(request, f"request {index}")
        return self._run(workers, requests, timeout)

    def generate(self, requests: Sequence[Request], *, timeout_s: Optional[float] = None,
                 on_wave: Optional[Callable[[list[Result]], None]] = None) -> list[Result]:
        """Run any number of requests, packed into the fewest waves of at most ``dp_size``
        (see `plan_waves`); one `Result` per request, in request order. Every request is
        checked against the pipeline's limits first (``ValueError`` naming the request and
        the field, before any wave). A request that fails gets an error `Result`; a wave
        that fails closed keeps the replies that arrived, and later waves still run.
        ``on_wave(results)`` is called with each wave's results as it ends (progress)."""
        requests = self._check(requests, "request")
        timeout = self._timeout(timeout_s)
        try:
            workers = self._ensure_workers()
        except WaveFailed as exc:
            raise RuntimeError(f"dlo engine: starting the workers failed: {exc}") from None
        for index, request in enumerate(requests):
            workers.limits.check(request, f"request {index}")
        results: list[Optional[Result]] = [None] * len(requests)
        for wave in plan_waves(requests, self.dp_size, mixed=workers.mixed):
            batch = [requests[i] for i in wave]
            try:
                workers = self._ensure_workers()
                answers = self._run(workers, batch, timeout)
            except WaveFailed as exc:
                answers = self._failed(batch, self._take_wave(), str(exc), {}, 0.0)
            for index, result in zip(wave, answers):
                results[index] = result
            if on_wave is not None:
                on_wave(answers)
        return results  # type: ignore[return-value]

    def _timeout(self, timeout_s: Optional[float]) -> float:
        if timeout_s is not None:
            _check_seconds("timeout_s", timeout_s)
        return self.wave_timeout_s if timeout_s is None else float(timeout_s)

    def _take_wave(self) -> int:
        wave = self._next_wave
        self._next_wave += 1
        return wave

    def _run(self, workers: WorkerSet, requests: list[Request], timeout: float) -> list[Result]:
        wave = self._take_wave()
        n = len(requests)
        # With a forward clock a spare replica only pads; without one it repeats a request
        # (every rank must run the same forwards) and its duplicate reply is not sent.
        assign = [d if d < n else None for d in range(self.dp_size)] if workers.mixed \
            else [d % n for d in range(self.dp_size)]
        start = time.perf_counter()
        try:
            replies = workers.run(wave, requests, assign, timeout)
        except WaveFailed as exc:
            self._shutdown(kill=True)
            message = (f"wave {wave} failed closed: {exc}; the engine shut its workers down "
                       "and the next wave starts fresh ones")
            log.error("dlo engine: %s", message)
            return self._failed(requests, wave, message, exc.replies,
                                time.perf_counter() - start)
        except BaseException:  # KeyboardInterrupt, a lost channel: no worker state is trusted
            self._shutdown(kill=True)
            raise
        return self._failed(requests, wave, "", replies, time.perf_counter() - start)

    @staticmethod
    def _failed(requests: Sequence[Request], wave: int, failure: str,
                replies: Mapping[int, dict], seconds: float) -> list[Result]:
        """One `Result` per request: its reply (output or own error), else ``failure``."""
        results = []
        for index, request in enumerate(requests):
            reply = replies.get(index)
            if reply is None:
                results.append(Result(request=request, wave=wave, error=failure,
                                      seconds=seconds))
                continue
            error = reply.get("error")
            if error is not None:
                error = (f"request {index} of wave {wave} failed on dp rank "
                         f"{reply['dp_rank']}: {error}")
            results.append(Result(request=request, wave=wave, output=reply.get("output"),
                                  error=error, dp_rank=reply["dp_rank"], seconds=seconds,
                                  info=reply.get("info", {})))
        return results


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


def _preflight(pipeline: str, topology: Topology, kwargs: Mapping[str, Any]) -> Optional[int]:
    """What the front end checks of the diffusers factory before any worker starts (a
    transformer that cannot split its sequence over ``sp_size`` ranks, a pipeline whose
    guidance branches ``cfg_size`` cannot put on two ranks: ``ValueError`` naming it) and the bytes of
    its denoisers; ``None`` for any other factory."""

    if pipeline != DIFFUSERS or "path" not in kwargs:
        return None
    from .diffusers_pipeline import check_cfg_parallel, check_context_parallel, denoiser_bytes

    check_context_parallel(kwargs["path"], topology.sp_size)
    check_cfg_parallel(kwargs["path"], topology.cfg_size)
    return denoiser_bytes(kwargs["path"])


def _gather(topology: Topology, gather: str, options: Mapping[str, Any],
            weight_bytes: Optional[int]) -> Optional[str]:
    """The engine's gather choice (``None``: the options' own ``shard_group``)."""
    if "shard_group" in options:
        if gather != "auto":
            raise ValueError(f"gather={gather!r} and options['shard_group'] both name the "
                             "ranks a block is gathered over; pass one of them")
        topology.choose_gather(gather)  # checks the value
        return None
    return topology.choose_gather(gather, sp_share_fits=sp_share_fits(topology, weight_bytes))


def planned_gather(topology: Topology, plan: str,
                   weight_bytes: Optional[int] = None) -> tuple[str, str]:
    """The gather group the planner's route model (`dlo_fx.planning.routes`) chooses for
    ``topology`` on the figures of the ``dlo-fx plan`` presets ``plan`` (comma-separated,
    later ones winning), the model's size from ``weight_bytes`` where known, and why."""
    from ..study.inputs import PlanInputs
    from ..study.presets import preset_fields
    from ..study.prediction import route_inputs
    from ...planning.routes import choose_route

    if not isinstance(plan, str) or not plan.strip():
        raise ValueError(f"plan={plan!r} is not allowed: expected the names of dlo-fx plan "
                         "presets, e.g. 'b300-8gpu,minimax-h3'")
    if topology.cfg_size > 1:
        raise ValueError(f"plan={plan!r} with cfg_size={topology.cfg_size}: the planner's route "
                         "model prices the dp and sp routes only; drop plan (the topology's "
                         "rule picks the gather group) or name it with gather=")
    names = [name.strip() for name in plan.split(",") if name.strip()]
    fields: dict = dict(preset_fields(names))  # ValueError naming an unknown preset
    fields.update(dp=topology.dp_size, sp=topology.sp_size, world=None)
    if weight_bytes:
        fields["model_gb"] = weight_bytes / 1e9
    missing = [f for f in ("model_gb", "blocks") if f not in fields]
    if missing:
        raise ValueError(f"plan={plan!r} gives no {' or '.join(missing)}: add a workload "
                         "preset (dlo-fx plan --list-presets)")
    return choose_route(route_inputs(PlanInputs(**fields)))


def sp_share_fits(topology: Topology, weight_bytes: Optional[int],
                  ranks_per_node: Optional[int] = None) -> bool:
    """Whether every rank's ``1/(cfg_size x sp_size)`` of ``weight_bytes`` (its share
    gathered over its replica) fits this host's RAM, the
    ``ranks_per_node`` (default: every rank of the engine) together; ``True`` where the
    bytes are unknown."""
    if weight_bytes is None:
        return True
    from ...runtime import host_ram_bytes

    ranks = ranks_per_node or topology.world_size
    return ranks * -(-int(weight_bytes) // topology.replica_size) <= host_ram_bytes()


def _check_seconds(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name}={value!r} is not allowed: expected a number of seconds > 0")
