"""Options checked where they are given, and `dlo_fx.release` of a module or a pipeline,
as a new user meets them: a second `compile_pipeline` with other options refused before
anything changes; a load/compile mismatch and an unsupported ``mode=`` refused at the
first call with dlo's message first (no ``BackendCompilerFailed`` around it);
``release(pipe)`` then save and cast."""

from __future__ import annotations

import pytest
import torch

import diffusers_pipelines as dp
import dlo_fx
from dlo_fx.apps.models import ReferenceDiT
from dlo_fx.runtime.weights.owners import live_runtimes, reset_runtimes, runtimes_holding
from dlo_fx.runtime.weights.stored import is_stored
from loader_cases import resident_dit, save_dit
from models import offloaded, tiny_dit, tiny_flux
from dlo_fx.apps.models import example_inputs


@pytest.fixture(autouse=True)
def fresh():
    torch._dynamo.reset()
    reset_runtimes()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def dit(tmp_path_factory):
    path, config = save_dit(str(tmp_path_factory.mktemp("options")))
    inputs = example_inputs(config, batch=1, height=8, width=8, seed=1)
    with torch.no_grad():
        expected = resident_dit(path, config)(*inputs)
    return {"path": path, "config": config, "inputs": inputs, "expected": expected}


def first_call_error(compiled, inputs) -> BaseException:
    with pytest.raises(ValueError) as caught, torch.no_grad():
        compiled(*inputs)
    return caught.value


def test_load_then_compile_with_other_options_refused_with_dlo_message_first(dit):
    model = dlo_fx.load(ReferenceDiT, dit["path"], config=dit["config"],
                        options={"num_slots": 3})
    exc = first_call_error(torch.compile(model, backend="dlo", options={"num_slots": 2}),
                           dit["inputs"])
    assert not isinstance(exc, torch._dynamo.exc.BackendCompilerFailed)
    assert "TORCHDYNAMO_VERBOSE" not in str(exc)  # dlo's message alone, no footer of Dynamo's
    first = str(exc).splitlines()[0]
    assert first.startswith("dlo: torch.compile(backend='dlo'): runtime options differ from "
                            "those the runtime of the model was made with: num_slots=2")
    # nothing changed: the model compiles with the options it was loaded with
    with torch.no_grad():
        out = torch.compile(model, backend="dlo")(*dit["inputs"])
    assert torch.equal(out, dit["expected"])


@pytest.mark.parametrize("option", [{"dump_dir": "dumps"}, {"trace": True}])
def test_a_compile_option_given_to_load_is_refused_before_anything_is_stored(dit, option):
    """``dump_dir`` and ``trace`` given to load were kept and never read (no dump, no
    trace); now refused naming the verb they belong to, before the checkpoint is read."""
    key = next(iter(option))
    with pytest.raises(ValueError, match=rf"'{key}'=.* belongs to each compile, not to "
                                         r"dlo_fx.load: give it to torch.compile"):
        dlo_fx.load(ReferenceDiT, dit["path"], config=dit["config"], options=option)
    assert live_runtimes() == []


def test_unsupported_mode_refused_with_dlo_message_first(dit):
    model = dlo_fx.load(ReferenceDiT, dit["path"], config=dit["config"])
    exc = first_call_error(torch.compile(model, backend="dlo", mode="max-autotune"),
                           dit["inputs"])
    assert not isinstance(exc, torch._dynamo.exc.BackendCompilerFailed)
    assert str(exc).startswith("torch.compile mode='max-autotune' is not supported by "
                               "backend 'dlo'")
    exc = first_call_error(torch.compile(model, backend="dlo", options={"num_slot": 2}),
                           dit["inputs"])
    assert str(exc).startswith("unknown dlo option 'num_slot'")


def test_second_compile_pipeline_with_other_options_refused_before_anything_changes():
    reference, pipe = dp.flux(), dp.flux()
    dlo_fx.compile_pipeline(pipe, options={"num_slots": 2})
    compiled_call = pipe.transformer._compiled_call_impl
    # offloaded by the first compile_pipeline: the runtime holds the options already
    with pytest.raises(ValueError, match=r"runtime of FluxPipeline\.\w+ \(release pipe\) was "
                                         r"made with: num_slots=3"):
        dlo_fx.compile_pipeline(pipe, options={"num_slots": 3})
    assert pipe.transformer._compiled_call_impl is compiled_call  # not compiled again
    with pytest.raises(ValueError, match="mode='max-autotune' is not supported"):
        dlo_fx.compile_pipeline(pipe, mode="max-autotune")
    expected = dp.images(reference, "flux", cfg=False)
    assert torch.equal(dp.images(pipe, "flux", cfg=False), expected)
    # after calls too; the same options (or none) compile again
    with pytest.raises(ValueError, match=r"differ from those the runtime of FluxPipeline"):
        dlo_fx.compile_pipeline(pipe, options={"num_slots": 3})
    dlo_fx.compile_pipeline(pipe)
    assert torch.equal(dp.images(pipe, "flux", cfg=False), expected)


