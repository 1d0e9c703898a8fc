"""Benchmark scripts run in a child by `distributed.spawn` (a spawned job: tests/conftest.py)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import pathlib
import sys

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def gpu_check_on_cpu(rank: int, world: int, folder: str) -> tuple[int, dict, str]:
    """``gpu_check.main`` on the CPU (tiny sizes, every section, Wan included): its exit
    status, the JSON it wrote, and the end of what it printed."""
    sys.path.insert(0, str(BENCHMARKS))
    import gpu_check

    out = os.path.join(folder, "gpu_check.json")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rc = gpu_check.main(["--device", "cpu", "--wan", "--out", out])
    result = json.loads(pathlib.Path(out).read_text()) if os.path.exists(out) else {}
    return rc, result, printed.getvalue()[-6000:]
