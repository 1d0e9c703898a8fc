"""Blocks by footprint (`dlo_fx.planning.blocks`) and the one residency decision
(`dlo_fx.planning.residency`): on names alone, then on hand-written DiTs whose layers are not
numbered, through compile and through `dlo_fx.load`, at dp=1 and dp=2."""

from __future__ import annotations

import tempfile

import pytest

import handwritten_dits as hw
from distributed import in_child, spawn
from dlo_fx.planning.blocks import Unit, default_budget, layering, partition
from dlo_fx.planning.residency import Candidate, decide_residency


def units(names: list[str], nbytes: int = 100) -> list[Unit]:
    return [Unit(n, nbytes) for n in names]


def layer_names(prefix: str, keys) -> list[str]:
    return [f"{prefix}{k}.{m}.{w}" for k in keys for m in ("attn.q", "ff.net.0", "ff.net.2")
            for w in ("weight", "bias")]


# -- on names ---------------------------------------------------------------------------------
@pytest.mark.parametrize("prefix,keys,refined", [
    ("blocks.", hw.WORDS[:6], ["blocks"]),                       # word-keyed ModuleDict
    ("trunk.layer_", hw.WORDS[:6], ["trunk"]),                   # attributes of one container
    ("model.blocks.", hw.WORDS[:6], ["model", "model.blocks"]),  # all wrapped in one module
    ("model.blocks.", range(6), ["model"]),                      # ... around a ModuleList
    ("blocks.", range(6), []),                                   # natural layers: unchanged
])
def test_one_block_per_layer_whatever_the_names(prefix, keys, refined):
    names = ["embed.weight", "embed.bias", *layer_names(prefix, keys), "out.weight"]
    if prefix.startswith("model."):
        names = [n if n.startswith("model.") else "model." + n for n in names]
    us = units(names)
    layers = layering(us)
    assert [name for name, _ in layers.refined] == refined
    budget = default_budget(us, layers)
    assert budget == 600  # one layer: 3 modules x (weight, bias) x 100 B
    cuts = partition(us, budget, layers)
    assert len(cuts) == 8 and [c.nbytes for c in cuts[1:-1]] == [600] * 6
    assert all(c.stop - c.start == 6 for c in cuts[1:-1])
    assert cuts[-1].reason == "last streamed parameter"
    assert cuts[1].reason.startswith("next layer `") and "does not fit" in cuts[1].reason
    assert (layers.describe() != "") == bool(refined)


def test_natural_layers_are_never_refined():
    # a depth-1 ModuleList layer holding most of the model stays one layer
    names = ["embed.weight", *layer_names("blocks.", [0]), "out.weight"]
    assert not layering(units(names)).refined
    assert layering(units(names)).key("blocks.0.ff.net.0.weight") == "blocks.0"
    # a leaf module holding most of the model is not split between weight and bias
    assert not layering([Unit("head.weight", 900), Unit("head.bias", 10), Unit("x.w", 10)]).refined


def test_reasons_name_an_oversized_layer_and_parameter():
    names = layer_names("blocks.", hw.WORDS[:2])
    us = [Unit(n, 1000 if n.endswith("ff.net.0.weight") else 100) for n in names]
    cuts = partition(us, 600)
    assert [c.reason for c in cuts[:4]] == [
        "next module `blocks.first.ff.net.0` (1,100 B) is larger than the budget",
        "one parameter larger than the budget",
        "end of module `blocks.first.ff.net.0`, split to fit the budget",
        "end of layer `blocks.first`, split to fit the budget"]
    assert [c.stop - c.start for c in cuts] == [2, 1, 1, 2] * 2
    assert all(c.nbytes <= 600 or c.stop - c.start == 1 for c in cuts)
    assert [i for c in cuts for i in range(c.start, c.stop)] == list(range(len(us)))


def test_residency_decides_every_reason_in_one_place():
    cands = [Candidate("empty", 0, 0, 0), Candidate("unused", 64, -1, -1),
             Candidate("small", 8, 1, 1), Candidate("out", 64, 2, 9, escapes=True),
             Candidate("table", 64, 1, 9)]
    cands += [Candidate(f"blocks.{i}.w", 64, 2 + i, 2 + i) for i in range(6)]
    r = decide_residency(cands, resident_bytes=16, block_bytes=None, num_slots=2)
    assert r.reasons[:5] == ["empty", "unused by this graph", "smaller than resident_bytes=16",
                             "returned by the graph", "used far apart"]
    assert r.reasons[5:] == [None] * 6 and r.budget == 64
    # at load time there are no use intervals: only the static reasons apply
    load = [Candidate("a.w", 64), Candidate("b.w", 8), Candidate("c.w", 64, named=True)]
    r = decide_residency(load, resident_bytes=16, block_bytes=None, num_slots=2)
    assert r.reasons == [None, "smaller than resident_bytes=16", "named in resident="]


# -- hand-written DiTs, dp=1 ---------------------------------------------------------------
def check(r: dict, features: bool) -> None:
    assert r["equal"]
    assert r["layers_whole"], r  # every layer whole, alone in its block
    assert hw.DEPTH <= r["blocks"] <= hw.DEPTH + 2, r
    # slots hold one layer (the mixed-dtype models' float32 layers are the largest)
    assert r["max_block_bytes"] <= r["layer_bytes"] + 2048, r
    assert r["slot_bytes"] <= 2 * r["max_block_bytes"], r  # num_slots=2, allocated once


@pytest.mark.parametrize("layout,features", [
    ("dict", True), ("attr", False), ("sequential", False), ("wrapped", True)])
def test_handwritten_dit_compiles_to_one_block_per_layer(layout, features):
    check(hw.run(layout, {}, **(hw.FEATURES if features else {})), features)


@pytest.mark.parametrize("layout,features", [("dict", True), ("attr", False)])
def test_handwritten_dit_loads_one_block_per_layer(tmp_path, layout, features):
    kw = hw.FEATURES if features else {}
    path = hw.save_built(str(tmp_path / "model.safetensors"), layout, **kw)
    check(hw.run(layout, {}, ckpt=path, **kw), features)


def test_blocks_md_says_why_each_block_ends(tmp_path):
    hw.run("dict", {"dump_dir": str(tmp_path)})
    (text,) = [p.read_text() for p in tmp_path.glob("*/blocks.md")]
    assert "- layers: `blocks` holds 98% of the streamed bytes" in text
    assert "next layer `blocks.second` does not fit" in text
    assert "| last streamed parameter |" in text


# -- dp=2 -----------------------------------------------------------------------------------
def _two_ranks():
    with tempfile.TemporaryDirectory() as folder:
        spawn(1, in_child, hw.save_built, f"{folder}/attr.safetensors", "attr")
        return spawn(2, hw.dp2_cases, folder, timeout=400)


@pytest.mark.spawned.with_args(_two_ranks)
def test_handwritten_dits_on_two_ranks_both_modes(spawned):
    results = spawned
    for rank, out in results.items():
        for key, r in out.items():
            check(r, "features" in key)
            assert r["mode"] == key.rsplit("-", 1)[1], key
