"""Bit-identity of `backend="dlo"` against the resident model, across models and options."""

from __future__ import annotations

import types

import pytest
import torch

from dlo_fx.runtime.device.executor import fault_delay
import dlo_fx
from dlo_fx.planning.blocks import layer_key
from dlo_fx.runtime.host.layout import span_bytes
from dlo_fx.runtime.weights.owners import runtimes_holding
from dlo_fx.runtime.weights.stored import is_stored

from models import MODELS, call, offloaded, run_dlo, tiny_dit


def largest_layer_bytes(model: torch.nn.Module) -> int:
    sizes: dict[str, int] = {}
    for name, p in model.named_parameters():
        sizes[layer_key(name)] = sizes.get(layer_key(name), 0) + span_bytes(p)
    return max(sizes.values())


BUDGETS = ["default", "half", "three"]


def budget_options(factory, budget: str, num_slots: int) -> dict:
    options = {"num_slots": num_slots}
    if budget != "default":
        layer = largest_layer_bytes(factory()[0])
        options["block_bytes"] = layer // 2 if budget == "half" else 3 * layer
    return options


# Every (budget, slots) for the reference DiT; for the diffusers models (a compile of a few
# seconds each) a pairwise cover: each model meets every budget and both slot counts, and
# every (budget, slots) pair is run by one of them.
FULLGRAPH_CASES = (
    [("dit", n, b) for b in BUDGETS for n in (2, 3)]
    + [("wan", 2, "default"), ("wan", 3, "half"), ("wan", 2, "three"),
       ("flux", 3, "default"), ("flux", 2, "half"), ("flux", 3, "three")])


@pytest.mark.parametrize("name,num_slots,budget", FULLGRAPH_CASES)
def test_bit_identical_fullgraph(name, num_slots, budget):
    factory = MODELS[name]
    ref, outs, model = run_dlo(factory, budget_options(factory, budget, num_slots))
    for out in outs:
        assert torch.equal(out, ref)
    report = dlo_fx.memory_report(model)
    assert report.num_blocks >= 1
    assert report.slot_bytes == num_slots * report.max_block_bytes


@pytest.mark.parametrize("num_slots", [2, 3])
@pytest.mark.parametrize("budget", BUDGETS)
def test_bit_identical_with_graph_break(num_slots, budget):
    """A graph break inside every layer: Dynamo compiles each half of DiTBlock.forward once
    and reuses it for every layer, passing that layer's parameters. The schedule must
    follow the parameters passed at run time."""
    options = budget_options(tiny_dit, budget, num_slots)
    ref, outs, model = run_dlo(tiny_dit, options, calls=3, fullgraph=False, depth=4,
                               graph_break=True)
    for out in outs:
        assert torch.equal(out, ref)
    runtime = runtimes_holding(list(model.parameters()))[0]
    for i in range(4):  # every layer's weights were streamed, not just layer 0's
        assert model.blocks[i].qkv.weight in runtime.store


def test_a_frame_left_eager_by_a_graph_break_is_told_how_to_keep_its_modules():
    """A graph break inside the loop over the blocks leaves the forward around the loop
    eager: its modules' weights are fetched every call (exact, warned once, naming the
    ``resident=`` that keeps them on the device); named there, nothing is read eagerly."""
    import warnings

    ref, inputs = tiny_dit(graph_break=True)
    with torch.no_grad():
        want = ref(*inputs)
    outer = ["patch_embed", "proj_out", "text_proj", "time_embed", "final_adaLN"]
    for resident in ([], outer):
        torch._dynamo.reset()
        model, _ = tiny_dit(graph_break=True)
        dlo_fx.offload(model, {"device": "cpu"}, resident=resident)
        compiled = torch.compile(model, backend="dlo")
        with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert all(torch.equal(compiled(*inputs), want) for _ in range(2))
        said = [str(w.message) for w in caught if "outside a scheduled graph" in str(w.message)]
        if resident:
            assert said == []
        else:
            assert len(said) == 1 and "resident=['patch_embed', ...]" in said[0], said


def _break_before_every_block(model: torch.nn.Module) -> None:
    """A forward pre-hook on every transformer block that forces a graph break."""
    def brk(module, args):
        torch._dynamo.graph_break()

    for name in ("blocks", "transformer_blocks", "single_transformer_blocks"):
        for block in getattr(model, name, ()):
            block.register_forward_pre_hook(brk)


