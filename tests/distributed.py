"""Spawn N ranks with a file rendezvous and run one case function on each, bounded in time.

`background` runs such work on a thread while the in-process tests go on: the session's
spawned jobs (tests/conftest.py), and the fixtures that start work when the session
`selected` the test that checks it.

Ranks fork from a ``forkserver`` that imported torch, dlo_fx and diffusers once per test
session (and compiled a tiny model and resolved the diffusers classes the tests build:
tests/rank_warmup.py), so a spawn costs a fork, not a fresh interpreter importing torch.
`start_fork_server` starts it (tests/conftest.py, before any job).

A case function ``fn(rank, world_size, *args) -> object`` runs many sub-cases in one
process group (spawning is the slow part). Its return value, or the traceback it raised,
comes back per rank; a rank that exits without answering is reported as dead, and the
whole spawn is killed at ``timeout`` so a hang fails the test instead of CI.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import hashlib
import multiprocessing as mp
import os
import pickle
import queue
import signal
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import Future
from typing import Any, Callable, Iterator

from dlo_fx.apps.engine import worker_set as workers


def _entry(rank: int, world: int, init: str, fn: Callable, args: tuple, out: Any,
           env: dict) -> None:
    os.environ.clear()  # the parent's environment now, not the fork server's at its start
    os.environ.update(env)
    # A rank that does not answer in time has its threads' stacks written here before it
    # is killed (`spawn`), so a hang fails its test showing where it hung.
    stacks = open(_stacks_path(init, rank), "w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        result = ("ok", fn(rank, world, *args))
    except BaseException as exc:  # report, never hang the parent
        result = ("error", failure_text(exc))
    # By value (plain pickle copies tensor bytes): a tensor put on a multiprocessing queue
    # as is travels as a file descriptor that dies with this process.
    out.put((rank, pickle.dumps(result)))
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def failure_text(exc: BaseException) -> str:
    """``exc``'s traceback and, where Dynamo wrapped a backend's error, that error's own
    traceback and notes (which the wrapper's text leaves out)."""
    from errors import original

    text = "".join(traceback.format_exception(exc))
    inner = original(exc)
    if inner is not exc:
        text += "\nThe backend's own error:\n" + "".join(traceback.format_exception(inner))
    return text


# What the engine's workers preload with the diffusers factory, and this harness.
_PRELOAD = [*workers._PRELOAD, "diffusers", "dlo_fx.apps.engine.diffusers_pipeline", "distributed",
            "rank_warmup"]


def _context() -> Any:
    """A ``forkserver`` context whose server imported torch, dlo_fx and diffusers once and
    compiled a tiny model (`rank_warmup`): every rank forks from it instead of importing
    them again (a few CPU seconds a rank on a 2-core machine), and its first compile skips
    Dynamo's lazy set-up (a 2-rank spawn of the DiT cases: 7.8 s -> 6.7 s). The server
    holds no thread, process group or runtime."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


#: What the fork server, its ranks and workers, and multiprocessing's resource tracker
#: print (a rank's failure also comes back to its test through `spawn`); one file per
#: checkout, so that suites of two checkouts running at once keep their own.
OUTPUT = os.path.join(tempfile.gettempdir(), "dlo-fx-test-ranks-" + hashlib.sha256(
    os.path.dirname(os.path.abspath(__file__)).encode()).hexdigest()[:8] + ".log")


def start_fork_server() -> None:
    """Start the session's fork server now, with this folder on its ``PYTHONPATH`` and its
    output in `OUTPUT`.

    Python 3.11's fork server ignores the ``sys.path`` multiprocessing hands it, and skips
    a preload module it cannot import: without the path it never imports `distributed`
    or `rank_warmup`, and every rank pays the first compile's set-up and the diffusers
    class imports again. Called from the main thread before any job or engine starts:
    the variable and the output descriptors are changed for the start only (ranks and
    workers restore the parent's environment). The engine's workers fork from the same
    server (its preload, set here first, is the one that applies), so the tracebacks of
    their injected faults land in `OUTPUT`, not between pytest's dots."""
    from multiprocessing import forkserver

    _context()
    here = os.path.dirname(os.path.abspath(__file__))
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, before) if p)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    try:
        with open(OUTPUT, "w") as log:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            forkserver.ensure_running()  # and the resource tracker it starts first
    finally:
        for fd, copy in zip((1, 2), saved):
            os.dup2(copy, fd)
            os.close(copy)
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


