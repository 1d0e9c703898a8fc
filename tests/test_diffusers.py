"""diffusers pipelines: `dlo_fx.load` like ``from_pretrained``, `dlo_fx.compile_pipeline`
bit-exact through ``pipe(...)``, the README quick start, and ``dlo-fx generate --diffusers``.

Tiny pipelines are built locally (tests/diffusers_pipelines.py) and saved once per module.
Torch runs one intra-op thread here (tests/conftest.py), as the engine's workers do
(``--threads 1``). The ``dlo-fx generate --diffusers`` runs start in a background thread
with the module's first test, so their worker processes (torch + diffusers imports, their
own compiles) overlap the in-process tests, whose Dynamo tracing keeps one core busy; each
generate test waits for its own run, then checks it.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import functools
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

import diffusers_pipelines as dp
from distributed import background, in_child, selected, spawn
from dlo_fx import compile_pipeline, load
from dlo_fx.loading.checkpoint import CheckpointError
from dlo_fx.apps.cli import build_parser, main
from dlo_fx.loading.plan import MAX_REPORT_LINES
from dlo_fx.runtime.weights.stored import is_stored
from dlo_fx.runtime.weights.owners import reset_runtimes
from loader_cases import same_state

README = Path(__file__).resolve().parent.parent / "README.md"


def fresh() -> None:
    torch._dynamo.reset()
    reset_runtimes()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Tiny Flux and Wan2.2-style (two transformers) pipelines saved once."""
    root = tmp_path_factory.mktemp("pipelines")
    out = {}
    for kind, build in (("flux", dp.flux), ("wan2", lambda: dp.wan(two_transformers=True))):
        build().save_pretrained(root / kind)
        out[kind] = root / kind
    return out


# -- dlo_fx.load follows from_pretrained ---------------------------------------------------------
def test_load_forms_of_a_pipeline_folder(saved, tmp_path):
    from diffusers import FluxTransformer2DModel
    from transformers import T5EncoderModel

    from dlo_fx.apps.engine.diffusers_pipeline import load_state_dict

    root = saved["flux"]
    reference = load_state_dict(FluxTransformer2DModel, root / "transformer")
    fresh()
    model = load(FluxTransformer2DModel, root, subfolder="transformer")  # root + subfolder
    assert model.config.num_layers == reference.config.num_layers == 1
    assert all(is_stored(p) for p in model.parameters())
    assert same_state(model, reference)
    fresh()
    assert same_state(load(FluxTransformer2DModel, root / "transformer"), reference)  # folder
    # an index of several shards, found in the folder or named itself
    sharded = tmp_path / "sharded"
    reference.save_pretrained(sharded, max_shard_size="20KB")
    index = next(sharded.glob("*.safetensors.index.json"))
    assert len(set(json.loads(index.read_text())["weight_map"].values())) > 1
    for source in (sharded, index):
        fresh()
        assert same_state(load(FluxTransformer2DModel, source), reference)
    # a single file: with config= it loads, without a config.json beside it is an error
    single = tmp_path / "single"
    single.mkdir()
    shutil.copy(root / "transformer" / "diffusion_pytorch_model.safetensors", single / "w.safetensors")
    fresh()
    config = json.loads((root / "transformer" / "config.json").read_text())
    assert same_state(load(FluxTransformer2DModel, single / "w.safetensors", config=config),
                      reference)
    with pytest.raises(ValueError, match=r"no config\.json beside its weights.*pass config=.*"
                                         r"add config\.json"):
        load(FluxTransformer2DModel, single / "w.safetensors")
    # a transformers text encoder, the same way
    fresh()
    encoder = load(T5EncoderModel, root, subfolder="text_encoder_2")
    assert same_state(encoder, T5EncoderModel.from_pretrained(root / "text_encoder_2"))
    # the pipeline root without subfolder= names the components that hold weights
    with pytest.raises(CheckpointError, match=r"diffusers pipeline folder.*subfolder=.*"
                                              r"'text_encoder_2'.*'transformer'"):
        load(FluxTransformer2DModel, root)


