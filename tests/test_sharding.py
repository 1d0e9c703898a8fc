"""Ranks share the weights: gloo, several processes, many sub-cases per spawn."""

from __future__ import annotations

import tempfile

import pytest
import torch

import dlo_fx
from dlo_fx import DLOConfig
from dlo_fx.planning.modes import predicted_weight_bytes
from dlo_fx.runtime.host.host_store import HostStore
from dlo_fx.runtime.device.shared_slots import SlotPool

import dist_cases
from distributed import spawn
from models import MODELS, tiny_dit


def check(results: dict, dp: int, alignment: int = 256) -> None:
    for key, r in results.items():
        if not isinstance(key, tuple) or key[0] == "mismatch":
            continue
        name, mode = key
        assert r["equal"], key
        for figure in ("host_shard_bytes", "slot_bytes"):  # the policy model, within 10%
            assert abs(r[figure] - r["predicted"][figure]) <= 0.1 * r[figure], (key, figure)
        num_slots = 3 if name == "dit-break" else 2  # dist_cases.sharding_cases' options
        assert r["slot_bytes"] == num_slots * r["max_block_bytes"], key
        if mode == "allgather":
            assert r["mode"] == "allgather" and r["dp"] == dp
            assert r["host_shard_bytes"] == r["sum_shard"], key
            assert r["host_shard_bytes"] <= r["total"] / dp + r["blocks"] * alignment, key
        else:
            assert r["mode"] == "rank_local" and r["dp"] == 1
            assert r["host_shard_bytes"] >= r["total"], key


def _sharding():
    with tempfile.TemporaryDirectory() as folder:  # rendezvous files of the later groups
        return spawn(2, dist_cases.sharding_cases, ("dit", "wan", "flux"), folder)


@pytest.mark.spawned.with_args(_sharding)
def test_two_ranks_allgather_and_rank_local_and_plan_mismatch(spawned):
    results = spawned
    for rank in (0, 1):
        kind, message = results[rank].pop("mismatch")
        assert kind == "ValueError", message
        # the first block the two budgets cut differently, named by index and parameter,
        # with each rank's row
        assert "hold different block plans for block " in message, message
        assert "on global rank 0 but " in message and "on global rank 1" in message, message
        assert "global rank" in message
        # A gather group is never reused from before init_process_group or across a
        # destroy and a new init: once it made every later allgather load rank-local.
        # Offloaded before the compile: the ranks agree at the offload, exact in both modes
        for (name, mode), r in results[rank].pop("offload").items():
            assert r["equal"], (rank, name, mode)
            assert (r["mode"], r["dp"]) == ((mode, 2) if mode == "allgather" else (mode, 1))
            assert r["slot_bytes"] == 2 * r["max_block_bytes"], (rank, name, mode)
        changes = {k: results[rank].pop(k) for k in ("before-init", "init-1", "init-2")}
        assert changes["before-init"]["equal"] and changes["before-init"]["dp"] == 1
        for key in ("init-1", "init-2"):
            assert changes[key]["equal"], (rank, key)
            assert (changes[key]["mode"], changes[key]["dp"]) == ("allgather", 2), (rank, key)
        check(results[rank], dp=2)


def test_three_ranks_shard_geometry_without_processes():
    """dp=3 is the 2-rank path with other numbers: the shard geometry (`runtime/host/layout.py`)
    decides them, so it is checked here for every rank of a 3-rank group in one process.
    A block per module of the model (``blocks.3``, ``proj_out``): each rank's host store
    keeps its shard, and the three shards written into a slot rebuild every parameter."""
    dp, num_slots, alignment = 3, 2, DLOConfig().alignment
    for name, factory in MODELS.items():
        model, _ = factory()
        originals = dict(model.named_parameters())
        groups: dict[str, list[str]] = {}
        for fqn in originals:
            parts = fqn.split(".")
            groups.setdefault(".".join(parts[:2] if parts[1:2] and parts[1].isdigit() else parts[:1]),
                              []).append(fqn)
        stores = [HostStore(alignment=alignment, rank=rank, dp=dp) for rank in range(dp)]
        alive = []  # a store keeps parameter ids: the parameters must outlive it
        for fqns in groups.values():
            for store in stores:
                params = [torch.nn.Parameter(originals[f].detach().clone(), requires_grad=False)
                          for f in fqns]
                alive.append(params)
                store.add_block(params, fqns)
        blocks = stores[0].blocks
        total = sum(b.nbytes for b in blocks)
        slots = SlotPool(num_slots, torch.device("cpu"))
        for b in blocks:
            slots.ensure(b.slot_bytes)
        for store in stores:
            assert store.host_bytes == sum(b.spec.shard_bytes for b in store.blocks), name
            assert store.host_bytes <= total / dp + len(blocks) * alignment, name
        for index, b in enumerate(blocks):  # the AllGather, by hand
            slot = index % num_slots
            for rank, store in enumerate(stores):
                start, end = b.spec.rank_range(rank)
                slots.buffers[slot][start:end].copy_(store.blocks[index].shard)
            for entry in b.entries:
                assert torch.equal(slots.view(slot, entry), originals[entry.fqn]), entry.fqn
        assert slots.total_bytes == num_slots * max(b.slot_bytes for b in blocks)
        predicted = predicted_weight_bytes("allgather", [b.nbytes for b in blocks], dp, num_slots)
        for figure, got in (("host_shard_bytes", stores[0].host_bytes),
                            ("slot_bytes", slots.total_bytes)):  # the policy model, within 10%
            assert abs(got - predicted[figure]) <= 0.1 * got, (name, figure)


