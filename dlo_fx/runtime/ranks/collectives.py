"""The shard group: which ranks a block is gathered over, on a process group of its own.

Weight gathers never share a process group with the model's own collectives: the ranks
of the shard group get a dedicated group (``dist.new_group`` with a timeout), so a
sequence-parallel all-to-all issued by the model can never interleave with a weight
AllGather. Every rank of the group must issue the same gathers in the same order; that
is checked when blocks are stored (see [Note: one agreement before the first gather] in
agreement.py). Groups are made once and kept: the weight group per device setting and
default process group (`weight_group`), the group the ranks agree on settings over per
ranks (`control_group`).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ..host.host_store import HostStore, fill_task


@dataclass
class ShardGroup:
    """This rank's place in the shard group (``dp == 1``: no group, nothing gathered)."""

    ranks: tuple[int, ...]  # global ranks, sorted: the order of the group's members
    rank: int  # index of this process in ``ranks``
    pg: Any = None  # the dedicated weight-gather process group
    # Why this rank issues no more collectives on ``pg`` (`shard_read`), or None
    failed: Optional[str] = field(default=None, compare=False)

    @property
    def dp(self) -> int:
        return len(self.ranks)

    def describe(self) -> str:
        return f"weight group of global ranks {list(self.ranks)}"

    def check_in_step(self, what: str) -> None:
        """Raise, issuing nothing, once a read of this rank's host shard failed on it."""
        if self.failed is not None:
            raise RuntimeError(
                f"dlo: {what} over the {self.describe()} is not issued on global rank "
                f"{self.ranks[self.rank]}: reading this rank's host shard for a gather "
                f"failed before ({self.failed}), so its collectives are out of step with "
                "the other ranks' (they raise when their gather times out). Fix the cause, "
                "then load the model again in a new process")


def shard_read(store: HostStore, group: ShardGroup, flat: torch.Tensor, block: int) -> Any:
    """The read of this rank's shard of host block ``block`` into ``flat`` (`fill_task`);
    where the store is sharded (a gather of the group follows), marking ``group`` failed on
    this rank when it raises.

    [Note: a read that fails before a gather]
    A rank whose read fails (a file truncated or rewritten while ``host_store="mmap"``
    serves it) skips that block's gather, which the other ranks issue: its next collective
    on the group (a gather already queued, the next call's clock) paired with theirs --
    an abort inside gloo when the sizes differed, a silent mix of two blocks' bytes when
    they did not. Issuing the gather anyway would hand the others a stale slice with no
    error. So the rank issues no collective on the group again (`check_in_step`): it
    raises the read's error, and the others raise when their gather times out
    (``collective_timeout_s``), as when a rank dies."""
    task = fill_task(store, flat, block)
    if store.dp == 1:
        return task

    def read() -> None:
        try:
            task()
        except Exception as exc:
            if group.failed is None:
                group.failed = f"{type(exc).__name__}: {exc}"
            raise

    return read


def shard_ranks(spec: Any) -> tuple[int, ...]:
    """The global ranks the ``shard_group`` option ``spec`` names, sorted (a rank list
    needs no process group; ``None``, WORLD's ranks, and a ProcessGroup, its members, need
    torch.distributed initialised). Sorted: ``dist.new_group`` orders a group's members by
    global rank whatever order it is given, and a gather puts each member's slice at its
    place in the group. Taking the position from the list as given (``shard_group=[1,
    0]``) put every rank's slice where another rank's belongs: every output was wrong."""
    if spec is None:
        return tuple(range(dist.get_world_size()))
    if isinstance(spec, (list, tuple)):
        return tuple(sorted(spec))
    return tuple(sorted(dist.get_process_group_ranks(spec)))


def resolve_shard_group(spec: Any, timeout_s: float) -> ShardGroup:
    """``None`` -> WORLD when initialised (dp = 1 otherwise); a ProcessGroup or a rank list
    -> those ranks (`shard_ranks`). Creates the dedicated weight group."""
    initialised = dist.is_available() and dist.is_initialized()
    if not initialised and not isinstance(spec, (list, tuple)):
        if spec is None:
            return ShardGroup(ranks=(0,), rank=0)
        raise ValueError("DLOConfig option 'shard_group' is a ProcessGroup but "
                         "torch.distributed is not initialised")
    ranks = shard_ranks(spec)
    if not initialised:
        if len(ranks) > 1:
            raise ValueError(
                f"DLOConfig option 'shard_group'={list(spec)!r} asks for dp={len(ranks)}, "
                "but torch.distributed is not initialised; call "
                "torch.distributed.init_process_group(...) on every rank first")
        if ranks != (0,):
            raise ValueError(
                f"DLOConfig option 'shard_group'={list(spec)!r} names global rank {ranks[0]}, "
                "but torch.distributed is not initialised, so this process is rank 0 of no "
                "group; drop the option, give [0], or call "
                "torch.distributed.init_process_group(...) first")
        return ShardGroup(ranks=ranks, rank=0)
    me = dist.get_rank()
    if me not in ranks:
        raise ValueError(f"DLOConfig option 'shard_group'={list(ranks)!r} does not contain "
                         f"this process (global rank {me}); give each rank its own group")
    if len(ranks) == 1:
        return ShardGroup(ranks=ranks, rank=0)
    return _new_group(ranks, timeout_s)


