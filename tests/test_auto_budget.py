"""device_budget="auto" planned from measured memory (#54): the arithmetic, the planner's
choices at declared capacities, the re-plan before a 4x larger input, the out-of-memory
fall-back and the reports. CPU and the meta device, with ``device_memory`` declared and the
activation peak given by ``runtime.activation_peak_of`` (no device peak to measure here)."""

from __future__ import annotations

import importlib

import pytest
import torch

import dlo_fx
from dlo_fx import DLOConfig, DeviceMemoryError
from dlo_fx.apps.dump.blocks_md import blocks_markdown
from dlo_fx.apps.models import example_inputs
from dlo_fx.planning.budget import predict_call_s
from dlo_fx.planning.device_memory import (GIB, ActivationPeaks, DeviceMemory, margin_bytes,
                                           replan, weights_budget)
from dlo_fx.runtime import probes
from dlo_fx.runtime.device import platform
from dlo_fx.runtime.weights.owners import reset_runtimes, runtimes_holding

from models import call, tiny_dit, tiny_wan

resident_set = importlib.import_module("dlo_fx.planning.stages.resident_set")


@pytest.fixture(autouse=True)
def fixed_figures(monkeypatch):
    """Fixed bandwidth and matmul rate: the planner's choices do not depend on the load of
    the machine, and no probe runs (a transfer-bound device: 1 GB/s, 10 GFLOP/s)."""
    monkeypatch.setattr(probes, "probe_bandwidths", lambda device, group, nbytes=0: (1.0, 1e9))
    monkeypatch.setattr(probes, "probe_matmul_flops", lambda device, dtype, group: 1e10)
    monkeypatch.setattr(resident_set, "probed_flops", lambda runtime, dtype: 1e10)
    torch._dynamo.reset()
    reset_runtimes()
    yield
    torch._dynamo.reset()


def runtime_of(model):
    return runtimes_holding(list(model.parameters()))[0]


def the_plan(model):
    (plan,) = runtime_of(model).budget_plans.values()
    return plan


def elements(inputs) -> int:
    values = inputs.values() if isinstance(inputs, dict) else inputs
    return sum(v.numel() for v in values if isinstance(v, torch.Tensor))


# -- options and arithmetic -----------------------------------------------------------------
def test_auto_is_the_default_and_device_memory_is_validated():
    assert DLOConfig().device_budget == "auto" and DLOConfig().device_memory is None
    assert DLOConfig(device_memory=2 * GIB).device_memory == 2 * GIB
    assert DLOConfig(device_budget=None).device_budget is None  # every block streams
    for bad, named in (({"device_memory": 0}, "'device_memory'=0"),
                       ({"device_memory": 1.5}, "'device_memory'=1.5"),
                       ({"device_budget": None, "device_memory": GIB}, "applies only with"),
                       ({"device_budget": 10**9, "device_memory": GIB}, "applies only with"),
                       ({"device_budget": 10**9, "activation_reserve_bytes": 1},
                        "applies only with")):
        with pytest.raises(ValueError) as info:
            DLOConfig.from_options(bad)
        assert named in str(info.value) and next(iter(bad.keys() - {"device_budget"})) in str(
            info.value)


def test_auto_without_a_declared_capacity_streams_every_block_on_cpu_and_meta():
    from dlo_fx.dynamo.probes import resolve_budget

    for device in ("cpu", "meta"):
        model, inputs = tiny_dit(depth=2)
        dlo_fx.offload(model, options={"device": device})
        budget = resolve_budget(DLOConfig(device=device), runtime_of(model))
        assert (budget.device_budget, budget.auto_capacity) == (None, None)


