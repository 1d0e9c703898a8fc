"""`StoredWeight`: a parameter whose weights are in a dlo host store.

[Note: a stored weight is a tensor]
A parameter whose bytes dlo moved into the host store becomes a `StoredWeight` in place:
a wrapper tensor subclass (``torch.Tensor._make_wrapper_subclass``, as FSDP2's DTensor
parameters and torchao's quantized weights are) with the parameter's shape, strides,
dtype, device and ``requires_grad``, and no storage of its own. The Python object stays
the same one (`become_stored` swaps its contents, as ``torch.utils.swap_tensors`` does),
so the model, the host store (keyed by ``id``) and every reference the user holds keep
pointing at it.

Inside a compiled graph nothing ever computes on it: Dynamo traces the subclass (it is
traceable: `__tensor_flatten__` names one empty device tensor, which Dynamo fakes), the
backend receives the parameters themselves as example inputs, and the passes replace every
use by a view of a device slot. Outside a graph every operation goes through
`__torch_dispatch__`, one place for every library method that reads or writes weights:

- a read (``p.sum()``, ``print(p)``, an eager module call, ``torch.func.functional_call``,
  ``model.apply(fn)``) fetches the block from the host store onto the device (gathered in
  allgather mode, behind a collective clock word, as a graph's gathers are) and runs the op
  on the real bytes: exact. The first such read of a module's weights warns once, naming
  the module (every eager read copies the block again: correct, but slow);
- a view (``p.t()``, ``p[0]``, ``p.view(...)``) is another `StoredWeight` that replays the
  view on the fetched bytes, so a write through it is refused too;
- a write (an in-place op or an ``out=`` into it, ``p.data = ...``, ``copy_`` from
  ``load_state_dict``, a LoRA merge through ``param.data``) and ``copy.deepcopy`` raise
  ``ValueError`` naming the parameter and `dlo_fx.release`. A conversion (``p.float()``,
  ``p.to(device)``) is a read: it returns a new tensor, as for any parameter. Converting
  the module (``module.to(...)``, ``.half()``) would replace its parameters: it is refused
  for the whole module before anything changes (`dlo_fx.model.guard`), and the
  parameter's ``data`` setter refuses it where no guard is;
- ``torch.save`` and pickling store the real weights; ``.numpy()`` returns a copy.

While Dynamo traces (its fake mode is active on the inner tensor) an op computes fake
outputs of the right metadata, so tracing reads nothing.

The loader makes stored parameters `StoredWeight`s from the start; a compile turns the
parameters it stored into them at the graph's first call (see [Note: when a parameter
becomes a StoredWeight] in `runtime/host_store.py`).
"""

from __future__ import annotations

import sys
import threading
import warnings
import weakref
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten, tree_map

from .. import torch_private
from .owners import owner_of

aten = torch.ops.aten

# Attribute names a `StoredWeight` carries in its __dict__ (beside the parameter's own).
_OURS = ("_dlo_token", "_dlo_origin", "_dlo_steps")

_WARNED: "weakref.WeakSet[Any]" = weakref.WeakSet()  # runtimes warned about once
_WARN_LOCK = threading.Lock()


