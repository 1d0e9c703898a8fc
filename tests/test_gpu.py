"""The accelerator path: every entry point against the same model resident on the device.

``pytest -m gpu`` selects this set; `make test` runs it too, and where no accelerator
exists every test here skips, saying so. Each comparison is `torch.equal` against the
model resident on the device (the same kernels on the same device): the diffusers zoo
through `dlo_fx.offload` and `dlo_fx.load` (float32 and bfloat16, 2 and 3 slots), a tiny
Flux pipeline through `compile_pipeline`, the README's snippets, no host sync in steady
state, and the host store pinned. ``DLO_FX_ZOO=all`` takes every class of the zoo, as
`make zoo` does; ``DLO_FX_TEST_DEVICE=cpu`` runs the set on the CPU (the host as its own
compute device: the same code paths, no streams)."""

from __future__ import annotations

import os

import pytest
import torch

import dlo_fx
from dlo_fx.runtime.device import platform
from dlo_fx.runtime.weights.stored import is_stored

ACCELERATOR = (torch.device(os.environ["DLO_FX_TEST_DEVICE"]) if os.environ.get("DLO_FX_TEST_DEVICE")
               else platform.accelerator())
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    ACCELERATOR is None, reason="no accelerator: torch.accelerator finds none on this machine "
    "(the meta-device tests of test_offload.py cover these paths on CPU)")]


def each_tensor(value, fn):
    """``value`` with ``fn`` applied to every tensor in it (lists, tuples, dicts)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)):
        return type(value)(each_tensor(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: each_tensor(v, fn) for k, v in value.items()}
    return value


def on(value, device):
    """``value`` (tensors, and lists, tuples and dicts of them) on ``device``."""
    return each_tensor(value, lambda t: t.to(device))


def cast(value, dtype):
    """``value`` with its floating-point tensors in ``dtype``."""
    return each_tensor(value, lambda t: t.to(dtype) if t.is_floating_point() else t)


def zoo_names() -> list[str]:
    if importlib_missing("diffusers"):
        return []
    from zoo_models import ZOO

    names = [m.name for m in ZOO]
    if os.environ.get("DLO_FX_ZOO") == "all":
        from zoo_more import MORE

        names += [m.name for m in MORE]
    return names


def importlib_missing(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is None


def fresh():
    torch._dynamo.reset()


@pytest.mark.parametrize("name", zoo_names())
def test_zoo_class_exact_on_the_device(name, tmp_path):
    """Through `offload` (float32, 2 slots; bfloat16, 3 slots) and `load` (float32, 3
    slots), two calls each, `torch.equal` against the model resident on the device."""
    from safetensors.torch import save_file
    from zoo_models import build, by_name, outputs

    import diffusers

    entry = by_name(name)
    device = ACCELERATOR
    failures = []
    for dtype, slots, via in ((torch.float32, 2, "offload"), (torch.bfloat16, 3, "offload"),
                              (torch.float32, 3, "load")):
        fresh()
        model, inputs = build(entry)
        model = model.to(dtype)
        inputs = on(cast(inputs, dtype), device)
        reference = model.to(device)
        with torch.no_grad():
            want = outputs(reference(**inputs))
        options = {"num_slots": slots}
        if via == "offload":
            streamed, _ = build(entry)
            streamed = dlo_fx.offload(streamed.to(dtype), options=options)
        else:
            path = tmp_path / f"{name}.safetensors"
            save_file({k: v.detach().contiguous().cpu() for k, v in
                       reference.state_dict().items()}, str(path))
            cls = getattr(diffusers, entry.cls) if isinstance(entry.cls, str) else entry.cls
            streamed = dlo_fx.load(lambda: cls(**entry.config).to(dtype), str(path),
                                   options=options)
        del reference
        assert any(is_stored(p) for p in streamed.parameters())
        compiled = torch.compile(streamed, backend="dlo")
        for call in range(2):
            with torch.no_grad():
                got = outputs(compiled(**inputs))
            if len(got) != len(want) or not all(torch.equal(g, w) for g, w in zip(got, want)):
                diff = max(((g.double() - w.double()).abs().max().item()
                            for g, w in zip(got, want) if g.shape == w.shape), default=None)
                failures.append(f"{via} {dtype} {slots} slots call {call}: max diff {diff}")
        del compiled, streamed
    assert not failures, f"{name}: " + "; ".join(failures)


def test_compile_pipeline_equals_the_pipeline_resident_on_the_device():
    pytest.importorskip("diffusers")
    import diffusers_pipelines as dp

    reference, pipe = dp.flux(), dp.flux()
    reference.to(ACCELERATOR)
    dlo_fx.compile_pipeline(pipe, options={"num_slots": 2})
    assert pipe._execution_device.type == ACCELERATOR.type
    assert all(p.device.type == ACCELERATOR.type for p in pipe.vae.parameters())
    for height, width in ((16, 16), (32, 16)):
        want = dp.images(reference, "flux", height=height, width=width)
        got = dp.images(pipe, "flux", height=height, width=width)
        assert got.device.type == ACCELERATOR.type and torch.equal(got, want), (height, width)
    dlo_fx.release(pipe)


def test_readme_snippets_run_on_the_device():
    from test_readme import run_snippets

    result = run_snippets()
    assert result["failed"] is None, result["failed"]
    assert result["device"].startswith(ACCELERATOR.type) and result["out_finite"]


def test_a_model_already_on_the_device_in_every_spelling():
    """`offload` of a model on the device keeps it there; ``"cuda"``, ``"cuda:0"`` and the
    current device's index are one device for every check."""
    from dlo_fx.apps.models import example_inputs, reference_dit

    kind = ACCELERATOR.type
    index = torch.accelerator.current_device_index() if platform.has_streams(ACCELERATOR) else 0
    model = reference_dit(width=64, depth=3, heads=4).to(ACCELERATOR)
    inputs = on(example_inputs(model.config), ACCELERATOR)
    with torch.inference_mode():
        want = model(*inputs)
    for spelling in (kind, f"{kind}:{index}", torch.device(kind, index)):
        fresh()
        dlo_fx.offload(model, options={"device": spelling})
        assert {p.device for p in model.parameters()} == {want.device}
        with torch.inference_mode():
            assert torch.equal(torch.compile(model, backend="dlo")(*inputs), want), spelling
        dlo_fx.release(model)
        assert {p.device for p in model.parameters()} == {want.device}
    # Never offloaded: refused naming the fix, the model left on the device; then the fix
    fresh()
    with torch.inference_mode(), pytest.raises(ValueError,
                                               match=r"dlo_fx\.offload\(model, options\) first"):
        torch.compile(model, backend="dlo", options={"device": kind})(*inputs)
    assert {p.device for p in model.parameters()} == {want.device}
    dlo_fx.offload(model, options={"device": kind})
    with torch.inference_mode():
        out = torch.compile(model, backend="dlo", options={"device": kind})(*inputs)
    assert torch.equal(out, want)
    dlo_fx.release(model)