@pytest.mark.spawned.with_args(lambda: spawn(4, dist_cases.group_cases))
def test_world_four_gathers_over_two_groups(spawned):
    results = spawned
    for rank in range(4):
        reason = results[rank].pop("auto_reason")
        auto = results[rank].pop("auto")
        for name, r in results[rank].items():
            assert r["equal"] and r["dp"] == 2 and r["mode"] == "allgather", (rank, name)
            assert r["host_shard_bytes"] == r["sum_shard"]
        # mode="auto": measured on the real group, decided through the policy model
        assert auto["equal"] and auto["mode"] in ("allgather", "rank_local")
        assert "measured H2D" in reason and "AllGather" in reason
    assert len({results[r]["dit"]["mode"] for r in range(4)}) == 1


HOST_GATHER_SHARD = 32 << 20


@pytest.mark.spawned.with_args(lambda: spawn(2, dist_cases.host_gather_case, HOST_GATHER_SHARD))
def test_a_host_gather_holds_no_second_copy_of_the_block(spawned):
    """A block gathered into a host slot (gloo) is completed in place: gloo's AllGather
    received into a new tensor of the whole block and copied out of it, so every rank
    peaked a whole gathered block above its slots (see [Note: a gather of host tensors]).
    The growth is read from the kernel's peak RSS (VmHWM, reset before the gather)."""
    block = 2 * HOST_GATHER_SHARD
    for rank in (0, 1):
        for turn, r in spawned[rank].items():
            assert r["equal"], (rank, turn)
        assert spawned[rank]["measured"]["peak_growth"] < block // 8, (rank, spawned[rank])


FAILURE_TIMEOUT_S = 5.0


@pytest.mark.spawned.with_args(lambda: spawn(2, dist_cases.failure_cases, FAILURE_TIMEOUT_S,
                                   allow_dead=(1,)))
def test_failed_or_dead_rank_makes_the_other_raise_within_timeout(spawned):
    timeout_s = FAILURE_TIMEOUT_S
    results = spawned
    raised = results[0]
    # A rank that raises keeps the collective clock (it completes the graph's gathers
    # without computing): the other rank's call is exact and raises nothing.
    assert raised["raise"] is None, raised["raise"]
    elapsed, message = raised["die"]  # a dead rank: the other raises within the timeout
    assert elapsed < timeout_s + 15, elapsed
    assert "AllGather of host block" in message and "weight group" in message, message
    assert message.startswith("RuntimeError: dlo: AllGather of host block "), message
    assert "over the weight group of global ranks [0, 1] failed on global rank 0: " in message
    assert 1 not in results  # rank 1 raised in the first case, then died in the second


def test_dp_above_one_without_process_group_is_a_value_error():
    model, _ = tiny_dit(depth=1)
    with pytest.raises(ValueError, match="init_process_group"):
        dlo_fx.offload(model, {"shard_group": [0, 1]})


def test_shard_group_naming_another_rank_without_process_group_is_refused():
    from dlo_fx.runtime.ranks.collectives import resolve_shard_group

    assert resolve_shard_group((0,), 30.0).ranks == (0,)
    with pytest.raises(ValueError, match=r"'shard_group'=\[5\] names global rank 5"):
        resolve_shard_group((5,), 30.0)
    model, _ = tiny_dit(depth=1)
    with pytest.raises(ValueError, match="init_process_group"):
        dlo_fx.offload(model, {"shard_group": [5]})
