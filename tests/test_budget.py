"""The device budget: whole blocks kept resident, planned from the cost model (#17)."""

from __future__ import annotations

import functools
import pickle
import tempfile

import pytest
import torch
from safetensors.torch import save_file

import dlo_fx

from dlo_fx.planning.budget import BudgetPlan, minimum_bytes, plan_resident_blocks, predict_call_s
from dlo_fx.config import DLOConfig
from dlo_fx.apps.dump.blocks_md import blocks_markdown
from dlo_fx.apps.dump.svg import resident_runs
from dlo_fx.runtime.weights.stored import is_stored

import budget_cases
from budget_cases import sweep
from distributed import in_child, spawn
from errors import BackendCompilerFailed
from loader_cases import save_dit
from models import call, offloaded, tiny_dit


def check_sweep(results: dict) -> None:
    for name, r in results.items():
        assert r["equal"], (name, r)
    blocks = results["full"]["blocks"]
    assert results["full"]["resident"] == list(range(blocks))
    assert results["full"]["copies_per_call"] == 0
    # Stored all the same (the model is offloaded before its first graph), read resident
    assert results["full"]["stored"] > 0
    # Room for 3 of the largest blocks: which ones depends on the measured copy and compute
    # times (the planner's choice on hand-made numbers is tested below); what any plan
    # must do is fit, stream fewer blocks and predict no slower a call.
    partial, sizes = results["partial"], results["full"]["block_bytes"]
    assert partial["resident"] and sum(sizes[g] for g in partial["resident"]) <= partial["capacity"]
    assert 0 < partial["copies_per_call"] < blocks
    assert partial["predicted_s"] <= partial["streamed_s"]
    # Compute is estimated from the graph's FLOPs: every block > 0, the DiT layers alike.
    compute, flops = results["full"]["compute_s"], results["full"]["flops"]
    assert len(compute) == blocks and all(c > 0 for c in compute)
    assert len(set(flops[1:-1])) == 1 and flops[1] > max(flops[0], flops[-1])
    if "minimum" in results:
        assert results["minimum"]["resident"] == []
        assert results["minimum"]["copies_per_call"] == blocks


def _checkpoint(tmp_path) -> str:
    model, _ = tiny_dit(depth=budget_cases.DEPTH)
    path = tmp_path / "dit.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return str(path)


@pytest.fixture(scope="module")
def swept():
    return sweep()


def test_budgets_are_bit_exact_fewer_blocks_stream_and_spread(swept, tmp_path):
    check_sweep(swept)
    check_sweep(sweep(checkpoint=_checkpoint(tmp_path), names=("full", "partial")))


def test_planner_spreads_ties_and_follows_the_cost_model():
    n, k = 12, 2
    copy, compute = [1.0] * n, [0.0] * n
    plan = plan_resident_blocks([10] * n, copy, compute, num_slots=k, capacity=30,
                                plan=BudgetPlan(device_budget=0, minimum=0, capacity=30))
    assert len(plan.resident) == 3 and plan.resident != [0, 1, 2]
    assert plan.predicted_s == pytest.approx(n - 3) and plan.streamed_s == pytest.approx(n)
    # Compute-bound blocks: residency saves nothing the copies did not already hide.
    assert predict_call_s([0.1] * n, [1.0] * n, {3, 7}, k) == pytest.approx(
        predict_call_s([0.1] * n, [1.0] * n, (), k), abs=0.11)
    assert minimum_bytes([5, 9, 7], 2, 4) == 22


