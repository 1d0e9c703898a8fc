import pytest
import torch

from dlo_fx import DLOConfig
from models import tiny_dit


def test_defaults_and_mapping():
    config = DLOConfig.from_options({"num_slots": 3, "block_bytes": 1024})
    assert config.num_slots == 3 and config.block_bytes == 1024 and config.mode is None
    assert DLOConfig.from_options(None) == DLOConfig()


SECONDS = "expected a number of seconds from 0 to"


@pytest.mark.parametrize("options, named, allowed", [
    ({"num_slot": 2}, "option 'num_slot' (value 2)",
     "did you mean 'num_slots'? allowed options: activation_reserve_bytes, alignment,"),
    ({"num_slots": 1}, "'num_slots'=1", "expected an integer >= 2"),
    ({"num_slots": 2.0}, "'num_slots'=2.0", "expected an integer >= 2"),
    ({"block_bytes": 0}, "'block_bytes'=0", "expected an integer >= 1"),
    ({"resident_bytes": -1}, "'resident_bytes'=-1", "expected an integer >= 0"),
    ({"mode": "ring"}, "'mode'='ring'", "expected one of None, 'auto', 'allgather', 'rank_local'"),
    ({"compiler": "tvm"}, "'compiler'='tvm'", "expected one of 'eager', 'inductor'"),
    ({"alignment": 100}, "'alignment'=100", "a power of two from 16 to 1048576"),
    # a power of two, but every tensor padded to 1 TiB
    ({"alignment": 2**40}, f"'alignment'={2**40}", "a power of two from 16 to 1048576"),
    ({"device": "gpu7"}, "'device'='gpu7'", "expected a torch device string"),
    ({"pin_memory": "yes"}, "'pin_memory'='yes'", "expected True or False"),
    ({"collective_timeout_s": 0}, "'collective_timeout_s'=0", "expected > 0"),
    ({"fault_delay_s": -1}, "'fault_delay_s'=-1", f"{SECONDS} 60.0"),
    # finite, but no sleep or timedelta takes it
    ({"fault_delay_s": 1e300}, "'fault_delay_s'=1e+300", f"{SECONDS} 60.0"),
    ({"collective_timeout_s": 1e300}, "'collective_timeout_s'=1e+300", f"{SECONDS} 604800.0"),
    # a list is named as the tuple the config keeps of it
    ({"shard_group": [0, 0]}, "'shard_group'=(0, 0)", "a non-empty list of distinct global ranks"),
    ({"user_passes": [1]}, "'user_passes'=(1,)", "expected a sequence of callables (gm, ctx) -> gm"),
])
def test_bad_option_names_key_value_and_allowed(options, named, allowed):
    """The message names the option and its value, and what it allows: the values of a
    choice, the range of a number, the shape of a list."""
    with pytest.raises(ValueError) as info:
        DLOConfig.from_options(options)
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


def test_environment_fills_unset_options(monkeypatch, tmp_path):
    monkeypatch.setenv("DLO_FX_DUMP_DIR", str(tmp_path))
    monkeypatch.setenv("DLO_FX_DEBUG_PASSES", "1")
    config = DLOConfig.from_options({})
    assert config.dump_dir == str(tmp_path) and config.debug_passes