def test_compile_pipeline_hands_each_option_to_its_verb():
    """compile_pipeline makes the runtimes and compiles: of one dict, the runtime's options
    reach each component's runtime and the compile's each compile (none dropped, none
    replacing the other); the same runtime options with other compile options compile
    again."""
    reference, pipe = dp.flux(), dp.flux()
    seen = set()

    def record(gm, plan):
        seen.add(plan.config.num_slots)
        return gm

    dlo_fx.compile_pipeline(pipe, options={"num_slots": 3, "trace": True,
                                           "user_passes": [record]})
    expected = dp.images(reference, "flux", cfg=False)
    assert torch.equal(dp.images(pipe, "flux", cfg=False), expected)
    assert seen == {3}  # the runtime's options, with the compile's user pass
    assert _slots(pipe) == {"transformer": 3, "text_encoder": 3, "text_encoder_2": 3}
    runtime = runtimes_holding(list(pipe.transformer.parameters()))[0]
    assert runtime.machine.tracer is not None
    seen.clear()
    dlo_fx.compile_pipeline(pipe, options={"num_slots": 3, "user_passes": [record]})
    assert torch.equal(dp.images(pipe, "flux", cfg=False), expected)
    assert seen == {3}


def test_release_of_a_pipeline_then_save_and_cast(tmp_path):
    reference, pipe = dp.flux(), dp.flux()
    dlo_fx.compile_pipeline(pipe, options={"num_slots": 2})
    expected = dp.images(reference, "flux", cfg=False)
    assert torch.equal(dp.images(pipe, "flux", cfg=False), expected)
    assert any(is_stored(p) for p in pipe.transformer.parameters())
    assert dlo_fx.release(pipe) is pipe
    for name in ("transformer", "text_encoder", "text_encoder_2"):
        module = getattr(pipe, name)
        assert not any(is_stored(p) for p in module.parameters()), name
        assert dlo_fx.state(module).released, name
        mine, theirs = module.state_dict(), getattr(reference, name).state_dict()
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k])
                                                    for k in mine), name
    # released, it runs resident: no runtime is made again
    assert torch.equal(dp.images(pipe, "flux", cfg=False), expected)
    assert dlo_fx.state(pipe.transformer).released
    with pytest.raises(TypeError, match=r"not a FluxPipeline; for a pipeline, ask of each "
                                        r"component, e.g. dlo_fx.state\(pipe\.\w+\)"):
        dlo_fx.state(pipe)
    pipe.save_pretrained(tmp_path / "saved")
    assert (tmp_path / "saved" / "transformer" / "config.json").is_file()
    pipe.to(torch.float64)
    assert {p.dtype for p in pipe.transformer.parameters()} == {torch.float64}
    assert dlo_fx.release(pipe) is pipe  # final: a second release does nothing
    with pytest.raises(ValueError, match=r"no component of FluxPipeline .* has weights"):
        dlo_fx.release(dp.flux())  # nothing of it ever was dlo's
    # released, it takes new options
    pipe.to(torch.float32)
    dlo_fx.compile_pipeline(pipe, options={"num_slots": 3})
    assert torch.equal(dp.images(pipe, "flux", cfg=False), expected)
    assert _slots(pipe) == {"transformer": 3, "text_encoder": 3, "text_encoder_2": 3}


def _slots(pipe) -> dict:
    """num_slots of the runtime of each streamed component."""
    states = {name: dlo_fx.state(getattr(pipe, name))
              for name in ("transformer", "text_encoder", "text_encoder_2")}
    return {name: s.config.num_slots for name, s in states.items() if s and not s.released}


