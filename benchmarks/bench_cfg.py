#!/usr/bin/env python
"""CPU benchmark of two-call CFG parallel: one guided Wan request on a CFG pair against one
rank running both calls of every step.

A small Wan pipeline (the suite's tiny text encoder and VAE, a transformer of ``--layers``
layers of width ``--width``) is saved once; two engines serve it, each worker one torch
thread, the transformer streamed by dlo (two slots):

- ``cfg 2``: ``Engine(..., cfg_size=2)``: the pair defers each step's "cond" call to its
  "uncond" call, then rank 0 computes cond and rank 1 uncond, the weights gathered over
  the pair (each rank holds 1/2 of every block), the predictions exchanged;
- ``cfg 1``: ``Engine(..., 1)``: one rank computes both calls, every block on its host.

Measured interleaved (A B, B A, ...; benchmarks/_timing.py) after a warm-up request each,
median of ``--reps`` (>= 5) request latencies; the outputs are checked equal first.

    python benchmarks/bench_cfg.py            # ~2 min on 2 cores
    python benchmarks/bench_cfg.py --width 768 --size 96 --reps 7 --wait-quiet 120
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import torch  # noqa: E402

import _timing as T  # noqa: E402

from dlo_fx.apps.engine import Engine, Request  # noqa: E402
from dlo_fx.apps.engine.factories import DIFFUSERS  # noqa: E402


def save(folder: str, width: int, layers: int) -> None:
    import diffusers_pipelines as dp
    from diffusers import WanTransformer3DModel

    pipe = dp.wan()
    torch.manual_seed(0)
    pipe.transformer = dp._seeded(WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=width // 32, attention_head_dim=32,
        in_channels=16, out_channels=16, text_dim=32, freq_dim=32, ffn_dim=4 * width,
        num_layers=layers, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        rope_max_seq_len=64), 0)
    pipe.save_pretrained(folder)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--size", type=int, default=64, help="height and width of the video")
    ap.add_argument("--frames", type=int, default=9)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="bench-out/cfg.json")
    ap.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                    help="first wait up to this long for other processes to go quiet")
    args = ap.parse_args(argv)
    if args.reps < 5:
        ap.error("--reps must be at least 5 (the figures are medians)")
    request = Request(prompt="a red cat over the tree", seed=1, guidance_scale=4.0,
                      negative_prompt="blurry", height=args.size, width=args.size,
                      num_frames=args.frames, num_inference_steps=args.steps,
                      extra_args={"max_sequence_length": 16})
    with tempfile.TemporaryDirectory() as folder:
        save(folder, args.width, args.layers)
        kw = dict(wave_timeout_s=1200, pipeline_kwargs={"path": folder},
                  options={"num_slots": 2})
        with Engine(DIFFUSERS, 1, cfg_size=2, **kw) as pair, Engine(DIFFUSERS, 1, **kw) as one:
            a, b = pair.generate([request])[0], one.generate([request])[0]
            assert a.ok and b.ok, (a.error, b.error)
            equal = torch.equal(a.output["frames"], b.output["frames"])
            if args.wait_quiet:
                T.wait_quiet(args.wait_quiet, log=print)
            with T.CpuLoad() as load:
                samples = T.interleaved({"cfg 2": lambda: pair.generate([request]),
                                         "cfg 1": lambda: one.generate([request])},
                                        reps=args.reps, warmup=0)
    result = {"args": vars(args), "equal": equal, "samples": samples.summary(),
              "speedup": samples.paired_ratio("cfg 1", "cfg 2"), "load": load.as_dict(),
              "machine": T.machine_info()}
    T.write_json(args.out, result)
    print(f"outputs equal: {equal}")
    for name in ("cfg 1", "cfg 2"):
        print(f"{name}: median {samples.median(name):.3f} s per request "
              f"({samples.reps} repetitions)")
    print(f"cfg 1 / cfg 2 (paired median): {result['speedup']:.2f}x; "
          f"other processes' load: {load.as_dict()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
