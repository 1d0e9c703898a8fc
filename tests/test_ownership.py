"""The model owns its runtime: options given once and inherited, memory given back when
the model goes, stored parameters safe under ordinary module operations, harmful
options refused up front, and no import from the runtime up into the planning."""

from __future__ import annotations

import ast
import copy
import gc
import re
import math
import os
import pathlib
import tempfile
import threading
import time
import warnings
from typing import Any, Callable, Optional

import pytest
import torch

import dlo_fx
from distributed import in_child, spawn
from dlo_fx.config import DLOConfig
from dlo_fx.apps.models import ReferenceDiT, example_inputs, reference_dit
from dlo_fx.runtime.device import shared_slots
from dlo_fx.runtime.weights.owners import live_runtimes, runtimes_holding
from dlo_fx.runtime.weights.stored import is_stored
from lifetime import collect_all
from loader_cases import resident_dit, save_dit
from models import offloaded, run_dlo, tiny_dit, tiny_flux

import ownership_cases

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def dit(tmp_path_factory):
    path, config = save_dit(str(tmp_path_factory.mktemp("own")))
    ref = resident_dit(path, config)
    inputs = example_inputs(config, batch=2, height=8, width=8, seed=1)
    with torch.no_grad():
        expected = ref(*inputs)
    return {"path": path, "config": config, "inputs": inputs, "expected": expected}


def run(model, inputs):
    with torch.no_grad():
        return model(*inputs)


# -- options given once -----------------------------------------------------------------------
def test_load_then_compile_without_options_inherits(dit):
    options = {"num_slots": 3, "block_bytes": 120_000}
    model = dlo_fx.load(ReferenceDiT, dit["path"], config=dit["config"], options=options)
    out = run(torch.compile(model, backend="dlo"), dit["inputs"])
    assert torch.equal(out, dit["expected"])
    runtimes = runtimes_holding(list(model.parameters()))
    assert len(runtimes) == 1
    runtime = runtimes[0]
    assert runtime.config.num_slots == 3 and runtime.slots.num_slots == 3
    assert runtime.config.block_bytes == 120_000 and len(runtime.store.blocks) > 3


def test_conflicting_options_refused_and_model_intact(dit):
    model = dlo_fx.load(ReferenceDiT, dit["path"], config=dit["config"],
                        options={"num_slots": 3})
    runtime = runtimes_holding(list(model.parameters()))[0]
    blocks, host = len(runtime.store.blocks), runtime.store.host_bytes
    bad = torch.compile(model, backend="dlo",
                        options={"num_slots": 2, "resident_bytes": 4096, "dump_dir": None})
    with pytest.raises(ValueError) as info:  # not wrapped by Dynamo
        run(bad, dit["inputs"])
    err = info.value
    assert isinstance(err, ValueError), err
    assert "num_slots=2" in str(err) and "resident_bytes=4096" in str(err)
    assert "dump_dir=" not in str(err)  # a compile option never conflicts
    assert "dlo_fx.release" in str(err)
    # Nothing changed: same runtime, same store; the model compiles and runs.
    assert runtimes_holding(list(model.parameters())) == [runtime]
    assert (len(runtime.store.blocks), runtime.store.host_bytes) == (blocks, host)
    torch._dynamo.reset()
    assert torch.equal(run(torch.compile(model, backend="dlo",
                                         options={"num_slots": 3, "trace": True}),
                           dit["inputs"]), dit["expected"])


def test_conflict_found_when_dynamo_reuses_a_graph(dit):
    """Dynamo reuses a graph for another model of the class compiled with the same
    options, without calling the backend: the call binds to the second model's runtime
    and refuses options that differ from it."""
    first = dlo_fx.load(ReferenceDiT, dit["path"], config=dit["config"],
                        options={"num_slots": 3})
    options = {"num_slots": 3}
    assert torch.equal(run(torch.compile(first, backend="dlo", options=options),
                           dit["inputs"]), dit["expected"])
    second = dlo_fx.load(ReferenceDiT, dit["path"], config=dit["config"],
                         options={"num_slots": 4})
    with pytest.raises(ValueError, match="num_slots=3"):
        run(torch.compile(second, backend="dlo", options=options), dit["inputs"])
    third = dlo_fx.load(ReferenceDiT, dit["path"], config=dit["config"],
                        options={"num_slots": 3, "block_bytes": 100_000})
    out = run(torch.compile(third, backend="dlo", options=options), dit["inputs"])
    assert torch.equal(out, dit["expected"])  # bound to its own runtime, its own blocks
    runtime = runtimes_holding(list(third.parameters()))[0]
    assert runtime.config.block_bytes == 100_000
    assert runtime is not runtimes_holding(list(first.parameters()))[0]


def test_offloaded_model_options_given_once():
    model, inputs = tiny_dit()
    ref_model, _ = tiny_dit()
    expected = run(ref_model, inputs)
    offloaded(model, {"num_slots": 3})
    assert torch.equal(run(torch.compile(model, backend="dlo", options={"num_slots": 3}),
                           inputs), expected)
    with pytest.raises(ValueError) as info:  # not wrapped by Dynamo
        torch._dynamo.reset()
        run(torch.compile(model, backend="dlo", options={"num_slots": 2}), inputs)
    assert isinstance(info.value, ValueError) and "num_slots=2" in str(info.value)
    assert torch.equal(run(torch.compile(model, backend="dlo"), inputs), expected)


