"""`dlo_fx.offload`: a model in memory becomes a streamed model before anything traces it.

On the CPU the compute device is the host, and every call is compared with the resident
model (`torch.equal`). The meta device stands in for a compute device that is not the
host (a GPU, where CI has none): the model traces, plans and runs there, with outputs of
the right shape. Bad inputs are refused before anything changes."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

import dlo_fx
from dlo_fx.apps.models import example_inputs, reference_dit
from dlo_fx.config import canonical_device, same_device
from dlo_fx.runtime.weights.owners import owner_of, runtimes_holding
from dlo_fx.runtime.weights.stored import is_stored

import layout_cases
from distributed import written_then_spawned


def _model(depth: int = 3):
    return reference_dit(width=32, depth=depth, heads=2).eval().requires_grad_(False)


def _on(inputs, device):
    return tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in inputs)


def _snapshot(model: nn.Module) -> dict:
    return {n: (type(p), p.device, p.detach().clone()) for n, p in model.named_parameters()}


def _same_as(model: nn.Module, snap: dict) -> bool:
    now = dict(model.named_parameters())
    return now.keys() == snap.keys() and all(
        type(now[n]) is t and now[n].device == d and torch.equal(now[n].detach(), v)
        for n, (t, d, v) in snap.items())


def test_offload_then_compile_is_exact_twice_and_release_gives_it_back():
    model = _model()
    inputs = example_inputs(model.config)
    with torch.inference_mode():
        want = model(*inputs)
    snap = _snapshot(model)
    assert dlo_fx.offload(model, options={"num_slots": 2}) is model
    stored = [p for p in model.parameters() if is_stored(p)]
    assert stored and all(p.device == torch.device("cpu") for p in stored)
    compiled = torch.compile(model, backend="dlo")  # inherits the options
    with torch.inference_mode():
        assert torch.equal(compiled(*inputs), want)
        assert torch.equal(compiled(*inputs), want)
    dlo_fx.release(model)
    assert _same_as(model, snap)
    # Offloaded again with other options, as on the first day
    dlo_fx.offload(model, options={"num_slots": 3})
    model.compile(backend="dlo")
    with torch.inference_mode():
        assert torch.equal(model(*inputs), want)
    dlo_fx.release(model)
    assert _same_as(model, snap)


def test_state_says_what_dlo_holds_of_a_module():
    """``dlo_fx.state``: None for a module dlo never held; the runtime's facts (options,
    device, mode, blocks) for an offloaded one and each of its submodules; released after
    `release`. A frozen copy: changing it changes nothing."""
    model = _model()
    assert dlo_fx.state(model) is None
    dlo_fx.offload(model, options={"num_slots": 3, "device": "cpu"})
    state = dlo_fx.state(model)
    assert not state.released and state.config.num_slots == 3 and state.guarded
    assert same_device(state.device, "cpu") and state.mode == "rank_local"
    assert state.blocks == len(runtimes_holding(list(model.parameters()))[0].store.blocks) > 0
    assert state.stored == sum(is_stored(p) for p in model.parameters()) > 0
    block = dlo_fx.state(model.blocks[0])
    assert block.config is state.config and 0 < block.stored < state.stored
    with pytest.raises(AttributeError):
        state.mode = "allgather"  # frozen
    dlo_fx.release(model)
    assert dlo_fx.state(model) == dlo_fx.DLOState(released=True)
    with pytest.raises(TypeError, match="dlo_fx.state takes a torch module"):
        dlo_fx.state(model.state_dict())


def test_release_gives_back_what_the_guards_shadowed():
    """The guards' instance attributes over a module's methods (``_apply``) replace, while
    the module is dlo's, what the instance held under that name; release puts that back
    (it was dropped: the module lost its own attribute)."""
    model = _model()
    block = model.blocks[0]
    own = block._apply  # a bound method held by the instance, as a wrapper would
    vars(block)["_apply"] = own
    dlo_fx.offload(model)
    assert vars(block)["_apply"] is not own  # guarded
    dlo_fx.release(model)
    assert vars(block)["_apply"] is own and "_apply" not in vars(model.blocks[1])


def test_offload_and_load_attach_alike(tmp_path):
    """One attach sequence ([Note: one attach sequence]): a model offloaded and the same
    model loaded from its checkpoint hold the same facts: the same state, why each host
    block ends, and the parameters named in ``resident=`` kept resident by name."""
    from safetensors.torch import save_file
    from dlo_fx.apps.models import ReferenceDiT
    from dlo_fx.runtime.runtime import NAMED_RESIDENT

    model = _model()
    path = str(tmp_path / "dit.safetensors")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path)
    options = {"device": "cpu", "block_bytes": 40_000}
    loaded = dlo_fx.load(ReferenceDiT, path, config=model.config, options=options,
                         resident=["final_adaLN"])
    dlo_fx.offload(model, options, resident=["final_adaLN"])
    facts = []
    for m in (model, loaded):
        runtime = runtimes_holding(list(m.parameters()))[0]
        named = sorted(n for n, p in m.named_parameters()
                       if runtime.kept_resident.get(p) == NAMED_RESIDENT)
        facts.append((dlo_fx.state(m), runtime.attachment.block_ends, named,
                      runtime.attachment.home, int(runtime.attachment.undo_moves is not None),
                      m.training,
                      any(p.requires_grad for p in m.parameters())))
    assert facts[0][2] and facts[0][2] == facts[1][2]
    assert facts[0][:2] == facts[1][:2] and facts[0][5:] == facts[1][5:] == (False, False)
    assert facts[0][3:5] == (torch.device("cpu"), 1) and facts[1][3:5] == (None, 0)


def test_a_compile_sets_trace_for_itself_on_an_offloaded_model():
    """``trace`` is an option each compile sets for itself (`PER_COMPILE_OPTIONS`): a model
    offloaded without it and compiled with it records the schedule's spans."""
    from dlo_fx.runtime.weights.owners import runtimes_holding

    model = _model()
    inputs = example_inputs(model.config)
    dlo_fx.offload(model)
    runtime = runtimes_holding(list(model.parameters()))[0]
    compiled = torch.compile(model, backend="dlo", options={"trace": True})
    with torch.inference_mode():
        compiled(*inputs)
    assert runtime.machine.tracer is not None and runtime.machine.tracer.spans
    dlo_fx.release(model)