def test_bf16_checkpoint_without_dtype_loads_like_diffusers(saved, tmp_path, caplog):
    """[Note: the dtype rule]: the model's dtype wins, one log line counts the casts."""
    from diffusers import FluxTransformer2DModel

    folder = tmp_path / "bf16"
    FluxTransformer2DModel.from_pretrained(saved["flux"] / "transformer").to(
        torch.bfloat16).save_pretrained(folder)
    fresh()
    with caplog.at_level(logging.INFO, logger="dlo_fx.loading.plan"):
        model = load(FluxTransformer2DModel, folder)
    casts = [r.message for r in caplog.records if "cast" in r.message]
    assert len(casts) == 1 and "bfloat16 -> float32" in casts[0], casts
    expected = FluxTransformer2DModel.from_pretrained(folder)  # diffusers: float32 as well
    assert {p.dtype for p in expected.parameters()} == {torch.float32}
    assert same_state(model, expected)
    fresh()
    half = load(FluxTransformer2DModel, folder, dtype=torch.bfloat16)
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}


def test_wrong_config_report_is_summarised(saved):
    from diffusers import FluxTransformer2DModel

    config = json.loads((saved["flux"] / "transformer" / "config.json").read_text())
    config.update(num_layers=4, attention_head_dim=32)  # another model: most tensors differ
    with pytest.raises(ValueError) as info:
        load(FluxTransformer2DModel, saved["flux"], subfolder="transformer", config=config)
    message = str(info.value)
    lines = message.splitlines()
    assert len(lines) <= MAX_REPORT_LINES + 3, message
    assert re.search(r"\d+ missing key\(s\).*\(first 10 of \d+\)", message)
    assert re.search(r"\d+ shape mismatch\(es\):", message) and "... and" in message
    assert "Pass config=" in lines[-1]
    print(message)


# -- compile_pipeline: resident vs dlo through pipe(...) -------------------------------------------
@pytest.mark.parametrize("kind", [  # Flux: the README quick start test below
    pytest.param(kind, marks=pytest.mark.spawned.with_args(
        functools.partial(spawn, 1, in_child, dp.compile_pipeline_case, kind)))
    for kind in ("wan", "sd3")])
def test_compile_pipeline_bit_exact_with_cfg_two_resolutions(spawned, kind):
    """`diffusers_pipelines.compile_pipeline_case`, in a forked child: a spawned job
    (tests/conftest.py), so its traces (the pipeline's transformer at two resolutions and
    its text encoders) run beside the in-process tests. A failed check raises there, with
    its traceback."""
    assert spawned == {0: None}


def test_compile_pipeline_rejects_unknown_components_and_options():
    pipe = dp.flux()
    with pytest.raises(ValueError, match=r"components='tokenizer' is a .*not a torch module; "
                                         r"its torch modules: .*transformer"):
        compile_pipeline(pipe, components=["tokenizer"])
    with pytest.raises(ValueError, match=r"components='transfomer' is not a component of "
                                         r"FluxPipeline, not a torch module; did you mean "
                                         r"'transformer'\? its torch modules"):
        compile_pipeline(pipe, components=["transfomer"])
    with pytest.raises(ValueError, match="unknown dlo option 'num_slot'"):
        compile_pipeline(pipe, options={"num_slot": 2})
    assert compile_pipeline(pipe, options={"num_slots": 2}) is pipe  # compiled in place


def test_compile_pipeline_streams_a_vae_named_in_components():
    """A pipeline calls its VAE through ``vae.decode``, which ``module.compile`` does not
    wrap: named in ``components=``, the VAE ran eagerly and kept its weights. Its decoder
    (what a text-to-image call runs) is now streamed, and the image is exact."""
    reference, pipe = dp.flux(), dp.flux()
    compile_pipeline(pipe, components=["vae"], options={"num_slots": 2})
    assert torch.equal(dp.images(pipe, "flux", cfg=False), dp.images(reference, "flux", cfg=False))
    assert all(is_stored(p) for p in pipe.vae.decoder.parameters() if p.numel() > 16)
    assert not any(is_stored(p) for p in pipe.transformer.parameters())  # not named
    # A pipeline's LoRA fusing reaches its text encoders through peft's layers, which
    # write into the base weights in place: refused while a component's are stored.
    for method in ("fuse_lora", "unfuse_lora"):
        with pytest.raises(ValueError, match=rf"cannot call FluxPipeline\.{method}\(\).*"
                                             r"dlo_fx\.release\(model\)"):
            getattr(pipe, method)()


def test_engine_factory_builds_every_component_in_the_dtype_asked(saved):
    """`diffusers_pipeline.build(dtype=...)` (``--pipeline-arg dtype=...``): the streamed
    transformer and every other module in that dtype, without diffusers' deprecation
    warning for ``torch_dtype``."""
    import warnings

    from dlo_fx.apps.engine.diffusers_pipeline import build

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe = build(path=saved["flux"], dtype="float64").pipe
    assert not [w for w in caught if "torch_dtype" in str(w.message)]
    modules = {n: m for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)}
    assert {"transformer", "text_encoder", "text_encoder_2", "vae"} <= modules.keys()
    for name, module in modules.items():
        assert {p.dtype for p in module.parameters()} == {torch.float64}, name
    assert all(is_stored(p) for p in pipe.transformer.parameters())