def test_graph_breaks_one_runtime_per_model():
    """Every graph of one model (a graph break in each layer) finds the model's runtime."""
    ref, outs, model = run_dlo(tiny_dit, {"num_slots": 2}, calls=2, fullgraph=False,
                               graph_break=True)
    assert all(torch.equal(o, ref) for o in outs)
    assert len(runtimes_holding(list(model.parameters()))) == 1


class _TwoDiTs(torch.nn.Module):
    """A model made of two sub-networks whose own ``forward`` Dynamo skips (as it does
    diffusers' Mochi's): each sub-network's ``forward`` is a frame of its own."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.first, self.second = tiny_dit(seed=seed)[0], tiny_dit(seed=seed + 1)[0]

    @torch.compiler.disable(recursive=False)
    def forward(self, x, t, text):
        return self.second(self.first(x, t, text), t, text)


def test_skipped_root_forward_one_runtime_per_model():
    """Graphs of frames below a skipped ``forward`` share the model's one runtime, found
    from their parameters; the output is exact."""
    _, inputs = tiny_dit()
    expected = run(_TwoDiTs(seed=3), inputs)
    model = offloaded(_TwoDiTs(seed=3), {"num_slots": 2, "resident_bytes": 0})
    compiled = torch.compile(model, backend="dlo")
    assert all(torch.equal(run(compiled, inputs), expected) for _ in range(2))
    runtimes = runtimes_holding(list(model.parameters()))
    assert len(runtimes) == 1
    assert all(p in runtimes[0].store for b in (*model.first.blocks, *model.second.blocks)
               for p in b.parameters())


class _Wrapper(torch.nn.Module):
    """A DiT behind a wrapper: the graph break in its layers ends the wrapper's graph at
    the call, so the DiT's ``forward`` is a frame of its own (guarded like the model)."""

    def __init__(self) -> None:
        super().__init__()
        self.dit = tiny_dit(graph_break=True)[0]

    def forward(self, x, t, text):
        return self.dit(x * 1.0, t, text)


def test_frames_past_the_recompile_limit_run_eagerly_and_exactly():
    """Past its recompile limit, Dynamo runs the wrapper's frame with its callback set to
    ``False`` (run only what was compiled): the DiT's frame guard refused that call as an
    eager one ("call it through torch.compile") although the user did; transformers'
    Qwen2.5-VL met it on its second image prompt. The hooks fetch what runs eagerly, and
    every resolution, before and past the limit, is exact."""
    model, reference = _Wrapper(), _Wrapper()
    model.load_state_dict(reference.state_dict())
    compiled = torch.compile(offloaded(model), backend="dlo", dynamic=False)
    with torch._dynamo.config.patch(recompile_limit=1), pytest.warns(RuntimeWarning):
        for size in (8, 16, 8, 24):
            inputs = example_inputs(model.dit.config, batch=2, height=size, width=size, seed=1)
            assert torch.equal(run(compiled, inputs), run(reference, inputs)), size


_STEP_MODEL = None


def _step(**kwargs):
    return _STEP_MODEL(**kwargs)[0]


def test_a_model_a_compiled_function_reaches_through_a_global_is_guarded():
    """``torch.compile(step)`` of a ``step`` calling a global model (no local of the frame
    names it, as a closure variable or an argument would): the model is guarded like a
    compiled one, and so is another model the global names later (Dynamo reuses the graph
    for it). Both were left unguarded: ``state_dict()`` returned `StoredWeight`s and
    ``.half()`` converted them half. An eager call of either is exact."""
    global _STEP_MODEL
    compiled = torch.compile(_step, backend="dlo")
    try:
        for seed in (0, 5):
            ref, inputs = tiny_flux(seed)
            _STEP_MODEL = offloaded(tiny_flux(seed)[0])
            model = _STEP_MODEL
            with torch.no_grad():
                expected = ref(**inputs)[0]
                assert all(torch.equal(compiled(**inputs), expected) for _ in range(2))
                assert torch.equal(_eagerly(model, **inputs)[0], expected)
            state = model.state_dict()
            assert all(torch.equal(state[k], v) for k, v in ref.state_dict().items())
            with pytest.raises(ValueError, match="host store"):
                model.half()
    finally:
        _STEP_MODEL = None


def _eagerly(model: torch.nn.Module, *args, **kwargs):
    """An eager call of a model with stored weights (exact; its warning is not checked)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return model(*args, **kwargs)


class _Pipe:
    """What a diffusers pipeline is to its transformer: not a module, holding one."""

    def __init__(self, transformer: torch.nn.Module) -> None:
        self.transformer = transformer


def test_a_model_a_compiled_function_reaches_through_an_argument_that_is_no_module():
    """``torch.compile(step)`` of a ``step(pipe, inputs)`` calling ``pipe.transformer``:
    each pipeline's transformer is guarded, the second through the reused graph."""
    compiled = torch.compile(lambda pipe, inputs: pipe.transformer(**inputs)[0], backend="dlo")
    for seed in (0, 5):
        ref, inputs = tiny_flux(seed)
        pipe = _Pipe(offloaded(tiny_flux(seed)[0]))
        with torch.no_grad():
            assert torch.equal(compiled(pipe, inputs), ref(**inputs)[0])
            assert torch.equal(_eagerly(pipe.transformer, **inputs)[0], ref(**inputs)[0])
        assert any(is_stored(p) for p in pipe.transformer.parameters())