def test_offload_to_meta_traces_plans_and_runs_and_release_restores_the_values():
    model = _model()
    inputs = example_inputs(model.config)
    with torch.inference_mode():
        want = model(*inputs)
    snap = _snapshot(model)
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    dlo_fx.offload(model, options={"device": "meta"})
    assert all(p.device.type == "meta" for p in model.parameters())
    assert all(b.device.type == "meta" for b in model.buffers())
    compiled = torch.compile(model, backend="dlo")
    with torch.inference_mode():
        out = compiled(*_on(inputs, "meta"))
    assert out.device.type == "meta" and out.shape == want.shape and out.dtype == want.dtype
    assert "num_blocks" in str(dlo_fx.memory_report(model))
    dlo_fx.release(model)  # the host store held the real bytes all along
    assert _same_as(model, snap)
    assert all(torch.equal(b, buffers[n]) for n, b in model.named_buffers())
    with torch.inference_mode():
        assert torch.equal(model(*inputs), want)


def test_load_and_compile_on_meta(tmp_path):
    from dlo_fx.apps.engine.reference_pipeline import write_checkpoint
    from dlo_fx.apps.models import ReferenceDiT

    write_checkpoint(str(tmp_path), width=32, depth=3, heads=2)
    config = {"width": 32, "depth": 3, "heads": 2}
    for store in ("memory", "mmap"):
        model = dlo_fx.load(ReferenceDiT, str(tmp_path), config=config,
                            options={"device": "meta", "host_store": store})
        assert all(p.device.type == "meta" for p in model.parameters())
        with torch.inference_mode():
            out = torch.compile(model, backend="dlo")(
                *_on(example_inputs(model.config), "meta"))
        assert out.device.type == "meta" and out.shape == (1, 4, 16, 16)
        del model, out
        torch._dynamo.reset()


