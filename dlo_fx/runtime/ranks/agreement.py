"""One agreement before the first gather: the ranks compare every fact that shapes their
collectives, once, and any difference raises `ValueError` on every rank.

[Note: one agreement before the first gather]
In allgather mode every rank must issue the same gathers, of the same sizes, into the same
places, of the same weights; otherwise a gather pairs with the wrong one (wrong outputs,
or an abort inside gloo). So, before any gather of the blocks they describe, the facts
that shape the gathers are compared in one exchange:

* the runtime's: the sorted shard group and each rank's position in it (checked against
  the order the exchange itself gathers in; a group given as ``[1, 0]`` takes positions
  from the list but orders members by global rank), the mode, ``num_slots`` (a different
  count gives a different number of wrap-around gathers), ``alignment``;
* the blocks': their layouts (every parameter's FQN, dtype, shape, strides and offset),
  the resident parameters, a sampled fingerprint of every block's weights whatever the
  store, files included (`host/fingerprint.py`), and the ``dlo-fx shard`` run the files come
  from (per-rank folders of two runs differ there).

The settings that pick a runtime's weight group (``num_slots``, the timeout, the shard
group) and the `fault_delay` test hook are compared once more, earlier, when the runtime is made and
before it takes that group (`agree_on_settings`, on a control group of the same ranks):
``dist.new_group`` pairs the ranks' calls by count, so a group made on one rank only would
pair every later exchange with something else. Both exchanges share the comparison and
its messages.

Every store of new blocks -- `dlo_fx.load`'s, a compile's, a reused graph's bound to a new
layer -- agrees once its blocks are added (`Runtime.store_blocks`, [Note: storing blocks] in
runtime.py): a rank whose store failed joins the exchange with its error, so every rank
raises together instead of waiting out the timeout. A model whose blocks are all stored
already issues no agreement (see [Note: a compile on one rank only] in graph/graph_call.py): its
blocks were agreed when they were stored. The exchange runs on the copy worker behind a
clock word, in the order of every other collective.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, Sequence

import torch

from ...config import DLOConfig
from .collectives import ShardGroup, control_group, exchange_json, shard_ranks
from ..device.executor import Executor, fault_delay_s
from ..device.shared_slots import SlotPool

__all__ = ["Agreeing", "Fact", "agree", "agree_on_settings", "compile_facts", "layout_digest",
           "runtime_facts", "weights_fact"]

_SETTINGS_LOCK = threading.Lock()


class Agreeing(Protocol):
    """What an agreement reads of a runtime (`runtime.Runtime`, which imports this module)."""

    group: ShardGroup
    mode: Optional[str]
    device: torch.device
    config: DLOConfig
    slots: SlotPool
    executor: Executor


@dataclass
class Fact:
    """One fact the ranks must share. ``blocks``: the value is a list with one item per
    block, and these are the blocks' first parameters (for messages)."""

    name: str
    value: Any  # JSON-encodable
    hint: str
    blocks: Optional[Sequence[str]] = None


def runtime_facts(runtime: Agreeing) -> list[Fact]:
    """What every runtime of the shard group must share, whatever its blocks."""
    same = ("Give every rank the same options (at dlo_fx.load, or at the first "
            "torch.compile)")
    return [
        Fact("shard group", list(runtime.group.ranks), "Give every rank the same shard_group"),
        Fact("mode", runtime.mode, same),
        Fact("num_slots", runtime.slots.num_slots, same),
        Fact("alignment", runtime.config.alignment, same),
    ]


def layout_digest(entries: Sequence[Any], padded_bytes: int) -> str:
    """A short digest of a block's layout: every entry's FQN, dtype, shape, strides,
    offset and size, and the block's padded size."""
    rows = [[e.fqn, str(e.dtype), list(e.shape), list(e.stride), e.offset, e.nbytes]
            for e in entries]
    return hashlib.sha256(json.dumps([rows, padded_bytes]).encode()).hexdigest()[:16]


def _ranks(group: ShardGroup, indices: Sequence[int]) -> str:
    ranks = [group.ranks[i] for i in indices]
    return (f"global rank {ranks[0]}" if len(ranks) == 1 else
            "global ranks " + ", ".join(str(r) for r in ranks))


