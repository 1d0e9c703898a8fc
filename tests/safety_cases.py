"""Case functions for the multi-rank safety tests (run on every rank by `distributed.spawn`)."""

from __future__ import annotations

import _thread
import contextlib
import random
import signal
import threading
import time

import torch

import dlo_fx
from dlo_fx.runtime.device.executor import fault_delay
from dlo_fx.apps.engine.clock import ForwardClock
from dlo_fx.runtime.ranks.clock import ClockMismatch
from dlo_fx.runtime.weights.owners import reset_runtimes, runtimes_holding

from errors import described
from models import call, offloaded, run_dlo, tiny_dit
from safety_models import FAIL, eager_head_dit, fail_after_half_the_waits, tiny_hidream


@contextlib.contextmanager
def ctrl_c_raises():
    """Python's own SIGINT handler (KeyboardInterrupt) for the block. A process started in
    the background by a non-interactive shell inherits SIGINT ignored, and then Python
    installs no handler: ``_thread.interrupt_main`` and a real SIGINT would do nothing, and
    an interrupt test would check no interrupt at all."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _fresh() -> None:
    torch._dynamo.reset()
    reset_runtimes()
    FAIL.update(rank=None, at=-1, seen=0)


def _outcome(fn):
    try:
        return fn()
    except ClockMismatch:
        return "clock"
    except KeyboardInterrupt:
        return "interrupt"
    except IndexError:
        return "index"


def _exact(factory, options, calls: int = 2, fullgraph: bool = False, **kw) -> list:
    _fresh()
    ref, outs, _ = run_dlo(factory, options, calls=calls, fullgraph=fullgraph, **kw)
    return [torch.equal(out, ref) for out in outs]


def _failing(rank: int, mode: str, kinds: tuple[str, ...], graph_break: bool,
             calls: int) -> dict:
    """For each of ``kinds`` in turn, on one compiled model: rank 1 fails once in its
    second call, half-way through a graph; the outcome of every call on this rank (True:
    exact). The first call of the first kind compiles every graph; each later kind starts
    on a runtime that already came through the earlier failures."""
    _fresh()
    ref_model, inputs = tiny_dit(depth=6, graph_break=graph_break)
    with torch.no_grad():
        ref = call(ref_model, inputs)
    model, _ = tiny_dit(depth=6, graph_break=graph_break)
    options = {"mode": mode, "block_bytes": 40_000, "collective_timeout_s": 30,
               "user_passes": [fail_after_half_the_waits]}
    compiled = torch.compile(offloaded(model, options), backend="dlo", options=options)
    outcomes = {}
    with torch.no_grad():
        for kind in kinds:
            first = torch.equal(call(compiled, inputs), ref)
            FAIL.update(rank=1, at=FAIL["seen"] + 1, kind=kind)
            outcomes[kind] = [first] + [_outcome(lambda: torch.equal(call(compiled, inputs), ref))
                                        for _ in range(calls)]
    return outcomes


def _gather_only(rank: int) -> dict:
    """The engine's padding: after a warm-up at both shapes (forwards that compile, so not
    replayable), rank 0 runs three forwards at the large shape while rank 1 pads three
    times: a real forward at its small shape, then two gather-only ones (the replayed
    collectives of that forward: graph clocks, gathers and an eager fetch); then both run
    the small shape."""
    _fresh()
    ref_model, (x,) = eager_head_dit()
    model, _ = eager_head_dit()
    options = {"mode": "allgather", "resident_bytes": 0, "collective_timeout_s": 30}
    compiled = torch.compile(offloaded(model, options), backend="dlo", options=options)
    calls = []
    clock = ForwardClock(lambda *a: calls.append(a[0].shape[0]) or compiled(*a))
    small, big = x[:1], torch.cat([x, x])
    outcome = []
    with torch.no_grad():
        expect = {1: ref_model(small), 4: ref_model(big)}
        for inp in (small, big):  # the warm-up: every rank compiles every shape
            outcome.append(torch.equal(clock(inp), expect[inp.shape[0]]))
        if rank == 0:
            outcome += [torch.equal(clock(big), expect[4]) for _ in range(3)]
        else:
            clock.pad(3)
        outcome.append(torch.equal(clock(small), expect[1]))
    return {"exact": outcome, "model_calls": calls, "gather_only": clock.gather_only,
            "in_step": clock.in_step}


def _interrupted_waits(rank: int, rounds: int = 8) -> dict:
    """Ctrl-C on rank 1 at a random moment of its call (most land while ``wait`` blocks on
    a delayed copy or gather), in allgather mode: rank 1 completes the graph's collectives
    and raises KeyboardInterrupt, rank 0's call is exact, and the next call of both is."""
    _fresh()
    ref_model, inputs = tiny_dit(depth=4)
    with torch.no_grad():
        ref = call(ref_model, inputs)
    model, _ = tiny_dit(depth=4)
    options = {"mode": "allgather", "block_bytes": 20_000, "collective_timeout_s": 60}
    with fault_delay(0.01):
        offloaded(model, options)
    compiled = torch.compile(model, backend="dlo", fullgraph=True)
    rng = random.Random(rank)
    calls, after, interrupted = [], [], 0
    with torch.no_grad(), ctrl_c_raises():
        calls.append(torch.equal(call(compiled, inputs), ref))  # compiles
        durations = []
        for _ in range(2):
            start = time.perf_counter()
            calls.append(torch.equal(call(compiled, inputs), ref))
            durations.append(time.perf_counter() - start)
        duration = min(durations)  # on a loaded machine a call may take less than one measured
        for _ in range(rounds):
            # rank 0 is never interrupted; rank 1 within the first 60% of a call
            delay = rng.uniform(0.0, 0.6 * duration) if rank == 1 else 1e9
            timer = threading.Timer(delay, _thread.interrupt_main)
            done = False
            try:
                timer.start()
                calls.append(torch.equal(call(compiled, inputs), ref))
                done = True
                if rank == 1:
                    timer.join()
                    time.sleep(0.02)  # an interrupt that came after the call lands here
            except KeyboardInterrupt:
                interrupted += not done
            timer.cancel()
            after.append(torch.equal(call(compiled, inputs), ref))
    return {"calls": calls, "after": after, "interrupted": interrupted,
            "broken": runtimes_holding(list(model.parameters()))[0].broken}


