"""``dlo-fx dump``: compile a model with dlo, run it on example inputs, write its dumps.

Without ``--model`` it uses the built-in reference DiT (``--layers``, ``--width``,
``--heads``, ``--size``). With ``--model MODULE:FACTORY``, ``FACTORY`` is a callable of
no arguments in the importable module ``MODULE`` (the current folder, or ``--app-dir``,
is put on ``sys.path``). It returns either

- ``(model, inputs)``: ``inputs`` a tuple/list of positional arguments, or a dict of
  keyword arguments, for ``model(...)``; or
- ``model`` alone, and ``--inputs MODULE:FN`` names ``FN(model) -> inputs`` (same forms).

The model runs ``--calls`` times under ``torch.inference_mode()``, traced unless
``--no-trace``; then every graph's folder (``OUT/graph_<n>/``: schedule.py, blocks.md,
timeline.svg, trace.json) is written and the stall summary printed.

`add_dump_arguments` adds the options to any parser; `run_dump` runs a parsed namespace
and returns the exit status (0 done, 2 bad input). ``python -m dlo_fx.apps.dump.cli ...``
runs it on its own.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from .timeline import Assumptions

def add_dump_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``dump`` options to ``parser`` and return it."""
    model = parser.add_argument_group("model (default: the built-in reference DiT)")
    model.add_argument("--model", metavar="MODULE:FACTORY", default=None,
                       help="factory returning (model, inputs), or a model with --inputs")
    model.add_argument("--inputs", metavar="MODULE:FN", default=None,
                       help="FN(model) returning the example inputs (tuple or dict)")
    model.add_argument("--app-dir", default=".",
                       help="folder put first on sys.path to import MODULE (default: .)")
    model.add_argument("--layers", type=int, default=4, help="reference DiT layers (default: 4)")
    model.add_argument("--width", type=int, default=256, help="reference DiT width (default: 256)")
    model.add_argument("--heads", type=int, default=4, help="reference DiT heads (default: 4)")
    model.add_argument("--size", type=int, default=16,
                       help="reference DiT latent height and width (default: 16)")
    dlo = parser.add_argument_group(
        "dlo options (a model the factory made dlo's keeps its own: a flag given here must "
        "equal its value)")
    dlo.add_argument("--out", default="dlo-dump", help="dump folder (default: dlo-dump)")
    dlo.add_argument("--slots", type=int, default=None, help="num_slots (default: 2)")
    dlo.add_argument("--block-bytes", type=int, default=None,
                     help="block budget in bytes (default: the largest natural layer)")
    dlo.add_argument("--resident-bytes", type=int, default=None,
                     help="keep parameters smaller than this resident (default: 0)")
    dlo.add_argument("--mode", choices=("auto", "allgather", "rank_local"), default=None,
                     help="(default: auto)")
    dlo.add_argument("--hardware", default=None, metavar="NAME",
                     help="also print dlo_fx.plan's prediction of a step on this hardware "
                          "preset (h200, b200, ...; see dlo-fx plan --help)")
    dlo.add_argument("--calls", type=int, default=2, help="calls to run and trace (default: 2)")
    dlo.add_argument("--trace", action=argparse.BooleanOptionalAction, default=True,
                     help="record spans for trace.json and the stall summary (default: on)")
    dlo.add_argument("--fullgraph", action="store_true",
                     help="fail on a graph break instead of compiling several graphs")
    guess = parser.add_argument_group(
        "timeline.svg where nothing was measured (with --no-trace: everywhere; use them to "
        "picture another machine)")
    for flag, field, text in (("--h2d-gbps", "h2d_gbps", "host-to-device GB/s"),
                              ("--gather-gbps", "gather_gbps", "AllGather GB/s per rank"),
                              ("--compute-gbps", "compute_gbps",
                               "block bytes computed per second, GB/s")):
        guess.add_argument(flag, dest=field, type=float, default=getattr(Assumptions, field),
                           help=f"{text} (default: {getattr(Assumptions, field)})")
    return parser


