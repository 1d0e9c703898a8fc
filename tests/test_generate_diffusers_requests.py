"""``dlo-fx generate --diffusers`` as a new pipeline author meets it: a request outside
what the pipeline serves is refused up front, naming the field; a request the pipeline's
own ``check_inputs`` refuses fails alone among good ones, and no worker restarts."""

from __future__ import annotations

import json

import pytest
import torch

import diffusers_pipelines as dp
from dlo_fx.apps.cli import main
from dlo_fx.apps.engine.request import Request


@pytest.fixture(scope="module")
def flux_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("generate") / "flux"
    dp.flux().save_pretrained(root)
    return root


def _generate(root, folder, rows, dp_size, capsys) -> tuple[int, str]:
    requests = folder / "r.jsonl"
    requests.write_text("".join(json.dumps(r) + "\n" for r in rows))
    status = main(["generate", "--diffusers", str(root), "--dp", str(dp_size), "--requests",
                   str(requests), "--out", str(folder / "out"), "--threads", "1",
                   "--wave-timeout", "300", "--quiet"])
    return status, capsys.readouterr().err


COMMON = dict(height=16, width=16, num_inference_steps=2, negative_prompt="blurry",
              true_cfg_scale=2.0)


def test_request_outside_the_limits_refused_up_front(flux_root, tmp_path, capsys):
    rows = [dict(prompt="a red cat", **COMMON), dict(prompt="a video", num_frames=5, **COMMON)]
    status, err = _generate(flux_root, tmp_path, rows, 1, capsys)
    lines = err.strip().splitlines()
    assert status == 2 and len(lines) == 1, err
    assert lines[0].startswith("dlo-fx generate: request 1: Request.num_frames=5 is not "
                               "allowed"), err
    assert not (tmp_path / "out").exists()  # refused before any wave


def test_sizes_no_memory_holds_refused_before_any_worker_starts(flux_root, tmp_path, capsys,
                                                                monkeypatch):
    """A height that overflows and a 4 TiB image failed in a worker after the model
    loaded; refused now before any worker starts, naming the field and the limit."""
    from dlo_fx.apps.engine.engine import Engine

    def started(*args, **kwargs):
        raise AssertionError("a worker started")

    monkeypatch.setattr(Engine, "start", started)
    for size in (dict(height=10**30, width=16), dict(height=2**20, width=2**20)):
        rows = [dict(prompt="a red cat", num_inference_steps=2), dict(prompt="a cat", **size)]
        status, err = _generate(flux_root, tmp_path, rows, 1, capsys)
        assert status == 2, err
        assert err.startswith(f"dlo-fx generate: request 1: Request.height={size['height']} "
                              "is not allowed: 1 output(s) of 1 frame(s)"), err
        assert "this pipeline serves at most" in err and ", height at most " in err, err
    assert not (tmp_path / "out").exists()


def test_a_loaded_pipeline_bounds_pixels_by_its_denoisers_width(flux_root):
    """The workers' limits add the denoiser's hidden states (tokens x its width) on their
    device to the images' bytes."""
    import dataclasses

    from dlo_fx.apps.engine.diffusers_pipeline import (DiffusersPipeline, memory_limits,
                                                       pipeline_limits)

    pipe = dp.flux()
    limits = DiffusersPipeline(pipe).limits
    width = pipe.transformer.config.num_attention_heads * pipe.transformer.config.attention_head_dim
    assert 0 < limits.max_pixels <= memory_limits("cpu").max_pixels
    pipe.transformer.register_to_config(attention_head_dim=10**9)  # a very wide denoiser
    wide = pipeline_limits(pipe, DiffusersPipeline(pipe)._params)
    assert wide.max_pixels < limits.max_pixels and width < 10**9
    request = dataclasses.replace(Request(prompt="a cat"), height=2**14, width=2**14)
    with pytest.raises(ValueError, match=r"Request\.height=16384 is not allowed"):
        wide.check(request)


def test_refused_request_fails_alone_among_good_ones(flux_root, tmp_path, capsys):
    from safetensors.torch import load_file

    from dlo_fx.apps.engine.diffusers_pipeline import resident
    from dlo_fx.apps.engine.request import Request

    short = {"max_sequence_length": 32}
    rows = [dict(prompt="a red cat over the tree", seed=1, extra_args=short, **COMMON),
            dict(prompt="a blue car", seed=2, extra_args={"max_sequence_length": 1000},
                 **COMMON),
            dict(prompt="a blue car under the sun", seed=3, extra_args=short, **COMMON)]
    status, err = _generate(flux_root, tmp_path, rows, 2, capsys)
    assert status == 1, err
    results = [json.loads(line)
               for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert [r["error"] is None for r in results] == [True, False, True]
    assert "max_sequence_length` cannot be greater than 512" in results[1]["error"]
    assert len({r["pid"] for r in results if r["dp_rank"] == 0}) == 1  # no restart
    reference = resident(flux_root)
    for index in (0, 2):
        got = load_file(str(tmp_path / "out" / results[index]["file"]))
        expected = reference(Request.from_dict(rows[index]))
        assert torch.equal(got["images"], expected["images"])


def test_true_cfg_requests_with_and_without_a_negative_prompt_share_no_wave(flux_root, tmp_path,
                                                                              capsys):
    """With ``true_cfg_scale > 1`` Flux runs a negative pass only when given a negative
    prompt: such requests and requests without one go in separate waves (a shared wave ran
    twice the forwards on one rank and failed closed at its timeout), and all are exact."""
    from safetensors.torch import load_file

    from dlo_fx.apps.engine.diffusers_pipeline import resident
    from dlo_fx.apps.engine.request import Request

    cfg = dict(height=16, width=16, num_inference_steps=2, true_cfg_scale=2.0)
    rows = [dict(prompt="a red cat", seed=1, negative_prompt="blurry", **cfg),
            dict(prompt="a blue car", seed=2, **cfg),
            dict(prompt="a green tree", seed=3, negative_prompt="dark", **cfg)]
    status, err = _generate(flux_root, tmp_path, rows, 2, capsys)
    assert status == 0, err
    results = [json.loads(line)
               for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert [r["error"] for r in results] == [None] * 3
    assert results[0]["dp_rank"] != results[2]["dp_rank"]  # one wave: the two given
    reference = resident(flux_root)
    for index, row in enumerate(rows):
        got = load_file(str(tmp_path / "out" / results[index]["file"]))
        assert torch.equal(got["images"], reference(Request.from_dict(row))["images"])