def test_regional_compile_of_the_blocks():
    """diffusers' ``compile_repeated_blocks`` (``nn.Module.compile`` on each block, the
    model's own ``forward`` eager): offloaded first, one runtime holds the whole model,
    the eager forward reads its stored weights from the host store, and every call is
    exact. Not offloaded, the first block's graph is refused naming the fix, nothing
    changes, and the fix then works on the same model."""
    ref, inputs = tiny_flux()
    with torch.no_grad():
        expected = ref(**inputs)[0]
    for offload_first in (False, True):
        torch._dynamo.reset()
        model, _ = tiny_flux()
        if offload_first:
            offloaded(model)
        with torch.no_grad():
            model.compile_repeated_blocks(backend="dlo")
            if not offload_first:
                with pytest.raises(ValueError, match=r"no dlo runtime holds: .* "
                                   r"dlo_fx\.offload\(model, options\) first"):
                    model(**inputs)
                assert dlo_fx.state(model) is None
                assert not any(is_stored(p) for p in model.parameters())
                offloaded(model)
            assert all(torch.equal(model(**inputs)[0], expected) for _ in range(3))
        runtimes = runtimes_holding(list(model.parameters()))
        assert len(runtimes) == 1
        assert all(any(p in r.store for r in runtimes) for p in model.transformer_blocks.parameters())
        assert any(p in runtimes[0].store for p in model.x_embedder.parameters())
        dlo_fx.release(model)


def test_regional_compile_of_a_loaded_model_names_what_it_reads_eagerly(dit):
    """A loaded model stores its own (non-block) parameters too, which its eager forward
    reads: exact, each read served from the host store, with one warning naming the first
    module read; with them resident, exact and nothing read outside a graph."""
    model = dlo_fx.load(ReferenceDiT, dit["path"], config=dit["config"],
                        options={"resident_bytes": 0})
    for block in model.blocks:
        block.compile(backend="dlo")
    with pytest.warns(RuntimeWarning, match="'patch_embed' are read outside a scheduled graph"):
        assert torch.equal(run(model, dit["inputs"]), dit["expected"])
    own = [name for name, _ in model.named_parameters() if not name.startswith("blocks.")]
    model = dlo_fx.load(ReferenceDiT, dit["path"], config=dit["config"],
                        options={"resident_bytes": 0}, resident=own)
    for block in model.blocks:
        block.compile(backend="dlo")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        assert all(torch.equal(run(model, dit["inputs"]), dit["expected"]) for _ in range(2))


def test_models_on_one_device_share_slots_not_blocks():
    """Two models alternate through the same slots; each call is exact (a slot another
    model filled since is copied again, never read)."""
    a, inputs = tiny_dit(depth=2, seed=0)
    b, _ = tiny_dit(depth=2, seed=5)
    ref_a, ref_b = run(tiny_dit(depth=2, seed=0)[0], inputs), run(tiny_dit(depth=2, seed=5)[0],
                                                                   inputs)
    ca = torch.compile(offloaded(a, {"num_slots": 3}), backend="dlo")
    cb = torch.compile(offloaded(b, {"num_slots": 3}), backend="dlo")
    for _ in range(2):
        assert torch.equal(run(ca, inputs), ref_a)
        assert torch.equal(run(cb, inputs), ref_b)
    (ra,), (rb,) = runtimes_holding(list(a.parameters())), runtimes_holding(list(b.parameters()))
    assert ra is not rb and ra.store is not rb.store
    assert ra.shared is rb.shared
    stored_a = {id(p) for p in a.parameters() if p in ra.store}
    assert stored_a and not any(p in rb.store for p in a.parameters())


# -- lifetime ---------------------------------------------------------------------------------
def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _copy_threads(wait_s: float = 0.0) -> int:
    """Live copy-worker threads; waits up to ``wait_s`` for them to finish exiting."""
    deadline = time.monotonic() + wait_s
    while True:
        count = sum(t.name.startswith("dlo-copy") and t.is_alive() for t in threading.enumerate())
        if count == 0 or time.monotonic() >= deadline:
            return count
        time.sleep(0.05)


def test_twenty_rounds_give_memory_back():
    """Build, compile, run and drop a 13 MiB model twenty times: the host store, the slots
    and the copy thread go with each model (RSS flat within a bound far below one model
    per round), and no runtime outlives its model, with or without torch._dynamo.reset()."""
    inputs = None
    rss, store_bytes = [], []
    model_bytes = 0
    for i in range(20):
        model = reference_dit(width=256, depth=4, heads=4, seed=i, dtype=torch.float32)
        if inputs is None:
            inputs = example_inputs(model.config, batch=1, height=8, width=8, seed=1)
        model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        # Offloaded: every model of the class shares one Dynamo entry
        dlo_fx.offload(model, options={"num_slots": 2})
        compiled = torch.compile(model, backend="dlo")
        run(compiled, inputs)
        assert runtimes_holding(list(model.parameters()))[0].store.host_bytes > 0
        assert _copy_threads() >= 1  # blocks over 256 KiB: copies run on the worker
        del model, compiled
        if i == 10:
            torch._dynamo.reset()
        gc.collect()
        store_bytes.append(sum(rt.store.host_bytes for rt in live_runtimes()))
        rss.append(_rss_bytes())
    collect_all()  # no cycle frozen by an earlier test keeps slots alive (tests/lifetime.py)
    assert store_bytes == [0] * 20
    assert live_runtimes() == []
    assert len(shared_slots._SHARED) == 0  # slots freed with the last runtime
    assert _copy_threads(wait_s=10.0) == 0
    growth = max(rss[5:]) - rss[4]
    assert growth < 3 * model_bytes, (growth, model_bytes, rss)  # leaking: 15 x model


