"""`StoredWeight`: a parameter whose weights are in a dlo host store.

[Note: a stored weight is a tensor]
A parameter whose bytes dlo moved into the host store stays the same Python object and
still behaves as that tensor: every read is exact, every write is refused, and nothing
hands out the address of bytes it does not have. It becomes a `StoredWeight` in place: a
wrapper tensor subclass (``torch.Tensor._make_wrapper_subclass``, as FSDP2's DTensor
parameters and torchao's quantized weights are) with the parameter's shape, strides,
dtype, device and ``requires_grad``, and no storage of its own. Its storage offset is 0
whatever the parameter's was (a view into a larger tensor: q and k cut from one fused
tensor): the host store holds the parameter's own storage span only, and Dynamo's fake copy
of the wrapper is rebuilt by `__tensor_unflatten__`, which is given the shape and strides
but not the offset (an offset it then had to reproduce failed inside Dynamo, "set the storage
of a tensor on device cpu to a storage on ... meta"). `become_stored` swaps its
contents, as ``torch.utils.swap_tensors`` does, so the model, the host store (keyed by
``id``) and every reference the user holds keep pointing at it.

Inside a compiled graph nothing ever computes on it: Dynamo traces the subclass (it is
traceable: `__tensor_flatten__` names one empty device tensor, which Dynamo fakes), the
backend receives the parameters themselves as example inputs, and the passes replace every
use by a view of a device slot. Outside a graph every operation goes through
`__torch_dispatch__`, one place for every library method that reads or writes weights:

- a read (``p.sum()``, ``print(p)``, an eager module call, ``torch.func.functional_call``,
  ``model.apply(fn)``) fetches the block from the host store onto the device (gathered in
  allgather mode, behind a collective clock word, as a graph's gathers are) and runs the op
  on the real bytes. The first such read of a module's weights warns once, naming the
  module (every eager read copies the block again: correct, but slow);
- a view (``p.t()``, ``p[0]``, ``p.view(...)``, ``p.as_strided(...)``) is another
  `StoredWeight`: see [Note: a view of a stored weight]. A write through it is refused too;
- a write (an in-place op or an ``out=`` into it, each tensor of a list that a foreach or
  fused optimizer op writes, ``p.data = ...``, ``copy_`` from ``load_state_dict``, a LoRA
  merge through ``param.data``) and ``copy.deepcopy`` raise ``ValueError`` naming the
  parameter and `dlo_fx.release`, before the op writes anything (a write into the
  parameter itself also while Dynamo traces it). A conversion (``p.float()``,
  ``p.to(device)``) is a read: it returns a new tensor, as for any parameter. Converting
  the module (``module.to(...)``, ``.half()``) would replace its parameters: it is refused
  for the whole module before anything changes (`dlo_fx.model.guard`), and the
  parameter's ``data`` setter refuses it where no guard is;
- ``torch.save`` and pickling store the real weights; a way out that would hand out an
  address copies or raises: see [Note: no pointer to a stored weight].

While Dynamo traces (its fake mode is active on the inner tensor) an op computes fake
outputs of the right metadata, so tracing reads nothing.

A parameter becomes a `StoredWeight` when its block is stored, before Dynamo traces the
model (see [Note: when a parameter becomes a StoredWeight] in `runtime/runtime.py`).
"""

from __future__ import annotations

import hashlib
import sys
import threading
import warnings
import weakref
from typing import Any, Optional

import torch

from ... import torch_private
from ...torch_private import is_traceable_wrapper_subclass, tree_flatten, tree_map
from ..host.layout import own_wrapper, storage_span
from ...planning.view import FAKE_STAND_IN
from .owners import owner_of
from .tensor_parallel import check_not_distributing

aten = torch.ops.aten

# Attribute names a `StoredWeight` carries in its __dict__ (beside the parameter's own).
_OURS = ("_dlo_token", "_dlo_origin", "_dlo_steps", "_dlo_bits", "_dlo_released", "_dlo_class")

_WARNED: "weakref.WeakSet[Any]" = weakref.WeakSet()  # runtimes warned about once
_WARN_LOCK = threading.Lock()

_LOAD_ADVICE = ("load the model with dlo_fx.load(..., dtype=...) and options={'device': ...} "
                "for the dtype and device it should run in")


def release_advice(instead: str = "", then: str = "", load: bool = False, after: str = "",
                   target: str = "model") -> str:
    """The way out that ends every refusal caused by weights in a dlo host store, in one
    wording: ``instead`` (what works as it is), then releasing first (``then``: what to do
    once released), then loading for the dtype and device wanted (``load``) and ``after``,
    joined by "or", as one sentence without its full stop. ``target``: the name the
    advice gives the object to release (``model``, ``pipe``)."""
    release = f"call dlo_fx.release({target}) first" + (f" {then}" if then else "")
    text = ", or ".join([s for s in (instead, release) if s] +
                        ([_LOAD_ADVICE] if load else []) + ([after] if after else []))
    return text[0].upper() + text[1:]


