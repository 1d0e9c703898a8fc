"""A safetensors checkpoint: validate every file's header, and read tensors
with ``os.pread`` (never through a mapping: a file truncated while it is read is an error
naming it, where a mapped page of it raised SIGBUS).

Where a checkpoint is found (a file, an index, a folder, the local Hugging Face cache): discover.py.

Pickled checkpoints (``.bin``, ``.pt``, ``.pth``, ...) are refused: only safetensors (and
GGUF) are loaded. Every header is parsed and checked against the file size before any tensor
is read, so a truncated file or a corrupt header is an error naming the file, not a crash
halfway.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

log = logging.getLogger(__name__)

__all__ = ["CheckpointError", "Checkpoint", "TensorInfo", "from_files", "from_index",
           "header_json", "load_error", "odd_path", "read_header", "refuse_pickles",
           "read_tensor"]

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")

_MAX_HEADER_BYTES = 100 * 2**20  # the safetensors format's own limit

_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16,
    "I32": torch.int32, "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16,
    "F32": torch.float32, "F64": torch.float64,
}
for _name, _attr in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"),
                     ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2")):
    if hasattr(torch, _attr):
        _DTYPES[_name] = getattr(torch, _attr)


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: missing, refused, or malformed."""


_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def odd_path(path: str | os.PathLike) -> Optional[str]:
    """What ``path`` is where it names neither a regular file nor a folder, said so that
    ``f"{path} is {odd_path(path)}"`` reads: a loop of symbolic links, a link to nothing,
    a FIFO, a socket or a device (a link to one named with its target), a path that cannot
    be looked at; None for a file, a folder, or nothing at all (a path that does not
    exist). Checked before anything is opened: reading a FIFO blocks until a writer
    comes, and a device's bytes never end."""
    path = os.fspath(path)
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "a loop of symbolic links (each link leads back to one of them)"
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            if os.path.islink(path):
                return f"a symbolic link to {os.readlink(path)!r}, which does not exist"
            return None
        return f"a path that cannot be looked at ({exc.strerror})"
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    kind = next((what for test, what in _KINDS if test(mode)), "not a regular file")
    target = os.path.realpath(path)
    return kind + (f" (a symbolic link to {target})" if os.path.islink(path) else "")


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors (or GGUF) file, as its header describes it."""

    key: str
    path: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    offset: Optional[int] = None  # where its bytes start in the file (None: not known)
    # A quantized GGUF tensor: its GGMLQuantizationType and the shape of its values
    # (``shape`` is then that of its uint8 bytes); None for a plain tensor
    quant_type: Any = None
    quant_shape: Optional[tuple[int, ...]] = None


@dataclass(frozen=True)
class Checkpoint:
    """A validated checkpoint: every tensor's file, dtype and shape, by checkpoint key."""

    source: str  # what the caller passed, for messages
    files: tuple[str, ...]
    tensors: dict[str, TensorInfo] = field(repr=False)
    folder: Optional[str] = None  # the model folder (where a config.json may live)
    described: Optional[str] = None  # what messages call its files, where ``files`` is not all

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def describe_files(self) -> str:
        """The file, or how many files and their folder, for messages."""
        if self.described is not None:
            return self.described
        if len(self.files) == 1:
            return self.files[0]
        return f"{len(self.files)} files in {os.path.dirname(self.files[0])}"


# -- headers ------------------------------------------------------------------------------
# What a file that is not safetensors starts with, for the message that names it.
_OTHER_FORMATS = (
    (b"PK\x03\x04", "a zip archive (what torch.save writes): pickled weights, which dlo_fx "
                     "never loads; convert it to safetensors first"),
    (b"GGUF", "a GGUF file: name it *.gguf and dlo_fx.load reads it as one"),
    (b"\x80\x02", "a pickle (an old torch.save): dlo_fx never loads pickles; convert it to "
                   "safetensors first"),
    (b"\x93NUMPY", "a NumPy .npy file, not safetensors"),
    (b"\x89HDF", "an HDF5 file (Keras/TensorFlow weights), not safetensors"),
)


