"""The ``plan`` command: predict both streaming modes and recommend one.

`add_plan_arguments` adds the options to any `argparse.ArgumentParser` (the ``dlo-fx
plan`` subcommand uses it); `run_plan` runs a parsed namespace and returns the exit
status: 0 on success, 1 when neither mode fits, 2 on bad input.
``python -m dlo_fx.apps.study.cli ...`` runs it on its own.

Inputs merge in three layers: `PlanInputs` defaults, then ``--preset`` sets (left to
right), then options given on the command line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from typing import Optional, Sequence, TextIO

from . import model
from .calibration import EXTRAPOLATION_PAIRS
from ..figures import PUBLISHED_EXTRAPOLATION
from .inputs import GATHER_OVER, PlanInputs
from .prediction import ModePrediction, Prediction, predict
from .presets import PRESETS, preset_fields

TABLE_BLOCKS = 128
"""Block count of table rows when neither --blocks nor a preset gives one."""

# (flag, PlanInputs field, type, help) for every input option.
_OPTIONS: tuple[tuple[str, str, type, str], ...] = (
    ("--model-gb", "model_gb", float, "GB of the streamed DiT blocks (one host copy)"),
    ("--blocks", "blocks", int, "number of streamed blocks"),
    ("--dp", "dp", int, "data-parallel degree (replicas, one request each)"),
    ("--sp", "sp", int, "sequence-parallel degree (default: world/dp when a preset sets world, else 1)"),
    ("--world", "world", int, "ranks on the host (default: dp*sp)"),
    ("--max-block-gb", "max_block_gb", float, "GB of the largest block (default: model/blocks)"),
    ("--resident-gb", "resident_gb", float, "GB of weights resident on the device outside blocks"),
    ("--activation-gb", "activation_gb", float, "GB of activations/workspace per device (default: 5/16 of --hbm-gb, 20 on a 64 GB device)"),
    ("--num-slots", "num_slots", int, "device slots a block streams into"),
    ("--gather-buffers", "gather_buffers", int, "gather input buffers per rank (0: in place)"),
    ("--overhead-gb", "overhead_gb", float, "host framework overhead per rank, GB"),
    ("--page-cache-fraction", "page_cache_fraction", float, "checkpoint share in page cache at load"),
    ("--staging-fraction", "staging_fraction", float, "private staging at load per host copy"),
    ("--pinned-cgroup-fraction", "pinned_cgroup_fraction", float, "pinned share the cgroup sees (0 Ascend, 1 CUDA)"),
    ("--h2d-gbps", "h2d_gbps", float, "host-to-device link bandwidth per device, GB/s"),
    ("--host-h2d-gbps", "host_h2d_gbps", float, "aggregate host-to-device bandwidth, GB/s (default: world*h2d)"),
    ("--gather-gbps", "gather_gbps", float, "AllGather bus bandwidth per rank, GB/s"),
    ("--block-compute-ms", "block_compute_ms", float, "compute of one block, one request, one device, ms"),
    ("--sp-serial-fraction", "sp_serial_fraction", float, "block compute share SP does not split"),
    ("--overlap-efficiency", "overlap_efficiency", float, "share of a hidden transfer that stays hidden"),
    ("--lockstep-fraction", "lockstep_fraction", float, "AllGather lockstep cost as a share of compute"),
    ("--copy-overhead-ms", "copy_overhead_ms", float, "fixed per-block rank-local issue cost, ms"),
    ("--collective-overhead-ms", "collective_overhead_ms", float, "fixed per-block AllGather issue cost, ms"),
    ("--steps", "steps", int, "denoising steps per request"),
    ("--tokens", "tokens", int, "tokens of one request's sequence (the SP all-to-all; 0: none)"),
    ("--heads", "heads", int, "attention heads (the SP all-to-all)"),
    ("--head-dim", "head_dim", int, "channels per attention head (the SP all-to-all)"),
    ("--attention-layers", "attention_layers", int, "attention layers per block"),
    ("--host-ram-gb", "host_ram_gb", float, "physical host RAM, GB"),
    ("--hbm-gb", "hbm_gb", float, "device memory per rank, GB"),
)


def _defaults() -> dict[str, object]:
    return {
        f.name: f.default
        for f in dataclasses.fields(PlanInputs)
        if f.default is not dataclasses.MISSING
    }


def add_plan_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``plan`` options to ``parser`` and return it."""
    defaults = _defaults()
    group = parser.add_argument_group("model and node")
    for flag, field, kind, text in _OPTIONS:
        shown = defaults.get(field)
        suffix = f" (default: {shown})" if shown is not None and "default:" not in text else ""
        group.add_argument(flag, dest=field, type=kind, default=None, metavar=kind.__name__.upper(),
                           help=text + suffix)
    group.add_argument("--gather-over", dest="gather_over", choices=GATHER_OVER, default=None,
                       help="ranks sharing a host copy: the DP group (SP group when dp=1) or the "
                            "whole world (default: dp)")
    group.add_argument("--preset", dest="preset", action="append", default=None, metavar="NAME",
                       help="apply a named constant set; repeat or comma-separate to combine, "
                            f"later wins (choices: {', '.join(PRESETS)})")
    out = parser.add_argument_group("output")
    out.add_argument("--json", dest="json", action="store_true", help="print JSON instead of text")
    out.add_argument("--table", dest="table", action="store_true",
                     help="print the host-memory extrapolation table instead (pure DP, sp=1)")
    out.add_argument("--table-sizes", dest="table_sizes", default=None, metavar="GB,GB,...",
                     help="model sizes of the table rows (default: the write-up's 33,124,185,400)")
    out.add_argument("--table-dp", dest="table_dp", default=None, metavar="N,N,...",
                     help="dp values of the table rows (default: 4,8)")
    out.add_argument("--formulas", dest="formulas", action="store_true", help="print the model's formulas")
    out.add_argument("--list-presets", dest="list_presets", action="store_true",
                     help="list the presets and their constants")
    from ..plan.cli import add_model_arguments

    add_model_arguments(parser)
    return parser