def test_a_pipeline_released_after_a_refused_compile_a_move_and_lora_compiles_anew():
    """What a compile left (the options held by each component's compiled call, the
    pipeline's guards) goes with release: the issue's case (a refused second
    compile_pipeline, then release, then other options) after ``pipe.to`` its own device
    and a LoRA adapter added while the weights were stored."""
    from peft import LoraConfig

    reference, pipe = dp.flux(), dp.flux()
    dlo_fx.compile_pipeline(pipe, options={"num_slots": 2})
    dp.images(pipe, "flux", cfg=False)
    with pytest.raises(ValueError, match=r"differ from those the runtime of FluxPipeline"):
        dlo_fx.compile_pipeline(pipe, options={"num_slots": 3})
    pipe.to("cpu")  # its own device: the stored weights stay where they are
    for transformer in (reference.transformer, pipe.transformer):
        torch.manual_seed(7)
        transformer.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights=False,
                                           target_modules=["to_q", "to_k", "to_v"]))
    dlo_fx.release(pipe)
    assert "fuse_lora" not in vars(pipe) and pipe.transformer._compiled_call_impl is None
    dlo_fx.compile_pipeline(pipe, options={"num_slots": 3})
    assert torch.equal(dp.images(pipe, "flux", cfg=False),
                       dp.images(reference, "flux", cfg=False))
    assert _slots(pipe) == {"transformer": 3, "text_encoder": 3, "text_encoder_2": 3}


def test_a_released_module_compiles_again_with_any_options(dit):
    """``model.compile(backend="dlo")``'s options, a refused first call's and a storage
    dtype's marks do not outlive release: the module runs resident, then is offloaded and
    compiled with other options, exactly."""
    model = resident_dit(dit["path"], dit["config"])
    options = {"num_slots": 2, "storage_dtype": torch.float8_e4m3fn}
    dlo_fx.offload(model, options)
    model.compile(backend="dlo", options=options)
    with torch.no_grad():
        model(*dit["inputs"])
    dlo_fx.release(model)
    rounded = resident_dit(dit["path"], dit["config"])  # the values fp8 holds are its own now
    rounded.load_state_dict(model.state_dict())
    with torch.no_grad():
        expected = rounded(*dit["inputs"])
        assert torch.equal(model(*dit["inputs"]), expected)  # resident: nothing stored
    assert dlo_fx.state(model).released
    dlo_fx.offload(model, {"num_slots": 3})
    model.compile(backend="dlo", options={"num_slots": 3})
    with torch.no_grad():
        assert torch.equal(model(*dit["inputs"]), expected)
    runtime = runtimes_holding(list(model.parameters()))[0]
    assert runtime.config.num_slots == 3
    assert torch.float8_e4m3fn not in {e.dtype for b in runtime.store.blocks for e in b.entries}
    # a model whose first call was refused (options differing from its load's)
    loaded = dlo_fx.load(ReferenceDiT, dit["path"], config=dit["config"],
                         options={"num_slots": 3})
    first_call_error(torch.compile(loaded, backend="dlo", options={"num_slots": 2}),
                     dit["inputs"])
    dlo_fx.release(loaded)
    dlo_fx.offload(loaded, {"num_slots": 2})
    with torch.no_grad():
        out = torch.compile(loaded, backend="dlo", options={"num_slots": 2})(*dit["inputs"])
    assert torch.equal(out, dit["expected"])
    assert dlo_fx.state(loaded).config.num_slots == 2


def test_release_is_final_and_idempotent():
    """See [Note: a released module is as on the first day] in dlo_fx/model/guard.py:
    release twice does nothing the second time (it raised); the torch.compile handle of
    the released model refuses, naming release and offload, and never stores the model
    again by itself (it offloaded it again, and the next .to() then said "release first");
    the module moves and casts as any; offloaded again, the same handle and a new one are
    exact."""
    model, inputs = tiny_dit()
    ref, _ = tiny_dit()
    with torch.no_grad():
        want = ref(*inputs)
        compiled = torch.compile(offloaded(model, {"num_slots": 2}), backend="dlo")
        assert torch.equal(compiled(*inputs), want)
        assert dlo_fx.release(model) is model
        assert dlo_fx.release(model) is model
        with pytest.raises(ValueError, match=r"dlo_fx\.release gave back: .* Call the model "
                                             r"itself, or dlo_fx\.offload\(model, options\) again"):
            compiled(*inputs)
        assert dlo_fx.state(model).released
        assert not any(is_stored(p) for p in model.parameters())
        assert torch.equal(model(*inputs), want)  # eager, as it now is
        dtypes = {n: p.dtype for n, p in model.named_parameters()}
        model.to(torch.float64).to("cpu")  # a module as any
        assert {p.dtype for p in model.parameters()} == {torch.float64}
        for name, p in model.named_parameters():  # back to its own dtypes, exactly
            p.data = p.data.to(dtypes[name])
        offloaded(model, {"num_slots": 3})  # other options: the runtime is new
        assert torch.equal(compiled(*inputs), want)
        assert torch.equal(torch.compile(model, backend="dlo")(*inputs), want)
        assert dlo_fx.state(model).config.num_slots == 3
    dlo_fx.release(model)
    assert dlo_fx.release(model) is model


