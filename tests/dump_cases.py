"""Helpers of tests/test_dump.py: dumps of a small DiT, user passes, model factories, and
the case function `distributed.spawn` runs on every rank for the allgather dumps."""

from __future__ import annotations

import json
import re
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import torch
from torch import fx
from torch.fx.node import has_side_effect

import dlo_fx.apps.dump
from dlo_fx.apps.models import example_inputs, reference_dit
from dlo_fx.runtime.weights.owners import reset_runtimes

from models import call, offloaded, tiny_wan

SVG = "{http://www.w3.org/2000/svg}"


def fresh() -> None:
    torch._dynamo.reset()
    reset_runtimes()


def small_dit():
    """The golden model: a one-layer reference DiT of width 32."""
    model = reference_dit(width=32, depth=1, heads=2, seed=0)
    return model, example_inputs(model.config, batch=1, height=4, width=4)


def normalise(text: str, folder: Path) -> str:
    """Drop what differs between machines (the dump's path, file line numbers) and put
    each argument of ``def forward`` on its own line (Dynamo writes them all on one)."""
    text = text.replace(str(folder), "<dump>")
    text = re.sub(r"(\.py):\d+", r"\1:<line>", text)
    return re.sub(r"^def forward\(self, (.*)\):$",
                  lambda m: "def forward(\n    self,\n"
                  + "".join(f"    {arg},\n" for arg in m.group(1).split(", ")) + "):",
                  text, flags=re.M)


def dlo_lines(schedule_py: str) -> str:
    """The schedule of a schedule.py without the compute: its header comments and one
    ``<node>  # dlo: ...`` line per schedule node and slot view, in graph order."""
    out, comment = [], None
    for line in schedule_py.splitlines():
        if line.startswith("#"):
            out.append(line)
        elif line.lstrip().startswith("# dlo: "):  # the node's annotation, on the line above it
            comment = line.split("# dlo: ", 1)[1]
        elif comment is not None:
            out.append(f"{line.strip().split(' = ')[0]}  # dlo: {comment}")
            comment = None
    return "\n".join(out) + "\n"


def dump_model(model, inputs, dump_dir: Path, options: dict, calls: int = 1,
               fullgraph: bool = True):
    """Compile with dlo writing dumps into ``dump_dir`` (offloaded first where it is not
    dlo's yet); run ``calls`` times.

    Returns (compiled model, the folders this compile wrote)."""
    before = len(dlo_fx.apps.dump.dumps())
    if dlo_fx.state(model) is None:
        offloaded(model, options)
    compiled = torch.compile(model, backend="dlo", fullgraph=fullgraph,
                             options={**options, "dump_dir": str(dump_dir)})
    with torch.no_grad():
        for _ in range(calls):
            call(compiled, inputs)
    return compiled, [d.folder for d in dlo_fx.apps.dump.dumps()[before:]]


def dump_texts(dump_dir: Path, options: dict) -> dict[str, str]:
    """schedule.py and blocks.md of the small DiT, normalised."""
    fresh()
    model, inputs = small_dit()
    _, (folder,) = dump_model(model, inputs, dump_dir, options)
    return {name: normalise((folder / name).read_text(), folder)
            for name in ("schedule.py", "blocks.md")}


def table_blocks(blocks_md: str) -> list[int]:
    """Block indices of the blocks table of a blocks.md."""
    table = blocks_md.split("## Blocks")[1].split("## Resident set")[0]
    return [int(n) for n in re.findall(r"^\| (\d+) \|", table, re.M)]


def svg_bars(path: Path) -> dict[str, dict[str, set[int]]]:
    """``{kind: {lane: {blocks}}}`` of the bars of a timeline.svg (parsed as XML)."""
    out: dict[str, dict[str, set[int]]] = {}
    for rect in ET.parse(path).getroot().iter(f"{SVG}rect"):
        if "data-lane" in rect.attrib:
            lanes = out.setdefault(rect.get("class"), {})
            lanes.setdefault(rect.get("data-lane"), set()).add(int(rect.get("data-block")))
    return out


def trace_blocks(path: Path) -> dict[str, set[int]]:
    """``{kind: {graph blocks}}`` of the complete events of a trace.json."""
    out: dict[str, set[int]] = {}
    for event in json.loads(path.read_text())["traceEvents"]:
        if event["ph"] == "X":
            out.setdefault(event["cat"], set()).add(event["args"]["block"])
    return out


