"""Hollow parameters read outside a scheduled graph are fetched for that call.

[Note: eager reads of streamed parameters]
Dynamo does not compile everything a model runs: after a graph break the resumed frame may
run eagerly, ``torch.nn`` modules called from an eager frame run eagerly, and code compiled
for one instance of a class can send another instance's call down an eager path. Such
code reads the module's own parameters, which are hollow (zero-byte storage) once their
bytes are in the host store. So every module that directly owns hollow parameters gets a
forward pre-hook and an always-called forward hook (`fetch_eagerly`):

- while Dynamo traces, ``torch.compiler.is_dynamo_compiling()`` is true and both hooks
  are no-ops (they trace to nothing, so scheduled graphs are unchanged). Not
  ``is_compiling()``: run eagerly, that reads a flag Dynamo holds for the whole process
  while any thread compiles, so a thread's eager call skipped its fetch while another
  thread compiled, and its forward read zero-byte storage. ``is_dynamo_compiling()`` is
  False when run and folded to True only where Dynamo traces it;
- in an eager call of a module whose ``forward`` Dynamo has compiled as a frame of its
  own (a graph break inside it makes Dynamo do that), the hooks run eagerly around the
  compiled code: nothing is fetched when that code will run, i.e. Dynamo is active and
  the guards of one of its compiled entries pass for this call (`_compiled_as_frame`).
  Otherwise Dynamo runs the ``forward`` eagerly (no compile context, or the recompile
  limit hit: one entry per layer when guards read a layer's own attributes) or compiles
  it anew, and the parameters are fetched (for a new compile, needlessly but correctly).
  A ``torch.nn`` layer is always fetched: Dynamo compiles its forward as a frame only
  while it has hooks, and skips that code for good once it meets an unhooked one (a
  layer of another model), so its entries can pass their guards and never run;
- in any other eager call, the pre-hook copies the parameters' blocks from the host store (in
  allgather mode: gathered, behind a collective clock exchange, through the same worker as
  every gather, so the ranks stay in step) and gives each parameter its bytes back; the
  forward hook hollows them again, also when the forward raises. A counter per module
  keeps nested and concurrent calls of one module materialised until the last one ends.

The first eager fetch of each module logs a `RuntimeWarning` naming it: it is correct but
slow (every call copies the blocks again), and a graph break moved into that module is
usually the cause.

The module whose ``forward`` Dynamo compiles as a frame (the model given to
``torch.compile``) is the exception: ``nn.Module.__call__`` runs its hooks eagerly around
the compiled code on every call, so a fetch there would copy its blocks on every call.
Its own streamed parameters (modulation tables, positional embeddings: small) are kept
materialised instead, fetched once when a graph is committed, so an eager run of its
``forward`` (Dynamo may fall back to it) reads real bytes.
"""

from __future__ import annotations

import functools
import inspect
import threading
import warnings
import weakref
from typing import Any

import torch
from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list, get_eval_frame_callback
from torch._dynamo.eval_frame import skip_code

from .host_store import is_hollow

_HOOKED: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
_WARNED: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()  # warned about once
_LOCK = threading.Lock()
_users: "weakref.WeakKeyDictionary[torch.nn.Module, int]" = weakref.WeakKeyDictionary()
_KEPT: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()  # own params kept materialised
_RUNTIME_OF: "weakref.WeakKeyDictionary[torch.nn.Module, Any]" = weakref.WeakKeyDictionary()


def _own_streamed(module: torch.nn.Module, runtime: Any) -> list[torch.nn.Parameter]:
    return [p for p in module._parameters.values()
            if p is not None and p.numel() and p in runtime.store]


def fetch_eagerly(root: torch.nn.Module, runtime: Any, keep_own: bool = False) -> None:
    """Hook every module under ``root`` that owns parameters in ``runtime``'s store.

    With ``keep_own`` (``root.forward`` is a compiled frame of its own, or ``root`` is the
    model given to ``torch.compile``), the hooks of ``root`` itself run eagerly on every
    call: its own streamed parameters are kept materialised instead (fetched here, once
    per compile)."""
    if keep_own:
        with runtime.lock:
            own = _own_streamed(root, runtime)
            params = [p for p in own if is_hollow(p)]  # none when its pre-hook fetched them
            if params:
                _materialise(runtime, root, params, warn=False)
            if own:
                _KEPT.add(root)  # its hooks (if any) leave them materialised from now on
    for module in root.modules():
        if module in _HOOKED or module in _KEPT or not _own_streamed(module, runtime):
            continue
        _RUNTIME_OF[module] = weakref.ref(runtime)
        _install_hooks(module)
        _HOOKED.add(module)


