"""Never silently wrong, round two (issue 40): the ranks agree once on everything that
shapes a gather; shard files are checked against their manifest; a file rewritten keeping
its size and mtime, or truncated while loaded, is an error; one model's failed copy stays
its own."""

from __future__ import annotations

import json
import shutil
import tempfile

import pytest
import agreement_cases
from agreement_cases import STORES, shorten_block_in_header
from distributed import in_child, spawn
from dlo_fx.loading.checkpoint import CheckpointError, read_header
from dlo_fx.loading.loader import load
from dlo_fx.apps.models import ReferenceDiT
from dlo_fx.loading.shards import MANIFEST, write_shard_dir
from loader_cases import SHARED, fresh


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("agreement"))
    return spawn(1, in_child, agreement_cases.write_files, root)[0]


# -- items 1, 2, 3, 6: two ranks -----------------------------------------------------------------
def _two_ranks():
    with tempfile.TemporaryDirectory() as root:
        files = spawn(1, in_child, agreement_cases.write_files, root)[0]
        return spawn(2, agreement_cases.agreement_cases, files, timeout=600)


@pytest.mark.spawned.with_args(_two_ranks)
def test_ranks_agree_on_everything_that_shapes_a_gather(spawned):
    results = spawned
    for rank, out in results.items():
        assert out[("order", "rank-local")] is True, (rank, out[("order", "rank-local")])
        for store in (*STORES, "built"):
            # 1. shard_group=[1, 0]: accepted in any order, exact
            assert out[("order", store)] is True, (rank, store, out[("order", store)])
            # 6. num_slots 2 on rank 0, 3 on rank 1: refused on both, naming it and the ranks
            message = out[("slots", store)]
            assert message.startswith("ValueError") and "num_slots" in message, (rank, message)
            assert "2 on global rank 0" in message and "3 on global rank 1" in message, message
            assert out[("slots-after", store)] is True, (rank, store)
        for store in STORES:
            # 2. another checkpoint of the same shapes on rank 1: refused whatever the store
            message = out[("weights", store)]
            assert message.startswith("ValueError"), (rank, store, message)
            assert "different weights for block 0" in message, message
            assert "global rank 0" in message and "global rank 1" in message, message
            assert out[("weights-after", store)] is True, (rank, store)
            # 3. shard folders of two `dlo-fx shard` runs: refused, naming the runs
            message = out[("shards", store)]
            assert message.startswith("ValueError") and "dlo-fx shard" in message, message
            assert "global rank 0" in message and "global rank 1" in message, message
            assert out[("shards-after", store)] is True, (rank, store)
        # a compile whose store fails on rank 1 only: both raise, the model stays as it was
        failed = out["store fails"]
        if rank == 1:
            assert failed["first"].startswith("MemoryError") and "injected" in failed["first"], \
                failed
        else:
            assert failed["first"].startswith("ValueError"), failed
            assert "failed on global rank 1" in failed["first"], failed
            assert "injected" in failed["first"], failed
        assert failed["intact"] is True and failed["again"] == [True, True], (rank, failed)


# -- item 4: a rank file whose header disagrees with its manifest --------------------------------
@pytest.mark.parametrize("store", STORES)
def test_rank_file_header_checked_against_manifest(files, tmp_path, store):
    folder = tmp_path / "short"
    write_shard_dir(ReferenceDiT, files["a"], str(folder), dp=1, config=files["config"],
                    resident=SHARED)
    shorten_block_in_header(str(folder / "rank-00000-of-00001.safetensors"), 1, 4096)
    fresh()
    with pytest.raises(CheckpointError, match=r"block\.1 .*rank-00000-of-00001\.safetensors"
                       r"|rank-00000-of-00001\.safetensors.*block\.1") as info:
        load(ReferenceDiT, str(folder), config=files["config"], resident=SHARED,
             options={"host_store": store})
    assert "manifest" in str(info.value) and "dlo-fx shard" in str(info.value)


