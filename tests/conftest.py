import gc

import pytest
import torch

from dlo_fx.runtime.runtime import reset_runtimes


@pytest.fixture(autouse=True)
def fresh_compile_state():
    """Each test compiles from scratch and leaves no runtime (host store, slots) behind."""
    torch._dynamo.reset()
    reset_runtimes()
    yield
    torch._dynamo.reset()
    reset_runtimes()
    gc.collect()  # this test's garbage: only what is not frozen yet
    gc.freeze()   # what outlives it (lazy imports, caches) is not scanned again


def pytest_configure(config):
    """One intra-op thread for the whole session, as the engine's workers and the spawned
    ranks (tests/distributed.py) run. The tensors are tiny, and on a busy 2-core machine
    (ranks and background work beside the in-process tests) two OpenMP threads per process
    spin against each other: an eager tiny-Flux call took 1-4 s instead of 0.1 s, a call
    of the DLO-compiled DiT with Inductor 0.3 s instead of 0.012 s. It also makes every
    resident reference run with the thread count of the workers it is compared with."""
    torch.set_num_threads(1)


def pytest_collection_finish(session):
    """Move what the imports and collection built (torch, diffusers, transformers: millions
    of objects) out of the garbage collector's reach: a full collection, the model-lifetime
    tests' `gc.collect()` included, then scans only what the tests create."""
    gc.collect()
    gc.freeze()
