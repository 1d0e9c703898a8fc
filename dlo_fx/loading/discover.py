"""Find the checkpoint a path or hub id names: `resolve_checkpoint`.

Forms understood by `resolve_checkpoint`:

* one ``.safetensors`` file;
* a folder holding a ``*.safetensors.index.json`` (the Hugging Face / diffusers sharded
  layout: ``weight_map`` names the file of every tensor), or that index file itself;
* a folder of ``.safetensors`` files without an index (their tensors are united);
* a ``.gguf`` file, or a folder holding one (and no safetensors): read by gguf.py;
* a local Hugging Face cache repo folder (``models--org--name``, resolved through
  ``refs/main`` or its only ``snapshots/<rev>/``), or a hub id ``org/name`` already in the
  local cache. Nothing is ever downloaded.

Pickled checkpoints (``.bin``, ``.pt``, ``.pth``, ...) are refused: only safetensors (and
GGUF) are loaded. Every header is parsed and checked against the file size before any tensor
is read, so a truncated file or a corrupt header is an error naming the file, not a crash
halfway.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional

from .checkpoint import (Checkpoint, CheckpointError, from_files, from_index, odd_path,
                         refuse_pickles)
from .gguf import read_gguf

__all__ = ["hf_cache_dirs", "resolve_checkpoint"]

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def hf_cache_dirs() -> list[Path]:
    """Folders a local Hugging Face hub cache may live in, most specific first."""
    dirs = []
    if os.environ.get("HF_HUB_CACHE"):
        dirs.append(Path(os.environ["HF_HUB_CACHE"]))
    if os.environ.get("HF_HOME"):
        dirs.append(Path(os.environ["HF_HOME"]) / "hub")
    xdg = os.environ.get("XDG_CACHE_HOME")
    dirs.append((Path(xdg) if xdg else Path.home() / ".cache") / "huggingface" / "hub")
    return list(dict.fromkeys(dirs))


def _snapshot(repo: Path) -> Path:
    """``models--org--name`` -> its ``snapshots/<rev>`` (``refs/main``, else the only one)."""
    snaps = repo / "snapshots"
    ref = repo / "refs" / "main"
    if ref.is_file():
        rev = ref.read_text().strip()
        if (snaps / rev).is_dir():
            return snaps / rev
    revs = sorted(p for p in snaps.iterdir() if p.is_dir()) if snaps.is_dir() else []
    if len(revs) == 1:
        return revs[0]
    if not revs:
        raise CheckpointError(f"{repo}: a Hugging Face cache repo folder without snapshots; "
                              "download the model first")
    raise CheckpointError(f"{repo}: several snapshots ({', '.join(r.name for r in revs)}) and no "
                          "refs/main; pass the snapshots/<rev> folder you want")


_SUFFIXES = (".safetensors", ".safetensors.index.json", ".gguf")
"""The names of the files a checkpoint folder is read from."""


def _refuse_odd(path: Path, what: str) -> None:
    """CheckpointError where ``path`` is neither a file nor a folder (`odd_path`)."""
    odd = odd_path(path)
    if odd is not None:
        raise CheckpointError(f"{what} {os.fspath(path)!r} is {odd}, not a file or a folder; "
                              "pass a .safetensors or .gguf file, a *.safetensors.index.json, "
                              "or a folder of them")


def _locate(source: str | os.PathLike) -> Path:
    path = Path(source).expanduser()
    _refuse_odd(path, "checkpoint path")
    if path.exists():
        if path.is_dir() and (path / "snapshots").is_dir() and path.name.startswith("models--"):
            return _snapshot(path)
        return path
    text = os.fspath(source)
    if isinstance(source, str) and _HUB_ID.match(text):
        name = "models--" + text.replace("/", "--")
        looked = hf_cache_dirs()
        for cache in looked:
            if (cache / name).is_dir():
                return _snapshot(cache / name)
        raise CheckpointError(
            f"checkpoint {text!r} does not exist as a path, and as a hub id it is not in the "
            f"local cache (looked for {name} in {', '.join(str(d) for d in looked)}); "
            "dlo_fx.load never downloads: fetch the model first (e.g. `huggingface-cli "
            "download ...`) or pass a local path")
    raise CheckpointError(f"checkpoint path {text!r} does not exist")


def resolve_checkpoint(source: str | os.PathLike, subfolder: Optional[str] = None) -> Checkpoint:
    """Find and validate the checkpoint ``source`` names (see the module docstring);
    ``subfolder`` is a folder inside it (a component of a diffusers pipeline folder)."""
    text = os.fspath(source)
    path = _locate(source)
    if subfolder:
        if not path.is_dir():
            raise CheckpointError(f"subfolder={subfolder!r} needs a folder, but {text!r} is "
                                  "a file")
        _refuse_odd(path / subfolder, "subfolder")
        if not (path / subfolder).is_dir():
            raise CheckpointError(f"{path} has no subfolder {subfolder!r}"
                                  + _components_hint(path))
        path = path / subfolder
        text = os.path.join(text, subfolder)
    if path.is_file():
        if path.name.endswith(".safetensors.index.json"):
            return from_index(path, text)
        if path.name.endswith(".safetensors"):
            return from_files([path], text, None)
        if path.name.endswith(".gguf"):
            return read_gguf(path, text, None)
        refuse_pickles([path], str(path))
        raise CheckpointError(f"{path}: not a .safetensors file, a *.safetensors.index.json "
                              "index or a .gguf file; dlo_fx only loads safetensors and GGUF")
    children = sorted(path.iterdir())
    odd = [(p.name, odd_path(p)) for p in children if p.name.endswith(_SUFFIXES)]
    odd = [(name, what) for name, what in odd if what is not None]
    if odd:
        raise CheckpointError(f"{path} holds {odd[0][0]}, which is {odd[0][1]}: a checkpoint's "
                              "files must be regular files; remove it or put the file itself "
                              "there")
    indexes = [p for p in children if p.name.endswith(".safetensors.index.json")]
    if len(indexes) > 1:
        raise CheckpointError(f"{path} holds several safetensors indexes "
                              f"({', '.join(p.name for p in indexes)}); pass the one to load")
    if indexes:
        return from_index(indexes[0], text)
    files = [p for p in children if p.name.endswith(".safetensors") and p.is_file()]
    if files:
        return from_files(files, text, path)
    ggufs = [p for p in children if p.name.endswith(".gguf") and p.is_file()]
    if len(ggufs) > 1:
        raise CheckpointError(f"{path} holds several .gguf files "
                              f"({', '.join(p.name for p in ggufs)}); pass the one to load")
    if ggufs:
        return read_gguf(ggufs[0], text, path)
    refuse_pickles(children, str(path))
    raise CheckpointError(f"{path} holds no .safetensors file, no *.safetensors.index.json "
                          "and no .gguf file" + _components_hint(path))


def _components_hint(path: Path) -> str:
    """For a diffusers pipeline folder: which subfolders hold weights."""
    index = path / "model_index.json"
    if not index.is_file():
        return ""
    names = sorted(p.name for p in path.iterdir() if p.is_dir() and any(
        c.name.endswith(_SUFFIXES) for c in p.iterdir()))
    return (f"; it is a diffusers pipeline folder (model_index.json): pass subfolder= (dlo-fx shard: --subfolder) one of "
            f"{', '.join(map(repr, names)) or '(none holds safetensors)'}, e.g. "
            "dlo_fx.load(FluxTransformer2DModel, root, subfolder='transformer')")
