"""Case functions for the ranks' agreement and the file checks (issue 40), run by
`distributed.spawn`: on every rank of a group, or in a forked child where a bug could kill
the process (a SIGBUS or SIGABRT then shows as a dead rank, not a dead pytest)."""

from __future__ import annotations

import json
import os
import shutil
import struct

import torch

import dlo_fx
from dlo_fx.runtime.device.executor import fault_delay
from dlo_fx.loading.loader import load
from dlo_fx.apps.models import ReferenceDiT
from dlo_fx.loading.shards import write_shard_dir
from dlo_fx.runtime.host.host_store import HostStore
from dlo_fx.runtime.weights.stored import is_stored
from errors import error_text
from loader_cases import SHARED, fresh, resident_dit, save_dit
from models import call, offloaded, tiny_dit

STORES = ("memory", "mmap")


def write_files(root: str) -> dict:
    """Two DiT checkpoints of the same shapes and other weights (A, B), and a dp=2 shard
    folder of each (two `dlo-fx shard` runs)."""
    a, config = save_dit(root, "a.safetensors", seed=0)
    b, _ = save_dit(root, "b.safetensors", seed=1)
    files = {"a": a, "b": b, "config": config}
    for name, path in (("a", a), ("b", b)):
        files[f"{name}2"] = os.path.join(root, f"{name}-dp2")
        write_shard_dir(ReferenceDiT, path, files[f"{name}2"], dp=2, config=config,
                        resident=SHARED)
    return files


def outcome(fn) -> object:
    """What ``fn()`` returns, or ``"ExceptionType: message"`` (Dynamo's wrapper unwrapped)."""
    try:
        return fn()
    except Exception as exc:
        return error_text(exc)


def _loaded_equal(path: str, config, options: dict, reference_path: str) -> bool:
    fresh()
    model = load(ReferenceDiT, path, config=config, options=options, resident=SHARED)
    compiled = torch.compile(model, backend="dlo")
    inputs = tiny_dit()[1]
    with torch.no_grad():
        expected = call(resident_dit(reference_path, config), inputs)
        return all(torch.equal(call(compiled, inputs), expected) for _ in range(3))


def _built_equal(options: dict, seed: int = 0) -> bool:
    fresh()
    reference, inputs = tiny_dit(seed=seed)
    model, _ = tiny_dit(seed=seed)
    compiled = torch.compile(offloaded(model, options), backend="dlo", options=options)
    with torch.no_grad():
        expected = call(reference, inputs)
        return all(torch.equal(call(compiled, inputs), expected) for _ in range(3))


def agreement_cases(rank: int, world: int, files: dict) -> dict:
    """Items 1, 2, 3 and 6 of issue 40 on two ranks, both stores. A case that must be
    refused is followed by one that must be exact: the group is still in step."""
    out: dict = {}
    config, a, b = files["config"], files["a"], files["b"]
    base = {"mode": "allgather", "collective_timeout_s": 30}
    for store in STORES:
        opts = {**base, "host_store": store}
        # 1. the shard group in another order than the global ranks
        out[("order", store)] = outcome(lambda: _loaded_equal(
            a, config, {**opts, "shard_group": [1, 0]}, a))
        # 2. another checkpoint of the same shapes on rank 1
        out[("weights", store)] = outcome(lambda: _loaded_equal(
            a if rank == 0 else b, config, opts, a))
        out[("weights-after", store)] = outcome(lambda: _loaded_equal(a, config, opts, a))
        # 3. per-rank shard folders of two `dlo-fx shard` runs (a stale copy on rank 1)
        out[("shards", store)] = outcome(lambda: _loaded_equal(
            files["a2"] if rank == 0 else files["b2"], config, opts, a))
        out[("shards-after", store)] = outcome(lambda: _loaded_equal(files["a2"], config, opts, a))
        # 6. num_slots differs
        out[("slots", store)] = outcome(lambda: _loaded_equal(
            a, config, {**opts, "num_slots": 2 + rank}, a))
        out[("slots-after", store)] = outcome(lambda: _loaded_equal(
            a, config, {**opts, "num_slots": 3}, a))
    # rank-local mode gathers nothing: the order of the list changes nothing either
    out[("order", "rank-local")] = outcome(lambda: _loaded_equal(
        a, config, {**base, "mode": "rank_local", "host_store": "mmap", "shard_group": [1, 0]},
        a))
    # A model built in memory and compiled (its blocks agreed at compile)
    out[("order", "built")] = outcome(lambda: _built_equal({**base, "shard_group": [1, 0]}))
    out[("slots", "built")] = outcome(lambda: _built_equal({**base, "num_slots": 2 + rank}))
    out[("slots-after", "built")] = outcome(lambda: _built_equal({**base, "num_slots": 3}))
    out["store fails"] = _store_fails_on_one_rank(rank, base)
    fresh()
    return out


