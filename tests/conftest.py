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


def pytest_collection_finish(session):
    """Move what the imports and collection built (torch, diffusers, transformers: millions
    of objects) out of the garbage collector's reach: a full collection, the model-lifetime
    tests' `gc.collect()` included, then scans only what the tests create."""
    gc.collect()
    gc.freeze()