_HOOK_IDS: list[int] = []  # (pre-hook id, forward-hook id), shared by every hooked module


def _install_hooks(module: torch.nn.Module) -> None:
    """The two hooks, under the same two hook ids on every module. Dynamo guards a traced
    module call on its hook ids (``hook_id in module._forward_hooks_always_called``): with
    an id per module, code compiled for one layer's frame failed the guard of the next
    layer, so a model with a graph break in its blocks, loaded hollow (hooked before its
    first trace), recompiled that frame for every layer, and past Dynamo's recompile limit
    (8) ran the rest eagerly."""
    if not _HOOK_IDS:
        pre = module.register_forward_pre_hook(_pre_hook, with_kwargs=True)
        post = module.register_forward_hook(_post_hook, always_call=True)
        _HOOK_IDS.extend((pre.id, post.id))
        return
    pre_id, post_id = _HOOK_IDS  # what register_forward_(pre_)hook would store, by hand
    module._forward_pre_hooks[pre_id] = _pre_hook
    module._forward_pre_hooks_with_kwargs[pre_id] = True
    module._forward_hooks[post_id] = _post_hook
    module._forward_hooks_always_called[post_id] = True


def hooked_for(runtimes: Any) -> list[torch.nn.Module]:
    """The modules `fetch_eagerly` hooked for any of ``runtimes``."""
    return [m for m, ref in list(_RUNTIME_OF.items()) if any(ref() is r for r in runtimes)]


def unhook(root: torch.nn.Module) -> None:
    """Take what `fetch_eagerly` put on ``root`` and its modules off again (`release`: the
    module is ordinary again). Left on, they kept pointing at the released runtime, and a
    later store (the next call of a graph) skipped them as hooked: an eager call of a
    submodule then read its hollow parameters."""
    for module in root.modules():
        if module in _HOOKED:
            pre_id, post_id = _HOOK_IDS
            module._forward_pre_hooks.pop(pre_id, None)
            module._forward_pre_hooks_with_kwargs.pop(pre_id, None)
            module._forward_hooks.pop(post_id, None)
            module._forward_hooks_always_called.pop(post_id, None)
            _HOOKED.discard(module)
        _KEPT.discard(module)
        _RUNTIME_OF.pop(module, None)
        _users.pop(module, None)


def fetches_eagerly(root: torch.nn.Module) -> bool:
    """Whether an eager call of ``root`` reads no hollow parameter unfetched: every module
    under it that owns one carries the hooks `fetch_eagerly` installs for a live runtime."""
    for module in root.modules():
        if any(p is not None and is_hollow(p) for p in module._parameters.values()):
            ref = _RUNTIME_OF.get(module)  # set with the hooks, popped with them
            if ref is None or ref() is None:
                return False
    return True


def kept_materialised(root: torch.nn.Module) -> set[int]:
    """Ids of the parameters under ``root`` kept materialised because their module's own
    ``forward`` is compiled as a frame (see the Note): in the host store, but not hollow."""
    return {id(p) for m in root.modules() if m in _KEPT for p in m._parameters.values()
            if p is not None}


# The hooks are traced into nothing while Dynamo traces a module call
# (is_dynamo_compiling() is true there). Called from an eager frame they must really run:
# Dynamo would otherwise compile the hook itself as a frame of its own, where it is true
# as well. So their code is never compiled as a top-level frame, and what they call runs
# with Dynamo disabled.
def _pre_hook(module: torch.nn.Module, args: Any, kwargs: Any) -> None:
    if not torch.compiler.is_dynamo_compiling():
        # Read here: inside `_enter` (Dynamo disabled) the callback is always None.
        dynamo_active = get_eval_frame_callback() is not None
        _enter(module, args, kwargs, dynamo_active)


@functools.lru_cache(maxsize=None)
def _signature(function: Any) -> inspect.Signature:
    return inspect.signature(function)