def test_replaced_layers_are_forgotten_and_calls_stay_exact():
    """A layer replaced after the first call (diffusers' ``delete_adapters`` and
    ``unload_lora`` drop an adapter's layers the same way): the next call stores the new
    one, exactly, and the store forgets the dead parameters. It kept them, keyed by id:
    the store grew by every replaced layer, and a new parameter given a dead one's id was
    refused as ``param.data = ...`` (host_store.py, [Note: a stored parameter that dies])."""
    reference, inputs = tiny_dit()
    model, _ = tiny_dit()
    compiled = torch.compile(offloaded(model), backend="dlo", fullgraph=True)
    assert torch.equal(run(compiled, inputs), run(reference, inputs))
    store = runtimes_holding(list(model.parameters()))[0].store
    sizes = []
    for seed in range(4):
        layer = torch.nn.Linear(64, model.blocks[1].fc1.out_features, dtype=torch.bfloat16)
        torch.nn.init.normal_(layer.weight, std=0.05, generator=torch.Generator().manual_seed(seed))
        reference.blocks[1].fc1 = layer.requires_grad_(False)
        model.blocks[1].fc1 = copy.deepcopy(layer)
        gc.collect()
        assert torch.equal(run(compiled, inputs), run(reference, inputs)), seed
        sizes.append((len(store.blocks), store.host_bytes, sum(p in store for p in model.parameters())))
    # one new block per round; the replaced layer's freed with its last parameter
    assert [n for n, _, _ in sizes] == [sizes[0][0] + i for i in range(4)], sizes
    assert len({b for _, b, _ in sizes}) == 1, sizes  # host bytes flat after the first round
    assert len(store._entries) == sizes[0][2], (len(store._entries), sizes)


def test_release_frees_the_runtime_and_gives_back_an_ordinary_module(dit):
    model = dlo_fx.load(ReferenceDiT, dit["path"], config=dit["config"])
    assert torch.equal(run(torch.compile(model, backend="dlo"), dit["inputs"]), dit["expected"])
    assert dlo_fx.release(model) is model
    collect_all()
    assert live_runtimes() == [] and dlo_fx.state(model).released
    assert torch.equal(run(model, dit["inputs"]), dit["expected"])  # eager again
    assert dlo_fx.release(model) is model  # final: a second release does nothing
    with pytest.raises(ValueError, match="no parameter of ReferenceDiT"):
        dlo_fx.release(tiny_dit()[0])  # nothing of it ever was dlo's


def test_new_weights_are_used_where_resident_and_refused_where_stored():
    """``param.data = ...`` and ``load_state_dict`` on a compiled model: a resident
    parameter takes the new weights (the graph reads the parameter), a stored one is
    refused at the write, naming it, and keeps its weights; load_state_dict of a stored
    key loads nothing."""
    ref, inputs = tiny_dit()
    model, _ = tiny_dit()
    # The biases stay resident (below resident_bytes): the graph reads them from the module
    compiled = torch.compile(offloaded(model, {"resident_bytes": 1024}), backend="dlo")
    stored = "blocks.1.fc2_weight"
    with torch.no_grad():
        assert torch.equal(run(compiled, inputs), run(ref, inputs))
        runtime = runtimes_holding(list(model.parameters()))[0]
        resident = [k for k, p in model.named_parameters() if p not in runtime.store]
        assert resident and model.get_parameter(stored) in runtime.store
        new = {k: torch.randn_like(p) for k, p in ref.named_parameters()
               if k in (resident[0], stored)}
        with pytest.raises(ValueError, match=f"load_state_dict .*parameter '{stored}'"):
            model.load_state_dict(new, strict=False)
        assert torch.equal(model.get_parameter(resident[0]), ref.get_parameter(resident[0]))
        model.load_state_dict({resident[0]: new[resident[0]]}, strict=False)
        ref.load_state_dict({resident[0]: new[resident[0]]}, strict=False)
        expected = run(ref, inputs)
        assert torch.equal(run(compiled, inputs), expected)
        model.get_parameter(resident[0]).data = new[resident[0]] * 2
        ref.get_parameter(resident[0]).data = new[resident[0]] * 2
        expected = run(ref, inputs)
        assert torch.equal(run(compiled, inputs), expected)
        with pytest.raises(ValueError, match=f"param.data = .* parameter '{stored}'"):
            model.get_parameter(stored).data = new[stored]
        assert torch.equal(run(compiled, inputs), expected)
        dlo_fx.release(model)
        assert torch.equal(run(model, inputs), expected)


def test_in_place_write_to_a_stored_parameter_is_refused(dit):
    """Writing a stored parameter in place (the model's own table, read by its root) is
    refused at the write, naming it: the graphs stream the stored bytes, which the write
    would not reach. The model stays exact; release puts the stored weights back."""
    model = dlo_fx.load(ReferenceDiT, dit["path"], config=dit["config"])
    compiled = torch.compile(model, backend="dlo")
    assert torch.equal(run(compiled, dit["inputs"]), dit["expected"])
    runtime = runtimes_holding(list(model.parameters()))[0]
    table = model.modulation_table
    assert table in runtime.store and is_stored(table)
    with torch.no_grad():
        for write in (lambda: table.mul_(2), lambda: table.data.add_(1),
                      lambda: torch.nn.init.zeros_(table)):
            with pytest.raises(ValueError, match="parameter 'modulation_table'"):
                write()
    assert torch.equal(run(compiled, dit["inputs"]), dit["expected"])
    dlo_fx.release(model)
    assert torch.equal(run(model, dit["inputs"]), dit["expected"])


