"""Checkpoint writers for the loader tests, and case functions run on every rank by
`distributed.spawn` (many sub-cases per spawn)."""

from __future__ import annotations

import dataclasses
import os

import torch
from safetensors.torch import load_file, save_file

from dlo_fx.loading.loader import load
from dlo_fx.apps.models import ReferenceDiT
from dlo_fx.runtime.weights.owners import live_runtimes, reset_runtimes, runtimes_holding

from models import call, runtime_figures, tiny_dit, tiny_wan


# The DiT's shared table, read by every block: some cases load it with ``resident=``, the
# others leave it to the partition (kept resident, its copy gathered through the copy
# worker in the order of every other gather: `Runtime.fetch_block`).
SHARED = ("modulation_table",)


# -- checkpoints ----------------------------------------------------------------------------
def save_dit(folder: str, name: str = "dit.safetensors", **kw) -> tuple[str, object]:
    """The tiny reference DiT's state dict as one safetensors file; (path, DiTConfig)."""
    model, _ = tiny_dit(**kw)
    path = os.path.join(folder, name)
    # fc2_weight is a transposed view: safetensors stores a contiguous copy of it.
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path)
    return path, model.config


def save_wan(folder: str) -> str:
    """The tiny Wan transformer via diffusers' save_pretrained, sharded into several files."""
    model, _ = tiny_wan()
    model.save_pretrained(folder, max_shard_size="40KB")
    shards = [f for f in os.listdir(folder) if f.endswith(".safetensors")]
    assert len(shards) >= 2, shards
    return folder


def save_checkpoints(root: str) -> tuple[str, object, str]:
    """`save_dit` and `save_wan` into ``root``: (DiT path, its config, Wan folder)."""
    dit, config = save_dit(root)
    return dit, config, save_wan(os.path.join(root, "wan"))


# -- references -----------------------------------------------------------------------------
def resident_dit(path: str, config) -> torch.nn.Module:
    """The same DiT the plain way: build it, then load_state_dict from the file."""
    model = ReferenceDiT(config)
    model.load_state_dict(load_file(path))
    return model.eval().requires_grad_(False)


def resident_wan(folder: str) -> torch.nn.Module:
    model, _ = tiny_wan(seed=123)  # other weights, replaced by the checkpoint's
    state = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            state.update(load_file(os.path.join(folder, name)))
    model.load_state_dict(state)
    return model.eval().requires_grad_(False)


def fresh() -> None:
    torch._dynamo.reset()
    reset_runtimes()


def compare(loaded: torch.nn.Module, reference: torch.nn.Module, inputs, options: dict,
            *, fullgraph: bool = True, calls: int = 2) -> dict:
    """Run ``loaded`` through backend="dlo" and the resident ``reference`` eagerly."""
    with torch.no_grad():
        expected = call(reference, inputs)
    compiled = torch.compile(loaded, backend="dlo", options=options, fullgraph=fullgraph)
    with torch.no_grad():
        equal = all(torch.equal(call(compiled, inputs), expected) for _ in range(calls))
    return {"equal": equal, **runtime_figures(loaded)}


def stored_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's values as the runtime would serve them (stored ones read back from
    the host store through `Runtime.resident_tensor`): checks a load without compiling."""
    runtime = runtimes_holding(list(model.parameters()))[0]
    return {name: runtime.reads.resident_tensor(p) if p in runtime.store else p.detach()
            for name, p in model.named_parameters()}


def same_state(model: torch.nn.Module, reference: torch.nn.Module) -> bool:
    state = stored_state(model)
    ref = dict(reference.named_parameters())
    return state.keys() == ref.keys() and all(
        torch.equal(state[k], ref[k]) and state[k].stride() == ref[k].stride() for k in ref)


# -- on every rank --------------------------------------------------------------------------
def load_cases(rank: int, world: int, dit_path: str, dit_config, wan_dir: str,
               missing: str) -> dict:
    out = {}
    _, dit_inputs = tiny_dit()
    _, wan_inputs = tiny_wan()
    for key, options, resident in [
        ("dit", {"mode": "allgather"}, ()),
        ("dit-resident-small", {"mode": "allgather", "resident_bytes": 4096}, SHARED),
        ("dit-rank-local", {"mode": "rank_local"}, ()),
        ("dit-auto", {"mode": "auto"}, SHARED),  # the load settles the mode (a collective probe)
    ]:
        fresh()
        model = load(ReferenceDiT, dit_path, config=dit_config, options=options, resident=resident)
        out[key] = compare(model, resident_dit(dit_path, dit_config), dit_inputs, options)
    fresh()
    options = {"mode": "allgather", "num_slots": 3}
    break_cfg = dataclasses.replace(dit_config, graph_break_in_blocks=True)
    model = load(ReferenceDiT, dit_path, config=break_cfg, options=options)  # eager root layers
    out["dit-break"] = compare(model, resident_dit(dit_path, break_cfg), dit_inputs, options,
                               fullgraph=False, calls=3)
    fresh()
    options = {"mode": "allgather"}
    from diffusers import WanTransformer3DModel

    model = load(WanTransformer3DModel, wan_dir, options=options)
    out["wan"] = compare(model, resident_wan(wan_dir), wan_inputs, options)
    # A bad checkpoint on one rank: every rank raises, none hangs, nothing is registered.
    fresh()
    options = {"mode": "allgather", "collective_timeout_s": 30}
    try:
        load(ReferenceDiT, missing if rank == 1 else dit_path, config=dit_config, options=options,
             resident=SHARED)
        out["bad-rank"] = None
    except ValueError as exc:
        out["bad-rank"] = str(exc)
    out["bad-rank-blocks"] = sum(len(rt.store.blocks) for rt in live_runtimes())
    return out