def test_one_device_identity():
    assert canonical_device("cpu:0") == canonical_device("cpu") == torch.device("cpu")
    assert canonical_device("meta") == torch.device("meta")
    assert same_device("cpu:0", torch.device("cpu", 0))
    # A model on the host offloaded for "cpu:0" computes on the host, exact
    model = _model(2)
    inputs = example_inputs(model.config)
    with torch.inference_mode():
        want = model(*inputs)
        dlo_fx.offload(model, options={"device": "cpu:0"})
        assert torch.equal(torch.compile(model, backend="dlo", options={"device": "cpu:0"})(
            *inputs), want)
    torch._dynamo.reset()
    dlo_fx.release(model)
    dlo_fx.offload(model, options={"device": "cpu:0"})
    with torch.inference_mode():
        assert torch.equal(torch.compile(model, backend="dlo")(*inputs), want)
    dlo_fx.release(model)


def test_offload_refuses_before_changing_anything():
    model = _model(2)
    snap = _snapshot(model)
    with pytest.raises(TypeError, match="takes a torch module"):
        dlo_fx.offload(object())
    with pytest.raises(ValueError, match="resident='nope' names no parameter"):
        dlo_fx.offload(model, resident=["nope"])
    assert _same_as(model, snap)
    with pytest.raises(ValueError, match="DLOConfig option 'num_slots'"):
        dlo_fx.offload(model, options={"num_slots": 1})
    assert _same_as(model, snap)
    # Compiled by another backend first: its graphs would keep the weights as traced
    other = _model(2)
    other.compile(backend="eager")
    with pytest.raises(ValueError, match="already compiled with backend 'eager'"):
        dlo_fx.offload(other)
    with pytest.raises(ValueError, match="not the torch.compile wrapper of a ReferenceDiT"):
        dlo_fx.offload(torch.compile(model, backend="dlo"))
    assert _same_as(model, snap)
    # Twice; and a module sharing a parameter with an offloaded one
    dlo_fx.offload(model)
    with pytest.raises(ValueError, match=r"parameter 'modulation_table' .* already stored by dlo"):
        dlo_fx.offload(model)
    holder = nn.Sequential(model.blocks[0])
    with pytest.raises(ValueError, match=r"parameter '0\..*' .* already stored by dlo"):
        dlo_fx.offload(holder)
    dlo_fx.release(model)
    assert _same_as(model, snap)
    # Parameters without weights
    meta = nn.Linear(4, 4, device="meta")
    with pytest.raises(ValueError, match="parameter 'weight' is on the meta device"):
        dlo_fx.offload(meta)
    # A model that contains itself (an attribute set on its compile wrapper lands on it)
    looped = _model(2)
    torch.compile(looped, backend="dlo").keep = looped
    with pytest.raises(ValueError, match=r"ReferenceDiT contains itself: submodule 'keep'"):
        dlo_fx.offload(looped)
    compiled = torch.compile(looped, backend="dlo")
    with torch.inference_mode(), pytest.raises(ValueError, match="no dlo runtime holds"):
        compiled(*example_inputs(looped.config))  # never offloaded: refused
    del looped.keep
    assert not any(is_stored(p) for p in looped.parameters())


def test_compile_pipeline_offloads_before_tracing_and_runs_on_meta():
    pytest.importorskip("diffusers")
    from diffusers_pipelines import flux

    pipe = flux(seed=0)
    transformer = pipe.transformer
    dlo_fx.compile_pipeline(pipe, options={"device": "meta"})
    # Offloaded before anything traced; the VAE is not moved to meta (it would lose values)
    for name in ("transformer", "text_encoder", "text_encoder_2"):
        assert all(p.device.type == "meta" for p in getattr(pipe, name).parameters()), name
    assert all(p.device.type == "cpu" for p in pipe.vae.parameters())
    kwargs = {k: v.to("meta") if isinstance(v, torch.Tensor) else v
              for k, v in flux_inputs(transformer).items()}
    with torch.inference_mode():
        out = transformer(**kwargs).sample
    assert out.device.type == "meta" and out.shape == kwargs["hidden_states"].shape
    dlo_fx.release(pipe)
    for name in ("transformer", "text_encoder", "text_encoder_2"):
        assert all(p.device.type == "cpu" and not is_stored(p)
                   for p in getattr(pipe, name).parameters()), name


