import pytest
import torch

from dlo_fx import DLOConfig
from models import tiny_dit


def test_defaults_and_mapping():
    config = DLOConfig.from_options({"num_slots": 3, "block_bytes": 1024})
    assert config.num_slots == 3 and config.block_bytes == 1024 and config.mode is None
    assert DLOConfig.from_options(None) == DLOConfig()


@pytest.mark.parametrize("options, key", [
    ({"num_slot": 2}, "num_slot"),
    ({"num_slots": 1}, "num_slots"),
    ({"num_slots": 2.0}, "num_slots"),
    ({"block_bytes": 0}, "block_bytes"),
    ({"resident_bytes": -1}, "resident_bytes"),
    ({"mode": "ring"}, "mode"),
    ({"compiler": "tvm"}, "compiler"),
    ({"alignment": 100}, "alignment"),
    ({"alignment": 2**40}, "alignment"),  # a power of two, but every tensor padded to 1 TiB
    ({"device": "gpu7"}, "device"),
    ({"pin_memory": "yes"}, "pin_memory"),
    ({"collective_timeout_s": 0}, "collective_timeout_s"),
    ({"fault_delay_s": -1}, "fault_delay_s"),
    ({"fault_delay_s": 1e300}, "fault_delay_s"),  # finite, but no sleep or timedelta takes it
    ({"collective_timeout_s": 1e300}, "collective_timeout_s"),
    ({"shard_group": [0, 0]}, "shard_group"),
    ({"user_passes": [1]}, "user_passes"),
])
def test_bad_option_names_key_value_and_allowed(options, key):
    with pytest.raises(ValueError) as info:
        DLOConfig.from_options(options)
    message = str(info.value)
    assert repr(key) in message
    assert repr(next(iter(options.values()))) in message or "allowed" in message


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
