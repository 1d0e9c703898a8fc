"""``compiler="inductor"``: Inductor compiles the compute between schedule nodes.

DLO with Inductor is compared with the resident model (`assert_inductor_close`: the
dtype's resolution at the output's scale) and with itself across slot counts, weights,
modes and dp sizes (``torch.equal``). The resident model runs eagerly for every reference
but two, which compile it with ``backend="inductor"``: the DiT at one static resolution
(test_dit_...) and the autocast model. See inductor_cases.py for why, and for the
configuration every test compiles with (scalar C++ kernels, one intra-op thread).

The two-rank spawn is a spawned job (tests/conftest.py): its ranks (imports, Inductor's
warm-up, first Dynamo traces of four models) run in the background while the in-process
tests run, and test_two_ranks_... checks what they returned. Wan and Flux
are compared with the resident model there, and across slot counts: no other test
compiles a diffusers transformer (a first Dynamo trace of one costs seconds in every
process that makes it).
"""

from __future__ import annotations

import functools
import operator

import pytest
import torch
from torch import fx
from torch.fx.node import has_side_effect

import dlo_fx.inductor
import inductor_cases as C
from distributed import in_child, spawn
from models import offloaded
from dlo_fx.inductor import CompiledPiece
from dlo_fx.runtime.weights.owners import runtimes_holding


@pytest.fixture(autouse=True)
def inductor_config():
    with C.compile_config():
        yield


@pytest.fixture
def outer_graphs(monkeypatch):
    """The outer graphs `compile_pieces` returns, in compile order (a spy, not a stub)."""
    graphs: list[fx.GraphModule] = []
    real = dlo_fx.inductor.compile_pieces

    def spy(gm, example_inputs_, ctx):
        forward = real(gm, example_inputs_, ctx)
        graphs.append(forward.__self__)
        return forward

    monkeypatch.setattr(dlo_fx.inductor, "compile_pieces", spy)
    return graphs


def schedule_of(gm: fx.GraphModule) -> list[tuple[str, str]]:
    return [(n.name, n.meta["dlo"]["kind"]) for n in gm.graph.nodes if "dlo" in n.meta]


def record_schedule(into: list):
    def user_pass(gm, ctx):
        into.append(schedule_of(gm))
        return gm
    return user_pass


dit_inputs = C.dit_inputs


CALLS: list[int] = []


def _count_call(block: int) -> None:
    CALLS.append(block)


has_side_effect(_count_call)


def after_waits(gm, ctx):
    """A user pass: a plain Python function called after every ``wait``."""
    for node in list(gm.graph.nodes):
        if node.meta.get("dlo", {}).get("kind") == "wait":
            with gm.graph.inserting_after(node):
                gm.graph.call_function(_count_call, (node.meta["dlo"]["block"],))
    return gm


def test_dit_matches_resident_inductor_exact_across_slots_weights_and_user_nodes(outer_graphs):
    """One DiT, four compiles sharing their pieces:

    - slot counts 2 and 3 compile the same pieces, agree bit for bit with each other and
      with the resident model under ``backend="inductor"`` to the dtype's resolution;
    - a second model with other weights runs on the first model's compiled pieces and
      still matches its own (eager) reference: no weight was baked into a piece;
    - a plain Python function a user pass inserts is not traced into a piece: it runs in
      the outer graph on every call, and changes no bit of the output."""
    inputs = dit_inputs()
    (ref,) = C.resident_inductor("dit", [inputs])
    outs, schedules = [], []
    for num_slots in (2, 3):
        C.fresh()
        got, _ = C.dlo_inductor("dit", {"num_slots": num_slots,
                                        "user_passes": [record_schedule(schedules)]},
                                [inputs, inputs])
        outs += got
    C.assert_inductor_close(outs[0], ref)
    assert all(torch.equal(out, outs[0]) for out in outs)
    for outer, schedule in zip(outer_graphs, schedules):
        # The outer graph runs the scheduled graph's schedule nodes, in the same order...
        assert schedule_of(outer) == schedule
        pieces = [n for n in outer.graph.nodes if n.op == "call_module"]
        assert len(pieces) > len([k for _, k in schedule if k == "wait"])
        # ...the compute is in compiled pieces that hold no tensor, the weights (slot
        # views) are plain inputs of the pieces.
        for node in pieces:
            module = outer.get_submodule(node.target)
            assert isinstance(module, CompiledPiece)
            assert not list(module.parameters()) and not list(module.buffers())
        for node in outer.graph.nodes:
            if node.meta.get("dlo", {}).get("kind") == "slot_view":
                assert node.users and all(u.op == "call_module" for u in node.users)
            if node.op == "call_function":  # only schedule nodes and pieces' outputs
                assert "dlo" in node.meta or node.target is operator.getitem, node
    # every layer's pieces are one compiled piece; the slots=3 run compiled nothing new
    assert sum(m.reused for m in pieces_of(outer_graphs[0])) >= 2
    assert not any(not m.reused for m in pieces_of(outer_graphs[1]))

    # other weights (seed 1), the same shapes: every piece is one the seed-0 runs compiled
    C.fresh()
    (other_ref,) = C.eager_reference("dit", [inputs], seed=1)
    (other,), _ = C.dlo_inductor("dit", {}, [inputs], seed=1)
    C.assert_inductor_close(other, other_ref)
    assert len(outer_graphs) == 3 and all(m.reused for m in pieces_of(outer_graphs[2]))
    assert not torch.allclose(outs[0], other, atol=1e-2)

    # a user pass's plain function (seed 0 again): called between pieces on every call
    C.fresh()
    CALLS.clear()
    with_calls, _ = C.dlo_inductor("dit", {"user_passes": [after_waits]}, [inputs, inputs])
    assert torch.equal(with_calls[0], outs[0]) and torch.equal(with_calls[1], outs[0])
    blocks = sorted(set(CALLS))
    assert blocks == list(range(len(blocks))) and CALLS == blocks + blocks