class StoredWeight(torch.Tensor):
    """A parameter (or a view of one) whose weights are in a dlo host store: see
    [Note: a stored weight is a tensor]. ``_dlo_origin`` is the stored parameter it reads
    (None: itself), ``_dlo_steps`` the views applied to it, ``_dlo_token`` the empty
    device tensor Dynamo fakes."""

    __torch_function__ = torch_private.DISABLED_TORCH_FUNCTION

    @staticmethod
    def __new__(cls, shape: Any, stride: Any, dtype: torch.dtype, device: torch.device,
                requires_grad: bool = False, storage_offset: int = 0,
                token: Optional[torch.Tensor] = None) -> "StoredWeight":
        t = torch.Tensor._make_wrapper_subclass(
            cls, tuple(shape), strides=tuple(stride), storage_offset=storage_offset,
            dtype=dtype, device=device, requires_grad=requires_grad)
        t._dlo_token = token if token is not None else torch.empty(0, dtype=torch.uint8,
                                                                   device=device)
        t._dlo_origin = None
        t._dlo_steps = ()
        return t

    # -- Dynamo: a traceable subclass with one (empty) inner tensor ----------------------
    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        # No per-parameter context: Dynamo guards on it, and a graph reused for every
        # layer of a model must not recompile per layer.
        # The dtype alone, which Dynamo guards on anyway.
        return ["_dlo_token"], self.dtype

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
        value = _read(self).detach().cpu().clone()
        if self._dlo_origin is None and getattr(self, "_is_param", False):
            return torch.nn.Parameter(value, self.requires_grad).__reduce_ex__(protocol)
        return value.__reduce_ex__(protocol)

    def __deepcopy__(self, memo: Any) -> Any:
        raise ValueError(
            f"dlo: cannot deepcopy parameter {stored_name(self.origin)!r}: its weights are in "
            "a dlo host store, which the copy would not own. Call dlo_fx.release(model) first "
            "to put them back, or copy the weights alone with model.state_dict()")

    def as_tensor(self) -> torch.Tensor:
        """A view of the weight, for code written for diffusers' ``GGUFParameter`` (whose
        ``quant_type`` a stored parameter keeps): its dequantisation calls ``as_tensor()``
        and reads the bytes through views, which read the stored weight here, or the
        slot inside a graph."""
        return self.view(self.shape)

    def numpy(self, *, force: bool = False) -> Any:  # a copy: the fetched bytes are cached
        return _read(self).detach().cpu().clone().numpy()

    def tolist(self) -> Any:
        return _read(self).tolist()

    def item(self) -> Any:
        return _read(self).item()

    @property
    def data(self) -> "StoredWeight":
        return _alias(self, ())

    @data.setter
    def data(self, value: Any) -> None:
        if isinstance(value, StoredWeight) and value.origin is self.origin \
                and value._dlo_steps == self._dlo_steps:
            return  # module._apply hands a no-op conversion back (.to() its own device)
        raise _refusal(self, "param.data = ... would replace")

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        stored = [x for x in flat if isinstance(x, StoredWeight)]
        fake = torch_private.fake_mode_of(stored[0]._dlo_token)
        if fake is not None:  # Dynamo traces: fake outputs, nothing read
            with fake:
                return func(*tree_map(_fake_like, args), **tree_map(_fake_like, kwargs))
        if func in (aten.detach.default, aten.alias.default):
            return _alias(args[0], ())
        _check_writes(func, args, kwargs)
        aliased = _aliased_input(func, args)
        if aliased is not None:
            return _view(func, args, kwargs, aliased)
        cache: dict = {}
        try:
            return func(*tree_map(lambda x: _read(x, cache), args),
                        **tree_map(lambda x: _read(x, cache), kwargs))
        except NotImplementedError as exc:
            raise _unsupported_read(func, stored, exc) from exc


def _fake_like(x: Any) -> Any:
    if isinstance(x, StoredWeight):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
    return x


def _alias(t: StoredWeight, steps: tuple, meta: Optional[torch.Tensor] = None) -> StoredWeight:
    """Another `StoredWeight` reading ``t``'s origin through ``t``'s steps and ``steps``."""
    m = meta if meta is not None else t
    out = StoredWeight(m.shape, m.stride(), t.dtype, t.device, requires_grad=False,
                       storage_offset=m.storage_offset(), token=t._dlo_token)
    out._dlo_origin = t.origin
    out._dlo_steps = t._dlo_steps + steps
    return out


def _owner(param: torch.Tensor) -> Any:
    return owner_of((param,))


# -- reads --------------------------------------------------------------------------------
def stored_name(param: torch.Tensor) -> str:
    """The name ``param`` was stored under (its FQN), or its shape where none is known."""
    runtime = _owner(param)
    entry = runtime.store.entry(param) if runtime is not None else None
    return entry.fqn if entry is not None else f"<parameter of shape {tuple(param.shape)}>"


def _read(x: Any, cache: Optional[dict] = None) -> Any:
    """``x`` with its real values (on its device) when it is a `StoredWeight`."""
    if not isinstance(x, StoredWeight):
        return x
    origin = x.origin
    runtime = _owner(origin)
    entry = runtime.store.entry(origin) if runtime is not None and not runtime.closed else None
    if entry is None and runtime is None:
        raise ValueError(
            f"dlo: a stored weight of shape {tuple(origin.shape)} ({origin.dtype}) that no dlo "
            "runtime holds was read: a copy of a stored parameter made by other code (another "
            "torch.compile backend, such as 'inductor', rebuilds it). Compile the model with "
            "backend='dlo' (options={'compiler': 'inductor'} for Inductor's kernels), or call "
            "dlo_fx.release(model) first to run it without dlo")
    if entry is None:
        raise ValueError(
            f"dlo: parameter of shape {tuple(origin.shape)} ({origin.dtype}) was stored by a "
            "dlo runtime that has been closed, so its weights are gone; load or build the "
            "model again")
    key = (id(runtime), entry.block)
    flat = cache.get(key) if cache is not None else None
    if flat is None:
        flat = runtime.eager_block(entry.block, entry.fqn)
        if cache is not None:
            cache[key] = flat
        _warn_once(runtime, entry.fqn)
    value = entry.value_of(flat)
    for func, args, kwargs, index in x._dlo_steps:
        value = func(*_put(args, value), **_put(kwargs, value))
        if index is not None:
            value = value[index]
    return value


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
        "linear as a whole); outside a graph dlo reads a stored weight op by op. Run the "
        "layers that use it inside the graph compiled with backend='dlo' (no graph break "
        "around them), or call dlo_fx.release(model) to run it without dlo. "
        f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")


