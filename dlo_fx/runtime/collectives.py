"""The shard group: which ranks a block is gathered over, on a process group of its own.

Weight gathers never share a process group with the model's own collectives: the ranks
of the shard group get a dedicated group (``dist.new_group`` with a timeout), so a
sequence-parallel all-to-all issued by the model can never interleave with a weight
AllGather. Every rank of the group must issue the same gathers in the same order; that
is checked when a graph is scheduled (`check_same_plan`).
"""

from __future__ import annotations

import datetime
import hashlib
import json
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist


@dataclass
class ShardGroup:
    """This rank's place in the shard group (``dp == 1``: no group, nothing gathered)."""

    ranks: tuple[int, ...]
    rank: int  # index of this process in ``ranks``
    pg: Any = None  # the dedicated weight-gather process group

    @property
    def dp(self) -> int:
        return len(self.ranks)

    def describe(self) -> str:
        return f"weight group of global ranks {list(self.ranks)}"


def resolve_shard_group(spec: Any, timeout_s: float) -> ShardGroup:
    """``None`` -> WORLD when initialised (dp = 1 otherwise); a ProcessGroup or a rank list
    -> those ranks. Creates the dedicated weight group."""
    initialised = dist.is_available() and dist.is_initialized()
    if spec is None:
        if not initialised or dist.get_world_size() == 1:
            return ShardGroup(ranks=(0,), rank=0)
        ranks = tuple(range(dist.get_world_size()))
    elif isinstance(spec, (list, tuple)):
        ranks = tuple(spec)
        if len(ranks) > 1 and not initialised:
            raise ValueError(
                f"DLOConfig option 'shard_group'={list(ranks)!r} asks for dp={len(ranks)}, "
                "but torch.distributed is not initialised; call "
                "torch.distributed.init_process_group(...) on every rank first")
    else:
        if not initialised:
            raise ValueError("DLOConfig option 'shard_group' is a ProcessGroup but "
                             "torch.distributed is not initialised")
        ranks = tuple(dist.get_process_group_ranks(spec))
    if len(ranks) == 1 and not initialised:
        return ShardGroup(ranks=ranks, rank=0)
    me = dist.get_rank()
    if me not in ranks:
        raise ValueError(f"DLOConfig option 'shard_group'={list(ranks)!r} does not contain "
                         f"this process (global rank {me}); give each rank its own group")
    if len(ranks) == 1:
        return ShardGroup(ranks=ranks, rank=0)
    pg = dist.new_group(list(ranks), timeout=datetime.timedelta(seconds=timeout_s),
                        use_local_synchronization=True)
    return ShardGroup(ranks=ranks, rank=ranks.index(me), pg=pg)


# torch >= 2.13 names the in-place-capable single-tensor gather `all_gather_single`.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def gather_in_place(flat: torch.Tensor, shard_bytes: int, group: ShardGroup, what: str) -> None:
    """Complete ``flat[: dp * shard_bytes]`` from every rank's slice, in place."""
    out = flat[: shard_bytes * group.dp]
    mine = out[group.rank * shard_bytes : (group.rank + 1) * shard_bytes]
    try:
        _all_gather_single(out, mine, group=group.pg)
    except Exception as exc:  # a rank died, raised, or timed out
        raise RuntimeError(f"dlo: AllGather of {what} over the {group.describe()} failed on "
                           f"global rank {group.ranks[group.rank]}: {exc}") from exc


def exchange_json(value: Any, group: ShardGroup, what: str) -> list[Any]:
    """Every rank's ``value`` (JSON-encodable), in shard-group order.

    Two tensor all_gathers (lengths, then the padded UTF-8 bytes): unlike
    ``all_gather_object`` nothing is pickled or unpickled, and nothing beyond torch is
    needed (no numpy). Tuples come back as lists.
    """
    if group.dp == 1:
        return [json.loads(json.dumps(value))]
    from .platform import exchange_device

    device = exchange_device(group.pg)
    data = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)
    try:
        size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
        sizes = [torch.empty_like(size) for _ in range(group.dp)]
        dist.all_gather(sizes, size, group=group.pg)
        longest = max(int(s.item()) for s in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8, device=device)
        padded[: data.numel()] = data.to(device)
        every = [torch.empty_like(padded) for _ in range(group.dp)]
        dist.all_gather(every, padded, group=group.pg)
    except Exception as exc:  # a rank died, raised, or timed out
        raise RuntimeError(f"dlo: exchanging {what} over the {group.describe()} failed on "
                           f"global rank {group.ranks[group.rank]}: {exc}") from exc
    return [json.loads(bytes(t[: int(n.item())].cpu().tolist()).decode())
            for t, n in zip(every, sizes)]


def plan_digest(items: Sequence[Any]) -> str:
    return hashlib.sha256(json.dumps(list(items), default=str).encode()).hexdigest()[:16]


def check_same_plan(rows: list[tuple], group: ShardGroup, what: str) -> None:
    """Raise on every rank when the ranks' block plans differ (instead of hanging later).

    ``rows`` holds one tuple per block (e.g. parameter count, bytes, first FQN).
    """
    if group.dp == 1:
        return
    rows = json.loads(json.dumps(list(rows), default=str))  # as every rank receives them
    mine = (plan_digest(rows), rows)
    plans = exchange_json(mine, group, f"the block plans of {what}")
    if all(p[0] == mine[0] for p in plans):
        return
    for other_index, (_, other_rows) in enumerate(plans):
        if other_rows == rows:
            continue
        for b in range(max(len(rows), len(other_rows))):
            a = rows[b] if b < len(rows) else None
            o = other_rows[b] if b < len(other_rows) else None
            if a != o:
                raise ValueError(
                    f"dlo: the ranks scheduled different block plans for {what}: block {b} "
                    f"is {a} on global rank {group.ranks[group.rank]} but {o} on global rank "
                    f"{group.ranks[other_index]} (rows are parameter count, bytes, first "
                    f"FQN; {len(rows)} vs {len(other_rows)} blocks). Every rank of the "
                    f"{group.describe()} must compile the same model with the same options "
                    "and reach the same graphs (a model that branches on its data, such as "
                    "diffusers' FirstBlockCache skipping blocks on one rank only, needs "
                    "mode='rank_local')")