def pieces_of(outer: fx.GraphModule) -> list[CompiledPiece]:
    """The pieces Inductor compiled (not those that only move data)."""
    return [m for m in outer.children() if isinstance(m, CompiledPiece) and m.compiled]


def test_graph_breaks_one_graph_per_half_layer_reused_across_layers(outer_graphs):
    kw = {"graph_break": True, "depth": 4}
    inputs = dit_inputs()
    (ref,) = C.eager_reference("dit", [inputs], **kw)
    outs = []
    for num_slots in (2, 3):
        C.fresh()
        got, model = C.dlo_inductor("dit", {"num_slots": num_slots}, [inputs] * 3,
                                    fullgraph=False, **kw)
        outs += got
    C.assert_inductor_close(outs[0], ref)
    assert all(torch.equal(out, outs[0]) for out in outs)
    assert len(outer_graphs) >= 2 * 3  # several graphs per compile
    store = runtimes_holding(list(model.parameters()))[0].store
    assert all(model.blocks[i].fc1.weight in store for i in range(4))


#: One forked child runs both dynamic-shape tests (`inductor_cases.dynamic_shape_cases`): a
#: spawned job (tests/conftest.py), so its symbolic compiles run beside the in-process tests.
DYNAMIC_SHAPES = functools.partial(spawn, 1, in_child, C.dynamic_shape_cases)


@pytest.mark.spawned.with_args(DYNAMIC_SHAPES)
def test_second_resolution_recompiles_with_symbolic_pieces(spawned):
    """Automatic dynamic shapes: the second resolution recompiles once with symbolic
    sizes, which then serves every resolution; the first graph keeps serving its own."""
    case = spawned[0]["automatic"]
    for out, ref in zip(case["outs"], case["refs"]):
        C.assert_inductor_close(out, ref)
    assert torch.equal(case["outs"][0], case["outs"][3])
    assert case["symbolic"] == [False, True]  # two outer graphs, the second symbolic
    assert case["streamed"]


@pytest.mark.spawned.with_args(DYNAMIC_SHAPES)
def test_dynamic_true_compiles_once_for_every_resolution(spawned):
    """``dynamic=True``: one symbolic graph serves both resolutions. Dynamo passes the
    LayerNorms' eps as tensors read with ``.item()``, which a piece cannot compile;
    the backend has Dynamo specialize them, as ``backend="inductor"`` does (see [Note:
    tensorified floats] in dlo_fx/torch_private.py). The model is offloaded before it is
    compiled (see [Note: one way in] in dlo_fx/dynamo/backend.py), so one graph is
    compiled, and no graph after it."""
    case = spawned[0]["dynamic_true"]
    for out, ref in zip(case["outs"], case["refs"]):
        C.assert_inductor_close(out, ref)
    assert case["symbolic"] == [True]
    assert case["streamed"]