def rewrapped(value: Any) -> TypeError:
    """The refusal of ``type(p)(tensor, requires_grad=...)`` for a stored parameter ``p``:
    how a library makes a new parameter of a parameter's own class to put in its place
    (accelerate's ``set_module_tensor_to_device``, which ``cpu_offload`` and
    ``dispatch_model`` call after dlo stored the model)."""
    what = (f"a {type(value).__name__} of shape {tuple(value.shape)}"
            if isinstance(value, torch.Tensor) else repr(value))
    return TypeError(
        f"dlo: StoredWeight({what}, ...): code outside dlo is making a new parameter of a "
        "stored weight's class to put in its place, as accelerate's set_module_tensor_to_device "
        "(cpu_offload, dispatch_model) does; a stored weight's bytes are in dlo's host store, "
        "and another offloading cannot take them over. " +
        release_advice(then="and give the model to the other offloading, or keep dlo's "
                            "(it streams the weights itself)"))


@own_wrapper
class StoredWeight(torch.Tensor):
    """A parameter (or a view of one) whose weights are in a dlo host store: see
    [Note: a stored weight is a tensor]. ``_dlo_origin`` is the stored parameter it reads
    (None: itself), ``_dlo_steps`` the views applied to it, ``_dlo_bits`` its conjugate and
    negative bits, ``_dlo_token`` the empty device tensor Dynamo fakes."""

    __torch_function__ = torch_private.DISABLED_TORCH_FUNCTION
    # DLPack's C exchange API reads a tensor's data pointer without Python: consumers
    # fall back to __dlpack__, which hands out a copy.
    __dlpack_c_exchange_api__ = None

    @staticmethod
    def __new__(cls, shape: Any, stride: Any = None, dtype: Optional[torch.dtype] = None,
                device: Optional[torch.device] = None, requires_grad: bool = False,
                storage_offset: int = 0, token: Optional[torch.Tensor] = None) -> "StoredWeight":
        if isinstance(shape, torch.Tensor) or stride is None or dtype is None or device is None:
            raise rewrapped(shape)
        t = torch.Tensor._make_wrapper_subclass(
            cls, tuple(shape), strides=tuple(stride), storage_offset=storage_offset,
            dtype=dtype, device=device, requires_grad=requires_grad, storage_size=0)
        # No bytes behind it (see [Note: no pointer to a stored weight]): a storage of none
        # whose mutable data pointer C++ readers are refused, and which cannot be resized;
        # but for the fake copies Dynamo makes (their inner tensor is not a plain one),
        # whose storage torch's meta converter resizes to none
        if token is None or type(token) is torch.Tensor:
            torch_private.refuse_storage_resize(t)
        torch_private.refuse_data_pointer(t)
        t._dlo_token = token if token is not None else torch.empty(0, dtype=torch.uint8,
                                                                   device=device)
        t._dlo_origin = None
        t._dlo_steps = ()
        t._dlo_bits = (False, False)
        return t

    # -- Dynamo: a traceable subclass with one (empty) inner tensor ----------------------
    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        # No per-parameter context: Dynamo guards on it, and a graph reused for every
        # layer of a model must not recompile per layer.
        # The dtype alone, which Dynamo guards on anyway.
        return ["_dlo_token"], self.dtype

    def _stable_hash_for_caching(self) -> str:
        """The AOT autograd cache's key of this input: its metadata, strides included (the
        default hashes the shape and the flatten context, not the strides), never its
        bytes, which the host store holds and a graph reads through its slots."""
        meta = (type(self).__qualname__, tuple(self.shape), tuple(self.stride()),
                self.storage_offset(), str(self.dtype), str(self.device), self.requires_grad)
        return hashlib.blake2b(repr(meta).encode(), digest_size=16).hexdigest()

    @staticmethod
    def __tensor_unflatten__(inner: dict, ctx: Any, outer_size: Any, outer_stride: Any) -> Any:
        token = inner["_dlo_token"]
        return StoredWeight(outer_size, outer_stride, ctx, token.device, token=token)

    # -- what the object is ---------------------------------------------------------------
    @property
    def origin(self) -> "StoredWeight":
        """The stored parameter this tensor reads."""
        return self if self._dlo_origin is None else self._dlo_origin

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        name = stored_name(self.origin)
        try:
            values = repr(_read(self).cpu())
        except Exception as exc:  # a released runtime, a failed fetch: say so, no crash
            values = f"<weights unavailable: {exc}>"
        what = "Parameter" if self._dlo_origin is None and getattr(self, "_is_param", False) \
            else "a view of parameter"
        return f"{what} {name!r} stored by dlo:\n{values}"

    def __reduce_ex__(self, protocol: int) -> Any:
        value = _copy(self)
        if self._dlo_origin is None and getattr(self, "_is_param", False):
            return torch.nn.Parameter(value, self.requires_grad).__reduce_ex__(protocol)
        return value.__reduce_ex__(protocol)

    def __deepcopy__(self, memo: Any) -> Any:
        raise ValueError(
            f"dlo: cannot deepcopy parameter {stored_name(self.origin)!r}: its weights are in "
            "a dlo host store, which the copy would not own. " + release_advice(
                then="to put them back", after="copy the weights alone with model.state_dict()"))

    def as_tensor(self) -> torch.Tensor:
        """A view of the weight, for code written for diffusers' ``GGUFParameter`` (whose
        ``quant_type`` a stored parameter keeps): its dequantisation calls ``as_tensor()``
        and reads the bytes through views, which read the stored weight here, or the
        slot inside a graph."""
        return self.view(self.shape)

    # -- ways out of the tensor: copies, or refused (see [Note: no pointer to a stored
    # weight]) --------------------------------------------------------------------------------
    def numpy(self, *, force: bool = False) -> Any:  # a copy: the fetched bytes are cached
        if not force:  # torch's own refusals (a device not the CPU, requires_grad, a
            # conjugate or negative bit), raised by torch on no elements of this metadata
            probe = torch.empty(0, dtype=self.dtype, device=self.device,
                                requires_grad=self.requires_grad)
            for bit, view in zip(self._dlo_bits, (aten._conj, aten._neg_view)):
                probe = view(probe) if bit else probe
            torch.Tensor.numpy(probe)
        return _copy(self).numpy(force=force)

    def tolist(self) -> Any:
        return _read(self).tolist()

    def item(self) -> Any:
        return _read(self).item()

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:
        if self.requires_grad:  # as torch refuses any tensor that requires grad
            raise BufferError("Can't export tensors that require gradient, use tensor.detach()")
        return _read(self).detach().clone().__dlpack__(*args, **kwargs)  # on its device

    def data_ptr(self) -> int:
        raise _no_pointer(self, "data_ptr()")

    def const_data_ptr(self) -> int:
        raise _no_pointer(self, "const_data_ptr()")

    def untyped_storage(self) -> torch.UntypedStorage:
        if _compiler_asks():
            return super().untyped_storage()
        raise _no_pointer(self, "untyped_storage()")

    def _typed_storage(self) -> Any:  # storage(), share_memory_(), is_shared() read it
        if _compiler_asks():
            return super()._typed_storage()
        raise _no_pointer(self, "storage()")

    @property
    def __cuda_array_interface__(self) -> Any:
        if self.device.type != "cuda":  # torch's AttributeError: hasattr() stays False
            return super().__cuda_array_interface__
        raise _no_pointer(self, "__cuda_array_interface__")

    @property
    def data(self) -> "StoredWeight":
        return _alias(self, ())

    @data.setter
    def data(self, value: Any) -> None:
        if isinstance(value, StoredWeight) and value.origin is self.origin \
                and value._dlo_steps == self._dlo_steps:
            return  # module._apply hands a no-op conversion back (.to() its own device)
        raise _refusal(self, "param.data = ... would replace")

    # Dynamo never traces it: an op run eagerly inside a compiled frame (after a graph
    # break) calls it under Dynamo's frame hook, which compiled every code path of the
    # reads and views, graph break after graph break
    @classmethod
    @torch.compiler.disable
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        stored = [x for x in flat if isinstance(x, StoredWeight)]
        _check_writes(func, args, kwargs)
        fake = torch_private.fake_mode_of(stored[0]._dlo_token)
        if fake is not None:  # Dynamo traces: fake outputs, nothing read
            with fake:
                return func(*tree_map(_fake_like, args), **tree_map(_fake_like, kwargs))
        if func in (aten.detach.default, aten.alias.default):
            # torch's distribute_tensor detaches first, on every rank, before it scatters
            check_not_distributing(stored_name(args[0].origin))
            return _alias(args[0], ())
        composite = torch_private.composite_kernel(func)
        if composite is not None:  # see [Note: a composite op reaches the dispatch]
            return _composite(func, composite, args, kwargs)
        aliased = _aliased_input(func, args)
        if aliased is not None:
            return _view(func, args, kwargs, aliased)
        return _read_op(func, args, kwargs, stored)