def _replaced_on_one_rank(rank: int) -> list:
    """Rank 1 gives a streamed parameter other data (``param.data = ...``) after the first
    call: refused at the write, nothing changed, so both ranks' calls stay exact. Then rank
    1 alone reads the weight (``p.sum()``): the read gathers its block behind a clock
    exchange, which meets rank 0's next call: both raise `ClockMismatch` instead of pairing
    a gather with another one, and the calls after that are exact on both."""
    _fresh()
    ref_model, inputs = tiny_dit()
    model, _ = tiny_dit()
    options = {"mode": "allgather", "collective_timeout_s": 30}
    compiled = torch.compile(offloaded(model, options), backend="dlo", fullgraph=True,
                             options=options)
    name = "blocks.1.fc2_weight"

    def outcome(fn=lambda: torch.equal(call(compiled, inputs), ref)):
        try:
            return fn()
        except ValueError as exc:
            return "refused" if f"param.data = ... would replace parameter {name!r}" in str(exc) \
                else str(exc)
        except ClockMismatch:
            return "clock"

    with torch.no_grad():
        ref = call(ref_model, inputs)
        outcomes = [outcome(), outcome()]
        if rank == 1:
            param = model.get_parameter(name)
            outcomes.append(outcome(lambda: setattr(
                param, "data", torch.zeros_like(ref_model.get_parameter(name)))))
            outcomes.append(outcome(lambda: torch.equal(param.sum(),
                                                        ref_model.get_parameter(name).sum())))
        else:
            outcomes.append(outcome())  # meets rank 1's read
        return outcomes + [outcome(), outcome()]