# -- item 5: a rewrite that keeps size and mtime -------------------------------------------------
@pytest.mark.parametrize("shards", [False, True], ids=["checkpoint", "shard-folder"])
def test_rewrite_keeping_size_and_mtime_is_caught(files, tmp_path, shards):
    lines = spawn(1, agreement_cases.serve_then_rewrite, str(tmp_path), files, shards)[0]
    assert lines[0] is True, lines
    for line in lines[1:]:
        assert isinstance(line, str) and line.startswith("FileChangedError"), lines
        assert "rewritten" in line and "size and mtime" in line, line


# -- item 7: a failed copy stays with its model --------------------------------------------------
@pytest.mark.parametrize("fault_delay_s", [0.0, 0.001], ids=["inline-copies", "worker-copies"])
def test_failed_copy_stays_with_its_model(files, tmp_path, fault_delay_s):
    out = spawn(1, agreement_cases.failure_stays_with_its_model, str(tmp_path), files,
                fault_delay_s)[0]
    assert out["a-first"] is True, out
    assert out["a-truncated"].startswith("FileChangedError"), out
    for store in STORES:
        assert out[("b", store)] == [True, True], (store, out)
    assert out["built"] == [True, True], out
    assert isinstance(out["a-again"], str) and "truncated" in out["a-again"], out


# -- item 8: a checkpoint truncated while the load reads it --------------------------------------
@pytest.mark.parametrize("store", STORES)
def test_truncated_while_loading_is_an_error_not_sigbus(files, tmp_path, store):
    message = spawn(1, agreement_cases.truncated_while_loading, str(tmp_path), files, store)[0]
    assert message.startswith(("FileChangedError", "CheckpointError")), message
    assert f"t-{store}.safetensors" in message and "truncated" in message, message


# -- lower: files outside the checkpoint folder, malformed manifests -----------------------------
@pytest.mark.parametrize("name", ["../x.safetensors", "ABSOLUTE", "sub/../../x.safetensors"])
def test_index_entry_outside_its_folder_is_refused(files, tmp_path, name):
    outside = tmp_path / "x.safetensors"
    shutil.copy(files["a"], outside)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    entry = str(outside) if name == "ABSOLUTE" else name
    (folder / "sub").mkdir()
    index = {"metadata": {}, "weight_map": {k: entry for k in read_header(files["a"])}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    fresh()
    with pytest.raises(CheckpointError, match="outside the folder"):
        load(ReferenceDiT, str(folder), config=files["config"])


@pytest.mark.parametrize("change", ["no-dp", "files-list", "tensor-not-object", "bad-dtype",
                                    "no-fingerprints", "shard-bytes-short", "common-dtype"])
def test_malformed_manifest_is_a_clear_error(files, tmp_path, change):
    folder = tmp_path / "m"
    write_shard_dir(ReferenceDiT, files["a"], str(folder), dp=1, config=files["config"],
                    resident=SHARED)
    manifest = json.loads((folder / MANIFEST).read_text())
    if change == "no-dp":
        del manifest["dp"]
    elif change == "files-list":
        manifest["files"] = list(manifest["files"])
    elif change == "tensor-not-object":
        manifest["tensors"][next(iter(manifest["tensors"]))] = 3
    elif change == "bad-dtype":
        manifest["tensors"][next(iter(manifest["tensors"]))]["dtype"] = "torch.nonsense"
    elif change == "no-fingerprints":
        del manifest["fingerprints"]
    elif change == "shard-bytes-short":
        manifest["block_shard_bytes"] = manifest["block_shard_bytes"][:-1]
    else:  # a tensor of common.safetensors said to have another dtype than its header's
        manifest["tensors"]["modulation_table"]["dtype"] = "torch.float16"
    (folder / MANIFEST).write_text(json.dumps(manifest))
    fresh()
    with pytest.raises(CheckpointError, match="manifest") as info:
        load(ReferenceDiT, str(folder), config=files["config"], resident=SHARED)
    assert "dlo-fx shard" in str(info.value)