def _not_safetensors(path: str, head: bytes) -> Optional[CheckpointError]:
    """The error for a file whose first bytes are another format's, else None."""
    for magic, what in _OTHER_FORMATS:
        if head.startswith(magic):
            return CheckpointError(f"{path}: not a safetensors file: it is {what}")
    if head[:1] in (b"{", b"<") or head[:3] == b"\xef\xbb\xbf":
        return CheckpointError(f"{path}: not a safetensors file: it starts with text "
                               f"({head[:8]!r}), not an 8-byte header length; a safetensors "
                               "file begins with the length of its JSON header")
    return None


def header_json(path: str | os.PathLike) -> tuple[dict[str, Any], int, int]:
    """The JSON header of the safetensors file ``path`` as a dict, the file offset of its
    first data byte (8 + header length), and the file's size.

    Every way a file can fail to be safetensors is a `CheckpointError` naming the file (a
    file too short, another format's magic, a header length beyond the file, a header that
    is not UTF-8 or not JSON or not an object, a ``__metadata__`` that is not an object of
    strings); nothing else escapes (a ``UnicodeDecodeError`` that named no file was what a
    user met). A header without ``__metadata__``, or with ``"__metadata__": null``, is
    fine: the format makes it optional.
    """
    path = os.fspath(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes; the "
                                      "8-byte header length is missing)")
            (length,) = struct.unpack("<Q", head)
            if length > _MAX_HEADER_BYTES or 8 + length > size:
                other = _not_safetensors(path, head)
                if other is not None:
                    raise other
                raise CheckpointError(
                    f"{path}: corrupt or truncated safetensors file: its header claims {length} "
                    f"bytes but the file has {size} bytes; re-download or re-save it")
            raw = f.read(length)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read the checkpoint file: {exc}") from exc
    if len(raw) < length:
        raise CheckpointError(f"{path}: the file ended inside its safetensors header (read "
                              f"{len(raw)} of {length} bytes); it changed while it was read")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CheckpointError(
            f"{path}: corrupt safetensors header: byte 0x{raw[exc.start]:02x} at file byte "
            f"{8 + exc.start} is not UTF-8 ({exc.reason}); the format's header is UTF-8 JSON "
            "(metadata values are strings): re-download or re-save the file") from None
    try:
        header = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: corrupt safetensors header (not JSON: {exc}); "
                              "re-download or re-save the file") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (a JSON {type(header).__name__}, "
                              "not an object)")
    meta = header.get("__metadata__")
    if meta is not None and not (isinstance(meta, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in meta.items())):
        raise CheckpointError(f"{path}: corrupt safetensors header: __metadata__ must be an "
                              f"object of string values, found {_short(meta)}; safetensors "
                              "itself refuses such a file: re-save it")
    return header, 8 + length, size


