"""Every private torch API dlo uses, in one place: the seam to torch's internals.

Each is checked against the torch versions the project supports (2.11 to 2.13); a torch that
lacks one fails here with a message naming it, or answers "nothing found" where a fallback
is safe, not somewhere inside a call. No other module of dlo_fx names a ``torch._`` module
or attribute. The groups: what the stored-weight representation needs (`fake_mode_of`,
`swap_in_place`, `refuse_data_pointer`, `refuse_storage_resize`, `storage_key`,
`composite_kernel`, `view_tracked`, `DISABLED_TORCH_FUNCTION`,
`is_traceable_wrapper_subclass`, the pytree helpers `tree_flatten`, `tree_leaves`,
`tree_map`); what `dlo_fx.offload` and `dlo_fx.release` read of a compiled module or
function (`compiled_module_of`, `compile_backend_name`); a correction to Dynamo (`install_contains_fix`); what
``compiler="inductor"`` uses (`graph_fake_mode`, `restart_with_floats_specialized`,
`inductor_compile`, `inductor_config_key`, `storage_key`, `GRAD_MODE_TARGETS`); what the
passes use to find a parameter's aliases (`storage_key`); the op targets FLOPs are counted
on (`NN_LINEAR`); a tensor-parallel parameter's own local tensor (`dtensor_local`); errors,
compile callbacks and profiler state; the ATen-level mode `dlo_fx.plan` traces a forward
under (`TorchDispatchMode`).
Torch itself imports none of its Dynamo or Inductor modules here until a function needs
them, so the runtime, which uses the first group, never loads Dynamo.
"""

from __future__ import annotations

import functools
import inspect
import operator
from typing import Any, Callable, Optional, Sequence

import sympy
import torch
from torch import fx
# Tensor-subclass and pytree helpers torch keeps in private modules (the stored weight's
# dispatch flattens its arguments; layout and planning recognise a wrapper subclass).
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
# The mode `dlo_fx.plan` runs a model's forward under on the meta device (every ATen op,
# its arguments and outputs: the graph it counts FLOPs on, the storages it counts bytes of).
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map

#: ``__torch_function__`` of a tensor subclass that opts out of torch-function dispatch.
DISABLED_TORCH_FUNCTION = torch._C._disabled_torch_function_impl
#: ``F.linear``'s C function, the call_function target Dynamo records for it.
NN_LINEAR = torch._C._nn.linear
#: ``torch.set_grad_enabled``'s C function, the target of Dynamo's grad-mode nodes.
GRAD_MODE_TARGETS = (torch._C._set_grad_enabled,)


def fake_mode_of(t: torch.Tensor) -> Optional[Any]:
    """The fake mode ``t`` belongs to (Dynamo is tracing), or None for a real tensor."""
    from torch._subclasses.fake_tensor import FakeTensor

    return t.fake_mode if isinstance(t, FakeTensor) else None


def dtensor_local(t: Any) -> Optional[torch.Tensor]:
    """The local tensor a DTensor holds (the very object, ``_local_tensor``: ``to_local()``
    returns a new view of it), or None where ``t`` is no DTensor. dlo stores that object in
    place (see [Note: a tensor-parallel parameter streams its local shard] in
    runtime/weights/tensor_parallel.py)."""
    if not isinstance(t, torch.Tensor) or type(t).__name__ != "DTensor":
        return None
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else None


def swap_in_place(t1: torch.Tensor, t2: torch.Tensor) -> None:
    """``torch.utils.swap_tensors(t1, t2)`` without its refusal of weak references.

    Dynamo holds a weak reference to every parameter it traced, for as long as its code
    lives, so the public function refuses every parameter of a compiled model. Here a weak
    reference is wanted to follow the object: the parameter stays the same Python object
    and only its contents change, which is the point. The other checks stay: no C++
    holder of either tensor besides its autograd accumulator."""
    if not callable(getattr(torch._C, "_swap_tensor_impl", None)):
        raise RuntimeError("dlo: this torch has no torch._C._swap_tensor_impl; dlo cannot "
                           "store a parameter in place")
    for t, name in ((t1, "t1"), (t2, "t2")):
        count = t._use_count()
        if count > 2 or (count == 2 and not t.is_leaf):
            raise RuntimeError(
                f"dlo: cannot store a parameter of shape {tuple(t.shape)} in place: other "
                f"tensors hold it ({count} references to its tensor; {name}); drop them (an "
                "autograd graph through it, a tensor built with it as its base) and call again")
    t1.__class__, t2.__class__ = t2.__class__, t1.__class__
    d1, d2 = dict(vars(t1)), dict(vars(t2))
    vars(t1).clear()
    vars(t1).update(d2)
    vars(t2).clear()
    vars(t2).update(d1)
    torch._C._swap_tensor_impl(t1, t2)


