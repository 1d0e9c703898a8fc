"""Every view a stored weight can produce, and every zero-copy way out of one, against the
resident parameter (see [Note: a view of a stored weight] and [Note: no pointer to a
stored weight] in dlo_fx/runtime/weights/stored.py): exact, or refused with a ValueError naming
the parameter. Never another parameter's bytes, never an address that is not the weight.

The view ops are every overload in ``torch.ops.aten`` whose first output aliases a tensor
argument (its schema says ``Tensor(a)``), each with the arguments of `SAMPLES`; an op torch
adds shows up as missing from it. One stored model for the whole file, in process (the
``set_`` spellings of tests/stored_set_cases.py: each in a forked child)."""

from __future__ import annotations

import ctypes
import tempfile
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import dlo_fx
import stored_set_cases
from distributed import in_child, spawn
from dlo_fx.apps.models import ReferenceDiT
from dlo_fx.runtime.weights.owners import owner_of
from dlo_fx.runtime.weights.stored import StoredWeight, is_stored
from loader_cases import resident_dit, save_dit
from test_stored_weight import _stored_model

aten = torch.ops.aten
DEBUG = False


def _stored(folder, how: str = "loaded", device: str = "cpu"):
    """(model, stored params, resident params by name) of the tiny DiT: loaded with
    `dlo_fx.load` from a file in ``folder`` (no compile) onto ``device``, or compiled and
    called once."""
    if how == "compiled":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            ref, model, names = _stored_model()
    else:
        path, config = save_dit(str(folder))
        ref = resident_dit(path, config).to(device)
        model = dlo_fx.load(ReferenceDiT, path, config=config, options={"device": device})
        names = [n for n, p in model.named_parameters() if is_stored(p)]
    got, want = dict(model.named_parameters()), dict(ref.named_parameters())
    return model, {n: got[n] for n in names}, {n: want[n].detach() for n in names}


def _pick(stored, dim: int, dtype=torch.float32, contiguous: bool = True):
    """A stored parameter of ``dim`` dimensions and ``dtype``, its name and its resident
    twin: one past the start of its block (a view replayed against the block's buffer read
    another parameter's bytes), or a transposed one where ``contiguous`` is false."""
    _, got, want = stored
    for name, p in got.items():
        entry = owner_of((p,)).store.entry(p)
        if p.dim() == dim and p.dtype == dtype and p.is_contiguous() == contiguous and (
                entry.offset > 0 or not contiguous):
            return name, p, want[name]
    raise AssertionError(f"no such stored {dim}-D {dtype} parameter")


def _view_ops() -> list:
    """Every aten overload whose first output aliases a Tensor argument."""
    found = []
    for schema in torch._C._jit_get_all_schemas():
        if not schema.name.startswith("aten::") or not schema.returns:
            continue
        alias = schema.returns[0].alias_info
        if alias is None or alias.is_write:
            continue
        aliased = [a for a in schema.arguments if a.alias_info is not None]
        if not aliased or str(aliased[0].type) != "Tensor":
            continue  # lists, dicts, RRefs: not a tensor's view
        name = schema.name.split("::")[1]
        found.append(f"{name}.{schema.overload_name or 'default'}")
    return sorted(set(found))


def _other(t, shape=None):
    return torch.zeros(shape or t.shape, dtype=t.dtype)