# [Note: a composite op reaches the dispatch]
# An op torch defines as other ops (``CompositeImplicitAutograd``: ``to``, ``contiguous``,
# ``reshape``, ``flatten``, ``linear``, ``matmul``, ``chunk``) runs as those ops above the
# dispatch, where autograd dispatches it, so a tensor subclass never sees it; under
# ``torch.inference_mode()`` autograd is skipped and the op itself reaches
# ``__torch_dispatch__``. Its schema says its output may alias its input (``to`` returns
# ``self`` when nothing changes), which is not what it does when it copies: taken for a
# view, ``p.half()`` was refused. It runs here as torch runs it for a resident parameter
# in that mode, as its own composite kernel, whose ops come back one by one (each a
# read, a view or a write), and so it is exact wherever it is exact outside
# inference_mode. Writes are checked first, on the op as called: nothing it is made of
# runs before a write into a stored weight is refused.
def _composite(func: Any, kernel: Any, args: Any, kwargs: Any) -> Any:
    """Composite op ``func`` run as its ``kernel``. A view it returns of a stored weight
    that requires grad requires grad too, as torch's view tracking gives a resident
    parameter's view under inference_mode (a leaf with no ``grad_fn``), where that
    tracking does not follow the dispatch (it runs above it, skipping the ops the kernel
    calls inside it)."""
    out = kernel(*args, **kwargs)
    if torch_private.view_tracked(func):
        return out
    grads = {id(x.origin) for x in tree_flatten((args, kwargs))[0]
             if isinstance(x, StoredWeight) and x.requires_grad}
    for o in tree_flatten(out)[0]:
        if isinstance(o, StoredWeight) and id(o.origin) in grads and o.is_leaf \
                and not o.requires_grad:
            o.requires_grad_(True)
    return out


def _fake_like(x: Any) -> Any:
    """What a fake op reads in place of a fake `StoredWeight`: one fake tensor of its layout
    per fake parameter (`FAKE_STAND_IN`), so that every view made while Dynamo traces
    shares one storage, as views of a plain parameter do (the planning stages follow
    aliases by storage: a slot refilled while a view of its weight is still read would be
    a wrong result)."""
    if isinstance(x, StoredWeight):
        stand_in = x.__dict__.get(FAKE_STAND_IN)
        if stand_in is None:
            stand_in = x.__dict__[FAKE_STAND_IN] = _empty_like_layout(x, x.device)
        return stand_in
    return x


