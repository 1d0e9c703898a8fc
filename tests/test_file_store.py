"""host_store="mmap": blocks served from the checkpoint files, bit-identical to the resident
model at dp=1 and dp=2 (both modes); `dlo-fx shard` round trips; every bad input (a file
truncated or rewritten while served, a missing or foreign shard file, a manifest that does
not match) is a clear error, never a SIGBUS or a wrong output."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch

import dlo_fx
import file_store_cases
from distributed import in_child, spawn
from dlo_fx.apps import cli
from dlo_fx.loading.checkpoint import CheckpointError
from dlo_fx.config import DLOConfig
from dlo_fx.loading.loader import load
from dlo_fx.model.memory import memory_report
from dlo_fx.apps.models import ReferenceDiT
from dlo_fx.loading.shards import MANIFEST, ShardDir, tensor_offsets, write_shard_dir
from dlo_fx.runtime.weights.stored import is_stored
from file_store_cases import served
from loader_cases import SHARED, compare, fresh, resident_dit, resident_wan, stored_state
from models import tiny_dit, tiny_wan

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def shard_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, HERE]))
    return subprocess.run([sys.executable, "-m", "dlo_fx.apps.cli", "shard", *args], env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("store")
    files = file_store_cases.write_files(str(root))
    wan1 = str(root / "wan-dp1")  # through the command's entry point: the round trip
    printed = io.StringIO()  # (test_shard_command_errors runs the command as a process)
    with contextlib.redirect_stdout(printed):
        assert cli.main(["shard", files["wan"], "--dp", "1", "--out", wan1]) == 0
    assert "dp=1" in printed.getvalue()
    return {**files, "root": root, "wan1": wan1}


def test_option_is_validated():
    assert DLOConfig.from_options({"host_store": "mmap"}).host_store == "mmap"
    with pytest.raises(ValueError, match="'host_store'='disk'.*'memory', 'mmap'"):
        DLOConfig.from_options({"host_store": "disk"})


# -- bit identity, dp = 1 ----------------------------------------------------------------------
@pytest.mark.parametrize("options", [
    {"host_store": "mmap"}, {"host_store": "mmap", "num_slots": 3, "block_bytes": 40_000},
], ids=["default", "slots3-small-blocks"])
def test_dit_served_from_its_file_bit_identical(ckpts, options):
    fresh()
    model = load(ReferenceDiT, ckpts["dit"], config=ckpts["config"], options=options)
    r = compare(model, resident_dit(ckpts["dit"], ckpts["config"]), tiny_dit()[1], options)
    s = served(model)
    assert r["equal"] and s["file_backed"] and s["anon_bytes"] == 0
    stats = s["stats"]
    # The checkpoint is not in the blocks' layout (256-byte alignment, transposed fc2):
    # blocks are read tensor by tensor, fc2_weight converted, and all of it counted.
    assert stats["split_block_reads"] > 0 and stats["tensor_reads"] > stats["split_block_reads"]
    assert stats["converted"] >= 3 and stats["bytes"] > 0 and stats["split_seconds"] > 0
    report = memory_report(model)  # the shards are in files, not missing
    assert report.host_shard_bytes == 0 and report.host_file_bytes > 0
    line = next(x for x in str(report).splitlines() if x.startswith("host_shard_bytes"))
    assert "-100.0%" not in line and "read from files" in line, line


def test_wan_folder_and_dtype_cast_served_from_files(ckpts):
    from diffusers import WanTransformer3DModel

    fresh()
    options = {"host_store": "mmap"}
    model = load(WanTransformer3DModel, ckpts["wan"], options=options)
    r = compare(model, resident_wan(ckpts["wan"]), tiny_wan()[1], options)
    assert r["equal"] and served(model)["anon_bytes"] == 0
    # dtype=bfloat16: every tensor is cast while read; the same values, dtypes and strides
    # as the memory store, which casts once at load.
    states = {}
    for store in ("memory", "mmap"):
        fresh()
        model = load(WanTransformer3DModel, ckpts["wan"], options={"host_store": store},
                     dtype=torch.bfloat16)
        states[store] = stored_state(model)
    assert states["memory"].keys() == states["mmap"].keys()
    for name, value in states["memory"].items():
        other = states["mmap"][name]
        assert value.dtype == other.dtype and value.stride() == other.stride(), name
        assert torch.equal(value, other), name
    assert states["mmap"]["blocks.0.attn1.to_q.weight"].dtype == torch.bfloat16


@pytest.mark.parametrize("store", ["mmap", "memory"])
def test_pre_sharded_dp1_round_trip(ckpts, store):
    from diffusers import WanTransformer3DModel

    fresh()
    options = {"host_store": store}
    model = load(WanTransformer3DModel, ckpts["wan1"], options=options)  # config.json copied
    r = compare(model, resident_wan(ckpts["wan"]), tiny_wan()[1], options)
    assert r["equal"]
    s = served(model)
    if store == "mmap":  # already in the block layout: one read per block, no conversion
        stats = s["stats"]
        assert s["anon_bytes"] == 0 and stats["reads"] == stats["block_reads"] > 0
        assert stats["split_block_reads"] == 0 and stats["converted"] == 0
    else:
        assert s["anon_bytes"] == r["sum_shard"]
    manifest = json.loads(open(os.path.join(ckpts["wan1"], MANIFEST)).read())
    assert manifest["dp"] == 1 and manifest["mode"] == "rank_local"
    assert manifest["model"].endswith("WanTransformer3DModel")


def test_mmap_needs_a_loaded_model():
    fresh()
    model, _ = tiny_dit(depth=1)
    with pytest.raises(ValueError,
                       match="host_store='mmap' serves weights from checkpoint files"):
        dlo_fx.offload(model, {"host_store": "mmap"})
    assert not any(is_stored(p) for p in model.parameters())


# -- dp = 2 -------------------------------------------------------------------------------------
def _two_ranks():
    with tempfile.TemporaryDirectory() as root:
        files = spawn(1, in_child, file_store_cases.write_files, root)[0]
        broken = os.path.join(root, "broken")
        shutil.copytree(files["dit2"], broken)
        os.remove(os.path.join(broken, "rank-00001-of-00002.safetensors"))
        return spawn(2, file_store_cases.dp2_cases, files["dit"], files["config"], files["wan"],
                     files["dit2"], files["dit1"], broken, timeout=600)


@pytest.mark.spawned.with_args(_two_ranks)
def test_two_ranks_both_modes_from_files_and_shards(spawned):
    results = spawned
    for rank, out in results.items():
        for key in ("mmap-allgather", "mmap-rank-local", "mmap-allgather-shards",
                    "mmap-allgather-shards-direct", "memory-allgather-shards",
                    "mmap-rank-local-shards", "wan-mmap-allgather"):
            assert out[key]["equal"], (rank, key)
        for key in ("mmap-allgather", "mmap-allgather-shards", "wan-mmap-allgather"):
            assert out[key]["mode"] == "allgather" and out[key]["anon_bytes"] == 0, (rank, key)
            assert out[key]["file_backed"], (rank, key)
        assert out["mmap-rank-local"]["mode"] == "rank_local"
        shards = out["mmap-allgather-shards"]["stats"]
        assert shards["reads"] == shards["block_reads"] > 0  # its own file: one read per block
        direct = out["mmap-allgather-shards-direct"]["stats"]  # two ranks, O_DIRECT
        assert direct["direct_block_reads"] == direct["block_reads"] > 0, (rank, direct)
        assert out["memory-allgather-shards"]["anon_bytes"] == \
            out["memory-allgather-shards"]["sum_shard"]
        assert "rank-00001-of-00002.safetensors is missing" in out["missing-rank-file"]
    assert "failed on global rank 1" in results[0]["missing-rank-file"]


# -- bad inputs -----------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["truncate", "rewrite", "rewrite-same-mtime"])
def test_file_changed_while_served_is_an_error_not_sigbus(ckpts, tmp_path, how):
    path = str(tmp_path / "dit.safetensors")
    shutil.copy(ckpts["dit"], path)
    # A forked child: a SIGBUS would show as a dead rank, not take pytest down.
    lines = spawn(1, file_store_cases.serve_then_break, path, how, 2)[0]
    assert lines[0] == "first-equal True"
    word = {"truncate": "truncated or extended", "rewrite": "rewritten",
            "rewrite-same-mtime": "keeping its size and mtime (its ctime changed"}[how]
    assert lines[1].startswith("FileChangedError") and word in lines[1] and path in lines[1]
    assert "host block" in lines[1] and "rank 0" in lines[1]
    assert not any(line.startswith("no-error") for line in lines[1:]), lines


def test_a_shard_folder_of_another_configuration_names_the_folder(ckpts):
    """A model of another width than the folder was sharded from: refused, naming the
    folder and its manifest (the block tensors are in its rank files, not in the one file
    the resident tensors are read from)."""
    fresh()
    wider = dataclasses.replace(ckpts["config"], width=2 * ckpts["config"].width)
    with pytest.raises(ValueError, match=r"does not match \(the pre-sharded checkpoint "
                                         r".*dlo-shards\.json.*rank files\):\n.*shape"):
        load(ReferenceDiT, ckpts["dit1"], config=wider, options={"host_store": "mmap"},
             resident=SHARED)


def test_missing_and_foreign_shard_files(ckpts, tmp_path):
    missing = tmp_path / "missing"
    shutil.copytree(ckpts["dit1"], missing)
    os.remove(missing / "rank-00000-of-00001.safetensors")
    fresh()
    with pytest.raises(CheckpointError, match="rank-00000-of-00001.safetensors is missing"):
        load(ReferenceDiT, str(missing), config=ckpts["config"], options={"host_store": "mmap"},
             resident=SHARED)
    # Shard files of another `dlo-fx shard` run of the same checkpoint: same sizes, other id.
    other = tmp_path / "other"
    write_shard_dir(ReferenceDiT, ckpts["dit"], str(other), dp=1, config=ckpts["config"],
                    resident=SHARED)
    mixed = tmp_path / "mixed"
    shutil.copytree(ckpts["dit1"], mixed)
    shutil.copy(other / "rank-00000-of-00001.safetensors", mixed)
    with pytest.raises(CheckpointError, match="belongs to another `dlo-fx shard` output"):
        load(ReferenceDiT, str(mixed), config=ckpts["config"], options={"host_store": "mmap"},
             resident=SHARED)
    truncated = tmp_path / "truncated"
    shutil.copytree(ckpts["dit1"], truncated)
    name = truncated / "rank-00000-of-00001.safetensors"
    os.truncate(name, os.path.getsize(name) - 512)
    with pytest.raises(CheckpointError, match="has .* bytes, the manifest says"):
        load(ReferenceDiT, str(truncated), config=ckpts["config"], resident=SHARED)
    # A byte changed between the sampled windows (a bad copy): served other weights before
    changed = tmp_path / "changed"
    shutil.copytree(ckpts["dit1"], changed)
    name = str(changed / "rank-00000-of-00001.safetensors")
    start, end = tensor_offsets(name)["block.1"]
    with open(name, "r+b") as f:
        f.seek(start + (end - start) * 37 // 100 + 3)
        f.write(b"\x3f" * 64)
    for store in ("memory", "mmap"):
        with pytest.raises(CheckpointError, match=r"block\.1 differ .*\(CRC-32 of the block\)"):
            load(ReferenceDiT, str(changed), config=ckpts["config"],
                 options={"host_store": store}, resident=SHARED)
    # Rank files swapped by name: each names the rank it was written for
    swapped = tmp_path / "swapped"
    shutil.copytree(ckpts["dit2"], swapped)
    first, second = (swapped / f"rank-0000{r}-of-00002.safetensors" for r in (0, 1))
    first.rename(tmp_path / "kept")
    second.rename(first)
    (tmp_path / "kept").rename(second)
    with pytest.raises(CheckpointError, match="holds the shard of rank 1, not of rank 0"):
        ShardDir.open(swapped)._rank_file(0)


def test_manifest_that_does_not_match_names_what_differs(ckpts):
    from diffusers import WanTransformer3DModel

    fresh()
    cases = [
        (ckpts["dit1"], ReferenceDiT, {"alignment": 512}, "alignment: written for 256"),
        (ckpts["dit1"], ReferenceDiT, {"block_bytes": 40_000}, "block_bytes: written for None"),
        (ckpts["dit2"], ReferenceDiT, {}, "dp: written for 2, this load has 1"),
        (ckpts["dit1"], WanTransformer3DModel, {}, None),  # another model: its keys differ
    ]
    for folder, cls, options, words in cases:
        config = ckpts["config"] if cls is ReferenceDiT else ckpts["wan"]  # its config.json
        with pytest.raises(ValueError) as info:
            load(cls, folder, config=config, options={"host_store": "mmap", **options},
                 resident=SHARED if cls is ReferenceDiT else ())
        assert (words or "missing key") in str(info.value), (options, str(info.value))
    with pytest.raises(ValueError, match=r"resident: written for \['modulation_table'\], this load has \[\]"):
        load(ReferenceDiT, ckpts["dit1"], config=ckpts["config"])
    # The command that writes the folder for this load, its options as the CLI takes them
    with pytest.raises(ValueError) as info:
        load(ReferenceDiT, ckpts["dit1"], config=ckpts["config"], dtype=torch.bfloat16,
             options={"storage_dtype": "float8_e4m3fn", "alignment": 512}, resident=SHARED)
    assert (f"--dp 1 --out {ckpts['dit1']} --dtype bfloat16 --storage-dtype float8_e4m3fn "
            """--options '{"alignment": 512}' --resident modulation_table`""") in str(info.value)


def test_shard_command_errors(ckpts, tmp_path):
    done = shard_cli(ckpts["dit"], "--dp", "2", "--out", str(tmp_path / "x"))
    assert done.returncode != 0 and "pass --model" in done.stderr


@pytest.mark.parametrize("store", ["memory", "mmap"])
def test_shard_folder_resident_bytes_and_a_rewrite_during_the_load_are_refused(
        ckpts, tmp_path, monkeypatch, store):
    # A byte changed in common.safetensors (resident parameters, buffers): loaded other
    # values with no error before its CRC-32 was in the manifest.
    flipped = tmp_path / "common"
    shutil.copytree(ckpts["dit1"], flipped)
    common = str(flipped / "common.safetensors")
    start, _ = tensor_offsets(common)["modulation_table"]
    with open(common, "r+b") as f:
        f.seek(start + 8)
        f.write(b"\x11\x22\x33\x44")
    fresh()
    with pytest.raises(CheckpointError, match=r"bytes of common\.safetensors differ"):
        load(ReferenceDiT, str(flipped), config=ckpts["config"], options={"host_store": store},
             resident=SHARED)
    # The rank file rewritten (size and mtime kept) after its check, before the store read
    # it: served the rewritten bytes with no error.
    raced = tmp_path / "raced"
    shutil.copytree(ckpts["dit1"], raced)
    name = str(raced / "rank-00000-of-00001.safetensors")
    checked = ShardDir.check

    def check_then_rewrite(self, *args, **kwargs):
        checked(self, *args, **kwargs)
        st = os.stat(name)
        block_start, block_end = tensor_offsets(name)["block.1"]
        with open(name, "r+b") as f:
            f.seek((block_start + block_end) // 2)
            f.write(b"\x3f" * 64)
        os.utime(name, ns=(st.st_atime_ns, st.st_mtime_ns))

    monkeypatch.setattr(ShardDir, "check", check_then_rewrite)
    fresh()
    with pytest.raises(CheckpointError, match="rank-00000-of-00001.safetensors was rewritten "
                       "or replaced while dlo_fx.load read it"):
        load(ReferenceDiT, str(raced), config=ckpts["config"], options={"host_store": store},
             resident=SHARED)


LIVE_TIMEOUT_S = 5.0


def _truncated_on_one_rank():
    with tempfile.TemporaryDirectory() as root:
        files = spawn(1, in_child, file_store_cases.write_files, root)[0]
        return spawn(2, file_store_cases.truncated_on_one_rank, files["dit2"], files["dit"],
                     files["config"], LIVE_TIMEOUT_S)


@pytest.mark.spawned.with_args(_truncated_on_one_rank)
def test_rank_file_truncated_while_two_ranks_serve_it_raises_on_both(spawned):
    # Rank 1 skipped the gather its failed read was for: its next collective paired with
    # rank 0's gather, and gloo aborted the process.
    zero, one = spawned[0], spawned[1]
    assert zero[0] is True and one[0] is True, (zero, one)
    assert one[1][1].startswith("FileChangedError") and "rank-00001-of-00002" in one[1][1], one
    elapsed, message = zero[1]  # its gather times out: no output, never a wrong one
    assert message.startswith("RuntimeError: dlo: AllGather of host block"), message
    assert elapsed < LIVE_TIMEOUT_S + 15, elapsed
    # Then rank 1 issues no collective on the group again; rank 0's runtime is closed.
    assert "is not issued on global rank 1" in one[2][1] and "FileChangedError" in one[2][1], one
    assert "failed earlier and is closed" in zero[2][1], zero
