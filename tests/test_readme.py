"""The README's Python snippets run as written, in order, in one namespace."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def python_snippets() -> list[tuple[int, str]]:
    """(first line number, code) of every ```python block of README.md."""
    text = README.read_text()
    out = []
    for match in re.finditer(r"^```python\n(.*?)^```", text, flags=re.S | re.M):
        out.append((text.count("\n", 0, match.start()) + 2, match.group(1)))
    return out


def test_readme_has_snippets():
    assert len(python_snippets()) >= 2


def test_readme_snippets_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__readme__"}
    for line, code in python_snippets():
        try:
            exec(compile(code, f"README.md:{line}", "exec"), namespace)
        except Exception as exc:
            pytest.fail(f"the README snippet at line {line} fails: {type(exc).__name__}: {exc}")
    out = namespace.get("out")
    assert isinstance(out, torch.Tensor) and torch.isfinite(out).all()
    assert "blocks" in capsys.readouterr().out  # memory_report was printed
