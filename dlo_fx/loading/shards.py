"""Pre-sharded checkpoints (``dlo-fx shard``) and where a block's bytes are in files.

[Note: pre-sharded checkpoints]
A shard folder serves exactly the blocks `dlo_fx.load` would make for the same options,
and a rank serves only bytes verified to be what was written for it. ``dlo-fx shard CKPT
--dp N --out DIR`` plans the load once and writes:

* ``rank-RRRRR-of-NNNNN.safetensors``: one uint8 tensor ``block.B`` per block holding rank
  R's host shard of block B, already in the block's layout (dtype cast, strides, alignment
  and zero padding applied), so serving it is one read per block; every tensor starts at a
  multiple of ``alignment`` bytes of the file. A rank on another node needs only its own
  file: 1/N of the model on its local disk;
* ``common.safetensors``: resident parameters and the checkpoint's buffers, by model FQN
  (every rank reads it; small);
* ``dlo-shards.json``: the manifest: the model class, N, the mode, the options that shape
  the blocks (``alignment``, ``block_bytes``, ``resident_bytes``, ``resident``, ``dtype``),
  the plan digest (every block's FQNs, shapes, strides, dtypes and offsets), an id that
  every rank file repeats in its metadata, each file's size, each block's size in a rank
  file (``block_shard_bytes``), each block's fingerprint of the checkpoint as `dlo_fx.load`
  takes it (``fingerprints``), a sampled digest of every block of every rank file
  (``block_checks``) and the CRC-32 of all its bytes (``block_crc32``), and the CRC-32 of
  ``common.safetensors`` (``common_crc32``).

``dlo_fx.load(cls, DIR, options=...)`` recognises the manifest (a malformed one is a
`CheckpointError` naming the field), plans the load as usual, and raises ValueError listing
every field that differs from what the manifest was written for before anything is
registered. The rank's file is checked against the manifest first: missing, of another
``dlo-fx shard`` run, of another size, written for another rank (its metadata's ``rank``), a
header whose ``block.B`` is not exactly ``block_shard_bytes[B]`` uint8 bytes inside the
file, or bytes that differ from what was written (the sampled digests, then the CRC-32 of
every block, read once at load: the sampled digest alone misses a byte changed between its
windows, as a bad copy to another node may), each an error naming the file (and the
block). ``common.safetensors`` is checked the same way, by its CRC-32: a byte changed in a
resident parameter or a buffer loaded other values with no error. The files are read
again after the check (the blocks by the store, the resident tensors by the load), so each
checked file's identity and times (inode, size, mtime, ctime) are taken around its check
and compared once every block is stored (`ShardDir.recheck`, inside the ranks' agreement):
a file rewritten between the check and the reads loaded the rewritten bytes with no error.
From then on the store's own checks apply ([Note: file-backed host store]). Ranks loading folders of two runs are refused by the ranks' agreement (the run id
and the fingerprints; see [Note: one agreement before the first gather] in
runtime/ranks/agreement.py). With ``host_store="mmap"`` the blocks are then served from the rank
file; with ``"memory"`` each rank reads its file once.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from .checkpoint import (Checkpoint, CheckpointError, TensorInfo, header_json, read_header,
                         read_tensor)
from ..config import DLOConfig
from .plan import LoadPlan, Target
from ..runtime import (CHECK_SAMPLES, CHECK_WINDOW, Convert, Entry, Extent, ShardSpec,
                       extent_sources, file_fingerprint, plan_offsets, read_extents)

__all__ = ["MANIFEST", "ShardDir", "checkpoint_extents", "write_shard_dir"]

MANIFEST = "dlo-shards.json"
FORMAT = "dlo-fx-shards/4"
COMMON = "common.safetensors"


def rank_file(rank: int, dp: int) -> str:
    return f"rank-{rank:05d}-of-{dp:05d}.safetensors"


def tensor_offsets(path: str) -> dict[str, tuple[int, int]]:
    """Absolute file byte range of every tensor of a safetensors file (header only);
    a `CheckpointError` naming the file where its header is not safetensors'."""
    return {k: (t.offset, t.offset + t.nbytes) for k, t in read_header(path).items()
            if t.offset is not None}