# op -> samples; a sample is f(op, t) for a 2-D float32 parameter t of shape (R, C)
SAMPLES = {
    "_autocast_to_full_precision.default": [lambda op, t: op(t, True, True)],
    "_autocast_to_reduced_precision.default": [
        lambda op, t: op(t, True, True, torch.float16, torch.bfloat16)],
    "_conj.default": [lambda op, t: op(t)],
    "_fw_primal.default": [lambda op, t: op(t, 0)],
    "_grad_sum_to_size.default": [lambda op, t: op(t, None)],
    "_indices.default": [lambda op, t: op(t)],
    "_make_dual.default": [lambda op, t: op(t, _other(t), 0)],
    "_ncf_unsqueeze.default": [lambda op, t: op(t.view(-1), 2)],
    "_ncf_view.default": [lambda op, t: op(t.view(-1), [t.shape[1]], 1)],
    "_neg_view.default": [lambda op, t: op(t), lambda op, t: op(t).t()[1:]],
    "_nested_get_values.default": [lambda op, t: op(t)],
    "_nested_view_from_buffer.default": [
        lambda op, t: op(t.view(-1), torch.tensor([[2, 3]]), torch.tensor([[3, 1]]),
                         torch.tensor([5]))],
    "_nested_view_from_jagged.default": [
        lambda op, t: op(t, torch.tensor([0, 2, t.shape[0]]), torch.empty(0))],
    "_reshape_alias.default": [lambda op, t: op(t, [t.shape[1], t.shape[0]], [1, t.shape[1]]),
                               lambda op, t: op(t[2:], [4], [3])],
    "_sparse_broadcast_to.default": [lambda op, t: op(t, [2, *t.shape])],
    "_test_autograd_multiple_dispatch_view.default": [lambda op, t: op(t)],
    "_unpack_dual.default": [lambda op, t: op(t, 0)],
    "_values.default": [lambda op, t: op(t)],
    "adjoint.default": [lambda op, t: op(t)],
    "alias.default": [lambda op, t: op(t)],
    "as_strided.default": [
        lambda op, t: op(t, t.shape, t.stride(), t.storage_offset()),
        lambda op, t: op(t, t.shape, t.stride()),
        lambda op, t: op(t, (4,), (1,), 0),
        lambda op, t: op(t.view(-1)[4:], (3,), (1,), 1),
        lambda op, t: op(t.t()[3:], (5, 2), (1, 7), 9),
        lambda op, t: op(t, (2, 3), (0, 2), t.numel() - 5),          # the last bytes
        lambda op, t: op(t, (4,), (1,), t.numel() - 2),              # past its end
        lambda op, t: op(t.view(-1)[8:], (4,), (1,), 0).as_strided((2,), (1,), 1),
        lambda op, t: op(t.view(torch.uint8), (6,), (1,), 3),
        lambda op, t: op(t, (0,), (1,), 0),
    ],
    "as_tensor.default": [lambda op, t: op(t)],
    "broadcast_to.default": [lambda op, t: op(t, [2, *t.shape])],
    "ccol_indices.default": [lambda op, t: op(t)],
    "chunk.default": [lambda op, t: op(t, 3), lambda op, t: op(t, 2, 1)],
    "coalesce.default": [lambda op, t: op(t)],
    "col_indices.default": [lambda op, t: op(t)],
    "conj.default": [lambda op, t: op(t)],
    "contiguous.default": [lambda op, t: op(t), lambda op, t: op(t.t())],
    "cpu.default": [lambda op, t: op(t)],
    "crow_indices.default": [lambda op, t: op(t)],
    "cuda.default": [lambda op, t: op(t)],
    "detach.default": [lambda op, t: op(t)],
    "diagonal.default": [lambda op, t: op(t), lambda op, t: op(t, 3, 1, 0)],
    "dsplit.array": [lambda op, t: op(t.view(2, -1, 4), [1, 3])],
    "dsplit.int": [lambda op, t: op(t.view(2, -1, 4), 2)],
    "expand.default": [lambda op, t: op(t, [2, *t.shape]), lambda op, t: op(t[:1], [5, -1])],
    "expand_as.default": [lambda op, t: op(t, _other(t, (3, *t.shape)))],
    "flatten.using_ints": [lambda op, t: op(t), lambda op, t: op(t.t(), 0, 1)],
    "hsplit.array": [lambda op, t: op(t, [1, 5])],
    "hsplit.int": [lambda op, t: op(t, 4)],
    "imag.default": [lambda op, t: op(t), lambda op, t: op(torch.view_as_complex(t.view(
        t.shape[0], -1, 2)))],
    "indices.default": [lambda op, t: op(t)],
    "lift_fresh.default": [lambda op, t: op(t)],
    "linalg_diagonal.default": [lambda op, t: op(t, offset=2)],
    "mH.a": [lambda op, t: op(t)],
    "mH.default": [lambda op, t: op(t)],
    "mT.a": [lambda op, t: op(t)],
    "mT.default": [lambda op, t: op(t)],
    "matrix_H.a": [lambda op, t: op(t)],
    "matrix_H.default": [lambda op, t: op(t)],
    "moveaxis.int": [lambda op, t: op(t, 0, 1)],
    "moveaxis.intlist": [lambda op, t: op(t, [0, 1], [1, 0])],
    "movedim.int": [lambda op, t: op(t, 0, 1)],
    "movedim.intlist": [lambda op, t: op(t, [0, 1], [1, 0])],
    "narrow.default": [lambda op, t: op(t, 0, 2, 5), lambda op, t: op(t, 1, 3, 4)],
    "narrow.Tensor": [lambda op, t: op(t, 1, torch.tensor(3), 4)],
    "numpy_T.a": [lambda op, t: op(t)],
    "numpy_T.default": [lambda op, t: op(t)],
    "permute.default": [lambda op, t: op(t, [1, 0])],
    "pin_memory.default": [lambda op, t: op(t)],
    "positive.default": [lambda op, t: op(t)],
    "ravel.default": [lambda op, t: op(t), lambda op, t: op(t.t())],
    "real.default": [lambda op, t: op(t), lambda op, t: op(torch.view_as_complex(t.view(
        t.shape[0], -1, 2)))],
    "reshape.default": [lambda op, t: op(t, [-1]), lambda op, t: op(t.t(), [-1])],
    "reshape_as.default": [lambda op, t: op(t, _other(t, (t.numel(),)))],
    "resolve_conj.default": [lambda op, t: op(t)],
    "resolve_neg.default": [lambda op, t: op(t), lambda op, t: op(aten._neg_view(t))],
    "row_indices.default": [lambda op, t: op(t)],
    "select.int": [lambda op, t: op(t, 0, 3), lambda op, t: op(t, 1, -1)],
    "slice.Tensor": [lambda op, t: op(t, 0, 1, 10, 2), lambda op, t: op(t, 1, None, None, 3),
                     lambda op, t: op(t.view(-1), 0, 7)],
    "slice_inverse.default": [lambda op, t: op(t, t[1:10:2], 0, 1, 10, 2)],
    "split.Tensor": [lambda op, t: op(t, 5)],
    "split.default": [lambda op, t: op(t, [3, t.shape[0] - 3])],
    "split.sizes": [lambda op, t: op(t, [3, t.shape[0] - 3])],
    "split_with_sizes.default": [lambda op, t: op(t, [3, t.shape[1] - 3], 1)],
    "squeeze.default": [lambda op, t: op(t[None])],
    "squeeze.dim": [lambda op, t: op(t[None], 0)],
    "squeeze.dims": [lambda op, t: op(t[None, :, None], [0, 2])],
    "swapaxes.default": [lambda op, t: op(t, 0, 1)],
    "swapdims.default": [lambda op, t: op(t, 0, 1)],
    "t.default": [lambda op, t: op(t), lambda op, t: op(t[2:5])],
    "tensor_split.indices": [lambda op, t: op(t, [5, 20])],
    "tensor_split.sections": [lambda op, t: op(t, 3, 1)],
    "tensor_split.tensor_indices_or_sections": [lambda op, t: op(t, torch.tensor(3))],
    "to.device": [lambda op, t: op(t, t.device, t.dtype), lambda op, t: op(t, t.device,
                                                                            torch.float16)],
    "to.dtype": [lambda op, t: op(t, t.dtype), lambda op, t: op(t, torch.float64)],
    "to.dtype_layout": [lambda op, t: op(t, dtype=t.dtype)],
    "to.other": [lambda op, t: op(t, _other(t)), lambda op, t: op(t, _other(t).half())],
    "to.prim_Device": [lambda op, t: op(t, t.device)],
    "to.prim_dtype": [lambda op, t: op(t, None)],
    "to.prim_other": [lambda op, t: op(t)],
    "transpose.int": [lambda op, t: op(t, 0, 1)],
    "unbind.int": [lambda op, t: op(t[:4], 0), lambda op, t: op(t[:, :3], 1)],
    "unflatten.int": [lambda op, t: op(t, 1, [2, -1])],
    "unfold.default": [lambda op, t: op(t, 0, 4, 2), lambda op, t: op(t.view(-1), 0, 5, 3)],
    "unsqueeze.default": [lambda op, t: op(t, 0), lambda op, t: op(t, -1)],
    "values.default": [lambda op, t: op(t)],
    "view.default": [lambda op, t: op(t, [-1]), lambda op, t: op(t, [t.shape[1], -1]),
                     lambda op, t: op(t.t(), [-1])],
    "view.dtype": [lambda op, t: op(t, torch.uint8), lambda op, t: op(t, torch.int16),
                   lambda op, t: op(t, torch.float64),
                   lambda op, t: op(t.view(torch.uint8)[:, 4:], torch.float32)],
    "view_as.default": [lambda op, t: op(t, _other(t, (t.shape[1], t.shape[0])))],
    "view_as_complex.default": [lambda op, t: op(t.view(t.shape[0], -1, 2)),
                                lambda op, t: op(t.view(-1, 2)[3:7])],
    "view_as_real.default": [lambda op, t: op(torch.view_as_complex(t.view(-1, 2))[5:])],
    "vsplit.array": [lambda op, t: op(t, [1, 5])],
    "vsplit.int": [lambda op, t: op(t, 4)],
}