def test_settle_budget_and_mode_read_a_frozen_store_view_only():
    """`planning.settle` decides from a `StoreView` and figures it is given: no runtime."""
    from dlo_fx.planning.settle import settle_budget, settle_mode
    from dlo_fx.planning.view import StoreView

    def view(**kw):
        return StoreView(**{"device": torch.device("cuda"), "mode": None, "dp": 1,
                            "num_slots": 2, "params": {}, "slot_bytes": GIB,
                            "auto_resident_bytes": GIB, "free_bytes": 6 * GIB, **kw})

    auto = DLOConfig(device_budget="auto")
    assert settle_budget(auto, view()).auto_capacity == 8 * GIB  # free + slots + resident
    assert settle_budget(auto, view()).device_budget is None
    gathered = settle_budget(auto, view(dp=2))  # planned per call, agreed (auto_budget.py)
    assert (gathered.device_budget, gathered.auto_capacity) == (None, 8 * GIB)
    assert settle_budget(auto, view(dp=2, mode="rank_local")).auto_capacity == 8 * GIB
    declared = DLOConfig(device_budget="auto", device_memory=4 * GIB)
    assert settle_budget(declared, view(free_bytes=None)).auto_capacity == 4 * GIB
    assert settle_budget(auto, view(free_bytes=None)).auto_capacity is None
    assert settle_budget(DLOConfig(device_budget=7), None).device_budget == 7

    def never():
        raise AssertionError("a settled mode measures nothing")

    assert settle_mode(view(mode="allgather", dp=2), [GIB], never) is None
    assert settle_mode(view(), [GIB], never)[0] == "rank_local"  # one rank: nothing to gather


def test_margin_budget_prediction_and_oom_floor():
    assert margin_bytes(0) == GIB and margin_bytes(20 * GIB) == 2 * GIB
    assert margin_bytes(10 * GIB + 1) == GIB + 1  # 10%, rounded up
    assert weights_budget(10 * GIB, 2 * GIB, GIB) == 6 * GIB
    assert weights_budget(GIB, GIB) == 0  # never below 0
    peaks = ActivationPeaks()
    assert peaks.predict(("a",), 100) is None
    peaks.record(("a",), 100, 1000)
    peaks.record(("b",), 10, 7)
    assert peaks.predict(("a",), 100) == (1000, "measured")
    peak, how = peaks.predict(("c",), 401)  # per element from the largest shape, rounded up
    assert peak == 4010 and "per element from 100 elements" in how
    memory = DeviceMemory(capacity=4 * GIB)
    assert memory.budget_for(("a",), 100) is None  # nothing measured: stream every block
    memory.peaks = peaks
    found = memory.budget_for(("a",), 100, other_resident=GIB)
    assert found.weights == 4 * GIB - 1000 - GIB - GIB and found.peak_source == "measured"
    assert memory.after_oom(found.weights, 1000, "oom") == found.weights - 1000
    assert memory.budget_for(("c",), 1).weights == found.weights - 1000  # the floor caps it
    memory.after_oom(10 * GIB, 0, "oom")  # a floor never rises
    assert memory.floor == found.weights - 1000 and memory.ooms == ["oom", "oom"]
    reserved = DeviceMemory(capacity=4 * GIB, reserve=GIB)  # activation_reserve_bytes
    assert reserved.budget_for(("z",), 5).weights == 2 * GIB