# -- stored parameters under module operations (a forked child: a crash is a dead rank) -----
def _module_operations():
    with tempfile.TemporaryDirectory() as folder:
        return spawn(1, ownership_cases.module_operations, folder)[0]


class Facts:
    """Checks that all run: each failing one (or one that raised, a fact the child did not
    report, say) is collected, and `verify` fails listing every one of them."""

    def __init__(self, reported: dict) -> None:
        self.reported = reported
        self.failed: list[str] = []

    def check(self, what: str, holds: Callable[[], Any],
              detail: Optional[Callable[[], Any]] = None) -> None:
        try:
            if holds():
                return
            shown = detail() if detail is not None else ""
        except Exception as exc:  # noqa: BLE001 (a fact missing or malformed fails alone)
            shown = f"raised {type(exc).__name__}: {exc}"
        self.failed.append(f"{what}: {shown!r}" if shown != "" else what)

    def verify(self) -> None:
        raised = self.reported.get("raised", {})
        failed = [f"the child raised in {section!r}: {tb}" for section, tb in raised.items()]
        failed += self.failed
        assert not failed, f"{len(failed)} failing facts:\n" + "\n".join(failed)


@pytest.mark.spawned.with_args(_module_operations)
def test_module_operations_in_a_child_process(spawned):
    r = spawned
    facts = Facts(r)
    check = facts.check
    check("stored before, exact before", lambda: r["stored"] > 0 and r["exact_before"])
    # os.fork after a call: the child refuses the parent's model naming the fork (it
    # waited forever), and a model loaded there runs exactly; the parent's is unaffected.
    child = r.get("fork_child")
    check("the forked child answered (else it hung and was killed)", lambda: child is not None)
    for key in ("call", "eager", "release"):
        check(f"fork child {key}: refused naming the process", lambda: child[key].startswith(
            "RuntimeError: dlo: this model's weights are stored by process"),
            lambda: child[key])
        check(f"fork child {key}: names the fork and 'spawn'", lambda: "was forked from it"
              in child[key] and "'spawn'" in child[key], lambda: child[key])
    check("fork child: a fresh model runs exactly", lambda: child["fresh"] == [True, True],
          lambda: child["fresh"])
    check("fork parent unaffected",
          lambda: r["fork_parent_before"] and r["fork_parent_after"])
    # A graph Dynamo reuses (another model of the class, a later layer after a graph break
    # in the blocks) guards the modules it meets: eager calls and state_dict are exact.
    # Released, a compiled handle refuses, naming release and offload (it never stores the
    # model again by itself); offloaded again, the same graphs stream it exactly.
    for refused in (*r["graph_break_released_refused"], *r["shared_layer_refused"]):
        check("released: the handle refuses naming release",
              lambda: "ValueError: dlo:" in refused and "dlo_fx.release gave back" in refused
              and "dlo_fx.offload(model, options) again" in refused, lambda: refused)
    for key in ("second", "graph_break", "graph_break_released", "step_first", "step"):
        check(f"{key}: exact", lambda: r[f"{key}_exact"] == [True, True],
              lambda: r[f"{key}_exact"])
        check(f"{key}: more than 10 eager and state checks",
              lambda: len(r[f"{key}_eager_and_state"]) > 10, lambda: r[f"{key}_eager_and_state"])
        check(f"{key}: eager calls and state_dict exact",
              lambda: all(v is True for v in r[f"{key}_eager_and_state"]),
              lambda: r[f"{key}_eager_and_state"])
    # Parameters sharing storage with other tensors, or over a file (torch.load mmap=True):
    # stored, exact, and the other tensors' bytes left to them.
    for key in ("assign", "mmap"):
        check(f"shared {key}: exact", lambda: r[f"shared_{key}_exact"] == [True, True],
              lambda: r[f"shared_{key}_exact"])
        check(f"shared {key}: stored", lambda: r[f"shared_{key}_stored"] > 0,
              lambda: r[f"shared_{key}_stored"])
    check("shared dict intact, resident model exact",
          lambda: r["shared_dict_intact"] and r["shared_resident_exact"])
    # Two models sharing a layer share a runtime: releasing one gives both their weights
    # back, and, offloaded again, both compiled models are exact.
    check("shared layer: exact", lambda: r["shared_layer_exact"] == [True, True],
          lambda: r["shared_layer_exact"])
    check("shared layer: eager exact", lambda: r["shared_layer_eager"] == [True, True],
          lambda: r["shared_layer_eager"])
    check("shared layer: nothing stored after release", lambda: r["shared_layer_stored"] == 0,
          lambda: r["shared_layer_stored"])
    check("shared layer: stored again, exact", lambda: r["shared_layer_again"] == [True, True],
          lambda: r["shared_layer_again"])
    check("shared layer: more than 10 eager and state checks",
          lambda: len(r["shared_layer_eager_and_state"]) > 10,
          lambda: r["shared_layer_eager_and_state"])
    check("shared layer: eager calls and state_dict exact",
          lambda: all(v is True for v in r["shared_layer_eager_and_state"]),
          lambda: r["shared_layer_eager_and_state"])
    # A model built in memory and one from dlo_fx.load share Dynamo's graphs, in either
    # order, with and without a graph break in the blocks; the loaded one, released, is
    # refused by its compiled handle naming release, and exact once offloaded again.
    for graph_break in (False, True):
        for order in ("built_loaded", "loaded_built"):
            key = f"built_and_loaded_{graph_break}_{order}"
            got = r[key]
            check(key, lambda: got[:4] == [True] * 4 and got[6:] == [True] * 2
                  and all("dlo_fx.release gave back" in str(g) for g in got[4:6]), lambda: got)
    check("skipped forwards", lambda: r["skipped_forwards"] == [True] * 6,
          lambda: r["skipped_forwards"])
    # .to() the runtime's own device, any spelling: a no-op.
    for key in ("to device(type='cpu', index=0)", "to 'cpu'", "to 'cpu:0'",
                "to device(type='cpu')", "cpu()"):
        check(f"{key}: a no-op", lambda: r[key] == "", lambda: r[key])
    check("to cpu: still stored, exact", lambda: r["stored_after_to_cpu"] == r["stored"]
          and r["exact_after_to_cpu"])
    # another dtype: ValueError naming dlo and the way out; nothing converted.
    for key in ("to_fp16", "float"):
        check(f"{key}: a ValueError of dlo's", lambda: r[key].startswith("ValueError: dlo:"),
              lambda: r[key])
        check(f"{key}: names release and dtype=",
              lambda: "dlo_fx.release(model)" in r[key] and "dtype=" in r[key], lambda: r[key])
        check(f"{key}: names the parameter FQN",
              lambda: re.search(r"parameter '[\w.]+'", r[key]), lambda: r[key])
        check(f"{key}: says nothing of strides (a memory-format change only)",
              lambda: "strides" not in r[key], lambda: r[key])
    check("fp16: nothing converted, exact", lambda: r["dtypes_after_fp16"] == r["dtypes_before"]
          and r["exact_after_fp16"])
    # state_dict: the real weights, saved by safetensors.
    check("state_dict saved, equal, strides", lambda: r["save_file"] == "" and r["saved_equal"]
          and r["state_strides"], lambda: r["save_file"])
    check("exact after state_dict", lambda: r["exact_after_state_dict"])
    # load_state_dict: refused naming a stored parameter, nothing loaded.
    for key in ("load_state_dict", "load_state_dict_block"):
        check(f"{key}: refused", lambda: r[key].startswith(
            "ValueError: dlo: cannot load_state_dict"), lambda: r[key])
        check(f"{key}: names release", lambda: "dlo_fx.release(model)" in r[key],
              lambda: r[key])
        check(f"{key}: names the parameter FQN",
              lambda: re.search(r"parameter '[\w.]+'", r[key]), lambda: r[key])
    check("load_state_dict: still stored, exact",
          lambda: r["stored_after_load"] == r["stored"] and r["exact_after_load"])
    # copy.deepcopy: refused naming a stored parameter (the copy would not own the host
    # store), model intact.
    check("deepcopy: refused naming the parameter", lambda: r["deepcopy"].startswith(
        "ValueError: dlo: cannot deepcopy parameter"), lambda: r["deepcopy"])
    check("deepcopy: names release, model exact",
          lambda: "dlo_fx.release(model)" in r["deepcopy"] and r["exact_after_deepcopy"],
          lambda: r["deepcopy"])
    # param.data = ... and an in-place write of a stored parameter: refused at the write,
    # naming it; nothing changed.
    for key in ("replaced_data", "replaced_in_place"):
        check(f"{key}: a ValueError of dlo's", lambda: r[key].startswith("ValueError: dlo: "),
              lambda: r[key])
        check(f"{key}: names the parameter",
              lambda: f"parameter '{r['replaced_name']}'" in r[key], lambda: r[key])
        check(f"{key}: names release", lambda: "dlo_fx.release(model)" in r[key],
              lambda: r[key])
    check("exact after the refused writes", lambda: r["exact_after_replaced"])
    # Reads outside the graph: an eager call of a layer and of the whole model, p.sum(),
    # p.float(), repr(p): exact.
    check("reads outside the graph exact",
          lambda: r["eager_layer"] and r["eager_model"] and all(r["reads"]), lambda: r["reads"])
    # release: an ordinary module again.
    check("release: no error, nothing stored",
          lambda: r["release"] == "" and r["stored_after_release"] == 0, lambda: r["release"])
    check("release: no runtime, eager exact",
          lambda: r["released"] and r["eager_after_release"])
    check("release: deepcopy exact", lambda: r["deepcopy_after_release"])
    check("release: to fp16 converts", lambda: r["to_fp16_after_release"] == ""
          and r["dtypes_after_release_fp16"] == ["torch.float16"],
          lambda: (r["to_fp16_after_release"], r["dtypes_after_release_fp16"]))
    # diffusers' save_pretrained from the host store.
    check("save_pretrained: no error, equal",
          lambda: r["save_pretrained"] == "" and r["save_pretrained_equal"],
          lambda: r["save_pretrained"])
    # diffusers methods that rewrite the weights: refused naming the method, nothing changed.
    for name, text in r.get("rewrites", {"(the rewrites were not reported)": ""}).items():
        check(f"{name}: refused", lambda: text.startswith("ValueError: dlo: cannot call "),
              lambda: text)
        check(f"{name}: names the method and release",
              lambda: f".{name}()" in text and "dlo_fx.release(model)" in text, lambda: text)
    check("the rewrites left nothing changed", lambda: r["rewrites_left_nothing"])
    # fuse_qkv_projections reads the stored weights into new fused ones: exact.
    check("fuse_qkv: no error, exact",
          lambda: r["fuse_qkv"] == "" and r["fuse_qkv_exact"] == [True, True],
          lambda: (r["fuse_qkv"], r["fuse_qkv_exact"]))
    check("hotswap: refused", lambda: r["hotswap"].startswith(
        "ValueError: dlo: cannot hotswap a LoRA adapter"), lambda: r["hotswap"])
    check("hotswap: names hotswap=True and release",
          lambda: "hotswap=True" in r["hotswap"] and "dlo_fx.release(model)" in r["hotswap"],
          lambda: r["hotswap"])
    check("a plain LoRA load passes through", lambda: not r["lora_load"].startswith(
        "ValueError: dlo:"), lambda: r["lora_load"])
    check("channels_last: refused", lambda: r["channels_last"].startswith(
        "ValueError: dlo: cannot convert"), lambda: r["channels_last"])
    check("channels_last: names strides and the parameter",
          lambda: "strides" in r["channels_last"]
          and "patch_embedding.weight" in r["channels_last"], lambda: r["channels_last"])
    facts.verify()

