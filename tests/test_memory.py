"""`memory_report`: slot memory is flat in depth; host bytes are the blocks' bytes."""

from __future__ import annotations

import torch

import dlo_fx
from dlo_fx.model.memory import MemoryReport
from dlo_fx.apps.models import example_inputs, reference_dit
from dlo_fx.runtime.host.layout import span_bytes


def compiled_report(depth: int, **options) -> tuple[MemoryReport, int]:
    model = reference_dit(width=64, depth=depth, heads=4)
    weight_bytes = sum(span_bytes(p) for p in model.parameters())
    inputs = example_inputs(model.config, batch=1, height=4, width=4)
    dlo_fx.offload(model, dict(options, device="cpu"))
    with torch.no_grad():
        torch.compile(model, backend="dlo", fullgraph=True)(*inputs)
    return dlo_fx.memory_report(model), weight_bytes


def test_slot_bytes_do_not_grow_with_depth_and_match_the_policy_model():
    shallow, _ = compiled_report(3)
    torch._dynamo.reset()
    from dlo_fx.runtime.weights.owners import reset_runtimes
    reset_runtimes()
    deep, deep_weights = compiled_report(12)
    assert shallow.slot_bytes == deep.slot_bytes == 2 * deep.max_block_bytes
    assert deep.num_blocks > shallow.num_blocks
    # everything but the resident shared table lives in the host store
    assert deep.host_shard_bytes >= deep_weights - deep.resident_bytes
    assert deep.resident_bytes < deep_weights // 100
    # the figures agree with the policy model within 10%
    for figure in ("host_shard_bytes", "slot_bytes"):
        measured, model = getattr(deep, figure), deep.predicted[figure]
        assert abs(measured - model) <= 0.1 * measured, (figure, measured, model)
    assert "model" in str(deep)


def test_report_fields_and_table():
    report, _ = compiled_report(2, num_slots=3)
    assert report.num_slots == 3 and report.slot_bytes == 3 * report.max_block_bytes
    assert report.rss_bytes and report.pss_bytes
    assert report.device_peak_bytes is None  # CPU: nothing to measure
    text = str(report)
    for name in ("num_blocks", "slot_bytes", "host_shard_bytes", "pss_bytes"):
        assert name in text


def test_uncompiled_model_reports_everything_resident():
    model = reference_dit(width=32, depth=1, heads=2)
    report = dlo_fx.memory_report(model)
    assert report.num_blocks == 0 and report.slot_bytes == 0
    assert report.resident_bytes == sum(span_bytes(p) for p in model.parameters())