def test_release_after_compile_repeated_blocks_runs_the_model_as_it_now_is():
    """diffusers' regional compilation (``module.compile`` on each block): release undoes
    the blocks' compiled calls, so the model runs eagerly on its own weights, exact, and
    nothing is stored again; a second release does nothing; offloaded again and compiled
    again, exact."""
    ref, inputs = tiny_flux()
    model, _ = tiny_flux()
    with torch.no_grad():
        want = ref(**inputs)[0]
        offloaded(model).compile_repeated_blocks(backend="dlo")
        assert torch.equal(model(**inputs)[0], want)
        dlo_fx.release(model)
        assert all(torch.equal(model(**inputs)[0], want) for _ in range(2))
        assert dlo_fx.state(model).released
        assert dlo_fx.release(model) is model
        model.to(torch.float64).to(torch.float32)
        offloaded(model).compile_repeated_blocks(backend="dlo")
        assert all(torch.equal(model(**inputs)[0], want) for _ in range(2))
        assert not dlo_fx.state(model).released
    dlo_fx.release(model)


def test_release_of_anything_else_says_what_it_takes():
    with pytest.raises(TypeError, match=r"dlo_fx\.release takes a torch module \(nn\.Module\) "
                                        r"or a diffusers pipeline .*not a dict"):
        dlo_fx.release({"transformer": torch.nn.Linear(2, 2)})


class _Tagged(torch.nn.Parameter):
    """A parameter subclass keeping its own attribute and method, as diffusers'
    ``GGUFParameter`` and bitsandbytes' parameters do."""

    def tag_twice(self) -> str:
        return self.tag * 2


class _Slotted(torch.nn.Parameter):
    __slots__ = ("scale",)


def _tagged_model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(3))).eval()
    for i, layer in enumerate(model):
        weight = torch.Tensor._make_subclass(_Tagged, layer.weight.detach(), False)
        weight.tag = f"w{i}"
        layer.weight = weight
    return model.requires_grad_(False)


@pytest.mark.parametrize("how", ["offload", "compile"])
def test_release_gives_back_each_parameters_class_and_attributes(how):
    """One rule for every ``nn.Parameter`` subclass ([Note: a parameter's class comes back]
    in runtime/weights/stored.py): it comes back of its class with its attributes, the
    values exact; a class that keeps state outside its ``__dict__`` is refused by name
    before anything is stored."""
    model, x = _tagged_model(), torch.randn(2, 16)
    with torch.no_grad():
        want = model(x)
    options = {"block_bytes": 1, "resident_bytes": 0}
    dlo_fx.offload(model, options=options)
    if how == "offload":
        options = None  # inherited; else given again to torch.compile
    with torch.no_grad():
        assert torch.equal(torch.compile(model, backend="dlo", options=options)(x), want)
    assert is_stored(model[1].weight)
    dlo_fx.release(model)
    assert [type(layer.weight) for layer in model] == [_Tagged] * 3
    assert [layer.weight.tag_twice() for layer in model] == ["w0w0", "w1w1", "w2w2"]
    with torch.no_grad():
        assert torch.equal(model(x), want)
    slotted = _tagged_model()
    slotted[1].weight = torch.Tensor._make_subclass(_Slotted, slotted[1].weight.detach(), False)
    before = {k: v.clone() for k, v in slotted.state_dict().items()}
    with pytest.raises(ValueError, match=r"parameter '1.weight' is a .*_Slotted, whose instances "
                                         r"keep state outside their __dict__"):
        dlo_fx.offload(slotted, options={"block_bytes": 1, "resident_bytes": 0})
    assert not any(is_stored(p) for p in slotted.parameters())
    assert all(torch.equal(v, before[k]) for k, v in slotted.state_dict().items())