def test_compute_decides_which_block_stays_resident():
    """Four blocks, two slots, room for one block. Block 2 has the largest copy (3 s):
    transfer-bound (compute 0), keeping it resident saves the most. With 4 s of compute in
    block 0, block 2's copy no longer matters as much as what block 0's compute can hide.

    Steady call (the first ``num_slots`` streamed blocks come from the previous call's
    wrap-around copies, issued once their slot is free for the last time):

    - block 0 resident: blocks 1 and 2 come from the previous call's wrap copies (3 + 1 s,
      done 4 s into this call, hidden by block 0's 4 s of compute), then block 3 copies
      once slot 0 is free (at 4 s) for 1 s: 5 s.
    - block 2 resident: the wrap copies of blocks 1 and 0 (1 s each) queue behind block
      3's copy, which ends the previous call: block 0 is ready 2 s into the call, computes
      until 6 s, and block 3's copy waits for its slot until then: 7 s.
    """
    copy, bytes_ = [1.0, 1.0, 3.0, 1.0], [10] * 4
    idle, busy = [0.0] * 4, [4.0, 0.0, 0.0, 0.0]
    assert predict_call_s(copy, idle, {2}, 2) == 3.0  # the three other copies
    assert predict_call_s(copy, idle, {0}, 2) == 5.0
    assert predict_call_s(copy, busy, {0}, 2) == 5.0
    assert predict_call_s(copy, busy, {2}, 2) == 7.0
    assert predict_call_s(copy, busy, (), 2) == 9.0
    # The first call copies from t=0 (no wrap-around copies yet): block 0 resident, block
    # 3's copy waits for block 1's slot, which block 0's compute keeps busy until 4 s.
    assert predict_call_s(copy, busy, {0}, 2, steady=False) == 5.0
    # no copy lane of its own: the compute and every streamed copy in turn
    assert predict_call_s(copy, busy, {0}, 2, overlap=False) == 4.0 + 5.0
    assert predict_call_s(copy, busy, {0, 1}, 2, overlap=False) == 4.0  # all in their slots

    def plan(compute):
        return plan_resident_blocks(bytes_, copy, compute, num_slots=2, capacity=10,
                                    plan=BudgetPlan(device_budget=0, minimum=0, capacity=10))

    transfer_bound, measured = plan(idle), plan(busy)
    assert (transfer_bound.resident, transfer_bound.predicted_s) == ([2], 3.0)
    assert (measured.resident, measured.predicted_s, measured.streamed_s) == ([0], 5.0, 9.0)
    assert "predicted 9000.000 -> 5000.000 ms per call" in measured.reasons[0]
    # Every block resident: no copy, the call is its compute.
    assert predict_call_s(copy, busy, {0, 1, 2, 3}, 2) == 4.0
    # Two streamed blocks or fewer stay in their slots after the first call: no copy.
    assert predict_call_s(copy, busy, {0, 1}, 2) == 4.0


def test_a_block_that_lengthens_the_call_is_not_kept():
    """Only block 0 fits. Keeping it resident makes block 2 (a 3 s copy) one of the first
    two streamed blocks, whose wrap-around copy nothing hides: the greedy choice is
    dropped and nothing is kept."""
    copy, compute = [1.0, 1.0, 3.0, 1.0], [0.0, 5.0, 0.0, 0.0]
    assert predict_call_s(copy, compute, (), 2) == 8.0
    assert predict_call_s(copy, compute, {0}, 2) == 10.0
    plan = plan_resident_blocks([10, 20, 30, 20], copy, compute, num_slots=2, capacity=10,
                                plan=BudgetPlan(device_budget=0, minimum=0, capacity=10))
    assert plan.resident == [] and plan.predicted_s == plan.streamed_s == 8.0


def test_budget_below_minimum_raises_before_storing():
    """A ValueError of its own (not Dynamo's BackendCompilerFailed around it): ``except
    ValueError`` catches it, its message comes first, and it pickles as a ValueError."""
    ref_model, inputs = tiny_dit(depth=1)  # refused before any schedule: one layer traces faster
    with torch.no_grad():
        want = call(ref_model, inputs)
    for given_again in (False, True):  # inherited, or given to torch.compile too
        torch._dynamo.reset()
        model, _ = tiny_dit(depth=1)
        dlo_fx.offload(model, {"device": "cpu", "device_budget": 1000})
        offloaded = True
        compiled = torch.compile(model, backend="dlo", fullgraph=True,
                                 options={"device_budget": 1000} if given_again else None)
        with pytest.raises(ValueError) as info, torch.no_grad():
            call(compiled, inputs)
        exc = info.value
        assert not isinstance(exc, BackendCompilerFailed) and type(exc).__name__ == "ValueError"
        assert str(exc).startswith("dlo option device_budget=1000 (1,000 B) is below the "
                                   "minimum of"), str(exc)
        assert "num_slots=2 slots of its largest block" in str(exc)
        assert "report" not in str(exc).lower()  # no "please report a bug to PyTorch"
        again = pickle.loads(pickle.dumps(exc))
        assert type(again) is ValueError and str(again) == str(exc)
        assert any(is_stored(p) for p in model.parameters()) == offloaded
        with torch.no_grad():
            assert torch.equal(call(model, inputs), want)


