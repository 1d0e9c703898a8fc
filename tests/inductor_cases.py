"""Helpers and multi-rank cases for the ``compiler="inductor"`` tests (test_inductor.py).

What DLO with Inductor is compared with. DLO splits the graph into pieces that end at
schedule nodes and Inductor compiles each piece, so it computes the model with other
kernels than a whole-graph evaluation: it agrees with the resident model to the resolution
of the dtype at the output's scale (`assert_inductor_close`), not bit for bit. Among DLO
runs (slot counts, modes, dp sizes, other weights of the same shapes, user-pass nodes)
the pieces are the same, so their outputs must be ``torch.equal``.

The resident model is run eagerly (`eager_reference`) for every reference except two,
compiled with ``torch.compile(backend="inductor")`` (`resident_inductor`) to keep the
direct comparison with what a user would otherwise run: the DiT at one static resolution
(seed 0, in test_dit_...) and the autocast model. What each test compares with:

| test | DLO outputs compared with |
| --- | --- |
| test_dit_... | seed 0: resident Inductor; seed 1: eager; user-pass nodes: the seed-0 run |
| test_graph_breaks_... | eager |
| test_second_resolution_... | eager, at 8, 12 and 16 |
| test_dynamic_true_... | eager, at 12 and 16 |
| test_autocast_... | resident Inductor |
| test_two_ranks_... | eager, computed on rank 0, for each of the four models |

Why eager is as good a reference: the tolerance is the same, and DLO is as close to eager
as to resident Inductor. Measured: at most 0.17 of the tolerance for the bfloat16 DiT, at
every resolution, static, automatic-dynamic or ``dynamic=True`` (0.15 to 0.17 from
resident Inductor); the DiT with graph breaks, Wan and Flux equal resident Inductor bit
for bit, and are 0.13 (bfloat16), 0.015 and 0.017 (float32) of the tolerance from eager.
Why not resident Inductor everywhere: each such reference is a Dynamo trace plus an
Inductor compile (seconds for a diffusers transformer), and with dynamic shapes a symbolic
compile (~20 s for ``dynamic=True``).

Every test compiles with one configuration, `compile_config`: scalar C++ kernels
(``cpp.vec_isa_ok=False``), which compile two to three times faster on CPU than the
vectorised default (benchmarks/bench_inductor.py runs the default). The ranks of the
two-rank test use it too, and every process runs one intra-op thread (tests/conftest.py,
tests/distributed.py), so that each of these processes finds in Inductor's on-disk cache
the pieces another one compiled (in this run or an earlier one).
"""

from __future__ import annotations

import contextlib
import time

import torch

from dlo_fx.runtime.weights.owners import reset_runtimes, runtimes_holding

from models import MODELS, call, offloaded

#: Relative resolution per dtype; the absolute tolerance is that times max |reference|.
RESOLUTION = {torch.bfloat16: 1.6e-2, torch.float16: 1e-3, torch.float32: 1e-5}


@contextlib.contextmanager
def compile_config():
    """The configuration every test compiles and runs with (see the module docstring)."""
    with torch._inductor.config.patch({"cpp.vec_isa_ok": False}):
        yield


def assert_inductor_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """``out`` agrees with ``ref`` to the dtype's resolution at the output's scale."""
    assert out.dtype == ref.dtype and out.shape == ref.shape, (out.dtype, out.shape, ref.shape)
    rtol = RESOLUTION[ref.dtype]
    scale = max(1.0, ref.float().abs().max().item())
    torch.testing.assert_close(out, ref, rtol=rtol, atol=rtol * scale)


def fresh() -> None:
    torch._dynamo.reset()
    reset_runtimes()


def eager_reference(name: str, inputs_list, **kw):
    """Outputs of the resident model, run eagerly, for each input."""
    model, _ = MODELS[name](**kw)
    with torch.no_grad():
        return [call(model, inputs) for inputs in inputs_list]


def resident_inductor(name: str, inputs_list, *, fullgraph=True, dynamic=None, **kw):
    """Outputs of the resident model under ``backend="inductor"`` for each input."""
    model, _ = MODELS[name](**kw)
    compiled = torch.compile(model, backend="inductor", fullgraph=fullgraph, dynamic=dynamic)
    with torch.no_grad():
        return [call(compiled, inputs) for inputs in inputs_list]


def dlo_inductor(name: str, options: dict, inputs_list, *, fullgraph=True, dynamic=None,
                 **kw):
    """(outputs, model) of a dlo-compiled twin with ``compiler="inductor"``."""
    model, _ = MODELS[name](**kw)
    compiled = torch.compile(offloaded(model, options), backend="dlo", fullgraph=fullgraph,
                             dynamic=dynamic,
                             options={"compiler": "inductor", **options})
    with torch.no_grad():
        return [call(compiled, inputs) for inputs in inputs_list], model


def dit_inputs(hw: int = 8):
    from dlo_fx.apps.models import example_inputs
    from models import tiny_dit

    return example_inputs(tiny_dit()[0].config, batch=2, height=hw, width=hw, seed=1)


