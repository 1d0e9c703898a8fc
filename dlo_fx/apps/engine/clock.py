"""`ForwardClock`: the count of model forwards that keeps the ranks of a wave in lock-step.

[Note: the forward clock of a wave]
Every rank of a wave issues the same number of forwards, and compiles at the same moments,
whatever requests it runs. In AllGather mode every forward of the compiled model issues one
weight AllGather per block on the DP group, and a compile issues a plan check on it. A
pipeline that keeps a forward clock lets any requests share a wave:

- ``pipeline.clock`` is a `ForwardClock` around the compiled model; the pipeline calls
  the model only through it.
- ``pipeline.forwards(request) -> int`` is how many forwards ``request`` takes.
- ``pipeline.graph_key(request) -> str`` names the compiled graphs ``request`` needs
  (its shapes); ``pipeline.warmup(request)`` runs one forward at those shapes.

Each wave then runs in three steps on every rank (worker.py):

1. Warm-up: for every graph key of the wave not seen before, in order, every rank runs
   ``warmup`` once, so every rank compiles every shape at the same moment and a request
   never compiles. The ranks see the same waves, so they agree on what is new without
   talking.
2. Requests: each replica runs its own request (or none); a request that raises between
   forwards becomes that request's error, and its rank goes on.
3. Padding: every rank then runs ``target - done`` padding forwards, ``target`` being the
   largest ``forwards`` of the wave's requests, so a rank with a shorter, failed or no
   request keeps serving its peers' gathers until the longest request ends.

A padding forward is gather-only: every forward through the clock is logged (a `_Forward`,
the `runtime.ranks.forward_log.ForwardLog` the runtime notes each collective step to), and a
padding forward replays the collectives of the latest steady-state forward without
computing (see [Note: gather-only forwards] in runtime/ranks/forward_log.py): it costs the
copies alone, nothing in rank-local mode or with dp=1. Until such a forward exists (a rank
that only ran warm-ups), or for a model whose forwards dlo does not schedule, the padding
forward is a real one on the smallest input already run (kept by reference, so a pipeline
must not change its model inputs in place afterwards), its output dropped; it is recorded,
so the next padding forward is gather-only.

A request that raises inside a forward (the clock started a forward it did not finish),
or runs more forwards than declared, leaves its rank's collectives out of step: the
worker stops and the wave fails closed (see [Note: failing closed] in engine.py).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ...runtime import logging_to


class _Forward:
    """The collective steps of one forward, as the runtime notes them (a `ForwardLog`)."""

    def __init__(self) -> None:
        self.replays: list[Callable[[], None]] = []
        self.compiles = False

    def step(self, replay: Callable[[], None]) -> None:
        self.replays.append(replay)

    def compiled(self) -> None:
        self.compiles = True

    @property
    def replayable(self) -> bool:
        """Whether it can stand for a forward: dlo scheduled it and nothing compiled."""
        return bool(self.replays) and not self.compiles

    def replay(self) -> None:
        """Issue its collectives again, computing nothing."""
        for replay in self.replays:
            replay()


def _numel(args: tuple, kwargs: dict) -> int:
    values = list(args) + list(kwargs.values())
    return sum(v.numel() for v in values if isinstance(v, torch.Tensor))


class ForwardClock:
    """Wraps the compiled model: counts its forwards and replays a small one on demand."""

    def __init__(self, model: Callable[..., Any]) -> None:
        self.model = model
        self.started = 0
        """Forwards begun."""
        self.finished = 0
        """Forwards that returned."""
        self._idle: Optional[tuple[tuple, dict]] = None
        self._idle_numel = 0
        self._steps: Optional[_Forward] = None
        self.gather_only = 0
        """Padding forwards run gather-only (replayed collectives, no compute)."""

    def _run(self, args: tuple, kwargs: dict) -> Any:
        with logging_to(_Forward()) as steps:
            out = self.model(*args, **kwargs)
        if steps.replayable:  # the latest steady-state forward, whatever its shapes
            self._steps = steps
        return out

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.started += 1
        out = self._run(args, kwargs)
        self.finished += 1
        numel = _numel(args, kwargs)
        if self._idle is None or numel < self._idle_numel:
            self._idle = (args, dict(kwargs))  # by reference: a copy could change strides
            self._idle_numel = numel
        return out

    @property
    def in_step(self) -> bool:
        """Every forward begun has returned (no forward was cut short by an error)."""
        return self.started == self.finished

    def pad(self, count: int) -> None:
        """Run ``count`` padding forwards: gather-only replays of the latest steady-state
        forward, or (until there is one) the smallest input already run, output dropped."""
        if count <= 0:
            return
        if self._idle is None:
            raise RuntimeError(f"dlo engine: {count} padding forward(s) are needed but this "
                               "rank has not run its model yet")
        args, kwargs = self._idle
        for _ in range(count):
            self.started += 1
            if self._steps is not None:
                self._steps.replay()
                self.gather_only += 1
            else:  # no steady-state forward seen yet (or dlo schedules none): a real one
                self._run(args, kwargs)
            self.finished += 1


def keeps_clock(pipeline: Any) -> bool:
    """Whether ``pipeline`` provides what mixed waves need (see the note above)."""
    return (isinstance(getattr(pipeline, "clock", None), ForwardClock)
            and all(callable(getattr(pipeline, name, None))
                    for name in ("forwards", "graph_key", "warmup")))
