"""Helpers and multi-rank cases for the ``compiler="inductor"`` tests (test_inductor.py).

Outputs of DLO with Inductor are compared with ``torch.compile(backend="inductor")`` of
the resident model: the two split the same computation into different kernels (the
pieces end at schedule nodes), so they agree to the resolution of the dtype at the
output's scale, not bit for bit. Among DLO runs (slot counts, modes, dp sizes) the pieces
are the same, so outputs must be ``torch.equal``.

Both sides compile with one Inductor configuration, `compile_config`: scalar C++ kernels
(``cpp.vec_isa_ok=False``), which compile two to three times faster on CPU than the
vectorised default. benchmarks/bench_inductor.py runs the default configuration.
"""

from __future__ import annotations

import contextlib
import time

import torch

from dlo_fx.runtime.runtime import reset_runtimes, runtimes_holding

from models import MODELS, call

#: Relative resolution per dtype; the absolute tolerance is that times max |reference|.
RESOLUTION = {torch.bfloat16: 1.6e-2, torch.float16: 1e-3, torch.float32: 1e-5}


@contextlib.contextmanager
def compile_config():
    """The Inductor configuration every test compiles with (see the module docstring)."""
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
    compiled = torch.compile(model, backend="dlo", fullgraph=fullgraph, dynamic=dynamic,
                             options={"compiler": "inductor", **options})
    with torch.no_grad():
        return [call(compiled, inputs) for inputs in inputs_list], model


# -- two ranks ------------------------------------------------------------------------------
#: (label, model, options, fullgraph, factory kwargs); "{rank}" in shard_group: dp = 1.
DP_CASES = (
    ("dit allgather slots=2", "dit", {"mode": "allgather", "num_slots": 2}, True, {}),
    ("dit allgather slots=3", "dit", {"mode": "allgather", "num_slots": 3}, True, {}),
    ("dit rank_local", "dit", {"mode": "rank_local"}, True, {}),
    ("dit dp=1", "dit", {"shard_group": "own"}, True, {}),
    ("dit-break allgather", "dit", {"mode": "allgather", "num_slots": 3}, False,
     {"graph_break": True, "depth": 4}),
    ("dit-break dp=1", "dit", {"shard_group": "own"}, False, {"graph_break": True, "depth": 4}),
    ("wan allgather", "wan", {"mode": "allgather"}, True, {}),
    ("wan dp=1", "wan", {"shard_group": "own"}, True, {}),
    ("flux allgather", "flux", {"mode": "allgather"}, True, {}),
    ("flux dp=1", "flux", {"shard_group": "own"}, True, {}),
)


def dp_cases(rank: int, world: int, threads: int) -> dict:
    """Every case of `DP_CASES` on this rank: its two outputs and the runtime's mode/dp.

    Runs with the parent's intra-op thread count: Inductor's CPU code depends on it, so
    the pieces the parent compiled are found in Inductor's on-disk cache."""
    torch.set_num_threads(threads)
    out = {}
    with compile_config():
        for label, name, options, fullgraph, kw in DP_CASES:
            start = time.perf_counter()
            fresh()
            options = dict(options)
            if options.get("shard_group") == "own":
                options["shard_group"] = [rank]
            _, inputs = MODELS[name](**kw)
            outs, model = dlo_inductor(name, options, [inputs, inputs], fullgraph=fullgraph,
                                       **kw)
            runtime = runtimes_holding(list(model.parameters()))[0]
            out[label] = {"outs": outs, "mode": runtime.mode, "dp": runtime.store.dp,
                          "seconds": time.perf_counter() - start}
    fresh()
    return out