def _preset_names(args: argparse.Namespace) -> list[str]:
    names: list[str] = []
    for item in getattr(args, "preset", None) or []:
        names.extend(n.strip() for n in item.split(",") if n.strip())
    return names


def _collect(args: argparse.Namespace, *, need_model: bool = True) -> tuple[dict, list[str]]:
    names = _preset_names(args)
    fields: dict = dict(preset_fields(names))
    for _, field, _, _ in _OPTIONS + (("", "gather_over", str, ""),):
        value = getattr(args, field, None)
        if value is not None:
            fields[field] = value
    world, dp = fields.get("world"), fields.get("dp", 1)
    if getattr(args, "sp", None) is None and isinstance(world, int) and world >= 1 and isinstance(dp, int) and dp >= 1:
        if world % dp:
            divisors = [d for d in range(1, world + 1) if world % d == 0]
            raise ValueError(f"dp={dp} does not divide world={world}; choose --dp from {divisors}")
        fields["sp"] = world // dp
    if need_model:
        for field, flag in (("model_gb", "--model-gb"), ("blocks", "--blocks")):
            if field not in fields:
                raise ValueError(f"{field} is required: pass {flag} or a workload --preset")
    return fields, names


def _parse_list(text: Optional[str], kind: type, flag: str, default: Sequence) -> list:
    if text is None:
        return list(default)
    try:
        items = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} must be a comma-separated list of {kind.__name__} values, got {text!r}") from None
    if not items or any(x <= 0 for x in items):
        raise ValueError(f"{flag} needs positive values, got {text!r}")
    return items


def table_rows(args: argparse.Namespace) -> list[dict]:
    """Rows of the extrapolation table for ``--table`` (both modes, pure DP)."""
    fields, _ = _collect(args, need_model=False)
    sizes = _parse_list(args.table_sizes, float, "--table-sizes", sorted({p[0] for p in EXTRAPOLATION_PAIRS}))
    dps = _parse_list(args.table_dp, int, "--table-dp", [4, 8])
    blocks = fields.get("blocks", TABLE_BLOCKS)
    share = fields["max_block_gb"] / fields["model_gb"] if "max_block_gb" in fields and "model_gb" in fields else None
    published = {(r.model_gb, r.dp): r for r in PUBLISHED_EXTRAPOLATION}
    rows = []
    for size in sizes:
        for dp in dps:
            row_fields = dict(fields, model_gb=size, dp=dp, sp=1, world=None, blocks=blocks,
                              max_block_gb=size * share if share else None)
            pred = predict(PlanInputs(**row_fields))
            ref = published.get((float(size), int(dp)))
            rows.append({
                "model_gb": size, "dp": dp,
                "allgather": _host(pred.allgather), "rank_local": _host(pred.rank_local),
                "recommended": pred.mode,
                "published_cgroup_gb": ref.cgroup_gb if ref else None,
                "published_total_gb": ref.total_gb if ref else None,
            })
    return rows


def _host(m: ModePrediction) -> dict:
    return {"cgroup_load_peak_gb": m.cgroup_load_peak_gb, "host_physical_peak_gb": m.host_physical_peak_gb,
            "pinned_per_rank_gb": m.pinned_per_rank_gb, "device_peak_gb": m.device_peak_gb, "fits": m.fits}