def _store_fails_on_one_rank(rank: int, options: dict) -> dict:
    """An offload whose host store fails on rank 1 only (an injected failure to pin a
    shard): both ranks raise together, the model keeps its real parameters, and offloading
    it again then compiling is exact on both (see [Note: storing blocks] in
    runtime/runtime.py)."""
    fresh()
    reference, inputs = tiny_dit()
    model, _ = tiny_dit()
    real_add = HostStore.add_block

    def failing_add(self, *args, **kw):
        raise MemoryError("pinning a host shard failed (injected)")

    if rank == 1:
        HostStore.add_block = failing_add
    try:
        first = outcome(lambda: offloaded(model, options))
    finally:
        HostStore.add_block = real_add
    intact = not any(is_stored(p) for p in model.parameters())
    with torch.no_grad():
        expected = call(reference, inputs)

        def again():
            compiled = torch.compile(offloaded(model, options), backend="dlo", options=options)
            return [torch.equal(call(compiled, inputs), expected) for _ in range(2)]

        again = outcome(again)
    return {"first": first, "intact": intact, "again": again}


# -- in a forked child ---------------------------------------------------------------------------
def rewrite_keeping_mtime(path: str, other: str) -> None:
    """``cp -p other path`` in place: the same size, another checkpoint's bytes, the old
    mtime restored (as ``cp -p``, ``tar x`` or ``touch -r`` leave it)."""
    st = os.stat(path)
    with open(other, "rb") as src, open(path, "r+b") as dst:
        dst.write(src.read())
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def serve_then_rewrite(rank: int, world: int, root: str, files: dict, shards: bool) -> list:
    """Item 5: serve A with host_store="mmap", rewrite the served file with B's bytes
    keeping its size and mtime, call twice more."""
    config = files["config"]
    work = os.path.join(root, "served")
    if shards:  # a dp=1 folder of A; its rank file rewritten with the one of B's folder
        write_shard_dir(ReferenceDiT, files["a"], work + "-a", dp=1, config=config,
                        resident=SHARED)
        write_shard_dir(ReferenceDiT, files["b"], work + "-b", dp=1, config=config,
                        resident=SHARED)
        source, target = work + "-a", os.path.join(work + "-a", "rank-00000-of-00001.safetensors")
        other = os.path.join(work + "-b", "rank-00000-of-00001.safetensors")
    else:
        source = target = work + ".safetensors"
        shutil.copy(files["a"], target)
        other = files["b"]
    options = {"host_store": "mmap"}
    model = load(ReferenceDiT, source, config=config, options=options, resident=SHARED)
    compiled = torch.compile(model, backend="dlo")
    inputs = tiny_dit()[1]
    with torch.no_grad():
        expected = call(resident_dit(files["a"], config), inputs)
        lines = [outcome(lambda: torch.equal(call(compiled, inputs), expected))]
        if shards:  # B's rank file has the same size but another shard id in its header:
            with open(other, "rb") as f:  # keep A's header, so only the weights differ
                (n,) = struct.unpack("<Q", f.read(8))
            with open(target, "rb") as f:
                head = f.read(8 + n)
            with open(other, "rb") as f:
                body = f.read()[8 + n:]
            staged = target + ".new"
            with open(staged, "wb") as f:
                f.write(head + body)
            rewrite_keeping_mtime(target, staged)
        else:
            rewrite_keeping_mtime(target, other)
        lines += [outcome(lambda: torch.equal(call(compiled, inputs), expected)) for _ in range(2)]
    return lines