def flux_inputs(transformer) -> dict:
    cfg = transformer.config
    gen = torch.Generator().manual_seed(1)
    tokens, text = 16, 8
    return dict(
        hidden_states=torch.randn(1, tokens, cfg.in_channels, generator=gen),
        encoder_hidden_states=torch.randn(1, text, cfg.joint_attention_dim, generator=gen),
        pooled_projections=torch.randn(1, cfg.pooled_projection_dim, generator=gen),
        timestep=torch.tensor([0.5]),
        img_ids=torch.zeros(tokens, 3), txt_ids=torch.zeros(text, 3),
        guidance=torch.tensor([3.5]) if cfg.guidance_embeds else None)


def test_an_offloaded_model_that_moved_buffers_is_collected():
    """What `release` needs to undo a move is held weakly: the model, its runtime and its
    host store go with the last reference to the model (tests/conftest.py checks every
    test's runtimes too)."""
    model = _model(2)
    dlo_fx.offload(model, options={"device": "meta"})  # buffers move: undo steps kept
    with torch.inference_mode():
        out = torch.compile(model, backend="dlo")(*_on(example_inputs(model.config), "meta"))
    assert out.device.type == "meta"
    runtime = owner_of(model.parameters())
    assert runtime is not None and len(runtime.store.blocks) > 0
    gone = [weakref.ref(model), weakref.ref(runtime), weakref.ref(runtime.store)]
    del model, runtime
    torch._dynamo.reset()
    gc.collect()
    assert [ref() for ref in gone] == [None, None, None]


def test_a_model_compiled_without_offload_is_refused_and_left_usable():
    """See [Note: one way in] in dynamo/backend.py: the first graph of a model never
    offloaded is refused at once, as a ValueError past Dynamo naming the fix, before
    anything changes; the model still runs eagerly, and offloaded (the fix) the same
    compiled handle streams it: the first graph stores nothing (every layer stored at the
    offload, though a graph break in each block makes the first graph read one layer), and
    another model of the class, offloaded, reuses the graphs."""
    def fresh():
        return reference_dit(width=32, depth=3, heads=2,
                             graph_break_in_blocks=True).eval().requires_grad_(False)

    model = fresh()
    inputs = example_inputs(model.config)
    with torch.inference_mode():
        want = model(*inputs)
    snap = _snapshot(model)
    compiled = torch.compile(model, backend="dlo")
    with torch.inference_mode(), pytest.raises(ValueError) as caught:
        compiled(*inputs)
    err = caught.value
    assert not isinstance(err, torch._dynamo.exc.BackendCompilerFailed)
    assert str(err).startswith("dlo: torch.compile(..., backend='dlo') traced a graph "), err
    assert "parameters ('" in str(err) and "no dlo runtime holds" in str(err), err
    assert "Call dlo_fx.offload(model, options) first" in str(err), err
    assert _same_as(model, snap) and dlo_fx.state(model) is None
    with torch.inference_mode():
        assert torch.equal(model(*inputs), want)  # still an ordinary module
    dlo_fx.offload(model, options={"num_slots": 2})
    with torch.inference_mode():
        assert torch.equal(compiled(*inputs), want)
        for block in model.blocks:  # every layer stored by the offload
            assert is_stored(block.qkv.weight)
        assert torch.equal(compiled(*inputs), want)
    other = fresh()
    other.load_state_dict(model.state_dict())  # the real weights (model/guard.py)
    dlo_fx.offload(other, options={"num_slots": 2})
    with torch.inference_mode():
        assert torch.equal(torch.compile(other, backend="dlo")(*inputs), want)
        assert is_stored(other.blocks[2].qkv.weight)
        assert torch.equal(compiled(*inputs), want)
    dlo_fx.release(other)
    dlo_fx.release(model)
    assert _same_as(model, snap)