def _new_group(ranks: tuple[int, ...], timeout_s: float) -> ShardGroup:
    """A new process group of ``ranks`` (sorted; this process among them)."""
    pg = dist.new_group(list(ranks), timeout=datetime.timedelta(seconds=timeout_s),
                        use_local_synchronization=True)
    return ShardGroup(ranks=ranks, rank=ranks.index(dist.get_rank()), pg=pg)


def weight_group(slots_key: tuple, spec: Any, timeout_s: float) -> ShardGroup:
    """The weight-gather group for ``spec`` of the runtimes on the slots ``slots_key``
    (`SharedSlots.key`): one per device setting and default process group, made the first
    time it is asked for and kept while that process group is (like the group of a global
    config). Runtimes sharing the slots' executor issue their gathers on one worker in one
    order, so they can share it; making a group per model, or again whenever the slots
    were collected, would call ``new_group`` at points that differ by rank. Keyed on the
    default process group as well: a group resolved before ``init_process_group`` (dp = 1)
    or under a group since destroyed must not serve a later compile or load."""
    key = (slots_key, None if spec is None else tuple(sorted(spec))
           if isinstance(spec, (tuple, list)) else ("group", id(spec)), float(timeout_s))
    return _kept(key, spec, lambda: resolve_shard_group(spec, timeout_s))


def control_group(ranks: tuple[int, ...], timeout_s: float) -> ShardGroup:
    """The `ShardGroup` of ``ranks`` (sorted) on which the ranks agree on a new runtime's
    settings before it takes its weight group (`agreement.agree_on_settings`): one per
    ranks and default process group, whatever the settings, so every rank makes it at the
    same point."""
    return _kept(("control", ranks), ranks, lambda: _new_group(ranks, timeout_s))


def exchange_group(ranks: tuple[int, ...], timeout_s: float) -> ShardGroup:
    """The `ShardGroup` of ``ranks`` (sorted) on which a model exchanges activations
    outside its graphs (`dlo_fx.cfg_parallel`'s guidance branches): one per ranks, timeout
    and default process group, never a weight group, so its collectives never interleave
    with a gather."""
    return _kept(("exchange", ranks, float(timeout_s)), ranks,
                 lambda: _new_group(ranks, timeout_s))


def _kept(key: tuple, spec: Any, make: Callable[[], ShardGroup]) -> ShardGroup:
    """The group kept under ``key`` and the default process group, made by ``make`` the
    first time; groups of a default process group since replaced are dropped."""
    world = _default_process_group()
    key = (*key, id(world))
    with _LOCK:
        found = _GROUPS.get(key)
        if found is None:  # spec and world pin their ids while the entry lives
            for stale in [k for k, v in _GROUPS.items() if v[1] is not world]:
                del _GROUPS[stale]  # groups of a world since replaced: never used again
            found = _GROUPS[key] = (spec, world, make())
    return found[2]


def _default_process_group() -> Any:
    """``torch.distributed``'s default process group, or None before it is initialised."""
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return None


_GROUPS: dict[tuple, tuple[Any, Any, ShardGroup]] = {}  # key -> (spec, world, group)
_LOCK = threading.Lock()


# torch >= 2.13 names the in-place-capable single-tensor gather `all_gather_single` (and warns
# at `all_gather_into_tensor`); every gather of one tensor into ranks x its size goes here.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def gather_in_place(flat: torch.Tensor, shard_bytes: int, group: ShardGroup, what: str) -> None:
    """Complete ``flat[: dp * shard_bytes]`` from every rank's slice, in place.

    [Note: a gather of host tensors]
    Gloo's AllGather (the backend of host tensors) is not in place: it receives into a new
    tensor of the whole output and then copies each slice out of it, so every gather of a
    block on the host held that block twice, and the host peaked a gathered block above
    its slots and shards on every rank (docs/benchmarks.md, "CPU: loading"). A host
    ``flat`` is completed by one broadcast per member instead, each from that member's
    slice into the same slice on every rank: the bytes each rank receives are the same,
    nothing is allocated or copied, and on two or four gloo ranks it took a quarter to
    one times the AllGather's time (in ascending rank order on every rank, as one
    collective). A device tensor keeps the device's AllGather, which is in place."""
    out = flat[: shard_bytes * group.dp]
    mine = out[group.rank * shard_bytes : (group.rank + 1) * shard_bytes]
    group.check_in_step(f"the AllGather of {what}")
    try:
        if out.device.type == "cpu":
            for i, source in enumerate(group.ranks):
                dist.broadcast(out[i * shard_bytes : (i + 1) * shard_bytes], src=source,
                               group=group.pg)
        else:
            all_gather_single(out, mine, group=group.pg)
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
    from ..device.platform import exchange_device

    device = exchange_device(group.pg)
    group.check_in_step(f"exchanging {what}")
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
