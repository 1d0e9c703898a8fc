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


def run_snippets() -> dict:
    """Run the snippets in order, in one namespace, in a fresh folder; what they left.
    The job of `test_readme_snippets_run` runs it in a forked child (`spawn(1, ...)`): the
    snippets build and compile a model, which a spawned job never does in the pytest
    process (tests/conftest.py)."""
    here = os.getcwd()
    namespace: dict = {"__name__": "__readme__"}
    printed = io.StringIO()
    with tempfile.TemporaryDirectory() as folder, contextlib.redirect_stdout(printed):
        os.chdir(folder)
        try:
            for line, code in python_snippets():
                try:
                    exec(compile(code, f"README.md:{line}", "exec"), namespace)
                except Exception as exc:
                    return {"failed": f"the README snippet at line {line} fails: "
                                      f"{error_text(exc)}"}
        finally:
            os.chdir(here)
    out = namespace.get("out")
    return {"failed": None, "printed": printed.getvalue(),
            "out_finite": isinstance(out, torch.Tensor) and bool(torch.isfinite(out).all())}


@pytest.mark.spawned.with_args(functools.partial(spawn, 1, in_child, run_snippets))
def test_readme_snippets_run(spawned):
    result = spawned[0]
    if result["failed"]:
        pytest.fail(result["failed"])
    assert result["out_finite"]
    assert "blocks" in result["printed"]  # memory_report was printed