def spawn(world: int, fn: Callable, *args: Any, timeout: float = 240.0,
          allow_dead: tuple[int, ...] = ()) -> dict[int, Any]:
    """Run ``fn`` on ``world`` ranks; return ``{rank: value}`` or raise with the failures."""
    ctx = _context()
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = "file://" + os.path.join(tmp, "rendezvous")
        env = dict(os.environ)
        procs = [ctx.Process(target=_entry, args=(r, world, init, fn, args, out, env),
                             daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(results) < world and time.monotonic() < deadline:
            try:
                rank, result = out.get(timeout=0.5)
                results[rank] = pickle.loads(result)
                continue
            except queue.Empty:
                pass
            if all(r in results or not procs[r].is_alive() for r in range(world)):
                # The rest exited: an answer written just before the exit may have reached
                # the pipe after the get above gave up (seen once: "exit code 0", no answer)
                try:
                    while len(results) < world:
                        rank, result = out.get(timeout=1.0)
                        results[rank] = pickle.loads(result)
                except queue.Empty:
                    pass
                break
        hung: dict[int, str] = {}
        for r, p in enumerate(procs):
            p.join(timeout=max(0.0, deadline - time.monotonic()) if len(results) == world else 1)
            if p.is_alive():
                hung[r] = _stacks_of(p, _stacks_path(init, r))
                p.kill()
                p.join()
        exits = {r: p.exitcode for r, p in enumerate(procs)}
    missing = [r for r in range(world) if r not in results and r not in allow_dead]
    errors = {r: v for r, (k, v) in results.items() if k == "error"}
    if missing or errors:
        text = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in errors.items())
        text += "".join(f"\n--- rank {r}: no answer in {timeout:g} s; its threads ---\n{stacks}"
                        for r, stacks in hung.items() if r in missing)
        dead = {r: exits[r] for r in missing if r not in hung}
        raise AssertionError(f"ranks without an answer: {missing} (exit codes of those that "
                             f"died: {dead}); failures:{text}")
    return {r: v for r, (_, v) in results.items()}


def _stacks_path(init: str, rank: int) -> str:
    return os.path.join(os.path.dirname(init[len("file://"):]), f"stacks-{rank}.txt")


def _stacks_of(proc: Any, path: str) -> str:
    """The stacks of every thread of ``proc``, a rank still running (``faulthandler``
    writes them when it gets SIGUSR1)."""
    try:
        os.kill(proc.pid, signal.SIGUSR1)
    except OSError:
        return "(gone before its stacks were asked for)"
    for _ in range(40):
        time.sleep(0.05)
        with open(path) as f:
            text = f.read()
        if text.count("\n") > 1 and "File " in text:
            time.sleep(0.1)  # the rest of the threads
            with open(path) as f:
                return f.read()
    return "(no stacks written)"


def in_child(rank: int, world: int, fn: Callable, *args: Any) -> Any:
    """``spawn(1, in_child, fn, *args)``: ``fn(*args)`` in a forked child. A spawned job
    (tests/conftest.py) writes its checkpoints this way: it never builds a model in the
    pytest process."""
    return fn(*args)


def written_then_spawned(write: Callable, case: Callable, world: int = 2,
                         timeout: float = 240.0) -> dict[int, Any]:
    """``write(0, 1, folder)`` on one rank into a new temporary folder, then ``case(rank,
    world, folder)`` on ``world`` ranks: `spawn`'s answer."""
    with tempfile.TemporaryDirectory() as folder:
        spawn(1, write, folder)
        return spawn(world, case, folder, timeout=timeout)


def selected(request: Any, test: str, **params: Any) -> bool:
    """Whether the session selected ``test`` of the requesting fixture's module (with these
    parametrize values, when given)."""
    for item in request.session.items:
        if getattr(item, "module", None) is not request.module:
            continue
        if getattr(item, "originalname", None) != test:
            continue
        callspec = getattr(item, "callspec", None)
        if all(callspec is not None and callspec.params.get(k) == v for k, v in params.items()):
            return True
    return False


@contextlib.contextmanager
def background(jobs: dict[Any, Callable[[], Any]], name: str) -> Iterator[dict[Any, Future]]:
    """Run ``jobs`` one after another on a thread; yield a Future per job.

    A module fixture starts ranks or worker processes (imports, first compiles) this way so
    they overlap the in-process tests, whose Dynamo tracing keeps one core busy; the test
    that checks a job waits for its Future. On exit, jobs not started yet are cancelled
    (a test failed early) and the thread is joined: no process outlives the fixture
    (`spawn` kills its ranks at its timeout).
    """
    futures = {key: Future() for key in jobs}

    def work() -> None:
        for key, job in jobs.items():
            if futures[key].set_running_or_notify_cancel():
                try:
                    futures[key].set_result(job())
                except BaseException as exc:  # the test that waits raises it
                    futures[key].set_exception(exc)

    thread = threading.Thread(target=work, name=name, daemon=True)
    thread.start()
    try:
        yield futures
    finally:
        for future in futures.values():
            future.cancel()
        thread.join()