def _detail(group: ShardGroup, values: Sequence[Any], show: Callable[[Any], str]) -> str:
    """``"X on global rank 0 but Y on global rank 1"``, ranks grouped by value."""
    seen: dict[str, list[int]] = {}
    for i, v in enumerate(values):
        seen.setdefault(json.dumps(v, sort_keys=True), []).append(i)
    return " but ".join(f"{show(values[ix[0]])} on {_ranks(group, ix)}" for ix in seen.values())


def _fmt(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 2**32:
        return f"{value:#x}"  # a fingerprint
    return str(value) if not isinstance(value, str) or value else "''"


def _compare(group: ShardGroup, rows: list[dict], facts: Sequence[Fact], what: str) -> None:
    for i, row in enumerate(rows):
        if row["rank"] != group.ranks[i] or row["position"] != i:
            raise ValueError(
                f"dlo: the {group.describe()} gathers global rank {row['rank']}'s slice at "
                f"position {i}, but that rank puts it at position {row['position']} (for "
                f"{what}); every rank must see the group's members in one order, sorted by "
                "global rank. Give every rank the same shard_group")
    mine = rows[group.rank]
    for k, fact in enumerate(facts):
        values = [row["facts"][k] for row in rows]
        if not all(v == mine["facts"][k] for v in values):
            raise ValueError(differing(group, fact, values, what))


def differing(group: ShardGroup, fact: Fact, values: list, what: str) -> str:
    """The message for ``fact``, whose ``values`` (one per rank of ``group``) differ: for a
    per-block fact, the first block that differs, its first parameter and each rank's
    value."""
    if fact.blocks is None or not all(isinstance(v, list) for v in values):
        return (f"dlo: the ranks of the {group.describe()} disagree on {fact.name} for "
                f"{what}: {_detail(group, values, _fmt)}. {fact.hint}")
    longest = max(len(v) for v in values)
    b = next(b for b in range(longest)
             if len({json.dumps(v[b] if b < len(v) else None) for v in values}) > 1)
    first = fact.blocks[b] if b < len(fact.blocks) else "?"
    at = [v[b] if b < len(v) else None for v in values]
    counts = "" if len({len(v) for v in values}) == 1 else (
        f" ({_detail(group, [len(v) for v in values], lambda n: f'{n} blocks')})")
    return (f"dlo: the ranks of the {group.describe()} hold different {fact.name} for "
            f"block {b} of {what} (first parameter {first!r}): "
            f"{_detail(group, at, lambda v: 'none' if v is None else _fmt(v))}{counts}. "
            f"{fact.hint}")


def agree(runtime: Agreeing, facts: Sequence[Fact], what: str,
          error: Optional[BaseException] = None) -> None:
    """Compare ``facts`` (and this rank's ``error``, if it failed) across the shard group:
    every rank raises together, ``error`` itself where it was raised, `ValueError` naming
    the fact, the block and the ranks where the ranks differ. Nothing is exchanged in
    rank-local mode or with one rank (``error`` is raised as is)."""
    group = runtime.group
    if group.dp == 1 or runtime.mode != "allgather":
        if error is not None:
            raise error
        return
    from .clock import CLOCK_WORDS, COMPILE, check_rows, exchange, word

    mine = {"rank": group.ranks[group.rank], "position": group.rank,
            "error": None if error is None else f"{type(error).__name__}: {error}",
            "names": [f.name for f in facts], "facts": [f.value for f in facts]}
    clock = [word("dlo-agreement"), 0] + [COMPILE] * (CLOCK_WORDS - 2)
    got: dict[str, list] = {}

    def task() -> None:  # a clock first: every control exchange has the same size
        check_rows(group, exchange(group, runtime.device, clock, what), what)
        got["rows"] = exchange_json(mine, group, f"the facts of {what}")

    try:
        runtime.executor.wait(runtime.executor.gather(-1, task, None))
    except BaseException:
        if error is not None:
            raise error from None
        raise
    rows = got["rows"]
    if error is not None:
        raise error
    failed = [i for i, row in enumerate(rows) if row["error"] is not None]
    if failed:
        raise ValueError(f"dlo: {what} failed on {_ranks(group, failed)} of the "
                         f"{group.describe()} ({rows[failed[0]]['error']}); every rank raises")
    if any(row["names"] != mine["names"] for row in rows):
        raise ValueError(f"dlo: the ranks of the {group.describe()} compare different facts "
                         f"for {what} (they run different versions of dlo-fx?)")
    _compare(group, rows, facts, what)


def weights_fact(fingerprints: Sequence[int], names: Sequence[str]) -> Fact:
    """The blocks' sampled fingerprints (`host/fingerprint.py`) as a fact of the ranks'
    agreement."""
    return Fact("weights", list(fingerprints), "Every rank of the shard group must load the "
                "same checkpoint (same files, same dtype); this compares sampled fingerprints, "
                "64 windows of 8 bytes per block", blocks=list(names))


def plan_fact(rows: Sequence[Sequence[Any]], hint: str) -> Fact:
    """A block plan (``rows``: parameter count, bytes, first FQN per block) as a fact of
    the ranks' agreement; ``hint`` says what makes the plans equal."""
    return Fact("block plans", [list(r) for r in rows],
                f"Rows are parameter count, bytes, first FQN. {hint}",
                blocks=[r[2] for r in rows])


def compile_facts(rows: Sequence[Sequence[Any]], resident: Sequence[str]) -> list[Fact]:
    """What the ranks compare when a compile stores new blocks, beside the blocks' layouts
    and fingerprints: the graph's block plan (``rows``: parameter count, bytes, first FQN
    per block) and the parameters it keeps resident."""
    plan = plan_fact(rows, "Every rank of the shard group must compile the same model with "
                     "the same options and reach the same graphs (a model that branches on "
                     "its data, such as diffusers' FirstBlockCache skipping blocks on one "
                     "rank only, needs mode='rank_local')")
    kept = Fact("resident parameters", sorted(resident), "Every rank must compile the same "
                "model with the same options (resident_bytes, device_budget)")
    return [plan, kept]


def agree_on_settings(config: DLOConfig, device: torch.device) -> None:
    """Before a runtime takes its weight group: compare the settings that decide which
    group, slots and executor it gets (``num_slots``, the timeout, the sorted shard group),
    with the `fault_delay` test hook, the mode, ``alignment`` and the device type, over the control group
    of its ranks, and raise `ValueError` on every rank where they differ.

    The weight group is made per slot setting (`collectives.weight_group`), and
    ``dist.new_group`` pairs the ranks' calls by count: a rank whose ``num_slots`` differs
    made a group the others did not, and every later exchange, of this model or any other,
    was paired with something else (a timeout at best; SIGABRT inside gloo when the
    gathers differed in count). The control group is made once per ranks and default
    process group, at the same point on every rank. Nothing is exchanged in rank-local
    mode (ranks independent) or without several ranks."""
    import torch.distributed as dist

    if config.mode == "rank_local" or not (dist.is_available() and dist.is_initialized()):
        return
    ranks = shard_ranks(config.shard_group)
    if len(ranks) < 2 or dist.get_rank() not in ranks:
        return  # nothing to gather, or `resolve_shard_group` refuses it
    group = control_group(ranks, config.collective_timeout_s)
    same = ("Give every rank the same options (at dlo_fx.load, or at the first "
            "torch.compile)")
    facts = [
        Fact("shard group", list(ranks), "Give every rank the same shard_group"),
        Fact("mode", config.mode or "allgather", same),
        Fact("num_slots", config.num_slots, same),
        Fact("alignment", config.alignment, same),
        Fact("collective_timeout_s", float(config.collective_timeout_s), same),
        Fact("fault_delay", fault_delay_s(), same),
        Fact("device type", str(getattr(device, "type", device)),
             "compute on the same kind of device on every rank"),
    ]
    mine = {"rank": group.ranks[group.rank], "position": group.rank, "error": None,
            "names": [f.name for f in facts], "facts": [f.value for f in facts]}
    what = "the runtime of a new model"
    with _SETTINGS_LOCK:  # one exchange at a time on the control group in this process
        rows = exchange_json(mine, group, f"the settings of {what}")
    _compare(group, rows, facts, what)
