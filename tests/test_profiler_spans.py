"""dlo's schedule in a `torch.profiler` trace: each prefetch and wait is a
``record_function`` span named for its block, beside the kernels; none without a
profiler, and the output is the resident model's either way."""

from __future__ import annotations

import copy

import torch
from torch.profiler import ProfilerActivity, profile

from dlo_fx.runtime.weights.owners import reset_runtimes
from models import offloaded, tiny_dit


def test_copies_and_waits_are_spans_in_a_profiler_trace():
    torch._dynamo.reset()
    reset_runtimes()
    model, inputs = tiny_dit(depth=3)
    resident = copy.deepcopy(model)
    compiled = torch.compile(offloaded(model, {"block_bytes": 40_000}), backend="dlo")
    with torch.no_grad():
        expected = resident(*inputs)
        assert torch.equal(compiled(*inputs), expected)  # compiled, weights stored
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out = compiled(*inputs)
        assert torch.equal(out, expected)
    names = {event.name for event in prof.events()}
    for kind in ("prefetch", "wait"):
        assert f"dlo::{kind} block 0" in names and f"dlo::{kind} block 1" in names, names
    assert any(name.startswith("aten::") for name in names)  # beside the kernels
    assert not any(name.startswith("dlo::allgather") for name in names)  # rank-local
