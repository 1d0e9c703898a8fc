"""Progress where people wait in ``dlo-fx generate``: a bar per wave (front end), a bar per
denoising step (the first worker), a line per phase of the first wave with its seconds.

Shown only when the command's stderr is a terminal and ``--quiet`` is not given; the
engine then starts its workers with ``progress=True`` and rank 0 shows its steps (one bar
per terminal: the other ranks run the same steps in lock-step). A phase's seconds: load
(starting the workers: each builds its pipeline, ``dlo_fx.load`` included), compile
(Dynamo and the dlo backend during the first wave, on the rank that replied), warm-up (the rest of the
first wave: its first forwards, first copies and gathers).
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, Iterable, Optional, Sequence, TextIO

from .topology import worker_context

_LOCK = threading.Lock()
_COMPILE = {"total": 0.0, "since": None, "installed": False}


def compile_seconds() -> float:
    """Seconds this process has spent compiling with Dynamo (any backend) so far."""
    from ...torch_private import on_compile

    with _LOCK:
        if not _COMPILE["installed"]:
            _COMPILE["installed"] = True
            on_compile(_compile_started, _compile_ended)
        since = _COMPILE["since"]
        running = time.perf_counter() - since if since is not None else 0.0
        return _COMPILE["total"] + running


def _compile_started() -> None:
    with _LOCK:
        _COMPILE["since"] = time.perf_counter()


def _compile_ended() -> None:
    with _LOCK:
        if _COMPILE["since"] is not None:
            _COMPILE["total"] += time.perf_counter() - _COMPILE["since"]
        _COMPILE["since"] = None


def shows_progress() -> bool:
    """Whether this process is the engine worker that shows the denoising steps."""
    context = worker_context()
    return context is not None and context.progress


def steps(count: int) -> Iterable[int]:
    """``range(count)``, as a progress bar in the worker that shows progress."""
    if not shows_progress():
        return range(count)
    from tqdm.auto import tqdm

    return tqdm(range(count), desc="denoising steps", unit="step", leave=False)


def terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class WaveProgress:
    """The front end's bar over requests, advanced wave by wave, and the phase lines."""

    def __init__(self, total: int, *, enabled: bool, stream: TextIO = sys.stderr) -> None:
        self.enabled = enabled
        self.stream = stream
        self.waves = 0
        self._bar: Optional[Any] = None
        self._total = total

    def phase(self, name: str, seconds: float, note: str = "") -> None:
        if self.enabled:
            line = f"dlo-fx generate: {name} {seconds:.1f} s" + (f" ({note})" if note else "")
            if self._bar is not None:
                self._bar.write(line, file=self.stream)
            else:
                print(line, file=self.stream, flush=True)

    def start(self) -> None:
        if self.enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=self._total, desc="waves", unit="request",
                             file=self.stream)

    def wave_done(self, results: Sequence[Any]) -> None:
        """One wave's results came back."""
        self.waves += 1
        if self.waves == 1 and results:
            info = next((r.info for r in results if "compile_s" in r.info), {})
            seconds = max(r.seconds for r in results)
            compile_s = float(info.get("compile_s", 0.0))
            self.phase("compile", compile_s, "first wave, the rank that replied")
            self.phase("warm-up", max(seconds - compile_s, 0.0), "first wave, the rest")
        if self._bar is not None:
            self._bar.set_postfix_str(f"wave {self.waves}", refresh=False)
            self._bar.update(len(results))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
