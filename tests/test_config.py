import pytest
import torch

import dlo_fx
from dlo_fx import DLOConfig
from dlo_fx.config import CompileOptions, split_options
from dlo_fx.runtime.device.executor import fault_delay
from dlo_fx.runtime.weights.owners import owner_of
from distributed import in_child, spawn
from models import tiny_dit


def test_defaults_and_mapping():
    config = DLOConfig.from_options({"num_slots": 3, "block_bytes": 1024})
    assert config.num_slots == 3 and config.block_bytes == 1024 and config.mode is None
    assert DLOConfig.from_options(None) == DLOConfig()


SECONDS = "expected a number of seconds from 0 to"


@pytest.mark.parametrize("options, named, allowed", [
    ({"num_slot": 2}, "option 'num_slot' (value 2)",
     "did you mean 'num_slots'? allowed options: activation_reserve_bytes, alignment,"),
    ({"complier": "eager"}, "option 'complier' (value 'eager')",
     "did you mean 'compiler'? allowed options:"),
    ({"num_slots": 1}, "'num_slots'=1", "expected an integer >= 2"),
    ({"num_slots": 2.0}, "'num_slots'=2.0", "expected an integer >= 2"),
    ({"block_bytes": 0}, "'block_bytes'=0", "expected an integer >= 1"),
    ({"resident_bytes": -1}, "'resident_bytes'=-1", "expected an integer >= 0"),
    ({"mode": "ring"}, "'mode'='ring'", "expected one of None, 'auto', 'allgather', 'rank_local'"),
    ({"alignment": 100}, "'alignment'=100", "a power of two from 16 to 1048576"),
    # a power of two, but every tensor padded to 1 TiB
    ({"alignment": 2**40}, f"'alignment'={2**40}", "a power of two from 16 to 1048576"),
    ({"device": "gpu7"}, "'device'='gpu7'", "expected a torch device string"),
    ({"pin_memory": "yes"}, "'pin_memory'='yes'", "expected True or False"),
    ({"collective_timeout_s": 0}, "'collective_timeout_s'=0", "expected > 0"),
    ({"collective_timeout_s": 1e300}, "'collective_timeout_s'=1e+300", f"{SECONDS} 604800.0"),
    # a list is named as the tuple the config keeps of it
    ({"shard_group": [0, 0]}, "'shard_group'=(0, 0)", "a non-empty list of distinct global ranks"),
    ({"user_passes": [1]}, "'user_passes'=(1,)", "expected a sequence of callables (gm, plan) -> gm"),
    ({"compiler": "tvm"}, "'compiler'='tvm'", "expected one of 'eager', 'inductor'"),
    ({"trace": 1}, "'trace'=1", "expected True or False"),
    ({"dump_dir": 3}, "'dump_dir'=3", "expected a path"),
])
def test_bad_option_names_key_value_and_allowed(options, named, allowed):
    """The message names the option and its value, and what it allows: the values of a
    choice, the range of a number, the shape of a list."""
    with pytest.raises(ValueError) as info:
        split_options(options)  # each half as its own verb validates it
    message = str(info.value)
    key = next(iter(options))
    assert repr(key) in message
    assert named in message, message  # the value, as the option's own
    assert allowed in message, message


def test_an_unknown_name_is_refused_naming_the_close_one():
    """As Python's own NameError does: the name meant, before the list of every name."""
    from dlo_fx.apps.engine import Limits, Request

    with pytest.raises(ValueError, match=r"'dump_dri' .*; did you mean 'dump_dir'\? allowed"):
        DLOConfig.from_options({"dump_dri": "/tmp"})
    with pytest.raises(ValueError, match=r"'zzz' \(value 1\); allowed options"):  # none close
        DLOConfig.from_options({"zzz": 1})
    with pytest.raises(ValueError, match=r"field\(s\) 'promt', 'sed'; did you mean 'prompt' for "
                                         r"'promt', 'seed' for 'sed'\? allowed fields"):
        Request.from_dict({"promt": "x", "sed": 1})
    with pytest.raises(ValueError, match=r"\['max_hieght'\]; did you mean 'max_height'\?"):
        Limits.from_value({"max_hieght": 512})


