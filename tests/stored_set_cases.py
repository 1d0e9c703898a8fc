"""``set_`` of a stored weight's storage under another tensor, each spelling in a process of
its own (see ``test_no_set_of_a_stored_weight_crashes`` in tests/test_stored_views.py): on a
model stored by `dlo_fx.offload` and on one from `dlo_fx.load`.

Each case returns True where the spelling's tensor, read back, equals the same spelling's
on a copy of the resident parameter, else the text of the Python exception it raised; and
whether the parameter still reads its own weights afterwards. A crash (a tensor over the
weight's storage that reads address 0) shows as something else."""

from __future__ import annotations

import contextlib
import warnings

import torch

import dlo_fx
from dlo_fx.apps.models import ReferenceDiT
from dlo_fx.runtime.weights.stored import is_stored

from errors import error_text
from loader_cases import resident_dit

aten = torch.ops.aten


def _empty(p: torch.Tensor, device=None) -> torch.Tensor:
    return torch.empty(0, dtype=p.dtype, device=device or p.device)


def _resized(p: torch.Tensor) -> torch.Tensor:
    """The storage torch's own method hands out, resized to 4 elements, under a tensor."""
    storage = torch.Tensor.untyped_storage(p)
    storage.resize_(4 * p.element_size())
    return _empty(p).set_(storage, 0, (4,), (1,))


#: spelling -> f(p); the offset forms are CompositeImplicitAutograd: torch takes the
#: stored weight's storage below any dispatch dlo sees
SETS = {
    "set_ with an offset": lambda p: _empty(p).set_(p, 0, (4,), (1,)),
    "Tensor.set_ with an offset": lambda p: torch.Tensor.set_(_empty(p), p, 0, (4,), (1,)),
    "set_ at offset 2": lambda p: _empty(p).set_(p, 2, (3,), (1,)),
    "the aten overload": lambda p: aten.set_.source_Tensor_storage_offset(
        _empty(p), p, 0, [4], [1]),
    "set_ of view(-1)": lambda p: _empty(p).set_(p.view(-1), 0, (4,), (1,)),
    "set_ of a row": lambda p: _empty(p).set_(p[1], 1, (3,), (1,)),
    "set_ onto a meta tensor": lambda p: _empty(p, "meta").set_(p, 0, (4,), (1,)),
    # the storage torch's own method hands out, past the parameter's refusing override
    "set_ of the storage": lambda p: _empty(p).set_(torch.Tensor.untyped_storage(p), 0,
                                                    (4,), (1,)),
    "resize_ of the storage": lambda p: _resized(p),
    "no elements": lambda p: _empty(p).set_(p, 0, (0,), (1,)),
    # refused by name in Python (dlo's dispatch, the parameter's own method)
    "set_ of the parameter": lambda p: _empty(p).set_(p),
    "untyped_storage": lambda p: p.untyped_storage(),
}

CONTEXTS = {"plain": contextlib.nullcontext, "no_grad": torch.no_grad,
            "inference_mode": torch.inference_mode}


def _stored(how: str, path: str, config):
    """(model, name of a stored 2-D parameter, its resident values)."""
    if how == "offload":
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)])
        ref = {n: p.detach().clone() for n, p in model.named_parameters()}
        dlo_fx.offload(model, options={"device": "cpu", "block_bytes": 1})
    else:
        ref = {n: p.detach() for n, p in resident_dit(path, config).named_parameters()}
        model = dlo_fx.load(ReferenceDiT, path, config=config, options={"device": "cpu"})
    name = next(n for n, p in model.named_parameters() if is_stored(p) and p.dim() == 2)
    return model, name, ref[name]


def _read(out):
    """What the spelling gave, read: a tensor's values copied (a meta tensor has none)."""
    return out.clone() if isinstance(out, torch.Tensor) else out


def _same(got, want) -> bool:
    if not isinstance(want, torch.Tensor):
        return got == want
    return (isinstance(got, torch.Tensor) and got.device == want.device
            and got.shape == want.shape and (want.is_meta or torch.equal(got, want)))


def set_case(path: str, config, how: str, spelling: str) -> dict:
    """``SETS[spelling]`` on a parameter stored ``how`` ("offload" or "load"), in each of
    `CONTEXTS`: {context: (its outcome, whether the parameter reads exactly after, the
    parameter's name)}."""
    model, name, want = _stored(how, path, config)
    p = model.get_parameter(name)
    out = {}
    for context, mode in CONTEXTS.items():
        with warnings.catch_warnings(), mode():
            warnings.simplefilter("ignore", RuntimeWarning)  # "read outside a graph": slow
            expected = _outcome(lambda: _read(SETS[spelling](want.clone())))  # resize_ it
            got = _outcome(lambda: _read(SETS[spelling](p)))
        if isinstance(got, Exception):
            outcome = error_text(got)
        elif isinstance(expected, Exception):
            outcome = f"read where torch refuses: {error_text(expected)}"
        else:
            outcome = _same(got, expected) or f"differs: {got} != {expected}"
        out[context] = (outcome, torch.equal(p.detach().clone(), want), name)
    return out


def _outcome(fn):
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - the test looks at it
        return exc


def all_sets(path: str, config) -> dict:
    """{(how, spelling, context): `set_case`'s answer}: every spelling in a forked child of
    its own, stored both ways."""
    from distributed import in_child, spawn

    out = {}
    for how in ("offload", "load"):
        for spelling in SETS:
            try:
                answers = spawn(1, in_child, set_case, path, config, how, spelling,
                                timeout=120)[0]
            except AssertionError as exc:  # the child died (a crash) or hung
                answers = {context: (f"no answer: {exc}", False, None) for context in CONTEXTS}
            out.update({(how, spelling, context): answer for context, answer in answers.items()})
    return out
