"""Rank math of the engine: which replica a rank belongs to, and which request it runs.

A replica is the ``cfg_size x sp_size`` ranks that compute one request. Global ranks are
laid out replica-major, then by guidance branch, then by sequence-parallel rank: rank
``d * cfg_size * sp_size + c * sp_size + s`` is SP rank ``s`` of guidance branch ``c``
of replica ``d``. So the ``sp_size`` ranks of one sequence-parallel group are
consecutive, a CFG pair (``cfg_size == 2``: the two ranks that compute one guidance
branch each, `dlo_fx.cfg_parallel`) is strided by ``sp_size``, and a DP group (one rank per
replica) by ``cfg_size * sp_size``; never ``range(dp_size)`` unless the replica is one
rank.

[Note: the gather group of a topology]
Each rank's weights are gathered over one group of ranks (its ``shard_group``), and every
rank of that group must run the same forwards in lock-step. The ranks of one replica
always do: they compute the same request (a CFG pair computes the two halves of the same
calls). Ranks of different replicas do because the engine runs them in waves (the forward
clock pads a shorter request, or a pipeline without one gets requests of one wave key).
`Topology.gather_group` names the choices, ``Engine(gather=...)`` and ``dlo-fx generate
--gather`` pick one:

| gather | group | host bytes per rank | lock-step needs |
| --- | --- | --- | --- |
| ``"sp"`` | the rank's SP group | 1/sp of the blocks | nothing more: one request |
| ``"cfg"`` | the rank's CFG pair | 1/cfg | nothing more: one request |
| ``"replica"`` | every rank of the replica | 1/(cfg x sp) | nothing more: one request |
| ``"dp"`` | the strided DP ranks, one per replica | 1/dp | the waves |
| ``"world"`` | every rank | 1/(dp x cfg x sp) | both |
| ``"none"`` | the rank alone (rank-local, no gather) | all | nothing |

``"auto"`` (the default) follows the design's routes (`Topology.choose_gather`): with
one rank per replica (DP_N x SP_1, no CFG split) over DP (what the engine always did: 1/dp
per rank; ``mode="auto"`` may still choose rank-local there, the planner's call on
measured bandwidths and host RAM). With a replica of several ranks, over the replica: its
ranks compute one request, so 1/(cfg x sp) per rank costs them no coupling at all (named
``"sp"`` without a CFG split, ``"cfg"`` without sequence parallelism: DP_1 x CFG_2 x SP_1
gathers over the CFG pair). With several replicas that holds when every rank's share fits
the host (the ranks on the node times 1/(cfg x sp) of the denoisers' bytes within its
RAM), which keeps the replicas independent of each other's gathers; else over the world,
the smallest share (1/(dp x cfg x sp)). ``"dp"`` is never the automatic choice with a
replica of several ranks: ``"world"`` couples the same replicas at a smaller share for
the same bytes received per rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

GATHER_CHOICES = ("sp", "cfg", "replica", "dp", "world", "none", "auto")
"""The engine's gather choices (see [Note: the gather group of a topology])."""


@dataclass(frozen=True)
class Topology:
    """``dp_size`` replicas of ``cfg_size x sp_size`` ranks each."""

    dp_size: int
    sp_size: int = 1
    cfg_size: int = 1
    """Ranks a batched guidance call is split over: 1, or 2 (one guidance branch each)."""

    def __post_init__(self) -> None:
        for name in ("dp_size", "sp_size", "cfg_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} is not allowed: expected an integer >= 1")
        if self.cfg_size > 2:
            raise ValueError(f"cfg_size={self.cfg_size} is not allowed: expected 1 or 2 (a "
                             "guidance call has two branches, the unconditional and the "
                             "conditional)")

    @property
    def replica_size(self) -> int:
        """Ranks computing one request: ``cfg_size x sp_size``."""
        return self.cfg_size * self.sp_size

    @property
    def world_size(self) -> int:
        return self.dp_size * self.replica_size

    def _check(self, rank: int) -> int:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size} ranks "
                             f"(dp_size={self.dp_size} x cfg_size={self.cfg_size} x "
                             f"sp_size={self.sp_size})")
        return rank

    def dp_rank(self, rank: int) -> int:
        """The replica ``rank`` belongs to."""
        return self._check(rank) // self.replica_size

    def cfg_rank(self, rank: int) -> int:
        """The guidance branch ``rank`` computes (0: the first half of the batch)."""
        return self._check(rank) % self.replica_size // self.sp_size

    def sp_rank(self, rank: int) -> int:
        """``rank``'s place inside its sequence-parallel group."""
        return self._check(rank) % self.sp_size

    def dp_group(self, rank: int) -> tuple[int, ...]:
        """Global ranks at ``rank``'s place in their replica, one per replica."""
        place = self._check(rank) % self.replica_size
        return tuple(place + d * self.replica_size for d in range(self.dp_size))

    def sp_group(self, rank: int) -> tuple[int, ...]:
        """Global ranks that split ``rank``'s sequence (its own guidance branch)."""
        first = self._check(rank) - self.sp_rank(rank)
        return tuple(range(first, first + self.sp_size))

    def cfg_group(self, rank: int) -> tuple[int, ...]:
        """Global ranks that split ``rank``'s guidance calls (one per branch), at its SP rank."""
        first = self.dp_rank(rank) * self.replica_size + self.sp_rank(rank)
        return tuple(first + c * self.sp_size for c in range(self.cfg_size))

    def replica_group(self, rank: int) -> tuple[int, ...]:
        """Global ranks of ``rank``'s replica (every rank computing its request)."""
        first = self.dp_rank(rank) * self.replica_size
        return tuple(range(first, first + self.replica_size))

    def gather_group(self, rank: int, gather: str) -> tuple[int, ...]:
        """The global ranks ``rank``'s weights are gathered over with the choice ``gather``
        (not ``"auto"``: see `choose_gather`)."""
        _check_gather(gather)
        if gather == "sp":
            return self.sp_group(rank)
        if gather == "cfg":
            return self.cfg_group(rank)
        if gather == "replica":
            return self.replica_group(rank)
        if gather == "dp":
            return self.dp_group(rank)
        if gather == "world":
            return tuple(range(self.world_size))
        if gather == "none":
            return (self._check(rank),)
        raise ValueError("gather='auto' names no group: resolve it with Topology.choose_gather")

    def choose_gather(self, gather: str = "auto", *, sp_share_fits: bool = True) -> str:
        """``gather`` itself unless it is ``"auto"``; else the route of this topology (see
        [Note: the gather group of a topology]). ``sp_share_fits``: every rank's
        1/(cfg x sp) of the weights fits the host's RAM."""
        _check_gather(gather)
        if gather != "auto":
            return gather
        if self.replica_size == 1:
            return "dp"
        if self.dp_size > 1 and not sp_share_fits:
            return "world"
        return "sp" if self.cfg_size == 1 else "cfg" if self.sp_size == 1 else "replica"

    def replies(self, rank: int) -> bool:
        """Only the first rank of each replica replies to the front end."""
        return self._check(rank) % self.replica_size == 0

    def request_index(self, rank: int, num_requests: int) -> int:
        """Which request of a wave ``rank`` runs: ``dp_rank % num_requests``. Every rank of
        a replica picks the same one; spare replicas of a partial wave repeat a request."""
        return self.dp_rank(rank) % num_requests


