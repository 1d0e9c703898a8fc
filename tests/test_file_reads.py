"""Reads of a file-backed host store (`runtime/host/file_reads.py`): pieces and windows, direct
(``O_DIRECT``) and buffered reads bit-identical to the resident model, and every bad input
(a file that shrinks during a read, a file system that refuses ``O_DIRECT``) a clear error
or a fallback that says so, never a wrong output."""

from __future__ import annotations

import errno
import os
import shutil

import pytest
import torch

from dlo_fx.loading.loader import load
from dlo_fx.apps.models import ReferenceDiT
from dlo_fx.runtime.host import file_reads, file_store
from dlo_fx.runtime.host.file_reads import ALIGN, plan_buffered, plan_direct
from dlo_fx.runtime.host.file_reads import FileChangedError
from dlo_fx.loading.shards import write_shard_dir
from file_store_cases import served, store_of
from loader_cases import SHARED, fresh, resident_dit, save_dit
from models import call, tiny_dit


@pytest.fixture(scope="module")
def dit(tmp_path_factory):
    root = tmp_path_factory.mktemp("reads")
    path, config = save_dit(str(root))
    shards = str(root / "dit-dp1")
    write_shard_dir(ReferenceDiT, path, shards, dp=1, config=config, resident=SHARED)
    return {"path": path, "config": config, "shards": shards, "root": root}


def run(source: str, config, options: dict, calls: int = 2):
    """Outputs of ``calls`` dlo calls of the DiT loaded from ``source``, the resident
    output, and the loaded model."""
    fresh()
    model = load(ReferenceDiT, source, config=config, options=options, resident=SHARED)
    compiled = torch.compile(model, backend="dlo", options=options)
    inputs = tiny_dit()[1]
    with torch.no_grad():
        outs = [call(compiled, inputs) for _ in range(calls)]
    return outs, model, compiled


def expected(dit):
    with torch.no_grad():
        return call(resident_dit(dit["path"], dit["config"]), tiny_dit()[1])


# -- plans ----------------------------------------------------------------------------------------
def _bytes_of(pieces, file: bytes, size: int) -> bytes:
    out = bytearray(size)
    for p in pieces:
        window = file[p.offset : p.offset + p.span]
        assert len(window) >= p.need
        for s in p.segments:
            out[s.dest : s.dest + s.nbytes] = window[s.at : s.at + s.nbytes]
    return bytes(out)


def test_direct_windows_are_aligned_merged_and_cover_every_byte():
    file = os.urandom(1 << 20)
    # Tensors in the file in another order than in the block, a few bytes apart.
    runs = [("f", 100_003, 5_000, 0, "a"), ("f", 8, 90_000, 5_000, "b"),
            ("f", 300_000, 700_000, 95_000, "c"), ("f", 90_008, 9_000, 795_000, "d")]
    pieces = plan_direct(runs, chunk=256 << 10, gap=64 << 10)
    assert all(p.offset % ALIGN == 0 and p.span % ALIGN == 0 and p.span <= 256 << 10
               for p in pieces)
    assert [p.offset for p in pieces] == sorted(p.offset for p in pieces)  # file order
    assert len(pieces[0].segments) == 3  # a, b and d: close in the file, one window
    want = bytearray(804_000)
    for _, o, n, d, _ in runs:
        want[d : d + n] = file[o : o + n]
    assert _bytes_of(pieces, file, 804_000) == bytes(want)
    buffered = plan_buffered(runs, chunk=256 << 10)
    assert all(len(p.segments) == 1 and p.span <= 256 << 10 for p in buffered)
    assert _bytes_of(buffered, file, 804_000) == bytes(want)


# -- bit identity ---------------------------------------------------------------------------------
@pytest.mark.parametrize("source", ["path", "shards"])
@pytest.mark.parametrize("reads", ["direct", "buffered"])
def test_direct_and_buffered_reads_bit_identical(dit, source, reads):
    options = {"host_store": "mmap", "file_reads": reads}
    outs, model, _ = run(dit[source], dit["config"], options)
    ref = expected(dit)
    assert all(torch.equal(o, ref) for o in outs)
    stats = served(model)["stats"]
    assert stats["block_reads"] > 0
    assert stats["direct_block_reads"] == (stats["block_reads"] if reads == "direct" else 0)
    assert store_of(model).files.direct is (reads == "direct")


def test_auto_reads_direct_only_when_the_page_cache_cannot_hold_the_files(dit, monkeypatch):
    options = {"host_store": "mmap"}
    _, model, _ = run(dit["path"], dit["config"], options, calls=1)
    assert store_of(model).files.direct is False  # a few hundred kB fit
    monkeypatch.setattr(file_store.procfs, "available_memory", lambda: 1000)
    outs, model, _ = run(dit["path"], dit["config"], options)
    assert store_of(model).files.direct is True
    assert all(torch.equal(o, expected(dit)) for o in outs)


# -- bad input ------------------------------------------------------------------------------------
@pytest.mark.parametrize("reads", ["direct", "buffered"])
def test_file_that_shrinks_during_a_read_is_an_error(dit, tmp_path, monkeypatch, reads):
    path = str(tmp_path / "dit.safetensors")
    shutil.copy(dit["path"], path)
    options = {"host_store": "mmap", "file_reads": reads}
    outs, _, compiled = run(path, dit["config"], options, calls=1)
    assert torch.equal(outs[0], expected(dit))
    real = os.preadv
    shrunk = []

    def shrink_then_read(fd, buffers, offset):
        if not shrunk:  # after the checks before the read, before its first byte
            os.truncate(path, ALIGN * 2)
            shrunk.append(True)
        return real(fd, buffers, offset)

    monkeypatch.setattr(file_reads.os, "preadv", shrink_then_read)
    with pytest.raises(FileChangedError, match="truncated") as info, torch.no_grad():
        call(compiled, tiny_dit()[1])
    assert path in str(info.value) and "host block" in str(info.value)


def _refuse_direct_open(monkeypatch):
    real = os.open

    def fake(path, flags, *args, **kw):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real(path, flags, *args, **kw)

    monkeypatch.setattr(file_store.os, "open", fake)


def _refuse_direct_read(monkeypatch):
    real = os.preadv

    def fake(fd, buffers, offset):
        if fcntl_direct(fd):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, buffers, offset)

    monkeypatch.setattr(file_reads.os, "preadv", fake)


def fcntl_direct(fd: int) -> bool:
    import fcntl

    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)


@pytest.mark.parametrize("where", ["open", "read"])
def test_o_direct_refused_falls_back_to_buffered_and_says_so(dit, monkeypatch, where):
    (_refuse_direct_open if where == "open" else _refuse_direct_read)(monkeypatch)
    options = {"host_store": "mmap", "file_reads": "direct"}
    with pytest.warns(RuntimeWarning, match="cannot be read with O_DIRECT.*page cache"):
        outs, model, _ = run(dit["path"], dit["config"], options)
    assert all(torch.equal(o, expected(dit)) for o in outs)
    assert store_of(model).files.reader.fallbacks == [dit["path"]]