def _state_dict_two_ranks():
    with tempfile.TemporaryDirectory() as folder:
        path, config = spawn(1, in_child, save_dit, folder)[0]
        return spawn(2, ownership_cases.allgather_state_dict, path, config, timeout=300)


@pytest.mark.spawned.with_args(_state_dict_two_ranks)
def test_state_dict_and_release_allgather_two_ranks(spawned):
    results = spawned
    for rank, r in results.items():
        assert r["mode"] == "allgather" and r["dp"] == 2, r
        assert r["host_bytes"] < r["total_bytes"]  # each rank holds about half
        assert r["state_equal"] and r["release_equal"], (rank, r)
        assert r["other_layers"] is True, (rank, r)
        assert r["live_after_release"] == 0


# -- options that can only hurt ------------------------------------------------------------------
@pytest.mark.parametrize("name, value", [
    ("num_slots", 10**9), ("num_slots", 65), ("num_slots", 1),
    ("collective_timeout_s", math.nan), ("collective_timeout_s", math.inf),
    ("collective_timeout_s", -1.0), ("collective_timeout_s", 0),
])
def test_harmful_option_refused(name, value):
    with pytest.raises(ValueError, match=f"'{name}'"):
        DLOConfig.from_options({name: value})


@pytest.mark.parametrize("options", [5, "num_slots=3", [("num_slots", 3)]])
def test_options_must_be_a_mapping(options, dit):
    with pytest.raises(ValueError, match="options=.*mapping"):
        DLOConfig.from_options(options)
    with pytest.raises(ValueError, match="mapping"):
        dlo_fx.load(ReferenceDiT, dit["path"], config=dit["config"], options=options)
    assert live_runtimes() == []  # nothing was stored