def _one_rank_recompiles(rank: int) -> list:
    """Calls that make Dynamo recompile on one rank only (allgather, a device budget): rank 1
    at a new resolution while rank 0 stays at the first, rank 0 under grad mode, rank 1
    under float16 autocast. A recompile of stored blocks issues no collective, so every
    call is exact on both ranks. They raised ClockMismatch at every call until both ranks
    recompiled together, and the autocast one paired a matmul-rate probe with rank 0's
    clock: gloo aborted both processes. Then a model with graph breaks in its blocks, at a
    shape on one rank alone."""
    from dlo_fx.apps.models import example_inputs, reference_dit

    _fresh()
    ref_model = reference_dit(width=64, depth=3, heads=4, seed=0)
    model = offloaded(reference_dit(width=64, depth=3, heads=4, seed=0), {
        "mode": "allgather", "device_budget": 450_000, "collective_timeout_s": 30})
    compiled = torch.compile(model, backend="dlo")
    steps = [((8, 8), None), ((8, 16), None), ((8, 16), None), ((8, 8), "grad0"),
             ((16, 16), "fp16_1"), ((8, 8), None)]
    outcomes = []
    for i, (sizes, how) in enumerate(steps):
        hw = sizes[rank]
        inputs = example_inputs(model.config, batch=1, height=hw, width=hw, seed=i)
        autocast = how == f"fp16_{rank}"
        with torch.set_grad_enabled(how == f"grad{rank}"), \
                torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
            expected = ref_model(*inputs)
            outcomes.append(_outcome(lambda: torch.equal(compiled(*inputs), expected)))
    # With graph breaks in the blocks, each block's forward is a compiled frame of its own;
    # at a new shape on rank 1 alone its guards fail there and it compiles the block again
    # (stored blocks: no collective), so both ranks call graphs in step, exactly. (Eager
    # fetch hooks once fetched the block there, and both ranks raised.)
    _fresh()
    model = offloaded(reference_dit(width=64, depth=3, heads=4, seed=0,
                                    graph_break_in_blocks=True),
                      {"mode": "allgather", "collective_timeout_s": 30})
    compiled = torch.compile(model, backend="dlo")
    for i, sizes in enumerate([(8, 8), (8, 16), (8, 8)]):
        inputs = example_inputs(model.config, batch=1, height=sizes[rank], width=sizes[rank],
                                seed=i)
        with torch.no_grad():
            expected = ref_model(*inputs)
            try:
                outcomes.append(torch.equal(compiled(*inputs), expected))
            except ClockMismatch as exc:
                outcomes.append("eager" if "rank 1 fetches weights eagerly" in str(exc) else str(exc))
    return outcomes


def safety_cases(rank: int, world: int) -> dict:
    out = {}
    # 1. allgather with several graphs per forward (a copy racing a gather into its slot)
    out["hidream"] = _exact(tiny_hidream, {"mode": "allgather", "resident_bytes": 0,
                                           "collective_timeout_s": 30})
    # 2. eager code reading streamed parameters: fetched (a gather) in step on both ranks
    out["eager"] = _exact(eager_head_dit, {"mode": "allgather", "resident_bytes": 0,
                                           "collective_timeout_s": 30}, calls=3)
    # 5. one rank raises mid-graph: it completes the graph's gathers, both stay exact
    for mode in ("allgather", "rank_local"):
        for kind, outcome in _failing(rank, mode, ("index", "interrupt"), False, 3).items():
            out[("fail", mode, kind)] = outcome
    # ... between graphs: the clock makes both raise once, then both are exact again
    out[("fail", "allgather", "index", "break")] = _failing(
        rank, "allgather", ("index",), True, calls=3 if rank == 0 else 4)["index"]
    # the engine's gather-only padding forwards keep the ranks in step
    out["gather_only"] = _gather_only(rank)
    # a parameter given other data on one rank: refused there, in step with the other
    out["replaced"] = _replaced_on_one_rank(rank)
    # recompiles on one rank only (a new resolution, grad mode, autocast) stay exact
    out["one_rank_recompiles"] = _one_rank_recompiles(rank)
    # 7. Ctrl-C during a wait on one rank only
    out["interrupts"] = _interrupted_waits(rank)
    # 8. different weights of the same shapes on each rank
    _fresh()
    model, inputs = tiny_dit(seed=rank)
    try:  # the ranks compare the weights at the offload
        compiled = torch.compile(offloaded(model, {"mode": "allgather"}), backend="dlo")
        with torch.no_grad():
            call(compiled, inputs)
        out["weights"] = None
    except Exception as exc:
        out["weights"] = described(exc)
    _fresh()
    return out
