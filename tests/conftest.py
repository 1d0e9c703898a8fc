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
