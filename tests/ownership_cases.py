"""Cases for `test_ownership`, run on every rank by `distributed.spawn` (a forked child: a
crash shows as a dead rank, it cannot take pytest down): ordinary module operations on a
dlo model, and the allgather ``state_dict`` / `release` case."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import warnings
import signal
import traceback
from typing import Iterator

import torch

from dlo_fx.runtime.device.executor import fault_delay
from safetensors.torch import load_file, save_file

import dlo_fx
from dlo_fx.apps.models import ReferenceDiT, example_inputs, reference_dit
from dlo_fx.runtime.weights.stored import is_stored
from dlo_fx.runtime.weights.owners import live_runtimes, runtimes_holding

from errors import error_text
from loader_cases import SHARED, resident_dit, resident_wan, save_dit, save_wan
from models import offloaded, tiny_wan

OPTIONS = {"block_bytes": 300_000}


def _stored_count(model: torch.nn.Module) -> int:
    return sum(is_stored(p) for p in model.parameters())


def _dtypes(model: torch.nn.Module) -> list[str]:
    return sorted({str(t.dtype) for t in [*model.parameters(), *model.buffers()]})


def _error(fn) -> str:
    try:
        fn()
    except Exception as exc:  # the text is what the test checks
        return error_text(exc)
    return ""


@contextlib.contextmanager
def _section(out: dict, name: str) -> Iterator[None]:
    """One section of `module_operations`' facts: what it raises is reported in
    ``out["raised"][name]`` and the next sections still run, so the test lists every failing
    fact, not the first."""
    try:
        yield
    except Exception:  # reported: the test fails naming the section and the error
        out.setdefault("raised", {})[name] = traceback.format_exc(limit=-4)


def _outcome(fn):
    """What ``fn()`` returns, or the text of what it raised."""
    try:
        return fn()
    except Exception as exc:  # the text is what the test checks
        return error_text(exc)


def module_operations(rank: int, world: int, out_dir: str) -> dict:
    """Each operation on a loaded, compiled and called DiT: error text and the module's
    state after it (still stored, still exact)."""
    dit_path, cfg = save_dit(out_dir)
    wan_dir = save_wan(os.path.join(out_dir, "wan-src"))
    ref = resident_dit(dit_path, cfg)
    inputs = example_inputs(cfg, batch=2, height=8, width=8, seed=1)
    with torch.no_grad():
        expected = ref(*inputs)
    model = dlo_fx.load(ReferenceDiT, dit_path, config=cfg, options=OPTIONS)
    compiled = torch.compile(model, backend="dlo")

    def exact() -> bool:
        with torch.no_grad():
            return torch.equal(compiled(*inputs), expected)

    out: dict = {}
    with _section(out, "before"):
        out["exact_before"] = exact()
        out["stored"] = _stored_count(model)
    with _section(out, "fork"):
        out.update(_forked(dit_path, cfg, inputs, expected))
    with _section(out, "to its own device"):
        # 1. .to() the runtime's own device, in every spelling: a no-op.
        for spelling in (torch.device("cpu", 0), "cpu", "cpu:0", torch.device("cpu")):
            out[f"to {spelling!r}"] = _error(lambda: model.to(spelling))
        out["cpu()"] = _error(model.cpu)
        out["stored_after_to_cpu"] = _stored_count(model)
        out["exact_after_to_cpu"] = exact()
    with _section(out, "to another dtype"):
        # 2. .to() another dtype (the DiT is bfloat16): refused, nothing converted.
        out["dtypes_before"] = _dtypes(model)
        out["to_fp16"] = _error(lambda: model.to(torch.float16))
        out["float"] = _error(model.float)
        out["dtypes_after_fp16"] = _dtypes(model)
        out["exact_after_fp16"] = exact()
    with _section(out, "state_dict"):
        # 3. state_dict() holds the real weights: save_file writes them.
        path = os.path.join(out_dir, "saved.safetensors")
        state = model.state_dict()
        out["save_file"] = _error(lambda: save_file({k: v.contiguous() for k, v in state.items()},
                                                    path))
        saved = load_file(path) if not out["save_file"] else {}
        ref_state = ref.state_dict()
        out["saved_equal"] = saved.keys() == ref_state.keys() and all(
            torch.equal(saved[k], ref_state[k]) for k in ref_state)
        out["state_strides"] = all(state[k].stride() == ref_state[k].stride() for k in ref_state)
        out["exact_after_state_dict"] = exact()
    with _section(out, "load_state_dict and deepcopy"):
        # 4. load_state_dict of a stored parameter's key: refused before anything is loaded,
        # from the model and from a submodule.
        runtime = runtimes_holding(list(model.parameters()))[0]
        out["load_state_dict"] = _error(lambda: model.load_state_dict(ref_state))
        block0 = {k[len("blocks.0."):]: v for k, v in ref_state.items()
                  if k.startswith("blocks.0.")}
        out["load_state_dict_block"] = _error(lambda: model.blocks[0].load_state_dict(block0))
        out["stored_after_load"] = _stored_count(model)
        out["exact_after_load"] = exact()
        out["deepcopy"] = _error(lambda: copy.deepcopy(model))
        out["exact_after_deepcopy"] = exact()
    with _section(out, "writes and reads"):
        # 5. param.data = other and an in-place write into a stored parameter: refused at the
        # write, naming it (the graphs would read the stored weights); nothing changed.
        name, linear = next((n, m) for n, m in model.named_modules()
                            if isinstance(m, torch.nn.Linear) and is_stored(m.weight))
        out["replaced_name"] = f"{name}.weight"
        out["replaced_data"] = _error(lambda: setattr(
            linear.weight, "data", torch.zeros_like(ref.get_submodule(name).weight)))
        out["replaced_in_place"] = _error(lambda: torch.nn.init.zeros_(linear.weight))
        out["exact_after_replaced"] = exact()
        x = torch.ones(1, linear.in_features, dtype=linear.weight.dtype)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # read outside a graph: warned
            out["eager_layer"] = torch.equal(linear(x), ref.get_submodule(name)(x))
            out["eager_model"] = torch.equal(model(*inputs), expected)
            out["reads"] = [torch.equal(linear.weight.sum(), ref.get_submodule(name).weight.sum()),
                            torch.equal(linear.weight.float(), ref.get_submodule(name).weight.float()),
                            repr(ref.get_submodule(name).weight.detach())[:40] in repr(linear.weight)
                            or name in repr(linear.weight)]
    with _section(out, "release"):
        # release: the stored weights go back into the parameters; the module is ordinary again.
        blocks = runtime.store.blocks
        out["blocks_before_release"] = len(blocks)
        out["release"] = _error(lambda: dlo_fx.release(model))
        out["stored_after_release"] = _stored_count(model)
        out["released"] = dlo_fx.state(model).released
        with torch.no_grad():
            out["eager_after_release"] = torch.equal(model(*inputs), expected)
        with torch.no_grad():
            out["deepcopy_after_release"] = torch.equal(copy.deepcopy(model)(*inputs), expected)
        out["to_fp16_after_release"] = _error(lambda: model.to(torch.float16))
        out["dtypes_after_release_fp16"] = _dtypes(model)
    with _section(out, "save_pretrained"):
        # A diffusers model: save_pretrained from the host store.
        from diffusers import WanTransformer3DModel

        wan = dlo_fx.load(WanTransformer3DModel, wan_dir)
        folder = os.path.join(out_dir, "wan")
        out["save_pretrained"] = _error(lambda: wan.save_pretrained(folder))
        got = {}
        for name in os.listdir(folder) if os.path.isdir(folder) else []:
            if name.endswith(".safetensors"):
                got.update(load_file(os.path.join(folder, name)))
        want = resident_wan(wan_dir).state_dict()
        out["save_pretrained_equal"] = got.keys() == want.keys() and all(
            torch.equal(got[k], want[k]) for k in want)
    with _section(out, "rewrites"):
        # diffusers methods that rewrite the weights in place: refused before anything changes.
        processors = {k: type(v).__name__ for k, v in wan.attn_processors.items()}
        out["rewrites"] = {
            "enable_layerwise_casting": _error(
                lambda: wan.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn)),
            "enable_group_offload": _error(lambda: wan.enable_group_offload(
                torch.device("cpu"), offload_type="block_level", num_blocks_per_group=1)),
            # LoRA fusing adds into the base weights through param.data, layer by layer
            "fuse_lora": _error(wan.fuse_lora),
            "unfuse_lora": _error(wan.unfuse_lora),
        }
        # hotswapping copies into the loaded adapter's weights in place; a plain load passes
        # through to diffusers (which wants peft, not a test dependency)
        out["hotswap"] = _error(lambda: wan.load_lora_adapter({}, hotswap=True))
        out["lora_load"] = _error(lambda: wan.load_lora_adapter({}))
        # .to(memory_format=...) restrides a 5-D conv weight: refused like a dtype (it was
        # skipped, and the output differed from the resident model's converted one)
        out["channels_last"] = _error(lambda: wan.to(memory_format=torch.channels_last_3d))
        after = wan.state_dict()
        out["rewrites_left_nothing"] = (
            after.keys() == want.keys() and all(torch.equal(after[k], want[k]) for k in want)
            and {k: type(v).__name__ for k, v in wan.attn_processors.items()} == processors
            and not any(hasattr(m, "to_qkv") for m in wan.modules())
            and _dtypes(wan) == _dtypes(resident_wan(wan_dir)))
    with _section(out, "fuse_qkv"):
        # fuse_qkv_projections reads the stored q, k and v weights (exactly) into new fused
        # ones, which the next compiled call stores: the same output as the resident model
        # fused the same way.
        resident = resident_wan(wan_dir)
        wan_inputs = tiny_wan()[1]
        out["fuse_qkv"] = _error(wan.fuse_qkv_projections)
        resident.fuse_qkv_projections()
        compiled_wan = torch.compile(wan, backend="dlo")
        with torch.no_grad():
            want_wan = resident(*wan_inputs)[0]
            out["fuse_qkv_exact"] = [torch.equal(compiled_wan(*wan_inputs)[0], want_wan)
                                     for _ in range(2)]
    with _section(out, "reused graphs"):
        # last: more Dynamo entries
        out.update(_reused_graphs(dit_path, cfg, inputs, expected, ref))
    with _section(out, "shared storages"):
        out.update(_shared_storages(out_dir))
    with _section(out, "shared layer"):
        out.update(_shared_layer())
    with _section(out, "built and loaded"):
        out.update(_built_and_loaded(dit_path, cfg, inputs, expected))
    return out


def _built_and_loaded(dit_path: str, cfg, inputs, expected: torch.Tensor) -> dict:
    """Dynamo reuses a graph for every model of the class: one built in memory and
    offloaded (small parameters resident, read by the graph itself) and one from
    dlo_fx.load (all stored), in either order, then the loaded one released and called
    again (refused naming release: it never stores itself again), then offloaded again
    and called; with and without a graph break in the blocks (the model's own forward
    then runs eagerly). The loaded model's call through the built one's graph read
    zero-byte storage (a crash), the other way round the graph's resident-copy op found
    no stored parameter."""
    out = {}
    for graph_break in (False, True):
        config = dataclasses.replace(cfg, graph_break_in_blocks=graph_break)
        for order in ("built", "loaded"), ("loaded", "built"):
            torch._dynamo.reset()
            got, compiled = [], {}
            for kind in order:
                model = (offloaded(resident_dit(dit_path, config)) if kind == "built" else
                         dlo_fx.load(ReferenceDiT, dit_path, config=config))
                compiled[kind] = torch.compile(model, backend="dlo")
                with torch.no_grad():
                    got += [_outcome(lambda: torch.equal(compiled[kind](*inputs), expected))
                            for _ in range(2)]
            # The loaded model released, then called again through its compiled model:
            # refused naming release; offloaded again, exact through the same handle.
            loaded = compiled["loaded"]._orig_mod
            dlo_fx.release(loaded)
            with torch.no_grad():
                got += [_outcome(lambda: torch.equal(compiled["loaded"](*inputs), expected))
                        for _ in range(2)]
                offloaded(loaded)
                got += [_outcome(lambda: torch.equal(compiled["loaded"](*inputs), expected))
                        for _ in range(2)]
            out[f"built_and_loaded_{graph_break}_{'_'.join(order)}"] = got
    # A built model compiled with options of its own between two loads (graph break in
    # the blocks): its torch.nn layers, unhooked, make Dynamo skip Linear.forward for good,
    # and the second loaded model's layers, whose entries from the first still pass their
    # guards, then run eagerly: they read zero-byte storage unless fetched.
    torch._dynamo.reset()
    config = dataclasses.replace(cfg, graph_break_in_blocks=True)
    options = {"num_slots": 3}
    got = []
    for kind in ("loaded", "built", "loaded"):
        model = (offloaded(resident_dit(dit_path, config), options) if kind == "built" else
                 dlo_fx.load(ReferenceDiT, dit_path, config=config, options=options))
        compiled = torch.compile(model, backend="dlo",
                                 options=options if kind == "built" else None)
        with torch.no_grad():
            got += [_outcome(lambda: torch.equal(compiled(*inputs), expected))
                    for _ in range(2)]
    out["skipped_forwards"] = got
    return out


def _eager_and_state(model: torch.nn.Module, ref: torch.nn.Module) -> list:
    """Whether an eager call of each stored Linear of ``model`` and ``state_dict()`` give
    what ``ref`` gives: one entry per Linear, then the state dict's."""
    gen = torch.Generator().manual_seed(0)
    got = []
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, torch.nn.Linear) and is_stored(m.weight):
                x = torch.randn(1, m.in_features, generator=gen).to(m.weight.dtype)
                try:
                    got.append(torch.equal(m(x), ref.get_submodule(name)(x)))
                except Exception as exc:  # the text is what the test shows
                    got.append(f"{name}: {error_text(exc)}")
    state, want = model.state_dict(), ref.state_dict()
    got.append(state.keys() == want.keys() and all(torch.equal(state[k], want[k]) for k in want))
    return got


