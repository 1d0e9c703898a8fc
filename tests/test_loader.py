"""`dlo_fx.load`: meta init + mmap safetensors into the host store, bit-identical to
``load_state_dict``; every bad input is a clear error that registers nothing."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import struct
import tempfile

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

import loader_cases
from distributed import in_child, spawn
from dlo_fx.loading.checkpoint import CheckpointError, read_header
from dlo_fx.loading.discover import resolve_checkpoint
from dlo_fx.loading.loader import load
from dlo_fx.apps.models import ReferenceDiT
from dlo_fx.apps.models.reference_dit import DiTBlock
from dlo_fx.runtime.weights.stored import is_stored
from dlo_fx.runtime.weights.owners import live_runtimes
from loader_cases import compare, resident_dit, resident_wan
from models import tiny_dit, tiny_wan




@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """One DiT file and one sharded diffusers Wan folder, written once for the module."""
    root = tmp_path_factory.mktemp("ckpt")
    dit_path, dit_config, wan_dir = loader_cases.save_checkpoints(str(root))
    return {"root": root, "dit": dit_path, "config": dit_config, "wan": wan_dir}


def store_blocks(options=None) -> int:
    """Blocks stored by every live runtime (a failed load must have stored none)."""
    return sum(len(rt.store.blocks) for rt in live_runtimes())


# -- bit identity ----------------------------------------------------------------------------
@pytest.mark.parametrize("options", [
    {}, {"num_slots": 3, "block_bytes": 40_000}, {"resident_bytes": 4096},
], ids=["default", "slots3-small-blocks", "resident-small"])
def test_reference_dit_single_file_bit_identical(ckpts, options):
    model = load(ReferenceDiT, ckpts["dit"], config=ckpts["config"], options=options)
    assert not model.training
    streamed = [p for p in model.parameters() if is_stored(p)]
    assert streamed and all(not p.requires_grad for p in model.parameters())
    w = model.blocks[0].fc2_weight  # a transposed parameter keeps its strides
    assert w.stride() == (1, w.shape[0]) and is_stored(w)
    assert torch.equal(model.rope_freqs, ReferenceDiT(ckpts["config"]).rope_freqs)
    if options.get("resident_bytes"):
        assert not is_stored(model.blocks[0].fc2_bias)  # 128 bytes < resident_bytes
    r = compare(model, resident_dit(ckpts["dit"], ckpts["config"]), tiny_dit()[1], options)
    assert r["equal"]
    assert r["host_shard_bytes"] == r["sum_shard"]
    assert r["slot_bytes"] == options.get("num_slots", 2) * r["max_block_bytes"]


def test_reference_dit_graph_break_bit_identical(ckpts):
    import dataclasses

    config = dataclasses.replace(ckpts["config"], graph_break_in_blocks=True)
    # Dynamo skips ReferenceDiT.forward (a graph break in its loop) and runs it eagerly:
    # each block's frame is compiled and streamed; the layers the root calls itself run
    # eagerly, their stored weights read from the host store for each call.
    model = load(ReferenceDiT, ckpts["dit"], config=config)
    assert is_stored(model.patch_embed.weight) and is_stored(model.blocks[2].qkv.weight)
    r = compare(model, resident_dit(ckpts["dit"], config), tiny_dit()[1], {}, fullgraph=False,
                calls=3)
    assert r["equal"]
    assert is_stored(model.modulation_table) and is_stored(model.patch_embed.weight)
    # One compiled DiTBlock.forward for every layer: a stored weight's flatten context
    # names no parameter, so Dynamo does not recompile the frame per layer.
    entries = _debug_get_cache_entry_list(DiTBlock.forward.__code__)
    assert len(entries) == 1, len(entries)


def test_loaded_layers_past_the_recompile_limit_run_eagerly_and_exactly(tmp_path):
    """A loaded model (stored from the start) whose block frame Dynamo compiles once per
    layer: the last two layers run eagerly (recompile limit) and read their own stored
    parameters, as does the head the skipped root calls: each read is served from the host
    store, exactly."""
    from safety_models import IndexedBlock, IndexedDiT, indexed_dit

    reference, (x,) = indexed_dit()
    path = str(tmp_path / "indexed.safetensors")
    save_file(reference.state_dict(), path)
    model = load(IndexedDiT, path)
    assert all(is_stored(p) for p in model.parameters())
    compiled = torch.compile(model, backend="dlo")
    with torch.no_grad():
        expected = reference(x)
        assert all(torch.equal(compiled(x), expected) for _ in range(2))
        entries = _debug_get_cache_entry_list(IndexedBlock.forward.__code__)
        assert len(entries) == torch._dynamo.config.recompile_limit < len(model.blocks)
        # Outside torch.compile the compiled entries do not run: a direct call fetches.
        hidden = reference.blocks[0](x)
        assert torch.equal(model.blocks[-1](hidden), reference.blocks[-1](hidden))
        assert torch.equal(model.blocks[0](x), hidden)
        assert torch.equal(model.head(hidden), reference.head(hidden))
    assert is_stored(model.head.weight) and is_stored(model.blocks[-1].linear.weight)


def test_eager_call_of_loaded_model_is_exact_and_warns_once(ckpts):
    model = load(ReferenceDiT, ckpts["dit"], config=ckpts["config"])
    reference = resident_dit(ckpts["dit"], ckpts["config"])
    inputs = tiny_dit()[1]
    with torch.no_grad():
        with pytest.warns(RuntimeWarning, match="read outside a scheduled graph") as seen:
            assert torch.equal(model(*inputs), reference(*inputs))
            assert torch.equal(model(*inputs), reference(*inputs))
    assert len([w for w in seen if "read outside" in str(w.message)]) == 1


def test_wan_sharded_save_pretrained_folder_bit_identical(ckpts):
    from diffusers import WanTransformer3DModel

    ckpt = resolve_checkpoint(ckpts["wan"])  # the index names several shard files
    assert len(ckpt.files) >= 2
    model = load(WanTransformer3DModel, ckpts["wan"])  # config read from config.json
    assert model.config.num_layers == 3
    r = compare(model, resident_wan(ckpts["wan"]), tiny_wan()[1], {})
    assert r["equal"] and r["blocks"] >= 3


def test_dtype_casts_per_tensor_and_keeps_fp32_modules(ckpts):
    """``dtype=`` casts floating parameters (diffusers' _keep_in_fp32_modules stay float32);
    the reference is the resident model cast by the same rule."""
    from diffusers import WanTransformer3DModel

    model = load(WanTransformer3DModel, ckpts["wan"], dtype=torch.bfloat16)
    keep = WanTransformer3DModel._keep_in_fp32_modules
    reference = resident_wan(ckpts["wan"])
    for name, p in reference.named_parameters():
        if not any(m in name.split(".") for m in keep):
            p.data = p.data.to(torch.bfloat16)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert dtypes["condition_embedder.time_embedder.linear_1.weight"] == torch.float32
    assert dtypes["blocks.0.attn1.to_q.weight"] == torch.bfloat16
    assert loader_cases.same_state(model, reference)  # values, dtypes and strides


class MixedDiT(ReferenceDiT):
    """The reference DiT declaring, as diffusers models do, the modules kept in float32."""

    _keep_in_fp32_modules = ("time_embed",)


def test_dtype_cast_of_a_non_contiguous_parameter(tmp_path, ckpts):
    """An all-float32 checkpoint into a bfloat16 DiT: each tensor is cast while copied,
    fc2_weight laid out transposed, time_embed kept in float32."""
    state = {k: v.float() for k, v in load_file(ckpts["dit"]).items()}
    path = str(tmp_path / "dit32.safetensors")
    save_file(state, path)
    model = load(MixedDiT, path, config=ckpts["config"], dtype=torch.bfloat16)
    assert model.blocks[1].fc2_weight.dtype == torch.bfloat16
    assert model.time_embed[0].weight.dtype == torch.float32
    reference = resident_dit(ckpts["dit"], ckpts["config"])  # bf16 -> f32 -> bf16 is exact
    assert compare(model, reference, tiny_dit()[1], {})["equal"]


def test_the_cast_log_says_why_each_cast_was_made(ckpts, tmp_path, caplog):
    """With dtype= the log names it and the modules the class keeps in float32; "pass
    dtype=" only where it was not passed."""
    state = {k: v.float() if k.startswith("blocks.") else v.bfloat16()
             for k, v in load_file(ckpts["dit"]).items()}
    path = str(tmp_path / "mixed.safetensors")  # float32 blocks, bfloat16 time_embed
    save_file(state, path)
    blocks, kept = (sum(k.startswith(p) for k in state) for p in ("blocks.", "time_embed."))
    with caplog.at_level(logging.INFO, logger="dlo_fx.loading.plan"):
        load(MixedDiT, path, config=ckpts["config"], dtype=torch.bfloat16)
    casts = [r.message for r in caplog.records if "cast" in r.message]
    assert len(casts) == 1 and "pass dtype=" not in casts[0], casts
    assert casts[0].endswith(
        f"cast {blocks + kept} checkpoint tensor(s) while copying: {blocks} to dtype=bfloat16 "
        f"(float32 -> bfloat16); {kept} to float32, kept so by MixedDiT._keep_in_fp32_modules "
        "['time_embed'] (bfloat16 -> float32)"), casts


# -- checkpoint forms --------------------------------------------------------------------------
def test_index_file_folder_without_index_and_hf_cache(ckpts, tmp_path, monkeypatch):
    from diffusers import WanTransformer3DModel

    index = [f for f in os.listdir(ckpts["wan"]) if f.endswith(".index.json")][0]
    plain = tmp_path / "plain"  # the same shards, no index
    shutil.copytree(ckpts["wan"], plain, ignore=shutil.ignore_patterns("*.index.json"))
    cache = tmp_path / "hub"
    snapshot = cache / "models--org--tiny-wan" / "snapshots" / "abc123"
    shutil.copytree(ckpts["wan"], snapshot)
    (cache / "models--org--tiny-wan" / "refs").mkdir()
    (cache / "models--org--tiny-wan" / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    reference = resident_wan(ckpts["wan"])
    sources = [os.path.join(ckpts["wan"], index), str(plain),
               str(cache / "models--org--tiny-wan"), "org/tiny-wan"]
    for source in sources:
        loader_cases.fresh()
        model = load(WanTransformer3DModel, source)  # config.json read from the folder
        assert loader_cases.same_state(model, reference), source
    with pytest.raises(CheckpointError, match=r"models--org--absent.*never downloads") as info:
        load(WanTransformer3DModel, "org/absent")
    assert str(cache) in str(info.value)


def test_key_map_dict_and_callable(ckpts, tmp_path):
    state = load_file(ckpts["dit"])
    path = str(tmp_path / "prefixed.safetensors")
    save_file({"model." + k: v for k, v in state.items()} | {"model.extra": torch.zeros(1)}, path)
    reference = resident_dit(ckpts["dit"], ckpts["config"])

    def strip(key):
        return None if key == "model.extra" else key.removeprefix("model.")

    table = {"model." + k: k for k in state}
    loader_cases.fresh()
    model = load(ReferenceDiT, path, config=ckpts["config"], key_map=strip)
    assert loader_cases.same_state(model, reference)
    loader_cases.fresh()
    with pytest.warns(UserWarning, match="model.extra"):
        model = load(ReferenceDiT, path, config=ckpts["config"], key_map=table, strict=False)
    assert loader_cases.same_state(model, reference)


def test_progress_log_lines_without_terminal(ckpts, caplog):
    with caplog.at_level(logging.INFO, logger="dlo_fx.loading.loader"):
        load(ReferenceDiT, ckpts["dit"], config=ckpts["config"])
    lines = [r.getMessage() for r in caplog.records if "tensors)" in r.getMessage()]
    assert lines and "100%" in lines[-1] and "43 of 43 tensors" in lines[-1]


# -- bad input: a clear error, nothing registered ------------------------------------------------
def _expect_error(match, *args, exc=ValueError, **kw):
    with pytest.raises(exc, match=match):
        load(*args, **kw)
    assert store_blocks(kw.get("options")) == 0


def _corrupt_copy(src: str, dst: str, *, keep: int | None = None, header: bytes | None = None):
    data = open(src, "rb").read()
    if header is not None:
        data = struct.pack("<Q", len(header)) + header + data[8 + struct.unpack("<Q", data[:8])[0]:]
    open(dst, "wb").write(data[:keep] if keep is not None else data)
    return dst


def test_missing_path(ckpts, tmp_path):
    _expect_error("does not exist", ReferenceDiT, str(tmp_path / "nope.safetensors"),
                  config=ckpts["config"])


def _odd_entries(folder) -> dict[str, str]:
    """Paths in ``folder`` that are neither a file nor a folder, each with the words the
    error must use: a FIFO, a link to /dev/zero, a socket, a loop of symbolic links (one
    link, and two leading to each other), a link to nothing."""
    import socket

    os.mkfifo(folder / "fifo")
    (folder / "zero").symlink_to("/dev/zero")
    (folder / "self").symlink_to(folder / "self")
    (folder / "a").symlink_to(folder / "b")
    (folder / "b").symlink_to(folder / "a")
    (folder / "dangling").symlink_to(folder / "nowhere")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(folder / "sock"))  # closed when collected; the path stays a socket
    return {"fifo": "a FIFO", "zero": "a character device (a symbolic link to /dev/zero)",
            "sock": "a socket", "self": "a loop of symbolic links", "a": "a loop of symbolic "
            "links", "dangling": f"a symbolic link to '{folder / 'nowhere'}', which does not exist"}


def test_a_path_that_is_no_file_or_folder_is_named_for_what_it_is(ckpts, tmp_path):
    """A FIFO, a device, a socket, a symbolic link loop or a link to nothing, as the
    checkpoint, its subfolder, one of a folder's weight files, the index or a shard it
    names, or the config: a CheckpointError (ValueError) saying what the path is, before
    anything is opened (a FIFO blocked the read; NotADirectoryError, or "does not exist"
    for a loop, was what a user met). A folder without weights and an empty file are
    named as such."""
    from diffusers import WanTransformer3DModel

    odd = _odd_entries(tmp_path)
    for name, what in odd.items():
        path = str(tmp_path / name)
        _expect_error(rf"checkpoint path {re.escape(repr(path))} is {re.escape(what)}.*, not a "
                      "file or a folder; pass a .safetensors", ReferenceDiT, path, config=ckpts["config"],
                      exc=CheckpointError)
        _expect_error(rf"subfolder {re.escape(repr(path))} is {re.escape(what)}", ReferenceDiT,
                      str(tmp_path), subfolder=name, config=ckpts["config"], exc=CheckpointError)
    for name, what in odd.items():  # one of a folder's files: the same kind of path there
        folder = tmp_path / f"with-{name}"
        folder.mkdir()
        shutil.copy(ckpts["dit"], folder / "dit.safetensors")
        more = folder / "more.safetensors"
        if name == "fifo":
            os.mkfifo(more)
        elif name == "sock":
            os.rename(tmp_path / name, more)
        else:  # a link: to /dev/zero, to itself, to nothing
            more.symlink_to({"zero": "/dev/zero", "dangling": str(folder / "nowhere")}.get(
                name, more))
        _expect_error(rf"holds more.safetensors, which is {re.escape(what[:14])}", ReferenceDiT,
                      str(folder), config=ckpts["config"], exc=CheckpointError)
    folder = tmp_path / "index-fifo"  # a FIFO as the index: reading it blocked for ever
    folder.mkdir()
    os.mkfifo(folder / "model.safetensors.index.json")
    _expect_error("holds model.safetensors.index.json, which is a FIFO", ReferenceDiT,
                  str(folder), config=ckpts["config"], exc=CheckpointError)
    wan = tmp_path / "wan"  # a shard the index names, and the config.json beside
    shutil.copytree(ckpts["wan"], wan)
    index = json.loads(next(wan.glob("*.index.json")).read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    (wan / shard).unlink()
    (wan / shard).symlink_to("/dev/zero")
    _expect_error(f"holds {shard}, which is a character device", WanTransformer3DModel,
                  str(wan), exc=CheckpointError)
    _expect_error(f"names shard file '{shard}', which is a character device",  # the index
                  WanTransformer3DModel, str(next(wan.glob("*.index.json"))), config=str(wan),
                  exc=CheckpointError)
    shutil.rmtree(wan)
    shutil.copytree(ckpts["wan"], wan)
    (wan / "config.json").unlink()
    os.mkfifo(wan / "config.json")
    _expect_error(r"the config.json beside .* weights is a FIFO \(named pipe\), not a config "
                  "file", WanTransformer3DModel, str(wan))
    _expect_error(rf"config={re.escape(repr(str(tmp_path / 'self')))}: .* is a loop of symbolic links",
                  WanTransformer3DModel, ckpts["wan"], config=str(tmp_path / "self"))
    (tmp_path / "empty").mkdir()
    _expect_error("empty holds no .safetensors file", ReferenceDiT, str(tmp_path / "empty"),
                  config=ckpts["config"], exc=CheckpointError)
    (tmp_path / "empty.safetensors").write_bytes(b"")
    _expect_error(r"truncated safetensors file \(0 bytes", ReferenceDiT,
                  str(tmp_path / "empty.safetensors"), config=ckpts["config"],
                  exc=CheckpointError)


def test_truncated_file(ckpts, tmp_path):
    size = os.path.getsize(ckpts["dit"])
    path = _corrupt_copy(ckpts["dit"], str(tmp_path / "cut.safetensors"), keep=size - 1000)
    _expect_error(r"cut.safetensors: truncated safetensors file: tensor .* ends at",
                  ReferenceDiT, path, config=ckpts["config"])
    path = _corrupt_copy(ckpts["dit"], str(tmp_path / "stub.safetensors"), keep=4)
    _expect_error("stub.safetensors: truncated", ReferenceDiT, path, config=ckpts["config"])


def test_corrupt_header(ckpts, tmp_path):
    path = _corrupt_copy(ckpts["dit"], str(tmp_path / "bad.safetensors"), header=b"{not json" + b" " * 7)
    _expect_error("bad.safetensors: corrupt safetensors header", ReferenceDiT, path,
                  config=ckpts["config"], exc=CheckpointError)
    with open(path, "r+b") as f:  # a header length far beyond the end of the file
        f.write(struct.pack("<Q", 10**9))
    _expect_error("bad.safetensors: corrupt or truncated", ReferenceDiT, path, config=ckpts["config"])


def _with_header(src: str, dst: str, edit) -> str:
    """A copy of ``src`` whose JSON header is ``edit(header dict) -> bytes`` (padded to 8)."""
    data = open(src, "rb").read()
    n = struct.unpack("<Q", data[:8])[0]
    raw = edit(json.loads(data[8:8 + n]))
    raw += b" " * (-len(raw) % 8)
    open(dst, "wb").write(struct.pack("<Q", len(raw)) + raw + data[8 + n:])
    return dst


def _meta(value):
    def edit(header):
        header = {k: v for k, v in header.items() if k != "__metadata__"}
        return json.dumps({"__metadata__": value, **header}, ensure_ascii=False).encode()
    return edit


@pytest.mark.parametrize("edit", [
    _meta(None),  # "__metadata__": null
    lambda h: json.dumps({k: v for k, v in h.items() if k != "__metadata__"}).encode(),  # none
    _meta({"format": "pt", "note": "\u00e9\u00ff\U0001f600"}),  # non-ASCII UTF-8
], ids=["null", "absent", "unicode"])
def test_metadata_is_optional_and_may_be_any_utf8(ckpts, tmp_path, edit):
    path = _with_header(ckpts["dit"], str(tmp_path / "meta.safetensors"), edit)
    loader_cases.fresh()
    model = load(ReferenceDiT, path, config=ckpts["config"])
    assert loader_cases.same_state(model, resident_dit(ckpts["dit"], ckpts["config"]))


@pytest.mark.parametrize("edit, match", [
    (lambda h: _meta({"blob": "AB"})(h).replace(b'"AB"', b'"A\xff"'),
     r"byte 0xff at file byte \d+ is not UTF-8"),
    (_meta({"n": 1}), r"__metadata__ must be an object of string values, found \{'n': 1\}"),
    (_meta("text"), r"__metadata__ must be an object of string values"),
], ids=["binary", "number", "string"])
def test_bad_metadata_is_an_error_naming_the_file(ckpts, tmp_path, edit, match):
    path = _with_header(ckpts["dit"], str(tmp_path / "meta.safetensors"), edit)
    _expect_error(r"meta\.safetensors: corrupt safetensors header: " + match, ReferenceDiT,
                  path, config=ckpts["config"], exc=CheckpointError)


@pytest.mark.parametrize("content, match", [
    (b"PK\x03\x04" + bytes(60), "a zip archive"),
    (b"GGUF\x03\x00\x00\x00" + bytes(60), "a GGUF file: name it"),
    (b"\x80\x02\x8a\x0alz" + bytes(60), "a pickle"),
    (b'{"a": {"dtype": "F32"}}', "it starts with text"),
    (b"\xff" * 64, "corrupt or truncated safetensors file"),
], ids=["zip", "gguf", "pickle", "json", "binary"])
def test_a_file_that_is_not_safetensors_is_an_error_naming_it(ckpts, tmp_path, content, match):
    path = str(tmp_path / "model.safetensors")
    open(path, "wb").write(content)
    _expect_error(r"model\.safetensors: .*" + match, ReferenceDiT, path,
                  config=ckpts["config"], exc=CheckpointError)


def _tiled(offsets: dict, data: int) -> tuple[dict, bytes]:
    """A safetensors header of uint8 tensors at ``offsets`` and ``data`` zero bytes."""
    return {k: {"dtype": "U8", "shape": [e - b], "data_offsets": [b, e]}
            for k, (b, e) in offsets.items()}, bytes(data)


@pytest.mark.parametrize("offsets, data, match", [
    ({"a": (0, 4), "b": (6, 10)}, 10, r"tensor 'b' starts at data byte 6, the tensors before "
     r"it end at data byte 4 \(a gap\)"),
    ({"a": (0, 4), "b": (2, 6)}, 6, r"tensor 'b' starts at data byte 2, .* byte 4 \(an overlap\)"),
    ({"a": (2, 6)}, 6, r"tensor 'a' starts at data byte 2, .* byte 0 \(a gap\)"),
    ({"a": (0, 4)}, 6, r"its tensors end at data byte 4, 2 bytes before the end of the file"),
], ids=["gap", "overlap", "leading", "trailing"])
def test_tensors_that_do_not_tile_the_file_are_named(tmp_path, offsets, data, match):
    """Checked from the header, without the mapping safetensors' own check needs."""
    header, body = _tiled(offsets, data)
    raw = json.dumps(header).encode()
    path = tmp_path / "tiles.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + body)
    with pytest.raises(CheckpointError, match=r"tiles\.safetensors: corrupt safetensors .*" + match):
        read_header(path)
    header, body = _tiled({"z": (0, 0), "a": (0, 4), "b": (4, 8)}, 8)  # an empty tensor too
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + body)
    assert sorted(read_header(path)) == ["a", "b", "z"]


def _unmappable():
    with tempfile.TemporaryDirectory() as root:
        return spawn(1, loader_cases.unmappable_cases, root, timeout=300)[0]


@pytest.mark.spawned.with_args(_unmappable)
def test_a_file_the_host_cannot_map_loads(spawned):
    """A 1 GiB file under an address-space limit that refuses safetensors' mapping of it
    (its own, or torch's over the file): not "re-download it", since the cause is the
    mapping and dlo reads tensors without one; the model loads exactly. A corrupt file is
    still refused under the same limit."""
    own, torchs = spawned[256 << 20], spawned[1536 << 20]
    assert own["opened"].startswith("MemoryError") and "os error 12" in own["opened"], own
    assert "unable to mmap" in torchs["opened"], torchs
    for case in (own, torchs):
        assert case["good"] is True, case
        assert "gap.safetensors: corrupt safetensors header: tensor 'pad'" in case["bad"], case


def test_config_that_is_not_json_is_an_error_naming_it(ckpts, tmp_path):
    """A weights file passed as ``config=`` (or a binary config.json): not a bare
    UnicodeDecodeError."""
    from diffusers import WanTransformer3DModel

    weights = next(p for p in sorted(os.listdir(ckpts["wan"])) if p.endswith(".safetensors"))
    path = os.path.join(ckpts["wan"], weights)
    _expect_error(rf"{weights} is not a JSON config file", WanTransformer3DModel, ckpts["wan"],
                  config=path)


def test_mochi_state_dict_file_loads_exactly(tmp_path):
    """diffusers' MochiTransformer3DModel written with ``save_file(model.state_dict())``
    (no ``__metadata__``), loaded from a factory: every weight as saved."""
    import diffusers
    from zoo_models import ZOO

    row = next(z for z in ZOO if z.name == "Mochi")

    def build():
        torch.manual_seed(0)
        return getattr(diffusers, row.cls)(**row.config)

    reference = build()
    path = str(tmp_path / "model.safetensors")
    save_file(reference.state_dict(), path)
    loader_cases.fresh()
    assert loader_cases.same_state(load(lambda: build(), path), reference)


def test_index_naming_a_missing_shard(ckpts, tmp_path):
    from diffusers import WanTransformer3DModel

    folder = tmp_path / "wan"
    shutil.copytree(ckpts["wan"], folder)
    index = json.loads(next(folder.glob("*.index.json")).read_text())
    gone = sorted(set(index["weight_map"].values()))[1]
    (folder / gone).unlink()
    _expect_error(f"names shard file '{gone}', which does not exist", WanTransformer3DModel,
                  str(folder))


def test_a_failure_while_reading_leaves_no_block_behind(ckpts, tmp_path):
    """A shard that disappears after validation (here: removed by the model factory, which
    runs between the two): the blocks already copied are dropped again."""
    from diffusers import WanTransformer3DModel

    folder = tmp_path / "wan"
    shutil.copytree(ckpts["wan"], folder)
    index = json.loads(next(folder.glob("*.index.json")).read_text())
    last = sorted(set(index["weight_map"].values()))[-1]
    config = {k: v for k, v in json.loads((folder / "config.json").read_text()).items()
              if not k.startswith("_")}

    def factory():
        (folder / last).unlink()
        return WanTransformer3DModel(**config)

    with pytest.raises(CheckpointError, match=last):
        load(factory, str(folder))
    assert store_blocks() == 0


def test_missing_keys_name_the_first_ten_and_the_count(ckpts, tmp_path):
    state = load_file(ckpts["dit"])
    dropped = [k for k in state if k.startswith(("blocks.1.", "blocks.2."))][:12]
    path = str(tmp_path / "partial.safetensors")
    save_file({k: v for k, v in state.items() if k not in dropped}, path)
    with pytest.raises(ValueError, match=r"12 missing key\(s\)") as info:
        load(ReferenceDiT, path, config=ckpts["config"], strict=False)
    message = str(info.value)
    assert "(first 10 of 12)" in message and repr(dropped[0]) in message
    assert repr(dropped[11]) not in message.split("missing")[1].split("\n")[0]
    assert store_blocks() == 0


def test_unexpected_keys_error_when_strict_warn_otherwise(ckpts, tmp_path):
    state = load_file(ckpts["dit"])
    path = str(tmp_path / "extra.safetensors")
    save_file(state | {"head.weight": torch.zeros(2), "head.bias": torch.zeros(2)}, path)
    _expect_error(r"2 unexpected key\(s\).*'head.weight'", ReferenceDiT, path,
                  config=ckpts["config"])
    with pytest.warns(UserWarning, match="ignoring 2 unexpected key.*head.bias") as record:
        load(ReferenceDiT, path, config=ckpts["config"], strict=False)
    assert len([w for w in record if "unexpected" in str(w.message)]) == 1


def test_shape_mismatch_names_key_expected_and_found(ckpts, tmp_path):
    state = load_file(ckpts["dit"])
    state["blocks.2.qkv.weight"] = torch.zeros(96, 64, dtype=torch.bfloat16)
    path = str(tmp_path / "shape.safetensors")
    save_file(state, path)
    _expect_error(r"1 shape mismatch\(es\):\n    'blocks.2.qkv.weight': the model expects \[192, 64\], "
                  r"the checkpoint holds \[96, 64\]", ReferenceDiT, path, config=ckpts["config"])


def test_other_float_dtype_is_cast_to_the_models_dtype(ckpts, tmp_path, caplog):
    """[Note: the dtype rule]: without dtype= the model's dtype wins; one log line."""
    state = load_file(ckpts["dit"])
    state["proj_out.weight"] = state["proj_out.weight"].float()
    path = str(tmp_path / "dtype.safetensors")
    save_file(state, path)
    with caplog.at_level(logging.INFO, logger="dlo_fx.loading.plan"):
        model = load(ReferenceDiT, path, config=ckpts["config"])
    casts = [r.message for r in caplog.records if "cast" in r.message]
    assert len(casts) == 1 and "cast 1 checkpoint tensor(s)" in casts[0], casts
    assert "float32 -> bfloat16" in casts[0]
    assert model.proj_out.weight.dtype == torch.bfloat16
    assert loader_cases.same_state(model, resident_dit(ckpts["dit"], ckpts["config"]))


def test_integer_dtype_mismatch_is_an_error(ckpts, tmp_path):
    state = load_file(ckpts["dit"])
    state["proj_out.weight"] = state["proj_out.weight"].to(torch.int16)
    path = str(tmp_path / "int.safetensors")
    save_file(state, path)
    _expect_error(r"1 dtype mismatch\(es\):\n    'proj_out.weight': the model expects "
                  r"torch.bfloat16, .* holds torch.int16; only floating-point", ReferenceDiT,
                  path, config=ckpts["config"])


@pytest.mark.parametrize("suffix", [".bin", ".pt", ".pth"])
def test_pickles_are_refused(ckpts, tmp_path, suffix):
    path = tmp_path / f"model{suffix}"
    path.write_bytes(b"not really a pickle")
    _expect_error("only loads safetensors", ReferenceDiT, str(path), config=ckpts["config"])
    folder = tmp_path / "pickled"
    folder.mkdir()
    (folder / f"pytorch_model{suffix}").write_bytes(b"x")
    _expect_error("only loads safetensors", ReferenceDiT, str(folder), config=ckpts["config"])


def test_bad_model_argument_and_resident_name(ckpts):
    model, _ = tiny_dit()
    _expect_error("pass the class or a zero-argument factory", model, ckpts["dit"])
    _expect_error("resident='patch_embd' names no parameter of the model; did you mean "
                  "'patch_embed'\\?", ReferenceDiT, ckpts["dit"],
                  config=ckpts["config"], resident=["patch_embd"])


# -- two ranks ----------------------------------------------------------------------------------
def _two_ranks():
    with tempfile.TemporaryDirectory() as root:
        dit, config, wan = spawn(1, in_child, loader_cases.save_checkpoints, root)[0]
        return spawn(2, loader_cases.load_cases, dit, config, wan,
                     os.path.join(root, "absent.safetensors"), timeout=300)


@pytest.mark.spawned.with_args(_two_ranks)
def test_two_ranks_allgather_shards_the_checkpoint(spawned):
    results = spawned
    for rank in (0, 1):
        r = results[rank]
        for key in ("dit", "dit-resident-small", "dit-break", "wan"):
            assert r[key]["equal"], (rank, key)
            assert r[key]["mode"] == "allgather" and r[key]["dp"] == 2
            assert r[key]["host_shard_bytes"] == r[key]["sum_shard"], (rank, key)
            assert r[key]["host_shard_bytes"] <= r[key]["total"] / 2 + 256 * r[key]["blocks"]
        for key in ("dit-rank-local", "dit-auto"):
            assert r[key]["equal"], (rank, key)
            if r[key]["mode"] == "rank_local":
                assert r[key]["dp"] == 1 and r[key]["host_shard_bytes"] >= r[key]["total"]
            else:
                assert r[key]["host_shard_bytes"] == r[key]["sum_shard"], (rank, key)
        assert r["dit-rank-local"]["mode"] == "rank_local"
        assert "does not exist" in r["bad-rank"]
        assert r["bad-rank-blocks"] == 0
    assert "global rank 1" in results[0]["bad-rank"]
