"""The parts a runtime is made of, each built and driven alone, without a `Runtime`: the
host store, the lifecycle, the weight reads and the slot machine over them (one rank,
on the CPU), giving back the stored bytes exactly."""

from __future__ import annotations

import threading

import pytest
import torch

from dlo_fx.runtime.device.executor import FaultDelay
from dlo_fx.runtime.device.shared_slots import SharedSlots
from dlo_fx.runtime.slot_machine import SlotMachine
from dlo_fx.runtime.host.host_store import HostStore
from dlo_fx.runtime.lifecycle import Lifecycle
from dlo_fx.runtime.ranks.collectives import ShardGroup
from dlo_fx.runtime.weights.weight_reads import WeightReads

CPU = torch.device("cpu")


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(16, 8, generator=g)),
            torch.nn.Parameter(torch.randn(8, generator=g).to(torch.bfloat16)),
            torch.nn.Parameter(torch.randint(-9, 9, (3, 5), generator=g, dtype=torch.int32),
                               requires_grad=False)]


def _parts(fault_delay_s: float = 0.0):
    store = HostStore(alignment=64)
    shared = SharedSlots(CPU, 2)  # the parts' own slots, shared with no other test
    life = Lifecycle(shared.lock)
    group = ShardGroup(ranks=(0,), rank=0)
    reads = WeightReads(store, CPU, group, shared.executor, life)
    machine = SlotMachine(store, shared, group, None,
                          FaultDelay(fault_delay_s, shared.executor), 0, life, reads)
    blocks = [_params(0), _params(1), _params(2)]
    for i, params in enumerate(blocks):
        index = store.add_block(params, [f"b{i}.{j}" for j in range(len(params))]).index
        assert index == i
        machine.fit_slots(store.blocks[index].slot_bytes)
    return store, life, reads, machine, blocks


@pytest.mark.parametrize("fault_delay_s", [0.0, 0.001], ids=["inline-copies", "worker-copies"])
def test_slot_machine_round_trip_gives_the_stored_bytes(fault_delay_s):
    store, life, reads, machine, blocks = _parts(fault_delay_s)
    for block, params in enumerate(blocks):  # three blocks through two slots: one reused
        slot = block % 2
        machine.prefetch(block, slot)
        machine.wait(block, slot)
        for p in params:
            view = machine.view(slot, block, p)
            assert view.dtype == p.dtype and torch.equal(view, p.detach())
        # a parameter of another host block is read through the reads, as it is stored
        other = blocks[(block + 1) % 3][0]
        assert torch.equal(machine.view(slot, block, other), other.detach())
        machine.swap(slot)
    assert machine.copies == 3
    machine.drain()


def test_a_prefetch_of_the_block_a_slot_holds_copies_nothing():
    _, _, _, machine, blocks = _parts()
    machine.prefetch(0, 0)
    machine.wait(0, 0)
    machine.swap(0)
    machine.prefetch(0, 0)
    machine.wait(0, 0)
    assert machine.copies == 1
    assert torch.equal(machine.view(0, 0, blocks[0][0]), blocks[0][0].detach())


def test_weight_reads_give_the_stored_bytes():
    store, _, reads, _, blocks = _parts()
    for params in blocks:
        for p in params:
            resident = reads.resident_tensor(p)
            assert resident.dtype == p.dtype and torch.equal(resident, p.detach())
            assert reads.resident_tensor(p) is resident  # kept
            assert torch.equal(reads.host_tensor(p), p.detach())
    assert reads.resident_copy_bytes > 0
    assert reads.drop_resident([p for params in blocks for p in params]) > 0
    assert reads.resident_copy_bytes == 0
    flat = reads.eager_block(1, "b1.0")
    entry = store.entry(blocks[1][0])
    assert torch.equal(entry.value_of(flat), blocks[1][0].detach())
    unstored = torch.ones(3)
    assert reads.resident_tensor(unstored) is unstored  # not stored here: read as it is


def test_a_failure_closes_every_part():
    _, life, reads, machine, _ = _parts()
    life.check_open()
    life.fail(RuntimeError("a gather failed"))
    assert life.broken == "RuntimeError: a gather failed"
    with pytest.raises(RuntimeError, match="failed earlier.*a gather failed"):
        life.check_open()
    with pytest.raises(RuntimeError, match="failed earlier"):
        machine.wait(0, 0)
    with pytest.raises(RuntimeError, match="failed earlier"):
        reads.eager_block(0, "b0.0")


def test_lifecycle_close_and_process():
    life = Lifecycle(threading.RLock())
    assert life.in_process() and life.lock is not None
    assert life.close() and not life.close()  # the second finds it closed
    with pytest.raises(RuntimeError, match="released"):
        life.check_open()
    life.pid += 1  # as a forked child sees it
    with pytest.raises(RuntimeError, match="forked"):
        life.lock


def test_host_store_is_sharded_only_while_empty_and_closes_empty():
    store, _, _, _, blocks = _parts()
    with pytest.raises(RuntimeError, match="blocks are stored"):
        store.shard_as(pin=False, rank=0, dp=2, files=None, device=CPU)
    store.close()
    assert store.blocks == [] and blocks[0][0] not in store
    store.shard_as(pin=False, rank=1, dp=2, files=None, device=CPU)
    assert (store.rank, store.dp) == (1, 2)
