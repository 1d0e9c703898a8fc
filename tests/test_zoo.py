"""The diffusers zoo: transformer classes built from tiny configs, streamed.

Spawns of two gloo ranks run the models of `zoo_models.ZOO` (with ``DLO_FX_ZOO=all``, as
`make zoo` sets it, also those of `zoo_more.MORE`: the rest of the release's transformer
classes and their cache and conditioning variants), a group of them per spawn:
dp=1 (each rank alone on its share of the group), then dp=2 in allgather mode (with
``DLO_FX_ZOO=all`` in both modes), two calls each, ``resident_bytes=0``. `make test` leaves
dp=2 rank-local to `make zoo`: there the shard group is one rank, so each rank computes
what the dp=1 case computes, and the agreement between the ranks on the model's blocks
and fingerprints, the one thing it adds, is the allgather case's too. Each model must be bit-identical (`torch.equal`) to its
resident twin on every call and stream at least half of its parameter bytes (counted
from the runtime's host store). Each group's spawn is a job of tests/conftest.py: it runs
in the background while the in-process tests of the suite run, and the group's tests check
its results.

``DLO_FX_ZOO_TABLE=docs/zoo.md make zoo`` also writes the table of the run
(model x dp x mode: exact, blocks, share streamed) and its timings.
"""

from __future__ import annotations

import functools
import os
import time

import pytest

import zoo_cases
from distributed import spawn
from zoo_models import ZOO

WORLD = 2
GROUP = 4  # models per spawn: a hang or a crash loses one group, not the zoo
# The models issue #13 names first (graph breaks, dual and single stream), then the rest.
FIRST = ["Mochi", "HiDream", "HunyuanVideo15", "Sana", "Flux", "Wan", "SD3", "CogVideoX", "LTX",
         "PixArt", "Lumina2", "Allegro", "HunyuanVideo", "Chroma", "QwenImage", "Cosmos",
         "SkyReelsV2"]
NAMES = FIRST + [m.name for m in ZOO if m.name not in FIRST]
MODES = ("allgather",)  # at dp=2
if os.environ.get("DLO_FX_ZOO") == "all":
    from zoo_more import MORE

    NAMES += [m.name for m in MORE]
    MODES = zoo_cases.MODES
GROUPS = [tuple(NAMES[i : i + GROUP]) for i in range(0, len(NAMES), GROUP)]


class Zoo:
    """Results per (model, dp, mode[, rank]) of the groups run so far, and their timings."""

    def __init__(self) -> None:
        self.results: dict = {}
        self.cpu = [0.0] * WORLD
        self.wall = 0.0

    def run(self, group: tuple[str, ...]) -> dict:
        """Spawn the ranks for ``group``; its results. A job of tests/conftest.py: the jobs
        run one after another on one thread, so the totals need no lock."""
        start = time.monotonic()
        # Collectives wait for the slower rank's compile: generous on a loaded machine.
        per_rank = spawn(WORLD, zoo_cases.zoo_cases, group, 600.0, MODES, timeout=1800.0)
        self.wall += time.monotonic() - start
        results = {}
        for rank in range(WORLD):
            for key, result in per_rank[rank].items():
                self.cpu[rank] += result["cpu_seconds"]
                if key[1] == WORLD and rank != 0:
                    key = (*key, rank)  # dp=2 seen from the other rank, checked too
                results[key] = result
        self.results.update(results)
        if os.environ.get("DLO_FX_ZOO_TABLE"):  # rewritten after every group
            self.write_table(os.environ["DLO_FX_ZOO_TABLE"])
        return results

    def write_table(self, path: str) -> None:
        rows = {k: v for k, v in self.results.items() if len(k) == 3}
        text = (
            "# The diffusers zoo\n\n"
            "Written by `DLO_FX_ZOO_TABLE=docs/zoo.md make zoo` from its run "
            "(never by hand).\nEach cell: bit-identical to the resident model on both calls "
            "(`exact`) or the largest absolute\ndifference, or the error raised; the number "
            "of host blocks; the share of parameter bytes\nstreamed with `resident_bytes=0`. "
            "At dp=1 one rank has nothing to gather, so the `allgather`\noption runs "
            "rank-local too (the zoo alternates the two options at dp=1). dp=2 cells are\n"
            "rank 0's; rank 1 is checked by the test as well.\n\n"
            + zoo_cases.table(rows, WORLD)
            + f"\n{len({k[0] for k in rows})} of {len(NAMES)} models in {len(GROUPS)} spawns "
            f"of {WORLD} gloo ranks: {self.wall:.0f} s wall; CPU time per rank "
            f"{', '.join(f'{c:.0f} s' for c in self.cpu)}.\n"
        )
        with open(path, "w") as f:
            f.write(text)


RUNS = Zoo()
#: One job per group, shared by the group's tests (tests/conftest.py runs the jobs).
JOBS = {group: functools.partial(RUNS.run, group) for group in GROUPS}


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.spawned.with_args(JOBS[group]))
    for group in GROUPS for name in group])
def test_zoo_model_is_exact_and_streams(spawned: dict, name: str) -> None:
    cases = {k: v for k, v in spawned.items() if k[0] == name}
    # dp=1, and dp=2 from both ranks in each mode
    assert len(cases) == 1 + len(MODES) * WORLD, sorted(cases)
    failures = []
    for key, r in cases.items():
        if r["error"]:
            failures.append(f"{key}: raised {r['error']}")
            continue
        if not r["exact"]:
            failures.append(f"{key}: not bit-identical (max |diff| {r['max_abs_diff']:.3g})")
        if r["streamed_bytes"] * 2 < r["param_bytes"] or not r["stored"]:
            failures.append(f"{key}: streamed {r['streamed_bytes']} of {r['param_bytes']} B")
        if r["runtimes"] != 1:
            failures.append(f"{key}: its parameters are held by {r['runtimes']} runtimes")
        dp, mode = key[1], key[2]
        want = (dp, mode) if dp > 1 and mode == "allgather" else (1, "rank_local")
        if (r["dp"], r["mode"]) != want:
            failures.append(f"{key}: ran as dp={r['dp']} mode={r['mode']}")
    assert not failures, "\n".join(failures)