@pytest.mark.spawned.with_args(
    functools.partial(spawn, 1, in_child, dp.readme_quick_start_case, str(README)))
def test_readme_diffusers_quick_start_runs_and_is_exact(spawned):
    """`diffusers_pipelines.readme_quick_start_case` (both README snippets, and Flux's case
    of the bit-exact CFG check), in a forked child: a spawned job (tests/conftest.py)."""
    assert spawned == {0: None}


# -- serving a saved pipeline ---------------------------------------------------------------------
GENERATE = {"flux": 1, "wan2": 2}
"""The ``dlo-fx generate --diffusers`` runs: saved pipeline -> ``--dp``."""


def _requests(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _generate_rows(kind: str, dp_size: int) -> list[dict]:
    common = dict(height=16, width=16, num_inference_steps=2, negative_prompt="blurry")
    if kind == "flux":
        common.update(true_cfg_scale=2.0, extra_args={"max_sequence_length": 32})
    else:  # a Wan2.2-style pair: one step on each transformer, CFG, 5 frames
        common.update(guidance_scale=3.0, num_frames=5, extra_args={"max_sequence_length": 16})
    return [dict(prompt="a red cat over the tree", seed=1, **common),
            dict(prompt="a blue car under the sun", seed=2, **common)][:dp_size]


def _generate(root: Path, folder: Path, kind: str) -> tuple[int, Path]:
    """``dlo-fx generate --diffusers root`` (``main(argv)`` in this process; the engine
    starts its worker processes): its exit status and output folder."""
    dp_size = GENERATE[kind]
    requests = _requests(folder / "r.jsonl", _generate_rows(kind, dp_size))
    out = folder / "out"
    status = main(["generate", "--diffusers", str(root), "--dp", str(dp_size),
                   "--requests", str(requests), "--out", str(out), "--threads", "1",
                   "--wave-timeout", "400"])
    return status, out


@pytest.fixture(scope="module", autouse=True)
def generated(request, tmp_path_factory):
    """The generate runs this session selected, started in one background thread with the
    module's first test (see the module docstring): kind -> Future of (status, out)."""
    kinds = [kind for kind in GENERATE
             if selected(request, "test_generate_diffusers_matches_resident", kind=kind)]
    if not kinds:
        yield {}
        return
    try:
        saved = request.getfixturevalue("saved")
    except Exception as exc:  # the generate tests fail with it, the others run
        failed: dict[str, Future] = {kind: Future() for kind in kinds}
        for run in failed.values():
            run.set_exception(exc)
        yield failed
        return
    build_parser()  # what main() imports, imported here, not beside the tests' own imports
    jobs = {kind: functools.partial(_generate, saved[kind],
                                    tmp_path_factory.mktemp(f"generate-{kind}"), kind)
            for kind in kinds}
    with background(jobs, "dlo-generate-tests") as runs:
        yield runs


@pytest.mark.parametrize("kind,dp_size", list(GENERATE.items()))
def test_generate_diffusers_matches_resident(saved, generated, kind, dp_size):
    from safetensors.torch import load_file

    from dlo_fx.apps.engine.diffusers_pipeline import resident
    from dlo_fx.apps.engine.png import encode_png
    from dlo_fx.apps.engine.request import Request

    rows = _generate_rows(kind, dp_size)
    status, out = generated[kind].result(timeout=900)
    assert status == 0
    reference = resident(saved[kind])
    results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len({r["dp_rank"] for r in results}) == dp_size
    assert torch.get_num_threads() == 1  # as the workers run (tests/conftest.py)
    expected_all = [reference(Request.from_dict(row)) for row in rows]
    for index, expected in enumerate(expected_all):
        got = load_file(str(out / results[index]["file"]))
        assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k])
                                                     for k in expected)
        pictures = expected.get("images", expected.get("frames"))
        flat = pictures.reshape(-1, *pictures.shape[-3:])
        assert len(results[index]["images"]) == flat.shape[0] == (5 if kind == "wan2" else 1)
        for name, picture in zip(results[index]["images"], flat):
            assert (out / name).read_bytes() == encode_png(picture)
