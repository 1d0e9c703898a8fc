"""``dlo-fx generate --pipeline module:function`` imports the module from the current folder."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from dlo_fx.apps.cli import main
from dlo_fx.apps.engine import Request
from dlo_fx.apps.engine.reference_pipeline import resident


def test_pipeline_module_from_the_current_folder(tmp_path, monkeypatch):
    app = tmp_path / "app"
    app.mkdir()
    (app / "my_factory.py").write_text(
        "from dlo_fx.apps.engine.reference_pipeline import build\n\n"
        "def factory(options, **kw):\n"
        "    return build(options, width=64, depth=2, heads=4)\n")
    row = {"prompt": "a red fox", "seed": 3, "height": 64, "width": 64,
           "num_inference_steps": 2}
    (app / "r.jsonl").write_text(json.dumps(row) + "\n")
    monkeypatch.chdir(app)
    assert main(["generate", "--pipeline", "my_factory:factory", "--requests", "r.jsonl",
                 "--out", "out", "--threads", "1"]) == 0
    got = load_file(str(app / "out" / "0000.safetensors"))["output"]
    assert torch.equal(got, resident(width=64, depth=2, heads=4)(Request.from_dict(row)))