def test_harmful_option_at_compile_leaves_model_intact():
    model, inputs = tiny_dit(depth=1)  # refused before any schedule: one layer traces faster
    expected = run(tiny_dit(depth=1)[0], inputs)
    with pytest.raises(ValueError) as info:  # not wrapped by Dynamo
        run(torch.compile(model, backend="dlo", options={"collective_timeout_s": math.inf}),
            inputs)
    assert isinstance(info.value, ValueError) and "collective_timeout_s" in str(info.value)
    assert not any(is_stored(p) for p in model.parameters())
    assert torch.equal(run(model, inputs), expected)  # still an ordinary, eager module


# -- the runtime never reaches up into the planning ----------------------------------------------
def _imported_modules(path, package: str):
    """Every module ``path`` (a module of ``package``) imports, as absolute names; ``from X
    import y`` counts as both ``X`` and ``X.y``."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] \
                if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            yield module
            yield from (f"{module}.{a.name}" for a in node.names)


#: What the runtime may import of planning: the view it builds and the plans it keeps (its
#: budget plans and memory records), values that import nothing of the runtime.
_PLANNING_VALUES = ("dlo_fx.planning.view", "dlo_fx.planning.budget",
                    "dlo_fx.planning.device_memory")


def test_runtime_imports_of_planning_only_its_values():
    bad = []
    walked = sorted((ROOT / "dlo_fx" / "runtime").rglob("*.py"))
    assert any(len(p.relative_to(ROOT).parts) > 3 for p in walked)  # its subpackages too
    for path in walked:
        package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
        bad += [f"{path.relative_to(ROOT)}: {m}" for m in _imported_modules(path, package)
                if (m == "dlo_fx.planning" or m.startswith("dlo_fx.planning."))
                and not any(m == v or m.startswith(v + ".") for v in _PLANNING_VALUES)]
    assert bad == [], bad


def test_planning_and_passes_import_nothing_of_the_runtime():
    """Planning reads what a runtime holds as a `StoreView` (dlo_fx/planning/view.py), and
    the passes reach the runtime's objects through the plan: no module of `dlo_fx.passes`
    or `dlo_fx.planning` imports `dlo_fx.runtime`."""
    bad = []
    for folder in ("passes", "planning"):
        for path in sorted((ROOT / "dlo_fx" / folder).rglob("*.py")):
            package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
            modules = set(_imported_modules(path, package))
            bad += [f"{path.relative_to(ROOT)}: {m}" for m in sorted(modules)
                    if m == "dlo_fx.runtime" or m.startswith("dlo_fx.runtime.")]
    assert bad == [], bad


#: Modules that still import runtime submodules: the attach sequence's, being rewritten
#: beside this change (issue 66, item 1). Remove each as it moves to the face.
def test_other_packages_import_the_runtime_through_its_face_only():
    """Code outside `dlo_fx/runtime` imports what it uses of the runtime from `dlo_fx.runtime`
    (runtime/__init__.py), never from a submodule; the face exports every name imported."""
    import dlo_fx.runtime as face

    bad = []
    walked = [p for folder in ("dlo_fx", "benchmarks") for p in sorted((ROOT / folder).rglob("*.py"))]
    for path in walked:
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("dlo_fx/runtime/"):
            continue
        package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                bad += [f"{rel}: import {a.name}" for a in node.names
                        if a.name.startswith("dlo_fx.runtime.")]
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")[:len(package.split(".")) - node.level + 1] \
                    if node.level else []
                module = ".".join(base + ([node.module] if node.module else []))
                if module.startswith("dlo_fx.runtime."):
                    bad.append(f"{rel}: from {module} import ...")
                elif module == "dlo_fx.runtime":
                    bad += [f"{rel}: {a.name} is not exported by dlo_fx.runtime"
                            for a in node.names if not hasattr(face, a.name)]
    assert bad == [], bad


# The layers of `dlo_fx.runtime`, bottom up (docs/architecture.md, "Layout"): a module
# imports nothing of a layer above its own. The modules beside runtime.py sit between
# weights/ and graph/, except the two that import nothing of the runtime.
_RUNTIME_LAYERS = [
    ["lifecycle", "interrupts"],
    ["device"],
    ["host"],
    ["ranks"],
    ["weights"],
    ["probes", "store_view", "slot_machine", "runtime"],
    ["graph"],
]


def _runtime_layer(module: str) -> Optional[int]:
    """The layer of ``module`` (``dlo_fx.runtime.<part>...``), or None outside the runtime's
    parts (the package itself, or another package)."""
    parts = module.split(".")
    if parts[:2] != ["dlo_fx", "runtime"] or len(parts) < 3:
        return None
    return next((i for i, layer in enumerate(_RUNTIME_LAYERS) if parts[2] in layer), None)


def test_runtime_layers_import_nothing_above_them():
    bad = []
    walked = sorted((ROOT / "dlo_fx" / "runtime").rglob("*.py"))
    for path in walked:
        rel = path.relative_to(ROOT)
        if rel.parts == ("dlo_fx", "runtime", "__init__.py"):
            continue
        name = ".".join(rel.with_suffix("").parts)
        own = _runtime_layer(name)
        assert own is not None, f"{rel}: in no layer of _RUNTIME_LAYERS"
        package = ".".join(rel.with_suffix("").parts[:-1])
        bad += [f"{rel}: {m}" for m in sorted(set(_imported_modules(path, package)))
                if (_runtime_layer(m) or 0) > own]
    assert bad == [], bad


# -- every runtime part owns what it declares ------------------------------------------------------
_RECORDS = {"NamedTuple", "Protocol", "TypedDict"}  # classes whose annotations are their fields
_LIFECYCLE_FLAGS = {"broken", "closed"}


def _name_of(node) -> str:
    if isinstance(node, ast.Call):
        node = node.func
    return node.id if isinstance(node, ast.Name) else \
        node.attr if isinstance(node, ast.Attribute) else ""


def _runtime_modules():
    walked = sorted((ROOT / "dlo_fx" / "runtime").rglob("*.py"))
    assert any(len(p.relative_to(ROOT).parts) > 3 for p in walked)  # its subpackages too
    return [(p.relative_to(ROOT), ast.parse(p.read_text())) for p in walked]


def test_no_runtime_class_declares_what_another_sets():
    """A class of `dlo_fx.runtime` that annotates an attribute without a value (and is no
    dataclass or record type) declares state some other class sets: a mixin reading its
    host's attributes. The runtime is made of parts that each set what they hold."""
    bad = []
    for path, tree in _runtime_modules():
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            if any(_name_of(d) == "dataclass" for d in cls.decorator_list) \
                    or any(_name_of(b) in _RECORDS for b in cls.bases):
                continue
            bad += [f"{path}: {cls.name}.{s.target.id}" for s in cls.body
                    if isinstance(s, ast.AnnAssign) and s.value is None
                    and isinstance(s.target, ast.Name)]
    assert bad == [], bad


def test_only_the_lifecycle_sets_its_flags():
    """``broken`` and ``closed`` are set by `Lifecycle` itself (``fail``, ``close``), never
    assigned on another object."""
    bad = []
    for path, tree in _runtime_modules():
        def visit(node, cls: str) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.ClassDef):
                    visit(child, child.name)
                    continue
                targets = child.targets if isinstance(child, ast.Assign) else \
                    [child.target] if isinstance(child, (ast.AugAssign, ast.AnnAssign)) else []
                for t in targets:
                    for a in (n for n in ast.walk(t) if isinstance(n, ast.Attribute)):
                        if a.attr in _LIFECYCLE_FLAGS and not (
                                cls == "Lifecycle" and _name_of(a.value) == "self"):
                            bad.append(f"{path}:{a.lineno}: {ast.unparse(a)}")
                visit(child, cls)
        visit(tree, "")
    assert bad == [], bad