def traced_dump(dump_dir: Path, options: dict, calls: int = 2) -> dict:
    """Dump the small DiT traced over ``calls`` calls; flush; what tests check."""
    fresh()
    model, inputs = small_dit()
    _, (folder,) = dump_model(model, inputs, dump_dir, {**options, "trace": True}, calls)
    before = (folder / "trace.json").exists()
    written = dlo_fx.apps.dump.flush(model)
    blocks_md = (folder / "blocks.md").read_text()
    return {"trace_before_flush": before, "flushed": written == [folder],
            "num_blocks": len(re.findall(r"# dlo: wait", (folder / "schedule.py").read_text())),
            "svg": svg_bars(folder / "timeline.svg"), "trace": trace_blocks(folder / "trace.json"),
            "blocks_md": blocks_md, "table_blocks": table_blocks(blocks_md),
            "stalls": dlo_fx.apps.dump.stall_summary(model)}


# -- on every rank of a 2-rank gloo group ------------------------------------------------
def allgather_cases(rank: int, world: int, dump_dir: str) -> dict:
    """Golden texts for 2 and 3 slots, and a traced dump, in allgather mode."""
    root = Path(dump_dir) / "golden"
    out = {slots: dump_texts(root / str(slots), {"mode": "allgather", "num_slots": slots})
           for slots in (2, 3)}
    out["traced"] = traced_dump(Path(dump_dir) / "traced", {"mode": "allgather"})
    out["folders"] = sorted(str(p.relative_to(dump_dir)) for p in Path(dump_dir).rglob("graph_*")
                            if f"rank_{rank}" in p.parts)
    return out


# -- user passes ---------------------------------------------------------------------------
def delay_prefetches(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Issue each block's prefetch one block later: where the next block's prefetch was
    (or just before its own wait, if that comes first). The wrap-around prefetch stays.
    The same code is in docs/schedule.md."""
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    found = {"prefetch": {}, "allgather": {}, "wait": {}}
    for n in nodes:
        meta = n.meta.get("dlo", {})
        if meta.get("kind") in found and not meta.get("wrap"):
            found[meta["kind"]][meta["block"]] = n
    prefetch, gather, wait = found["prefetch"], found["allgather"], found["wait"]
    for block, node in list(prefetch.items()):
        later = prefetch.get(block + 1)  # where the next block's prefetch was ...
        anchor = later if later is not None and order[later] < order[wait[block]] else wait[block]
        anchor.prepend(node)             # ... unless its own wait comes first
        if block in gather:
            anchor.prepend(gather[block])
    gm.graph.lint()
    gm.recompile()
    return gm


def _busy(seconds: float) -> None:
    time.sleep(seconds)


has_side_effect(_busy)


def slow_blocks(seconds: float):
    """A user pass making each block's compute last at least ``seconds`` (a sleep right
    after its wait), so a timing test does not hang on this machine's speed."""
    def slow_blocks_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
        for n in list(gm.graph.nodes):
            if n.meta.get("dlo", {}).get("kind") == "wait":
                with gm.graph.inserting_after(n):
                    gm.graph.call_function(_busy, (seconds,))
        gm.recompile()
        return gm
    return slow_blocks_pass


def stall_total(passes: tuple, dump_dir: Path, calls: int = 2, delay_s: float = 0.0,
                **options) -> float:
    """Measured stall seconds of a 4-layer DiT over ``calls`` traced calls, each copy
    delayed by up to ``delay_s`` (`fault_delay`)."""
    from dlo_fx.runtime.device.executor import fault_delay

    fresh()
    model = reference_dit(width=64, depth=4, heads=4, seed=0)
    inputs = example_inputs(model.config, batch=1, height=8, width=8)
    with fault_delay(delay_s):
        dump_model(model, inputs, dump_dir, {"trace": True, "user_passes": passes, **options},
                   calls)
    return dlo_fx.apps.dump.stall_summary(model).total_ns / 1e9


# -- factories for `dlo-fx dump --model` ------------------------------------------------
def wan_factory():
    """``dump_cases:wan_factory``: a tiny diffusers WanTransformer3DModel and its inputs."""
    return tiny_wan()


def dit_model():
    """``dump_cases:dit_model`` with ``--inputs dump_cases:dit_inputs``."""
    return reference_dit(width=32, depth=2, heads=2, seed=0)


def dit_inputs(model):
    return example_inputs(model.config, batch=1, height=4, width=4)


def offloaded_dit():
    """``dump_cases:offloaded_dit``: a model the factory made dlo's itself, with 3 slots."""
    model = offloaded(reference_dit(width=32, depth=2, heads=2, seed=0), {"num_slots": 3})
    return model, dit_inputs(model)