def _empty_like_layout(x: torch.Tensor, device: Any) -> torch.Tensor:
    """An uninitialised tensor with ``x``'s shape, strides, storage offset and dtype."""
    size = x.storage_offset() + storage_span(x)
    return torch.empty((size,), dtype=x.dtype, device=device).as_strided(
        x.shape, x.stride(), x.storage_offset())


def _alias(t: StoredWeight, steps: tuple, meta: Optional[torch.Tensor] = None) -> StoredWeight:
    """Another `StoredWeight` reading ``t``'s origin through ``t``'s steps and ``steps``,
    with the metadata of ``meta`` (the view computed on a meta tensor) or of ``t``."""
    m = meta if meta is not None else t
    # A view of a parameter (a normal tensor) taken under inference_mode is a normal tensor
    # too: torch gives it the parameter's version counter, which an inference tensor (what
    # the wrapper would be, made in that mode) cannot take ("Cannot set version_counter").
    # Where torch makes an inference tensor of it (``view(dtype)``), so does the same op on
    # the meta tensor of the parameter's metadata (`_meta_of`)
    with torch.inference_mode(m.is_inference()):
        out = StoredWeight(m.shape, m.stride(), m.dtype, t.device, requires_grad=False,
                           storage_offset=m.storage_offset(), token=t._dlo_token)
    out._dlo_origin = t.origin
    out._dlo_steps = t._dlo_steps + steps
    out._dlo_bits = (m.is_conj(), m.is_neg()) if meta is not None else t._dlo_bits
    return out


def _owner(param: torch.Tensor) -> Any:
    return owner_of((param,))


# -- reads --------------------------------------------------------------------------------
def stored_name(param: torch.Tensor) -> str:
    """The name ``param`` was stored under (its FQN), or its shape where none is known."""
    runtime = _owner(param)
    entry = runtime.store.entry(param) if runtime is not None else None
    return entry.fqn if entry is not None else f"<parameter of shape {tuple(param.shape)}>"


def _read_op(func: Any, args: Any, kwargs: Any, stored: list) -> Any:
    """``func`` run on the real values of its stored arguments. An output that shares
    the fetched bytes (an op that returns its input, ``_unsafe_view``) is copied: a
    tensor over the block would reach the other weights in it."""
    out, fetched = _on_values(func, args, kwargs, stored)
    return tree_map(lambda o: _unshared(o, fetched), out)


def _on_values(func: Any, args: Any, kwargs: Any, stored: list) -> tuple[Any, set]:
    """``func``'s outputs on the real values of its stored arguments, and the storage keys
    of the bytes fetched for them."""
    cache: dict = {}
    fetched: set = set()

    def real(x: Any) -> Any:
        value = _read(x, cache)
        if isinstance(x, StoredWeight):
            fetched.add(torch_private.storage_key(value))
        return value

    try:
        return func(*tree_map(real, args), **tree_map(real, kwargs)), fetched
    except NotImplementedError as exc:
        raise _unsupported_read(func, stored, exc) from exc


def _unshared(out: Any, fetched: set) -> Any:
    if isinstance(out, torch.Tensor) and not is_traceable_wrapper_subclass(out) \
            and torch_private.storage_key(out) in fetched:
        return out.clone()
    return out


def _copy(x: "StoredWeight") -> torch.Tensor:
    """A new host tensor holding ``x``'s values."""
    return _read(x).detach().cpu().clone()


def _read(x: Any, cache: Optional[dict] = None) -> Any:
    """``x`` with its real values (on its device) when it is a `StoredWeight`."""
    if not isinstance(x, StoredWeight):
        return x
    origin = x.origin
    if not isinstance(origin, StoredWeight) or getattr(origin, "_dlo_released", False):
        raise _released_view(origin)
    runtime = _owner(origin)
    entry = runtime.store.entry(origin) if runtime is not None and not runtime.closed else None
    if entry is None and runtime is None:
        raise ValueError(
            f"dlo: a stored weight of shape {tuple(origin.shape)} ({origin.dtype}) that no dlo "
            "runtime holds was read: a copy of a stored parameter made by other code (another "
            "torch.compile backend, such as 'inductor', rebuilds it). " + release_advice(
                instead="compile the model with backend='dlo' (options={'compiler': "
                        "'inductor'} for Inductor's kernels)", then="to run it without dlo"))
    if entry is None:
        raise ValueError(
            f"dlo: parameter of shape {tuple(origin.shape)} ({origin.dtype}) was stored by a "
            "dlo runtime that has been closed, so its weights are gone; load or build the "
            "model again")
    key = (id(runtime), entry.block)
    flat = cache.get(key) if cache is not None else None
    if flat is None:
        flat = runtime.reads.eager_block(entry.block, entry.fqn)
        if cache is not None:
            cache[key] = flat
        _warn_once(runtime, entry.fqn)
    if entry.parts:
        return _replayed(x, entry.value_of(flat), entry.fqn)
    return _rebased(x, origin, entry.span_of(flat), entry.fqn)