def failure_stays_with_its_model(rank: int, world: int, root: str, files: dict,
                                 fault_delay_s: float) -> dict:
    """Item 7: model A (host_store="mmap", blocks large enough to be copied on the copy
    worker) hits a truncated file and raises; models on the same slots afterwards (the
    small DiT loaded with each store, whose copies run inline, and a built model) are
    exact, and A keeps raising its own error."""
    from safetensors.torch import save_file

    from dlo_fx.apps.models import example_inputs, reference_dit

    big = reference_dit(width=256, depth=2, heads=4, seed=3)
    path = os.path.join(root, f"a-{fault_delay_s}.safetensors")
    save_file({k: v.contiguous() for k, v in big.state_dict().items()}, path)
    big_inputs = example_inputs(big.config, batch=1, height=8, width=8, seed=1)
    options = {"host_store": "mmap", "num_slots": 2}
    config, inputs = files["config"], tiny_dit()[1]
    out: dict = {}
    fresh()
    with fault_delay(fault_delay_s):
        a = torch.compile(load(ReferenceDiT, path, config=big.config, options=options,
                               resident=SHARED), backend="dlo")
    with torch.no_grad():
        expected = call(big.eval(), big_inputs)
        out["a-first"] = outcome(lambda: torch.equal(call(a, big_inputs), expected))
        os.truncate(path, os.path.getsize(path) // 2)
        out["a-truncated"] = outcome(lambda: torch.equal(call(a, big_inputs), expected))
        for store in STORES:
            b = torch.compile(load(ReferenceDiT, files["b"], config=config, resident=SHARED,
                                   options={**options, "host_store": store}), backend="dlo")
            want = call(resident_dit(files["b"], config), inputs)
            out[("b", store)] = [outcome(lambda: torch.equal(call(b, inputs), want))
                                 for _ in range(2)]
        reference, built_inputs = tiny_dit(depth=2, seed=5)
        built, _ = tiny_dit(depth=2, seed=5)
        with fault_delay(fault_delay_s):
            offloaded(built, {"num_slots": 2})
        c = torch.compile(built, backend="dlo")
        want = call(reference, built_inputs)
        out["built"] = [outcome(lambda: torch.equal(call(c, built_inputs), want))
                        for _ in range(2)]
        out["a-again"] = outcome(lambda: torch.equal(call(a, big_inputs), expected))
    fresh()
    return out


def truncated_while_loading(rank: int, world: int, root: str, files: dict, store: str) -> str:
    """Item 8: the checkpoint is truncated while the load reads it (before its second
    block is stored; the first was read): a Python error naming the file, never a SIGBUS."""
    from dlo_fx.runtime.host.host_store import HostStore

    path = os.path.join(root, f"t-{store}.safetensors")
    shutil.copy(files["a"], path)
    stored = HostStore.add_block
    calls = []

    def truncate_then_store(self, *args, **kw):
        calls.append(1)
        if len(calls) == 2:
            os.truncate(path, os.path.getsize(path) // 3)
        return stored(self, *args, **kw)

    HostStore.add_block = truncate_then_store
    try:
        fresh()
        return outcome(lambda: load(ReferenceDiT, path, config=files["config"],
                                    options={"host_store": store}) and "loaded")
    finally:
        HostStore.add_block = stored


def shorten_block_in_header(path: str, block: int, by: int) -> None:
    """Make the header of a rank file give ``block.{block}`` ``by`` bytes fewer (its end
    moved down), keeping the header's length and the file's size."""
    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        meta = header[f"block.{block}"]
        meta["data_offsets"][1] -= by
        meta["shape"] = [meta["data_offsets"][1] - meta["data_offsets"][0]]
        raw = json.dumps(header, separators=(",", ":")).encode()
        assert len(raw) <= n
        f.seek(8)
        f.write(raw + b" " * (n - len(raw)))