def test_a_graph_over_two_models_never_offloaded_is_refused_before_anything_changes():
    """One graph streams one model: the models' classes are read from the graph (Dynamo
    records the call of each), neither is touched."""
    first, second = _model(2), _model(2)
    inputs = example_inputs(first.config)
    snaps = _snapshot(first), _snapshot(second)

    def both(*args):
        return first(*args) + second(*args)

    with torch.inference_mode(), pytest.raises(ValueError) as caught:
        torch.compile(both, backend="dlo")(*inputs)
    err = caught.value
    assert "ReferenceDiT and ReferenceDiT" in str(err) and "each model" in str(err)
    assert "compile it on its own" in str(err)
    assert _same_as(first, snaps[0]) and _same_as(second, snaps[1])


def test_inputs_on_another_device_are_refused_naming_the_compute_device():
    """See [Note: inputs on the compute device] in model/input_device.py: a model offloaded
    for the meta device (standing in for an accelerator) called with host inputs raised
    Dynamo's "Tensor device mismatch" (compiled) or torch's own error (eager), with no word
    of dlo; it names dlo's device and the fix, compiled and eager, before anything runs,
    and the same handle then runs with the inputs moved. After release the check is gone."""
    model = _model(2)
    inputs = example_inputs(model.config)
    dlo_fx.offload(model, options={"device": "meta"})
    compiled = torch.compile(model, backend="dlo")
    for run in (compiled, model):
        with torch.inference_mode(), pytest.raises(ValueError) as caught:
            run(*inputs)
        message = str(caught.value)
        assert message.startswith("dlo: ReferenceDiT computes on meta"), message
        assert "argument 0 is a tensor on cpu" in message, message
        assert "x.to('meta')" in message and "options={'device': 'cpu'}" in message, message
    with torch.inference_mode():
        out = compiled(*_on(inputs, "meta"))
    assert out.device.type == "meta" and out.shape == inputs[0].shape
    dlo_fx.release(model)
    with torch.inference_mode():
        model(*inputs)  # an ordinary module again, on the host