def _fmt(x: Optional[float], width: int = 9) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-".rjust(width)
    return f"{x:{width}.1f}"


def _print_table(rows: list[dict], out: TextIO) -> None:
    head = ("model GB", "dp", "AG cgroup", "AG total", "AG fits", "RL cgroup", "RL total", "RL fits",
            "pub cgroup", "pub total", "recommended")
    out.write("  ".join(h.rjust(10) for h in head) + "\n")
    for r in rows:
        ag, rl = r["allgather"], r["rank_local"]
        cells = (_fmt(r["model_gb"], 10), str(r["dp"]).rjust(10),
                 _fmt(ag["cgroup_load_peak_gb"], 10), _fmt(ag["host_physical_peak_gb"], 10),
                 ("yes" if ag["fits"] else "no").rjust(10),
                 _fmt(rl["cgroup_load_peak_gb"], 10), _fmt(rl["host_physical_peak_gb"], 10),
                 ("yes" if rl["fits"] else "no").rjust(10),
                 _fmt(r["published_cgroup_gb"], 10), _fmt(r["published_total_gb"], 10), r["recommended"].rjust(11))
        out.write("  ".join(cells) + "\n")
    out.write("GB = 10^9 bytes; host peaks are at load; 'pub' = DLO write-up estimate (AllGather, Ascend).\n")


PLACEHOLDERS = {"block_compute_ms": ("generic_block_compute_ms", "--block-compute-ms"),
                "h2d_gbps": ("generic_h2d_gbps", "--h2d-gbps"),
                "gather_gbps": ("generic_gather_gbps", "--gather-gbps")}
"""Inputs whose default is an assumed placeholder, not a figure of any machine or model."""


def placeholders(fields: dict) -> dict[str, str]:
    """The placeholder inputs in use (neither given nor set by a preset), each with what to
    do about it."""
    from ..figures import CONSTANTS

    return {field: (f"{CONSTANTS[name].value:g} {CONSTANTS[name].unit} is a placeholder "
                    f"({name}, assumed); give {flag}, or plan a real model with --model")
            for field, (name, flag) in PLACEHOLDERS.items() if field not in fields}


def _print_prediction(pred: Prediction, presets: list[str], out: TextIO,
                      assumed: Optional[dict[str, str]] = None) -> None:
    i, ag, rl = pred.inputs, pred.allgather, pred.rank_local
    out.write(
        f"DLO plan: {i.model_gb:g} GB in {i.blocks} blocks (largest {i.block_gb:.2f} GB), "
        f"dp={i.dp} x sp={i.sp} on {i.world_size} ranks, gather group {i.gather_group}\n"
    )
    if presets:
        out.write(f"presets: {', '.join(presets)}\n")
    rows = [
        ("host copies of the blocks", ag.host_copies, rl.host_copies, "{:.0f}"),
        ("pinned per rank (GB)", ag.pinned_per_rank_gb, rl.pinned_per_rank_gb, "{:.2f}"),
        ("cgroup-visible load peak (GB)", ag.cgroup_load_peak_gb, rl.cgroup_load_peak_gb, "{:.1f}"),
        ("physical host peak (GB)", ag.host_physical_peak_gb, rl.host_physical_peak_gb, "{:.1f}"),
        ("device peak per rank (GB)", ag.device_peak_gb, rl.device_peak_gb, "{:.2f}"),
        ("compute per block (ms)", ag.compute_ms, rl.compute_ms, "{:.2f}"),
        ("H2D per block (ms)", ag.h2d_ms, rl.h2d_ms, "{:.2f}"),
        ("gather per block (ms)", ag.gather_ms, rl.gather_ms, "{:.2f}"),
        ("lockstep per block (ms)", ag.lockstep_ms, rl.lockstep_ms, "{:.2f}"),
        ("fixed per block (ms)", ag.fixed_ms, rl.fixed_ms, "{:.2f}"),
        ("bound term", ag.bound, rl.bound, "{}"),
        ("block time (ms)", ag.block_time_ms, rl.block_time_ms, "{:.2f}"),
        ("step time (ms)", ag.step_time_ms, rl.step_time_ms, "{:.1f}"),
        (f"request time (s, {i.steps} steps)", ag.request_time_s, rl.request_time_s, "{:.2f}"),
        ("requests per hour", ag.requests_per_hour, rl.requests_per_hour, "{:.1f}"),
        (f"fits host RAM ({i.host_ram_gb:g} GB)", "yes" if ag.fits_host else "no",
         "yes" if rl.fits_host else "no", "{}"),
        (f"fits HBM ({i.hbm_gb:g} GB)", "yes" if ag.fits_device else "no", "yes" if rl.fits_device else "no", "{}"),
    ]
    out.write(f"{'':32}{'allgather':>14}{'rank_local':>14}\n")
    for label, a, b, spec in rows:
        out.write(f"{label:32}{spec.format(a):>14}{spec.format(b):>14}\n")
    out.write(f"recommended: {pred.mode}\nreason: {pred.reason}\n")
    for field, text in (assumed or {}).items():
        out.write(f"placeholder: {field} = {text}\n")
    _print_routes(pred, out)