class _Shaped(torch.nn.Module):
    """Three layers (three blocks) behind one LayerNorm; reads ``x.shape`` once, before
    the first block, and takes a float argument."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))
        self.norm = torch.nn.LayerNorm(16)

    def forward(self, x, scale: float):
        batch, tokens, width = x.shape
        for layer in self.layers:
            x = layer(self.norm(x)).view(batch, tokens, 2, width // 2)
            x = torch.nn.functional.gelu(x).flatten(2) * scale + scale
        return x


def test_dynamic_true_float_argument_and_sizes_read_across_blocks(outer_graphs):
    """``dynamic=True``, two things no piece could compile (each compile failed; with
    ``fullgraph=False`` the frame silently ran eagerly on resident weights):

    - a float argument of ``forward`` (and the LayerNorm's eps) is a tensor read with
      ``.item()``: each value is specialized instead, one graph per value, guarded on it
      (see [Note: tensorified floats] in dlo_fx/torch_private.py);
    - ``width`` comes from ``x.size()`` in the piece before the first block, and a
      ``torch.Size`` cannot be a piece's input: the piece that reads it recomputes it.

    Every call agrees with the resident model and every graph streams the weights."""
    model = _Shaped().eval().requires_grad_(False)
    reference = _Shaped().eval().requires_grad_(False)
    compiled = torch.compile(offloaded(model), backend="dlo", dynamic=True, fullgraph=True,
                             options={"compiler": "inductor"})
    with torch.no_grad():
        for batch, tokens, scale in [(2, 4, 0.5), (3, 6, 1.5), (4, 5, 0.5)]:
            x = torch.randn(batch, tokens, 16)
            C.assert_inductor_close(compiled(x, scale), reference(x, scale))
    # 0.5 and 1.5; the third call reuses the first graph. The root module's forward
    # pre-hook (the inputs' device check) makes Dynamo compile ``_call_impl``, whose own
    # graph, before the float restart, reads nothing: no weight, no schedule.
    streaming = [g for g in outer_graphs if len(list(g.graph.nodes)) > 1]
    assert len(streaming) == 2 and len(outer_graphs) <= 3, outer_graphs
    assert all(C.symbolic_inputs(g) for g in streaming)  # sizes stay symbolic
    store = runtimes_holding(list(model.parameters()))[0].store
    assert all(layer.weight in store for layer in model.layers)


class _Autocast(torch.nn.Module):
    """Three layers (three blocks) inside one autocast region."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(3))

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            for layer in self.layers:
                x = torch.nn.functional.gelu(layer(x)) * 2
        return x.float()


def test_autocast_region_cut_by_schedule_nodes_is_reentered_in_each_piece(outer_graphs):
    x = torch.randn(4, 32)
    resident = torch.compile(_Autocast().eval().requires_grad_(False), backend="inductor")
    compiled = torch.compile(offloaded(_Autocast().eval().requires_grad_(False)),
                             backend="dlo", options={"compiler": "inductor"})
    with torch.no_grad():
        ref, out = resident(x), compiled(x)
    # float32 tolerance: the same layers computed without autocast differ by ~5e-3
    C.assert_inductor_close(out, ref)
    waits = [n for n in outer_graphs[0].graph.nodes if n.meta.get("dlo", {}).get("kind") == "wait"]
    assert len(waits) == 3  # the region spans three blocks


@pytest.mark.spawned.with_args(lambda: spawn(2, C.dp_cases, timeout=400))
def test_two_ranks_match_the_resident_model_and_are_exact_across_modes_dp_and_slots(spawned):
    """One spawn, many cases: dp=2 AllGather and rank-local, slot counts, dp=1, graph
    breaks, Wan and Flux. Every case of a model is bit-identical to every other case of
    it, on both ranks (a dp=1 case runs on one of them: see `C.DP_CASES`), and agrees with
    the resident model run eagerly (for Wan and Flux this is their only comparison with
    it, and their only slot counts: 2 in AllGather, 3 at dp=1)."""
    results = spawned
    first: dict = {}
    for rank in (0, 1):
        for label, name, options, fullgraph, _, ranks in C.DP_CASES:
            if rank not in ranks:
                assert label not in results[rank], (rank, label)
                continue
            r = results[rank][label]
            expected = ("allgather", 2) if options.get("mode") == "allgather" else ("rank_local", 1)
            assert (r["mode"], r["dp"]) == expected, label
            assert torch.equal(r["outs"][1], r["outs"][0]), label
            out = first.setdefault((name, fullgraph), r["outs"][0])
            assert torch.equal(r["outs"][0], out), (rank, label)
    refs = results[0]["refs"]
    assert first.keys() == refs.keys()
    for key, out in first.items():
        C.assert_inductor_close(out, refs[key])