@dataclass(frozen=True)
class WorkerContext:
    """Where the current worker process sits; see `worker_context`."""

    rank: int
    topology: Topology
    device: str
    progress: bool = False
    """This worker shows the denoising steps as a progress bar (see engine/progress.py)."""
    collective_timeout_s: Optional[float] = None
    """The engine's ``collective_timeout_s``: the timeout of every process group of the
    engine's device mesh and of the model's context-parallel groups (see [Note: failure
    inside a graph stays bounded] in context_parallel.py); ``None``: their own."""

    @property
    def dp_rank(self) -> int:
        return self.topology.dp_rank(self.rank)

    @property
    def sp_rank(self) -> int:
        return self.topology.sp_rank(self.rank)

    @property
    def dp_group(self) -> tuple[int, ...]:
        return self.topology.dp_group(self.rank)

    @property
    def sp_group(self) -> tuple[int, ...]:
        return self.topology.sp_group(self.rank)

    @property
    def cfg_group(self) -> tuple[int, ...]:
        """The ranks that split this rank's guidance calls (``group=`` of
        `dlo_fx.cfg_parallel`, ``cfg_group=`` of `dlo_fx.compile_pipeline`)."""
        return self.topology.cfg_group(self.rank)

    @property
    def mesh(self) -> Any:
        """The engine's ``DeviceMesh`` over every rank, dimensions ``("dp", "cfg", "ring",
        "ulysses")`` of sizes ``(dp_size, cfg_size, 1, sp_size)``, built at the first read (every
        rank of the engine must read it, at the same point of its factory: see [Note: the
        engine's device mesh] in context_parallel.py)."""
        from .context_parallel import replica_mesh

        return replica_mesh(self)

    @property
    def sp_mesh(self) -> Any:
        """This rank's replica as a ``DeviceMesh`` (``mesh["ring", "ulysses"]``): the
        ``mesh=`` of diffusers' ``ContextParallelConfig``, or of `enable_context_parallel`;
        ``sp_mesh["ulysses"].get_group()`` is the replica's ProcessGroup, and
        ``shard_group=sp_mesh`` gathers the weights over it."""
        return self.mesh["ring", "ulysses"]


_CONTEXT: Optional[WorkerContext] = None


def _check_gather(gather: Any) -> None:
    if gather not in GATHER_CHOICES:
        raise ValueError(f"gather={gather!r} is not allowed: expected one of "
                         f"{', '.join(map(repr, GATHER_CHOICES))}")


def worker_context() -> Optional[WorkerContext]:
    """The engine worker this process is (rank, DP/CFG/SP groups, device, the device mesh), or
    ``None`` outside one. A pipeline factory that splits the sequence over its replica's
    ranks reads ``worker_context().sp_mesh`` here, one that splits its guidance calls
    ``worker_context().cfg_group``."""
    return _CONTEXT


def worker_cfg_group() -> Optional[tuple[int, ...]]:
    """Inside an engine worker of ``cfg_size == 2``: this rank's CFG pair; else None."""
    context = worker_context()
    if context is None or context.topology.cfg_size == 1:
        return None
    return context.cfg_group


def set_worker_context(context: Optional[WorkerContext]) -> None:
    global _CONTEXT
    _CONTEXT = context