def _absent_devices() -> list[str]:
    """Device strings this machine has nothing for: the accelerators it lacks, an index
    past its own accelerator's (or CUDA's), and the lazy device."""
    there = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    count = torch.accelerator.device_count() if there is not None else 0
    kind = there.type if there is not None else "cuda"
    spelled = ["cuda:7", "mps", "xpu", "hpu", "lazy", f"{kind}:99"]
    return [d for d in spelled if there is None or torch.device(d).type != there.type
            or (torch.device(d).index or 0) >= count]


def test_a_device_this_machine_lacks_is_refused_naming_the_option_at_every_entry(dit):
    """Through offload, load and compile_pipeline: a ValueError naming the option and what
    the machine has, before anything is stored (torch's raw RuntimeError, "not linked with
    support for cuda devices", came from inside the runtime's construction). torch.compile
    of the model never offloaded is refused naming offload, where the device is checked."""
    devices = _absent_devices()
    assert "lazy" in devices
    pipe = dp.flux()
    for device in devices:
        options = {"device": device}
        named = rf"dlo option 'device'={device!r}: .*; compute on 'cpu', on 'meta'"
        model = ReferenceDiT(dit["config"])
        with pytest.raises(ValueError, match=named):
            dlo_fx.offload(model, options)
        with pytest.raises(ValueError, match=named):
            dlo_fx.load(ReferenceDiT, dit["path"], config=dit["config"], options=options)
        with pytest.raises(ValueError, match=named):
            dlo_fx.compile_pipeline(pipe, options=options)
        with pytest.raises(ValueError, match=r"dlo_fx\.offload\(model, options\) first"), \
                torch.no_grad():
            torch.compile(model, backend="dlo", options=options)(*dit["inputs"])
        torch._dynamo.reset()
        assert not any(is_stored(p) for p in model.parameters())
        assert all(dlo_fx.state(m) is None for m in pipe.components.values()
                   if isinstance(m, torch.nn.Module))
    # the same pipeline compiles exactly where the machine has the device
    reference = dp.flux()
    dlo_fx.compile_pipeline(pipe, options={"device": "cpu"})
    assert torch.equal(dp.images(pipe, "flux", cfg=False), dp.images(reference, "flux", cfg=False))


def _hooked(pipe) -> list[str]:
    """The components carrying an accelerate or diffusers hook."""
    return [name for name, m in pipe.components.items() if isinstance(m, torch.nn.Module)
            and any(hasattr(s, "_hf_hook") or getattr(s, "_diffusers_hook", None) is not None
                    for s in m.modules())]


def test_a_pipelines_own_offloading_is_refused_while_dlo_streams_it():
    """``enable_sequential_cpu_offload`` after `compile_pipeline` raised a raw TypeError
    from StoredWeight.__new__ with some accelerate hooks installed; each of the pipeline's
    offloads is now refused up front, naming dlo and dlo_fx.release, with the pipeline
    unchanged and exact; following the advice (release, then offload) runs exactly."""
    want = dp.images(dp.flux(), "flux", cfg=False)
    pipe = dp.flux()
    dlo_fx.compile_pipeline(pipe, options={"device": "cpu"})
    offloads = {"enable_sequential_cpu_offload": {"device": "cpu"},
                "enable_model_cpu_offload": {"device": "cpu"},
                "enable_group_offload": {"onload_device": torch.device("cpu"),
                                         "offload_type": "leaf_level"}}
    for name, kwargs in offloads.items():
        with pytest.raises(ValueError, match=rf"dlo: cannot call FluxPipeline\.{name}\(\): .* "
                           r"dlo offloads this pipeline already.*nothing was changed\. .*"
                           r"call dlo_fx\.release\(pipe\) first to offload with"):
            getattr(pipe, name)(**kwargs)
        assert _hooked(pipe) == []
    assert torch.equal(dp.images(pipe, "flux", cfg=False), want)
    dlo_fx.release(pipe)
    pipe.enable_model_cpu_offload(device="cpu")  # the advice: released, it offloads
    assert _hooked(pipe) and torch.equal(dp.images(pipe, "flux", cfg=False), want)


