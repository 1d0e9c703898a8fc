"""Case functions for tests/test_parallel.py: tensor-parallel models (DTensor parameters)
and diffusers' context parallelism, streamed by dlo, run by `distributed.spawn` (many
sub-cases per spawn)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import dlo_fx
from dlo_fx.dynamo.backend import SCHEDULED_OBSERVERS
from dlo_fx.runtime.weights.owners import reset_runtimes
from dlo_fx.runtime.weights.stored import is_stored
from dlo_fx.runtime.weights.tensor_parallel import stored_tensor

from errors import described
from models import call, tiny_flux
from parallel_cpu import cpu_parallelism


def _fresh() -> None:
    torch._dynamo.reset()
    reset_runtimes()


class TwoMLPs(nn.Module):
    """Two column-wise / row-wise linear pairs: the Megatron MLP, twice."""

    def __init__(self, width: int = 8, hidden: int = 64):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"up": nn.Linear(width, hidden), "down": nn.Linear(hidden, width)})
            for _ in range(2))

    def forward(self, x):
        for b in self.blocks:
            x = x + b["down"](torch.relu(b["up"](x)))
        return x


TP_PLAN = {f"blocks.{i}.{name}": style for i in range(2)
           for name, style in (("up", ColwiseParallel()), ("down", RowwiseParallel()))}


#: Uneven shards (63 rows over 2 ranks: 32 and 31) of the column-wise layers, gathered
#: after each; the row-wise layers stay plain parameters beside the DTensors
UNEVEN_PLAN = {f"blocks.{i}.up": ColwiseParallel(output_layouts=Replicate()) for i in range(2)}


def tp_mlp(mesh, hidden: int = 64, plan=TP_PLAN):
    torch.manual_seed(0)
    model = TwoMLPs(hidden=hidden).eval().requires_grad_(False)
    if mesh is not None:
        parallelize_module(model, mesh, plan)
    return model, (torch.randn(3, 8, generator=torch.Generator().manual_seed(1)),)


@contextlib.contextmanager
def scheduled_targets():
    """The call_function targets' names of every graph dlo schedules meanwhile."""
    seen: list[list[str]] = []

    def observe(gm, plan, runtime, config):
        seen.append([getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes
                     if n.op == "call_function"])

    SCHEDULED_OBSERVERS.append(observe)
    try:
        yield seen
    finally:
        SCHEDULED_OBSERVERS.remove(observe)


def streamed(factory, options, *, compile_options=False, calls=2, inputs_of=None):
    """Outputs of the resident model and of a dlo twin (offloaded first; with
    ``compile_options``, ``torch.compile`` given the same options again), ``torch.equal``
    per call, and what dlo holds."""
    _fresh()
    ref_model, inputs = factory()
    with torch.no_grad():
        ref = call(ref_model, inputs)
    model, _ = factory()
    with scheduled_targets() as graphs:
        dlo_fx.offload(model, options)
        compiled = torch.compile(model, backend="dlo",
                                 options=options if compile_options else None)
        with torch.no_grad():
            outs = [call(compiled, inputs) for _ in range(calls)]
    return {"equal": [torch.equal(o, ref) for o in outs], **holdings(model),
            "rewraps": sum(g.count("as_dtensor") for g in graphs),
            "slot_views": sum(g.count("slot_view") for g in graphs)}


