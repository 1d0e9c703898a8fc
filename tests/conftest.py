import contextlib
import gc
import os
import time

import pytest
import torch

from distributed import OUTPUT, background, start_fork_server
from dlo_fx.runtime.weights.owners import reset_runtimes
from lifetime import Survivors


@pytest.fixture(autouse=True)
def fresh_compile_state():
    """Each test compiles from scratch and leaves no runtime (host store, slots) behind:
    one it made that is still alive after its garbage is collected fails it, naming what
    holds it (see [Note: the frozen heap] in tests/lifetime.py)."""
    torch._dynamo.reset()
    reset_runtimes()
    survivors = Survivors()
    yield
    torch._dynamo.reset()
    # Before reset_runtimes: a runtime lives as long as a parameter it stores, so one alive
    # here is a model the test left alive. A failed test's frames hold its models.
    leaked = "" if survivors.failed() else survivors.after()
    reset_runtimes()
    gc.collect()  # this test's garbage: only what is not frozen yet
    gc.freeze()   # what outlives it (lazy imports, caches) is not scanned again
    assert not leaked, leaked


def pytest_configure(config):
    """One intra-op thread for the whole session, as the engine's workers and the spawned
    ranks (tests/distributed.py) run. The tensors are tiny, and on a busy 2-core machine
    (ranks and background work beside the in-process tests) two OpenMP threads per process
    spin against each other: an eager tiny-Flux call took 1-4 s instead of 0.1 s, a call
    of the DLO-compiled DiT with Inductor 0.3 s instead of 0.012 s. It also makes every
    resident reference run with the thread count of the workers it is compared with."""
    torch.set_num_threads(1)
    _keep_pytest_off_torch_trace_log()
    config.addinivalue_line(
        "markers", "gpu: on the accelerator (tests/test_gpu.py; skipped where none exists)")
    config.addinivalue_line(
        "markers", "spawned(job): the test checks what job() returns; see tests/conftest.py")
    config.addinivalue_line(
        "markers", "fast: the subset to run before each commit (FAST_FILES in tests/conftest.py)")


def _keep_pytest_off_torch_trace_log():
    """pytest attaches its log-capture handlers to every logger that does not propagate, and
    torch's structured-trace logger (``torch.__trace``, what TORCH_TRACE writes) takes any
    handler as "tracing is on": every Dynamo compile then built each trace payload (graph
    printouts, guards, JSON) for pytest to store or write to /dev/null, in this process and
    in every rank the fork server forks from it. A propagating logger gets no handler from
    pytest, so torch's own lazy handler, which removes itself when TORCH_TRACE is unset, is
    its only one; with TORCH_TRACE set it traces as usual."""
    torch._logging._internal.trace_log.propagate = True


# -- spawned jobs ------------------------------------------------------------------------------
# A test marked ``@pytest.mark.spawned.with_args(job)`` (``with_args``: a bare function
# argument would be taken for the decorated test) checks what ``job()`` returns: ranks or
# worker processes whose work needs nothing from the pytest process (a `distributed.spawn`,
# often after a ``spawn(1, ...)`` that writes its checkpoint). The jobs of the selected tests
# run one after another on one background thread from the start of the session, and those
# tests run last, each taking its job's value from the `spawned` fixture. So the ranks (about
# 1.7 cores busy) overlap the in-process tests (one core busy: Dynamo tracing), where running
# them in turn left a core idle for half the suite. A job touches no state of the pytest
# process: no model built here (torch's global RNG), no Dynamo or runtime state, no
# environment. Several tests may share one job. The reverse holds too: an in-process test
# sets no ``DLO_FX_*`` variable, since the ranks and engine workers the jobs start meanwhile
# copy this process's environment (a test's DLO_FX_DUMP_DIR once made a job's ranks dump);
# such a test sets it in a child, ``spawn(1, in_child, fn, ...)`` (`pytest_runtest_call`
# fails one that does).
_SESSION = contextlib.ExitStack()
_FUTURES: dict = {}
_SECONDS: dict = {}  # first test of a job -> the job's wall time, for the session summary


