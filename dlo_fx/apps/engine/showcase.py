"""The showcase (``make demo``): two CPU ranks serve a wave of two requests from a
checkpoint, bit-identical to a single-process resident run.

1. The reference DiT checkpoint is written once to a cache folder (``$DLO_FX_CACHE``,
   else ``$XDG_CACHE_HOME/dlo-fx``, else ``~/.cache/dlo-fx``) and reused afterwards.
2. An `Engine` starts 2 worker ranks (one thread each); each loads the checkpoint with
   ``dlo_fx.load`` (only its half of every block reaches its memory) and
   compiles the DiT with ``backend="dlo"`` in AllGather mode.
3. A wave of two requests runs twice (the first compiles); the outputs are compared
   with ``torch.equal`` against each request run alone on a resident model here.
4. A table: wave latency, throughput, per-rank host shard and slot bytes, the peak PSS
   of the process tree (sampled every 50 ms), and where the schedule dump and the PNG
   previews were written; then what it shows, and why a CPU serves fewer requests per
   second streamed than one resident process (the copies and the gather run on the cores
   that compute).

The requests are 128x128 px, 6 steps: on a CPU without bf16 instructions (AVX2 only)
torch's bf16 matmuls take a slow path, 20 to 130 times slower than float32 at the
showcase's shapes (72x512 by 512x2048: 590 ms against 4.5 ms, one thread), and at
256x256 px the showcase took over 3 minutes on 2 such cores; at 128 px it takes about a
minute.

    python -m dlo_fx.apps.engine.showcase
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import torch

from ...runtime import tree_pss
from ..demo import CPU_COPIES
from .cli import write_outputs
from .engine import Engine
from .reference_pipeline import CONFIG_FILE, WEIGHTS_FILE, resident, write_checkpoint
from .request import Request

PIPELINE = "dlo_fx.apps.engine.reference_pipeline:build"


def cache_dir() -> Path:
    """Where the showcase keeps its checkpoint and outputs."""
    if os.environ.get("DLO_FX_CACHE"):
        return Path(os.environ["DLO_FX_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dlo-fx"


def cached_checkpoint(root: Path, *, width: int, depth: int, heads: int, seed: int) -> Path:
    """The reference DiT checkpoint for these settings, written on first use."""
    folder = root / f"reference-dit-w{width}-d{depth}-h{heads}-s{seed}"
    if not ((folder / WEIGHTS_FILE).is_file() and (folder / CONFIG_FILE).is_file()):
        print(f"writing the reference DiT checkpoint to {folder} (once)", flush=True)
        write_checkpoint(folder, width=width, depth=depth, heads=heads, seed=seed)
    return folder


class PssSampler:
    """Peak PSS of this process and its children, sampled on a thread."""

    def __init__(self, interval_s: float = 0.05) -> None:
        self.interval_s = interval_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="pss-sampler")

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, tree_pss(os.getpid()))
            self._stop.wait(self.interval_s)

    def __enter__(self) -> "PssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _mib(nbytes: Optional[float]) -> str:
    return "n/a" if nbytes is None else f"{nbytes / 2**20:.1f} MiB"


def _meaning(streamed_slower: bool) -> str:
    """What the table shows, and why a CPU serves fewer requests per second streamed."""
    lines = ["What this shows: each rank holds half of every block (its host shard) and two "
             "block slots, and its outputs are bit-identical to the resident model's."]
    if streamed_slower:
        lines.append(f"Why fewer requests/s than one resident process: {CPU_COPIES}.")
    return "\n".join(lines)


def run_showcase(*, width: int = 512, depth: int = 8, heads: int = 8, size: int = 128,
                 steps: int = 6, root: Optional[Path] = None) -> int:
    """Run the showcase; print its table; return 0 when the outputs are bit-identical."""
    root = Path(root) if root is not None else cache_dir()
    print(f"writing to {root}: the checkpoint (once), the schedule dump, the outputs "
          "(DLO_FX_CACHE or XDG_CACHE_HOME moves it)", flush=True)
    checkpoint = cached_checkpoint(root, width=width, depth=depth, heads=heads, seed=0)
    weights_bytes = (checkpoint / WEIGHTS_FILE).stat().st_size
    dump = root / "showcase-dump"
    options = {"dump_dir": str(dump)}
    requests = [Request(prompt="a lighthouse at dusk", seed=1, height=size, width=size,
                        num_inference_steps=steps),
                Request(prompt="a field of poppies", seed=2, height=size, width=size,
                        num_inference_steps=steps)]
    print(f"2 CPU ranks, one thread each, load {checkpoint} with dlo_fx.load and serve a wave "
          f"of 2 requests ({size}x{size} px, {steps} steps)", flush=True)
    start = time.perf_counter()
    with PssSampler() as pss:
        with Engine(PIPELINE, 2, options=options, num_threads=1,
                    pipeline_kwargs={"checkpoint": str(checkpoint)}) as engine:
            engine.start()
            start_s = time.perf_counter() - start
            cold = engine.run_wave(requests)
            warm = engine.run_wave(requests) if all(r.ok for r in cold) else cold
    failed = [r.error for r in warm if not r.ok]
    if failed:
        print(f"the wave failed: {failed[0]}", file=sys.stderr)
        return 1
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        reference = resident(checkpoint=checkpoint)
        t = time.perf_counter()
        expected = [reference(r) for r in requests]
        resident_s = (time.perf_counter() - t) / len(requests)
    finally:
        torch.set_num_threads(threads)
    identical = all(torch.equal(r.output, e) for r, e in zip(warm, expected))
    outputs = root / "showcase-out"
    write_outputs(warm, outputs)
    wave_s = warm[0].seconds
    rows = [
        ("model", f"reference DiT width {width}, {depth} layers, bf16: "
                  f"{_mib(weights_bytes)} checkpoint"),
        ("start 2 ranks (fork server, load)", f"{start_s:.1f} s"),
        ("first wave (compiles)", f"{cold[0].seconds:.2f} s"),
        ("wave latency", f"{wave_s:.2f} s for 2 requests"),
        ("throughput", f"{2 / wave_s:.3f} requests/s "
                       f"(one resident process: {1 / resident_s:.3f} requests/s)"),
    ]
    for r in warm:
        rows.append((f"rank {r.dp_rank}: host shard / slots",
                     f"{_mib(r.info.get('host_shard_bytes'))} / "
                     f"{_mib(r.info.get('slot_bytes'))}"))
    rows += [
        ("peak PSS, process tree", f"{_mib(pss.peak)} (front end, fork server, 2 ranks)"),
        ("bit-identical to resident", str(identical)),
        ("schedule dump", str(dump)),
        ("outputs", f"{outputs} (safetensors latents + PNG previews)"),
    ]
    width_ = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width_}}  {v}" for k, v in rows))
    print(_meaning(streamed_slower=2 / wave_s < 1 / resident_s))
    (root / "showcase.json").write_text(json.dumps(dict(rows), indent=1))
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(run_showcase())
