"""Case functions for the file-backed host store run on every rank by `distributed.spawn`
(the truncation cases too: in a forked child, a SIGBUS shows as a dead rank)."""

from __future__ import annotations

import os

import torch

from dlo_fx.loading.loader import load
from dlo_fx.apps.models import ReferenceDiT
from dlo_fx.runtime.host.file_reads import FileChangedError
from dlo_fx.runtime.weights.owners import runtimes_holding

from dlo_fx.loading.shards import write_shard_dir
from loader_cases import (SHARED, compare, fresh, resident_dit, resident_wan, save_dit,
                          save_wan)
from models import call, tiny_dit, tiny_wan


def write_files(root: str) -> dict:
    """One DiT file, a sharded Wan folder, and the DiT pre-sharded for dp 1 and 2."""
    dit, config = save_dit(root)
    files = {"root": root, "dit": dit, "config": config,
             "wan": save_wan(os.path.join(root, "wan"))}
    for dp in (1, 2):
        files[f"dit{dp}"] = os.path.join(root, f"dit-dp{dp}")
        write_shard_dir(ReferenceDiT, dit, files[f"dit{dp}"], dp=dp, config=config,
                        resident=SHARED)
    return files


def store_of(model: torch.nn.Module):
    return runtimes_holding(list(model.parameters()))[0].store


def served(model: torch.nn.Module) -> dict:
    """Where the model's host shards are: anonymous bytes, and what the files served."""
    store = store_of(model)
    return {"anon_bytes": sum(b.shard.numel() for b in store.blocks),
            "file_backed": all(b.source is not None for b in store.blocks),
            "stats": dict(store.files.stats) if store.files is not None else None}


def dp2_cases(rank: int, world: int, dit_path: str, dit_config, wan_dir: str, shards2: str,
              shards1: str, broken: str) -> dict:
    out = {}
    _, dit_inputs = tiny_dit()
    _, wan_inputs = tiny_wan()
    reference = resident_dit(dit_path, dit_config)
    for key, source, options in [
        ("mmap-allgather", dit_path, {"mode": "allgather", "host_store": "mmap"}),
        ("mmap-rank-local", dit_path, {"mode": "rank_local", "host_store": "mmap"}),
        ("mmap-allgather-shards", shards2, {"mode": "allgather", "host_store": "mmap"}),
        ("mmap-allgather-shards-direct", shards2,
         {"mode": "allgather", "host_store": "mmap", "file_reads": "direct"}),
        ("memory-allgather-shards", shards2, {"mode": "allgather"}),
        ("mmap-rank-local-shards", shards1, {"mode": "rank_local", "host_store": "mmap"}),
    ]:
        fresh()
        model = load(ReferenceDiT, source, config=dit_config, options=options, resident=SHARED)
        out[key] = {**compare(model, reference, dit_inputs, options), **served(model)}
    fresh()
    from diffusers import WanTransformer3DModel

    options = {"mode": "allgather", "host_store": "mmap", "num_slots": 3}
    model = load(WanTransformer3DModel, wan_dir, options=options)
    out["wan-mmap-allgather"] = {**compare(model, resident_wan(wan_dir), wan_inputs, options),
                                 **served(model)}
    # Rank 1's shard file is missing: every rank raises, none hangs.
    fresh()
    try:
        load(ReferenceDiT, broken, config=dit_config, resident=SHARED,
             options={"mode": "allgather", "host_store": "mmap", "collective_timeout_s": 30})
        out["missing-rank-file"] = None
    except ValueError as exc:
        out["missing-rank-file"] = str(exc)
    return out


def serve_then_break(rank: int, world: int, dit_path: str, how: str, slots: int) -> list[str]:
    """Serve the DiT from ``dit_path`` with host_store="mmap", then truncate or rewrite the
    file in place and call again twice; what happened, a line per call."""
    config = tiny_dit()[0].config
    options = {"host_store": "mmap", "num_slots": slots}
    model = load(ReferenceDiT, dit_path, config=config, options=options)
    compiled = torch.compile(model, backend="dlo", options=options)
    inputs = tiny_dit()[1]
    with torch.no_grad():
        first = call(compiled, inputs)
        expected = call(resident_dit(dit_path, config), inputs)
    lines = [f"first-equal {torch.equal(first, expected)}"]
    size = os.path.getsize(dit_path)
    if how == "truncate":
        os.truncate(dit_path, size // 2)
    else:  # rewrite in place: same size, other bytes
        before = os.stat(dit_path)
        with open(dit_path, "r+b") as f:
            f.seek(size // 2)
            f.write(b"\x7f" * 4096)
        st = os.stat(dit_path)
        if how == "rewrite":
            os.utime(dit_path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
        else:  # "rewrite-same-mtime": its mtime set back, only its ctime tells
            os.utime(dit_path, ns=(before.st_atime_ns, before.st_mtime_ns))
    for attempt in range(2):
        try:
            with torch.no_grad():
                again = call(compiled, inputs)
            lines.append(f"no-error {torch.equal(again, expected)}")
        except FileChangedError as exc:
            lines.append("FileChangedError " + str(exc).replace("\n", " "))
        except RuntimeError as exc:
            lines.append("RuntimeError " + str(exc).replace("\n", " "))
    return lines


def truncated_on_one_rank(rank: int, world: int, folder: str, dit_path: str, dit_config,
                          timeout_s: float) -> list:
    """Serve the dp-2 shard folder with host_store="mmap" in allgather mode, then truncate
    rank 1's file: what each of three calls did (see [Note: a read that fails before a
    gather] in runtime/ranks/collectives.py)."""
    import time

    fresh()
    options = {"mode": "allgather", "host_store": "mmap", "collective_timeout_s": timeout_s}
    model = load(ReferenceDiT, folder, config=dit_config, options=options, resident=SHARED)
    compiled = torch.compile(model, backend="dlo", options=options)
    inputs = tiny_dit()[1]
    with torch.no_grad():
        expected = call(resident_dit(dit_path, dit_config), inputs)
    lines: list = []
    for attempt in range(3):
        if attempt == 1 and rank == 1:
            path = os.path.join(folder, "rank-00001-of-00002.safetensors")
            os.truncate(path, os.path.getsize(path) // 2)
        start = time.monotonic()
        try:
            with torch.no_grad():
                lines.append(torch.equal(call(compiled, inputs), expected))
        except Exception as exc:
            lines.append((time.monotonic() - start, f"{type(exc).__name__}: {exc}"))
    return lines
