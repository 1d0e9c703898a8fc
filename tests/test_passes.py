"""The passes one by one: intervals through aliases, resident set, partition, schedule."""

from __future__ import annotations

import dataclasses
import importlib
import logging

import pytest
import torch
from torch import nn

import dlo_fx
import dlo_fx.dynamo.backend as backend
from dlo_fx.passes import PIPELINE
from dlo_fx.planning.stages import PLANNING, GraphPlan
from dlo_fx.planning.blocks import layer_key
from dlo_fx.runtime.weights.owners import owner_of
from dlo_fx.runtime.weights.stored import is_stored

from errors import BackendCompilerFailed, described
from models import call, offloaded, tiny_dit


def compile_capture(model, inputs, options=None, fullgraph=True):
    """Compile with dlo (offloaded first where it is not dlo's yet), run once, return
    (output, [GraphPlan], [GraphModule])."""
    ctxs, gms = [], []
    real = backend.run_passes

    def spy(gm, ctx, extra=(), debug=False):
        out = real(gm, ctx, extra, debug)
        ctxs.append(ctx)
        gms.append(out)
        return out

    if dlo_fx.state(model) is None:
        offloaded(model, options)
    backend.run_passes = spy
    try:
        compiled = torch.compile(model, backend="dlo", options=options, fullgraph=fullgraph)
        with torch.no_grad():
            out = call(compiled, inputs)
    finally:
        backend.run_passes = real
    return out, ctxs, gms


def test_layer_key():
    assert layer_key("blocks.3.attn.qkv.weight") == "blocks.3"
    assert layer_key("blocks.3.ffn.net.0.proj.weight") == "blocks.3"
    assert layer_key("time_embed.0.weight") == "time_embed.0"
    assert layer_key("patch_embed.weight") == "patch_embed"
    assert layer_key("modulation_table") == "modulation_table"


def test_shared_table_is_resident_far_apart_and_default_budget_gives_a_block_per_layer():
    model, inputs = tiny_dit(depth=4)
    _, (ctx,), _ = compile_capture(model, inputs, {"block_bytes": 10**9})
    reasons = {p.fqn: p.reason for p in ctx.resident}
    # one block holds every parameter: no use is far apart from another, nothing stays
    assert len(ctx.blocks) == 1 and reasons == {}, (len(ctx.blocks), reasons)
    _, (ctx,), _ = compile_capture(*tiny_dit(depth=4))  # the default budget
    assert {p.fqn: p.reason for p in ctx.resident}["modulation_table"] == "used far apart"
    layer_blocks = [b for b in ctx.blocks if b.params[0].fqn.startswith("blocks.")]
    assert [{layer_key(p.fqn) for p in b.params} for b in layer_blocks] == [
        {f"blocks.{i}"} for i in range(4)]


def test_parameter_larger_than_budget_gets_its_own_block():
    model, inputs = tiny_dit(depth=2)
    ref = call(tiny_dit(depth=2)[0], inputs)
    big = model.blocks[0].adaLN.weight
    budget = big.numel() * big.element_size() // 3
    out, (ctx,), _ = compile_capture(model, inputs, {"block_bytes": budget})
    assert torch.equal(out, ref)
    (own,) = [b for b in ctx.blocks if any(p.param is big for p in b.params)]
    assert [p.fqn for p in own.params] == ["blocks.0.adaLN.weight"]
    assert own.nbytes > budget
    assert all(b.nbytes <= budget for b in ctx.blocks if len(b.params) > 1)


def test_half_layer_budget_splits_at_module_boundaries():
    budget = 30_000
    _, (ctx,), _ = compile_capture(*tiny_dit(depth=2), {"block_bytes": budget})
    size = {p.fqn: p.nbytes for b in ctx.blocks for p in b.params}
    assert any(len({layer_key(p.fqn) for p in b.params}) == 1 and len(b.params) < 10
               for b in ctx.blocks)  # layers were split
    for block in ctx.blocks:
        fqns = [p.fqn for p in block.params]
        # a Linear's weight and bias that fit the budget together are never split apart
        for fqn in fqns:
            bias = fqn.replace("weight", "bias")
            if fqn.endswith("weight") and bias in size and size[fqn] + size[bias] <= budget:
                assert bias in fqns


class NoStreamable(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(2.0), requires_grad=False)
        self.register_buffer("offset", torch.ones(4))

    def forward(self, x):
        return x * self.scale + self.offset


def test_model_with_no_streamable_parameters():
    model = NoStreamable()
    x = torch.randn(4)
    ref = model(x)
    out, (ctx,), (gm,) = compile_capture(model, (x,), {"resident_bytes": 1024})
    assert torch.equal(out, ref)
    assert not ctx.blocks and [p.reason for p in ctx.resident] == ["smaller than resident_bytes=1024"]
    assert not [n for n in gm.graph.nodes if "dlo" in n.meta]