def refuse_data_pointer(t: torch.Tensor) -> None:
    """Make C++ readers of ``t``'s mutable data pointer raise (torch's RuntimeError, as for
    a fake tensor) instead of reading the address of a storage that has no data: a
    wrapper subclass's ``data_ptr()`` is 0 (``torch.utils.dlpack.to_dlpack`` exported it).
    Nothing on a torch without the flag."""
    flag = getattr(torch._C, "_set_throw_on_mutable_data_ptr", None)
    if callable(flag):
        flag(t)


def refuse_storage_resize(t: torch.Tensor) -> None:
    """Give wrapper tensor ``t`` a storage of no bytes that cannot be resized, in place of
    the one ``_make_wrapper_subclass`` gives it (no bytes, resizable, and its allocator's
    every block is address 0), ``t``'s layout kept. A ``set_`` that puts the storage under
    a tensor that has elements must resize it: it raises torch's RuntimeError ("Trying to
    resize storage that is not resizable") instead of growing it to a null pointer that
    tensor reads. Torch checks this below any dispatch, where
    ``t2.set_(t, offset, size, stride)`` takes ``t``'s storage. Nothing on a torch without
    the two functions used, for a ``t`` of symbolic sizes (one Dynamo builds while
    tracing: the storage is not read there), or where torch cannot copy a plain tensor's
    storage onto ``t`` (``.data =`` refuses: on the meta device, whose bytes nothing
    reads, and on an out-of-tree device)."""
    reinterpret = _reinterpret_tensor()
    make_storage = getattr(torch._C, "_construct_storage_from_data_pointer", None)
    if reinterpret is None or not callable(make_storage) or t._has_symbolic_sizes_strides:
        return
    # A storage with no allocator is not resizable. Inductor's _reinterpret_tensor lays
    # out a view over its no bytes (it checks no bounds: it views storages that FSDP and
    # CUDA graphs emptied), and ``.data =`` copies that storage and layout onto ``t``.
    storage = make_storage(0, t.device, 0)
    with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
        empty = torch.empty(0, dtype=t.dtype, device=t.device).set_(storage)
        layout = reinterpret(empty, t.shape, t.stride(), t.storage_offset())
        if torch._has_compatible_shallow_copy_type(t, layout):
            torch._C.TensorBase.data.__set__(t, layout)


@functools.cache
def composite_kernel(func: Any) -> Optional[Callable]:
    """``func``'s ``CompositeImplicitAutograd`` kernel (torch's C++ one: the kernel a plain
    tensor runs, not a Python decomposition registered beside it), or None where ``func``
    has none. It runs the op as the ops it is made of, each dispatched on its own."""
    key = torch._C.DispatchKey.CompositeImplicitAutograd
    if not torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), key):
        return None
    return functools.partial(func._op_dk, key)


