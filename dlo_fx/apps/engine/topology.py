"""Rank math of the engine: which replica a rank belongs to, and which request it runs.

Global ranks are laid out replica-major: the ``sp_size`` ranks of one sequence-parallel
group are consecutive, so replica ``d`` holds ranks ``d * sp_size ... d * sp_size +
sp_size - 1``. A DP group (the ranks a block is gathered over, one per replica) is
therefore strided: ``sp_rank, sp_rank + sp_size, ...``; never ``range(dp_size)`` unless
``sp_size == 1``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


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
        """Global ranks with ``rank``'s sp_rank, one per replica: its weight shard group."""
        sp_rank = self.sp_rank(rank)
        return tuple(sp_rank + d * self.sp_size for d in range(self.dp_size))

    def sp_group(self, rank: int) -> tuple[int, ...]:
        """Global ranks of ``rank``'s replica."""
        first = self.dp_rank(rank) * self.sp_size
        return tuple(range(first, first + self.sp_size))

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


_CONTEXT: Optional[WorkerContext] = None


def worker_context() -> Optional[WorkerContext]:
    """The engine worker this process is (rank, DP/SP groups, device), or ``None`` outside
    one. A pipeline factory that builds its own sequence-parallel groups reads it here."""
    return _CONTEXT


def set_worker_context(context: Optional[WorkerContext]) -> None:
    global _CONTEXT
    _CONTEXT = context
