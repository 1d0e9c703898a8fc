"""Rank math of the engine: which replica a rank belongs to, and which request it runs.

Global ranks are laid out replica-major: the ``sp_size`` ranks of one sequence-parallel
group are consecutive, so replica ``d`` holds ranks ``d * sp_size ... d * sp_size +
sp_size - 1``. A DP group (the ranks a block is gathered over, one per replica) is
therefore strided: ``sp_rank, sp_rank + sp_size, ...``; never ``range(dp_size)`` unless
``sp_size == 1``.

[Note: the gather group of a topology]
Each rank's weights are gathered over one group of ranks (its ``shard_group``), and every
rank of that group must run the same forwards in lock-step. The ranks of one replica (its
SP group) always do: they compute the same request. Ranks of different replicas do
because the engine runs them in waves (the forward clock pads a shorter request, or a
pipeline without one gets requests of one wave key). `Topology.gather_group` names the
choices, ``Engine(gather=...)`` and ``dlo-fx generate --gather`` pick one:

| gather | group | host bytes per rank | lock-step needs |
| --- | --- | --- | --- |
| ``"sp"`` | the replica's SP ranks | 1/sp of the blocks | nothing more: one request |
| ``"dp"`` | the strided DP ranks, one per replica | 1/dp | the waves |
| ``"world"`` | every rank | 1/(dp x sp) | both |
| ``"none"`` | the rank alone (rank-local, no gather) | all | nothing |

``"auto"`` (the default) follows the design's routes (`Topology.choose_gather`): DP_N x
SP_1 gathers over DP (what the engine always did: 1/dp per rank; ``mode="auto"`` may
still choose rank-local there, the planner's call on measured bandwidths and host RAM).
DP_1 x SP_M gathers over SP: its ranks compute one request, so 1/M per rank costs them no
coupling at all. DP_N x SP_M gathers over SP when every rank's 1/M fits the host (the
ranks on the node times 1/M of the denoisers' bytes within its RAM), which keeps the
replicas independent of each other's gathers; else over the world, the smallest share
(1/(N x M)). ``"dp"`` is never the automatic choice with sp > 1: ``"world"`` couples the
same replicas at a smaller share for the same bytes received per rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

GATHER_CHOICES = ("sp", "dp", "world", "none", "auto")
"""The engine's gather choices (see [Note: the gather group of a topology])."""


@dataclass(frozen=True)
class Topology:
    """``dp_size`` replicas of ``sp_size`` ranks each."""

    dp_size: int
    sp_size: int = 1

    def __post_init__(self) -> None:
        for name in ("dp_size", "sp_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} is not allowed: expected an integer >= 1")

    @property
    def world_size(self) -> int:
        return self.dp_size * self.sp_size

    def _check(self, rank: int) -> int:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size} ranks "
                             f"(dp_size={self.dp_size} x sp_size={self.sp_size})")
        return rank

    def dp_rank(self, rank: int) -> int:
        """The replica ``rank`` belongs to."""
        return self._check(rank) // self.sp_size

    def sp_rank(self, rank: int) -> int:
        """``rank``'s place inside its replica's sequence-parallel group."""
        return self._check(rank) % self.sp_size

    def dp_group(self, rank: int) -> tuple[int, ...]:
        """Global ranks with ``rank``'s sp_rank, one per replica."""
        sp_rank = self.sp_rank(rank)
        return tuple(sp_rank + d * self.sp_size for d in range(self.dp_size))

    def sp_group(self, rank: int) -> tuple[int, ...]:
        """Global ranks of ``rank``'s replica."""
        first = self.dp_rank(rank) * self.sp_size
        return tuple(range(first, first + self.sp_size))

    def gather_group(self, rank: int, gather: str) -> tuple[int, ...]:
        """The global ranks ``rank``'s weights are gathered over with the choice ``gather``
        (not ``"auto"``: see `choose_gather`)."""
        _check_gather(gather)
        if gather == "sp":
            return self.sp_group(rank)
        if gather == "dp":
            return self.dp_group(rank)
        if gather == "world":
            return tuple(range(self.world_size))
        if gather == "none":
            return (self._check(rank),)
        raise ValueError("gather='auto' names no group: resolve it with Topology.choose_gather")

    def choose_gather(self, gather: str = "auto", *, sp_share_fits: bool = True) -> str:
        """``gather`` itself unless it is ``"auto"``; else the route of this topology (see
        [Note: the gather group of a topology]). ``sp_share_fits``: every rank's 1/sp of the
        weights fits the host's RAM."""
        _check_gather(gather)
        if gather != "auto":
            return gather
        if self.sp_size == 1:
            return "dp"
        return "sp" if self.dp_size == 1 or sp_share_fits else "world"

    def replies(self, rank: int) -> bool:
        """Only the first rank of each replica replies to the front end."""
        return self.sp_rank(rank) == 0

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
    def mesh(self) -> Any:
        """The engine's ``DeviceMesh`` over every rank, dimensions ``("dp", "ring",
        "ulysses")`` of sizes ``(dp_size, 1, sp_size)``, built at the first read (every
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
    """The engine worker this process is (rank, DP/SP groups, device, the device mesh), or
    ``None`` outside one. A pipeline factory that splits the sequence over its replica's
    ranks reads ``worker_context().sp_mesh`` here."""
    return _CONTEXT


def set_worker_context(context: Optional[WorkerContext]) -> None:
    global _CONTEXT
    _CONTEXT = context
