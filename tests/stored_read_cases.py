"""Reads of a stored weight outside a graph, each in a process of its own (see
tests/test_stored_reads.py): what ordinary code does with a model's parameters, on a model
from `dlo_fx.load` and on one compiled with ``backend="dlo"`` and called once.

Each case returns True (exact against the resident model), or the text of the Python
exception it raised; a crash or a wrong value shows as something else."""

from __future__ import annotations

import copy
import io
import warnings

import torch

import dlo_fx
from dlo_fx.apps.models import ReferenceDiT
from dlo_fx.runtime.weights.stored import is_stored

from errors import error_text
from loader_cases import resident_dit
from models import offloaded, tiny_dit

LAYER = "blocks.1.qkv"  # a Linear whose weight is stored


def _equal_all(got, want) -> bool:
    return len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))


def _weight_sums(model: torch.nn.Module) -> list:
    sums: list = []
    model.apply(lambda m: sums.append(m.weight.sum()) if isinstance(m, torch.nn.Linear) else None)
    return sums


def _save_load(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf)


def _parametrize(model: torch.nn.Module, ref: torch.nn.Module):
    from torch.nn.utils import parametrize

    class Double(torch.nn.Module):
        def forward(self, w):
            return w * 2

    parametrize.register_parametrization(model.get_submodule(LAYER), "weight", Double())
    parametrize.register_parametrization(ref.get_submodule(LAYER), "weight", Double())
    return torch.equal(model.get_submodule(LAYER).weight, ref.get_submodule(LAYER).weight)


def _functional_call(model: torch.nn.Module, ref: torch.nn.Module, inputs) -> bool:
    """One stored weight replaced by a tensor of the caller's, the rest read as stored."""
    new = {f"{LAYER}.weight": ref.get_submodule(LAYER).weight * 0.5}
    return torch.equal(torch.func.functional_call(model, new, inputs),
                       torch.func.functional_call(ref, new, inputs))


def _ones(ref: torch.nn.Module) -> torch.Tensor:
    layer = ref.get_submodule(LAYER)
    return torch.ones(2, layer.in_features, dtype=layer.weight.dtype)


READS = {
    "sum": lambda m, r, x: torch.equal(m.get_parameter(f"{LAYER}.weight").sum(),
                                       r.get_parameter(f"{LAYER}.weight").sum()),
    "float": lambda m, r, x: torch.equal(m.get_parameter(f"{LAYER}.weight").float(),
                                         r.get_parameter(f"{LAYER}.weight").float()),
    "detach_clone": lambda m, r, x: torch.equal(m.get_parameter(f"{LAYER}.weight").detach().clone(),
                                                r.get_parameter(f"{LAYER}.weight")),
    # the DiT is bfloat16, which numpy lacks: its bits, through a view of the weight
    "numpy": lambda m, r, x: (m.get_parameter(f"{LAYER}.weight").detach().view(torch.int16).numpy()
                              == r.get_parameter(f"{LAYER}.weight").detach().view(torch.int16)
                              .numpy()).all(),
    "print": lambda m, r, x: (print(m.get_parameter(f"{LAYER}.weight")) is None
                              and LAYER in repr(m.get_parameter(f"{LAYER}.weight"))),
    "apply": lambda m, r, x: _equal_all(_weight_sums(m), _weight_sums(r)),
    "sum_of_parameters": lambda m, r, x: torch.equal(sum(t.sum() for t in m.parameters()),
                                                     sum(t.sum() for t in r.parameters())),
    "parametrize": lambda m, r, x: _parametrize(m, r),
    "save_parameter": lambda m, r, x: torch.equal(
        _save_load(m.get_parameter(f"{LAYER}.weight")), r.get_parameter(f"{LAYER}.weight")),
    "save_state_dict": lambda m, r, x: all(
        torch.equal(v, r.state_dict()[k]) for k, v in _save_load(m.state_dict()).items()),
    "deepcopy": lambda m, r, x: torch.equal(copy.deepcopy(m)(*x), r(*x)),
    "functional_call": lambda m, r, x: _functional_call(m, r, x),
    "eager_call": lambda m, r, x: torch.equal(m(*x), r(*x)),
    "eager_layer": lambda m, r, x: torch.equal(m.get_submodule(LAYER)(_ones(r)),
                                               r.get_submodule(LAYER)(_ones(r))),
}


def read_case(path: str, config, how: str, name: str):
    """``READS[name]`` on the DiT stored ``how`` ("loaded" or "compiled")."""
    ref = resident_dit(path, config)
    inputs = tiny_dit()[1]
    if how == "loaded":
        model = dlo_fx.load(ReferenceDiT, path, config=config)
    else:
        model = offloaded(resident_dit(path, config))
        with torch.no_grad():
            torch.compile(model, backend="dlo", fullgraph=True)(*inputs)
    assert is_stored(model.get_parameter(f"{LAYER}.weight"))
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # "read outside a graph": slow
            return bool(READS[name](model, ref, inputs))
    except Exception as exc:  # the text is what the test checks
        return error_text(exc)


def all_reads(path: str, config) -> dict:
    """Every read, stored both ways, each in a forked child of its own."""
    from distributed import in_child, spawn

    out = {}
    for how in ("loaded", "compiled"):
        for name in READS:
            try:
                out[(how, name)] = spawn(1, in_child, read_case, path, config, how, name,
                                         timeout=120)[0]
            except AssertionError as exc:  # the child died (a crash) or hung
                out[(how, name)] = f"no answer: {exc}"
    return out
