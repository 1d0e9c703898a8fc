"""The ``dlo-fx`` command line.

Every error is one line on stderr, ``dlo-fx COMMAND: message``, and exit status 2; ``-v``
(before or after the command) logs at INFO level and shows an error's traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional, Sequence


VERBOSE_HELP = "log at INFO level; show an error's traceback"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dlo-fx", description=__doc__.split("\n\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="the showcase: 2 CPU ranks load the reference DiT "
                          "checkpoint with dlo_fx.load and serve a wave of 2 requests")
    demo.add_argument("--single-process", action="store_true",
                      help="instead: one process, resident vs dlo, latency ratio")
    demo.add_argument("--width", type=int, default=1024)
    demo.add_argument("--layers", type=int, default=12)
    demo.add_argument("--heads", type=int, default=16)
    demo.add_argument("--size", type=int, default=16, help="latent height and width")
    demo.add_argument("--runs", type=int, default=3, help="timed runs (median)")

    from .dump.cli import add_dump_arguments
    from .engine.cli import add_generate_arguments

    generate = sub.add_parser("generate", help="run a JSONL file of requests through the "
                              "DP wave engine")
    add_generate_arguments(generate)

    dump = sub.add_parser("dump", help="compile a model with dlo and write its schedule dumps")
    add_dump_arguments(dump)

    from .shard import add_shard_arguments

    shard = sub.add_parser("shard", help="write per-rank shard files of a checkpoint, so "
                           "each rank reads only its own 1/N (dlo_fx.load accepts the folder)")
    add_shard_arguments(shard)

    from .study.cli import add_plan_arguments

    plan = sub.add_parser("plan", help="plan a model from its config for a hardware target "
                          "(--model), or predict both modes from numbers")
    add_plan_arguments(plan)
    for command in sub.choices.values():  # -v after the command too
        command.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP,
                             default=argparse.SUPPRESS)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return run_command(args)
    except Exception as exc:
        if args.verbose:
            raise
        print(f"dlo-fx {args.command}: {one_line(exc)} (-v shows the traceback)",
              file=sys.stderr)
        return 2


def one_line(exc: BaseException) -> str:
    """``exc``'s message on one line (the backend's own error where Dynamo wrapped it)."""
    inner = getattr(exc, "inner_exception", None) or exc
    lines = [line.strip() for line in str(inner).splitlines() if line.strip()]
    message = "; ".join(lines) or type(inner).__name__
    return message if isinstance(inner, (ValueError, OSError)) else \
        f"{type(inner).__name__}: {message}"


def run_command(args: argparse.Namespace) -> int:
    """Run the parsed command; returns its exit status."""
    if args.command == "demo" and not args.single_process:
        from .engine.showcase import run_showcase

        return run_showcase()
    if args.command == "demo":
        from .demo import run_demo

        return run_demo(width=args.width, depth=args.layers, heads=args.heads,
                        size=args.size, runs=args.runs)
    if args.command == "generate":
        from .engine.cli import run_generate

        return run_generate(args)
    if args.command == "dump":
        from .dump.cli import run_dump

        return run_dump(args)
    if args.command == "shard":
        from .shard import run_shard

        return run_shard(args)
    if args.command == "plan":
        from .study.cli import run_plan

        return run_plan(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
