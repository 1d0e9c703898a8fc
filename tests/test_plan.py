"""`dlo_fx.plan`: a model planned on the meta device for hardware it does not run on gives
the blocks, bytes, FLOPs and resident choice the run itself makes (real diffusers
classes with tiny configs; no weights where the plan needs none)."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
from torch import nn

import dlo_fx
from dlo_fx.apps.plan import HARDWARE, Hardware
from dlo_fx.runtime.weights.owners import runtimes_holding
from models import tiny_flux, tiny_wan

GIB = 1 << 30
TOY = Hardware("toy", h2d_gbps=1.0, gather_gbps=1.0, flops_per_s={"float32": 1e10},
               memory_bytes=64 << 20)


def _meta_copy(model: nn.Module) -> nn.Module:
    """The same architecture on the meta device, no weights (as one built from its config
    under ``torch.device("meta")``)."""
    return copy.deepcopy(model).to("meta")


def _meta_inputs(inputs):
    if isinstance(inputs, dict):
        return {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    return tuple(v.to("meta") for v in inputs)


def _host_blocks(model) -> set[tuple[str, ...]]:
    (runtime,) = runtimes_holding(list(model.parameters()))
    return {tuple(b.fqns) for b in runtime.store.blocks}


@pytest.mark.parametrize("make", [tiny_flux, tiny_wan], ids=["flux", "wan"])
def test_plan_on_meta_gives_the_blocks_offload_makes_on_meta_and_on_the_cpu(make):
    model, inputs = make()
    options = {"block_bytes": 20_000}
    planned = dlo_fx.plan(_meta_copy(model), _meta_inputs(inputs), hardware=TOY,
                          options=options)
    on_meta = dlo_fx.offload(copy.deepcopy(model), {**options, "device": "meta"})
    on_cpu = dlo_fx.offload(model, {**options, "device": "cpu"})
    assert planned.num_blocks > 3
    assert set(planned.blocks) == _host_blocks(on_meta) == _host_blocks(on_cpu)
    (runtime,) = runtimes_holding(list(on_cpu.parameters()))
    assert planned.host_bytes == runtime.store.host_bytes
    assert planned.slot_bytes == runtime.slots.total_bytes > 0
    assert planned.block_bytes == [sum(t.numel() * t.element_size() for n, t in
                                       on_cpu.named_parameters() if n in b)
                                   for b in planned.blocks]
    dlo_fx.release(on_meta)
    dlo_fx.release(on_cpu)


def test_plan_counts_the_flops_and_chooses_the_resident_blocks_the_compile_does(tmp_path):
    """The compile on the meta device with the same figures (a declared device_memory, the
    same rates) plans the same FLOPs per block and keeps the same blocks resident."""
    from dlo_fx.runtime import probes

    resident_set = importlib.import_module("dlo_fx.planning.stages.resident_set")
    model, inputs = tiny_flux()
    memory = GIB + 150_000  # the margin, and room for some of the blocks
    hw = Hardware("toy", h2d_gbps=1.0, gather_gbps=1.0, flops_per_s={"float32": 1e10},
                  memory_bytes=memory)
    options = {"block_bytes": 20_000, "activation_reserve_bytes": 0}
    planned = dlo_fx.plan(_meta_copy(model), _meta_inputs(inputs), hardware=hw,
                          options=options)
    patch = pytest.MonkeyPatch()
    try:
        patch.setattr(probes, "probe_bandwidths", lambda device, group, nbytes=0: (1.0, 1.0))
        patch.setattr(probes, "probe_matmul_flops", lambda device, dtype, group: 1e10)
        patch.setattr(resident_set, "probed_flops", lambda view, dtype: 1e10)
        streamed = dlo_fx.offload(model, {**options, "device": "meta",
                                          "device_memory": memory})
        compiled = torch.compile(streamed, backend="dlo", options={"dump_dir": str(tmp_path)})
        for _ in range(2):  # the first call streams every block, the second is planned
            compiled(**_meta_inputs(inputs))
    finally:
        patch.undo()
    (runtime,) = runtimes_holding(list(streamed.parameters()))
    (compile_plan,) = runtime.budget_plans.values()
    assert compile_plan.flops == planned.flops and sum(planned.flops) > 0
    assert compile_plan.fqns == [list(b) for b in planned.graph_blocks]
    assert compile_plan.compute_s == planned.compute_s
    assert compile_plan.resident == planned.resident_blocks
    assert 0 < len(planned.resident_blocks) < planned.num_blocks
    # the meta device measures nothing, and its compile does not say it did
    assert compile_plan.figures.startswith("meta device's")
    from dlo_fx.apps.dump.blocks_md import _resident_blocks
    assert "measured" not in "\n".join(_resident_blocks(compile_plan))
    # the auto budget's variant is dumped as a variant of graph 0, not as a graph 1
    variant = f"budget_{len(planned.resident_blocks)}_of_{planned.num_blocks}_resident"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["graph_0"]
    assert (tmp_path / "graph_0" / variant / "timeline.svg").is_file()
    assert "(device_budget variant)" in (tmp_path / "graph_0" / variant / "timeline.svg").read_text()
    (memory,) = runtime.device_memory.values()
    assert memory.peaks.found_as.startswith("0: the meta device has no allocator")
    dlo_fx.release(streamed)


def test_flops_and_activations_grow_with_the_resolution():
    model, _ = tiny_flux()
    meta = _meta_copy(model)

    def at(side: int):
        tokens = side * side
        kwargs = dict(hidden_states=torch.empty(1, tokens, 16, device="meta"),
                      encoder_hidden_states=torch.empty(1, 6, 32, device="meta"),
                      pooled_projections=torch.empty(1, 32, device="meta"),
                      timestep=torch.empty(1, device="meta"),
                      img_ids=torch.empty(tokens, 3, device="meta"),
                      txt_ids=torch.empty(6, 3, device="meta"), return_dict=False)
        return dlo_fx.plan(meta, kwargs, hardware=TOY)

    small, large = at(4), at(16)
    assert small.blocks == large.blocks
    assert sum(large.flops) > 10 * sum(small.flops) > 0
    assert large.activation_peak > 10 * small.activation_peak > 0


def test_activation_peak_is_the_live_bytes_of_the_forward():
    """Two linear layers on (8, 64) float32 with a ReLU between: the peak is at the ReLU,
    its input and output (8, 256) alive together (the second layer's output (8, 64) comes
    after the first is freed); the weights and the input are not counted."""
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)).to("meta")
    planned = dlo_fx.plan(model, torch.empty(8, 64, device="meta"), hardware=TOY,
                          options={"device_budget": None})
    assert planned.activation_peak == 2 * 8 * 256 * 4
    assert sum(planned.flops) == 2 * 8 * 64 * 256 * 2


def test_a_real_model_is_planned_without_being_changed():
    model, inputs = tiny_flux()
    before = {n: t.clone() for n, t in model.state_dict().items()}
    planned = dlo_fx.plan(model, inputs, hardware="h200")
    assert planned.num_blocks >= 1
    after = model.state_dict()
    assert all(not t.is_meta and torch.equal(t, before[n]) for n, t in after.items())


def test_hardware_presets_and_declared_hardware():
    assert {"h100-pcie", "h100-sxm", "h200", "b200", "b300", "a100-80gb", "l40s", "rtx-4090",
            "ascend-910b3"} <= set(HARDWARE)
    for hw in HARDWARE.values():
        for field in ("h2d_gbps", "gather_gbps", "memory_bytes", "flops_per_s.bfloat16"):
            assert hw.source(field) != "given", (hw.name, field)
    model, inputs = tiny_flux()
    meta, kwargs = _meta_copy(model), _meta_inputs(inputs)
    assert dlo_fx.plan(meta, kwargs, hardware="H100 SXM").hardware is HARDWARE["h100-sxm"]
    with pytest.raises(ValueError, match="did you mean 'h200'"):
        dlo_fx.plan(meta, kwargs, hardware="h20O")
    declared = dlo_fx.plan(meta, kwargs, hardware={"h2d_gbps": 10.0, "gather_gbps": 20.0,
                                                   "flops_per_s": {"float32": 1e12},
                                                   "memory_bytes": 8 * GIB})
    text = str(declared)
    assert "measured" not in text.replace("nothing here is measured", "")
    with pytest.raises(ValueError, match=r"no FLOP rate for it .*flops_per_s\['float32'\]"):
        dlo_fx.plan(meta, kwargs, hardware=Hardware("bf16-only", 1.0, 1.0,
                                                    {"bfloat16": 1e12}, GIB))
    with pytest.raises(ValueError, match="memory_bytes"):
        Hardware("bad", 1.0, 1.0, {"float32": 1.0}, 0)
    with pytest.raises(ValueError, match=r"needs flops_per_s, memory_bytes \(it was given "
                                         r"gather_gbps, h2d_gbps\)"):
        dlo_fx.plan(meta, kwargs, hardware={"h2d_gbps": 1.0, "gather_gbps": 1.0})


def test_copies_without_a_lane_of_their_own_add_to_the_step():
    """A CPU computing on every core copies in turn with its matmuls ([Note: a copy lane of
    its own]): the step is the compute plus every streamed block's copy, where a device's
    copy engine hides them behind compute."""
    from dlo_fx.apps.plan import cpu_copies_overlap

    model, inputs = tiny_flux()
    meta, kwargs = _meta_copy(model), _meta_inputs(inputs)
    fields = dict(h2d_gbps=0.01, gather_gbps=1.0, flops_per_s={"float32": 1e9},
                  memory_bytes=GIB)
    options = {"block_bytes": 20_000, "device_budget": None}
    beside = dlo_fx.plan(meta, kwargs, hardware=Hardware("engine", **fields), options=options)
    serial = dlo_fx.plan(meta, kwargs, hardware=Hardware("cpu", **fields, copies_overlap=False),
                         options=options)
    assert serial.num_blocks > serial.num_slots and not serial.resident_blocks
    assert serial.predicted_step_s == pytest.approx(sum(serial.compute_s) + sum(serial.h2d_s))
    assert max(sum(beside.compute_s), sum(beside.h2d_s)) <= beside.predicted_step_s
    assert beside.predicted_step_s < serial.predicted_step_s
    assert "copies run in turn with compute" in str(serial)
    assert "copies run in turn" not in str(beside)
    with pytest.raises(ValueError, match="copies_overlap='no' is not allowed"):
        Hardware("bad", copies_overlap="no", **fields)
    assert not cpu_copies_overlap(threads=2, cores=2) and cpu_copies_overlap(threads=1, cores=2)


def test_auto_budget_plans_residency_for_the_targets_memory():
    model, inputs = tiny_flux()
    meta, kwargs = _meta_copy(model), _meta_inputs(inputs)
    small = Hardware("small", 1.0, 1.0, {"float32": 1e10}, memory_bytes=GIB + 150_000)
    large = Hardware("large", 1.0, 1.0, {"float32": 1e10}, memory_bytes=2 * GIB)
    options = {"block_bytes": 20_000}
    few = dlo_fx.plan(meta, kwargs, hardware=small, options=options)
    every = dlo_fx.plan(meta, kwargs, hardware=large, options=options)
    assert 0 < len(few.resident_blocks) < few.num_blocks
    assert len(every.resident_blocks) == every.num_blocks and every.bound == "compute"
    assert every.predicted_step_s < few.predicted_step_s <= few.streamed_step_s
    d = few.device_bytes
    assert d["total"] == (d["slots"] + d["resident parameters"] + d["resident blocks"]
                          + d["activation peak"])
    tiny = Hardware("tiny", 1.0, 1.0, {"float32": 1e10}, memory_bytes=100_000)
    cramped = dlo_fx.plan(meta, kwargs, hardware=tiny, options=options)
    assert not cramped.fits and "does not fit" in str(cramped)


def test_dp_shares_the_host_bytes_and_gathers():
    model, inputs = tiny_flux()
    meta, kwargs = _meta_copy(model), _meta_inputs(inputs)
    one = dlo_fx.plan(meta, kwargs, hardware=TOY, options={"device_budget": None})
    two = dlo_fx.plan(meta, kwargs, hardware=TOY, options={"device_budget": None}, dp=2)
    assert two.mode == "allgather" and one.mode == "rank_local"
    assert two.host_bytes < 0.6 * one.host_bytes
    assert sum(two.gather_s) > 0 == sum(one.gather_s)


def test_plan_writes_its_dump_labelled_predicted(tmp_path):
    model, inputs = tiny_flux()
    planned = dlo_fx.plan(_meta_copy(model), _meta_inputs(inputs), hardware="h200",
                          options={"block_bytes": 20_000, "device_budget": None})
    folder = planned.write(tmp_path / "plan")
    names = {p.name for p in (tmp_path / "plan").iterdir()}
    assert str(tmp_path / "plan") == folder
    assert {"blocks.md", "schedule.txt", "timeline.svg", "plan.txt"} <= names
    md = (tmp_path / "plan" / "blocks.md").read_text()
    assert md.startswith("# Plan for h200 (predicted)") and "Measured stalls" not in md
    assert "from the h200 preset's figures" in md
    svg = (tmp_path / "plan" / "timeline.svg").read_text()
    assert "dlo plan (predicted)" in svg and "measured" not in svg.replace("nothing measured", "")
    assert (tmp_path / "plan" / "schedule.txt").read_text().count("prefetch b") >= planned.num_blocks


# -- dlo-fx plan --model ---------------------------------------------------------------------
TINY_FLUX = dict(_class_name="FluxTransformer2DModel", patch_size=1, in_channels=16,
                 num_layers=2, num_single_layers=2, attention_head_dim=16,
                 num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
                 guidance_embeds=True, axes_dims_rope=[4, 4, 8])
TINY_WAN = dict(_class_name="WanTransformer3DModel", patch_size=[1, 2, 2],
                num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
                text_dim=32, freq_dim=32, ffn_dim=64, num_layers=3, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", rope_max_seq_len=32)


def _cli(capsys, *argv) -> tuple[int, str]:
    from dlo_fx.apps.cli import main

    status = main(["plan", *argv])
    captured = capsys.readouterr()
    return status, captured.out + captured.err


def test_cli_plans_a_model_from_its_config(tmp_path, capsys):
    import json

    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text(json.dumps(TINY_FLUX))
    status, text = _cli(capsys, "--model", "diffusers:FluxTransformer2DModel", "--config",
                        str(tmp_path), "--hardware", "rtx-4090", "--height", "128", "--width",
                        "128", "--text-tokens", "8", "--device-memory", "1.5GiB",
                        "--out", str(tmp_path / "dump"))
    assert status == 0, text
    assert "dlo plan of FluxTransformer2DModel for rtx-4090" in text
    assert "device memory         1.50 GiB (1,610,612,736 B)" in text
    assert "hidden_states=(1, 64, 16) bfloat16" in text and "guidance=(1,)" in text
    assert (tmp_path / "dump" / "timeline.svg").is_file()
    status, text = _cli(capsys, "--model", "diffusers:FluxTransformer2DModel", "--config",
                        str(tmp_path), "--device-memory", "24 parsecs")
    assert status == 2 and "--device-memory '24 parsecs' is not a size" in text
    status, text = _cli(capsys, "--model", "diffusers:UNet2DModel", "--config", str(tmp_path))
    assert status == 2 and "no inputs are known for UNet2DModel" in text
    status, text = _cli(capsys, "--model", "diffusers:FluxTransformer2DModel", "--config",
                        str(tmp_path), "--block-compute-ms", "5", "--json")
    assert status == 2 and ("--block-compute-ms, --json are for the number-only mode; with "
                            "--model") in text


def test_cli_plans_wan_with_frames(tmp_path, capsys):
    import json

    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_WAN))
    flops = []
    for frames in ("5", "13"):
        status, text = _cli(capsys, "--model", "diffusers:WanTransformer3DModel", "--config",
                            str(config), "--height", "64", "--width", "64", "--frames", frames,
                            "--text-tokens", "8", "--dp", "2", "--hardware", "h100-sxm")
        assert status == 0, text
        assert "dp=2, mode allgather" in text
        flops.append(int(text.split("FLOPs per step")[1].split("(")[1].split(")")[0]
                         .replace(",", "")))
    assert "hidden_states=(1, 4, 4, 8, 8) bfloat16" in text
    assert flops[1] > 2 * flops[0] > 0


def test_cli_number_mode_flags_its_placeholders(capsys):
    status, text = _cli(capsys, "--model-gb", "23.8", "--blocks", "57")
    assert status == 0, text
    assert ("placeholder: block_compute_ms = 50 ms is a placeholder (generic_block_compute_ms, "
            "assumed); give --block-compute-ms, or plan a real model with --model") in text
    status, text = _cli(capsys, "--model-gb", "23.8", "--blocks", "57", "--block-compute-ms",
                        "12", "--h2d-gbps", "50", "--gather-gbps", "100")
    assert status == 0 and "placeholder" not in text
    status, text = _cli(capsys, "--model-gb", "23.8", "--blocks", "57", "--hardware", "h200",
                        "--height", "512")
    assert status == 2 and "--hardware, --height need --model" in text


def test_gpu_check_prints_the_plans_prediction_beside_each_measured_row():
    """benchmarks/gpu_check.py's printing path, on a result as a run writes it."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import gpu_check

    cfg = gpu_check.sizes(True, 5)
    label = cfg.resolutions[0].label
    variants = {"resident": {"step_ms": 2.0}, "dlo 2 slots": {"step_ms": 4.0},
                "dlo auto budget": {"step_ms": 3.0}, "group offload": {"step_ms": 9.0}}
    result = {"flux": {"weight_bytes": 10_000_000, "resolutions": {label: {"variants": variants}}}}
    hardware, note = gpu_check.plan_hardware(None, "NVIDIA H200")
    assert hardware == "h200" and gpu_check.plan_hardware(None, "NVIDIA H100 PCIe")[0] == "h100-pcie"
    checks = gpu_check.Checks(apply_targets=False)
    gpu_check.add_predictions(result, cfg, hardware, note, checks)
    assert checks.failures == []
    for name in ("resident", "dlo 2 slots", "dlo auto budget"):
        plan = variants[name]["plan"]
        assert plan["predicted_step_ms"] > 0 and plan["hardware"] == "h200"
        assert plan["measured_over_plan"] == variants[name]["step_ms"] / plan["predicted_step_ms"]
    assert "plan" not in variants["group offload"]
    assert gpu_check._predicted(variants["dlo 2 slots"]).endswith(f"({variants['dlo 2 slots']['plan']['bound']})")
