"""Tensor-parallel models (DTensor parameters) and diffusers' context parallelism, streamed
by dlo: gloo, several processes, many sub-cases per spawn (tests/parallel_cases.py)."""

from __future__ import annotations

import pytest
import torch

import parallel_cases
from distributed import spawn
from parallel_cpu import cpu_parallelism


def _check_streamed(r: dict, key, dp: int = 1) -> None:
    """Exact every call; every local shard stored, each rebuilt as a DTensor in the graph."""
    assert r["equal"] == [True, True], key
    assert r["dp"] == dp and r["stored"] > 0, key
    assert r["rewraps"] > 0 and r["slot_views"] > 0, key


#: sub-case of `parallel_cases.tp_cases` -> what its ValueError names
REFUSALS = {
    "gather-over-tp": ("tensor-parallel shards", "'blocks.0.up.weight'", "shard_group",
                       "rank_local"),
    "partial": ("'blocks.1.down.weight'", "Partial", "nothing was stored"),
    "storage-dtype": ("'blocks.0.up.weight'", "storage_dtype"),
    "tp-after-offload": ("'blocks.0.up.weight'", "dlo_fx.release(model) first"),
    "flux-tp-after-offload": ("FluxTransformer2DModel", "dlo_fx.release(model) first"),
}


@pytest.mark.spawned.with_args(lambda: spawn(2, parallel_cases.tp_cases))
def test_tensor_parallel_shards_stream_as_they_are(spawned):
    """TP 2, rank-local: a hand-written Megatron MLP (torch's parallelize_module) and a tiny
    Flux (diffusers' enable_parallelism with TensorParallelConfig), offloaded or stored by
    the first compiled call, each exact against the same TP model resident, two calls;
    each rank's host store holds its own shard only. Refused by name before anything is
    stored: a Partial placement, a gather over the TP ranks themselves, another storage
    dtype; tensor
    parallelism applied after the offload, on every rank before any collective."""
    for rank in (0, 1):
        r = spawned[rank]
        for key in ("offload", "compile", "uneven", "flux"):
            _check_streamed(r[key], (rank, key))
            # the host holds this rank's local shards (padded to the alignment per tensor),
            # not the whole weights
            assert r[key]["host_bytes"] < r[key]["full_bytes"], (rank, key)
            assert r[key]["local_bytes"] <= r[key]["host_bytes"], (rank, key)
        for key, words in REFUSALS.items():  # each refused by name, the model unchanged
            kind, message = r[key]
            assert kind == "ValueError" and all(w in message for w in words), (key, message)
            assert r[f"{key}-unchanged"], key
        # released, parallelized, offloaded again: exact; state_dict gives DTensors;
        # released again, the DTensors hold their real local tensors
        assert r["released-then-tp"] == {"equal": [True, True], "close-to-plain": True,
                                         "state_dict": True, "released": True}, rank


@pytest.mark.spawned.with_args(lambda: spawn(4, parallel_cases.dp_tp_cases))
def test_data_parallel_replicas_beside_tensor_parallel_gather_the_local_shard(spawned):
    """A 2 x 2 mesh (dp, tp): each rank's TP shard split 1/2 over its DP peer (the strided
    ranks) and gathered, exact; rank-local beside it for the bytes."""
    for rank in range(4):
        gathered, local = spawned[rank]["allgather"], spawned[rank]["rank_local"]
        _check_streamed(gathered, (rank, "allgather"), dp=2)
        _check_streamed(local, (rank, "rank_local"))
        assert gathered["mode"] == "allgather" and local["mode"] == "rank_local"
        assert gathered["host_bytes"] * 2 == local["host_bytes"], rank


def _check_routes(spawned, world: int) -> None:
    for rank in range(world):
        for (dp, sp, name, route), r in spawned[rank].items():
            key = (rank, dp, sp, name, route)
            assert r["equal"] == [True, True], key
            size = {"sp": sp, "dp": dp, "world": dp * sp, "rank_local": 1}[route]
            assert r["dp"] == size and r["mode"] == (
                "rank_local" if route == "rank_local" else "allgather"), key
            # 1/size of each block (padded to the alignment per block)
            assert r["host_bytes"] <= r["block_bytes"] / size + r["blocks"] * 256, key
            assert r["block_bytes"] <= r["full_bytes"] + r["stored"] * 256, key


@pytest.mark.spawned.with_args(lambda: spawn(2, parallel_cases.cp_cases, timeout=600))
def test_context_parallel_at_dp1_sp2_in_both_modes(spawned):
    """diffusers' Ulysses context parallelism on tiny Flux and Wan at (dp, sp) = (1, 2),
    weights gathered over the two sequence ranks or rank-local: exact against the same
    context-parallel model resident, two compiled calls; 1/2 of each block per rank when
    gathered."""
    _check_routes(spawned, 2)


@pytest.mark.spawned.with_args(lambda: spawn(4, parallel_cases.cp_cases, timeout=900))
def test_context_parallel_at_dp1_sp4_and_dp2_sp2_over_every_gather_group(spawned):
    """The same at (1, 4) (gathered over the four sequence ranks, and rank-local) and at
    (2, 2), gathered over the replica's sequence ranks, over the strided DP ranks, over all
    four, or rank-local."""
    _check_routes(spawned, 4)


def test_cpu_parallelism_passes_the_two_device_checks_and_restores_them():
    """The helper changes exactly what its docstring says, and only inside its block."""
    from diffusers.hooks import tensor_parallel

    count, supported = torch.accelerator.device_count, tensor_parallel._SUPPORTED_TP_DEVICES
    with cpu_parallelism():
        if not torch.accelerator.is_available():
            assert torch.accelerator.device_count() == 1
            assert "cpu" in tensor_parallel._SUPPORTED_TP_DEVICES
    assert torch.accelerator.device_count is count
    assert tensor_parallel._SUPPORTED_TP_DEVICES == supported
