"""Dumps after a recompile: every graph gets its own trace.json, with its own spans."""

from __future__ import annotations

import json

import torch

from dlo_fx.apps.dump import writer
from dlo_fx.apps.models import example_inputs
from dlo_fx.runtime.weights.owners import reset_runtimes
from models import offloaded, tiny_dit


def _spans(path) -> list:
    doc = json.loads(path.read_text())
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    return [e for e in events if e.get("ph") == "X"]


def test_second_resolution_gets_its_own_trace(tmp_path):
    torch._dynamo.reset()
    reset_runtimes()
    model, first = tiny_dit()
    offloaded(model)
    second = example_inputs(model.config, batch=2, height=16, width=8, seed=1)
    compiled = torch.compile(model, backend="dlo", dynamic=False,
                             options={"dump_dir": str(tmp_path), "trace": True})
    with torch.no_grad():
        for inputs, calls in ((first, 2), (second, 3)):
            for _ in range(calls):
                compiled(*inputs)
    writer.flush(model)
    traces = {g: _spans(tmp_path / g / "trace.json") for g in ("graph_0", "graph_1")}
    # each call computes every block once: a graph counts its own calls only
    computes = {g: sum(e["name"].startswith("compute") for e in spans) for g, spans in traces.items()}
    assert computes["graph_0"] and computes["graph_1"]
    assert computes["graph_1"] * 2 == computes["graph_0"] * 3, computes