def _resolve(spec: str, what: str, app_dir: str) -> Callable:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{what} {spec!r} is not of the form 'package.module:callable'")
    path = str(Path(app_dir).resolve())
    if path not in sys.path:
        sys.path.insert(0, path)
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{what} {spec!r}: cannot import {module_name!r} ({exc}); run from "
                         "the folder that holds it or pass --app-dir") from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{what} {spec!r}: module {module_name!r} has no {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{what} {spec!r} is not callable")
    return obj


def _check_inputs(inputs: Any, source: str) -> Any:
    if isinstance(inputs, (tuple, list, dict)):
        return inputs
    raise ValueError(f"{source} returned inputs of type {type(inputs).__name__}; expected a "
                     "tuple/list of positional arguments or a dict of keyword arguments")


def build_model(args: argparse.Namespace) -> tuple[torch.nn.Module, Any, str]:
    """(model, inputs, description) from the parsed options."""
    if args.model is None:
        from ..models import example_inputs, reference_dit

        if args.inputs is not None:
            raise ValueError("--inputs needs --model (the reference DiT makes its own inputs)")
        model = reference_dit(width=args.width, depth=args.layers, heads=args.heads, seed=0)
        inputs = example_inputs(model.config, batch=1, height=args.size, width=args.size)
        return model, inputs, f"reference DiT ({args.layers} layers, width {args.width})"
    made = _resolve(args.model, "--model", args.app_dir)()
    if isinstance(made, torch.nn.Module):
        if args.inputs is None:
            raise ValueError(f"--model {args.model!r} returned a model without inputs; return "
                             "(model, inputs) from it, or name an inputs function with --inputs")
        inputs = _check_inputs(_resolve(args.inputs, "--inputs", args.app_dir)(made), args.inputs)
        return made, inputs, args.model
    if (isinstance(made, (tuple, list)) and len(made) == 2
            and isinstance(made[0], torch.nn.Module)):
        if args.inputs is not None:
            raise ValueError(f"--model {args.model!r} returned inputs already; drop --inputs")
        return made[0], _check_inputs(made[1], args.model), args.model
    raise ValueError(f"--model {args.model!r} returned {type(made).__name__}; expected "
                     "(model, inputs) or an nn.Module")


def run_dump(args: argparse.Namespace) -> int:
    """Compile, run and dump as ``args`` says; print what was written."""
    from . import dumps, flush, stall_summary
    from ...loading.offload import offload
    from ...runtime import owner_of

    try:
        assume = Assumptions(h2d_gbps=args.h2d_gbps, gather_gbps=args.gather_gbps,
                             compute_gbps=args.compute_gbps)
        model, inputs, what = build_model(args)
        if args.calls < 1:
            raise ValueError(f"--calls {args.calls} must be at least 1")
        given = {option: value for option, value in runtime_flags(args).items()
                 if value is not None}
        model.eval().requires_grad_(False)
        before = len(dumps())
        runtime = owner_of(model.parameters())
        if runtime is None:
            options = {**RUNTIME_DEFAULTS, **given}
            predicted = prediction(model, inputs, args.hardware, options)
            offload(model, {**options, "device": str(next(model.parameters()).device)})
        else:  # made dlo's by the factory (dlo_fx.load, dlo_fx.offload): its options stand
            check_inherited(given, runtime.config)
            predicted = prediction(None, inputs, args.hardware, None)
        compiled = torch.compile(model, backend="dlo", fullgraph=args.fullgraph,
                                 options={"dump_dir": args.out, "trace": args.trace})
        with torch.inference_mode():
            for _ in range(args.calls):
                compiled(**inputs) if isinstance(inputs, dict) else compiled(*inputs)
    except Exception as exc:  # a bad option reaches us wrapped by Dynamo
        inner = getattr(exc, "inner_exception", exc)
        if not isinstance(inner, ValueError):
            raise
        print(f"dlo-fx dump: {inner}", file=sys.stderr)
        return 2
    flush(model, assume=assume)
    written = dumps()[before:]
    print(f"{what}: {len(written)} graph(s) scheduled, {args.calls} call(s) run")
    for dump in written:
        files = sorted(p.name for p in dump.folder.iterdir() if p.is_file())
        print(f"  {dump.folder}: {len(dump.blocks)} blocks, {len(dump.resident)} resident "
              f"parameters; {', '.join(files)}")
    if args.trace:
        print()
        print(stall_summary(model))
    if predicted:
        print()
        print(predicted)
    return 0


RUNTIME_DEFAULTS = {"num_slots": 2, "resident_bytes": 0, "mode": "auto"}
"""The runtime options ``dlo-fx dump`` offloads a model with where no flag sets them."""


def runtime_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The runtime options of the command line, None where the flag was not given."""
    return {"num_slots": args.slots, "block_bytes": args.block_bytes,
            "resident_bytes": args.resident_bytes, "mode": args.mode}


_FLAGS = {"num_slots": "--slots", "block_bytes": "--block-bytes",
          "resident_bytes": "--resident-bytes", "mode": "--mode"}


def check_inherited(given: dict[str, Any], config: Any) -> None:
    """A model the factory made dlo's is dumped with the options its runtime was made with:
    a flag given on the command line that says otherwise is refused, never ignored."""
    differ = [f"{_FLAGS[k]} {v} (its runtime has {getattr(config, k)!r})"
              for k, v in given.items() if v != getattr(config, k)]
    if differ:
        raise ValueError(
            "the model --model returned is dlo's already (dlo_fx.load or dlo_fx.offload made "
            "it), and its runtime options stand: " + "; ".join(differ) + ". Drop those "
            "flags, or return the model before it is offloaded and let dlo-fx dump offload it")


def prediction(model: Any, inputs: Any, hardware: Optional[str],
               options: Optional[dict]) -> Optional[str]:
    """`dlo_fx.plan`'s table of ``model`` at ``inputs``' shapes on ``hardware`` (None: no
    --hardware), planned before the model is offloaded (from its config, on the meta
    device); a model the factory made dlo's already is said to be unplanned."""
    if hardware is None:
        return None
    if model is None:
        return (f"predicted on {hardware}: not planned (the model was dlo's before dlo-fx dump "
                "saw it; plan it with dlo_fx.plan or dlo-fx plan --model before it is loaded)")
    from ..plan import plan

    return f"predicted on {hardware} (dlo_fx.plan, not measured):\n" + str(
        plan(model, inputs, hardware=hardware, options=options))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="dlo-fx dump", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    args = add_dump_arguments(parser).parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    return run_dump(args)


if __name__ == "__main__":
    sys.exit(main())