def _reused_graphs(dit_path: str, cfg, inputs, expected: torch.Tensor, ref) -> dict:
    """Graphs Dynamo reuses for parameters no compile saw are guarded on their call: a
    second model of the class (an eager call of a submodule read zero-byte storage) and
    the layers after the first of a DiT with a graph break inside its blocks (one graph per
    half layer; ``state_dict()`` crashed reading a later layer's stored weights), also
    through a compiled function that takes the model."""
    second = dlo_fx.load(ReferenceDiT, dit_path, config=cfg, options=OPTIONS)
    compiled = torch.compile(second, backend="dlo")
    with torch.no_grad():
        out = {"second_exact": [torch.equal(compiled(*inputs), expected) for _ in range(2)]}
    out["second_eager_and_state"] = _eager_and_state(second, ref)
    broken, twin = (reference_dit(width=64, depth=3, heads=4, seed=0, graph_break_in_blocks=True)
                    .eval().requires_grad_(False) for _ in range(2))
    x = example_inputs(twin.config, batch=2, height=8, width=8, seed=1)
    compiled = torch.compile(offloaded(broken, {"resident_bytes": 0}), backend="dlo",
                             options={"resident_bytes": 0})
    with torch.no_grad():
        want = twin(*x)
        out["graph_break_exact"] = [torch.equal(compiled(*x), want) for _ in range(2)]
    out["graph_break_eager_and_state"] = _eager_and_state(broken, twin)
    dlo_fx.release(broken)  # final: the next call refuses, naming release
    with torch.no_grad():
        out["graph_break_released_refused"] = [_outcome(lambda: compiled(*x))
                                               for _ in range(2)]
        offloaded(broken, {"resident_bytes": 0})  # the way back: the same graphs stream it
        out["graph_break_released_exact"] = [torch.equal(compiled(*x), want) for _ in range(2)]
    out["graph_break_released_eager_and_state"] = _eager_and_state(broken, twin)
    # A compiled function that takes the model (a denoising step): no module frame is on
    # the stack when its graph, reused for a second model, stores that model's blocks.
    step = torch.compile(lambda model, *args: model(*args), backend="dlo",
                         options={"resident_bytes": 0})
    for seed, key in ((1, "step_first"), (2, "step")):
        model, twin = (reference_dit(width=64, depth=3, heads=4, seed=seed)
                       .eval().requires_grad_(False) for _ in range(2))
        offloaded(model, {"resident_bytes": 0})
        with torch.no_grad():
            want = twin(*x)
            out[f"{key}_exact"] = [torch.equal(step(model, *x), want) for _ in range(2)]
        out[f"{key}_eager_and_state"] = _eager_and_state(model, twin)
    return out


