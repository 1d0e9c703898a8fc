"""Every ordinary read of a stored weight outside a graph is exact or a Python exception,
each in a process of its own (a segfault, an abort or a hang shows as "no answer"): see
[Note: a stored weight is a tensor] in dlo_fx/runtime/weights/stored.py."""

from __future__ import annotations

import tempfile

import pytest

import stored_read_cases
from distributed import in_child, spawn
from loader_cases import save_dit

#: reads that refuse, with what their message must say; every other read is exact
REFUSED = {
    # register_parametrization moves a tensor subclass into the parametrization with
    # torch.utils.swap_tensors, which refuses a tensor anything holds a weak reference to
    # (the host store does): torch's error, before anything changed
    "parametrize": "RuntimeError: Cannot swap t1 because it has weakref associated with it",
    # a copy would not own the host store
    "deepcopy": "ValueError: dlo: cannot deepcopy parameter",
}


def _reads():
    with tempfile.TemporaryDirectory() as folder:
        path, config = spawn(1, in_child, save_dit, folder)[0]
        return stored_read_cases.all_reads(path, config)


@pytest.mark.spawned.with_args(_reads)
def test_every_read_outside_the_graph_is_exact_or_refused(spawned):
    results = spawned
    assert len(results) == 2 * len(stored_read_cases.READS)
    for (how, name), outcome in results.items():
        if name in REFUSED:
            assert isinstance(outcome, str) and outcome.startswith(REFUSED[name]), \
                (how, name, outcome)
            assert name == "parametrize" or "dlo_fx.release(model)" in outcome, (how, name)
        else:
            assert outcome is True, (how, name, outcome)


def test_a_torchao_quantized_reference_dit_streams_exactly():
    """torchao's weight-only int8 weights are tensor subclasses whose data are other
    tensors: the compile raised torchao's NotImplementedError about ``aten.as_strided``;
    they now stream as their inner tensors (tests/test_quantized.py has Flux, both modes
    and two ranks), here on the reference DiT in float32."""
    import torch
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    from models import call, offloaded, tiny_dit

    ref, inputs = tiny_dit()
    model, _ = tiny_dit()
    for m in (ref, model):
        quantize_(m.float(), Int8WeightOnlyConfig())
    offloaded(model)
    inputs = [t.float() if t.is_floating_point() else t for t in inputs]
    with torch.no_grad():
        want = call(ref, inputs)
        compiled = torch.compile(model, backend="dlo")
        assert all(torch.equal(call(compiled, inputs), want) for _ in range(2))


def test_magcache_before_the_first_call_reads_the_blocks_from_the_host_store():
    """diffusers' MagCache enabled before the first call runs the blocks from its own hook,
    which Dynamo does not trace. The model is offloaded whole (before it is compiled), so
    those blocks read their stored weights from the host store at each eager read: exact,
    nothing left resident, and one warning per model says the reads are eager."""
    import warnings

    import torch
    from diffusers.hooks.mag_cache import MagCacheConfig

    from dlo_fx.runtime.weights.stored import is_stored
    from models import offloaded, tiny_flux

    def config():
        return MagCacheConfig(num_inference_steps=4, mag_ratios=[1.0] * 4, threshold=0.0)

    ref, inputs = tiny_flux(0)
    model, _ = tiny_flux(0)
    ref.enable_cache(config())
    model.enable_cache(config())
    compiled = torch.compile(offloaded(model), backend="dlo")
    with torch.no_grad(), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert all(torch.equal(compiled(**inputs)[0], ref(**inputs)[0]) for _ in range(3))
    eager = [w for w in seen if "read outside a scheduled graph" in str(w.message)]
    assert len(eager) == 1, [str(w.message) for w in seen]
    assert all(is_stored(p) for p in model.transformer_blocks.parameters())


def test_a_stored_model_compiled_again_by_another_backend():
    """A stored model compiled again with another backend: ``backend="eager"`` runs its
    graph on the stored weights, each read served from the host store (exact); Inductor
    rebuilds the weights from their inner tensors and reads a copy no runtime holds,
    which raises saying so (torch's raw setStorage error before)."""
    import torch

    from models import call, offloaded, tiny_dit

    model, inputs = tiny_dit()
    offloaded(model)
    ref, _ = tiny_dit()
    # backend="eager" reads the stored weights outside a scheduled graph: slow, and said
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="read outside a scheduled graph"):
        want = call(ref, inputs)
        assert torch.equal(call(torch.compile(model, backend="dlo"), inputs), want)
        eager = torch.compile(model, backend="eager")
        assert all(torch.equal(call(eager, inputs), want) for _ in range(2))
        with pytest.raises(Exception, match="that no dlo runtime holds was read.*backend='dlo'"):
            call(torch.compile(model, backend="inductor"), inputs)
        assert torch.equal(call(torch.compile(model, backend="dlo"), inputs), want)
