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


# -- a file no mapping can hold -------------------------------------------------------------
PAD_BYTES = 1 << 30


def padded_dit(folder: str, name: str, gap: int = 0) -> tuple[str, str, object]:
    """The tiny DiT's file with a 1 GiB tensor ``pad`` after its weights, left a hole (a
    sparse file: nothing written, nothing on disk), and ``gap`` bytes before ``pad`` (a
    corrupt file: no tensor covers them). (padded path, plain path, config)."""
    import json
    import struct

    plain, config = save_dit(folder, name=f"plain-{name}")
    data = open(plain, "rb").read()
    n = struct.unpack("<Q", data[:8])[0]
    header, body = json.loads(data[8:8 + n]), data[8 + n:]
    start = len(body) + gap
    header["pad"] = {"dtype": "U8", "shape": [PAD_BYTES], "data_offsets": [start, start + PAD_BYTES]}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path = os.path.join(folder, name)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + body)
        f.truncate(8 + len(raw) + start + PAD_BYTES)
    return path, plain, config


def _address_space() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))


def unmappable_cases(rank: int, world: int, folder: str) -> dict:
    """Loads of a 1 GiB file under an address-space limit (RLIMIT_AS) that refuses its
    mapping: safetensors' own (``headroom`` 256 MiB) or torch's second one over the file
    (1.5 GiB). Per case: what safetensors said when opening the file, whether the load was
    exact, or the load's error. The corrupt file is refused under the same limit."""
    import resource

    from safetensors import safe_open

    good, plain, config = padded_dit(folder, "big.safetensors")
    bad, _, _ = padded_dit(folder, "gap.safetensors", gap=8)
    drop_pad = {"pad": None}
    out = {}
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    for headroom in (256 << 20, 1536 << 20):
        case = out[headroom] = {}
        resource.setrlimit(resource.RLIMIT_AS, (_address_space() + headroom, hard))
        try:
            try:
                with safe_open(good, framework="pt", device="cpu"):
                    case["opened"] = "opened"
            except Exception as exc:
                case["opened"] = f"{type(exc).__name__}: {exc}"
            for key, path in (("good", good), ("bad", bad)):
                fresh()
                try:
                    model = load(ReferenceDiT, path, config=config, key_map=drop_pad)
                    case[key] = same_state(model, resident_dit(plain, config))
                except Exception as exc:
                    case[key] = f"{type(exc).__name__}: {exc}"
        finally:
            resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    return out
