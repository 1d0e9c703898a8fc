"""``dlo-fx generate``: run a JSONL file of requests through the wave engine.

    dlo-fx generate --dp 2 --requests requests.jsonl --out results/
    python -m dlo_fx.apps.engine.cli --dp 2 --requests requests.jsonl --out results/

Each line of the requests file is a JSON object with the fields of `Request` (``prompt``
at least). For request ``i`` the output folder gets ``{i:04d}.safetensors`` (the output
tensors), ``{i:04d}.png`` (a preview of image latents) and one line of
``results.jsonl``. With ``--diffusers ROOT`` (a saved diffusers pipeline, served by
`dlo_fx.apps.engine.diffusers_pipeline`) the PNGs are the images themselves:
``{i:04d}-{n}.png`` per image, ``{i:04d}-{n}-{frame:03d}.png`` per video frame. The exit
status is 0 when every request succeeded, 1 otherwise. Under ``torchrun`` (``RANK`` and
``WORLD_SIZE`` set) every rank runs the same command with the same control-plane secret
(``DLO_FX_ENGINE_SECRET``, hex, or ``DLO_FX_ENGINE_SECRET_FILE``, a 0600 file); rank 0
hosts the front end and writes the outputs.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from .factories import DIFFUSERS, REFERENCE
from .topology import GATHER_CHOICES


def _key_value(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value  # a bare string, e.g. a path


def add_generate_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the options of ``dlo-fx generate`` to ``parser``."""
    parser.add_argument("--requests", required=True, type=Path,
                        help="JSONL file, one request object per line")
    parser.add_argument("--out", required=True, type=Path, help="output folder")
    parser.add_argument("--dp", type=int, default=1, help="replicas = requests per wave")
    parser.add_argument("--sp", type=int, default=1,
                        help="ranks per replica; with --diffusers they split each request's "
                             "sequence (diffusers' context parallelism, Ulysses)")
    parser.add_argument("--cfg", type=int, default=1, choices=(1, 2),
                        help="2: two ranks per replica compute the guidance branches, one "
                             "each (dlo_fx.cfg_parallel: a batched call split, two calls per "
                             "step paired); world = dp x cfg x sp")
    parser.add_argument("--gather", default="auto", choices=GATHER_CHOICES,
                        help="ranks each rank's weights are gathered over: its SP group (sp), "
                             "its CFG pair (cfg), both (replica), one rank per replica (dp), "
                             "every rank (world), none (rank-local), or auto: chosen from "
                             "--dp, --cfg, --sp and the host's RAM (with --plan and --cfg 1: "
                             "by the planner's route model)")
    parser.add_argument("--plan", default=None, metavar="PRESETS",
                        help="dlo-fx plan presets of the node and workload (e.g. "
                             "b300-8gpu,minimax-h3): --gather auto takes the gather group "
                             "the planner chooses on their figures")
    parser.add_argument("--pipeline", default=REFERENCE,
                        help="factory 'package.module:function' (default: the reference "
                             "DiT pipeline)")
    parser.add_argument("--diffusers", default=None, metavar="ROOT", type=Path,
                        help="serve the diffusers pipeline saved in ROOT (model_index.json and "
                             "its subfolders): its transformer(s) load with dlo_fx.load; one "
                             "PNG per image or frame")
    parser.add_argument("--app-dir", default=".",
                        help="folder put first on sys.path to import the --pipeline module "
                             "(default: .)")
    parser.add_argument("--checkpoint", default=None,
                        help="checkpoint handed to the factory as checkpoint=...")
    parser.add_argument("--pipeline-arg", action="append", type=_key_value, default=[],
                        metavar="KEY=VALUE", help="factory keyword argument (JSON value)")
    parser.add_argument("--option", action="append", type=_key_value, default=[],
                        metavar="KEY=VALUE", help="dlo option (JSON value), e.g. num_slots=3")
    parser.add_argument("--wave-timeout", type=float, default=600.0,
                        help="seconds before a wave fails closed (default 600)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per worker (default: cores / ranks)")
    parser.add_argument("--no-preview", action="store_true", help="write no PNG previews")
    parser.add_argument("--quiet", action="store_true",
                        help="no progress (bars per wave and step, a line per phase of the "
                             "first wave); they show only on a terminal anyway")
    return parser


def read_requests(path: Path) -> list:
    """The requests of a JSONL file; ``ValueError`` naming the line of a bad one."""
    from .request import Request

    requests = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                requests.append(Request.from_dict(json.loads(line)))
            except (ValueError, TypeError) as exc:
                raise ValueError(f"{path}:{number}: {exc}") from None
    if not requests:
        raise ValueError(f"{path} holds no requests")
    return requests