def _released_view(param: torch.Tensor) -> ValueError:
    return ValueError(
        f"dlo: a parameter of shape {tuple(param.shape)} ({param.dtype}), or a view of it, "
        "was read after dlo_fx.release put the weights back into the model's parameters: it "
        "was taken while they were in a dlo host store, and reads nothing now. Take it again "
        "from the model (released, its parameters are ordinary tensors)")


def _unsupported_read(func: Any, stored: list, exc: BaseException) -> BaseException:
    """A read outside the graph that a stored weight's own tensor subclass (a torchao
    quantized weight) does not implement at the level dlo reads it: say so, naming it."""
    for t in stored:
        runtime = _owner(t.origin)
        entry = runtime.store.entry(t.origin) if runtime is not None else None
        if entry is not None and entry.parts:
            break
    else:
        return exc
    kind = entry.wrapper[0].__qualname__
    return NotImplementedError(
        f"dlo: parameter {entry.fqn!r} (a {kind}) was read outside a compiled graph by "
        f"{func}, which {kind} does not implement below torch functions (it implements "
        "linear as a whole); outside a graph dlo reads a stored weight op by op. " +
        release_advice(instead="run the layers that use it inside the graph compiled with "
                               "backend='dlo' (no graph break around them)",
                       then="to run it without dlo") +
        f". ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")


def _warn_once(runtime: Any, fqn: str) -> None:
    """Warn once per runtime, naming the first module whose weights were read eagerly."""
    module = fqn.rsplit(".", 1)[0] if "." in fqn else "<root>"
    keep = fqn if module == "<root>" else module  # what offload's resident= takes
    with _WARN_LOCK:
        if runtime in _WARNED:
            return
        _WARNED.add(runtime)
    warnings.warn(
        f"dlo: the weights of module {module!r} are read outside a scheduled graph (eager "
        "code: a module Dynamo runs eagerly, print(p), p.sum(), ...), so their block is copied "
        "from the host store for each such read: correct, but slow. A graph break inside or "
        "around this module is the usual cause (a break inside a loop over the blocks leaves "
        "the whole forward around them eager). Where such modules run every call, keep them "
        f"on the device: dlo_fx.offload(model, options, resident=[{keep!r}, ...]) "
        "(dlo_fx.load takes resident= too); this warning is given once per model",
        RuntimeWarning, stacklevel=caller_level())


def caller_level() -> int:
    """The stack level of the first frame outside torch and dlo_fx (for warnings)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith(("torch", "dlo_fx")):
        frame, level = frame.f_back, level + 1
    return level


# -- views ----------------------------------------------------------------------------------
# [Note: a view of a stored weight]
# A view of a stored parameter reads exactly the bytes the same view of the resident
# parameter would, or raises when it is made. It is a `StoredWeight` whose metadata (shape,
# strides, storage offset, dtype, conjugate and negative bits) is what the op computes on a
# meta tensor of the parameter's own metadata: for any view op, the one torch defines,
# since a view is metadata over the same storage. Its bytes are then found by construction:
# the storage offset is rebased on the parameter's own place (`_rebased`: byte ``k`` of the
# parameter's storage, counted from its storage offset, is byte ``k`` of its span in the
# fetched block). Replaying the view against the block's buffer instead would let
# ``as_strided`` with an explicit offset read another parameter's bytes. A view that
# reaches bytes outside the parameter's own storage span (the resident parameter's storage
# may hold other tensors there, or end) raises ValueError naming it, when it is made. A
# quantized weight (a tensor subclass stored as its inner tensors) has no one span: its
# views are replayed through the subclass's own ops, and a view op that takes an explicit
# layout (``as_strided``, ``_reshape_alias``) or another tensor is refused for it by name.
class StoredViewError(ValueError, RuntimeError):
    """A view op of a stored parameter that torch refuses, raised naming it: one that
    fails on the parameter's metadata and on its values too, as for the resident
    parameter (a ``view`` of an incompatible shape). A ``ValueError``, and a
    ``RuntimeError`` as torch's own refusal is, for code that catches that."""


class _Marker:
    """Where a view step's input goes in its recorded arguments."""


_SELF = _Marker()


def _put(tree: Any, value: torch.Tensor) -> Any:
    return tree_map(lambda a: value if a is _SELF else a, tree)


def _aliased_input(func: Any, args: Any) -> Optional[StoredWeight]:
    """The `StoredWeight` argument the op's first output aliases (a view), or None."""
    schema = func._schema
    if not schema.returns or schema.returns[0].alias_info is None:
        return None
    if schema.returns[0].alias_info.is_write:
        return None
    for arg, value in zip(schema.arguments, args):
        if arg.alias_info is not None and isinstance(value, StoredWeight):
            return value
    return None


def _view(func: Any, args: Any, kwargs: Any, base: StoredWeight) -> Any:
    """A view op on ``base``: its outputs computed on meta tensors, each a `StoredWeight`
    (see [Note: a view of a stored weight])."""
    meta_base = _meta_of(base)
    metas = {id(base): meta_base}
    to_meta = (lambda a: metas.setdefault(id(a), _meta_of(a))
               if isinstance(a, torch.Tensor) else a)
    try:
        out = func(*tree_map(to_meta, args), **tree_map(to_meta, kwargs))
    except Exception as exc:  # noqa: BLE001 - the values decide (see _not_a_view)
        return _not_a_view(func, args, kwargs, base, f"it fails there: {exc}")
    if any(isinstance(o, torch.Tensor) and
           torch_private.storage_key(o) != torch_private.storage_key(meta_base)
           for o in tree_flatten(out)[0]):
        return _not_a_view(func, args, kwargs, base, "it returns a new tensor there")
    recorded = tree_map(lambda a: _SELF if a is base else a, args)
    step = (func, recorded, kwargs)
    if isinstance(out, torch.Tensor):
        return _view_output(base, out, step, None)
    return type(out)(_view_output(base, o, step, i) for i, o in enumerate(out))