def _op(name: str):
    packet, overload = name.split(".")
    return getattr(getattr(aten, packet), overload)


def _outcome(fn):
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fn(), None
    except Exception as exc:  # noqa: BLE001 - the test looks at it
        return None, exc


def _flat(value) -> list:
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _flat(v)]
    return [value]


def _layout(t: torch.Tensor) -> tuple:
    return (t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.device)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values (a stored tensor read through the dispatch) as bytes, bits resolved."""
    value = t.resolve_conj().resolve_neg().detach().clone().contiguous().cpu()
    return value.view(-1).view(torch.uint8) if value.dtype != torch.bool else value


def _check_same(got, want) -> None:
    got, want = _flat(got), _flat(want)
    assert len(got) == len(want), "number of outputs"
    for g, w in zip(got, want):
        if not isinstance(w, torch.Tensor):
            assert g == w, (g, w)
            continue
        assert isinstance(g, torch.Tensor), g
        assert not w.is_nested and w.layout == torch.strided, w.layout
        assert _layout(g) == _layout(w), (_layout(g), _layout(w))
        assert torch.equal(_bytes(g), _bytes(w)), "values"


def test_every_view_op_has_samples():
    missing = [op for op in _view_ops() if op not in SAMPLES]
    assert not missing, f"view ops with no sample in SAMPLES: {missing}"


def test_every_view_of_a_stored_weight_is_exact_or_refused_by_name(tmp_path):
    """Each view op's samples on a stored parameter, read back, equal the same on the
    resident one (values and layout: strides and storage offset too), or raise ValueError
    naming the parameter; where torch refuses one for the resident parameter, it raises
    too. A float32 and a bfloat16 weight, a transposed weight and a bias seen as 2-D, of
    a model from `dlo_fx.load`; every failure is listed."""
    stored = _stored(tmp_path)
    picks = [_pick(stored, 2), _pick(stored, 2, torch.bfloat16),
             _pick(stored, 2, torch.bfloat16, contiguous=False)]
    name, p, r = _pick(stored, 1)
    picks.append((name, p.view(8, -1), r.view(8, -1)))  # the same samples apply
    failures, exact, refused = [], 0, 0
    for op in _view_ops():
        for index, sample in enumerate(SAMPLES.get(op, [])):
            for name, p, r in picks:
                outcome = _compare(op, sample, name, p, r)
                if outcome not in ("exact", "refused"):
                    failures.append(f"{op}[{index}] on {name}: {outcome}")
                exact += outcome == "exact"
                refused += outcome == "refused"
    print(f"{exact} exact, {refused} refused")
    assert not failures, "\n".join(failures)
    assert exact > 150 and refused < exact // 4, (exact, refused)


def _compare(op: str, sample, name: str, p, r) -> str:
    want, torch_refused = _outcome(lambda: sample(_op(op), r))
    got, error = _outcome(lambda: sample(_op(op), p))
    if torch_refused is not None:
        return "refused" if error is not None else f"read where torch refuses: {torch_refused}"
    if error is not None:
        named = isinstance(error, ValueError) and repr(name) in str(error)
        if named and DEBUG:
            print("REFUSED", op, str(error)[:200])
        return "refused" if named else f"{type(error).__name__}: {error}"
    try:
        _check_same(got, want)
        for g in _flat(got):  # a stored view stays a stored weight: a write is refused
            if isinstance(g, StoredWeight):
                with pytest.raises(ValueError, match=repr(name).replace(".", r"\.")):
                    g.add_(1)
    except AssertionError as exc:
        return f"differs: {exc}"
    return "exact"


@pytest.mark.parametrize("how", ["loaded", "compiled"])
def test_as_strided_with_an_explicit_offset_reads_the_parameters_own_bytes(tmp_path, how):
    """The offset was replayed against the block's buffer: another parameter's bytes."""
    stored = _stored(tmp_path, how)
    name, p, r = _pick(stored, 2)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for fn in (lambda t: t.as_strided(t.shape, t.stride(), t.storage_offset()),
                   lambda t: t.as_strided((4,), (1,), 0),
                   lambda t: t.view(-1)[4:].as_strided((3,), (1,), 1)):
            assert torch.equal(fn(p).clone(), fn(r)), name
        with pytest.raises(ValueError, match=rf"{name}.*outside its"):
            p.as_strided((8,), (1,), p.numel() - 4)


def test_storage_and_set_are_refused_by_name(tmp_path):
    stored = _stored(tmp_path)
    name, p, r = _pick(stored, 2)
    match = repr(name).replace(".", r"\.")
    attempts = {
        "untyped_storage": lambda: p.untyped_storage(),
        "storage": lambda: p.storage(),
        "share_memory_": lambda: p.share_memory_(),
        "is_shared": lambda: p.is_shared(),
        "set_ source": lambda: torch.empty(0, dtype=p.dtype).set_(p),
        "set_ of a view": lambda: torch.empty(0, dtype=p.dtype).set_(p.t()[2:]),
        "data_ptr": lambda: p.data_ptr(),
        "const_data_ptr": lambda: p.const_data_ptr(),
        "a view's data_ptr": lambda: p[1].data_ptr(),
        "ctypes": lambda: ctypes.c_float.from_address(p.data_ptr()),
    }
    for what, attempt in attempts.items():
        with pytest.raises(ValueError, match=match), torch.no_grad():
            attempt()
            pytest.fail(f"{what} was not refused")
    # below Python, the wrapper's storage has no bytes, cannot be resized and refuses its
    # data pointer
    storage = torch.Tensor.untyped_storage(p)
    assert storage.nbytes() == 0 and not storage.resizable()
    with pytest.raises(RuntimeError, match="Cannot access data pointer"):
        torch.utils.dlpack.to_dlpack(p)


RESIZE = "RuntimeError: Trying to resize storage that is not resizable"
#: how a spelling may fail besides RESIZE and dlo's ValueError naming the parameter: a meta
#: tensor cannot take a storage on the parameter's device
TORCH_REFUSALS = ('RuntimeError: Attempted to set the storage of a tensor on device "meta" '
                  'to a storage on different device',)


def _sets():
    with tempfile.TemporaryDirectory() as folder:
        path, config = spawn(1, in_child, save_dit, folder)[0]
        return stored_set_cases.all_sets(path, config)


@pytest.mark.spawned.with_args(_sets)
def test_no_set_of_a_stored_weight_crashes(spawned):
    """``t.set_(p, offset, size, stride)`` (CompositeImplicitAutograd) puts the stored
    weight's storage under ``t`` below any dispatch dlo sees; that storage has no bytes and
    cannot be resized, so torch raises where it grew it to address 0 (reading ``t`` killed
    the process). Every spelling of `stored_set_cases.SETS`, on a parameter stored by
    `dlo_fx.offload` and by `dlo_fx.load`, plain, under ``no_grad`` and in inference mode,
    each in a forked child: exact, or a Python exception; the parameter reads its own
    weights after."""
    results = spawned
    sets, contexts = stored_set_cases.SETS, stored_set_cases.CONTEXTS
    assert len(results) == 2 * len(sets) * len(contexts)
    for (how, spelling, context), (outcome, exact_after, name) in results.items():
        where = (how, spelling, context, outcome)
        assert exact_after, where
        assert outcome is True or outcome.startswith((RESIZE, *TORCH_REFUSALS)) or (
            outcome.startswith("ValueError: dlo: ") and repr(name) in outcome), where
    for how in ("offload", "load"):
        for spelling in ("set_ with an offset", "Tensor.set_ with an offset", "set_ of a row",
                         "set_ of the storage", "resize_ of the storage"):
            assert results[(how, spelling, "plain")][0].startswith(RESIZE), (how, spelling)
        assert results[(how, "no elements", "plain")][0] is True
        assert results[(how, "set_ of the parameter", "plain")][0].startswith("ValueError")


def test_zero_copy_ways_out_are_copies_of_the_real_bytes(tmp_path):
    """DLPack, numpy's array protocols: copies, exact; reading them never crashes."""
    stored = _stored(tmp_path)
    name, p, r = _pick(stored, 2)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for out in (torch.from_dlpack(p), torch.from_dlpack(p.t()[3:]),
                    torch.utils.dlpack.from_dlpack(p.__dlpack__())):
            assert not isinstance(out, StoredWeight)
            want = r if out.shape == r.shape else r.t()[3:]
            assert torch.equal(out, want) and torch.isfinite(out.sum()), name
        assert p.__dlpack_device__() == r.__dlpack_device__()
        for out in (np.asarray(p), np.array(p), p.numpy(), p.t().numpy()):
            want = r.numpy() if out.shape == tuple(r.shape) else r.t().numpy()
            assert (out == want).all(), name
        assert not hasattr(p, "__array_interface__") and not hasattr(r, "__array_interface__")
        assert not hasattr(p, "__cuda_array_interface__")  # a CPU tensor, as for torch
        with pytest.raises(TypeError):
            memoryview(p)