def _shared_storages(out_dir: str) -> dict:
    """Parameters whose storage is not theirs alone (a parameter stored lets its old tensor
    go and frees no storage: see [Note: when a parameter becomes a StoredWeight] in
    dlo_fx/runtime/runtime.py): a state dict loaded with
    ``assign=True`` into the compiled model and into a resident one (storing freed the
    resident model's weights and the caller's dict under them), and ``torch.load(...,
    mmap=True)``, whose storages cannot be resized (the compile raised)."""
    twin = reference_dit(width=64, depth=3, heads=4, seed=3).eval().requires_grad_(False)
    x = example_inputs(twin.config, batch=2, height=8, width=8, seed=1)
    path = os.path.join(out_dir, "twin.pt")
    torch.save(twin.state_dict(), path)
    shared = {k: v.clone() for k, v in twin.state_dict().items()}
    resident = reference_dit(width=64, depth=3, heads=4, seed=4).eval().requires_grad_(False)
    resident.load_state_dict(shared, assign=True)
    out = {}
    with torch.no_grad():
        want = twin(*x)
        for key, state in (("assign", shared), ("mmap", torch.load(path, mmap=True))):
            model = reference_dit(width=64, depth=3, heads=4, seed=5).eval().requires_grad_(False)
            model.load_state_dict(state, assign=True)
            compiled = torch.compile(offloaded(model, {"resident_bytes": 0}), backend="dlo")
            out[f"shared_{key}_exact"] = [_outcome(lambda: torch.equal(compiled(*x), want))
                                          for _ in range(2)]
            out[f"shared_{key}_stored"] = _stored_count(model)
        out["shared_dict_intact"] = all(torch.equal(shared[k], v)
                                        for k, v in twin.state_dict().items())
        out["shared_resident_exact"] = torch.equal(resident(*x), want)
    return out