def _view_output(base: StoredWeight, out: Any, step: tuple, index: Optional[int]) -> Any:
    if not isinstance(out, torch.Tensor):
        return out
    _check_reach(out, base.origin)
    return _alias(base, (step + (index,),), out)


def _not_a_view(func: Any, args: Any, kwargs: Any, base: StoredWeight, why: str) -> Any:
    """An op whose schema says it may return a view of ``base``, but which gives none on
    ``base``'s metadata (``why``): run on the values, where torch's own refusal is raised
    as a `StoredViewError`, a new tensor returned, and a view of the fetched bytes refused
    (it would not be the parameter: a write through it would be lost)."""
    name = stored_name(base.origin)
    stored = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, StoredWeight)]
    try:
        out, fetched = _on_values(func, args, kwargs, stored)
    except Exception as exc:
        raise StoredViewError(
            f"dlo: {func} of parameter {name!r} (stored by dlo) is refused by torch on the "
            f"parameter's own values and layout, as for the resident parameter: {exc}") from exc
    if any(isinstance(o, torch.Tensor) and torch_private.storage_key(o) in fetched
           for o in tree_flatten(out)[0]):
        raise ValueError(
            f"dlo: {func} of parameter {name!r} returns a view of it, which dlo computes on "
            f"the parameter's shape, strides and dtype on the meta device, and {why}; a view "
            "of the bytes dlo fetched for this read would not be the parameter. " +
            release_advice(instead="read a copy first (p.detach().clone())"))
    return out


