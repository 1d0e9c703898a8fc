"""Tests for the reference Diffusion Transformer."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
import torch._dynamo
from torch import fx
from torch.overrides import TorchFunctionMode

from dlo_fx.apps.models import DiTConfig, ReferenceDiT, example_inputs, reference_dit

SMALL = {"width": 64, "depth": 2, "heads": 2, "text_dim": 16, "text_len": 4}


def small_model(seed: int = 0, **kw: object) -> ReferenceDiT:
    return reference_dit(seed=seed, **{**SMALL, **kw})


def small_inputs(model: ReferenceDiT, seed: int = 0) -> tuple[torch.Tensor, ...]:
    return example_inputs(model.config, batch=2, height=8, width=8, seed=seed)


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def recording_backend() -> tuple[Callable, list[tuple[fx.GraphModule, list]]]:
    """A backend that runs graphs eagerly and remembers each graph with its inputs."""
    graphs: list[tuple[fx.GraphModule, list]] = []

    def backend(gm: fx.GraphModule, inputs: list) -> Callable:
        graphs.append((gm, list(inputs)))
        return gm.forward

    return backend, graphs


def declared_order(config: DiTConfig) -> list[str]:
    """Parameter names in the order ``ReferenceDiT.__init__`` declares them."""
    names = ["patch_embed.weight", "patch_embed.bias"]
    names += ["time_embed.0.weight", "time_embed.0.bias", "time_embed.2.weight", "time_embed.2.bias"]
    names += ["text_proj.weight", "text_proj.bias", "modulation_table"]
    for i in range(config.depth):
        for layer in ("adaLN", "qkv", "proj", "fc1"):
            names += [f"blocks.{i}.{layer}.weight", f"blocks.{i}.{layer}.bias"]
        names += [f"blocks.{i}.fc2_weight", f"blocks.{i}.fc2_bias"]
    names += ["final_adaLN.weight", "final_adaLN.bias", "proj_out.weight", "proj_out.bias"]
    return names


def test_shapes_and_dtypes() -> None:
    model = small_model()
    config = model.config
    for name, param in model.named_parameters():
        expected = torch.float32 if name.startswith("time_embed.") else torch.bfloat16
        assert param.dtype == expected, name
        assert not param.requires_grad
    assert model.rope_freqs.dtype == torch.float32
    assert model.rope_freqs.shape == (config.head_dim // 2,)
    assert "rope_freqs" not in model.state_dict()
    assert model.modulation_table.shape == (6, config.width)
    fc2 = model.blocks[0].fc2_weight
    assert fc2.shape == (config.width, config.mlp_hidden)
    assert fc2.stride() == (1, config.width)
    assert not fc2.is_contiguous()
    assert not model.training

    latents, timestep, text = small_inputs(model)
    assert latents.shape == (2, config.in_channels, 8, 8) and latents.dtype == torch.bfloat16
    assert timestep.shape == (2,) and timestep.dtype == torch.float32
    assert bool(((timestep >= 0) & (timestep < 1000)).all())
    assert text.shape == (2, config.text_len, config.text_dim) and text.dtype == torch.bfloat16
    out = model(latents, timestep, text)
    assert out.shape == latents.shape and out.dtype == torch.bfloat16
    assert model.patchify(latents).shape == (2, 16, config.in_channels * config.patch_size**2)
    assert torch.equal(model.unpatchify(model.patchify(latents), 8, 8), latents)


def test_deterministic_and_non_degenerate() -> None:
    model = small_model()
    latents, timestep, text = small_inputs(model)
    out = model(latents, timestep, text)
    assert torch.equal(out, small_model()(*small_inputs(model)))
    assert not torch.equal(out, small_model(seed=1)(latents, timestep, text))
    assert out.float().std() > 0
    other_time = model(latents, torch.full_like(timestep, 999.0), text)
    assert not torch.equal(out, other_time)
    assert not torch.equal(out, model(latents, timestep, text[:, :2]))


def test_compile_fullgraph_matches_eager() -> None:
    model = small_model()
    inputs = small_inputs(model)
    backend, graphs = recording_backend()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    assert torch.equal(compiled(*inputs), model(*inputs))
    assert len(graphs) == 1

    # Parameters enter the graph in declaration order.
    names = {id(p): n for n, p in model.named_parameters()}
    lifted = [names[id(t)] for t in graphs[0][1] if id(t) in names]
    assert lifted == declared_order(model.config)


def test_first_use_order_follows_registration() -> None:
    model = small_model()
    names = {id(p): n for n, p in model.named_parameters()}
    used: list[str] = []

    class RecordUse(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            kwargs = kwargs or {}
            for arg in (*args, *kwargs.values()):
                name = names.get(id(arg))
                if name is not None and name not in used:
                    used.append(name)
            return func(*args, **kwargs)

    with RecordUse():
        model(*small_inputs(model))

    # The shared table is first used right after block 0's own modulation.
    expected = declared_order(model.config)
    expected.remove("modulation_table")
    expected.insert(expected.index("blocks.0.adaLN.bias") + 1, "modulation_table")
    assert used == expected

    # named_parameters lists a module's direct parameters before its children's,
    # which moves modulation_table and each block's fc2_* ahead; otherwise it
    # follows the declaration order.
    registered = declared_order(model.config)
    registered.remove("modulation_table")
    registered.insert(0, "modulation_table")
    for i in range(model.config.depth):
        for name in (f"blocks.{i}.fc2_weight", f"blocks.{i}.fc2_bias"):
            registered.remove(name)
            registered.insert(registered.index(f"blocks.{i}.adaLN.weight"), name)
    assert [n for n, _ in model.named_parameters()] == registered


def test_graph_break_in_blocks() -> None:
    model = small_model(graph_break_in_blocks=True)
    reference = small_model()
    inputs = small_inputs(model)
    eager = model(*inputs)
    assert torch.equal(eager, reference(*inputs))

    backend, graphs = recording_backend()
    assert torch.equal(torch.compile(model, backend=backend)(*inputs), eager)
    assert len(graphs) > 1

    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported):
        torch.compile(model, backend="eager", fullgraph=True)(*inputs)


def test_overrides_and_example_inputs() -> None:
    model = ReferenceDiT(DiTConfig(width=32), depth=1, heads=2)
    assert model.config.width == 32 and model.config.depth == 1 and len(model.blocks) == 1
    config = DiTConfig(patch_size=4)
    latents, _, text = example_inputs(config, height=8, width=12, text_len=3)
    assert latents.shape == (1, 4, 8, 12) and text.shape == (1, 3, config.text_dim)
    with pytest.raises(ValueError, match="patch_size=4"):
        example_inputs(config, height=6, width=8)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"width": 0}, r"DiTConfig\.width=0 .*positive int"),
        ({"depth": -1}, r"DiTConfig\.depth=-1 .*positive int"),
        ({"heads": 2.0}, r"DiTConfig\.heads=2\.0 .*positive int"),
        ({"text_len": True}, r"DiTConfig\.text_len=True .*positive int"),
        ({"width": 250, "heads": 4}, r"DiTConfig\.width=250 .*multiple of heads=4"),
        ({"width": 12, "heads": 4}, r"DiTConfig\.heads=4 .*head_dim .* = 3 must be even"),
        ({"mlp_ratio": 0.0}, r"DiTConfig\.mlp_ratio=0\.0 .*positive number"),
        ({"dtype": torch.int32}, r"DiTConfig\.dtype=torch\.int32 .*floating"),
        ({"graph_break_in_blocks": 1}, r"DiTConfig\.graph_break_in_blocks=1 .*bool"),
    ],
)
def test_config_validation(kwargs: dict, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        DiTConfig(**kwargs)