def _print_routes(pred: Prediction, out: TextIO) -> None:
    """Each gather group of the topology (`dlo_fx.planning.routes`) and the one chosen."""
    out.write(f"\ngather group (dp={pred.inputs.dp} x sp={pred.inputs.sp})\n")
    head = ("group", "ranks", "host GB/rank", "H2D ms", "gather ms", "all-to-all ms",
            "lock-step ms", "block ms", "fits host")
    out.write(f"{head[0]:8}" + "".join(f"{h:>14}" for h in head[1:]) + "\n")
    for f in pred.routes.values():
        cells = (str(f.group), f"{f.host_bytes_per_rank / 1e9:.2f}", f"{f.h2d_s * 1e3:.2f}",
                 f"{f.gather_s * 1e3:.2f}", f"{f.all_to_all_s * 1e3:.2f}",
                 f"{f.lockstep_s * 1e3:.2f}", f"{f.block_s * 1e3:.2f}",
                 "yes" if f.fits_host else "no")
        out.write(f"{f.route:8}" + "".join(f"{c:>14}" for c in cells) + "\n")
    out.write(f"gather over: {pred.gather}\nreason: {pred.gather_reason}\n")


def _print_presets(out: TextIO) -> None:
    for p in PRESETS.values():
        out.write(f"{p.name}: {p.description}\n")
        for field, v in p.values.items():
            out.write(f"  {field} = {v.value:g}  [{v.source}]\n")


def _refuse_numbers(args: argparse.Namespace) -> None:
    """ValueError naming the number-only options given with ``--model``, which plans from
    the model itself (only --dp and --num-slots apply to both)."""
    given = [flag for flag, field, _, _ in _OPTIONS
             if field not in ("dp", "num_slots") and getattr(args, field, None) is not None]
    given += [flag for flag, dest in (("--preset", "preset"), ("--gather-over", "gather_over"),
                                      ("--json", "json"), ("--table", "table"),
                                      ("--formulas", "formulas"),
                                      ("--list-presets", "list_presets"))
              if getattr(args, dest, None)]
    if given:
        raise ValueError(f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} for the "
                         "number-only mode; with --model the plan takes the model's own "
                         "blocks, FLOPs and memory and the --hardware figures: drop "
                         f"{'it' if len(given) == 1 else 'them'}, or drop --model")


def run_plan(args: argparse.Namespace, out: Optional[TextIO] = None, err: Optional[TextIO] = None) -> int:
    """Run the ``plan`` command for parsed arguments; returns the exit status."""
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        if getattr(args, "model", None) is not None:
            from ..plan.cli import run_model_plan

            _refuse_numbers(args)
            return run_model_plan(args, out)
        if getattr(args, "list_presets", False):
            _print_presets(out)
            return 0
        if getattr(args, "formulas", False):
            forms = model.formulas("str")
            if args.json:
                out.write(json.dumps(forms, indent=2) + "\n")
            else:
                out.write("\n".join(forms.values()) + "\n")
            return 0
        if getattr(args, "table", False):
            rows = table_rows(args)
            if args.json:
                out.write(json.dumps({"table": rows}, indent=2) + "\n")
            else:
                _print_table(rows, out)
            return 0
        from ..plan.cli import model_only_given

        alone = model_only_given(args)
        if alone:
            raise ValueError(f"{', '.join(alone)} need{'s' if len(alone) == 1 else ''} "
                             "--model (a model planned from its config); the number-only "
                             "mode takes --model-gb and --blocks")
        fields, names = _collect(args)
        pred = predict(PlanInputs(**fields))
    except ValueError as exc:
        err.write(f"plan: error: {exc}\n")
        return 2
    assumed = placeholders(fields)
    if args.json:
        data = pred.to_dict()
        data["presets"] = names
        data["placeholders"] = assumed
        out.write(json.dumps(data, indent=2) + "\n")
    else:
        _print_prediction(pred, names, out, assumed)
    return 1 if pred.mode == "none" else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``python -m dlo_fx.apps.study.cli``."""
    parser = argparse.ArgumentParser(
        prog="python -m dlo_fx.apps.study.cli",
        description="Predict host and device memory and step time of the allgather and "
                    "rank_local streaming modes, and recommend one.",
    )
    add_plan_arguments(parser)
    return run_plan(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