def _warn_once(runtime: Any, fqn: str) -> None:
    """Warn once per runtime, naming the first module whose weights were read eagerly."""
    module = fqn.rsplit(".", 1)[0] if "." in fqn else "<root>"
    with _WARN_LOCK:
        if runtime in _WARNED:
            return
        _WARNED.add(runtime)
    warnings.warn(
        f"dlo: the weights of module {module!r} are read outside a scheduled graph (eager "
        "code: a module Dynamo runs eagerly, print(p), p.sum(), ...), so their block is copied "
        "from the host store for each such read: correct, but slow. A graph break inside or "
        "around this module is the usual cause; this warning is given once per model",
        RuntimeWarning, stacklevel=_caller_level())


def _caller_level() -> int:
    """The stack level of the first frame outside torch and dlo_fx (for warnings)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith(("torch", "dlo_fx")):
        frame, level = frame.f_back, level + 1
    return level


class _Marker:
    """Where a view step's input goes in its recorded arguments."""


_SELF = _Marker()


def _put(tree: Any, value: torch.Tensor) -> Any:
    return tree_map(lambda a: value if a is _SELF else a, tree)


# -- views ----------------------------------------------------------------------------------
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
    recorded = tree_map(lambda a: _SELF if a is base else a, args)
    if any(isinstance(a, torch.Tensor) for a in tree_flatten((recorded, kwargs))[0]):
        # A view op that takes another tensor: read it now (no later write reaches it)
        return func(*tree_map(_read, args), **tree_map(_read, kwargs))
    out = func(*tree_map(lambda a: _meta_of(a) if a is base else a, args), **kwargs)
    if isinstance(out, torch.Tensor):
        return _alias(base, ((func, recorded, kwargs, None),), out)
    return type(out)(_alias(base, ((func, recorded, kwargs, i),), o) for i, o in enumerate(out))


def _meta_of(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta").as_strided(
        t.shape, t.stride(), t.storage_offset())


# -- writes and conversions -------------------------------------------------------------------
def _refusal(t: StoredWeight, action: str) -> ValueError:
    return ValueError(
        f"dlo: {action} parameter {stored_name(t.origin)!r}, whose weights are in a dlo host "
        "store where the compiled model reads them; nothing was written to it. Call "
        "dlo_fx.release(model) first to put the weights back into the parameters (then change, "
        "move or cast the module and compile it again), or load the model with "
        "dlo_fx.load(..., dtype=...) and options={'device': ...} for the dtype and device it "
        "should run in")


def _check_writes(func: Any, args: Any, kwargs: Any) -> None:
    schema = func._schema
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        if isinstance(value, StoredWeight):
            raise _refusal(value, f"{func.__name__} would write into")


# -- becoming stored and back -------------------------------------------------------------------
def is_stored(t: Any) -> bool:
    """Whether ``t`` is a parameter whose weights a dlo host store holds (a `StoredWeight`)."""
    return isinstance(t, StoredWeight)


def stored_parameter(shape: Any, stride: Any, dtype: torch.dtype, device: torch.device,
                     requires_grad: bool = False) -> StoredWeight:
    """A new parameter of this metadata whose weights will be in a host store (the loader)."""
    p = StoredWeight(shape, stride, dtype, device, requires_grad=requires_grad)
    p._is_param = True
    return p


def become_stored(p: torch.Tensor, device: Optional[torch.device] = None) -> None:
    """Turn parameter ``p`` into a `StoredWeight` in place (same object, same metadata,
    on ``device``, the compute device, when given); its old tensor (and its memory,
    unless held elsewhere) is let go."""
    if isinstance(p, StoredWeight):
        return
    with torch.inference_mode(p.is_inference()):  # an inference tensor stays one
        new = StoredWeight(p.shape, p.stride(), p.dtype, device if device is not None else p.device,
                           requires_grad=p.requires_grad,
                           storage_offset=p.storage_offset())
    vars(new).update(carried_attributes(p))
    vars(new)["_is_param"] = True
    torch_private.swap_in_place(p, new)


def carried_attributes(p: torch.Tensor) -> dict[str, Any]:
    """The instance attributes of parameter ``p`` that a stored parameter in its place
    keeps (a ``GGUFParameter``'s ``quant_type``, a storage-dtype mark). A tensor subclass's
    own fields (torchao's qdata, scale, block_size) are its data, kept in the store: only
    the attributes others set on the parameter stay."""
    own = set(p.__tensor_flatten__()[0]) if is_traceable_wrapper_subclass(p) else set()
    return {k: v for k, v in vars(p).items() if k not in _OURS and k not in own
            and not isinstance(v, torch.Tensor)}


def become_real(p: StoredWeight, value: torch.Tensor) -> None:
    """Give stored parameter ``p`` the real tensor ``value`` in place (`dlo_fx.release`)."""
    if not isinstance(p, StoredWeight):
        raise TypeError("dlo: internal error: become_real of a parameter that is not stored")
    with torch.inference_mode(p.is_inference()):
        real = torch.nn.Parameter(value.detach(), requires_grad=p.requires_grad)
    vars(real).update({k: v for k, v in vars(p).items() if k not in _OURS and k != "_is_param"})
    torch_private.swap_in_place(p, real)