@pytest.mark.parametrize("name,num_slots", [("wan", 2), ("flux", 3)])
def test_diffusers_with_forced_graph_breaks(name, num_slots):
    factory = MODELS[name]
    ref_model, inputs = factory()
    with torch.no_grad():
        ref = call(ref_model, inputs)
    model, _ = factory()
    _break_before_every_block(model)
    graphs = []

    def count(gm, ctx):
        graphs.append(gm)
        return gm

    options = {"num_slots": num_slots, "user_passes": [count]}
    compiled = torch.compile(offloaded(model, options), backend="dlo", options=options)
    with torch.no_grad():
        outs = [call(compiled, inputs) for _ in range(2)]
    assert len(graphs) > 1  # the breaks really split the model
    for out in outs:
        assert torch.equal(out, ref)


@fault_delay(0.01)
def test_fault_injection_keeps_bit_identity():
    """Random delays on every copy: `wait` alone must order each slot."""
    ref, outs, _ = run_dlo(tiny_dit, {"block_bytes": 20_000}, calls=3)
    for out in outs:
        assert torch.equal(out, ref)


def test_wrap_around_prefetch_starts_next_call_warm():
    ref, outs, model = run_dlo(tiny_dit, {"num_slots": 2}, calls=1)
    runtime = runtimes_holding(list(model.parameters()))[0]
    # the same options: Dynamo reuses the first trace (no second trace of the model)
    compiled = torch.compile(model, backend="dlo", fullgraph=True, options={"num_slots": 2})
    blocks = dlo_fx.memory_report(model).num_blocks
    assert blocks > 2 and runtime.machine.copies == blocks + 2  # every block, then the ring of 2
    before = runtime.machine.copies
    with torch.no_grad():
        out = call(compiled, tiny_dit()[1])
    assert torch.equal(out, ref)
    # blocks 0 and 1 were prefetched by the previous call's ring: not copied again.
    assert runtime.machine.copies - before == (blocks - 2) + 2


def test_parameters_end_stored_and_an_eager_call_is_exact_with_a_warning():
    ref, _, model = run_dlo(tiny_dit, None, calls=1)
    streamed = [p for p in model.parameters() if is_stored(p)]
    assert streamed and all(p.numel() > 0 for p in streamed)
    reference, inputs = tiny_dit()
    with pytest.warns(RuntimeWarning, match="read outside a scheduled graph"), torch.no_grad():
        assert torch.equal(model(*inputs), reference(*inputs))
    assert all(is_stored(p) for p in streamed)


def test_grad_mode_with_trainable_parameters_is_refused():
    model, inputs = tiny_dit()
    offloaded(model).requires_grad_(True)
    blocks = dlo_fx.state(model).blocks
    compiled = torch.compile(model, backend="dlo", fullgraph=True)
    with pytest.raises(NotImplementedError, match="inference only"):  # not wrapped by Dynamo
        compiled(*inputs)
    # nothing changed: the blocks the offload stored, no more
    assert dlo_fx.state(model).blocks == blocks


def test_grad_mode_with_inputs_that_require_grad_is_refused():
    """Autograd through streamed blocks saved views of the slots, which later blocks
    overwrite before backward (which raised autograd's in-place error): refused at compile,
    naming the input; the model is left as it was and runs exactly under no_grad."""
    model, inputs = tiny_dit()
    ref, _ = tiny_dit()
    compiled = torch.compile(offloaded(model), backend="dlo")
    blocks = dlo_fx.state(model).blocks
    wants_grad = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
    with pytest.raises(NotImplementedError,
                       match=r"inference only, but input L\['latents'\] requires grad"):
        compiled(*wants_grad)
    assert dlo_fx.state(model).blocks == blocks
    with torch.no_grad():
        assert torch.equal(compiled(*inputs), ref(*inputs))


def test_entry_point_registers_backend():
    from importlib.metadata import entry_points

    names = {ep.name: ep.value for ep in entry_points(group="torch_dynamo_backends")}
    assert names.get("dlo") == "dlo_fx.dynamo.backend:dlo_backend"
    assert "dlo" in torch._dynamo.list_backends(exclude_tags=())


