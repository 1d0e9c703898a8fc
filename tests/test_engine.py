"""The DP wave engine: real worker processes on gloo, outputs checked with torch.equal
against the same request run alone on a resident model in this process."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import zlib

import pytest
import torch

from dlo_fx.engine import Engine, Request, Topology
from dlo_fx.engine.png import encode_png, latents_preview
from dlo_fx.engine.reference_pipeline import resident, write_checkpoint
from dlo_fx.engine.request import plan_waves

PIPELINE = "dlo_fx.engine.reference_pipeline:build"
DIT = dict(width=64, depth=3, heads=4)


def req(prompt: str = "a red fox", seed: int = 0, **kw) -> Request:
    return Request(prompt=prompt, seed=seed, height=64, width=64, num_inference_steps=3, **kw)


def alone(request: Request, **dit) -> torch.Tensor:
    """``request`` run by itself on a resident model, single process, one thread (as the
    workers run)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return resident(**(dit or DIT))(request)
    finally:
        torch.set_num_threads(threads)


# -- before any worker -------------------------------------------------------------------
def test_empty_prompt_is_rejected_up_front():
    for prompt in ("", "   "):
        with pytest.raises(ValueError, match="prompt"):
            Request(prompt=prompt)
    with pytest.raises(ValueError, match="prompt"):
        Request.from_dict({"prompt": "", "seed": 3})
    with pytest.raises(ValueError, match="'colour'"):
        Request.from_dict({"prompt": "x", "colour": "red"})


def test_incompatible_wave_is_rejected_naming_the_fields_before_any_worker():
    engine = Engine(PIPELINE, 2, pipeline_kwargs=DIT)
    with pytest.raises(ValueError, match="height, num_inference_steps") as info:
        engine.run_wave([req(seed=1), Request(prompt="b", height=128, width=64,
                                              num_inference_steps=4)])
    assert "request 1 has height=128, num_inference_steps=4" in str(info.value)
    with pytest.raises(ValueError, match="extra_args"):
        engine.run_wave([req(extra_args={"a": 1}), req(extra_args={"a": 2})])
    with pytest.raises(ValueError, match="at most dp_size=2"):
        engine.run_wave([req(seed=s) for s in range(3)])
    with pytest.raises(ValueError, match="at least one"):
        engine.run_wave([])
    assert engine.generations == 0  # nothing was started
    # request-local fields may differ; extra_args compare as canonical JSON
    assert req("a", 1, extra_args={"x": 1, "y": [1, 2]}).wave_key() == \
        req("b", 2, negative_prompt="n", extra_args={"y": [1, 2], "x": 1}).wave_key()


def test_requests_are_planned_into_waves_of_at_most_dp():
    a, b = req(seed=1), req(seed=2, guidance_scale=3.0)
    assert plan_waves([a, a, a], 2) == [[0, 1], [2]]
    assert plan_waves([a, b, a, b, a], 2) == [[0, 2], [4], [1, 3]]


def test_request_round_trips_and_is_read_only():
    r = req("a cat", 7, extra_args={"k": [1, {"z": None}]}, lora_id="style", fps=24.0)
    assert Request.from_dict(json.loads(json.dumps(r.to_dict()))) == r
    assert pickle.loads(pickle.dumps(r)) == r
    with pytest.raises(TypeError):
        r.extra_args["k"] = 2  # type: ignore[index]


def test_topology_with_sequence_parallel_replicas():
    topo = Topology(dp_size=2, sp_size=2)  # ranks 0,1 = replica 0; ranks 2,3 = replica 1
    assert [topo.dp_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert topo.dp_group(1) == (1, 3) and topo.sp_group(2) == (2, 3)
    assert [topo.replies(r) for r in range(4)] == [True, False, True, False]
    assert [topo.request_index(r, 1) for r in range(4)] == [0, 0, 0, 0]
    assert [topo.request_index(r, 2) for r in range(4)] == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="rank 4"):
        topo.dp_rank(4)


def test_engine_arguments_are_checked():
    with pytest.raises(ValueError, match="package.module:function"):
        Engine("dlo_fx.engine.reference_pipeline", 2)
    with pytest.raises(ValueError, match="cannot be found"):
        Engine("no_such_module_xyz:build", 2)
    with pytest.raises(ValueError, match="num_slot"):
        Engine(PIPELINE, 2, options={"num_slot": 3})
    with pytest.raises(ValueError, match="dp_size"):
        Engine(PIPELINE, 0)


def test_png_preview_is_a_valid_png():
    rgb = latents_preview(torch.randn(4, 8, 8))
    assert rgb.shape == (128, 128, 3) and rgb.dtype == torch.uint8
    data = encode_png(rgb)
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    idat_len = int.from_bytes(data[33:37], "big")
    raw = zlib.decompress(data[41 : 41 + idat_len])
    assert len(raw) == 128 * (1 + 128 * 3) and raw[1:4] == bytes(rgb[0, 0].tolist())