def _short(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def read_header(path: str | os.PathLike) -> dict[str, TensorInfo]:
    """Parse and check the header of one safetensors file (reads no tensor data).

    Raises `CheckpointError` naming the file for anything `header_json` refuses, an
    unknown dtype, or a tensor whose bytes do not fit in the file (a truncated download).
    """
    path = os.fspath(path)
    header, base, size = header_json(path)
    data_bytes = size - base
    out: dict[str, TensorInfo] = {}
    for key, meta in header.items():
        if key == "__metadata__":
            continue
        out[key] = _tensor_info(path, key, meta, data_bytes, base)
    _check_layout(path, out, base, size)
    _check_with_reader(path)
    return out


def _check_layout(path: str, tensors: dict[str, TensorInfo], base: int, size: int) -> None:
    """The tensors tile the data section, as safetensors' reader requires: each begins
    where the one before it (by offset) ends, and the last ends at the end of the file (no
    gap, overlap or trailing bytes). Checked from the header alone, so that a file no
    mapping can hold is checked too (`_check_with_reader`)."""
    end = base
    for info in sorted(tensors.values(), key=lambda t: (t.offset, t.nbytes)):
        if info.offset != end:
            what = "an overlap" if info.offset < end else "a gap"
            raise CheckpointError(
                f"{path}: corrupt safetensors header: tensor {info.key!r} starts at data byte "
                f"{info.offset - base}, the tensors before it end at data byte {end - base} "
                f"({what}); re-download or re-save it")
        end = info.offset + info.nbytes
    if end != size:
        raise CheckpointError(
            f"{path}: corrupt safetensors file: its tensors end at data byte {end - base}, "
            f"{size - end} bytes before the end of the file; re-download or re-save it")


def _check_with_reader(path: str) -> None:
    """Let safetensors itself check the file (what it checks beyond `_check_layout`).
    Opening maps the whole file but touches no tensor page. A mapping the host refuses (a
    file larger than the address space a limit leaves: ``ENOMEM``) says nothing about the
    file, and dlo reads tensors without one (`read_tensor`), so that check is then skipped,
    with a log line: such a file loads, not "re-download it"."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt", device="cpu"):
            pass
    except Exception as exc:  # safetensors raises its own error types
        if not _mapping_failed(exc):
            raise CheckpointError(f"{path}: safetensors refuses the file ({exc}); "
                                  "re-download or re-save it") from None
        log.info("%s: safetensors cannot map the file to check it (%s); its header was checked "
                 "without it, and its tensors are read without a mapping", path, exc)


def _mapping_failed(exc: Exception) -> bool:
    """Whether safetensors failed to map a file, not to accept it. It maps the file twice:
    with a mapping of its own (a MemoryError, "Cannot allocate memory (os error 12)", or
    another OSError where the host refuses it), and as torch's storage over the file
    (torch's RuntimeError "unable to mmap N bytes from file <...>")."""
    return isinstance(exc, (MemoryError, OSError)) or "unable to mmap" in str(exc)


def _tensor_info(path: str, key: str, meta: object, data_bytes: int, base: int) -> TensorInfo:
    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{path}: corrupt safetensors header for tensor {key!r}: {what}")

    if not isinstance(meta, dict):
        raise bad(f"expected an object, found {meta!r}")
    dtype = _DTYPES.get(meta.get("dtype"))  # type: ignore[arg-type]
    if dtype is None:
        raise bad(f"unknown or unsupported dtype {meta.get('dtype')!r}")
    shape, offsets = meta.get("shape"), meta.get("data_offsets")
    if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise bad(f"shape {shape!r} is not a list of sizes")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) for o in offsets) or not 0 <= offsets[0] <= offsets[1]):
        raise bad(f"data_offsets {offsets!r} is not [begin, end]")
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if offsets[1] - offsets[0] != nbytes:
        raise bad(f"data_offsets {offsets} span {offsets[1] - offsets[0]} bytes but "
                  f"{meta['dtype']} {shape} needs {nbytes}")
    if offsets[1] > data_bytes:
        raise CheckpointError(
            f"{path}: truncated safetensors file: tensor {key!r} ends at data byte {offsets[1]} "
            f"but the file holds only {data_bytes} data bytes; re-download or re-save it")
    return TensorInfo(key=key, path=path, dtype=dtype, shape=tuple(shape), nbytes=nbytes,
                      offset=base + offsets[0])


def refuse_pickles(paths: Sequence[Path], where: str) -> None:
    pickles = sorted(p.name for p in paths if p.name.endswith(PICKLE_SUFFIXES)
                     or p.name.endswith(tuple(s + ".index.json" for s in PICKLE_SUFFIXES)))
    if pickles:
        raise CheckpointError(
            f"{where} holds pickled weights ({', '.join(pickles[:5])}): dlo_fx only loads "
            "safetensors, never pickles; convert them to .safetensors first")