# -- the planner's choices at three capacities, against the simulator -------------------------
def _on_meta(inputs):
    if isinstance(inputs, dict):
        return {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    return tuple(v.to("meta") for v in inputs)


def _zoo(name: str):
    from zoo_models import build, by_name

    return lambda: build(by_name(name))


@pytest.mark.parametrize("factory", [tiny_dit, _zoo("DiT"), tiny_wan],
                         ids=["reference", "diffusers-DiT", "diffusers-Wan"])
def test_planner_choices_at_three_capacities_match_the_simulator(factory):
    """On the meta device with a declared capacity: the first call streams every block and
    measures, the second runs the plan; then the same planner at three capacities (below
    one resident block, a few blocks, the whole model): every choice fits, is the
    simulator's prediction for its resident set, and more room never predicts slower."""
    model, inputs = factory()
    peak = 64 * elements(inputs)
    dlo_fx.offload(model, options={"device": "meta", "device_memory": 64 * GIB})
    runtime = runtime_of(model)
    runtime.activation_peak_of = lambda key: peak
    compiled = torch.compile(model, backend="dlo")
    meta = _on_meta(inputs)
    with torch.no_grad():
        first = call(compiled, meta)
        assert the_plan(model).resident == []  # nothing measured yet: every block streams
        second = call(compiled, meta)
    assert first.device.type == second.device.type == "meta"
    (memory,) = runtime.device_memory.values()
    # the call's tensor inputs: the model's inputs and its buffers, lifted by Dynamo
    ((counted, measured),) = memory.peaks.measured.values()
    assert measured == peak and counted >= elements(inputs)
    plan = the_plan(model)
    n = len(plan.block_bytes)
    assert plan.resident == list(range(n))  # 64 GiB: the whole model stays resident
    assert plan.device_budget == weights_budget(64 * GIB, peak)
    base = replan(plan, 0, 2)
    chosen = []
    for weights in (plan.minimum + min(plan.block_bytes) - 1,  # below one resident block
                    plan.minimum + sum(plan.block_bytes) // 2,  # half the blocks' bytes
                    plan.minimum + sum(plan.block_bytes)):  # the whole model
        declared = DeviceMemory(capacity=weights + peak + margin_bytes(peak),
                                peaks=memory.peaks)
        found = declared.budget_for(next(iter(memory.peaks.measured)), counted)
        assert found.weights == weights
        chosen.append(replan(base, found.weights, 2, found.lines()))
    assert chosen[0].resident == [] and chosen[-1].resident == list(range(n))
    assert 0 < chosen[1].resident_bytes <= sum(plan.block_bytes) // 2
    assert len(chosen[1].resident) < n
    for c in chosen:
        assert c.resident_bytes <= max(c.device_budget - c.minimum, 0)
        assert c.predicted_s == pytest.approx(
            predict_call_s(c.copy_s, c.compute_s, c.resident, 2))
        assert c.streamed_s == pytest.approx(predict_call_s(c.copy_s, c.compute_s, (), 2))
    times = [c.predicted_s for c in chosen]
    assert times[0] >= times[1] >= times[2] and times[2] < times[0]
    assert times[2] == pytest.approx(sum(plan.compute_s))  # nothing copied


# -- exact calls: two calls, a 4x larger input, an injected out-of-memory error --------------
def _offloaded_dit(device_memory: int):
    ref, inputs = tiny_dit(depth=6)
    model, _ = tiny_dit(depth=6)
    dlo_fx.offload(model, options={"device": "cpu", "device_memory": device_memory})
    return ref, model, inputs


def _probed_plan():
    """(minimum, block sizes, the probe's inputs) of the offloaded tiny DiT's plan on a
    device with room to spare: what the tests size their declared capacities from."""
    _, probe_model, own = _offloaded_dit(GIB + 10**9)
    with torch.no_grad():
        call(torch.compile(probe_model, backend="dlo"), own)
    plan = the_plan(probe_model)
    torch._dynamo.reset()
    reset_runtimes()
    return plan.minimum, plan.block_bytes, own


def _planned_dit(blocks: int, peak: int = 0, before_compile=None):
    """The offloaded tiny DiT on a device with room for ``blocks`` of its largest block
    above the minimum (plus ``peak`` bytes of activations, which ``activation_peak_of``
    gives where nonzero), compiled and called twice, exact both times, some blocks
    resident: (model, compiled, inputs, the resident output, the plan of those calls)."""
    minimum, sizes, inputs = _probed_plan()
    ref, model, _ = _offloaded_dit(GIB + peak + minimum + blocks * max(sizes))
    if peak:
        runtime_of(model).activation_peak_of = lambda key: peak
    if before_compile is not None:
        before_compile(model)
    compiled = torch.compile(model, backend="dlo")
    with torch.no_grad():
        want = call(ref, inputs)
        for _ in range(2):
            assert torch.equal(call(compiled, inputs), want)
    plan = the_plan(model)
    assert plan.resident
    return model, compiled, inputs, want, plan


def test_a_4x_larger_input_replans_before_it_runs_and_is_exact():
    """A device that holds the weights at the small size but not at 4x its pixels: the
    large call is planned from the small call's peak, per element, before it runs, keeps
    fewer blocks resident, fits, and returns the resident model's output exactly."""
    minimum, sizes, small = _probed_plan()
    large = example_inputs(tiny_dit(depth=6)[0].config, batch=2, height=16, width=16, seed=2)
    per_element = 3 * max(sizes) // (elements(large) - elements(small)) + 1
    capacity = GIB + per_element * elements(large) + minimum + 2 * max(sizes)
    ref, model, _ = _offloaded_dit(capacity)
    runtime = runtime_of(model)
    runtime.activation_peak_of = lambda key: per_element * sum(  # ints: symbolic sizes
        torch.Size(k[0]).numel() for k in key if isinstance(k, tuple))
    compiled = torch.compile(model, backend="dlo")
    fits = []
    with torch.no_grad():
        for inputs in (small, small, large, large, small):
            out = call(compiled, inputs)
            assert torch.equal(out, call(ref, inputs))
            plan = runtime.budget_plans[next(iter(runtime.budget_plans))]
            peak = per_element * elements(inputs)
            fits.append((len(plan.resident), plan.resident_bytes + minimum + peak
                         + margin_bytes(peak) <= capacity))
    assert all(ok for _, ok in fits), fits
    counts = [k for k, _ in fits]
    assert counts[0] == 0 and counts[1] > counts[2] > 0  # re-planned before the large call
    assert counts[2] == counts[3] and counts[4] == counts[1]  # each shape reuses its variant
    (memory,) = runtime.device_memory.values()
    assert len(memory.peaks.measured) == 2


class InjectedOutOfMemory:
    """``runtime.reads.resident_tensor`` (every resident read of the runtime goes through
    it) that raises ``torch.OutOfMemoryError`` once: a resident block's device copy that
    does not fit."""

    def __init__(self, runtime):
        self.runtime, self.real, self.raised = runtime, runtime.reads.resident_tensor, 0
        runtime.reads.resident_tensor = self

    def __call__(self, param, clock=False):
        if not self.raised:
            self.raised += 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return self.real(param, clock)


def test_out_of_memory_moves_blocks_back_and_the_next_call_is_exact():
    minimum, sizes, inputs = _probed_plan()
    ref, model, _ = _offloaded_dit(GIB + 1000 + minimum + 3 * max(sizes))
    runtime = runtime_of(model)
    runtime.activation_peak_of = lambda key: 1000
    compiled = torch.compile(model, backend="dlo")
    with torch.no_grad():
        want = call(ref, inputs)
        assert torch.equal(call(compiled, inputs), want)
        assert torch.equal(call(compiled, inputs), want)
        plan = the_plan(model)
        resident, copies = list(plan.resident), runtime.reads.resident_copy_bytes
        assert resident and copies >= plan.resident_bytes
        InjectedOutOfMemory(runtime)
        with pytest.raises(DeviceMemoryError) as info:
            call(compiled, inputs)
        error = info.value
        assert isinstance(error, torch.OutOfMemoryError)
        assert isinstance(error.__cause__, torch.OutOfMemoryError)
        assert error.moved_blocks == resident and error.moved_bytes == plan.resident_bytes
        message = str(error)
        assert "ran out of device memory" in message and "back to streaming" in message
        assert f"{plan.resident_bytes:,} B" in message and "exactly" in message
        assert plan.labels[resident[0]] in message
        assert runtime.reads.resident_copy_bytes == copies - plan.resident_bytes  # copies dropped
        for _ in range(2):  # no retry happened; the next calls fit and are exact
            assert torch.equal(call(compiled, inputs), want)
        (memory,) = runtime.device_memory.values()
        assert memory.floor == plan.device_budget - plan.resident_bytes
        after = the_plan(model)  # never again more than what failed minus what moved
        assert after.device_budget <= memory.floor
        assert after.minimum + after.resident_bytes <= memory.floor
    report = dlo_fx.memory_report(model)
    assert any("out of memory with" in line for line in report.budget_lines)


def test_out_of_memory_under_a_budget_planned_once_says_what_stays_resident():
    """An explicit device_budget is planned once, at the compile: a call that runs out of
    device memory raises `DeviceMemoryError`
    naming the resident blocks and the way out; nothing changes, and the next calls run
    the same plan exactly."""
    ref, inputs = tiny_dit(depth=6)
    model, _ = tiny_dit(depth=6)
    dlo_fx.offload(model, options={"device": "cpu", "device_budget": 10**9})
    compiled = torch.compile(model, backend="dlo")
    with torch.no_grad():
        want = call(ref, inputs)
        assert torch.equal(call(compiled, inputs), want)
        plan = the_plan(model)
        assert plan.resident
        InjectedOutOfMemory(runtime_of(model))
        with pytest.raises(DeviceMemoryError) as info:
            call(compiled, inputs)
        error = info.value
        assert isinstance(error.__cause__, torch.OutOfMemoryError)
        assert error.moved_blocks == [] and error.moved_bytes == 0
        message = str(error)
        assert f"{len(plan.resident)} blocks resident" in message
        assert f"{plan.resident_bytes:,} B" in message and plan.labels[plan.resident[0]] in message
        assert "device_budget=1000000000" in message and "dlo changed nothing" in message
        for _ in range(2):
            assert torch.equal(call(compiled, inputs), want)
    assert the_plan(model).resident == plan.resident


class FakeAllocator:
    """The allocator's counters of a simulated device, read by `platform` (the CPU has
    none): what a pipeline's VAE decode between two calls of the transformer does to them,
    as ``other_work`` (a new peak) or ``failed_allocation`` (an out-of-memory error raised
    to the pipeline)."""

    def __init__(self, monkeypatch):
        self.allocated, self.peak, self.ooms = 0, 0, 0
        monkeypatch.setattr(platform, "memory_allocated", lambda device: self.allocated)
        monkeypatch.setattr(platform, "max_memory_allocated", lambda device: self.peak)
        monkeypatch.setattr(platform, "reset_peak_memory",
                            lambda device: setattr(self, "peak", self.allocated))
        monkeypatch.setattr(platform, "oom_count", lambda device: self.ooms)

    def other_work(self, nbytes: int) -> None:
        self.peak = max(self.peak, self.allocated + nbytes)

    def failed_allocation(self) -> None:
        self.ooms += 1


def test_work_between_calls_enters_the_next_plan(monkeypatch):
    """A VAE decode between two calls needs two blocks' worth of memory while the
    transformer's resident blocks stay: the next call keeps fewer resident, says why, and
    is exact."""
    fake = FakeAllocator(monkeypatch)
    minimum, sizes, inputs = _probed_plan()
    capacity = GIB + minimum + 3 * max(sizes)
    ref, model, _ = _offloaded_dit(capacity)
    compiled = torch.compile(model, backend="dlo")
    with torch.no_grad():
        want = call(ref, inputs)
        for _ in range(2):
            assert torch.equal(call(compiled, inputs), want)
        before = the_plan(model)
        fake.other_work(2 * max(sizes))
        for _ in range(2):
            assert torch.equal(call(compiled, inputs), want)
    after = the_plan(model)
    assert before.device_budget == capacity - GIB  # nothing measured: activations 0
    assert after.device_budget == capacity - GIB - 2 * max(sizes)
    assert after.minimum + after.resident_bytes <= after.device_budget
    assert after.resident_bytes < before.resident_bytes, (before.resident, after.resident)
    (memory,) = runtime_of(model).device_memory.values()
    assert memory.between == 2 * max(sizes)
    assert "the work between two calls" in after.budget_lines[0]


def test_out_of_memory_between_calls_moves_blocks_back_with_a_warning(monkeypatch):
    """An allocation that failed between two calls (raised to the pipeline, not to dlo):
    the next call streams the blocks that were resident, warns naming what it did, stays
    under the OOM floor and is exact."""
    fake = FakeAllocator(monkeypatch)
    model, compiled, inputs, want, plan = _planned_dit(3)
    runtime = runtime_of(model)
    with torch.no_grad():
        fake.failed_allocation()
        with pytest.warns(RuntimeWarning, match=rf"out-of-memory between two calls.*"
                                                rf"{len(plan.resident)} of its blocks "
                                                r"resident.*back to streaming"):
            assert torch.equal(call(compiled, inputs), want)
        assert torch.equal(call(compiled, inputs), want)
    (memory,) = runtime.device_memory.values()
    assert memory.floor == plan.device_budget - plan.resident_bytes
    assert the_plan(model).minimum + the_plan(model).resident_bytes <= memory.floor
    assert any("between two calls" in line for line in dlo_fx.memory_report(model).budget_lines)


def test_a_pipelines_first_run_streams_every_block_and_its_decode_enters_the_plan(
        monkeypatch):
    """compile_pipeline under the auto budget: the first run (four transformer calls, then
    the VAE decode) keeps every block streamed, so the decode never meets resident blocks;
    the next run plans them within what the decode used, and both runs are exact."""
    pytest.importorskip("diffusers")
    from diffusers_pipelines import call_kwargs, flux

    fake = FakeAllocator(monkeypatch)
    decode = 64 << 20  # what the simulated VAE decode allocates above the resident weights
    capacity = GIB + 10**9  # room for every block
    with torch.no_grad():
        want = flux(seed=0)(**call_kwargs("flux")).images
    pipe = flux(seed=0)
    dlo_fx.compile_pipeline(pipe, options={"device": "cpu", "device_memory": capacity})
    held = []
    pipe.vae.decoder.register_forward_pre_hook(
        lambda module, args: (fake.other_work(decode), held.append(
            [bool(the_plan(pipe.transformer).resident), runtime_of(pipe.transformer)
             .hold_resident is not None, "every block streams until FluxPipeline's first "
             "run ends" in " ".join(dlo_fx.memory_report(pipe.transformer).budget_lines)]))[0])
    runtime = runtime_of(pipe.transformer)
    assert runtime.hold_resident == "FluxPipeline's first run"
    for run in range(2):
        with torch.no_grad():
            assert torch.equal(pipe(**call_kwargs("flux")).images, want), run
    assert held == [[False, True, True], [True, False, False]]  # first decode: none resident
    plan = the_plan(pipe.transformer)
    (memory,) = runtime.device_memory.values()
    others = sum(b for (token, _), b in runtime.shared.auto_resident.items()
                 if token != runtime.token)  # the text encoders' resident blocks
    assert memory.between == decode and "the work between two calls" in plan.budget_lines[0]
    assert plan.device_budget == capacity - GIB - decode - others
    assert plan.resident and "maybe_free_model_hooks" not in vars(pipe)
    # compiled again after release: held again; release removes the signal
    dlo_fx.release(pipe)
    dlo_fx.compile_pipeline(pipe, options={"device": "cpu", "device_memory": capacity})
    assert runtime_of(pipe.transformer).hold_resident is not None
    assert "maybe_free_model_hooks" in vars(pipe)
    dlo_fx.release(pipe)
    assert "maybe_free_model_hooks" not in vars(pipe)


def test_graph_breaks_plan_each_graph_within_what_the_others_keep():
    """A graph break in every block: the block graphs Dynamo reuses for every layer are
    planned for each layer's parameters on their own, each budget leaves out what the
    others keep resident, the resident copies stay within the plans, and every call is
    exact."""
    ref, inputs = tiny_dit(depth=4, graph_break=True)
    model, _ = tiny_dit(depth=4, graph_break=True)
    dlo_fx.offload(model, options={"device": "cpu", "device_memory": GIB + 500_000})
    runtime = runtime_of(model)
    runtime.activation_peak_of = lambda key: 1000
    compiled = torch.compile(model, backend="dlo")
    with torch.no_grad():
        want = call(ref, inputs)
        for _ in range(3):
            assert torch.equal(call(compiled, inputs), want)
    held = {key: nbytes for (_, key), nbytes in runtime.shared.auto_resident.items()}
    # two graphs per layer (the graph break), each layer's planned: those that fit stay
    assert len(held) == 8 and sum(nbytes > 0 for nbytes in held.values()) >= 4
    assert runtime.reads.resident_copy_bytes <= sum(held.values()) + 1024
    for key, nbytes in held.items():
        plan = runtime.budget_plans[key]
        assert plan.resident_bytes == nbytes
        others = sum(b for k, b in held.items() if k != key)
        assert plan.minimum + plan.resident_bytes <= plan.device_budget
        assert plan.device_budget <= GIB + 500_000 - 1000 - GIB - others


def test_two_models_on_one_device_leave_each_other_out():
    """Two models streamed into the same slots (a pipeline's components): the second's
    budget leaves out what the first keeps resident, and both are exact."""
    capacity = GIB + 1000 + 1_500_000
    (ref_a, model_a, inputs), (ref_b, model_b, _) = (_offloaded_dit(capacity)
                                                     for _ in range(2))
    for model in (model_a, model_b):
        runtime_of(model).activation_peak_of = lambda key: 1000
    a, b = (torch.compile(m, backend="dlo") for m in (model_a, model_b))
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(call(a, inputs), call(ref_a, inputs))
        kept_a = the_plan(model_a).resident_bytes
        for _ in range(2):
            assert torch.equal(call(b, inputs), call(ref_b, inputs))
    assert runtime_of(model_a).shared is runtime_of(model_b).shared
    plan_b = the_plan(model_b)
    assert kept_a > 0 and plan_b.device_budget == capacity - 1000 - GIB - kept_a
    assert f"{kept_a:,} B resident for the other graphs on the device" in plan_b.budget_lines[0]


def test_replanned_variants_compile_with_inductor():
    """compiler="inductor": each variant's compute pieces are compiled at its first call
    (from the graph's fake example inputs); the re-planned calls agree with the resident
    model as Inductor does (`assert_inductor_close`) and are exact among themselves. (The
    compiler was given to offload once, where the compile dropped it: the test ran eager.)"""
    from inductor_cases import assert_inductor_close

    ref, inputs = tiny_dit(depth=2)
    model, _ = tiny_dit(depth=2)
    dlo_fx.offload(model, options={"device": "cpu", "device_memory": GIB + 400_000})
    runtime_of(model).activation_peak_of = lambda key: 1000
    compiled = torch.compile(model, backend="dlo", options={"compiler": "inductor"})
    with torch.no_grad():
        want = call(ref, inputs)
        outs = [call(compiled, inputs) for _ in range(3)]
    for out in outs:
        assert_inductor_close(out, want)
    assert torch.equal(outs[1], outs[2])  # one variant, its pieces compiled once
    assert the_plan(model).resident


_ARMED = []  # one entry: the next call of dlotest::maybe_oom raises


@torch.library.custom_op("dlotest::maybe_oom", mutates_args=())
def maybe_oom(x: torch.Tensor) -> torch.Tensor:
    """An op of the compute that runs out of device memory once when armed."""
    if _ARMED:
        _ARMED.clear()
        raise torch.OutOfMemoryError("out of memory (injected in the middle of the graph)")
    return x.clone()


@maybe_oom.register_fake
def _(x):
    return torch.empty_like(x)


def test_out_of_memory_in_the_middle_of_the_graph_leaves_the_slots_exact():
    """The error raised by a compute op between two blocks, with later blocks' copies
    queued: the rest of the schedule completes without compute, and the next calls (a
    smaller plan) are exact."""
    model, compiled, inputs, want, plan = _planned_dit(
        2, peak=1000, before_compile=lambda model: model.blocks[2].register_forward_hook(
            lambda module, args, out: maybe_oom(out)))
    with torch.no_grad():
        _ARMED.append(True)
        with pytest.raises(DeviceMemoryError) as info:
            call(compiled, inputs)
        assert info.value.moved_blocks == plan.resident
        for _ in range(2):
            assert torch.equal(call(compiled, inputs), want)


# -- reports --------------------------------------------------------------------------------
def test_memory_report_and_blocks_md_show_the_auto_budget():
    minimum, sizes, inputs = _probed_plan()
    capacity = GIB + 5000 + minimum + 2 * max(sizes)
    ref, model, _ = _offloaded_dit(capacity)
    runtime_of(model).activation_peak_of = lambda key: 5000
    compiled = torch.compile(model, backend="dlo")
    with torch.no_grad():
        for _ in range(2):
            call(compiled, inputs)
    plan = the_plan(model)
    report = dlo_fx.memory_report(model)
    assert report.device_capacity_bytes == capacity
    assert report.activation_peak_bytes == 5000 and len(report.activation_peaks) == 1
    assert report.weights_budget_bytes == capacity - 5000 - GIB == plan.device_budget
    text = str(report)
    assert "activation_peak" in text and "weights budget" in text
    assert f"device capacity {capacity:,} B - activation peak 5,000 B (measured)" in text
    for g in plan.resident:
        assert f"resident block {g} ({plan.labels[g]}): {plan.block_bytes[g]:,} B" in text
    assert "ms per call with" in text and "measured" in text
    from dlo_fx.apps.dump.record import GraphDump

    dump = GraphDump(index=0, folder=None, mode="rank_local", dp=1, rank=0, num_slots=2,
                     budget=0, blocks=(), resident=(), program=(), budget_plan=plan)
    md = blocks_markdown(dump)
    assert "device_budget='auto': device capacity" in md
    assert all(f"| {g} | {plan.labels[g]} |" in md for g in plan.resident)


# -- several ranks gathering: each call planned, the smallest budget agreed ------------------
def _two_ranks():
    import auto_budget_cases
    from distributed import spawn

    return spawn(2, auto_budget_cases.allgather_plans_agreed_per_call, timeout=400)


@pytest.mark.spawned.with_args(_two_ranks)
def test_two_ranks_gathering_agree_on_each_calls_plan(spawned):
    """Two ranks gathering plan every call from their own measured memory and run the
    plan of the smallest budget, exactly: see [Note: the auto budget of ranks gathering]."""
    r0, r1 = spawned[0], spawned[1]
    a0, a1 = r0["agreed"], r1["agreed"]
    assert a0["equal"][:5] == [True] * 5 and a1["equal"] == [True] * 5, (a0, a1)
    assert a0["resident"] == a1["resident"] and a0["budget"] == a1["budget"]
    counts = [len(x) for x in a0["resident"]]
    assert counts[0] == 0 and counts[1] > counts[2] > 0, counts  # measured, then re-planned
    assert counts[4] == counts[1] and a0["records"] == 1
    assert "global rank 1's" in a0["lines"][-1] and "this rank's" in a1["lines"][-1]
    assert f"weights budget {a0['budget']:,} B" in a1["lines"][0]  # rank 1 offered the least

    o0, o1 = r0["oom"], r1["oom"]  # out of memory in a call of rank 1
    assert o0["error"] == "" and o0["first_exact"] is True, o0
    assert o1["error"].startswith("DeviceMemoryError: dlo: the call ran out of device memory")
    assert "at the next call the ranks of the weight group of global ranks [0, 1]" in o1["error"]
    assert o0["after"] == o1["after"] == [True, True]
    assert o0["resident_after"] == o1["resident_after"]  # both moved the same blocks back
    assert len(o1["resident_after"]) < len(o1["before"]) and o1["floor"] is not None

    c0, c1 = r0["copy"], r1["copy"]  # a resident block's copy that rank 1 cannot allocate
    assert c1["raised"] == 1 and c0["first"] and c1["first"]
    for c in (c0, c1):
        assert c["error"].startswith("DeviceMemoryError: dlo: the call ran out of device "
                                     "memory"), c
        assert "does not fit on global rank(s) [1]" in c["error"] and "no rank gathered" in c["error"]
        assert c["later"] == [True, True]
    assert c0["resident"] == c1["resident"]

    p0, p1 = r0["padding"], r1["padding"]  # the engine's gather-only padding forwards
    assert p0["exact"] == [True] * 9 and p1["exact"] == [True] * 6, (p0, p1)
    assert p1["gather_only"] == 3 and p0["gather_only"] == 0 and p0["in_step"] and p1["in_step"]
    assert p0["plans"] == p1["plans"], (p0["plans"], p1["plans"])
    assert len(p1["plans"][4]) > len(p1["plans"][3])  # the replays made the small plan's copies

    d0, d1 = r0["completed"], r1["completed"]  # a call failing before its resident copies
    assert d1["failed"] == [True] and "injected failure" in d1["second"], d1
    assert d0["second"] is True and d0["kept"] == [], d0
    assert d1["kept"], d1  # the blocks after the failure: fetched with rank 0, kept
    assert d0["later"] == d1["later"] == [True, True] and d0["resident"] == d1["resident"]