def _shared_layer() -> dict:
    """Two models sharing a layer share a runtime: ``a`` offloaded, ``b``'s graph finds
    ``a``'s runtime through the shared layer and stores its own parameters there.
    Releasing one closed it and left the other's parameters stored in a closed runtime,
    their weights gone (its next call raised reading zero-byte storage): release gives back
    every parameter the runtime stores, and the compiled handles then refuse, naming
    release, until ``a`` is offloaded again."""
    torch._dynamo.reset()
    a, b, ref_a, ref_b = (reference_dit(width=64, depth=3, heads=4, seed=seed)
                          .eval().requires_grad_(False) for seed in (6, 7, 6, 7))
    b.blocks[0], ref_b.blocks[0] = a.blocks[0], ref_a.blocks[0]
    x = example_inputs(a.config, batch=2, height=8, width=8, seed=1)
    pairs = ((a, ref_a(*x)), (b, ref_b(*x)))
    offloaded(a)
    compiled = [(torch.compile(m, backend="dlo"), want) for m, want in pairs]
    with torch.no_grad():
        out = {"shared_layer_exact": [torch.equal(c(*x), want) for c, want in compiled]}
        dlo_fx.release(a)
        out["shared_layer_eager"] = [_outcome(lambda: torch.equal(m(*x), want))
                                     for m, want in pairs]
        out["shared_layer_stored"] = _stored_count(a) + _stored_count(b)
        out["shared_layer_refused"] = [_outcome(lambda: c(*x)) for c, _ in compiled]
        offloaded(a)
        out["shared_layer_again"] = [_outcome(lambda: torch.equal(c(*x), want))
                                     for c, want in compiled]
    out["shared_layer_eager_and_state"] = _eager_and_state(b, ref_b)
    return out


