"""The ``dlo-fx`` command as a new user meets it: ``dlo-fx shard ROOT --subfolder
transformer`` on a saved diffusers pipeline, and every error one line without a traceback
(``-v`` shows it)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import diffusers_pipelines as dp
from dlo_fx.loading.loader import load
from loader_cases import fresh, stored_state

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def dlo_fx_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, HERE]))
    return subprocess.run([sys.executable, "-m", "dlo_fx.apps.cli", *args], env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def pipeline_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli") / "flux"
    pipe = dp.flux()
    pipe.save_pretrained(root)
    return root, pipe.transformer


def test_shard_subfolder_of_a_pipeline_folder(pipeline_folder, tmp_path):
    from diffusers import FluxTransformer2DModel

    root, transformer = pipeline_folder
    out = tmp_path / "shards"
    done = dlo_fx_cli("shard", str(root), "--subfolder", "transformer", "--dp", "1",
                      "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "dp=1" in done.stdout
    fresh()
    model = load(FluxTransformer2DModel, str(out))  # config.json copied beside the shards
    state, expected = stored_state(model), transformer.state_dict()
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[k], expected[k]) for k in expected)


def test_errors_are_one_line_unless_verbose(pipeline_folder, tmp_path):
    root, _ = pipeline_folder
    done = dlo_fx_cli("shard", str(root), "--dp", "1", "--out", str(tmp_path / "x"))
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith("dlo-fx shard: ") and "--subfolder" in lines[0]
    assert "'transformer'" in lines[0] and "Traceback" not in done.stderr
    done = dlo_fx_cli("shard", str(root), "--subfolder", "nope", "--dp", "1",
                      "--out", str(tmp_path / "x"))
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "has no subfolder 'nope'" in done.stderr
    verbose = dlo_fx_cli("shard", str(root), "--dp", "1", "--out", str(tmp_path / "x"), "-v")
    assert verbose.returncode != 0 and "Traceback" in verbose.stderr
    assert "CheckpointError" in verbose.stderr
