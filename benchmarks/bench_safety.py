"""What the weight fingerprint and the sampled file checks cost against the work they guard.

In allgather mode `dlo_fx.load` takes a sampled fingerprint of every block from the
checkpoint's own bytes (`runtime/host/fingerprint.py`, read with ``os.pread`` whatever the
store), so ranks that loaded different weights of the same shapes raise instead of
gathering a mix; with ``host_store="mmap"`` every block read also compares 16 sampled
windows with the bytes seen at load (`runtime/host/file_store.py`), so a rewrite that keeps the
file's size and mtime raises. This script saves a reference DiT as one safetensors file,
then per repetition (interleaved, page cache warm):

- ``load``: `dlo_fx.load` of the checkpoint at dp=1 (rank-local: no fingerprint taken);
- ``fingerprint``: the fingerprints of all of its blocks, read from the file as the loader
  reads them;
- ``serve``, ``serve_unchecked``: every block of a ``host_store="mmap"`` model read from
  the file once, with the sampled checks and with them stripped;

and reports the medians and the median per-repetition ratios fingerprint / load and
serve / serve_unchecked.

    python benchmarks/bench_safety.py            # about a minute on 2 cores
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import tempfile

import torch
from _timing import interleaved, machine_info, write_json
from safetensors.torch import save_file

import dlo_fx
from dlo_fx.loading.discover import resolve_checkpoint
from dlo_fx.apps.models import ReferenceDiT, reference_dit
from dlo_fx.runtime import file_fingerprint, reset_runtimes, runtimes_holding


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--out", default="bench-out/bench_safety.json")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        model = reference_dit(width=args.width, depth=args.depth, heads=args.width // 64,
                              dtype=torch.float32)
        config = model.config
        path = os.path.join(tmp, "dit.safetensors")
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path)
        del model
        ckpt = resolve_checkpoint(path)

        def load() -> None:
            loaded = dlo_fx.load(ReferenceDiT, path, config=config,
                                 options={"resident_bytes": 0, "mode": "rank_local"})
            runtimes_holding(list(loaded.parameters()))[0].close()  # this one only
            del loaded
            gc.collect()

        # The blocks the loader makes, and their entries, from one load.
        loaded = dlo_fx.load(ReferenceDiT, path, config=config,
                             options={"resident_bytes": 0, "mode": "rank_local"})
        store = runtimes_holding(list(loaded.parameters()))[0].store
        blocks = [[(e, ckpt.tensors[e.fqn]) for e in block.entries] for block in store.blocks]
        del loaded, store
        reset_runtimes()
        gc.collect()

        sources = [[(info.path, info.offset, info.nbytes) if e.nbytes else None
                    for e, info in block] for block in blocks]

        def fingerprint() -> None:
            for block, srcs in zip(blocks, sources):
                file_fingerprint([e for e, _ in block], srcs)

        served = {}
        for name in ("checked", "unchecked"):
            served[name] = dlo_fx.load(ReferenceDiT, path, config=config,
                                       options={"resident_bytes": 0, "mode": "rank_local",
                                                "host_store": "mmap"})
        unchecked = runtimes_holding(list(served["unchecked"].parameters()))[0].store
        for shard in unchecked.files.shards:
            shard.runs = [dataclasses.replace(r, check_at=None, check_bytes=None)
                          for r in shard.runs]
        largest = max(b.slot_bytes for b in unchecked.blocks)
        buffer = torch.empty(largest, dtype=torch.uint8)

        def serve(model) -> None:
            for block in runtimes_holding(list(model.parameters()))[0].store.blocks:
                block.copy_to(buffer[: block.shard_nbytes])

        samples = interleaved({"load": load, "fingerprint": fingerprint,
                               "serve": lambda: serve(served["checked"]),
                               "serve_unchecked": lambda: serve(served["unchecked"])},
                              reps=args.reps, warmup=2)
        ratio = samples.paired_ratio("fingerprint", "load")
        checks = samples.paired_ratio("serve", "serve_unchecked")
        result = {
            "machine": machine_info(),
            "checkpoint_bytes": ckpt.nbytes,
            "blocks": len(blocks),
            "tensors": sum(len(b) for b in blocks),
            "reps": samples.reps,
            "load_s": samples.median("load"),
            "fingerprint_s": samples.median("fingerprint"),
            "fingerprint_over_load": ratio,
            "serve_s": samples.median("serve"),
            "serve_unchecked_s": samples.median("serve_unchecked"),
            "serve_over_unchecked": checks,
        }
        del served, unchecked
        reset_runtimes()
    write_json(args.out, result)
    print(f"checkpoint {result['checkpoint_bytes'] / 2**20:.0f} MiB, {result['blocks']} blocks, "
          f"{result['tensors']} tensors; median of {samples.reps} after 2 warm-up:")
    print(f"  load        {result['load_s'] * 1e3:9.1f} ms")
    print(f"  fingerprint {result['fingerprint_s'] * 1e3:9.2f} ms  "
          f"({ratio:.2%} of the load, median per-repetition ratio)")
    print(f"  serve (mmap, every block once) {result['serve_s'] * 1e3:9.2f} ms, without the "
          f"sampled checks {result['serve_unchecked_s'] * 1e3:9.2f} ms  (ratio {checks:.4f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