def _compiled_as_frame(module: torch.nn.Module, args: Any, kwargs: Any,
                       dynamo_active: bool) -> bool:
    """The compiled code Dynamo holds for this module's ``forward`` as a frame of its own
    will run for this call: ``nn.Module.__call__`` runs the hooks eagerly, then the
    compiled ``forward`` reads the slots, so a fetch here would only copy the blocks for
    nothing. True only when Dynamo is active and an entry's guards pass for the frame's
    locals (the call's arguments bound to ``forward``); a fetch is always correct."""
    forward = getattr(module.forward, "__func__", None)
    code = getattr(forward, "__code__", None)
    if not dynamo_active or code is None:
        return False
    # Dynamo compiles the forward of a torch.nn module class as a frame only while the
    # module has hooks, and once it meets one without (another model's layer), it skips
    # that code for good: entries compiled before still pass their guards, but never run.
    if type(module).__module__.startswith(("torch.nn.", "torch.ao.")):
        return False
    try:
        entries = _debug_get_cache_entry_list(code)
        if not entries:
            return False
        bound = _signature(forward).bind(module, *args, **(kwargs or {}))
        bound.apply_defaults()
        frame_locals = dict(bound.arguments)
        return any(entry.guard_manager.check(frame_locals) for entry in entries)
    except Exception:  # private API, or arguments forward does not take: fetch
        return False


def _post_hook(module: torch.nn.Module, args: Any, out: Any) -> None:
    if not torch.compiler.is_dynamo_compiling():
        _leave(module)


skip_code(_pre_hook.__code__)
skip_code(_post_hook.__code__)


@torch._dynamo.disable
def _enter(module: torch.nn.Module, args: Any, kwargs: Any, dynamo_active: bool) -> None:
    ref = _RUNTIME_OF.get(module)
    runtime = ref() if ref is not None else None
    if runtime is None or module in _KEPT:
        return
    with runtime.lock:
        users = _users.get(module, 0)
        _users[module] = users + 1  # before raising: the forward hook always runs
        own = _own_streamed(module, runtime)
        runtime.store.check_storages(own)
        if users:
            return
        params = [p for p in own if is_hollow(p)]
        if not params or _compiled_as_frame(module, args, kwargs, dynamo_active):
            return
        try:
            _materialise(runtime, module, params)
        except BaseException:
            _users[module] = 0
            _hollow(params)
            raise


@torch._dynamo.disable
def _leave(module: torch.nn.Module) -> None:
    ref = _RUNTIME_OF.get(module)
    runtime = ref() if ref is not None else None
    if runtime is None or module in _KEPT:
        return
    with runtime.lock:
        users = _users.get(module, 0) - 1
        _users[module] = max(users, 0)
        if users <= 0:  # not a parameter given other data since: that data is the user's
            own = _own_streamed(module, runtime)
            _hollow([p for p in own if runtime.store.has_own_storage(p)])


def _hollow(params: list[torch.nn.Parameter]) -> None:
    for p in params:
        p.untyped_storage().resize_(0)


def _materialise(runtime: Any, module: torch.nn.Module, params: list[torch.nn.Parameter],
                 warn: bool = True) -> None:
    entries = [runtime.store.entry(p) for p in params]
    name = entries[0].fqn.rsplit(".", 1)[0] if "." in entries[0].fqn else "<root>"
    with _LOCK:
        first = module not in _WARNED
        _WARNED.add(module)
    if first and warn:
        warnings.warn(
            f"dlo: module {name!r} ({type(module).__name__}) runs outside a scheduled graph "
            "(Dynamo runs this code eagerly), so its streamed parameters are copied from the "
            "host store on every such call: correct, but slow. A graph break inside or "
            "around this module usually causes it", RuntimeWarning, stacklevel=4)
    flats = {}
    for e in sorted({e.block for e in entries}):
        flats[e] = runtime.fetch_block(e, f"the eager call of {name!r}", clock=True)
    with torch.no_grad():
        for p, e in zip(params, entries):
            src = e.view_of(flats[e.block])
            need = p.storage_offset() * p.element_size() + e.nbytes
            p.untyped_storage().resize_(need)
            # A parameter made under inference_mode is an inference tensor: written only
            # inside inference mode (and a normal one only outside it). inference_mode(False)
            # turns grad mode back on: no_grad inside it, for parameters that require grad.
            with torch.inference_mode(p.is_inference()), torch.no_grad():
                p.copy_(src)
    runtime.store.note_fetched(params)  # a later write in place is refused (host_store.py)