def test_device_memory_below_the_slots_is_refused_naming_both_figures():
    """A declared capacity that cannot hold the slots planned and ran without a word (every
    block streamed, on a device that could not hold them); now a ValueError naming
    device_memory and the bytes the slots need, before the first call changes anything."""
    ref_model, inputs = tiny_dit(depth=1)
    with torch.no_grad():
        want = call(ref_model, inputs)
    model, _ = tiny_dit(depth=1)
    dlo_fx.offload(model, {"device": "cpu", "device_memory": 1000})
    with pytest.raises(ValueError) as info, torch.no_grad():
        call(torch.compile(model, backend="dlo", fullgraph=True), inputs)
    message = str(info.value)
    assert message.startswith("dlo option device_memory=1000 (1,000 B) is below the "), message
    assert "num_slots=2 slots of its largest block" in message and "B of slots)" in message
    assert "device_memory >= " in message
    dlo_fx.release(model)
    torch._dynamo.reset()  # what the message advises: a capacity that holds the slots
    dlo_fx.offload(model, {"device": "cpu", "device_memory": 1 << 40})
    with torch.no_grad():
        assert torch.equal(call(torch.compile(model, backend="dlo", fullgraph=True), inputs),
                           want)


def test_memory_report_and_blocks_md_show_the_resident_blocks(swept):
    r, sizes = swept["partial"], swept["full"]["block_bytes"]
    report = r["report"]
    assert report.num_resident_blocks == len(r["resident"])
    assert report.streamed_bytes_per_call == sum(sizes) - sum(sizes[g] for g in r["resident"])
    assert report.predicted_s_per_call > 0 and report.measured_s_per_call > 0
    plan = r["plan"]
    assert report.predicted_copy_s_per_call == pytest.approx(
        sum(plan.copy_s[g] for g in range(len(sizes)) if g not in r["resident"]))
    assert report.predicted_compute_s_per_call == pytest.approx(sum(plan.compute_s))
    # Blocks compute one after the other; copies overlap them.
    assert 0 < report.predicted_compute_s_per_call <= report.predicted_s_per_call * (1 + 1e-9)
    assert "num_resident_blocks" in str(report) and "s_per_call" in str(report)
    assert f"(copies {report.predicted_copy_s_per_call * 1e3:.3f} ms, compute" in str(report)
    from dlo_fx.apps.dump.record import GraphDump

    dump = GraphDump(index=0, folder=None, mode="rank_local", dp=1, rank=0, num_slots=2,
                     budget=0, blocks=(), resident=(), program=(), budget_plan=plan)
    text = blocks_markdown(dump)
    assert "## Resident blocks (device_budget)" in text
    for g in r["resident"]:
        assert f"| {g} | {plan.labels[g]} |" in text
    assert text.count("device_budget: predicted") == len(r["resident"])


def test_device_budget_options_are_validated():
    assert DLOConfig(device_budget="auto", activation_reserve_bytes=0).device_budget == "auto"
    for bad in ({"device_budget": -1}, {"device_budget": "lots"}, {"device_budget": 1.5},
                {"device_budget": None, "activation_reserve_bytes": 10}, {"device_budget": "auto",
                                                   "activation_reserve_bytes": -1}):
        with pytest.raises(ValueError, match="device_budget|activation_reserve_bytes"):
            DLOConfig.from_options(bad)


def test_auto_on_cpu_streams_every_block():
    from dlo_fx.dynamo.probes import resolve_budget

    assert resolve_budget(DLOConfig(device_budget="auto"), None).device_budget is None
    assert resolve_budget(DLOConfig(device_budget=7), None).device_budget == 7


def _two_ranks():
    with tempfile.TemporaryDirectory() as folder:
        path, _ = spawn(1, in_child, functools.partial(save_dit, depth=budget_cases.DEPTH),
                         folder)[0]
        return spawn(2, budget_cases.budget_cases, path, timeout=480)