def write_outputs(results: Sequence[Any], out: Path, *, preview: bool = True) -> None:
    """One safetensors file (and PNG preview) per successful request, and results.jsonl."""
    import torch
    from safetensors.torch import save_file

    from .png import latents_preview, write_png

    out.mkdir(parents=True, exist_ok=True)
    with open(out / "results.jsonl", "w", encoding="utf-8") as log_file:
        for index, result in enumerate(results):
            row = {"index": index, "prompt": result.request.prompt, "seed": result.request.seed,
                   "wave": result.wave, "dp_rank": result.dp_rank,
                   "pid": result.info.get("pid"),
                   "seconds": round(result.seconds, 4), "error": result.error}
            if result.ok:
                output = result.output
                tensors = {"output": output} if isinstance(output, torch.Tensor) else output
                name = f"{index:04d}.safetensors"
                save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / name),
                          metadata={"request": json.dumps(result.request.to_dict())})
                row["file"] = name
                pictures = _pictures(out, index, tensors)
                first = next(iter(tensors.values()))
                if pictures:
                    row["images"] = pictures
                elif preview and first.dim() == 4 and first.is_floating_point():
                    write_png(out / f"{index:04d}.png", latents_preview(first[0]))
                    row["preview"] = f"{index:04d}.png"
            log_file.write(json.dumps(row) + "\n")


def _pictures(out: Path, index: int, tensors: dict) -> list:
    """One PNG per image (``images`` [N, H, W, 3]) or frame (``frames`` [N, F, H, W, 3]) of
    a diffusers pipeline's uint8 output; their file names."""
    import torch

    from .png import write_png

    names = []
    images, frames = tensors.get("images"), tensors.get("frames")
    if isinstance(images, torch.Tensor) and images.dtype == torch.uint8 and images.dim() == 4:
        for n, image in enumerate(images):
            names.append(f"{index:04d}-{n}.png")
            write_png(out / names[-1], image)
    elif isinstance(frames, torch.Tensor) and frames.dtype == torch.uint8 and frames.dim() == 5:
        for n, video in enumerate(frames):
            for f, frame in enumerate(video):
                names.append(f"{index:04d}-{n}-{f:03d}.png")
                write_png(out / names[-1], frame)
    return names


def run_generate(args: argparse.Namespace) -> int:
    """Run ``dlo-fx generate``; returns the exit status."""
    from .engine import Engine
    from .progress import WaveProgress, terminal
    from .serve import serve

    try:
        requests = read_requests(args.requests)
    except (OSError, ValueError) as exc:
        print(f"dlo-fx generate: {exc}", file=sys.stderr)
        return 2
    app_dir = os.path.abspath(getattr(args, "app_dir", "."))
    if app_dir not in sys.path:  # the workers get the front end's sys.path
        sys.path.insert(0, app_dir)
    kwargs = dict(args.pipeline_arg)
    if args.checkpoint is not None:
        kwargs["checkpoint"] = args.checkpoint
    if getattr(args, "diffusers", None) is not None:
        if args.pipeline != REFERENCE:
            print("dlo-fx generate: pass either --diffusers or --pipeline, not both",
                  file=sys.stderr)
            return 2
        args.pipeline = DIFFUSERS
        kwargs["path"] = os.path.abspath(args.diffusers)
        from .diffusers_pipeline import check_up_front

        # Sizes no memory holds: refused before any worker starts (as Engine(...) refuses
        # a transformer --sp cannot split)
        try:
            check_up_front(requests, dict(args.option))
        except ValueError as exc:
            print(f"dlo-fx generate: {exc}", file=sys.stderr)
            return 2
    common = dict(options=dict(args.option), wave_timeout_s=args.wave_timeout,
                  pipeline_kwargs=kwargs, gather=getattr(args, "gather", "auto"),
                  cfg_size=getattr(args, "cfg", 1), plan=getattr(args, "plan", None))
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ:
        engine = serve(args.pipeline, sp_size=args.sp, num_threads=args.threads, **common)
        if engine is None:
            return 0  # a worker rank: rank 0 writes the outputs
    else:
        ranks = args.dp * args.sp * getattr(args, "cfg", 1)
        threads = args.threads or max(1, (os.cpu_count() or 1) // ranks)
        engine = Engine(args.pipeline, args.dp, sp_size=args.sp, num_threads=threads,
                        progress=not args.quiet and terminal(sys.stderr), **common)
    progress = WaveProgress(len(requests), enabled=engine.spec.progress)
    with engine:
        start = time.perf_counter()
        engine.start()
        progress.phase("load", time.perf_counter() - start,
                       f"{engine.topology.world_size} worker(s) built the pipeline")
        progress.start()
        try:
            results = engine.generate(requests, on_wave=progress.wave_done)
        finally:
            progress.close()
    write_outputs(results, args.out, preview=not args.no_preview)
    failed = [i for i, r in enumerate(results) if not r.ok]
    waves = len({r.wave for r in results})
    print(f"{len(results) - len(failed)}/{len(results)} requests succeeded in {waves} "
          f"wave(s) on dp={engine.dp_size}; outputs in {args.out}")
    for i in failed:
        print(f"request {i}: {results[i].error}", file=sys.stderr)
    return 1 if failed else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = add_generate_arguments(argparse.ArgumentParser(
        prog="dlo-fx generate", description="Run a JSONL file of requests through the "
        "dlo wave engine."))
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    return run_generate(args)


if __name__ == "__main__":
    sys.exit(main())