def test_another_offloading_installed_before_dlo_is_refused_and_its_advice_works():
    """accelerate's hooks (a pipeline's model offload, accelerate's cpu_offload, which
    leaves the parameters on meta: refused as "on the meta device, build the model with
    its weights", advice that did not work) and diffusers' group offloading, met by
    compile_pipeline or offload: a ValueError naming them before anything changes, whose
    advice (remove the hooks, then offload) runs exactly."""
    from accelerate import cpu_offload
    from accelerate.hooks import remove_hook_from_module
    from models import call, tiny_dit

    want = dp.images(dp.flux(), "flux", cfg=False)
    pipe = dp.flux()
    pipe.enable_model_cpu_offload(device="cpu")
    with pytest.raises(ValueError, match=r"FluxPipeline has accelerate's offload hooks .* "
                       r"nothing was changed\. Remove them first: pipe\.remove_all_hooks\(\)"):
        dlo_fx.compile_pipeline(pipe, options={"device": "cpu"})
    assert all(dlo_fx.state(m) is None for m in pipe.components.values()
               if isinstance(m, torch.nn.Module))
    pipe.remove_all_hooks()
    dlo_fx.compile_pipeline(pipe, options={"device": "cpu"})
    assert torch.equal(dp.images(pipe, "flux", cfg=False), want)

    pipe = dp.flux()
    pipe.transformer.enable_group_offload(onload_device=torch.device("cpu"),
                                          offload_type="leaf_level")
    with pytest.raises(ValueError, match=r"has diffusers' group offloading .* Build or load "
                                         r"the model again without enable_group_offload"):
        dlo_fx.compile_pipeline(pipe, options={"device": "cpu"})
    assert dlo_fx.state(pipe.transformer) is None

    reference, inputs = tiny_dit(depth=1)
    with torch.no_grad():
        expected = call(reference, inputs)
    model, _ = tiny_dit(depth=1)
    cpu_offload(model, execution_device=torch.device("cpu"))
    with pytest.raises(ValueError, match=r"ReferenceDiT has accelerate's offload hooks .* "
                       r"accelerate\.hooks\.remove_hook_from_module\(model, recurse=True\)"):
        dlo_fx.offload(model, {"device": "cpu"})
    remove_hook_from_module(model, recurse=True)
    dlo_fx.offload(model, {"device": "cpu"})
    with torch.no_grad():
        assert torch.equal(call(torch.compile(model, backend="dlo"), inputs), expected)
    # accelerate's offloading installed after dlo's: its new parameter of a stored weight's
    # class is refused naming dlo and release (a raw TypeError of StoredWeight.__new__'s
    # arguments before); no parameter went to meta, every call still exact
    with pytest.warns(RuntimeWarning, match="read outside a scheduled graph"), \
            pytest.raises(TypeError, match=r"dlo: StoredWeight\(a Tensor of shape .*accelerate's "
                          r"set_module_tensor_to_device .*dlo_fx\.release\(model\) first"):
        cpu_offload(model, execution_device=torch.device("cpu"))
    assert not any(p.is_meta for p in model.parameters())
    with torch.no_grad():
        assert torch.equal(call(model, inputs), expected)


def test_pickling_an_offloaded_model_is_refused_and_works_after_release(tmp_path):
    """``torch.save(model)``/pickle of a model dlo stores: a ValueError naming release and
    state_dict (a TypeError about a weakref, or a local hook, before), as copy.deepcopy is
    refused naming the parameter; nothing changed, every call exact; released, it pickles
    as the ordinary module it is."""
    import copy
    import pickle

    ref, inputs = tiny_dit(depth=2)
    model, _ = tiny_dit(depth=2)
    with torch.no_grad():
        want = ref(*inputs)
    compiled = torch.compile(offloaded(model), backend="dlo")
    path = tmp_path / "model.pt"
    refusal = (r"dlo: cannot pickle this {} \(torch.save\(model\).*nothing was written\. "
               r"Call dlo_fx\.release\(model\) first .* model\.state_dict\(\)")
    with pytest.raises(ValueError, match=refusal.format("ReferenceDiT")):
        torch.save(model, path)
    with pytest.raises(ValueError, match=refusal.format("DiTBlock")):
        pickle.dumps(model.blocks[0])  # a guarded submodule too
    with pytest.raises(ValueError, match=r"dlo: cannot deepcopy parameter '.*dlo_fx\.release"):
        copy.deepcopy(model)
    with torch.no_grad():
        assert all(torch.equal(compiled(*inputs), want) for _ in range(2))
    dlo_fx.release(model)
    torch.save(model, path)
    loaded = torch.load(path, weights_only=False)
    assert dlo_fx.state(loaded) is None
    with torch.no_grad():
        assert torch.equal(loaded(*inputs), want)