def test_a_view_that_outlived_release_says_the_weights_were_released(tmp_path):
    model, got, _ = _stored(tmp_path)
    name, p = next(iter(got.items()))
    view = p.t()
    dlo_fx.release(model)
    assert not any(is_stored(q) for q in model.parameters())
    reads = [lambda: view.sum(), lambda: view[0].clone()]
    if is_stored(p):  # something held its tensor: the model has a new parameter
        reads.append(lambda: p.sum())
    for read in reads:
        with pytest.raises(ValueError, match=r"read after dlo_fx\.release put the weights"):
            read()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_views_and_ways_out_on_a_gpu(tmp_path):
    """On a GPU: the view family and the issue's as_strided cases exact, DLPack a copy on
    the device, __cuda_array_interface__ and data_ptr refused by name."""
    stored = _stored(tmp_path, device="cuda")
    name, p, r = _pick(stored, 2)
    failures = [f"{op}[{i}]: {outcome}" for op in _view_ops()
                for i, sample in enumerate(SAMPLES.get(op, []))
                if (outcome := _compare(op, sample, name, p, r)) not in ("exact", "refused")]
    assert not failures, "\n".join(failures)
    match = repr(name).replace(".", r"\.")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = torch.from_dlpack(p.t()[3:])
        assert out.is_cuda and torch.equal(out, r.t()[3:]) and torch.isfinite(out.sum())
        for attempt in (lambda: p.__cuda_array_interface__, lambda: p.data_ptr(),
                        lambda: hasattr(p, "__cuda_array_interface__")):
            with pytest.raises(ValueError, match=match):
                attempt()
        assert hasattr(r, "__cuda_array_interface__")


def test_views_and_state_dict_under_inference_mode_are_exact():
    """A view of a stored parameter (a normal tensor) taken under ``torch.inference_mode()``
    is a normal tensor, as for a resident parameter: it raised torch's "Cannot set
    version_counter for inference tensor", and so did ``model.state_dict()``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)).requires_grad_(False)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    dlo_fx.offload(model, options={"block_bytes": 1, "resident_bytes": 0})
    p = model[0].weight
    with torch.inference_mode():
        assert torch.equal(p.t() * 1, want["0.weight"].t())
        assert torch.equal(p.view(-1)[3:7] * 1, want["0.weight"].view(-1)[3:7])
        assert torch.equal(p.detach() * 1, want["0.weight"])
        got = model.state_dict()
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    dlo_fx.release(model)