def _metadata(path: str) -> dict[str, str]:
    return header_json(path)[0].get("__metadata__") or {}


def checkpoint_extents(block: Sequence[Target], entries: Sequence[Entry]) -> list[Extent]:
    """Where each parameter of a block is in the checkpoint's files: the tensor's own bytes
    when its dtype and layout are the parameter's, else a conversion of that tensor."""
    offsets: dict[str, dict[str, tuple[int, int]]] = {}
    out = []
    for t, e in zip(block, entries):
        if e.nbytes == 0 or t.info is None:
            continue
        info = t.info
        if info.offset is None and info.path not in offsets:
            offsets[info.path] = tensor_offsets(info.path)
        start = info.offset if info.offset is not None else offsets[info.path][info.key][0]
        convert = None
        if info.dtype != e.dtype or not t.tensor.is_contiguous():
            # Stored in another dtype: cast through the parameter's own first, as the
            # model in memory is cast (fp32 file -> bf16 model -> fp8 store), never at once
            via = e.compute_dtype if e.compute_dtype not in (None, info.dtype) else None
            convert = Convert(info.dtype, tuple(t.tensor.shape), e.dtype, e.stride, via)
        out.append(Extent(dest=e.offset, nbytes=e.nbytes, path=info.path, offset=start,
                          src_nbytes=info.nbytes, what=repr(t.fqn), convert=convert))
    return out


# -- the plan, as the manifest records it ----------------------------------------------------
def _layout_rows(plan: LoadPlan, alignment: int) -> list[list]:
    rows = []
    for b, block in enumerate(plan.blocks):
        offsets, _ = plan_offsets([t.nbytes for t in block], alignment)
        for t, off in zip(block, offsets):
            rows.append([b, t.fqn, list(t.tensor.shape), list(t.tensor.stride()), str(t.dtype),
                         off, t.nbytes] + ([str(t.stored_as)] if t.stored_as else []))
    return rows


def _shape_fields(plan: LoadPlan, cfg: DLOConfig, dp: int, mode: str,
                  dtype: Optional[torch.dtype], resident: Sequence[str]) -> dict[str, Any]:
    module = plan.module
    rows = _layout_rows(plan, cfg.alignment)
    return {
        "model": f"{type(module).__module__}.{type(module).__qualname__}",
        "dp": dp, "mode": mode, "alignment": cfg.alignment, "block_bytes": cfg.block_bytes,
        "resident_bytes": cfg.resident_bytes,
        "resident": sorted([resident] if isinstance(resident, str) else resident),
        "dtype": str(dtype) if dtype is not None else None,
        "storage_dtype": str(cfg.storage_dtype) if cfg.storage_dtype is not None else None,
        "blocks": len(plan.blocks),
        "plan_digest": hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:32],
    }


def _block_bytes(plan: LoadPlan, b: int, alignment: int) -> tuple[list[int], int]:
    sizes = [t.nbytes for t in plan.blocks[b]]
    return plan_offsets(sizes, alignment)


# -- writing ---------------------------------------------------------------------------------
def _entries(block: Sequence[Target], offsets: list[int]) -> list[Entry]:
    return [Entry(uid=i, fqn=t.fqn, block=0, offset=off, nbytes=t.nbytes,
                  shape=tuple(t.tensor.shape), stride=tuple(t.tensor.stride()),
                  dtype=t.stored_dtype, compute_dtype=t.dtype if t.stored_as else None)
            for i, (t, off) in enumerate(zip(block, offsets))]