class _ViewReadLate(nn.Module):
    """A view of ``a.weight`` read after two later layers ran: on two slots, the third
    layer's copy goes to ``a``'s slot, so the view must keep it until its last read."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (nn.Linear(16, 16) for _ in range(3))

    def forward(self, x):
        wt = self.a.weight.t()
        return self.c(self.b(x @ wt)) @ wt


@pytest.mark.parametrize("how", ["offload", "compile"])
def test_a_view_of_a_stored_weight_keeps_its_slot_until_its_last_read(how):
    """The planning stages follow a weight's views by their storage; a stored weight's
    traced views share one (runtime/weights/stored.py, `FAKE_STAND_IN`)."""
    torch.manual_seed(0)
    model = _ViewReadLate().requires_grad_(False)
    x = torch.randn(2, 16)
    want = model(x)
    options = {"num_slots": 2, "block_bytes": 1, "resident_bytes": 0}
    dlo_fx.offload(model, options=options)
    if how == "offload":
        options = None  # inherited; else given again to torch.compile
    compiled = torch.compile(model, backend="dlo", options=options, fullgraph=True)
    with torch.no_grad():
        assert torch.equal(compiled(x), want)
        assert torch.equal(compiled(x), want)
    dlo_fx.release(model)


def test_parameters_that_are_views_of_other_tensors_offload_load_compile_and_release(tmp_path):
    """A parameter with a storage offset (q and k of one fused tensor), a transposed view,
    a strided slice and an empty parameter: offloaded and loaded, exact eagerly and
    compiled (a stored weight starts at its own bytes: it had the view's storage offset,
    which Dynamo's fake copy failed to reproduce), and exact after release, each a tensor
    of its own (`layout_cases.views_case`)."""
    layout_cases.write_case(0, 1, str(tmp_path))
    for case, got in layout_cases.views_case(0, 1, str(tmp_path)).items():
        assert all(got), (case, got)


def _views_on_two_ranks():
    return written_then_spawned(layout_cases.write_case, layout_cases.views_case)


@pytest.mark.spawned.with_args(_views_on_two_ranks)
def test_parameters_that_are_views_on_two_ranks_both_modes(spawned):
    for rank, out in spawned.items():
        assert len(out) == 4, (rank, out)
        for case, got in out.items():
            assert all(got), (rank, case, got)


class _Buffered(nn.Module):
    """Two linear layers sharing a scale buffer, a persistent and a non-persistent buffer."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)
        scale = torch.rand(16)
        self.a.register_buffer("scale", scale)
        self.b.register_buffer("scale", scale)
        self.register_buffer("shift", torch.randn(16))
        self.register_buffer("table", torch.randn(16), persistent=False)
        self.eval().requires_grad_(False)

    def forward(self, x):
        return self.b(self.a(x) * self.a.scale + self.shift) * self.b.scale + self.table


def _with_a_meta_cache():
    """A `_Buffered` with an unread buffer on the meta device; an input, its output and
    its `_state`."""
    x = torch.randn(2, 16)
    model = _Buffered()
    model.register_buffer("cache", torch.empty(16, device="meta"), persistent=False)
    with torch.no_grad():
        want = model(x)
    return model, x, want, _state(model)


def _state(model: nn.Module) -> dict:
    """Every parameter and buffer (non-persistent ones too): class, device, values."""
    members = [*model.named_parameters(), *model.named_buffers()]
    return {n: (type(t), t.device, t.detach().clone()) for n, t in members}


def _same_state(model: nn.Module, state: dict) -> bool:
    now = _state(model)
    return now.keys() == state.keys() and all(
        now[n][:2] == state[n][:2] and (t.is_meta or torch.equal(now[n][2], t))
        for n, (_, _, t) in state.items())


def test_offload_checks_every_member_it_moves_before_anything_changes():
    """A buffer that cannot move (on the meta device: no values) is refused naming it
    before any weight is stored, the model as it was (every weight was stored, then
    torch's NotImplementedError left it offloaded); a module with buffers and no
    parameters is refused (offloaded to meta, release could not find it to give the
    buffers' values back). See [Note: what offload moves] in loading/offload.py."""
    from dlo_fx.runtime.weights.owners import runtimes_holding

    model, x, want, state = _with_a_meta_cache()
    for storage in (None, torch.float8_e4m3fn):  # refused before weights are rounded to it
        with pytest.raises(ValueError, match=r"buffer 'cache' is on the meta device \(it has "
                                             r"no values to move to cpu\); nothing was changed"):
            dlo_fx.offload(model, options={"block_bytes": 1, "resident_bytes": 0,
                                           "storage_dtype": storage})
        assert _same_state(model, state) and dlo_fx.state(model) is None
    with torch.no_grad():
        assert torch.equal(model(x), want)
    norm = nn.BatchNorm1d(8, affine=False).eval()
    norm.running_mean.normal_()
    state = _state(norm)
    with pytest.raises(ValueError, match="BatchNorm1d has no parameters, so dlo has nothing "
                                         "to store"):
        dlo_fx.offload(norm, options={"device": "meta"})
    assert _same_state(norm, state)


def test_release_puts_every_buffer_back_where_offload_moved_it():
    """Offloaded to meta, the buffers (persistent, non-persistent, one shared by two
    layers) move there and come back with their values, the shared one one tensor again;
    a buffer on meta already stays there."""
    model, x, want, state = _with_a_meta_cache()
    dlo_fx.offload(model, options={"device": "meta", "block_bytes": 1, "resident_bytes": 0})
    assert all(b.is_meta for b in model.buffers()) and model.a.scale is model.b.scale
    with torch.inference_mode():
        out = torch.compile(model, backend="dlo")(x.to("meta"))
    assert out.is_meta and out.shape == want.shape
    dlo_fx.release(model)
    assert _same_state(model, state) and model.a.scale is model.b.scale
    assert model.cache.is_meta
    with torch.no_grad():
        assert torch.equal(model(x), want)
