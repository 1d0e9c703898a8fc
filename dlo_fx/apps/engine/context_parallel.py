"""Diffusers' context parallelism over the ranks of an engine replica.

With ``sp_size > 1`` the ranks of a replica split each request's sequence: the diffusers
factory (diffusers_pipeline.py) enables diffusers' context parallelism (Ulysses: each rank
holds ``1/sp`` of the tokens, and an all-to-all before and after every attention hands it
``1/sp`` of the heads over the whole sequence) on every transformer it loads, over the
replica's device mesh. A user factory does the same with `enable_context_parallel` and
``worker_context().sp_mesh``.

[Note: the engine's device mesh]
Every worker builds one `DeviceMesh` over the engine's world, collectively (every rank at
the same point: the first `replica_mesh` of the worker), shaped ``(dp, cfg, 1, sp)`` with
the dimensions ``("dp", "cfg", "ring", "ulysses")``. The global ranks are laid out
replica-major, then by guidance branch (topology.py), so ``mesh["ring", "ulysses"]`` is
this rank's sequence-parallel ranks, ``mesh["cfg"]`` its CFG pair and ``mesh["dp"]`` its
strided DP group. The SP dimensions carry
diffusers' names because `ContextParallelConfig(mesh=...)` reads exactly those two (ring
attention over ``ring``, Ulysses over ``ulysses``; their product is the SP group). Ring
degree 1: the native attention backend, the one that runs on every device, returns no
log-sum-exp, which ring attention needs. The mesh is built from the public
``init_device_mesh``; a 1-D ``"sp"`` dimension would need torch's private ``_unflatten`` to
become the two that diffusers reads.

[Note: context parallelism on a CPU-only torch]
Diffusers 0.42 records the device each rank computes on as ``torch.device(accelerator,
rank % torch.accelerator.device_count())`` in ``ModelMixin._resolve_parallel_config``; a
torch without an accelerator counts 0 devices and that line raises ``ZeroDivisionError``
before anything else runs. `enable_context_parallel` makes the count read 1 for the
duration of ``enable_parallelism`` when (and only when) torch has no accelerator. That is
sound there: the accelerator type is then ``"cpu"``, every rank computes on the host, whose
one device is ``cpu:0`` (the device ``rank % 1`` names), and diffusers only records that
device (``ContextParallelConfig._device``, read by none of its context-parallel code). The
all-to-alls run on the mesh's process groups, gloo on the CPU. The count is swapped on
the ``torch.accelerator`` module for that call only and restored after it, also when it
raises; with an accelerator nothing is touched.

[Note: failure inside a graph stays bounded]
A rank that fails (raises, dies or hangs) inside a compiled graph leaves its peers in the
next collective of that graph: a weight AllGather of dlo's, on dlo's own group, whose
timeout is ``collective_timeout_s``; or the model's own all-to-all or all-gather, on the
groups diffusers took from the device mesh (``ulysses``, ``ring``, and ``ring x ulysses``
flattened), whose timeout is whatever those groups were made with: torch's default for
``new_group`` (30 min on gloo, 10 on NCCL), or, where a mesh dimension spans every rank
(DP1 x SP_N), the default process group itself, which the engine's workers make with the
wave timeout. A peer waiting there outlived ``collective_timeout_s`` by that much before it
raised and the wave failed closed. So the engine gives every group of its mesh
(`replica_mesh`) and every group diffusers' context parallelism runs on
(`enable_context_parallel`) the engine's ``collective_timeout_s``
(``ProcessGroup.set_timeout``: every later operation of the group): a peer raises within
it wherever it waits, reports, and the front end fails the wave closed and starts fresh
workers. Outside the engine, the model's groups are the user's: `enable_context_parallel`
with ``timeout_s=`` bounds them the same way, or ``group.set_timeout(...)`` on each; dlo's
``offload``/``load`` with a ``shard_group`` of that mesh bound only dlo's own gathers.
"""

from __future__ import annotations

import contextlib
import datetime
from typing import Any, Iterable, Iterator, Optional

import torch

MESH_DIMS = ("dp", "cfg", "ring", "ulysses")
"""The dimensions of the engine's device mesh (see [Note: the engine's device mesh])."""

_MESHES: dict = {}  # (topology, device type, id(default process group)) -> DeviceMesh
_WORKER_TIMEOUT_S: dict = {}  # id(default process group) -> the engine's collective_timeout_s


