"""The README's Python snippets run as written, in order, in one namespace."""

from __future__ import annotations

import contextlib
import functools
import io
import os
import re
import tempfile
from pathlib import Path

import pytest
import torch

from distributed import in_child, spawn
from errors import error_text

README = Path(__file__).resolve().parents[1] / "README.md"


DIFFUSERS_SECTION = "## Diffusers quick start"
"""Its snippets name a real pipeline folder: tests/test_diffusers.py runs them on a tiny
locally built one."""
SEQUENCE_PARALLEL_SECTION = "## Sequence parallelism"
"""Its snippet runs on 2 ranks: `test_readme_sequence_parallel_snippet_runs_on_two_ranks`."""
CFG_SECTION = "## CFG parallel"
"""Its snippet runs on 2 ranks: tests/cfg_cases.py, `readme_case`."""


def _section(text: str, title: str) -> tuple[int, int]:
    start = text.find(title)
    return (start, text.find("\n## ", start + 1)) if start >= 0 else (-1, -1)


def python_snippets(section: str = "") -> list[tuple[int, str]]:
    """(first line number, code) of every ```python block of README.md in ``section``,
    or (no section) outside the diffusers quick start, the sequence-parallel and the CFG
    sections."""
    text = README.read_text()
    skipped = [_section(text, title)
               for title in (DIFFUSERS_SECTION, SEQUENCE_PARALLEL_SECTION, CFG_SECTION)]
    start, end = _section(text, section) if section else (0, len(text))
    out = []
    for match in re.finditer(r"^```python\n(.*?)^```", text, flags=re.S | re.M):
        inside = start <= match.start() < end
        if not inside or (not section and any(a <= match.start() < b for a, b in skipped)):
            continue
        out.append((text.count("\n", 0, match.start()) + 2, match.group(1)))
    return out


def test_readme_has_snippets():
    assert len(python_snippets()) >= 2


def run_snippets(device: str = "") -> dict:
    """Run the snippets in order, in one namespace, in a fresh folder; what they left.
    With ``device``, the snippets run as on a machine whose accelerator that device is
    (``"meta"``: a compute device that is not the host, as a GPU is; the outputs have no
    values). The job of `test_readme_snippets_run` runs it in a forked child (`spawn(1,
    ...)`): the snippets build and compile a model, which a spawned job never does in the
    pytest process (tests/conftest.py)."""
    from dlo_fx.runtime.device import platform

    here = os.getcwd()
    namespace: dict = {"__name__": "__readme__"}
    printed = io.StringIO()
    default = platform.default_device
    if device:
        platform.default_device = lambda: torch.device(device)
    with tempfile.TemporaryDirectory() as folder, contextlib.redirect_stdout(printed):
        os.chdir(folder)
        try:
            for line, code in python_snippets():
                try:
                    exec(compile(code, f"README.md:{line}", "exec"), namespace)
                except Exception as exc:
                    return {"failed": f"the README snippet at line {line} fails on "
                                      f"{device or 'the default device'}: {error_text(exc)}"}
        finally:
            os.chdir(here)
            platform.default_device = default
    out = namespace.get("out")
    return {"failed": None, "printed": printed.getvalue(), "device": str(out.device),
            "shape": tuple(out.shape),
            "out_finite": out.is_meta or bool(torch.isfinite(out).all())}


def run_snippets_here_and_on_meta() -> list[dict]:
    import torch._dynamo

    here = run_snippets()
    torch._dynamo.reset()
    return [here, run_snippets("meta")]


@pytest.mark.spawned.with_args(functools.partial(spawn, 1, in_child,
                                                 run_snippets_here_and_on_meta))
def test_readme_snippets_run(spawned):
    here, meta = spawned[0]
    for result in (here, meta):
        if result["failed"]:
            pytest.fail(result["failed"])
        assert result["out_finite"]
        assert "blocks" in result["printed"]  # memory_report was printed
    from dlo_fx.runtime.device.platform import default_device

    assert here["device"].startswith(default_device().type) and meta["device"] == "meta"
    assert here["shape"] == meta["shape"]


def sequence_parallel_snippet(rank: int, world: int) -> dict:
    """The sequence-parallel snippet as written, on this rank of 2 (gloo), then the same
    transformer resident with the same context parallelism (`enable_context_parallel`
    over the same mesh) and without any, on the same inputs; and the host bytes of the
    snippet's transformer against a rank-local twin's."""
    import dlo_fx
    from dlo_fx.apps.engine.context_parallel import enable_context_parallel

    (line, code), = python_snippets(SEQUENCE_PARALLEL_SECTION)
    namespace: dict = {"__name__": "__readme__"}
    exec(compile(code, f"README.md:{line}", "exec"), namespace)
    cls, mesh, inputs = (namespace[k] for k in ("FluxTransformer2DModel", "mesh", "inputs"))

    def built():
        torch.manual_seed(0)
        return cls.from_config(namespace["transformer"].config)

    resident, plain = built(), built()
    enable_context_parallel(resident, mesh)
    local = built()
    dlo_fx.offload(local, options={"shard_group": [rank]})
    with torch.inference_mode():
        expected = resident(**inputs, return_dict=False)[0]
        alone = plain(**inputs, return_dict=False)[0]
    shared = dlo_fx.memory_report(namespace["transformer"]).host_shard_bytes
    whole = dlo_fx.memory_report(local).host_shard_bytes
    out = namespace["out"]
    return {"equal": torch.equal(out, expected), "shape": tuple(out.shape),
            "plain_equal": torch.equal(expected, alone),
            "plain_diff": float((expected - alone).abs().max()), "cls": cls.__name__,
            "shared": shared, "whole": whole}


@pytest.mark.spawned.with_args(functools.partial(spawn, 2, sequence_parallel_snippet))
def test_readme_sequence_parallel_snippet_runs_on_two_ranks(spawned):
    """The README's context parallelism plus offload: each rank's output equals the same
    context-parallel transformer resident, and each rank holds half of every block."""
    for rank, result in spawned.items():
        assert result["equal"], (rank, result)
        assert result["shape"] == (1, 64, 16)
        assert result["whole"] / 2 <= result["shared"] <= result["whole"] / 2 + 3 * 256, result