@functools.cache
def view_tracked(func: Any) -> bool:
    """Whether torch's view tracking (``ADInplaceOrView``) has a kernel for ``func``: it
    makes ``func``'s outputs views of its input after any tensor subclass's dispatch."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(
        func.name(), torch._C.DispatchKey.ADInplaceOrView)


@functools.cache
def _reinterpret_tensor() -> Optional[Callable]:
    """``torch.ops.inductor._reinterpret_tensor`` (a view of a tensor's storage with any
    layout, bounds unchecked; a C++ op, it loads no Inductor module), or None."""
    return getattr(torch.ops.inductor, "_reinterpret_tensor", None)


# -- a compiled function or module (release, offload) ----------------------------------
def compile_backend_name(fn: Any) -> Optional[str]:
    """The name of the backend a ``torch.compile`` wrapper of a function compiles with
    (``module.compile``'s ``_compiled_call_impl``, a compiled bound method): Dynamo's
    callback, down its ``_torchdynamo_orig_backend`` chain to the wrapper that names the
    backend. None for anything else, or on a torch where the chain is not there."""
    if not callable(fn) or getattr(fn, "_torchdynamo_orig_callable", None) is None:
        return None
    try:
        found = inspect.getclosurevars(fn).nonlocals.get("callback")
    except (TypeError, ValueError):  # not a Python function
        return None
    for _ in range(16):  # a few wrappers deep
        name = getattr(found, "compiler_name", None)
        if isinstance(name, str) or found is None:
            return name
        found = getattr(found, "_torchdynamo_orig_backend", None)
    return None


def compiled_call(module: torch.nn.Module) -> Optional[Callable]:
    """What ``module(...)`` calls in place of ``_call_impl`` (``module.compile``'s
    ``_compiled_call_impl`` on the instance), or None."""
    return vars(module).get("_compiled_call_impl")


def set_compiled_call(module: torch.nn.Module, fn: Optional[Callable]) -> None:
    """Make ``module(...)`` call ``fn`` (None: ``_call_impl`` again)."""
    if fn is None:
        vars(module).pop("_compiled_call_impl", None)
    else:
        module._compiled_call_impl = fn


def compiled_module_of(value: Any) -> Optional[torch.nn.Module]:
    """The module a ``torch.compile`` wrapper (``OptimizedModule``) wraps, else None."""
    from torch._dynamo.eval_frame import OptimizedModule

    if isinstance(value, OptimizedModule) and isinstance(value._orig_mod, torch.nn.Module):
        return value._orig_mod
    return None


# -- errors raised past Dynamo (dynamo/errors.py) ----------------------------------------
def unwrapped_error_base() -> type:
    """Dynamo's ``ShortenTraceback``: what a backend raises of that class reaches the
    caller as raised, where any other exception becomes ``BackendCompilerFailed`` (first
    line ``backend='dlo_backend' raised:``). ``Exception`` on a torch without it (the error
    is then wrapped, but still raised)."""
    try:
        from torch._dynamo.exc import ShortenTraceback
    except ImportError:
        return Exception
    return ShortenTraceback


# -- compile time (engine/progress.py) -----------------------------------------------------
def on_compile(start: Any, end: Any) -> bool:
    """Call ``start()`` when Dynamo begins compiling (no compile under way) and ``end()``
    when it is done (Dynamo's ``callback_handler``); False on a torch without it."""
    try:
        from torch._dynamo.callback import callback_handler
    except ImportError:
        return False
    callback_handler.register_start_callback(lambda _args: start())
    callback_handler.register_end_callback(lambda _args: end())
    return True


# -- profiler spans (ops.py) ------------------------------------------------------------
def profiler_enabled() -> bool:
    """Whether a torch profiler records now (``torch.autograd.profiler``'s own flag, set
    by ``torch.profiler.profile`` on entry): a schedule op opens a ``record_function`` span
    only then, so a call pays one attribute read per op otherwise."""
    return torch.autograd.profiler._is_profiler_enabled


# -- a correction to Dynamo's `x in sequence` (dynamo/backend.py) ------------------------
# [Note: `x in list` with a symbolic element]
# What must hold: ``const in [a, b, ...]`` in a frame traced for dlo gives the answer Python
# gives for every value the compiled code will be called with.
#
# Dynamo before torch 2.14 evaluates ``const in [a, b, ...]`` at trace time by comparing the
# constant with the elements that are Python constants only, and installs no guard. An
# element Dynamo made dynamic (automatic dynamic: an int argument that changed between
# calls becomes a SymInt) is skipped, so ``0 in [s0, 2]`` is False whatever ``s0`` is, and
# the compiled code takes the wrong branch with no error (diffusers'
# ``SD3Transformer2DModel(..., skip_layers=[...])``: after ``skip_layers=[1]`` and then
# ``[0, 2]``, block 0 runs, with ``backend="eager"`` too). Upstream fixed ``iter_contains``
# in pytorch#184765 (after 2.13), so the correction is installed on torch older than
# `CONTAINS_FIXED_IN` only. The suite's skip-layers test runs on every torch, so a torch at
# or past that version without the fix fails it.
#
# `install_contains_fix` wraps ``iter_contains`` where Dynamo binds it
# (``torch._dynamo.utils``, and ``torch._dynamo.variables.lists``, which imported it by
# name). The wrapper changes one case only, and only in a frame traced for a dlo backend
# (`_traced_for_dlo`; every other compile in the process gets Dynamo's function as it is):
# when the searched value is a constant and an element is symbolic, every element is
# compared through Dynamo's own ``==`` and ``or``, as for a symbolic searched value, so the
# branch taken is guarded on (``Eq(s0, 0)``) and a later call with other values
# recompiles. It is installed when ``dlo_fx.dynamo.backend`` is imported, which
# ``torch.compile(backend="dlo")`` does before it traces. Where Dynamo's function is not
# there in that form, nothing is installed.
_CONTAINS_PARAMETERS = ["items", "search", "tx", "check_tensor_identity"]
#: The first torch whose Dynamo answers ``const in [SymInt, ...]`` correctly itself.
CONTAINS_FIXED_IN = (2, 14)


def _traced_for_dlo(tx: Any) -> bool:
    """Whether the frame ``tx`` traces is compiled for a backend of dlo's own: the backend
    at the end of Dynamo's wrappers (``_torchdynamo_orig_backend``, ``compiler_fn``) is a
    function of this package. True where the chain cannot be followed (the correction
    then errs on the side of dlo's models)."""
    found = getattr(getattr(tx, "output", None), "compiler_fn", None)
    for _ in range(16):  # a few wrappers deep
        inner = getattr(found, "_torchdynamo_orig_backend", None) or \
            getattr(found, "compiler_fn", None)
        if inner is None:
            break
        found = inner
    module = getattr(found, "__module__", None)
    return module is None or module.split(".")[0] == __name__.split(".")[0]


def _contains_through_eq(items: list, search: Any, tx: Any) -> Any:
    """``search in items`` through Dynamo's own ``==`` and ``or``, guarded."""
    from torch._dynamo.variables.builder import SourcelessBuilder

    eq = SourcelessBuilder.create(tx, operator.eq)
    or_ = SourcelessBuilder.create(tx, operator.or_)
    found = None
    for x in items:
        check = eq.call_function(tx, [x, search], {})
        found = check if found is None else or_.call_function(tx, [check, found], {})
    return found


def _fixed_contains(original: Callable) -> Callable:
    from torch._dynamo.variables.builder import SourcelessBuilder  # noqa: F401 (moved: none)
    from torch._dynamo.variables.tensor import SymNodeVariable

    @functools.wraps(original)
    def iter_contains(items: Any, search: Any, tx: Any, check_tensor_identity: bool = False) -> Any:
        items = list(items)
        if not (search.is_python_constant() and any(
                not x.is_python_constant() and isinstance(x.realize(), SymNodeVariable)
                for x in items) and _traced_for_dlo(tx)):
            return original(items, search, tx, check_tensor_identity)
        return _contains_through_eq(items, search, tx)

    iter_contains.__dlo_fixed__ = True
    return iter_contains


def install_contains_fix() -> bool:
    """Wrap Dynamo's ``iter_contains`` (once) on a torch older than `CONTAINS_FIXED_IN`;
    False where it is not needed or not there as expected. See [Note: `x in list` with a
    symbolic element]."""
    if torch.torch_version.TorchVersion(torch.__version__) >= CONTAINS_FIXED_IN:
        return False
    import torch._dynamo.utils as utils
    import torch._dynamo.variables.lists as lists

    original = getattr(utils, "iter_contains", None)
    if original is None or getattr(original, "__dlo_fixed__", False):
        return original is not None
    if list(inspect.signature(original).parameters) != _CONTAINS_PARAMETERS or \
            getattr(lists, "iter_contains", None) is not original:
        return False
    try:
        fixed = _fixed_contains(original)
    except (ImportError, AttributeError):  # another torch: its classes moved
        return False
    utils.iter_contains = fixed
    lists.iter_contains = fixed
    return True


# -- compiler="inductor" (inductor/) --------------------------------------------------------
def graph_fake_mode(gm: fx.GraphModule, inputs: Sequence[Any]) -> Any:
    """The fake mode Dynamo traced ``gm`` in (from its inputs or its nodes' example
    values), or a fresh one."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = detect_fake_mode(inputs)
    if mode is not None:
        return mode
    for node in gm.graph.nodes:
        found = fake_mode_of(node.meta.get("example_value"))
        if found is not None:
            return found
    return FakeTensorMode()


def storage_key(t: torch.Tensor) -> int:
    """An identity of ``t``'s storage that aliases share (fake tensors included): the one
    way dlo tells storages apart (the stored weight's views, the passes' aliases of a
    parameter, the Inductor pieces' inputs). It is what `StorageWeakRef` hashes, valid
    while the storage lives."""
    return t.untyped_storage()._cdata


def inductor_config_key() -> tuple:
    """What of Inductor's and AOTAutograd's configuration a compiled piece depends on."""
    return (torch._inductor.config.get_hash(), torch._functorch.config.get_hash())


def inductor_compile(gm: fx.GraphModule, inputs: list) -> Callable:
    """``gm`` compiled by Inductor (AOTAutograd, then Inductor), weights kept as inputs:
    no folding into constants, no recorded addresses."""
    from torch._inductor.compile_fx import compile_fx

    with torch._inductor.config.patch({"freezing": False, "triton.cudagraphs": False}):
        return compile_fx(gm, inputs)


# [Note: tensorified floats]
# Every float Dynamo passes as a tensor is specialized before anything is compiled or
# stored: a piece cannot take one as an input. With ``dynamic=True`` (and
# ``torch._dynamo.config.specialize_float=False``, the default), Dynamo passes Python
# floats, a module's float attributes (``LayerNorm.eps``) and float arguments of ``forward``
# alike, as 0-d float64 tensors and reads each with ``.item()``, a backed ``SymFloat``.
# ``backend="inductor"`` compiles the whole graph: it turns the float arithmetic it can into
# tensor arithmetic, and the rest (LayerNorm's eps, on which Dynamo already guarded) it
# specializes, restarting Dynamo's analysis of the frame with the float a constant checked
# by a guard (``tensorify_python_scalars``). A piece can do neither: Inductor traces it
# from its own inputs, where the ``.item()`` of such a tensor is a data-dependent number,
# and the compile fails (``GuardOnDataDependentSymNode`` for the eps,
# ``DataDependentOutputException`` for a float argument). So
# `restart_with_floats_specialized` specializes every such float and Dynamo traces the
# frame again. Values are unchanged (the graph reads the same float, as a constant); what
# differs from ``backend="inductor"`` is that a float argument Inductor would keep symbolic
# is guarded on, so each new value compiles the frame again, up to Dynamo's recompile limit
# (past it the frame runs eagerly, still exact).
def restart_with_floats_specialized(gm: fx.GraphModule) -> None:
    """Have Dynamo trace the frame again with ``gm``'s tensorified float inputs
    specialized, if any is not yet. See [Note: tensorified floats]."""
    from torch._dynamo.exc import TensorifyScalarRestartAnalysis
    from torch._dynamo.symbolic_convert import TensorifyState

    names = []
    for node in gm.graph.find_nodes(op="placeholder"):
        value = node.meta.get("example_value")
        memo = value.item_memo if fake_mode_of(value) is not None else None
        if not isinstance(memo, torch.SymFloat):
            continue
        symbol = memo.node._expr  # the symbol itself, not what it was replaced by
        if isinstance(symbol, sympy.Symbol) and not TensorifyState.should_specialize(
                symbol.name):
            names.append(symbol.name)
    for name in names:
        TensorifyState.specialize(name)
    if names:
        raise TensorifyScalarRestartAnalysis


def graph_break() -> None:
    """``torch._dynamo.graph_break()``: end the graph here (the reference DiT's option)."""
    torch._dynamo.graph_break()
