"""GGUF-quantized weights (diffusers' ``GGUFLinear`` over ``GGUFParameter``s holding Q8_0
blocks, quantized here with the ``gguf`` package) stream through dlo: the quantized bytes
are stored, and every call, compiled or eager, is exact against the resident model. Once
stored, a weight is a `StoredWeight` that keeps ``quant_type``; the frame's second trace
(for the stored weights) records diffusers' ``as_tensor()`` call on it, which `insert_schedule`
replaces by the slot view read in its place."""

from __future__ import annotations

import pytest
import torch

from models import offloaded


class _GGUFModel(torch.nn.Module):
    def __init__(self) -> None:
        from diffusers.quantizers.gguf.utils import GGUFLinear

        super().__init__()
        self.layers = torch.nn.ModuleList(
            GGUFLinear(64, 64, True, compute_dtype=torch.float32) for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = torch.nn.functional.gelu(layer(x))
        return x


def _q8_model() -> torch.nn.Module:
    import gguf
    from diffusers.quantizers.gguf.utils import GGUFParameter

    model = _GGUFModel()
    gen = torch.Generator().manual_seed(0)
    for layer in model.layers:
        weight = torch.randn(64, 64, generator=gen).numpy()
        quantized = gguf.quants.quantize(weight, gguf.GGMLQuantizationType.Q8_0)
        layer.weight = GGUFParameter(torch.from_numpy(quantized),
                                     quant_type=gguf.GGMLQuantizationType.Q8_0)
        layer.bias = torch.nn.Parameter(torch.randn(64, generator=gen), requires_grad=False)
    return model.eval()


def _compiled_exactly():
    """A Q8_0 model compiled with dlo, called three times, each `torch.equal` to the
    resident one; returns the model, the input and the expected output."""
    ref, model = _q8_model(), _q8_model()
    compiled = torch.compile(offloaded(model), backend="dlo")
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(x)
        assert all(torch.equal(compiled(x), want) for _ in range(3))
    return model, x, want


def test_gguf_q8_weights_stream_exactly_compiled_and_eager():
    from dlo_fx.runtime.weights.owners import runtimes_holding
    from dlo_fx.runtime.weights.stored import is_stored

    model, x, want = _compiled_exactly()
    with torch.no_grad():
        weights = [layer.weight for layer in model.layers]
        assert all(is_stored(w) and w.dtype == torch.uint8 for w in weights)
        store = runtimes_holding(weights)[0].store
        assert sum(b.nbytes for b in store.blocks) < 64 * 64 * 4 * 4 / 3  # the Q8_0 bytes
        with pytest.warns(RuntimeWarning, match="read outside a scheduled graph"):  # slow, and said
            assert torch.equal(model(x), want)


def test_planning_leaves_the_graph_and_the_schedule_drops_as_tensor():
    """The planning stages change no node; `insert_schedule` turns a streamed GGUF weight's
    ``as_tensor()`` call (recorded once the weights are stored) into its slot view."""
    import dlo_fx.dynamo.backend as backend

    real_plan, real_run = backend.plan_graph, backend.run_passes
    planned, scheduled = [], []

    def plan_spy(gm, *args):
        before = gm.code
        plan = real_plan(gm, *args)
        planned.append((before, gm.code))
        return plan

    def run_spy(gm, plan, extra=(), debug=False):
        out = real_run(gm, plan, extra, debug)
        scheduled.append(out.code)
        return out

    backend.plan_graph, backend.run_passes = plan_spy, run_spy
    try:
        _compiled_exactly()
    finally:
        backend.plan_graph, backend.run_passes = real_plan, real_run
    assert planned and all(before == after for before, after in planned)
    traced_as_tensor = [before for before, _ in planned if "as_tensor" in before]
    assert traced_as_tensor, "no trace recorded as_tensor(): the test no longer covers it"
    assert all("as_tensor" not in code for code in scheduled), scheduled[-1]