def test_unknown_option_through_torch_compile():
    model, inputs = tiny_dit(depth=1)  # refused before any schedule: one layer traces faster
    compiled = torch.compile(model, backend="dlo", options={"slots": 2})
    with pytest.raises(ValueError, match="unknown dlo option 'slots'"):  # not wrapped
        with torch.no_grad():
            compiled(*inputs)


def _options_from_environment(dump_dir: str) -> tuple:
    import os

    os.environ.update(DLO_FX_DUMP_DIR=dump_dir, DLO_FX_DEBUG_PASSES="1")
    config = CompileOptions.from_options({})
    given = CompileOptions.from_options({"dump_dir": None, "debug_passes": False})
    return config.dump_dir, config.debug_passes, given.dump_dir, given.debug_passes


def test_environment_fills_unset_options(tmp_path):
    """In a child process: this process's environment is read by the spawned jobs that
    start meanwhile (tests/conftest.py), whose compiles would take these options too."""
    (got,) = spawn(1, in_child, _options_from_environment, str(tmp_path)).values()
    assert got == (str(tmp_path), True, None, False)


@pytest.mark.parametrize("max_s", [-1, 1e300, float("nan"), True])
def test_fault_delay_is_a_test_hook_with_its_bounds(max_s):
    """Not an option (options are the user's): a test sets it around the runtimes it
    makes, in the bounds a sleep takes."""
    with pytest.raises(ValueError, match=f"{SECONDS} 60.0"):
        with fault_delay(max_s):
            pass
    with pytest.raises(ValueError, match="unknown dlo option 'fault_delay_s'"):
        DLOConfig.from_options({"fault_delay_s": 0.01})


@pytest.mark.parametrize("option", [{"compiler": "inductor"}, {"trace": True},
                                    {"dump_dir": "dumps"}, {"user_passes": [lambda gm, p: gm]},
                                    {"debug_passes": True}])
def test_a_compile_option_given_to_offload_is_refused_naming_torch_compile(option):
    """It was accepted and kept by the runtime: ``dump_dir`` and ``trace`` were never read
    there, and a compile given any options of its own replaced the runtime's (a
    ``compiler="inductor"`` given at offload ran eager). Refused, before anything changes."""
    model, _ = tiny_dit(depth=1)
    key = next(iter(option))
    with pytest.raises(ValueError, match=rf"dlo option '{key}'=.* belongs to each compile, "
                                         r"not to dlo_fx.offload: give it to torch.compile"):
        dlo_fx.offload(model, option)
    assert dlo_fx.state(model) is None  # nothing stored


def test_runtime_and_compile_options_each_reach_their_verb():
    """The runtime's options given at offload, the compile's at torch.compile: each
    compile plans with the runtime's (not the defaults), and its own options are its
    own; a runtime option given to torch.compile of a stored model with another value
    than the runtime's is refused naming the verbs that make a runtime."""
    model, inputs = tiny_dit(depth=2)
    with torch.no_grad():
        expected = model(*inputs)
    dlo_fx.offload(model, {"num_slots": 3, "block_bytes": 20_000})
    seen = []

    def record(gm, plan):
        seen.append((plan.config.num_slots, plan.config.block_bytes))
        return gm

    compiled = torch.compile(model, backend="dlo", options={"user_passes": [record],
                                                            "trace": True})
    with torch.no_grad():
        assert torch.equal(compiled(*inputs), expected)
    assert seen and all(s == (3, 20_000) for s in seen)  # the runtime's, with the user pass
    assert owner_of(model.parameters()).machine.tracer is not None  # trace reached it
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="dlo", options={"num_slots": 2, "trace": False})
    with pytest.raises(ValueError, match=r"runtime options differ from those the runtime of "
                                         r"the model was made with: num_slots=2 \(the runtime "
                                         r"has num_slots=3\); nothing was changed\. Runtime "
                                         r"options are given where the runtime is made "
                                         r"\(dlo_fx.offload"):
        with torch.no_grad():
            compiled(*inputs)
    torch._dynamo.reset()  # the runtime's own values again: nothing dropped, accepted
    compiled = torch.compile(model, backend="dlo", options={"num_slots": 3})
    with torch.no_grad():
        assert torch.equal(compiled(*inputs), expected)
