"""Re-make the pictures of docs/schedule.md: ``python docs/img/make_images.py``.

Runs ``dlo-fx dump`` on the reference DiT with the settings each section of the page
discusses, and converts each ``timeline.svg`` to PNG with ``rsvg-convert`` (Debian/Ubuntu
package ``librsvg2-bin``). The allgather picture runs two CPU ranks on gloo. Every
picture is predicted from block bytes (``--no-trace``), so it does not depend on the
machine that makes it.
"""

from __future__ import annotations

import datetime
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
MODEL = ["--layers", "6", "--width", "512", "--heads", "8", "--no-trace"]

PICTURES = {
    "copy-bound.png": MODEL,
    "compute-bound.png": MODEL + ["--compute-gbps", "20"],
    "resident.png": MODEL + ["--resident-bytes", "1600000"],
    "small-blocks.png": MODEL + ["--block-bytes", "3000000"],
    "three-slots.png": MODEL + ["--slots", "3", "--compute-gbps", "20"],
}


def render(svg: Path, png: Path) -> None:
    subprocess.run(["rsvg-convert", "--background-color", "white", str(svg), "-o", str(png)],
                   check=True)
    print(f"{png.name}: {png.stat().st_size // 1024} KiB")


def dump(args: list[str], out: Path) -> Path:
    subprocess.run([sys.executable, "-m", "dlo_fx.apps.dump.cli", "--out", str(out), *args],
                   check=True, stdout=subprocess.DEVNULL)
    return out / "graph_0" / "timeline.svg"


def _rank(rank: int, world: int, init: str, out: str) -> None:
    from dlo_fx.apps.dump.cli import add_dump_arguments, run_dump
    import argparse

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    args = add_dump_arguments(argparse.ArgumentParser()).parse_args(
        MODEL + ["--mode", "allgather", "--calls", "1", "--out", out])
    run_dump(args)
    dist.destroy_process_group()


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for name, args in PICTURES.items():
            render(dump(args, Path(tmp) / name), HERE / name)
        out = Path(tmp) / "allgather"
        init = "file://" + str(Path(tmp) / "rendezvous")
        mp.spawn(_rank, args=(2, init, str(out)), nprocs=2)
        render(out / "rank_0" / "graph_0" / "timeline.svg", HERE / "allgather.png")


if __name__ == "__main__":
    if shutil.which("rsvg-convert") is None:
        sys.exit("rsvg-convert not found: install librsvg2-bin")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