def context_parallel_refusal(cls: type, sp_size: int) -> Optional[str]:
    """Why ``cls`` cannot split its sequence over ``sp_size`` ranks with diffusers' context
    parallelism (a clause to follow the class's name), or ``None`` when it can: it must be
    a diffusers model with a context-parallel plan (``_cp_plan``)."""
    if not callable(getattr(cls, "enable_parallelism", None)):
        return ("is not a diffusers model (no enable_parallelism), so diffusers cannot split "
                f"its sequence over the sp_size={sp_size} ranks of a replica")
    if getattr(cls, "_cp_plan", None) is None:
        return ("has no context-parallel plan (_cp_plan), so diffusers cannot split its "
                f"sequence over the sp_size={sp_size} ranks of a replica")
    return None


def replica_mesh(context: Any) -> Any:
    """The engine's device mesh of the worker ``context`` (a `WorkerContext`): built once
    per worker, by every rank at the same point (see [Note: the engine's device mesh])."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("the engine's device mesh needs torch.distributed initialised: "
                           "read it inside an engine worker (worker_context())")
    topology = context.topology
    kind = torch.device(context.device).type
    key = (topology, kind, id(dist.group.WORLD))
    mesh = _MESHES.get(key)
    if mesh is None:
        _MESHES.clear()  # meshes of an earlier default process group: never used again
        _WORKER_TIMEOUT_S.clear()
        _WORKER_TIMEOUT_S[id(dist.group.WORLD)] = context.collective_timeout_s
        mesh = _MESHES[key] = init_device_mesh(
            kind, (topology.dp_size, topology.cfg_size, 1, topology.sp_size),
            mesh_dim_names=MESH_DIMS)
        bound_timeouts(mesh.get_all_groups(), context.collective_timeout_s)
    return mesh


def bound_timeouts(groups: Iterable[Any], timeout_s: Optional[float]) -> None:
    """Give every process group of ``groups`` the timeout ``timeout_s`` for its later
    operations (``None``: leave them alone); see [Note: failure inside a graph stays
    bounded]."""
    if timeout_s is None:
        return
    for group in groups:
        group.set_timeout(datetime.timedelta(seconds=float(timeout_s)))


def _context_parallel_groups(config: Any) -> list:
    """The process groups a set-up ``ContextParallelConfig`` runs the model's collectives
    on: its ring, Ulysses and flattened (ring x Ulysses) meshes'."""
    meshes = [getattr(config, name, None)
              for name in ("_ring_mesh", "_ulysses_mesh", "_flattened_mesh")]
    return [mesh.get_group() for mesh in meshes if mesh is not None]


def enable_context_parallel(transformer: torch.nn.Module, mesh: Any, *,
                            timeout_s: Optional[float] = None) -> None:
    """Split ``transformer``'s sequence over ``mesh`` with diffusers' context parallelism
    (Ulysses over the mesh's ``"ulysses"`` dimension, ring over ``"ring"``: pass
    ``worker_context().sp_mesh``), on any device, the CPU included (see [Note: context
    parallelism on a CPU-only torch]). ``ValueError`` naming the class when it has no
    context-parallel plan. Call it before ``torch.compile``; before or after
    `dlo_fx.offload` / `dlo_fx.load`, which leave the module's hooks and attention
    processors alone. ``timeout_s``: the timeout of every process group the model's
    collectives run on (pass the ``collective_timeout_s`` of dlo's options so a failed
    rank's peers raise within it); ``None``: in an engine worker that built the engine's
    mesh (`replica_mesh`, ``worker_context().sp_mesh``), the engine's
    ``collective_timeout_s``, elsewhere the groups' own (see [Note: failure inside a graph
    stays bounded])."""
    from diffusers import ContextParallelConfig

    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if "ring" not in names or "ulysses" not in names:
        raise ValueError(f"enable_context_parallel: mesh={mesh!r} has the dimensions {names}; "
                         "diffusers reads the dimensions 'ring' and 'ulysses' (pass "
                         "worker_context().sp_mesh, or a mesh of your own with both)")
    cls = type(transformer)
    why = context_parallel_refusal(cls, mesh["ring", "ulysses"].size())
    if why is not None:
        raise ValueError(f"enable_context_parallel: {cls.__module__}.{cls.__qualname__} {why}")
    config = ContextParallelConfig(ring_degree=mesh["ring"].size(),
                                   ulysses_degree=mesh["ulysses"].size(), mesh=mesh)
    with device_count_on_host():
        transformer.enable_parallelism(config=config)
    if timeout_s is None:
        import torch.distributed as dist

        timeout_s = _WORKER_TIMEOUT_S.get(id(dist.group.WORLD))
    bound_timeouts(_context_parallel_groups(config), timeout_s)


@contextlib.contextmanager
def device_count_on_host() -> Iterator[None]:
    """``torch.accelerator.device_count()`` reads 1 inside, where torch has no
    accelerator (see [Note: context parallelism on a CPU-only torch])."""
    module = torch.accelerator
    original = module.device_count
    if original() > 0:
        yield
        return
    module.device_count = lambda: 1
    try:
        yield
    finally:
        module.device_count = original