def test_first_call_under_inference_mode_with_stored_resident_table(tmp_path):
    """Slots and resident copies made during an inference_mode call are written by the
    copy worker thread, which is not in inference mode."""
    from safetensors.torch import save_file

    from dlo_fx.apps.models import ReferenceDiT

    ref_model, inputs = tiny_dit(depth=3)
    path = tmp_path / "dit.safetensors"
    save_file({k: v.contiguous() for k, v in ref_model.state_dict().items()}, str(path))
    model = dlo_fx.load(lambda: ReferenceDiT(ref_model.config), str(path),
                        options={"block_bytes": 300_000})
    compiled = torch.compile(model, backend="dlo", options={"block_bytes": 300_000})
    with torch.inference_mode():
        ref = call(ref_model, inputs)
        assert all(torch.equal(call(compiled, inputs), ref) for _ in range(2))


class _SkipLayers(torch.nn.Module):
    """Blocks skipped by a list argument, as in ``SD3Transformer2DModel(...,
    skip_layers=[...])`` (skip-layer guidance)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(4))

    def forward(self, x: torch.Tensor, skip_layers=None) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if not (skip_layers is not None and i in skip_layers):
                x = block(x)
        return x


def _skip_layers_compiled(cls: type = _SkipLayers) -> tuple:
    """A model of ``cls`` compiled with dlo, its resident twin and an input."""
    torch.manual_seed(0)
    ref = cls().eval().requires_grad_(False)
    model = cls().eval().requires_grad_(False)
    model.load_state_dict(ref.state_dict())
    compiled = torch.compile(offloaded(model, {"block_bytes": 20_000}), backend="dlo")
    return model, compiled, ref, torch.randn(2, 64)


def test_blocks_skipped_by_a_list_argument_whose_values_change():
    """Once ``skip_layers`` changed from ``[1]`` to ``[0, 2]``, Dynamo made its first element
    a SymInt and evaluated ``0 in [s0, 2]`` as False with no guard: block 0 ran though it
    was skipped, a wrong output and no error (with ``backend="eager"`` too). See [Note: `x
    in list` with a symbolic element] (dlo_fx/torch_private.py)."""
    model, compiled, ref, x = _skip_layers_compiled()
    with torch.no_grad():
        for skip in (None, [1], None, [0, 2], [1], [3], (0, 3), [2, 1]):
            assert torch.equal(compiled(x, skip), ref(x, skip)), skip
    assert any(is_stored(p) for p in model.parameters())  # streamed


def test_contains_fix_only_where_torch_needs_it_and_only_for_dlo(monkeypatch):
    """[Note: `x in list` with a symbolic element]: the correction is installed on a torch
    older than the first one with the upstream fix only, and where it is, it corrects the
    frames traced for dlo and leaves every other compile to Dynamo's own function."""
    import torch._dynamo.utils as dynamo_utils

    from dlo_fx import torch_private

    needed = torch.torch_version.TorchVersion(torch.__version__) < \
        torch_private.CONTAINS_FIXED_IN
    assert getattr(dynamo_utils.iter_contains, "__dlo_fixed__", False) == needed
    if not needed:
        return
    corrected: list[str] = []
    through_eq = torch_private._contains_through_eq
    monkeypatch.setattr(torch_private, "_contains_through_eq",
                        lambda *a: corrected.append("x") or through_eq(*a))

    def skipping(x: torch.Tensor, skip: list) -> torch.Tensor:  # a code object of its own
        for i in range(3):
            if i not in skip:
                x = x + (i + 1)
        return x

    eager = torch.compile(skipping, backend="eager")
    for skip in ([1], [0, 2], [1, 2]):  # the second call makes ``skip[0]`` a SymInt
        eager(torch.zeros(1), skip)
    assert corrected == []  # another backend's frames: Dynamo's function as it is

    # _SkipLayers' forward as a code object of its own, which Dynamo has not traced yet
    forward = _SkipLayers.forward
    SkipLayersAgain = type("SkipLayersAgain", (_SkipLayers,), {"forward": types.FunctionType(
        forward.__code__.replace(), forward.__globals__, "forward")})
    _, compiled, ref, x = _skip_layers_compiled(SkipLayersAgain)
    with torch.no_grad():
        for skip in ([1], [0, 2]):
            assert torch.equal(compiled(x, skip), ref(x, skip)), skip
    assert corrected  # the frame traced for dlo went through the correction