def test_host_inputs_of_a_model_offloaded_to_the_device_are_refused_naming_it():
    """Dynamo's "Tensor device mismatch" (host inputs, weights on the device) named
    neither dlo nor its device: the call is refused naming both and the fix, compiled and
    eager, and runs exactly with the inputs moved (see [Note: inputs on the compute
    device] in dlo_fx/model/input_device.py)."""
    from dlo_fx.apps.models import example_inputs, reference_dit

    model = reference_dit(width=64, depth=3, heads=4)
    inputs = example_inputs(model.config)
    with torch.inference_mode():
        want = model.to(ACCELERATOR)(*on(inputs, ACCELERATOR))
    model.cpu()
    dlo_fx.offload(model)
    device = next(model.parameters()).device
    compiled = torch.compile(model, backend="dlo")
    for run in (compiled, model):
        with torch.inference_mode(), pytest.raises(ValueError) as caught:
            run(*inputs)
        assert str(caught.value).startswith(f"dlo: ReferenceDiT computes on {device} "), caught
        assert "is a tensor on cpu" in str(caught.value), caught
    with torch.inference_mode():
        assert torch.equal(compiled(*on(inputs, ACCELERATOR)), want)
    dlo_fx.release(model)


def test_parameters_on_two_devices_are_refused():
    from dlo_fx.apps.models import reference_dit

    if not platform.has_streams(ACCELERATOR):
        pytest.skip("the host is the compute device: the model is on one device")
    model = reference_dit(width=32, depth=2, heads=2)
    model.blocks[0].to(ACCELERATOR)
    with pytest.raises(ValueError, match="are on 2 devices"):
        dlo_fx.offload(model)
    assert not any(is_stored(p) for p in model.parameters())


def test_steady_state_has_no_host_sync_and_the_store_is_pinned():
    from dlo_fx.apps.models import example_inputs, reference_dit
    from dlo_fx.runtime.weights.owners import owner_of

    model = reference_dit(width=256, depth=4, heads=4)
    inputs = example_inputs(model.config)
    with torch.inference_mode():
        want = model.to(ACCELERATOR)(*on(inputs, ACCELERATOR))
    model.cpu()
    # every block streamed: the steady state of the stream (device_budget="auto" re-plans
    # at the second call, which then makes its resident copies)
    dlo_fx.offload(model, options={"num_slots": 2, "device_budget": None})
    runtime = owner_of(model.parameters())
    assert runtime.store.blocks and all(b.shard.is_pinned() == platform.can_pin(ACCELERATOR)
                                        for b in runtime.store.blocks if b.shard.numel())
    compiled = torch.compile(model, backend="dlo")
    device_inputs = on(inputs, ACCELERATOR)
    with torch.inference_mode():
        compiled(*device_inputs)  # the first call compiles
        if platform.has_streams(ACCELERATOR):
            with platform.sync_debug(ACCELERATOR, "error"):
                out = compiled(*device_inputs)
        else:
            out = compiled(*device_inputs)
    assert torch.equal(out, want)


