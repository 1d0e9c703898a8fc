"""``compiler="inductor"``: Inductor compiles the compute between schedule nodes.

DLO with Inductor is compared with the resident model under ``backend="inductor"``
(`assert_inductor_close`: the dtype's resolution at the output's scale) and with itself
across slot counts, modes and dp sizes (``torch.equal``). See inductor_cases.py for why,
and for the Inductor configuration both sides compile with.
"""

from __future__ import annotations

import operator

import pytest
import torch
from torch import fx
from torch.fx.node import has_side_effect

import dlo_fx.inductor
import inductor_cases as C
from distributed import spawn
from dlo_fx.inductor import CompiledPiece
from dlo_fx.models import example_inputs
from dlo_fx.runtime.runtime import runtimes_holding
from models import MODELS, tiny_dit


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


def dit_inputs(hw: int = 8):
    return example_inputs(tiny_dit()[0].config, batch=2, height=hw, width=hw, seed=1)


def test_dit_matches_resident_inductor_and_is_exact_across_slots(outer_graphs):
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


def pieces_of(outer: fx.GraphModule) -> list[CompiledPiece]:
    """The pieces Inductor compiled (not those that only move data)."""
    return [m for m in outer.children() if isinstance(m, CompiledPiece) and m.compiled]


def test_weights_are_inputs_so_other_weights_reuse_the_compiled_pieces(outer_graphs):
    """A second model with other weights runs on the first model's compiled pieces and
    still matches its own reference: no weight was baked into a piece."""
    inputs = dit_inputs()
    outs = []
    for seed in (0, 1):
        C.fresh()
        (ref,) = C.resident_inductor("dit", [inputs], seed=seed)
        got, _ = C.dlo_inductor("dit", {}, [inputs], seed=seed)
        C.assert_inductor_close(got[0], ref)
        outs.append(got[0])
    assert all(m.reused for m in pieces_of(outer_graphs[1]))
    assert not torch.allclose(outs[0], outs[1], atol=1e-2)


@pytest.mark.parametrize("name", ["wan", "flux"])
def test_diffusers_match_resident_inductor_and_are_exact_across_slots(name):
    _, inputs = MODELS[name]()
    (ref,) = C.resident_inductor(name, [inputs])
    outs = []
    for num_slots in (2, 3):
        C.fresh()
        got, _ = C.dlo_inductor(name, {"num_slots": num_slots}, [inputs, inputs])
        outs += got
    C.assert_inductor_close(outs[0], ref)
    assert all(torch.equal(out, outs[0]) for out in outs)


def test_graph_breaks_one_graph_per_half_layer_reused_across_layers(outer_graphs):
    kw = {"graph_break": True, "depth": 4}
    inputs = dit_inputs()
    (ref,) = C.resident_inductor("dit", [inputs], fullgraph=False, **kw)
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


def symbolic_inputs(outer: fx.GraphModule) -> bool:
    return any(isinstance(n.meta.get("example_value"), torch.SymInt)
               for n in outer.graph.nodes if n.op == "placeholder")


def test_second_resolution_recompiles_with_symbolic_pieces(outer_graphs):
    """Automatic dynamic shapes: the second resolution recompiles once with symbolic
    sizes, which then serves every resolution; the first graph keeps serving its own."""
    inputs = [dit_inputs(hw) for hw in (8, 12, 16, 8)]
    refs = C.resident_inductor("dit", inputs)
    C.fresh()  # Dynamo remembers, per code object, which sizes changed: start over
    outs, _ = C.dlo_inductor("dit", {}, inputs)
    for out, ref in zip(outs, refs):
        C.assert_inductor_close(out, ref)
    assert torch.equal(outs[0], outs[3])
    assert len(outer_graphs) == 2
    assert not symbolic_inputs(outer_graphs[0]) and symbolic_inputs(outer_graphs[1])


def test_dynamic_true_compiles_once_for_every_resolution(outer_graphs):
    inputs = [dit_inputs(hw) for hw in (12, 16)]
    refs = C.resident_inductor("dit", inputs, dynamic=True)
    outs, _ = C.dlo_inductor("dit", {}, inputs, dynamic=True)
    for out, ref in zip(outs, refs):
        C.assert_inductor_close(out, ref)
    assert len(outer_graphs) == 1 and symbolic_inputs(outer_graphs[0])


CALLS: list[int] = []


def _count_call(block: int) -> None:
    CALLS.append(block)


has_side_effect(_count_call)


def test_user_pass_nodes_run_at_call_time_between_pieces():
    """A plain Python function a user pass inserts is not traced into a piece: it runs
    in the outer graph on every call."""
    def after_waits(gm, ctx):
        for node in list(gm.graph.nodes):
            if node.meta.get("dlo", {}).get("kind") == "wait":
                with gm.graph.inserting_after(node):
                    gm.graph.call_function(_count_call, (node.meta["dlo"]["block"],))
        return gm

    CALLS.clear()
    inputs = dit_inputs()
    outs, _ = C.dlo_inductor("dit", {"user_passes": [after_waits]}, [inputs, inputs])
    C.fresh()
    plain, _ = C.dlo_inductor("dit", {}, [inputs])
    assert torch.equal(outs[0], plain[0]) and torch.equal(outs[1], plain[0])
    blocks = sorted(set(CALLS))
    assert blocks == list(range(len(blocks))) and CALLS == blocks + blocks


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
    compiled = torch.compile(_Autocast().eval().requires_grad_(False), backend="dlo",
                             options={"compiler": "inductor"})
    with torch.no_grad():
        ref, out = resident(x), compiled(x)
    # float32 tolerance: the same layers computed without autocast differ by ~5e-3
    C.assert_inductor_close(out, ref)
    waits = [n for n in outer_graphs[0].graph.nodes if n.meta.get("dlo", {}).get("kind") == "wait"]
    assert len(waits) == 3  # the region spans three blocks


def test_two_ranks_exact_across_modes_dp_and_slots():
    """One spawn, many cases: dp=2 AllGather and rank-local, slot counts, dp=1, graph
    breaks, Wan and Flux. Every case of a model is bit-identical to every other case of
    it, on both ranks. (dp=1 is what the tests above compare with the resident model.)"""
    results = spawn(2, C.dp_cases, torch.get_num_threads(), timeout=400)
    first: dict = {}
    for rank in (0, 1):
        for label, name, options, fullgraph, _ in C.DP_CASES:
            r = results[rank][label]
            expected = ("allgather", 2) if options.get("mode") == "allgather" else ("rank_local", 1)
            assert (r["mode"], r["dp"]) == expected, label
            assert torch.equal(r["outs"][1], r["outs"][0]), label
            out = first.setdefault((name, fullgraph), r["outs"][0])
            assert torch.equal(r["outs"][0], out), (rank, label)