def holdings(model) -> dict:
    """Host bytes this rank's store holds against the bytes of the model's local tensors."""
    from dlo_fx.runtime.weights.owners import runtimes_holding

    runtime = runtimes_holding([stored_tensor(p) for p in model.parameters()])[0]
    locals_ = [stored_tensor(p) for p in model.parameters()]
    return {"host_bytes": runtime.store.host_bytes, "dp": runtime.store.dp,
            "block_bytes": sum(b.nbytes for b in runtime.store.blocks),
            "mode": runtime.mode, "blocks": len(runtime.store.blocks),
            "stored": sum(is_stored(t) for t in locals_),
            "local_bytes": sum(t.numel() * t.element_size() for t in locals_),
            "full_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}


def _refused(fn) -> tuple[str, str]:
    try:
        fn()
    except Exception as exc:
        return described(exc)
    return ("no error", "")


# -- TP 2 ---------------------------------------------------------------------------------
def tp_cases(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    rank_local = {"mode": "rank_local", "resident_bytes": 0}
    out = {
        "offload": streamed(lambda: tp_mlp(mesh), rank_local),
        "compile": streamed(lambda: tp_mlp(mesh), rank_local, compile_options=True),
        "uneven": streamed(lambda: tp_mlp(mesh, hidden=63, plan=UNEVEN_PLAN), rank_local),
    }
    # A gather over the TP ranks themselves would mix two shards: refused at the offload
    _fresh()
    model, _ = tp_mlp(mesh)
    out["gather-over-tp"] = _refused(lambda: dlo_fx.offload(model, {"mode": "allgather"}))
    out["gather-over-tp-unchanged"] = not any(is_stored(stored_tensor(p)) for p in model.parameters())
    # A Partial placement: refused by name before anything is stored
    _fresh()
    model, _ = tp_mlp(mesh)
    model.blocks[1]["down"].weight = nn.Parameter(
        distribute_tensor(torch.ones(8, 64), mesh, [Partial()]), requires_grad=False)
    out["partial"] = _refused(lambda: dlo_fx.offload(model, rank_local))
    out["partial-unchanged"] = not any(is_stored(stored_tensor(p)) for p in model.parameters())
    # Another storage dtype: not for DTensors yet, refused before any value is rounded
    _fresh()
    model, _ = tp_mlp(mesh)
    before = [stored_tensor(p).clone() for p in model.parameters()]
    out["storage-dtype"] = _refused(lambda: dlo_fx.offload(
        model, {**rank_local, "storage_dtype": torch.float8_e4m3fn}))
    out["storage-dtype-unchanged"] = all(
        torch.equal(stored_tensor(p), b) for p, b in zip(model.parameters(), before))
    out.update(after_offload(mesh, rank_local))
    out.update(flux_tp(rank_local))
    return out


def after_offload(mesh, options) -> dict:
    """Tensor parallelism applied to an offloaded model: refused on every rank before any
    collective; after `dlo_fx.release` it applies, and offloading again streams the shards."""
    _fresh()
    model, (x,) = tp_mlp(None)
    with torch.no_grad():
        plain = model(x)
    dlo_fx.offload(model, options)
    out = {"tp-after-offload": _refused(lambda: parallelize_module(model, mesh, TP_PLAN)),
           "tp-after-offload-unchanged": all(is_stored(p) for p in model.parameters())}
    dlo_fx.release(model)
    parallelize_module(model, mesh, TP_PLAN)
    with torch.no_grad():
        resident = model(x)
    dlo_fx.offload(model, options)
    state = model.state_dict()  # DTensors again, around host copies of the local shards
    with torch.no_grad():
        outs = [torch.compile(model, backend="dlo")(x) for _ in range(2)]
    dlo_fx.release(model)
    with torch.no_grad():
        released = model(x)
    out["released-then-tp"] = {
        "equal": [torch.equal(o, resident) for o in outs],
        "close-to-plain": torch.allclose(resident, plain, atol=1e-5),
        "state_dict": all(isinstance(v, DTensor) and not is_stored(v._local_tensor)
                          for k, v in state.items() if k.endswith("weight")),
        "released": torch.equal(released, resident)
                    and not any(is_stored(p._local_tensor) for p in model.parameters())}
    return out


def _flux_tp(tp_degree: int):
    from diffusers import ParallelConfig, TensorParallelConfig

    def factory():
        model, kwargs = tiny_flux()
        model.eval().requires_grad_(False)
        with cpu_parallelism():
            model.enable_parallelism(config=ParallelConfig(
                tensor_parallel_config=TensorParallelConfig(tp_degree=tp_degree)))
        return model, kwargs
    return factory


def flux_tp(options) -> dict:
    """diffusers' own tensor parallelism (Flux's ``_tp_plan``) at TP 2, streamed; and
    ``enable_parallelism`` with a TensorParallelConfig after the offload, refused."""
    from diffusers import ParallelConfig, TensorParallelConfig

    out = {"flux": streamed(_flux_tp(2), options)}
    _fresh()
    model, _ = tiny_flux()
    dlo_fx.offload(model, options)
    with cpu_parallelism():
        out["flux-tp-after-offload"] = _refused(lambda: model.enable_parallelism(
            config=ParallelConfig(tensor_parallel_config=TensorParallelConfig(tp_degree=2))))
    out["flux-tp-after-offload-unchanged"] = model._parallel_config is None and all(
        is_stored(p) or p.numel() * p.element_size() <= 0 or not isinstance(p, DTensor)
        for p in model.parameters())
    dlo_fx.release(model)
    return out


# -- DP 2 x TP 2 ---------------------------------------------------------------------------
def dp_tp_cases(rank: int, world: int) -> dict:
    """A 2 x 2 mesh (dp, tp): the model tensor-parallel over ``mesh["tp"]``, its local
    shard split 1/2 over the DP ranks (the strided ranks ``r % 2``, ``r % 2 + 2``) and
    gathered."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_ranks = [rank % 2, rank % 2 + 2]
    return {"allgather": streamed(lambda: tp_mlp(mesh["tp"]),
                                  {"mode": "allgather", "shard_group": dp_ranks,
                                   "resident_bytes": 0}),
            "rank_local": streamed(lambda: tp_mlp(mesh["tp"]),
                                   {"mode": "rank_local", "resident_bytes": 0})}


# -- context parallelism ----------------------------------------------------------------------
def _cp_model(name: str, mesh, heads: int):
    """A factory of a tiny Flux or Wan whose sequence diffusers' Ulysses context parallelism
    splits over ``mesh`` (dims "ring", "ulysses"), with ``heads`` heads (the Ulysses degree
    divides them) and 8 text tokens (Flux splits its text too)."""
    from dlo_fx.apps.engine.context_parallel import enable_context_parallel
    from models import tiny_wan

    def factory():
        if name == "flux":
            model, inputs = tiny_flux(heads=heads, text=8)
        else:  # a tuple out (diffusers' context-parallel output hook takes no dataclass)
            model, (hidden, timestep, text) = tiny_wan(heads=heads)
            inputs = dict(hidden_states=hidden, timestep=timestep,
                          encoder_hidden_states=text, return_dict=False)
        model.eval().requires_grad_(False)
        enable_context_parallel(model, mesh)
        return model, inputs
    return factory


#: (dp, sp) topologies of one spawn's world -> the gather groups each model runs with
#: ("sp": the replica's ranks, "dp": the strided ranks of one sp place, "world": all of
#: them, "rank_local": none)
CP_ROUTES = {
    2: [((1, 2), "flux", ("sp", "rank_local")), ((1, 2), "wan", ("sp", "rank_local"))],
    4: [((1, 4), "flux", ("sp", "rank_local")), ((1, 4), "wan", ("sp",)),
        ((2, 2), "flux", ("sp", "dp", "world", "rank_local")), ((2, 2), "wan", ("sp", "dp"))],
}


def _route_options(route: str, rank: int, dp: int, sp: int) -> dict:
    replica = rank // sp
    groups = {"sp": [replica * sp + i for i in range(sp)],
              "dp": [rank % sp + d * sp for d in range(dp)],
              "world": list(range(dp * sp))}
    if route == "rank_local":
        return {"mode": "rank_local"}
    return {"mode": "allgather", "shard_group": groups[route]}


def cp_cases(rank: int, world: int) -> dict:
    """diffusers' Ulysses context parallelism on tiny Flux and Wan at every (dp, sp) of
    `CP_ROUTES` for ``world`` ranks, each rank's weights gathered over its replica's
    sequence ranks, over the strided DP ranks, over all ranks, or kept rank-local: exact
    against the same context-parallel model resident (the engine's mesh layout: replica-
    major ranks, dims ("dp", "ring", "ulysses"))."""
    out = {}
    for (dp, sp), name, routes in CP_ROUTES[world]:
        mesh = init_device_mesh("cpu", (dp, 1, sp), mesh_dim_names=("dp", "ring", "ulysses"))
        for route in routes:
            out[(dp, sp, name, route)] = streamed(
                _cp_model(name, mesh["ring", "ulysses"], heads=sp),
                {**_route_options(route, rank, dp, sp), "resident_bytes": 0})
    return out


__all__ = ["cp_cases", "dp_tp_cases", "tp_cases"]