def _forked(dit_path: str, cfg, inputs, expected: torch.Tensor) -> dict:
    """``os.fork`` after a call (multiprocessing's default start method on Linux): in the
    child, the parent's model refuses a compiled call, an eager fetch and release, naming
    the fork (a call waited forever on a copy no thread ran there), and a model loaded in
    the child runs exactly. The parent's model is unaffected."""
    with fault_delay(0.001):  # every copy on the executor's thread
        model = dlo_fx.load(ReferenceDiT, dit_path, config=cfg, options=OPTIONS)
    compiled = torch.compile(model, backend="dlo")

    def exact(module) -> bool:
        with torch.no_grad():
            return torch.equal(module(*inputs), expected)

    out = {"fork_parent_before": exact(compiled)}
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child answers through the pipe and never returns
        try:
            os.close(read)
            signal.alarm(60)  # a hang ends the child: the parent reads no answer
            linear = next(m for m in model.modules()
                          if isinstance(m, torch.nn.Linear) and is_stored(m.weight))
            x = torch.zeros(1, linear.in_features, dtype=linear.weight.dtype)
            answer = {"call": _error(lambda: exact(compiled)), "eager": _error(lambda: linear(x)),
                      "release": _error(lambda: dlo_fx.release(model))}
            with fault_delay(0.001):
                fresh = dlo_fx.load(ReferenceDiT, dit_path, config=cfg, options=OPTIONS)
            answer["fresh"] = [exact(torch.compile(fresh, backend="dlo")) for _ in range(2)]
        except BaseException as exc:  # shown by the test, instead of "no answer"
            answer = {"child_error": error_text(exc)}
        try:
            os.write(write, json.dumps(answer).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        text = pipe.read()  # until the child exits
    os.waitpid(pid, 0)
    out["fork_child"] = json.loads(text) if text else None
    out["fork_parent_after"] = exact(compiled)
    return out


def allgather_state_dict(rank: int, world: int, dit_path: str, config) -> dict:
    """dp=2, allgather: state_dict gathers every block (each rank holds half of it), and
    raises on every rank when the ranks ask for different blocks; release puts the whole
    weights back on every rank."""
    ref = resident_dit(dit_path, config)
    model = dlo_fx.load(ReferenceDiT, dit_path, config=config, resident=SHARED,
                        options={"mode": "allgather", "collective_timeout_s": 30, **OPTIONS})
    runtime = runtimes_holding(list(model.parameters()))[0]
    out = {"mode": runtime.mode, "dp": runtime.store.dp,
           "host_bytes": runtime.store.host_bytes,
           "total_bytes": sum(b.nbytes for b in runtime.store.blocks)}
    # Each rank asks for another layer's weights: the ranks would gather different blocks
    # of the same size into each other's, a state dict of mixed bytes with no error. The
    # clock before the gather makes both raise, and the runtime stays usable.
    from dlo_fx.runtime.ranks.clock import ClockMismatch
    try:
        model.blocks[rank].state_dict()
        out["other_layers"] = "no error"
    except ClockMismatch as exc:
        out["other_layers"] = "read outside the graph" in str(exc)
    state = model.state_dict()
    ref_state = ref.state_dict()
    out["state_equal"] = state.keys() == ref_state.keys() and all(
        torch.equal(state[k], ref_state[k]) for k in ref_state)
    dlo_fx.release(model)
    out["release_equal"] = all(torch.equal(p, ref_state[k]) for k, p in model.named_parameters())
    out["live_after_release"] = sum(len(rt.store.blocks) for rt in live_runtimes())
    return out