class AliasLate(nn.Module):
    """A view of `a.weight` is read after `b` runs: a's slot must stay until then."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)

    def forward(self, x):
        wt = self.a.weight.t()
        h = x @ wt
        h = self.b(h)
        return h @ wt


def test_alias_extends_last_use_and_is_bit_identical():
    model = AliasLate().requires_grad_(False)
    x = torch.randn(2, 16)
    ref = model(x)
    out, (ctx,), (gm,) = compile_capture(model, (x,), {"block_bytes": 1200})
    assert torch.equal(out, ref)
    a_weight = next(p for p in ctx.params if p.fqn == "a.weight")
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    last_matmul = [n for n in gm.graph.nodes if n.op == "output"][0].args[0][0]
    swaps = {n.meta["dlo"]["block"]: n for n in gm.graph.nodes
             if n.meta.get("dlo", {}).get("kind") == "swap_slot"}
    block_of_a = next(b.index for b in ctx.blocks if a_weight in b.params)
    assert a_weight.reason is None  # streamed, not resident
    assert order[swaps[block_of_a]] > order[last_matmul] > order[last_matmul.args[0]]


def test_schedule_nodes_survive_dead_code_elimination_and_carry_meta():
    _, _, (gm,) = compile_capture(*tiny_dit(depth=3))
    kinds = [n.meta["dlo"]["kind"] for n in gm.graph.nodes if "dlo" in n.meta]
    assert {"prefetch", "wait", "swap_slot", "slot_view"} <= set(kinds)
    before = len(gm.graph.nodes)
    gm.graph.eliminate_dead_code()
    assert len(gm.graph.nodes) == before
    wraps = [n for n in gm.graph.nodes if n.meta.get("dlo", {}).get("wrap")]
    assert sorted(n.meta["dlo"]["block"] for n in wraps) == [0, 1]  # the ring: one per slot


def test_debug_switch_logs_graph_around_every_pass(caplog):
    """The graph once as planned (planning changes none) and around every pass."""
    with caplog.at_level(logging.DEBUG, logger="dlo_fx.passes"):
        compile_capture(*tiny_dit(depth=1), {"debug_passes": True})
    text = caplog.text
    assert "graph planned:" in text and " streamed in " in text  # the graph, what was decided
    assert "graph before pass insert_schedule" in text and "graph after pass insert_schedule" in text
    assert "graph before pass identify_params" not in text


def test_failing_pass_names_itself_and_what_ran_before():
    def broken(gm, ctx):
        raise RuntimeError("boom")

    model, inputs = tiny_dit(depth=1)
    store = owner_of(offloaded(model).parameters()).store
    stored = [(n, len(store.blocks)) for n, p in model.named_parameters() if is_stored(p)]
    with pytest.raises(BackendCompilerFailed) as info:
        compile_capture(model, inputs, {"user_passes": (broken,)})
    kind, notes = described(info.value)  # the pass's own error, its notes after its message
    assert kind == "RuntimeError" and "boom" in notes
    ran = ", ".join((*PLANNING, *(p.__name__ for p in PIPELINE)))  # planning, then the schedule
    assert f"in dlo pass 'broken' (passes that ran before it: {ran})" in notes, notes
    # a failed compile leaves the model as it was: the same parameters stored, no new block
    assert [(n, len(store.blocks)) for n, p in model.named_parameters() if is_stored(p)] == stored


def test_planning_is_functions_returning_frozen_values():
    """Each planning stage returns a frozen value and changes no graph; `plan_graph` composes
    them into one frozen plan, the same when planned again from the same inputs."""
    real, calls = backend.plan_graph, []

    def spy(gm, *args):
        before = str(gm.graph)
        plan = real(gm, *args)
        calls.append((before, str(gm.graph), plan, real(gm, *args)))
        return plan

    backend.plan_graph = spy
    try:
        compile_capture(*tiny_dit(depth=2))
    finally:
        backend.plan_graph = real
    (before, after, plan, again), = calls
    assert after == before  # planning changed no node
    for value in (plan, plan.params[0], plan.blocks[0]):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(value, "ran", ())
    assert [(p.fqn, p.first, p.last, p.reason) for p in again.params] == \
        [(p.fqn, p.first, p.last, p.reason) for p in plan.params]
    assert [[p.fqn for p in b.params] for b in again.blocks] == \
        [[p.fqn for p in b.params] for b in plan.blocks]
    assert plan.ran == PLANNING


def test_failing_planning_stage_names_itself_and_what_ran_before(monkeypatch):
    stages = importlib.import_module("dlo_fx.planning.stages")

    def broken(*args):
        raise RuntimeError("boom")

    monkeypatch.setattr(stages, "resident_set", broken)
    with pytest.raises(BackendCompilerFailed) as info:
        compile_capture(*tiny_dit(depth=1))
    kind, notes = described(info.value)
    assert kind == "RuntimeError" and "boom" in notes
    assert ("in dlo planning stage 'resident_set' (stages that ran before it: "
            "identify_params, use_intervals)") in notes, notes


def test_user_pass_sees_schedule_meta():
    seen = []

    def count(gm, plan: GraphPlan):
        seen.extend(n.meta["dlo"]["kind"] for n in gm.graph.nodes if "dlo" in n.meta)
        return gm

    model, inputs = tiny_dit(depth=2)
    ref = call(tiny_dit(depth=2)[0], inputs)
    out, _, _ = compile_capture(model, inputs, {"user_passes": (count,)})
    assert torch.equal(out, ref) and "prefetch" in seen
