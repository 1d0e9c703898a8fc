"""Progress where people wait: ``dlo-fx generate`` on a pseudo-terminal shows a bar per wave,
a bar per denoising step and a line per phase of the first wave; ``--quiet`` (or a stderr
that is no terminal) shows none. ``dlo-fx shard`` shows a bar on a terminal too."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import threading

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TIMEOUT_S = 300
#: a frame of ``dlo-fx shard``'s bar: percentage, count and total, the unit in the rate
SHARD_BAR = re.compile(r"dlo-fx shard: blocks read and written:\s*(\d+)%\|[^|\r\n]*\|\s*"
                       r"(\d+)/(\d+) \[[^\]\r\n]*block/s\]")


def on_terminal(args: list[str], cwd: str) -> tuple[int, str]:
    """Run ``python -m dlo_fx.apps.cli ARGS`` with stdout and stderr on a pseudo-terminal; its
    exit status and everything it wrote there (bounded by `TIMEOUT_S`)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # rows, columns
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, HERE]))
    proc = subprocess.Popen([sys.executable, "-m", "dlo_fx.apps.cli", *args], cwd=cwd, env=env,
                            stdin=subprocess.DEVNULL, stdout=slave, stderr=slave)
    os.close(slave)
    chunks: list[bytes] = []

    def drain() -> None:  # the child blocks on a full terminal otherwise
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every writer closed the terminal
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        status = proc.wait(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    reader.join(timeout=30)
    os.close(master)
    return status, b"".join(chunks).decode("utf-8", "replace")


@pytest.fixture(scope="module")
def requests_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("progress")
    rows = [{"prompt": "a red fox", "seed": s, "height": 64, "width": 64,
             "num_inference_steps": 3} for s in range(2)]
    (folder / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


GENERATE = ["generate", "--requests", "r.jsonl", "--threads", "1", "--pipeline-arg",
            "width=64", "--pipeline-arg", "depth=2", "--pipeline-arg", "heads=4"]


def test_generate_shows_progress_on_a_terminal(requests_file):
    status, shown = on_terminal([*GENERATE, "--out", "out"], str(requests_file))
    assert status == 0, shown
    for what in ("dlo-fx generate: load ", "dlo-fx generate: compile ",
                 "dlo-fx generate: warm-up ", "waves:", "denoising steps:", "2/2"):
        assert what in shown, (what, shown)


def test_generate_quiet_shows_none(requests_file):
    status, shown = on_terminal([*GENERATE, "--out", "quiet", "--quiet"], str(requests_file))
    assert status == 0, shown
    for what in ("dlo-fx generate: load", "waves:", "denoising steps", "%|"):
        assert what not in shown, (what, shown)
    assert "2/2 requests succeeded" in shown


def test_shard_shows_a_bar_on_a_terminal(tmp_path):
    from dlo_fx.apps.engine.reference_pipeline import write_checkpoint

    write_checkpoint(tmp_path / "ckpt", width=64, depth=2, heads=4)
    args = ["shard", str(tmp_path / "ckpt" / "model.safetensors"), "--dp", "2", "--out",
            str(tmp_path / "shards"), "--model", "dlo_fx.apps.models:ReferenceDiT", "--config",
            json.dumps({"width": 64, "depth": 2, "heads": 4})]
    status, shown = on_terminal(args, str(tmp_path))
    assert status == 0, shown
    # tqdm's bar as it draws it on a terminal, once per block read and written:
    # "dlo-fx shard: blocks read and written:  50%|#####     | 4/8 [00:00<00:00, 9.1block/s]"
    frames = SHARD_BAR.findall(shown)
    assert frames, shown
    blocks = json.loads((tmp_path / "shards" / "dlo-shards.json").read_text())["blocks"]
    assert blocks > 0
    total = 2 * blocks  # each block read (fingerprinted), then written
    assert {int(t) for _, _, t in frames} == {total}, frames
    counts = [int(n) for _, n, _ in frames]
    assert counts == sorted(counts) and sorted(set(counts)) == list(range(total + 1)), counts
    for percent, n, _ in frames:
        assert abs(int(percent) - 100 * int(n) / total) <= 0.5, (percent, n, total)
