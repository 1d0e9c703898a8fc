"""The ``dlo-fx shard`` command: its arguments, the model it names, its bar and its summary.

The files it writes, and how `dlo_fx.load` reads them, are the library's
(`dlo_fx.loading.shards.write_shard_dir`, [Note: pre-sharded checkpoints]).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from ..loading.shards import write_shard_dir


def add_shard_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="safetensors file, folder, index or cached hub id")
    parser.add_argument("--subfolder", default=None,
                        help="the component folder inside a diffusers pipeline folder, e.g. "
                        "transformer (as dlo_fx.load(..., subfolder=...))")
    parser.add_argument("--dp", type=int, required=True, help="ranks of the shard group")
    parser.add_argument("--out", required=True, help="folder to write the shard files into")
    parser.add_argument("--model", default=None,
                        help="module:attr of the model class or factory (default: the diffusers "
                        "class named by the checkpoint's config.json)")
    parser.add_argument("--config", default=None,
                        help="JSON object of constructor arguments (default: config.json)")
    parser.add_argument("--dtype", default=None, help="cast floating-point weights, e.g. bfloat16")
    parser.add_argument("--storage-dtype", default=None,
                        help="store the linear and convolution weights in this dtype, e.g. "
                        "float8_e4m3fn, converted block by block while sharding (the "
                        "storage_dtype option; load with the same)")
    parser.add_argument("--options", default="{}",
                        help="JSON dlo options the model will be loaded with (alignment, "
                        "block_bytes, resident_bytes)")
    parser.add_argument("--resident", action="append", default=[],
                        help="parameter FQN or module prefix to keep resident (repeatable)")


def _model_from(spec: Optional[str], ckpt_path: str, subfolder: Optional[str] = None) -> Any:
    if spec is not None:
        module, _, attr = spec.partition(":")
        if not attr:
            raise ValueError(f"dlo-fx shard: --model {spec!r} must be module:attr")
        return getattr(importlib.import_module(module), attr)
    from ..loading.discover import resolve_checkpoint

    folder = resolve_checkpoint(ckpt_path, subfolder).folder
    config = Path(folder) / "config.json" if folder else None
    if config is None or not config.is_file():
        raise ValueError("dlo-fx shard: no config.json next to the checkpoint; pass --model")
    name = json.loads(config.read_text()).get("_class_name")
    import diffusers

    if not name or not hasattr(diffusers, name):
        raise ValueError(f"dlo-fx shard: config.json names class {name!r}, not a diffusers "
                         "class; pass --model")
    return getattr(diffusers, name)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"--dtype {name!r} is not a torch dtype")
    return dtype


class _Bar:
    """A tqdm bar over the blocks read and written, on a terminal (off otherwise), made
    at the first report, when the total is known. It shows every block (a block takes
    far longer than drawing the bar): the bar cleared at the end never stood at an older
    count than the blocks done."""

    def __init__(self) -> None:
        self.bar: Any = None

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            from tqdm.auto import tqdm

            try:
                shown = sys.stderr.isatty()
            except (AttributeError, ValueError):
                shown = False
            self.bar = tqdm(total=total, desc="dlo-fx shard: blocks read and written",
                            unit="block", leave=False, disable=not shown, mininterval=0,
                            miniters=1)
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run_shard(args: argparse.Namespace) -> int:
    options = json.loads(args.options)
    if args.storage_dtype is not None:
        options["storage_dtype"] = args.storage_dtype
    bar = _Bar()
    progress: Callable[[int, int], None] = bar
    try:
        manifest = write_shard_dir(
            _model_from(args.model, args.checkpoint, args.subfolder), args.checkpoint,
            args.out, subfolder=args.subfolder, dp=args.dp,
            config=json.loads(args.config) if args.config else None,
            dtype=_dtype(args.dtype) if args.dtype else None, options=options,
            resident=tuple(args.resident), progress=progress)
    finally:
        bar.close()
    total = sum(manifest["files"].values())
    print(f"wrote {len(manifest['files'])} files ({total} bytes) for dp={manifest['dp']}, "
          f"{manifest['blocks']} blocks, plan {manifest['plan_digest'][:12]}, into {args.out}")
    return 0