# -- a checkpoint from its files ------------------------------------------------------------
def from_index(index: Path, source: str) -> Checkpoint:
    try:
        doc = json.loads(index.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{index}: unreadable safetensors index ({exc})") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise CheckpointError(f"{index}: a safetensors index needs a 'weight_map' object "
                              "mapping tensor names to file names")
    files = list(dict.fromkeys(weight_map.values()))
    for name in files:
        _inside(index, name)
        if not name.endswith(".safetensors"):
            refuse_pickles([Path(name)], str(index))
            raise CheckpointError(f"{index}: shard {name!r} is not a .safetensors file")
        odd = odd_path(index.parent / name)
        if odd is not None:
            raise CheckpointError(f"{index} names shard file {name!r}, which is {odd}, not a "
                                  "safetensors file; put the file itself there")
        if not (index.parent / name).is_file():
            raise CheckpointError(f"{index} names shard file {name!r}, which does not exist in "
                                  f"{index.parent}; the download is incomplete")
    headers = {name: read_header(index.parent / name) for name in files}
    tensors = {}
    for key, name in weight_map.items():
        info = headers[name].get(key)
        if info is None:
            raise CheckpointError(f"{index} maps tensor {key!r} to {name!r}, but that file "
                                  "does not hold it")
        tensors[key] = info
    return Checkpoint(source=source, files=tuple(str(index.parent / n) for n in files),
                      tensors=tensors, folder=str(index.parent))


def _inside(index: Path, name: str) -> None:
    """Refuse an index entry that names a file outside the index's folder (an absolute
    path, or ``..`` leading out of it): a checkpoint is the files of its folder. Checked
    on the path as written, so a symbolic link inside the folder (a Hugging Face cache
    snapshot's links into its blobs) is still followed."""
    folder = os.path.normpath(os.path.abspath(index.parent))
    target = os.path.normpath(os.path.join(folder, name))
    if os.path.isabs(name) or os.path.commonpath([folder, target]) != folder:
        raise CheckpointError(f"{index} maps tensors to {name!r}, which is outside the folder "
                              f"{index.parent}; an index may only name files in its own "
                              "folder: move the file there and name it relative to the folder")


def from_files(paths: Sequence[Path], source: str, folder: Optional[Path]) -> Checkpoint:
    tensors: dict[str, TensorInfo] = {}
    for path in paths:
        for key, info in read_header(path).items():
            if key in tensors:
                raise CheckpointError(f"tensor {key!r} is in both {tensors[key].path} and "
                                      f"{path}; add an index file or pass one of them")
            tensors[key] = info
    return Checkpoint(source=source, files=tuple(str(p) for p in paths), tensors=tensors,
                      folder=str(folder) if folder is not None else None)


# -- reading ------------------------------------------------------------------------------
def read_tensor(info: TensorInfo) -> torch.Tensor:
    """The tensor ``info`` names, read with ``os.pread`` into memory of its own (never a
    mapping: a file truncated meanwhile is a `FileChangedError` naming it, not a SIGBUS)."""
    from ..runtime import Extent, read_extents

    offset = info.offset if info.offset is not None else _data_offset(info)
    with torch.inference_mode(False):
        flat = torch.empty(info.nbytes, dtype=torch.uint8)
    read_extents([Extent(dest=0, nbytes=info.nbytes, path=info.path, offset=offset,
                         src_nbytes=info.nbytes, what=repr(info.key))], 0, flat,
                 f"tensor {info.key!r}")
    return flat.view(info.dtype).view(info.shape)


def load_error(exc: BaseException) -> BaseException:
    """``exc`` as `dlo_fx.load` raises it: a file that could not be read as its header
    promised (`FileChangedError`: removed, truncated or rewritten since it was checked) is
    the checkpoint's problem, a `CheckpointError` naming the file."""
    from ..runtime import FileChangedError

    if isinstance(exc, FileChangedError):
        return CheckpointError(str(exc).removeprefix("dlo: "))
    return exc


def _data_offset(info: TensorInfo) -> int:
    found = read_header(info.path).get(info.key)
    if found is None or found.offset is None:
        raise CheckpointError(f"{info.path}: no tensor {info.key!r} in its header; the file "
                              "changed since it was opened: restore it")
    return found.offset