def _job(item):
    marker = item.get_closest_marker("spawned")
    return marker.args[0] if marker is not None else None


# The fast subset (``make test-fast``, ``pytest -m fast``): the in-process tests of the files
# that hold the project's contracts (options, the stored weight's reads and writes, offload and
# release, the backend and its passes, the golden schedules, planning, loading, the parallel
# routes' single-process checks), about 2.5 minutes on 2 cores. No spawned job and no zoo: a
# change to the gathers, the engine or a model class still wants `make test` before it lands.
FAST_FILES = frozenset({
    "test_config.py", "test_stored_writes.py", "test_stored_read_contexts.py",
    "test_stored_weight.py", "test_passes.py", "test_golden.py", "test_policy.py",
    "test_routes.py", "test_offload.py", "test_backend.py", "test_flops.py",
    "test_runtime_parts.py", "test_options_and_release.py", "test_loader.py",
    "test_cfg_parallel.py", "test_parallel.py"})


def pytest_collection_modifyitems(session, config, items):
    for item in items:
        if item.path.name in FAST_FILES and _job(item) is None:
            item.add_marker(pytest.mark.fast)
    items.sort(key=lambda item: _job(item) is not None)  # stable: spawned tests last, in order


def pytest_collection_finish(session):
    """Move what the imports and collection built (torch, diffusers, transformers: millions
    of objects) out of the garbage collector's reach: a full collection, the model-lifetime
    tests' `gc.collect()` included, then scans only what the tests create. Then start the
    selected tests' spawned jobs."""
    gc.collect()
    gc.freeze()
    if session.config.option.collectonly:
        return
    start_fork_server()  # from this thread, before any job or engine forks from it
    jobs = {}
    for item in session.items:
        job = _job(item)
        if job is not None and job not in jobs:
            jobs[job] = _timed(job, item.nodeid)
    if jobs:
        _FUTURES.update(_SESSION.enter_context(background(jobs, "dlo-spawned-jobs")))


def _timed(job, test):
    def run():
        start = time.perf_counter()
        try:
            return job()
        finally:
            _SECONDS[test] = time.perf_counter() - start
    return run


def pytest_terminal_summary(terminalreporter, exitstatus):
    """The spawned jobs' wall times beside pytest's ``--durations`` (a job's test only waits
    for it, so its own duration says nothing); on a failure, where the ranks' and workers'
    own output went."""
    if exitstatus != 0 and os.path.exists(OUTPUT):
        terminalreporter.write_line(f"output of the spawned ranks and engine workers: {OUTPUT}")
    if _SECONDS and terminalreporter.config.option.durations is not None:
        terminalreporter.write_sep("=", "spawned jobs (wall seconds, on the background thread)")
        for test, seconds in sorted(_SECONDS.items(), key=lambda kv: -kv[1]):
            terminalreporter.write_line(f"{seconds:8.2f}s  {test}")


def pytest_sessionfinish(session, exitstatus):
    _SESSION.close()  # jobs not started are cancelled; the thread is joined


@pytest.fixture
def spawned(request):
    """What this test's spawned job returned: the fixture gives the job's Future, and
    `pytest_pyfunc_call` swaps in its value as the test starts, so a job that raised
    fails its tests (with the job's exception) instead of erroring their set-up."""
    return _FUTURES[_job(request.node)]


def _ours() -> dict:
    return {k: v for k, v in os.environ.items() if k.startswith("DLO_FX_")}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    before = _ours()
    yield
    changed = sorted(set(before.items()) ^ set(_ours().items()))
    if changed:  # monkeypatch restores it at teardown, after the jobs may have read it
        pytest.fail(f"{item.nodeid} changed {sorted({k for k, _ in changed})} in the pytest "
                    "process, whose environment the spawned jobs' processes copy: set it in "
                    "a child (spawn(1, in_child, fn, ...)); see tests/conftest.py",
                    pytrace=False)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    if "spawned" in pyfuncitem.funcargs:
        pyfuncitem.funcargs["spawned"] = pyfuncitem.funcargs["spawned"].result()