def test_the_store_pins_what_it_uses(caplog):
    """Every host shard page-locked, and the pinned slabs no more than what the shards use
    (exactly sized registered slabs where the platform registers host memory: [Note: pinned
    slabs] in runtime/host/host_slabs.py); unregistered again at release."""
    import gc
    import logging

    from dlo_fx import memory_report
    from dlo_fx.apps.models import example_inputs, reference_dit
    from dlo_fx.runtime.weights.owners import owner_of

    if not platform.can_pin(ACCELERATOR):
        pytest.skip(f"{ACCELERATOR.type}: host shards are not page-locked for this device")
    if not platform.can_register():
        pytest.skip(f"{ACCELERATOR.type}: no cudaHostRegister in this build (power-of-two "
                    "pin_memory slabs, tests/test_host_slabs.py)")
    model = reference_dit(width=256, depth=4, heads=4)
    inputs = example_inputs(model.config)
    with torch.inference_mode():
        want = model.to(ACCELERATOR)(*on(inputs, ACCELERATOR))
    model.cpu()
    dlo_fx.offload(model, options={"num_slots": 2})
    store = owner_of(model.parameters()).store
    shards = [b.shard for b in store.blocks if b.shard.numel()]
    assert shards and all(s.is_pinned() for s in shards)
    report = memory_report(model)
    assert report.pinned_requested_bytes == report.host_shard_bytes > 0
    assert report.pinned_allocated_bytes / report.pinned_requested_bytes <= 1.01
    with torch.inference_mode():
        assert torch.equal(torch.compile(model, backend="dlo")(*on(inputs, ACCELERATOR)), want)
    del shards, store
    with caplog.at_level(logging.DEBUG, logger=platform.__name__):
        dlo_fx.release(model)
        gc.collect()
    assert "cudaHostUnregister" not in caplog.text  # each slab unregistered, once


@pytest.mark.parametrize("budget", ["auto", None])
def test_device_budget_exact(budget):
    from dlo_fx.apps.models import example_inputs, reference_dit

    model = reference_dit(width=128, depth=4, heads=4)
    inputs = on(example_inputs(model.config), ACCELERATOR)
    with torch.inference_mode():
        want = model.to(ACCELERATOR)(*inputs)
    dlo_fx.offload(model, options={"device_budget": budget})
    compiled = torch.compile(model, backend="dlo")
    with torch.inference_mode():  # "auto": the first call measures, the next ones re-plan
        for _ in range(3):
            assert torch.equal(compiled(*inputs), want)
    if budget == "auto" and platform.has_streams(ACCELERATOR):
        report = dlo_fx.memory_report(model)
        assert report.activation_peak_bytes is not None and report.device_capacity_bytes
        assert report.num_resident_blocks > 0  # a tiny model fits: blocks stay resident


def _sample(model, kwargs):
    import warnings

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model(**kwargs).sample


def test_fp8_storage_dtype_exact_on_the_device():
    """Stored as fp8, cast in the graph: equal to diffusers' layerwise casting resident
    on the device, through `offload` and through `compile_pipeline`'s take-over."""
    pytest.importorskip("diffusers")
    from storage_cases import BF16, FP8, flux, inputs, ref_model

    kwargs = on(inputs(), ACCELERATOR)
    want = _sample(ref_model(flux()).to(ACCELERATOR), kwargs)
    model = dlo_fx.offload(flux(), options={"storage_dtype": FP8})
    compiled = torch.compile(model, backend="dlo")
    assert all(torch.equal(_sample(compiled, kwargs), want) for _ in range(2))
    taken = ref_model(flux())
    assert dlo_fx.take_over_layerwise_casting(taken) > 0
    dlo_fx.offload(taken)
    taken.compile(backend="dlo")
    assert all(torch.equal(_sample(taken, kwargs), want) for _ in range(2))
    assert BF16 in {p.dtype for p in model.parameters()}


def test_gguf_file_loaded_exact_on_the_device(tmp_path):
    pytest.importorskip("gguf")
    from diffusers import FluxTransformer2DModel
    from gguf_cases import COMPUTE, reference, write_folder
    from storage_cases import inputs

    path = write_folder(str(tmp_path))
    kwargs = on(cast(inputs(), COMPUTE), ACCELERATOR)
    want = _sample(reference(path).to(ACCELERATOR), kwargs)
    model = dlo_fx.load(FluxTransformer2DModel, path, config=os.path.dirname(path),
                        dtype=COMPUTE)
    compiled = torch.compile(model, backend="dlo")
    assert all(torch.equal(_sample(compiled, kwargs), want) for _ in range(2))


@pytest.mark.parametrize("name", ["int8", "float8"])
def test_torchao_weights_exact_on_the_device(name):
    pytest.importorskip("torchao")
    from quantized_cases import quantized
    from storage_cases import inputs

    if name == "float8" and platform.has_streams(ACCELERATOR) and \
            torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 weight-only needs compute capability 8.9")
    kwargs = on(inputs(), ACCELERATOR)
    want = _sample(quantized(name).to(ACCELERATOR), kwargs)
    model = dlo_fx.offload(quantized(name))
    compiled = torch.compile(model, backend="dlo")
    assert all(torch.equal(_sample(compiled, kwargs), want) for _ in range(2))