# -- two worker processes ----------------------------------------------------------------
def _expect_failed(results, requests, needle: str, elapsed: float) -> None:
    assert len(results) == len(requests), "every request of the wave gets one result"
    for result, request in zip(results, requests):
        assert result.request is request and result.output is None
        assert not result.ok and needle in result.error, result.error
    assert elapsed < 10, elapsed


def test_waves_are_bit_identical_and_fail_closed():
    with Engine(PIPELINE, 2, pipeline_kwargs=DIT, wave_timeout_s=120) as engine:
        # Two compatible requests with different seeds: one wave, two different outputs,
        # each equal to the request run alone on a resident model.
        pair = [req("a red fox", seed=1), req("a blue bird", seed=2)]
        results = engine.generate(pair)
        assert [r.ok for r in results] == [True, True], [r.error for r in results]
        assert results[0].wave_id == results[1].wave_id
        assert [r.dp_rank for r in results] == [0, 1]
        assert not torch.equal(results[0].output, results[1].output)
        for result, request in zip(results, pair):
            assert torch.equal(result.output, alone(request))
        info = results[1].info
        assert info["host_shard_bytes"] > 0 and info["slot_bytes"] > 0
        pids = {r.dp_rank: r.info["pid"] for r in results}

        # Three requests: two waves; the partial one repeats a request on the spare rank
        # and drops the duplicate.
        three = [req("one", seed=3), req("two", seed=4, guidance_scale=2.0),
                 req("three", seed=5)]
        results = engine.generate(three)
        assert all(r.ok for r in results), [r.error for r in results]
        assert results[0].wave_id == results[2].wave_id != results[1].wave_id
        assert [r.dp_rank for r in results] == [0, 0, 1]
        for result, request in zip(results, three):
            assert torch.equal(result.output, alone(request))
        assert engine.generations == 1

        # A worker raising mid-wave: every request fails, with its message.
        wave = [req("x", seed=6, extra_args={"fault": "raise", "fault_rank": 1}),
                req("y", seed=7, extra_args={"fault": "raise", "fault_rank": 1})]
        start = time.monotonic()
        results = engine.run_wave(wave)
        _expect_failed(results, wave, "injected fault on rank 1 at step 1",
                       time.monotonic() - start)
        check_fresh_workers(engine, generations=2)

        # A worker killed mid-wave: noticed within seconds, not at the wave timeout.
        first = engine.generate([req(seed=8), req(seed=9)])
        pid = first[1].info["pid"]
        assert pid != pids[1]  # a fresh generation
        wave = [req("x", seed=6, extra_args={"fault": "hang", "fault_rank": 0}),
                req("y", seed=7, extra_args={"fault": "hang", "fault_rank": 0})]
        killer = threading.Timer(1.0, os.kill, (pid, signal.SIGKILL))
        killer.start()
        start = time.monotonic()
        results = engine.run_wave(wave)
        killer.join()
        _expect_failed(results, wave, f"(pid {pid}) exited with code -9",
                       time.monotonic() - start)
        check_fresh_workers(engine, generations=3)

        # A wave over its timeout (rank 1 hangs).
        wave = [req("x", seed=6, extra_args={"fault": "hang"})]
        start = time.monotonic()
        results = engine.run_wave(wave, timeout_s=4)
        _expect_failed(results, wave, "timed out after 4 s", time.monotonic() - start)
        check_fresh_workers(engine, generations=4)


def check_fresh_workers(engine: Engine, generations: int) -> None:
    request = req("after the failure", seed=11)
    (result,) = engine.generate([request])
    assert result.ok, result.error
    assert torch.equal(result.output, alone(request))
    assert engine.generations == generations


def test_cli_generates_from_a_checkpoint(tmp_path):
    ckpt = write_checkpoint(tmp_path / "ckpt", width=64, depth=2, heads=4, seed=3)
    requests = [dict(prompt="a red fox", seed=1, height=64, width=64, num_inference_steps=2),
                dict(prompt="a blue bird", seed=2, height=64, width=64, num_inference_steps=2),
                dict(prompt="a cow", seed=3, height=32, width=32, num_inference_steps=2)]
    (tmp_path / "requests.jsonl").write_text("\n".join(json.dumps(r) for r in requests))
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "dlo_fx.engine.cli", "--dp", "2", "--threads", "1",
         "--requests", str(tmp_path / "requests.jsonl"), "--out", str(out),
         "--checkpoint", str(ckpt), "--wave-timeout", "120"],
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "3/3 requests succeeded in 2 wave(s)" in proc.stdout
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["error"] for r in rows] == [None] * 3
    from safetensors.torch import load_file

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pipe = resident(checkpoint=ckpt)
        for row, data in zip(rows, requests):
            latents = load_file(str(out / row["file"]))["output"]
            assert torch.equal(latents, pipe(Request.from_dict(data)))
            assert (out / row["preview"]).read_bytes()[:4] == b"\x89PNG"
    finally:
        torch.set_num_threads(threads)