def symbolic_inputs(outer) -> bool:
    """Whether an outer graph takes symbolic sizes (a graph compiled for dynamic shapes)."""
    return any(isinstance(n.meta.get("example_value"), torch.SymInt)
               for n in outer.graph.nodes if n.op == "placeholder")


def dynamic_shape_cases() -> dict:
    """The dynamic-shape tests of test_inductor, run in a forked child by their shared
    spawned job: for each case, the outputs, the eager references, whether each outer
    graph `compile_pieces` returned (a spy, in compile order) takes symbolic sizes, and
    whether every layer's weights were streamed.

    - ``"automatic"``: resolutions 8, 12, 16, then 8 again, as Dynamo's automatic dynamic
      shapes compile them;
    - ``"dynamic_true"``: 12 and 16 with ``dynamic=True`` (see
      test_dynamic_true_compiles_once_for_every_resolution)."""
    import dlo_fx.inductor

    graphs: list = []
    real = dlo_fx.inductor.compile_pieces

    def spy(gm, example_inputs_, ctx):
        forward = real(gm, example_inputs_, ctx)
        graphs.append(forward.__self__)
        return forward

    dlo_fx.inductor.compile_pieces = spy
    out = {}
    with compile_config():
        for case, sizes, dynamic in (("automatic", (8, 12, 16, 8), None),
                                     ("dynamic_true", (12, 16), True)):
            fresh()
            graphs.clear()
            inputs = [dit_inputs(hw) for hw in sizes]
            refs = eager_reference("dit", inputs)
            outs, model = dlo_inductor("dit", {}, inputs, dynamic=dynamic)
            store = runtimes_holding(list(model.parameters()))[0].store
            out[case] = {"outs": outs, "refs": refs,
                         "symbolic": [symbolic_inputs(g) for g in graphs],
                         "streamed": all(b.qkv.weight in store for b in model.blocks)}
    fresh()
    return out


# -- two ranks ------------------------------------------------------------------------------
#: (label, model, options, fullgraph, factory kwargs, ranks that run it); an "own" shard
#: group is the rank alone: dp = 1.
#: A dp=1 case runs on one rank only: a group of one rank is local (no process group, no
#: collective), so the other rank would compute the same thing again. Those cases come
#: last, so that neither rank waits in a collective for the other while it runs one.
#: Every model's outputs are also compared with the resident model; for Wan and Flux that
#: is their only such comparison (no in-process test compiles them: a first Dynamo trace of
#: a diffusers transformer costs seconds in every process that makes one). Their
#: AllGather cases run with the default 2 slots and their dp=1 cases with 3, so that each
#: model still runs at both slot counts, both modes and both dp sizes, all bit-identical,
#: without a third case (a dp=1 case at each slot count) costing another trace.
BOTH = (0, 1)
DP_CASES = (
    ("dit allgather slots=2", "dit", {"mode": "allgather", "num_slots": 2}, True, {}, BOTH),
    ("dit allgather slots=3", "dit", {"mode": "allgather", "num_slots": 3}, True, {}, BOTH),
    ("dit rank_local", "dit", {"mode": "rank_local"}, True, {}, BOTH),
    ("dit-break allgather", "dit", {"mode": "allgather", "num_slots": 3}, False,
     {"graph_break": True, "depth": 4}, BOTH),
    ("wan allgather", "wan", {"mode": "allgather"}, True, {}, BOTH),
    ("flux allgather", "flux", {"mode": "allgather"}, True, {}, BOTH),
    ("dit dp=1", "dit", {"shard_group": "own"}, True, {}, (0,)),
    ("wan dp=1 slots=3", "wan", {"shard_group": "own", "num_slots": 3}, True, {}, (0,)),
    ("dit-break dp=1", "dit", {"shard_group": "own"}, False,
     {"graph_break": True, "depth": 4}, (1,)),
    ("flux dp=1 slots=3", "flux", {"shard_group": "own", "num_slots": 3}, True, {}, (1,)),
)


def dp_cases(rank: int, world: int) -> dict:
    """This rank's cases of `DP_CASES` (label -> its two outputs and the runtime's
    mode/dp), and the resident model's eager output for each model (``"refs"``, keyed by
    (model, fullgraph)), computed here, where the model's classes are imported anyway.

    Runs under `compile_config`, as the parent's tests do: Inductor's CPU code depends on
    the configuration and the thread count, so a piece the parent or the other rank
    compiled is found in Inductor's on-disk cache."""
    out: dict = {"refs": {}}
    with compile_config():
        for label, name, options, fullgraph, kw, ranks in DP_CASES:
            if rank not in ranks:
                continue
            start = time.perf_counter()
            fresh()
            options = dict(options)
            if options.get("shard_group") == "own":
                options["shard_group"] = [rank]
            _, inputs = MODELS[name](**kw)
            if (name, fullgraph) not in out["refs"]:
                (out["refs"][name, fullgraph],) = eager_reference(name, [inputs], **kw)
            outs, model = dlo_inductor(name, options, [inputs, inputs], fullgraph=fullgraph,
                                       **kw)
            runtime = runtimes_holding(list(model.parameters()))[0]
            out[label] = {"outs": outs, "mode": runtime.mode, "dp": runtime.store.dp,
                          "seconds": time.perf_counter() - start}
    fresh()
    return out