def sampled_digest(read: Any, nbytes: int) -> str:
    """A digest of ``CHECK_SAMPLES`` windows of ``CHECK_WINDOW`` bytes spread evenly over
    ``nbytes`` bytes, ``read(at, n)`` giving the bytes at ``at``: the manifest's check of
    each block of each rank file, compared when the file is loaded."""
    h = hashlib.sha256(str(nbytes).encode())
    for at in sorted({i * nbytes // CHECK_SAMPLES for i in range(CHECK_SAMPLES)} if nbytes else ()):
        n = min(CHECK_WINDOW, nbytes - at)
        got = read(at, n)
        if len(got) != n:
            raise OSError(f"read {len(got)} of {n} bytes")
        h.update(got)
    return h.hexdigest()[:16]


CRC_CHUNK = 16 << 20
"""Bytes read at a time for a block's CRC-32 at load."""


def _identity(st: os.stat_result) -> tuple[int, ...]:
    """What changes when a file is rewritten, replaced or truncated (a ctime is never set
    back by a user call)."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _crc32(read: Any, nbytes: int) -> int:
    """The CRC-32 of ``nbytes`` bytes, ``read(at, n)`` giving the bytes at ``at``."""
    crc = 0
    for at in range(0, nbytes, CRC_CHUNK):
        n = min(CRC_CHUNK, nbytes - at)
        got = read(at, n)
        if len(got) != n:
            raise OSError(f"read {len(got)} of {n} bytes")
        crc = zlib.crc32(got, crc)
    return crc


def _padded_block(block: Sequence[Target], offsets: list[int], spec: ShardSpec) -> torch.Tensor:
    """A block's whole padded flat image, read from the checkpoint with ``pread`` and
    converted as `dlo_fx.load` converts it (the same extents)."""
    flat = torch.zeros(spec.padded_bytes, dtype=torch.uint8)
    read_extents(checkpoint_extents(block, _entries(block, offsets)), 0, flat,
                 f"the block of {block[0].fqn!r}")
    return flat


def _safetensors_header(tensors: list[tuple[str, int]], metadata: dict[str, str],
                        alignment: int) -> bytes:
    """Header of a file of uint8 tensors (name, nbytes) written back to back, padded with
    spaces so the data starts at a multiple of ``alignment``."""
    header: dict[str, Any] = {"__metadata__": metadata}
    cursor = 0
    for name, n in tensors:
        header[name] = {"dtype": "U8", "shape": [n], "data_offsets": [cursor, cursor + n]}
        cursor += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    pad = (-(8 + len(raw))) % alignment
    return struct.pack("<Q", len(raw) + pad) + raw + b" " * pad


def write_shard_dir(model: Any, checkpoint: str | os.PathLike, out: str | os.PathLike, *,
                    dp: int, config: Any = None, dtype: Optional[torch.dtype] = None,
                    key_map: Any = None, strict: bool = True,
                    options: Mapping[str, Any] | DLOConfig | None = None,
                    resident: Sequence[str] = (),
                    subfolder: Optional[str] = None,
                    progress: Optional[Callable[[int, int], None]] = None) -> dict[str, Any]:
    """Write the per-rank shard files of ``checkpoint`` (its ``subfolder``, for a
    component of a diffusers pipeline folder) for ``dp`` ranks into ``out`` (see
    [Note: pre-sharded checkpoints]); returns the manifest. ``dp=1`` writes whole blocks
    (for rank-local mode or one rank). The arguments are `dlo_fx.load`'s; ``progress(done,
    total)`` is told of each block read (fingerprinted), then of each block written."""
    from .discover import resolve_checkpoint
    from .gguf import is_gguf
    from .plan import plan_load
    from .build import construct, materialised

    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise ValueError(f"dlo-fx shard: --dp {dp!r} must be an integer >= 1")
    cfg = DLOConfig.from_options(options, verb="dlo-fx shard")
    ckpt = resolve_checkpoint(checkpoint, subfolder)
    if is_gguf(ckpt):
        raise NotImplementedError(
            f"dlo-fx shard: {ckpt.source!r} is a GGUF file, which is not sharded yet; load it "
            "with dlo_fx.load (host_store='mmap' serves its quantized bytes from the file)")
    module = construct(model, config, ckpt)
    plan = plan_load(module, ckpt, cfg, dtype=dtype, key_map=key_map, strict=strict,
                     resident=resident)
    mode = "allgather" if dp > 1 else "rank_local"
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if (out / MANIFEST).exists():
        (out / MANIFEST).unlink()  # a half-written folder is never taken for a finished one
    shard_id = uuid.uuid4().hex
    specs, offsets, fingerprints = [], [], []
    report = progress or (lambda done, total: None)
    steps = 2 * len(plan.blocks)  # each block read (fingerprint), then written
    report(0, steps)
    for b in range(len(plan.blocks)):
        offs, total = _block_bytes(plan, b, cfg.alignment)
        offsets.append(offs)
        specs.append(ShardSpec.of(total, dp, cfg.alignment))
        entries = _entries(plan.blocks[b], offs)  # as `dlo_fx.load` fingerprints the checkpoint
        fingerprints.append(file_fingerprint(
            entries, extent_sources(entries, checkpoint_extents(plan.blocks[b], entries))))
        report(b + 1, steps)
    checks: list[list[str]] = [[] for _ in range(dp)]
    crcs: list[list[int]] = [[] for _ in range(dp)]
    sizes = [s.shard_bytes if dp > 1 else s.padded_bytes for s in specs]
    names = [rank_file(r, dp) for r in range(dp)]
    handles = [open(out / n, "wb") for n in names]
    try:
        for r, f in enumerate(handles):
            f.write(_safetensors_header([(f"block.{b}", n) for b, n in enumerate(sizes)],
                                        {"format": FORMAT, "shard_id": shard_id, "rank": str(r),
                                         "dp": str(dp)}, cfg.alignment))
        for b, block in enumerate(plan.blocks):
            flat = _padded_block(block, offsets[b], specs[b])
            for r, f in enumerate(handles):
                lo = specs[b].rank_range(r)[0] if dp > 1 else 0
                data = flat[lo : lo + sizes[b]].numpy().tobytes()
                checks[r].append(sampled_digest(lambda at, n: data[at : at + n], sizes[b]))
                crcs[r].append(zlib.crc32(data))
                f.write(data)
            del flat
            report(len(plan.blocks) + b + 1, steps)
    finally:
        for f in handles:
            f.close()
    common: dict[str, torch.Tensor] = {}
    small = [t for t in plan.buffers + plan.resident if t.info is not None]
    for t in small:
        common[t.fqn] = materialised(t, read_tensor(t.info), torch.device("cpu")).contiguous()
    from safetensors.torch import save

    data = save(common, metadata={"format": FORMAT, "shard_id": shard_id})
    (out / COMMON).write_bytes(data)
    common_crc = zlib.crc32(data)
    if ckpt.folder is not None and (Path(ckpt.folder) / "config.json").is_file():
        shutil.copy(Path(ckpt.folder) / "config.json", out / "config.json")
    tensors = {}
    for t in plan.params + plan.buffers:
        if t.info is not None:
            tensors[t.fqn] = {"dtype": str(t.dtype), "shape": list(t.tensor.shape)}
    manifest = {
        "format": FORMAT, "shard_id": shard_id, "source": ckpt.source,
        **_shape_fields(plan, cfg, dp, mode, dtype, resident),
        "block_shard_bytes": sizes,
        "fingerprints": fingerprints,
        "block_checks": checks,
        "block_crc32": crcs,
        "common_crc32": common_crc,
        "files": {n: (out / n).stat().st_size for n in names + [COMMON]},
        "tensors": tensors,
    }
    tmp = out / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, out / MANIFEST)
    return manifest


# -- reading ---------------------------------------------------------------------------------
_FIELDS: dict[str, Any] = {  # manifest field -> what it must be
    "shard_id": str, "source": str, "model": str, "dp": int, "mode": str, "alignment": int,
    "blocks": int, "plan_digest": str, "block_shard_bytes": list, "fingerprints": list,
    "block_checks": list, "block_crc32": list, "common_crc32": int, "files": dict,
    "tensors": dict,
}


def _check_manifest(path: Path, manifest: dict[str, Any]) -> None:
    """CheckpointError naming the first field of ``manifest`` that is missing or malformed."""
    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{path}: malformed manifest: {what}; rerun `dlo-fx shard` (a "
                               "manifest is written by it, never by hand)")

    for name, kind in _FIELDS.items():
        value = manifest.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise bad(f"field {name!r} is {value!r}, expected a {kind.__name__}")
    dp, blocks = manifest["dp"], manifest["blocks"]
    if dp < 1 or blocks < 0:
        raise bad(f"dp={dp}, blocks={blocks}")
    for name, count in (("block_shard_bytes", blocks), ("fingerprints", blocks)):
        value = manifest[name]
        if len(value) != count or not all(isinstance(v, int) and not isinstance(v, bool)
                                           and v >= 0 for v in value):
            raise bad(f"field {name!r} is not {count} integers >= 0")
    checks = manifest["block_checks"]
    if len(checks) != dp or not all(isinstance(c, list) and len(c) == blocks and all(
            isinstance(x, str) for x in c) for c in checks):
        raise bad(f"field 'block_checks' is not {dp} lists of {blocks} digests")
    crcs = manifest["block_crc32"]
    if len(crcs) != dp or not all(isinstance(c, list) and len(c) == blocks and all(
            isinstance(x, int) and not isinstance(x, bool) for x in c) for c in crcs):
        raise bad(f"field 'block_crc32' is not {dp} lists of {blocks} integers")
    if not all(isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)
               for k, v in manifest["files"].items()):
        raise bad("field 'files' does not map file names to sizes")
    for fqn, meta in manifest["tensors"].items():
        if (not isinstance(meta, dict) or not isinstance(meta.get("dtype"), str)
                or not isinstance(meta.get("shape"), list)
                or not all(isinstance(n, int) and n >= 0 for n in meta["shape"])):
            raise bad(f"tensor {fqn!r} is {meta!r}, expected {{'dtype': ..., 'shape': [...]}}")
        try:
            _dtype(meta["dtype"])
        except (AttributeError, TypeError):
            raise bad(f"tensor {fqn!r} has dtype {meta['dtype']!r}, not a torch dtype") from None


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."))
    if not isinstance(dtype, torch.dtype):
        raise TypeError(name)
    return dtype


@dataclass
class ShardDir:
    """A folder written by ``dlo-fx shard``, as `dlo_fx.load` reads it."""

    folder: Path
    manifest: dict[str, Any]

    def __post_init__(self) -> None:
        self._offsets: dict[str, dict[str, tuple[int, int]]] = {}  # checked rank files
        self._checked: dict[Path, tuple[int, ...]] = {}  # checked file -> `_identity` then

    @classmethod
    def open(cls, path: str | os.PathLike) -> Optional["ShardDir"]:
        """The shard folder at ``path``, or None when ``path`` is no such folder."""
        folder = Path(path)
        if not (folder / MANIFEST).is_file():
            return None
        try:
            manifest = json.loads((folder / MANIFEST).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{folder / MANIFEST}: unreadable manifest ({exc}); rerun "
                                  "`dlo-fx shard`") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise CheckpointError(f"{folder / MANIFEST}: not a {FORMAT} manifest; rerun "
                                  "`dlo-fx shard` with this version of dlo-fx")
        _check_manifest(folder / MANIFEST, manifest)
        return cls(folder, manifest)

    @property
    def dp(self) -> int:
        return int(self.manifest["dp"])

    def _check_file(self, name: str, rank: Optional[int] = None) -> Path:
        path = self.folder / name
        want = self.manifest["files"].get(name)
        if not path.is_file():
            raise CheckpointError(f"pre-sharded checkpoint {self.folder}: shard file {name} is "
                                  "missing; copy it from where `dlo-fx shard` wrote it, or "
                                  "rerun `dlo-fx shard`")
        size = path.stat().st_size
        if size != want:
            raise CheckpointError(f"pre-sharded checkpoint {self.folder}: {name} has {size} "
                                  f"bytes, the manifest says {want}; the file is truncated or "
                                  "from another `dlo-fx shard` run: rerun it")
        try:
            metadata = _metadata(str(path))
        except (OSError, ValueError, struct.error) as exc:
            raise CheckpointError(f"pre-sharded checkpoint {self.folder}: {name} has no "
                                  f"readable header ({exc}); rerun `dlo-fx shard`") from None
        got = metadata.get("shard_id")
        if got != self.manifest["shard_id"]:
            raise CheckpointError(f"pre-sharded checkpoint {self.folder}: {name} belongs to "
                                  f"another `dlo-fx shard` output (shard id {got}, the manifest "
                                  f"says {self.manifest['shard_id']}); do not mix shard "
                                  "folders: copy all files of one run")
        if rank is not None and metadata.get("rank") != str(rank):
            raise CheckpointError(f"pre-sharded checkpoint {self.folder}: {name} holds the shard "
                                  f"of rank {metadata.get('rank')}, not of rank {rank} (files "
                                  "renamed or swapped); copy each rank file under its own name")
        return path

    def _rank_file(self, rank: int) -> tuple[str, dict[str, tuple[int, int]]]:
        """This rank's file, checked against the manifest, and its blocks' byte ranges.

        Every ``block.B`` of the header must be a uint8 tensor of exactly the manifest's
        ``block_shard_bytes[B]`` bytes inside the file, and the sampled bytes of each must
        match the manifest's ``block_checks``: a header that gives a block fewer bytes left
        the rest of its slot holding the previous block's bytes."""
        name = rank_file(rank if self.dp > 1 else 0, self.dp)
        found = self._offsets.get(name)
        if found is not None:
            return name, found
        path = self._check_file(name, rank if self.dp > 1 else 0)
        where = f"pre-sharded checkpoint {self.folder}: {name}"
        fix = "the file does not match its manifest: copy it again from the `dlo-fx shard` run"
        try:
            with open(path, "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(length))
            header.pop("__metadata__")
            base, size = 8 + length, path.stat().st_size
        except (OSError, ValueError, KeyError, AttributeError, struct.error) as exc:
            raise CheckpointError(f"{where}: unreadable header ({exc}); {fix}") from None
        sizes = self.manifest["block_shard_bytes"]
        names = {f"block.{b}" for b in range(len(sizes))}
        if set(header) != names:
            extra = sorted(set(header) - names)[:3]
            missing = sorted(names - set(header))[:3]
            raise CheckpointError(f"{where} holds tensors {extra} the manifest does not name "
                                  f"and lacks {missing}; {fix}")
        offsets = {}
        digests = self.manifest["block_checks"][rank if self.dp > 1 else 0]
        crcs = self.manifest["block_crc32"][rank if self.dp > 1 else 0]
        with open(path, "rb") as f:
            before = _identity(os.fstat(f.fileno()))
            for b, want in enumerate(sizes):
                meta = header[f"block.{b}"]
                span = meta.get("data_offsets") if isinstance(meta, dict) else None
                if (not isinstance(span, list) or len(span) != 2
                        or not all(isinstance(x, int) for x in span)
                        or meta.get("dtype") != "U8" or meta.get("shape") != [want]
                        or span[1] - span[0] != want or span[0] < 0
                        or base + span[1] > size):
                    raise CheckpointError(
                        f"{where}: its header gives block.{b} {meta!r} but the manifest says "
                        f"{want} bytes of U8 (block_shard_bytes) inside the file's {size} "
                        f"bytes; {fix}")
                start = base + span[0]

                def read(at: int, n: int, start: int = start) -> bytes:
                    return os.pread(f.fileno(), n, start + at)

                if sampled_digest(read, want) != digests[b]:
                    raise CheckpointError(
                        f"{where}: the bytes of block.{b} differ from those `dlo-fx shard` "
                        f"wrote (sampled check); {fix}")
                if _crc32(read, want) != crcs[b]:
                    raise CheckpointError(
                        f"{where}: the bytes of block.{b} differ from those `dlo-fx shard` "
                        f"wrote (CRC-32 of the block); {fix}")
                offsets[f"block.{b}"] = (start, start + want)
            self._identified(path, before, os.fstat(f.fileno()))
        self._offsets[name] = offsets
        return name, offsets

    def _identified(self, path: Path, before: tuple[int, ...], after: os.stat_result) -> None:
        """Remember ``path`` as checked, unless it changed while it was (``before``: its
        `_identity` when the check began)."""
        if _identity(after) != before:
            raise CheckpointError(f"pre-sharded checkpoint {self.folder}: {path.name} changed "
                                  "while dlo_fx.load checked it; load again once nothing "
                                  "writes to the folder")
        self._checked[path] = before

    def recheck(self) -> None:
        """Raise when a file checked at this load (`_rank_file`, `checkpoint`) changed
        since: the load read it again after the check, and may have read other bytes."""
        for path, seen in self._checked.items():
            try:
                now: Optional[tuple[int, ...]] = _identity(os.stat(path))
            except OSError:
                now = None
            if now != seen:
                raise CheckpointError(
                    f"pre-sharded checkpoint {self.folder}: {path.name} was "
                    f"{'removed' if now is None else 'rewritten or replaced'} while "
                    "dlo_fx.load read it, after its bytes were checked against the manifest: "
                    "the weights loaded may not be those checked. Load again once nothing "
                    "writes to the folder (copy a shard folder before loading from it)")

    def _check_common(self, path: Path) -> None:
        """``common.safetensors``'s bytes against the manifest's ``common_crc32``."""
        with open(path, "rb") as f:
            before = _identity(os.fstat(f.fileno()))
            crc = _crc32(lambda at, n: os.pread(f.fileno(), n, at), before[2])
            if crc != self.manifest["common_crc32"]:
                raise CheckpointError(
                    f"pre-sharded checkpoint {self.folder}: the bytes of {COMMON} differ from "
                    "those `dlo-fx shard` wrote (CRC-32 of the file; it holds the resident "
                    "parameters and buffers); the file does not match its manifest: copy it "
                    "again from the `dlo-fx shard` run, or rerun `dlo-fx shard`")
            self._identified(path, before, os.fstat(f.fileno()))

    def checkpoint(self, source: str) -> Checkpoint:
        """The tensors the manifest promises, for planning the load (`plan_load`); those in
        ``common.safetensors`` checked against its header (dtype and shape), and its bytes
        against the manifest (``common_crc32``)."""
        common_path = self._check_file(COMMON)
        self._check_common(common_path)
        common = str(common_path)
        in_common = read_header(common)
        tensors = {}
        for fqn, meta in self.manifest["tensors"].items():
            dtype, shape = _dtype(meta["dtype"]), tuple(meta["shape"])
            nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
            held = in_common.get(fqn)
            if held is not None and (held.dtype, held.shape) != (dtype, shape):
                raise CheckpointError(
                    f"pre-sharded checkpoint {self.folder}: {COMMON} holds {fqn!r} as "
                    f"{held.dtype} {list(held.shape)}, the manifest says {dtype} {list(shape)}; "
                    "the file does not match its manifest: rerun `dlo-fx shard`")
            tensors[fqn] = TensorInfo(key=fqn, path=common if held is not None else "",
                                      dtype=dtype, shape=shape, nbytes=nbytes,
                                      offset=held.offset if held is not None else None)
        return Checkpoint(source=source, files=(common,), tensors=tensors,
                          folder=str(self.folder),
                          described=f"the pre-sharded checkpoint {self.folder}: its {MANIFEST} "
                                    f"and the tensors of {COMMON} and the rank files")

    def check(self, plan: LoadPlan, cfg: DLOConfig, *, dp: int, mode: Optional[str],
              rank: int, dtype: Optional[torch.dtype], resident: Sequence[str],
              key_map: Any) -> None:
        """Raise ValueError naming every field in which this load differs from the one the
        folder was written for, or a shard file this rank needs that is missing, foreign
        or does not match the manifest."""
        where = f"dlo_fx.load: pre-sharded checkpoint {self.folder}"
        if key_map is not None:
            raise ValueError(f"{where}: its keys are model FQNs already; drop key_map=")
        if mode is None:
            raise ValueError(f"{where} was written for mode={self.manifest['mode']!r}; mode='auto' "
                             "cannot choose another: pass options={'mode': "
                             f"{self.manifest['mode']!r}}}")
        shards = dp if mode == "allgather" else 1
        mine = _shape_fields(plan, cfg, shards, mode, dtype, resident)
        diffs = [f"{k}: written for {self.manifest.get(k)!r}, this load has {v!r}"
                 for k, v in mine.items() if self.manifest.get(k) != v]
        if diffs:
            raise ValueError(
                f"{where} does not match this load:\n  " + "\n  ".join(diffs) +
                "\nload with the options it was written for, or rerun `" +
                self._command(mine, shards) + "` for this load's")
        self._rank_file(rank)

    def _command(self, fields: Mapping[str, Any], shards: int) -> str:
        """The ``dlo-fx shard`` command that writes this folder for a load whose
        `_shape_fields` are ``fields``."""
        words = ["dlo-fx shard", str(self.manifest.get("source")), "--dp", str(shards),
                 "--out", str(self.folder)]
        for flag, key in (("--dtype", "dtype"), ("--storage-dtype", "storage_dtype")):
            if fields[key] is not None:
                words += [flag, fields[key].removeprefix("torch.")]
        defaults = DLOConfig()
        options = {k: fields[k] for k in ("alignment", "block_bytes", "resident_bytes")
                   if fields[k] != getattr(defaults, k)}
        if options:
            words += ["--options", "'" + json.dumps(options) + "'"]
        for name in fields["resident"]:
            words += ["--resident", name]
        return " ".join(words)

    def block_extents(self, index: int, rank: int, spec: ShardSpec) -> list[Extent]:
        """Block ``index``'s bytes of ``rank``'s range, in that rank's file."""
        name, offsets = self._rank_file(rank)
        start, end = offsets[f"block.{index}"]
        want = spec.shard_bytes if self.dp > 1 else spec.padded_bytes
        if end - start != want:
            raise CheckpointError(
                f"pre-sharded checkpoint {self.folder}: {name} holds {end - start} bytes of "
                f"block.{index}, but this load's layout needs {want}; rerun `dlo-fx shard`")
        lo = spec.rank_range(rank)[0] if self.dp > 1 else 0
        path = str(self.folder / name)
        return [Extent(dest=lo, nbytes=end - start, path=path, offset=start,
                       src_nbytes=end - start, what=f"block.{index} of {name}")]

    def fingerprint(self, index: int) -> int:
        """Block ``index``'s fingerprint of the checkpoint, as `dlo_fx.load` takes it
        (`runtime.host.fingerprint.file_fingerprint`), recorded when the folder was written."""
        return int(self.manifest["fingerprints"][index])
