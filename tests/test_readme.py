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


def python_snippets() -> list[tuple[int, str]]:
    """(first line number, code) of every ```python block of README.md outside the
    diffusers quick start."""
    text = README.read_text()
    start = text.find(DIFFUSERS_SECTION)
    end = text.find("\n## ", start + 1) if start >= 0 else -1
    out = []
    for match in re.finditer(r"^```python\n(.*?)^```", text, flags=re.S | re.M):
        if start <= match.start() < end:
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
