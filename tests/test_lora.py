"""LoRA adapters (peft, through diffusers' adapter methods) on a compiled model whose
weights are stored: adding, switching, deleting and disabling adapters after the first
call is exact against the resident model doing the same; fusing is refused before
anything changes, and the model stays exact."""

from __future__ import annotations

import pytest
import torch

from dlo_fx.runtime.weights.stored import is_stored
from models import offloaded, tiny_flux


def _config():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v"],
                      init_lora_weights=False)  # random adapters: they change the output


def test_adapters_added_switched_and_deleted_after_the_first_call_are_exact():
    ref, inputs = tiny_flux(0)
    model = offloaded(tiny_flux(0)[0])
    compiled = torch.compile(model, backend="dlo")

    def both(action):
        for seed, m in ((7, model), (7, ref)):
            torch.manual_seed(seed)
            action(m)

    def exact() -> bool:
        return torch.equal(compiled(**inputs)[0], ref(**inputs)[0])

    with torch.no_grad():
        assert exact() and exact()
        both(lambda m: m.add_adapter(_config(), adapter_name="a"))
        assert exact() and exact()
        both(lambda m: (m.add_adapter(_config(), adapter_name="b"), m.set_adapter("b")))
        assert exact() and exact()
        both(lambda m: m.set_adapter("a"))
        assert exact()
        both(lambda m: m.delete_adapters(["b"]))
        assert exact()
        with pytest.raises(ValueError, match=r"cannot call FluxTransformer2DModel\.fuse_lora"):
            model.fuse_lora()
        assert exact()
        both(lambda m: m.disable_adapters())
        assert exact()
    lora = [p for n, p in model.named_parameters() if "lora_A.a" in n]
    assert lora and any(is_stored(p) for p in model.parameters())