def _meta_of(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor with ``t``'s metadata, over a meta storage that holds at least the
    stored parameter's whole span and ``t`` (``set_`` checks ``t`` against it)."""
    end = (t.storage_offset() + storage_span(t)) * t.element_size()
    if isinstance(t, StoredWeight):
        o = t.origin
        end = max(end, (o.storage_offset() + storage_span(o)) * o.element_size())
    storage = torch.UntypedStorage(end, device="meta")
    with torch.inference_mode(t.is_inference()):  # an op on it makes views as on ``t``
        meta = torch.empty(0, dtype=t.dtype, device="meta").set_(
            storage, t.storage_offset(), t.shape, t.stride())
    conj, neg = t._dlo_bits if isinstance(t, StoredWeight) else (t.is_conj(), t.is_neg())
    if conj:
        meta = aten._conj(meta)
    if neg:
        meta = aten._neg_view(meta)
    return meta


def _check_reach(view: torch.Tensor, origin: StoredWeight) -> None:
    """ValueError when ``view`` reaches bytes outside ``origin``'s own storage span."""
    start, end = _byte_range(view, origin)
    span = storage_span(origin) * origin.element_size()
    if view.numel() and (start < 0 or end > span or start % view.element_size()):
        raise ValueError(
            f"dlo: a view of parameter {stored_name(origin)!r} (shape "
            f"{tuple(view.shape)}, strides {tuple(view.stride())}, storage offset "
            f"{view.storage_offset()}, {view.dtype}) reaches bytes {start} to {end} of the "
            f"parameter's storage, counted from its first element, outside its {span} bytes: "
            "the resident parameter's storage holds other tensors there, or ends, and dlo "
            "holds the parameter's own bytes only; nothing was read. " +
            release_advice(instead="take views within the parameter"))


def _byte_range(view: torch.Tensor, origin: torch.Tensor) -> tuple[int, int]:
    """The bytes ``view`` spans, counted from ``origin``'s first storage element."""
    start = view.storage_offset() * view.element_size() - \
        origin.storage_offset() * origin.element_size()
    return start, start + storage_span(view) * view.element_size()


def _rebased(x: StoredWeight, origin: StoredWeight, span: torch.Tensor,
             name: str) -> torch.Tensor:
    """``x``'s values: a tensor of ``x``'s metadata over ``span``, the fetched bytes of
    ``origin``'s storage span, its storage offset rebased there."""
    if x.numel() == 0:
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=span.device)
    _check_reach(x, origin)
    start, _ = _byte_range(x, origin)
    at = span.storage_offset() * span.element_size() + start
    if at % x.element_size():  # pragma: no cover - block entries are aligned
        raise ValueError(f"dlo: internal error: a view of {name!r} is not aligned in its block")
    value = torch.empty(0, dtype=x.dtype, device=span.device).set_(
        span.untyped_storage(), at // x.element_size(), x.shape, x.stride())
    conj, neg = x._dlo_bits
    if conj:
        value = aten._conj(value)
    if neg:
        value = aten._neg_view(value)
    return value


def _replayed(x: StoredWeight, value: torch.Tensor, name: str) -> torch.Tensor:
    """``x``'s values for a tensor subclass's stored weight: its view steps replayed on
    the subclass's value (see [Note: a view of a stored weight])."""
    for func, args, kwargs, index in x._dlo_steps:
        if _takes_layout(func):
            raise ValueError(
                f"dlo: {func} of parameter {name!r}, a tensor subclass stored as its inner "
                "tensors, cannot be read: its inner tensors have no storage in common with "
                "the layout the op names. " +
                release_advice(instead="read a copy first (p.detach().clone())"))
        value = func(*_put(args, value), **_put(kwargs, value))
        if index is not None:
            value = value[index]
    return value


def _takes_layout(func: Any) -> bool:
    """A view op that names a layout itself (strides, a storage offset, another tensor)."""
    for arg in func._schema.arguments[1:]:
        if arg.name in ("stride", "storage_offset") or "Tensor" in str(arg.type):
            return True
    return False


# -- no pointer to a stored weight --------------------------------------------------------
# [Note: no pointer to a stored weight]
# Nothing hands out an address for a `StoredWeight`'s bytes: it has no bytes in this
# process that are its weights (its storage is the wrapper's, with no data; the bytes it
# reads are a block fetched for each read), and a pointer would read memory that is not the
# weight (address 0 or a freed block: a crash, or another tensor's bytes). So every
# zero-copy way out either hands out a copy of the real values (``numpy()``, ``__array__``,
# ``__dlpack__`` and so ``torch.from_dlpack``, pickling) or raises ValueError naming the
# parameter (``data_ptr()``, ``const_data_ptr()``, ``untyped_storage()``, ``storage()`` and
# what is built on it: ``share_memory_()``, ``is_shared()``, a tensor ``set_`` over it;
# ``__cuda_array_interface__``, whose consumer keeps only the address; a ``set_`` with a
# stored source). Below Python, the wrapper's storage refuses its mutable data pointer
# (`torch_private.refuse_data_pointer`), so ``torch.utils.dlpack.to_dlpack`` raises
# torch's RuntimeError instead of exporting address 0; and it has no bytes and cannot be
# resized (`torch_private.refuse_storage_resize`), so every ``set_`` that would put a
# tensor with elements over it raises torch's RuntimeError ("Trying to resize storage that
# is not resizable") where torch would grow it to address 0: ``t.set_(p, offset, size,
# stride)``, which torch decomposes into a ``set_`` over ``p``'s storage below any
# dispatch (in inference mode it reaches the dispatch and is refused by name), and a
# ``set_`` or ``resize_`` of the storage torch's own ``untyped_storage`` hands out. As for
# any storage that cannot grow, torch has given ``t`` its new layout when it raises: a
# tensor whose ``set_`` failed must not be read. Torch's compiler stack reads the storage
# object for identity and size only (fake tensors are made from it), and gets it; the fake
# copies it makes (their inner tensor is not a plain one) keep a resizable storage of no
# bytes, which it resizes to none.
_COMPILER_MODULES = ("torch._subclasses.", "torch._dynamo.", "torch._functorch.",
                     "torch._inductor.", "torch.fx.", "torch._guards", "torch._export.",
                     "torch.export.", "dlo_fx.")


def _compiler_asks() -> bool:
    """Whether the caller of the method calling this is torch's compiler stack or dlo."""
    caller = sys._getframe(2).f_globals.get("__name__", "")
    return caller.startswith(_COMPILER_MODULES)


def _no_pointer(t: StoredWeight, what: str) -> ValueError:
    return ValueError(
        f"dlo: {what} of parameter {stored_name(t.origin)!r} is refused: its weights are in "
        "a dlo host store and no memory of this process holds them as this tensor, so an "
        "address would read memory that is not the weight. " + release_advice(
            instead="read a copy (p.detach().clone(), p.numpy() and torch.from_dlpack(p) give "
                    "copies)", then="to put the weights back into the parameters"))


# -- writes and conversions -------------------------------------------------------------------
def _refusal(t: StoredWeight, action: str) -> ValueError:
    return ValueError(
        f"dlo: {action} parameter {stored_name(t.origin)!r}, whose weights are in a dlo host "
        "store where the compiled model reads them; nothing was written to it. " +
        release_advice(then="to put the weights back into the parameters (then change, move "
                            "or cast the module and compile it again)", load=True))


def _check_writes(func: Any, args: Any, kwargs: Any) -> None:
    """Refuse ``func`` where it would write into a stored weight, before it writes
    anything: every argument its schema marks written (``Tensor(a!)``, an ``out=``, and
    each tensor of a ``Tensor(a!)[]`` list, which foreach and fused optimizer ops write
    whole), and the source of a ``set_``."""
    schema = func._schema
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        for t in tree_flatten(value)[0]:
            if isinstance(t, StoredWeight):
                raise _refusal(t, f"{func.__name__} would write into")
    if func.overloadpacket in _SETS:  # the tensor set would share the parameter's storage
        for value in tree_flatten((args, kwargs))[0][1:]:
            if isinstance(value, StoredWeight):
                raise _refusal(value, f"{func.__name__} would make a tensor share the storage of")


_SETS = (aten.set_, aten.set)


# -- becoming stored and back -------------------------------------------------------------------
def is_stored(t: Any) -> bool:
    """Whether ``t`` is a parameter whose weights a dlo host store holds (a `StoredWeight`)."""
    return isinstance(t, StoredWeight)


def stored_parameter(shape: Any, stride: Any, dtype: torch.dtype, device: torch.device,
                     requires_grad: bool = False, cls: type = torch.nn.Parameter
                     ) -> StoredWeight:
    """A new parameter of this metadata whose weights will be in a host store (the loader),
    given back as a ``cls`` (the model's parameter class: a ``GGUFParameter``) by `release`."""
    p = StoredWeight(shape, stride, dtype, device, requires_grad=requires_grad)
    p._is_param = True
    p._dlo_class = cls
    return p


def become_stored(p: torch.Tensor, device: Optional[torch.device] = None) -> None:
    """Turn parameter ``p`` into a `StoredWeight` in place (same object, same metadata,
    on ``device``, the compute device, when given); its old tensor (and its memory,
    unless held elsewhere) is let go."""
    if isinstance(p, StoredWeight):
        return
    with torch.inference_mode(p.is_inference()):  # an inference tensor stays one
        new = StoredWeight(p.shape, p.stride(), p.dtype, device if device is not None else p.device,
                           requires_grad=p.requires_grad)
    vars(new).update(carried_attributes(p))
    vars(new)["_is_param"] = True
    vars(new)["_dlo_class"] = type(p)
    torch_private.swap_in_place(p, new)


def carried_attributes(p: torch.Tensor) -> dict[str, Any]:
    """The instance attributes of parameter ``p`` that a stored parameter in its place
    keeps (a ``GGUFParameter``'s ``quant_type``). A tensor subclass's
    own fields (torchao's qdata, scale, block_size) are its data, kept in the store: only
    the attributes others set on the parameter stay."""
    own = set(p.__tensor_flatten__()[0]) if is_traceable_wrapper_subclass(p) else set()
    return {k: v for k, v in vars(p).items() if k not in _OURS and k not in own
            and not isinstance(v, torch.Tensor)}


def mark_released(p: StoredWeight) -> None:
    """Stored parameter ``p`` stays a `StoredWeight` after `dlo_fx.release` (something
    held its tensor, and the model got a new parameter): a later read of it or of a view
    of it says so."""
    vars(p)["_dlo_released"] = True


def real_parameter(p: StoredWeight, value: torch.Tensor) -> torch.nn.Parameter:
    """A parameter holding ``value`` of the class stored parameter ``p`` had, with its
    attributes (those others set on it: a ``GGUFParameter``'s ``quant_type``, a
    storage-dtype mark): see [Note: a parameter's class comes back]."""
    with torch.inference_mode(p.is_inference()):
        return parameter_of(vars(p).get("_dlo_class", torch.nn.Parameter), value,
                            p.requires_grad, {k: v for k, v in vars(p).items()
                                              if k not in _OURS and k != "_is_param"})


# [Note: a parameter's class comes back]
# A parameter stored by dlo comes back from `dlo_fx.release` as the class it had, with the
# instance attributes it carried (a loaded one: as the class the model built), by one rule
# for every class: a subclass of ``nn.Parameter`` (diffusers' ``GGUFParameter``, whose
# ``quant_type`` and ``quant_shape`` its layer reads and whose ``as_tensor`` it calls) is
# made as such subclasses make themselves, ``Tensor._make_subclass`` over the plain value,
# then its ``__dict__`` set; any other value is ``nn.Parameter``'s (a tensor subclass, such
# as torchao's, rebuilt from its inner tensors, keeps its own class). So a class whose
# instances keep state anywhere but ``__dict__`` (``__slots__``) could not be given back,
# and is refused by name before it is stored (`check_restorable`). The loader makes its
# resident parameters by the same rule.
def parameter_of(cls: type, value: torch.Tensor, requires_grad: bool,
                 attributes: dict[str, Any]) -> torch.nn.Parameter:
    """A parameter of class ``cls`` holding ``value``, with ``attributes``: see [Note: a
    parameter's class comes back]."""
    value = value.detach()
    if issubclass(cls, torch.nn.Parameter) and cls is not torch.nn.Parameter \
            and type(value) is torch.Tensor:
        real = torch.Tensor._make_subclass(cls, value, requires_grad)
    else:
        real = torch.nn.Parameter(value, requires_grad=requires_grad)
    vars(real).update(attributes)
    return real


def check_restorable(p: torch.Tensor, fqn: str) -> None:
    """ValueError naming parameter ``fqn`` when its class could not be given back by
    `release` (see [Note: a parameter's class comes back])."""
    cls = vars(p).get("_dlo_class", type(p)) if is_stored(p) else type(p)
    slotted = [k.__qualname__ for k in cls.__mro__
               if "__slots__" in vars(k) and issubclass(k, torch.nn.Parameter)
               and k is not torch.nn.Parameter]
    if slotted:
        raise ValueError(
            f"dlo: parameter {fqn!r} is a {cls.__qualname__}, whose instances keep state "
            f"outside their __dict__ (__slots__ of {', '.join(slotted)}), which dlo could not "
            "give back to it when the model is released; nothing was stored. Make it an "
            "nn.Parameter (or a subclass keeping its state in its __dict__) before it is "
            "offloaded or compiled with backend='dlo'")


def become_real(p: StoredWeight, value: torch.Tensor) -> None:
    """Give stored parameter ``p`` the real tensor ``value`` in place (`dlo_fx.release`)."""
    if not isinstance(p, StoredWeight):
        raise TypeError("dlo: internal error: become_real of a parameter that is not stored")
    torch_private.swap_in_place(p, real_parameter(p, value))