@pytest.mark.spawned.with_args(_two_ranks)
def test_two_ranks_both_modes_and_loaded(spawned):
    results = spawned
    for rank in (0, 1):
        for key in ("allgather", "rank_local", "loaded"):
            check_sweep(results[rank][key])
        assert results[rank]["allgather"]["partial"]["mode"] == "allgather"
        assert results[rank]["rank_local"]["partial"]["mode"] == "rank_local"
        shapes = results[rank]["one_rank_resolutions"]
        assert shapes["equal"] == [True] * 5, (rank, shapes)
        assert shapes["resident"][0] and all(r == shapes["resident"][0]
                                             for r in shapes["resident"]), (rank, shapes)
    assert results[0] == results[1]


def test_timeline_and_blocks_md_show_resident_blocks(swept, tmp_path):
    """The dump of a budgeted graph: each resident block computes in bars of its own on
    the compute lane (``R<n>``) with a marker on the copy lane, and is never copied."""
    import xml.etree.ElementTree as ET

    from dump_cases import SVG, dump_model, svg_bars

    full = swept["full"]
    budget = full["minimum"] + 3 * max(full["block_bytes"])
    budget_cases.fresh()
    model, inputs = tiny_dit(depth=budget_cases.DEPTH)
    _, (folder,) = dump_model(model, inputs, tmp_path, {"device_budget": budget})
    plan = budget_cases.plan_of(model)
    assert plan.resident
    root = ET.parse(folder / "timeline.svg").getroot()
    resident_bars = [r for r in root.iter(f"{SVG}rect") if r.get("class") == "resident-block"]
    assert {int(r.get("data-resident-block")) for r in resident_bars} == set(plan.resident)
    assert {r.get("data-lane") for r in resident_bars} == {"compute"}
    markers = [p for p in root.iter(f"{SVG}path") if p.get("class") == "resident-marker"]
    assert sorted(int(p.get("data-resident-block")) for p in markers) == plan.resident
    title = root.find(f"{SVG}title").text
    assert (f"device_budget keeps {len(plan.resident)} of {len(plan.block_bytes)} blocks "
            "resident (never copied): " + resident_runs(plan.resident)) in title
    assert (f"{len(plan.block_bytes) - len(plan.resident)} streamed blocks, "
            f"{len(plan.resident)} resident") in title
    # Only the streamed blocks are copied: one H2D bar per graph block, none for the rest.
    bars = svg_bars(folder / "timeline.svg")
    streamed = len(plan.block_bytes) - len(plan.resident)
    assert bars["bar"]["h2d"] == set(range(streamed))
    text = (folder / "blocks.md").read_text()
    assert "| block | FQNs | bytes | copy ms (saved) | compute ms | why |" in text
    assert "compute " in text and "GFLOP of matmuls" in text
    for g in plan.resident:
        assert (f"| {g} | {plan.labels[g]} | {plan.block_bytes[g]:,} | "
                f"{plan.copy_s[g] * 1e3:.3f} | {plan.compute_s[g] * 1e3:.3f} |") in text


def test_second_resolution_keeps_no_more_resident_than_its_budget_allows(monkeypatch):
    """The first resolution's graph keeps blocks resident under the budget; the second
    resolution's graph (planned anew from its own FLOPs, with the first one's resident
    copies counted against the budget) keeps none more, and both are exact."""
    import importlib

    from dlo_fx.apps.models import example_inputs
    from dlo_fx.runtime import probes

    resident_set = importlib.import_module("dlo_fx.planning.stages.resident_set")

    monkeypatch.setattr(resident_set, "probed_flops", lambda runtime, dtype: 1e10)
    monkeypatch.setattr(probes, "probe_bandwidths", lambda device, group, nbytes=0: (1.0, 1e9))
    torch._dynamo.reset()
    ref, _ = tiny_dit()
    model = offloaded(tiny_dit()[0], {"device_budget": 600_000})
    compiled = torch.compile(model, backend="dlo")
    small, large = (example_inputs(model.config, batch=1, height=h, width=h, seed=1)
                    for h in (4, 32))
    from dlo_fx.runtime.weights.owners import runtimes_holding

    kept = []
    with torch.no_grad():
        for inputs in (small, large, small, large):
            assert torch.equal(call(compiled, inputs), call(ref, inputs))
            runtime = runtimes_holding(list(model.parameters()))[0]
            kept.append([plan.resident for plan in runtime.budget_plans.values()])
    assert kept[0] != [[]]  # the small graph keeps blocks resident: the large one's plan
    assert kept[1:] == [kept[0]] * 3  # shares their resident copies and adds none
