"""What the weight fingerprint costs against the load it guards.

In allgather mode `dlo_fx.load` takes a sampled fingerprint of every block from the
checkpoint's own bytes (`runtime/fingerprint.py`), so ranks that loaded different weights
of the same shapes raise instead of gathering a mix. This script saves a reference DiT as
one safetensors file, then per repetition (interleaved, page cache warm):

- ``load``: `dlo_fx.load` of the checkpoint at dp=1 (rank-local: no fingerprint taken);
- ``fingerprint``: the fingerprints of all of its blocks, sampled from the same mmap views
  the loader reads (views opened outside the timed region).

and reports the medians and the median per-repetition ratio fingerprint / load.

    python benchmarks/bench_safety.py            # about a minute on 2 cores
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile

import torch
from _timing import interleaved, machine_info, write_json
from safetensors.torch import save_file

import dlo_fx
from dlo_fx.checkpoint import open_views, resolve_checkpoint
from dlo_fx.models import ReferenceDiT, reference_dit
from dlo_fx.runtime.fingerprint import block_fingerprint
from dlo_fx.runtime.runtime import reset_runtimes, runtimes_holding


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
            del loaded
            reset_runtimes()
            gc.collect()

        # The blocks the loader makes, and their entries, from one load.
        loaded = dlo_fx.load(ReferenceDiT, path, config=config,
                             options={"resident_bytes": 0, "mode": "rank_local"})
        store = runtimes_holding(list(loaded.parameters()))[0].store
        blocks = [[(e, ckpt.tensors[e.fqn]) for e in block.entries] for block in store.blocks]
        del loaded, store
        reset_runtimes()
        gc.collect()

        with open_views([info for block in blocks for _, info in block]) as views:
            sources = [[views[info.key].reshape(-1).view(torch.uint8) if e.nbytes else None
                        for e, info in block] for block in blocks]

            def fingerprint() -> None:
                for block, srcs in zip(blocks, sources):
                    block_fingerprint([e for e, _ in block], srcs)

            samples = interleaved({"load": load, "fingerprint": fingerprint},
                                  reps=args.reps, warmup=2)
        ratio = samples.paired_ratio("fingerprint", "load")
        result = {
            "machine": machine_info(),
            "checkpoint_bytes": ckpt.nbytes,
            "blocks": len(blocks),
            "tensors": sum(len(b) for b in blocks),
            "reps": samples.reps,
            "load_s": samples.median("load"),
            "fingerprint_s": samples.median("fingerprint"),
            "fingerprint_over_load": ratio,
        }
    write_json(args.out, result)
    print(f"checkpoint {result['checkpoint_bytes'] / 2**20:.0f} MiB, {result['blocks']} blocks, "
          f"{result['tensors']} tensors; median of {samples.reps} after 2 warm-up:")
    print(f"  load        {result['load_s'] * 1e3:9.1f} ms")
    print(f"  fingerprint {result['fingerprint_s'] * 1e3:9.2f} ms  "
          f"({ratio:.2%} of the load, median per-repetition ratio)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
