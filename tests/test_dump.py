"""Schedule dumps: golden schedule.py / blocks.md, timeline.svg, trace.json, stalls, CLI.

One golden holds a whole schedule.py; the others hold its schedule lines only
(`dump_cases.dlo_lines`): the compute between them is the same graph every time.

Refresh the goldens with ``EXPECTTEST_ACCEPT=1 pytest tests/test_dump.py`` and read the diff.
"""

from __future__ import annotations

import argparse
import functools
import json
import runpy
import sys
import tempfile
import warnings
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
from expecttest import TestCase

import dlo_fx.apps.dump
from dlo_fx.apps.dump.cli import add_dump_arguments, run_dump

from distributed import in_child, spawn
from dump_cases import (SVG, allgather_cases, delay_prefetches, dlo_lines, dump_model,
                        dump_texts, fresh, slow_blocks, small_dit, stall_total, svg_bars,
                        table_blocks, trace_blocks, traced_dump)
from models import offloaded, tiny_dit

TESTS = Path(__file__).resolve().parent


def rank_local_texts(num_slots: int, **options) -> dict[str, str]:
    with tempfile.TemporaryDirectory() as tmp:
        return dump_texts(Path(tmp), {"num_slots": num_slots, **options})


@functools.lru_cache(maxsize=None)
def allgather_results() -> dict:
    """One 2-rank spawn for every allgather case (spawning is the slow part)."""
    with tempfile.TemporaryDirectory() as tmp:
        return spawn(2, allgather_cases, tmp, timeout=240)


class GoldenDumps(TestCase):
    maxDiff = None

    def test_rank_local_two_slots(self):
        texts = rank_local_texts(2)
        self.assertExpectedInline(texts["blocks.md"], """\
# Graph 0: blocks and resident set

- mode: rank_local (why: one rank in the shard group: nothing to gather)
- slots: 2 x 38,400 B = 76,800 B on the device (block b lives in slot b % slots)
- block budget: 32,896 B

## Blocks

`bytes`: the block's parameters; `shard bytes`: what this rank keeps in host
memory and copies to the device.
`ends because`: why the block closes there (whole layers up to the budget).

| block | first FQN | last FQN | params | bytes | slot | shard bytes | ends because |
| ---: | --- | --- | ---: | ---: | ---: | ---: | --- |
| 0 | patch_embed.weight | time_embed.0.bias | 4 | 33,984 | 0 | 34,816 | next layer `time_embed.2` does not fit (34,368 + 4,224 > 37,824 B) |
| 1 | time_embed.2.weight | text_proj.bias | 4 | 8,384 | 1 | 8,704 | next layer `blocks.0` does not fit (8,384 + 37,824 > 37,824 B) |
| 2 | blocks.0.adaLN.weight | blocks.0.fc2_bias | 10 | 37,824 | 0 | 38,400 | next layer `final_adaLN` does not fit (37,824 + 4,224 > 37,824 B) |
| 3 | final_adaLN.weight | proj_out.bias | 4 | 5,280 | 1 | 5,632 | last streamed parameter |
| total | | | 22 | 85,472 | | 87,552 | |

## Resident set

| FQN | bytes | reason |
| --- | ---: | --- |
| modulation_table | 384 | read while 2 later blocks are live (num_slots=2) |
| total (1) | 384 | |

## Measured stalls

No traced run yet. Compile with `options={"trace": True}`, run the model,
then call `dlo_fx.apps.dump.flush(model)` (it also runs when the process exits).
""")
        self.assertExpectedInline(texts["schedule.py"], """\
# dlo schedule of graph 0: 4 blocks, 2 slots, mode rank_local.
# Each schedule node follows a line '# dlo: <kind> block=<graph block> slot=<slot> bytes=<block bytes>';
# a wait also lists the parameters it covers. dlo_fx_runtime_graph_ops_<kind> is
# dlo_fx.runtime.graph.ops.<kind>; _dlo is the graph's schedule. Statements that only free
# values early ('x = None') are left out. Blocks, slots and bytes: blocks.md.
def forward(
    self,
    L_latents_ : torch.Tensor,
    L_self_modules_patch_embed_parameters_weight_ : dlo_fx_runtime_weights_stored_StoredWeight,
    L_self_modules_patch_embed_parameters_bias_ : dlo_fx_runtime_weights_stored_StoredWeight,
    L_timestep_ : torch.Tensor,
    L_self_modules_time_embed_modules_0_parameters_weight_ : dlo_fx_runtime_weights_stored_StoredWeight,
    L_self_modules_time_embed_modules_0_parameters_bias_ : dlo_fx_runtime_weights_stored_StoredWeight,
    L_self_modules_time_embed_modules_2_parameters_weight_ : dlo_fx_runtime_weights_stored_StoredWeight,
    L_self_modules_time_embed_modules_2_parameters_bias_ : dlo_fx_runtime_weights_stored_StoredWeight,
    L_text_ : torch.Tensor,
    L_self_modules_text_proj_parameters_weight_ : dlo_fx_runtime_weights_stored_StoredWeight,
    L_self_modules_text_proj_parameters_bias_ : dlo_fx_runtime_weights_stored_StoredWeight,
    L_self_parameters_modulation_table_ : dlo_fx_runtime_weights_stored_StoredWeight,
    L_self_buffers_rope_freqs_ : torch.Tensor,
    L_self_modules_blocks_modules_0_modules_adaLN_parameters_weight_ : dlo_fx_runtime_weights_stored_StoredWeight,
    L_self_modules_blocks_modules_0_modules_adaLN_parameters_bias_ : dlo_fx_runtime_weights_stored_StoredWeight,
    L_self_modules_blocks_modules_0_modules_qkv_parameters_weight_ : dlo_fx_runtime_weights_stored_StoredWeight,
    L_self_modules_blocks_modules_0_modules_qkv_parameters_bias_ : dlo_fx_runtime_weights_stored_StoredWeight,
    L_self_modules_blocks_modules_0_modules_proj_parameters_weight_ : dlo_fx_runtime_weights_stored_StoredWeight,
    L_self_modules_blocks_modules_0_modules_proj_parameters_bias_ : dlo_fx_runtime_weights_stored_StoredWeight,
    L_self_modules_blocks_modules_0_modules_fc1_parameters_weight_ : dlo_fx_runtime_weights_stored_StoredWeight,
    L_self_modules_blocks_modules_0_modules_fc1_parameters_bias_ : dlo_fx_runtime_weights_stored_StoredWeight,
    L_self_modules_blocks_modules_0_parameters_fc2_weight_ : dlo_fx_runtime_weights_stored_StoredWeight,
    L_self_modules_blocks_modules_0_parameters_fc2_bias_ : dlo_fx_runtime_weights_stored_StoredWeight,
    L_self_modules_final_adaLN_parameters_weight_ : dlo_fx_runtime_weights_stored_StoredWeight,
    L_self_modules_final_adaLN_parameters_bias_ : dlo_fx_runtime_weights_stored_StoredWeight,
    L_self_modules_proj_out_parameters_weight_ : dlo_fx_runtime_weights_stored_StoredWeight,
    L_self_modules_proj_out_parameters_bias_ : dlo_fx_runtime_weights_stored_StoredWeight,
):
    l_latents_ = L_latents_
    l_self_modules_patch_embed_parameters_weight_ = L_self_modules_patch_embed_parameters_weight_
    l_self_modules_patch_embed_parameters_bias_ = L_self_modules_patch_embed_parameters_bias_
    l_timestep_ = L_timestep_
    l_self_modules_time_embed_modules_0_parameters_weight_ = L_self_modules_time_embed_modules_0_parameters_weight_
    l_self_modules_time_embed_modules_0_parameters_bias_ = L_self_modules_time_embed_modules_0_parameters_bias_
    l_self_modules_time_embed_modules_2_parameters_weight_ = L_self_modules_time_embed_modules_2_parameters_weight_
    l_self_modules_time_embed_modules_2_parameters_bias_ = L_self_modules_time_embed_modules_2_parameters_bias_
    l_text_ = L_text_
    l_self_modules_text_proj_parameters_weight_ = L_self_modules_text_proj_parameters_weight_
    l_self_modules_text_proj_parameters_bias_ = L_self_modules_text_proj_parameters_bias_
    l_self_parameters_modulation_table_ = L_self_parameters_modulation_table_
    l_self_buffers_rope_freqs_ = L_self_buffers_rope_freqs_
    l_self_modules_blocks_modules_0_modules_ada_ln_parameters_weight_ = L_self_modules_blocks_modules_0_modules_adaLN_parameters_weight_
    l_self_modules_blocks_modules_0_modules_ada_ln_parameters_bias_ = L_self_modules_blocks_modules_0_modules_adaLN_parameters_bias_
    l_self_modules_blocks_modules_0_modules_qkv_parameters_weight_ = L_self_modules_blocks_modules_0_modules_qkv_parameters_weight_
    l_self_modules_blocks_modules_0_modules_qkv_parameters_bias_ = L_self_modules_blocks_modules_0_modules_qkv_parameters_bias_
    l_self_modules_blocks_modules_0_modules_proj_parameters_weight_ = L_self_modules_blocks_modules_0_modules_proj_parameters_weight_
    l_self_modules_blocks_modules_0_modules_proj_parameters_bias_ = L_self_modules_blocks_modules_0_modules_proj_parameters_bias_
    l_self_modules_blocks_modules_0_modules_fc1_parameters_weight_ = L_self_modules_blocks_modules_0_modules_fc1_parameters_weight_
    l_self_modules_blocks_modules_0_modules_fc1_parameters_bias_ = L_self_modules_blocks_modules_0_modules_fc1_parameters_bias_
    l_self_modules_blocks_modules_0_parameters_fc2_weight_ = L_self_modules_blocks_modules_0_parameters_fc2_weight_
    l_self_modules_blocks_modules_0_parameters_fc2_bias_ = L_self_modules_blocks_modules_0_parameters_fc2_bias_
    l_self_modules_final_ada_ln_parameters_weight_ = L_self_modules_final_adaLN_parameters_weight_
    l_self_modules_final_ada_ln_parameters_bias_ = L_self_modules_final_adaLN_parameters_bias_
    l_self_modules_proj_out_parameters_weight_ = L_self_modules_proj_out_parameters_weight_
    l_self_modules_proj_out_parameters_bias_ = L_self_modules_proj_out_parameters_bias_
    _dlo = self._dlo
    # dlo: prefetch block=0 slot=0 bytes=33984
    prefetch_b0 = dlo_fx_runtime_graph_ops_prefetch(_dlo, 0, l_self_modules_patch_embed_parameters_weight_, l_self_modules_patch_embed_parameters_bias_, l_self_modules_time_embed_modules_0_parameters_weight_, l_self_modules_time_embed_modules_0_parameters_bias_)
    # dlo: prefetch block=1 slot=1 bytes=8384
    prefetch_b1 = dlo_fx_runtime_graph_ops_prefetch(_dlo, 1, l_self_modules_time_embed_modules_2_parameters_weight_, l_self_modules_time_embed_modules_2_parameters_bias_, l_self_modules_text_proj_parameters_weight_, l_self_modules_text_proj_parameters_bias_)
    to = l_latents_.to(torch.bfloat16)
    x = to.reshape(1, 4, 2, 2, 2, 2)
    permute = x.permute(0, 2, 4, 3, 5, 1)
    reshape_1 = permute.reshape(1, 4, 16)
    # dlo: wait block=0 slot=0 bytes=33984 covers patch_embed.weight, patch_embed.bias, time_embed.0.weight, time_embed.0.bias
    wait_b0 = dlo_fx_runtime_graph_ops_wait(_dlo, 0)
    # dlo: slot_view patch_embed.weight (1024 B)
    patch_embed_weight = dlo_fx_runtime_graph_ops_slot_view(_dlo, 0, wait_b0, l_self_modules_patch_embed_parameters_weight_)
    # dlo: slot_view patch_embed.bias (64 B)
    patch_embed_bias = dlo_fx_runtime_graph_ops_slot_view(_dlo, 0, wait_b0, l_self_modules_patch_embed_parameters_bias_)
    # dlo: slot_view time_embed.0.weight (32768 B)
    time_embed_0_weight = dlo_fx_runtime_graph_ops_slot_view(_dlo, 0, wait_b0, l_self_modules_time_embed_modules_0_parameters_weight_)
    # dlo: slot_view time_embed.0.bias (128 B)
    time_embed_0_bias = dlo_fx_runtime_graph_ops_slot_view(_dlo, 0, wait_b0, l_self_modules_time_embed_modules_0_parameters_bias_)
    image = torch._C._nn.linear(reshape_1, patch_embed_weight, patch_embed_bias)
    steps = torch.arange(128, dtype = torch.float32, device = device(type='cpu'))
    mul = -9.210340371976184 * steps
    truediv = mul / 128
    freqs = torch.exp(truediv)
    float_1 = l_timestep_.float()
    getitem = float_1[(slice(None, None, None), None)]
    getitem_1 = freqs[(None, slice(None, None, None))]
    args = getitem * getitem_1
    cos = torch.cos(args)
    sin = torch.sin(args)
    cat = torch.cat((cos, sin), dim = -1)
    input_1 = torch._C._nn.linear(cat, time_embed_0_weight, time_embed_0_bias)
    # dlo: swap_slot block=0 slot=0 bytes=33984
    swap_slot_b0 = dlo_fx_runtime_graph_ops_swap_slot(_dlo, 0)
    # dlo: prefetch block=2 slot=0 bytes=37824
    prefetch_b2 = dlo_fx_runtime_graph_ops_prefetch(_dlo, 2, l_self_modules_blocks_modules_0_modules_ada_ln_parameters_weight_, l_self_modules_blocks_modules_0_modules_ada_ln_parameters_bias_, l_self_modules_blocks_modules_0_modules_qkv_parameters_weight_, l_self_modules_blocks_modules_0_modules_qkv_parameters_bias_, l_self_modules_blocks_modules_0_modules_proj_parameters_weight_, l_self_modules_blocks_modules_0_modules_proj_parameters_bias_, l_self_modules_blocks_modules_0_modules_fc1_parameters_weight_, l_self_modules_blocks_modules_0_modules_fc1_parameters_bias_, l_self_modules_blocks_modules_0_parameters_fc2_weight_, l_self_modules_blocks_modules_0_parameters_fc2_bias_)
    input_2 = torch.nn.functional.silu(input_1, inplace = False)
    # dlo: wait block=1 slot=1 bytes=8384 covers time_embed.2.weight, time_embed.2.bias, text_proj.weight, text_proj.bias
    wait_b1 = dlo_fx_runtime_graph_ops_wait(_dlo, 1)
    # dlo: slot_view time_embed.2.weight (4096 B)
    time_embed_2_weight = dlo_fx_runtime_graph_ops_slot_view(_dlo, 1, wait_b1, l_self_modules_time_embed_modules_2_parameters_weight_)
    # dlo: slot_view time_embed.2.bias (128 B)
    time_embed_2_bias = dlo_fx_runtime_graph_ops_slot_view(_dlo, 1, wait_b1, l_self_modules_time_embed_modules_2_parameters_bias_)
    # dlo: slot_view text_proj.weight (4096 B)
    text_proj_weight = dlo_fx_runtime_graph_ops_slot_view(_dlo, 1, wait_b1, l_self_modules_text_proj_parameters_weight_)
    # dlo: slot_view text_proj.bias (64 B)
    text_proj_bias = dlo_fx_runtime_graph_ops_slot_view(_dlo, 1, wait_b1, l_self_modules_text_proj_parameters_bias_)
    input_3 = torch._C._nn.linear(input_2, time_embed_2_weight, time_embed_2_bias)
    temb = input_3.to(torch.bfloat16)
    to_2 = l_text_.to(torch.bfloat16)
    text_tokens = torch._C._nn.linear(to_2, text_proj_weight, text_proj_bias)
    # dlo: swap_slot block=1 slot=1 bytes=8384
    swap_slot_b1 = dlo_fx_runtime_graph_ops_swap_slot(_dlo, 1)
    # dlo: prefetch block=3 slot=1 bytes=5280
    prefetch_b3 = dlo_fx_runtime_graph_ops_prefetch(_dlo, 3, l_self_modules_final_ada_ln_parameters_weight_, l_self_modules_final_ada_ln_parameters_bias_, l_self_modules_proj_out_parameters_weight_, l_self_modules_proj_out_parameters_bias_)
    cond = torch.nn.functional.silu(temb)
    x_1 = torch.cat((text_tokens, image), dim = 1)
    # dlo: wait block=2 slot=0 bytes=37824 covers blocks.0.adaLN.weight, blocks.0.adaLN.bias, blocks.0.qkv.weight, blocks.0.qkv.bias, blocks.0.proj.weight, blocks.0.proj.bias, blocks.0.fc1.weight, blocks.0.fc1.bias, blocks.0.fc2_weight, blocks.0.fc2_bias
    wait_b2 = dlo_fx_runtime_graph_ops_wait(_dlo, 2)
    # dlo: slot_view blocks.0.adaLN.weight (12288 B)
    blocks_0_adaLN_weight = dlo_fx_runtime_graph_ops_slot_view(_dlo, 2, wait_b2, l_self_modules_blocks_modules_0_modules_ada_ln_parameters_weight_)
    # dlo: slot_view blocks.0.adaLN.bias (384 B)
    blocks_0_adaLN_bias = dlo_fx_runtime_graph_ops_slot_view(_dlo, 2, wait_b2, l_self_modules_blocks_modules_0_modules_ada_ln_parameters_bias_)
    # dlo: slot_view blocks.0.qkv.weight (6144 B)
    blocks_0_qkv_weight = dlo_fx_runtime_graph_ops_slot_view(_dlo, 2, wait_b2, l_self_modules_blocks_modules_0_modules_qkv_parameters_weight_)
    # dlo: slot_view blocks.0.qkv.bias (192 B)
    blocks_0_qkv_bias = dlo_fx_runtime_graph_ops_slot_view(_dlo, 2, wait_b2, l_self_modules_blocks_modules_0_modules_qkv_parameters_bias_)
    # dlo: slot_view blocks.0.proj.weight (2048 B)
    blocks_0_proj_weight = dlo_fx_runtime_graph_ops_slot_view(_dlo, 2, wait_b2, l_self_modules_blocks_modules_0_modules_proj_parameters_weight_)
    # dlo: slot_view blocks.0.proj.bias (64 B)
    blocks_0_proj_bias = dlo_fx_runtime_graph_ops_slot_view(_dlo, 2, wait_b2, l_self_modules_blocks_modules_0_modules_proj_parameters_bias_)
    # dlo: slot_view blocks.0.fc1.weight (8192 B)
    blocks_0_fc1_weight = dlo_fx_runtime_graph_ops_slot_view(_dlo, 2, wait_b2, l_self_modules_blocks_modules_0_modules_fc1_parameters_weight_)
    # dlo: slot_view blocks.0.fc1.bias (256 B)
    blocks_0_fc1_bias = dlo_fx_runtime_graph_ops_slot_view(_dlo, 2, wait_b2, l_self_modules_blocks_modules_0_modules_fc1_parameters_bias_)
    # dlo: slot_view blocks.0.fc2_weight (8192 B)
    blocks_0_fc2_weight = dlo_fx_runtime_graph_ops_slot_view(_dlo, 2, wait_b2, l_self_modules_blocks_modules_0_parameters_fc2_weight_)
    # dlo: slot_view blocks.0.fc2_bias (64 B)
    blocks_0_fc2_bias = dlo_fx_runtime_graph_ops_slot_view(_dlo, 2, wait_b2, l_self_modules_blocks_modules_0_parameters_fc2_bias_)
    linear_4 = torch._C._nn.linear(cond, blocks_0_adaLN_weight, blocks_0_adaLN_bias)
    view = linear_4.view(1, 6, 32)
    # dlo: resident modulation_table (384 B)
    modulation_table = dlo_fx_runtime_graph_ops_resident(_dlo, l_self_parameters_modulation_table_)
    mod = view + modulation_table
    unbind = mod.unbind(1)
    shift1 = unbind[0]
    scale1 = unbind[1]
    gate1 = unbind[2]
    shift2 = unbind[3]
    scale2 = unbind[4]
    gate2 = unbind[5]
    getitem_8 = gate1[(slice(None, None, None), None, slice(None, None, None))]
    layer_norm = torch.nn.functional.layer_norm(x_1, (32,), None, None, 1e-06)
    getitem_9 = scale1[(slice(None, None, None), None, slice(None, None, None))]
    add_1 = 1 + getitem_9
    mul_2 = layer_norm * add_1
    getitem_10 = shift1[(slice(None, None, None), None, slice(None, None, None))]
    add_2 = mul_2 + getitem_10
    linear_5 = torch._C._nn.linear(add_2, blocks_0_qkv_weight, blocks_0_qkv_bias)
    qkv = linear_5.view(1, 12, 3, 2, 16)
    permute_1 = qkv.permute(2, 0, 3, 1, 4)
    unbind_1 = permute_1.unbind(0)
    q = unbind_1[0]
    k = unbind_1[1]
    v = unbind_1[2]
    positions = torch.arange(12, dtype = torch.float32, device = device(type='cpu'))
    getitem_14 = positions[(slice(None, None, None), None)]
    getitem_15 = l_self_buffers_rope_freqs_[(None, slice(None, None, None))]
    angles = getitem_14 * getitem_15
    cos_1 = torch.cos(angles)
    cos_2 = cos_1.to(torch.bfloat16)
    sin_1 = torch.sin(angles)
    sin_2 = sin_1.to(torch.bfloat16)
    chunk = q.chunk(2, dim = -1)
    x1 = chunk[0]
    x2 = chunk[1]
    mul_4 = x1 * cos_2
    mul_5 = x2 * sin_2
    sub = mul_4 - mul_5
    mul_6 = x1 * sin_2
    mul_7 = x2 * cos_2
    add_3 = mul_6 + mul_7
    q_1 = torch.cat((sub, add_3), dim = -1)
    chunk_1 = k.chunk(2, dim = -1)
    x1_1 = chunk_1[0]
    x2_1 = chunk_1[1]
    mul_8 = x1_1 * cos_2
    mul_9 = x2_1 * sin_2
    sub_1 = mul_8 - mul_9
    mul_10 = x1_1 * sin_2
    mul_11 = x2_1 * cos_2
    add_4 = mul_10 + mul_11
    k_1 = torch.cat((sub_1, add_4), dim = -1)
    out = torch._C._nn.scaled_dot_product_attention(q_1, k_1, v)
    transpose = out.transpose(1, 2)
    reshape_2 = transpose.reshape(1, 12, 32)
    linear_6 = torch._C._nn.linear(reshape_2, blocks_0_proj_weight, blocks_0_proj_bias)
    mul_12 = getitem_8 * linear_6
    x_2 = x_1 + mul_12
    layer_norm_1 = torch.nn.functional.layer_norm(x_2, (32,), None, None, 1e-06)
    getitem_20 = scale2[(slice(None, None, None), None, slice(None, None, None))]
    add_6 = 1 + getitem_20
    mul_13 = layer_norm_1 * add_6
    getitem_21 = shift2[(slice(None, None, None), None, slice(None, None, None))]
    add_7 = mul_13 + getitem_21
    linear_7 = torch._C._nn.linear(add_7, blocks_0_fc1_weight, blocks_0_fc1_bias)
    h = torch._C._nn.gelu(linear_7, approximate = 'tanh')
    getitem_22 = gate2[(slice(None, None, None), None, slice(None, None, None))]
    linear_8 = torch._C._nn.linear(h, blocks_0_fc2_weight, blocks_0_fc2_bias)
    # dlo: swap_slot block=2 slot=0 bytes=37824
    swap_slot_b2 = dlo_fx_runtime_graph_ops_swap_slot(_dlo, 2)
    # dlo: prefetch block=0 slot=0 bytes=33984 wrap-around
    prefetch_b0_wrap = dlo_fx_runtime_graph_ops_prefetch(_dlo, 0, l_self_modules_patch_embed_parameters_weight_, l_self_modules_patch_embed_parameters_bias_, l_self_modules_time_embed_modules_0_parameters_weight_, l_self_modules_time_embed_modules_0_parameters_bias_)
    mul_14 = getitem_22 * linear_8
    x_3 = x_2 + mul_14
    x_4 = x_3[(slice(None, None, None), slice(8, None, None))]
    # dlo: wait block=3 slot=1 bytes=5280 covers final_adaLN.weight, final_adaLN.bias, proj_out.weight, proj_out.bias
    wait_b3 = dlo_fx_runtime_graph_ops_wait(_dlo, 3)
    # dlo: slot_view final_adaLN.weight (4096 B)
    final_adaLN_weight = dlo_fx_runtime_graph_ops_slot_view(_dlo, 3, wait_b3, l_self_modules_final_ada_ln_parameters_weight_)
    # dlo: slot_view final_adaLN.bias (128 B)
    final_adaLN_bias = dlo_fx_runtime_graph_ops_slot_view(_dlo, 3, wait_b3, l_self_modules_final_ada_ln_parameters_bias_)
    # dlo: slot_view proj_out.weight (1024 B)
    proj_out_weight = dlo_fx_runtime_graph_ops_slot_view(_dlo, 3, wait_b3, l_self_modules_proj_out_parameters_weight_)
    # dlo: slot_view proj_out.bias (32 B)
    proj_out_bias = dlo_fx_runtime_graph_ops_slot_view(_dlo, 3, wait_b3, l_self_modules_proj_out_parameters_bias_)
    linear_9 = torch._C._nn.linear(cond, final_adaLN_weight, final_adaLN_bias)
    chunk_2 = linear_9.chunk(2, dim = -1)
    shift = chunk_2[0]
    scale = chunk_2[1]
    layer_norm_2 = torch.nn.functional.layer_norm(x_4, (32,), None, None, 1e-06)
    getitem_26 = scale[(slice(None, None, None), None, slice(None, None, None))]
    add_9 = 1 + getitem_26
    mul_15 = layer_norm_2 * add_9
    getitem_27 = shift[(slice(None, None, None), None, slice(None, None, None))]
    add_10 = mul_15 + getitem_27
    x_5 = torch._C._nn.linear(add_10, proj_out_weight, proj_out_bias)
    # dlo: swap_slot block=3 slot=1 bytes=5280
    swap_slot_b3 = dlo_fx_runtime_graph_ops_swap_slot(_dlo, 3)
    # dlo: prefetch block=1 slot=1 bytes=8384 wrap-around
    prefetch_b1_wrap = dlo_fx_runtime_graph_ops_prefetch(_dlo, 1, l_self_modules_time_embed_modules_2_parameters_weight_, l_self_modules_time_embed_modules_2_parameters_bias_, l_self_modules_text_proj_parameters_weight_, l_self_modules_text_proj_parameters_bias_)
    x_6 = x_5.reshape(1, 2, 2, 2, 2, 4)
    permute_2 = x_6.permute(0, 5, 1, 3, 2, 4)
    reshape_4 = permute_2.reshape(1, 4, 4, 4)
    return (reshape_4,)

""")

    def test_rank_local_three_slots_small_resident(self):
        texts = rank_local_texts(3, resident_bytes=512)
        self.assertExpectedInline(texts["blocks.md"], """\
# Graph 0: blocks and resident set

- mode: rank_local (why: one rank in the shard group: nothing to gather)
- slots: 3 x 36,864 B = 110,592 B on the device (block b lives in slot b % slots)
- block budget: 36,864 B

## Blocks

`bytes`: the block's parameters; `shard bytes`: what this rank keeps in host
memory and copies to the device.
`ends because`: why the block closes there (whole layers up to the budget).

| block | first FQN | last FQN | params | bytes | slot | shard bytes | ends because |
| ---: | --- | --- | ---: | ---: | ---: | ---: | --- |
| 0 | patch_embed.weight | time_embed.0.weight | 2 | 33,792 | 0 | 33,792 | next layer `time_embed.2` does not fit (33,792 + 4,096 > 36,864 B) |
| 1 | time_embed.2.weight | text_proj.weight | 2 | 8,192 | 1 | 8,192 | next layer `blocks.0` does not fit (8,192 + 36,864 > 36,864 B) |
| 2 | blocks.0.adaLN.weight | blocks.0.fc2_weight | 5 | 36,864 | 2 | 36,864 | next layer `final_adaLN` does not fit (36,864 + 4,096 > 36,864 B) |
| 3 | final_adaLN.weight | proj_out.weight | 2 | 5,120 | 0 | 5,120 | last streamed parameter |
| total | | | 11 | 83,968 | | 83,968 | |

## Resident set

| FQN | bytes | reason |
| --- | ---: | --- |
| patch_embed.bias | 64 | smaller than resident_bytes=512 |
| time_embed.0.bias | 128 | smaller than resident_bytes=512 |
| time_embed.2.bias | 128 | smaller than resident_bytes=512 |
| text_proj.bias | 64 | smaller than resident_bytes=512 |
| modulation_table | 384 | smaller than resident_bytes=512 |
| blocks.0.adaLN.bias | 384 | smaller than resident_bytes=512 |
| blocks.0.qkv.bias | 192 | smaller than resident_bytes=512 |
| blocks.0.proj.bias | 64 | smaller than resident_bytes=512 |
| blocks.0.fc1.bias | 256 | smaller than resident_bytes=512 |
| blocks.0.fc2_bias | 64 | smaller than resident_bytes=512 |
| final_adaLN.bias | 128 | smaller than resident_bytes=512 |
| proj_out.bias | 32 | smaller than resident_bytes=512 |
| total (12) | 1,888 | |

## Measured stalls

No traced run yet. Compile with `options={"trace": True}`, run the model,
then call `dlo_fx.apps.dump.flush(model)` (it also runs when the process exits).
""")
        self.assertExpectedInline(dlo_lines(texts["schedule.py"]), """\
# dlo schedule of graph 0: 4 blocks, 3 slots, mode rank_local.
# Each schedule node follows a line '# dlo: <kind> block=<graph block> slot=<slot> bytes=<block bytes>';
# a wait also lists the parameters it covers. dlo_fx_runtime_graph_ops_<kind> is
# dlo_fx.runtime.graph.ops.<kind>; _dlo is the graph's schedule. Statements that only free
# values early ('x = None') are left out. Blocks, slots and bytes: blocks.md.
prefetch_b0  # dlo: prefetch block=0 slot=0 bytes=33792
prefetch_b1  # dlo: prefetch block=1 slot=1 bytes=8192
prefetch_b2  # dlo: prefetch block=2 slot=2 bytes=36864
wait_b0  # dlo: wait block=0 slot=0 bytes=33792 covers patch_embed.weight, time_embed.0.weight
patch_embed_weight  # dlo: slot_view patch_embed.weight (1024 B)
time_embed_0_weight  # dlo: slot_view time_embed.0.weight (32768 B)
swap_slot_b0  # dlo: swap_slot block=0 slot=0 bytes=33792
prefetch_b3  # dlo: prefetch block=3 slot=0 bytes=5120
wait_b1  # dlo: wait block=1 slot=1 bytes=8192 covers time_embed.2.weight, text_proj.weight
time_embed_2_weight  # dlo: slot_view time_embed.2.weight (4096 B)
text_proj_weight  # dlo: slot_view text_proj.weight (4096 B)
swap_slot_b1  # dlo: swap_slot block=1 slot=1 bytes=8192
prefetch_b1_wrap  # dlo: prefetch block=1 slot=1 bytes=8192 wrap-around
wait_b2  # dlo: wait block=2 slot=2 bytes=36864 covers blocks.0.adaLN.weight, blocks.0.qkv.weight, blocks.0.proj.weight, blocks.0.fc1.weight, blocks.0.fc2_weight
blocks_0_adaLN_weight  # dlo: slot_view blocks.0.adaLN.weight (12288 B)
blocks_0_qkv_weight  # dlo: slot_view blocks.0.qkv.weight (6144 B)
blocks_0_proj_weight  # dlo: slot_view blocks.0.proj.weight (2048 B)
blocks_0_fc1_weight  # dlo: slot_view blocks.0.fc1.weight (8192 B)
blocks_0_fc2_weight  # dlo: slot_view blocks.0.fc2_weight (8192 B)
swap_slot_b2  # dlo: swap_slot block=2 slot=2 bytes=36864
prefetch_b2_wrap  # dlo: prefetch block=2 slot=2 bytes=36864 wrap-around
wait_b3  # dlo: wait block=3 slot=0 bytes=5120 covers final_adaLN.weight, proj_out.weight
final_adaLN_weight  # dlo: slot_view final_adaLN.weight (4096 B)
proj_out_weight  # dlo: slot_view proj_out.weight (1024 B)
swap_slot_b3  # dlo: swap_slot block=3 slot=0 bytes=5120
prefetch_b0_wrap  # dlo: prefetch block=0 slot=0 bytes=33792 wrap-around
""")

    def test_allgather_two_slots(self):
        texts = allgather_results()[0][2]
        self.assertExpectedInline(texts["blocks.md"], """\
# Graph 0: blocks and resident set

- mode: allgather, rank 0 of a 2-rank shard group (why: mode='allgather' option)
- slots: 2 x 38,400 B = 76,800 B on the device (block b lives in slot b % slots)
- block budget: 32,896 B

## Blocks

`bytes`: the block's parameters; `shard bytes`: what this rank keeps in host
memory and copies to the device (the AllGather completes the rest).
`ends because`: why the block closes there (whole layers up to the budget).

| block | first FQN | last FQN | params | bytes | slot | shard bytes | ends because |
| ---: | --- | --- | ---: | ---: | ---: | ---: | --- |
| 0 | patch_embed.weight | time_embed.0.bias | 4 | 33,984 | 0 | 17,408 | next layer `time_embed.2` does not fit (34,368 + 4,224 > 37,824 B) |
| 1 | time_embed.2.weight | text_proj.bias | 4 | 8,384 | 1 | 4,352 | next layer `blocks.0` does not fit (8,384 + 37,824 > 37,824 B) |
| 2 | blocks.0.adaLN.weight | blocks.0.fc2_bias | 10 | 37,824 | 0 | 19,200 | next layer `final_adaLN` does not fit (37,824 + 4,224 > 37,824 B) |
| 3 | final_adaLN.weight | proj_out.bias | 4 | 5,280 | 1 | 2,816 | last streamed parameter |
| total | | | 22 | 85,472 | | 43,776 | |

## Resident set

| FQN | bytes | reason |
| --- | ---: | --- |
| modulation_table | 384 | read while 2 later blocks are live (num_slots=2) |
| total (1) | 384 | |

## Measured stalls

No traced run yet. Compile with `options={"trace": True}`, run the model,
then call `dlo_fx.apps.dump.flush(model)` (it also runs when the process exits).
""")
        self.assertExpectedInline(dlo_lines(texts["schedule.py"]), """\
# dlo schedule of graph 0: 4 blocks, 2 slots, mode allgather, dp 2.
# Each schedule node follows a line '# dlo: <kind> block=<graph block> slot=<slot> bytes=<block bytes>';
# a wait also lists the parameters it covers. dlo_fx_runtime_graph_ops_<kind> is
# dlo_fx.runtime.graph.ops.<kind>; _dlo is the graph's schedule. Statements that only free
# values early ('x = None') are left out. Blocks, slots and bytes: blocks.md.
prefetch_b0  # dlo: prefetch block=0 slot=0 bytes=33984
allgather_b0  # dlo: allgather block=0 slot=0 bytes=33984
prefetch_b1  # dlo: prefetch block=1 slot=1 bytes=8384
allgather_b1  # dlo: allgather block=1 slot=1 bytes=8384
wait_b0  # dlo: wait block=0 slot=0 bytes=33984 covers patch_embed.weight, patch_embed.bias, time_embed.0.weight, time_embed.0.bias
patch_embed_weight  # dlo: slot_view patch_embed.weight (1024 B)
patch_embed_bias  # dlo: slot_view patch_embed.bias (64 B)
time_embed_0_weight  # dlo: slot_view time_embed.0.weight (32768 B)
time_embed_0_bias  # dlo: slot_view time_embed.0.bias (128 B)
swap_slot_b0  # dlo: swap_slot block=0 slot=0 bytes=33984
prefetch_b2  # dlo: prefetch block=2 slot=0 bytes=37824
allgather_b2  # dlo: allgather block=2 slot=0 bytes=37824
wait_b1  # dlo: wait block=1 slot=1 bytes=8384 covers time_embed.2.weight, time_embed.2.bias, text_proj.weight, text_proj.bias
time_embed_2_weight  # dlo: slot_view time_embed.2.weight (4096 B)
time_embed_2_bias  # dlo: slot_view time_embed.2.bias (128 B)
text_proj_weight  # dlo: slot_view text_proj.weight (4096 B)
text_proj_bias  # dlo: slot_view text_proj.bias (64 B)
swap_slot_b1  # dlo: swap_slot block=1 slot=1 bytes=8384
prefetch_b3  # dlo: prefetch block=3 slot=1 bytes=5280
allgather_b3  # dlo: allgather block=3 slot=1 bytes=5280
wait_b2  # dlo: wait block=2 slot=0 bytes=37824 covers blocks.0.adaLN.weight, blocks.0.adaLN.bias, blocks.0.qkv.weight, blocks.0.qkv.bias, blocks.0.proj.weight, blocks.0.proj.bias, blocks.0.fc1.weight, blocks.0.fc1.bias, blocks.0.fc2_weight, blocks.0.fc2_bias
blocks_0_adaLN_weight  # dlo: slot_view blocks.0.adaLN.weight (12288 B)
blocks_0_adaLN_bias  # dlo: slot_view blocks.0.adaLN.bias (384 B)
blocks_0_qkv_weight  # dlo: slot_view blocks.0.qkv.weight (6144 B)
blocks_0_qkv_bias  # dlo: slot_view blocks.0.qkv.bias (192 B)
blocks_0_proj_weight  # dlo: slot_view blocks.0.proj.weight (2048 B)
blocks_0_proj_bias  # dlo: slot_view blocks.0.proj.bias (64 B)
blocks_0_fc1_weight  # dlo: slot_view blocks.0.fc1.weight (8192 B)
blocks_0_fc1_bias  # dlo: slot_view blocks.0.fc1.bias (256 B)
blocks_0_fc2_weight  # dlo: slot_view blocks.0.fc2_weight (8192 B)
blocks_0_fc2_bias  # dlo: slot_view blocks.0.fc2_bias (64 B)
modulation_table  # dlo: resident modulation_table (384 B)
swap_slot_b2  # dlo: swap_slot block=2 slot=0 bytes=37824
prefetch_b0_wrap  # dlo: prefetch block=0 slot=0 bytes=33984 wrap-around
allgather_b0_wrap  # dlo: allgather block=0 slot=0 bytes=33984 wrap-around
wait_b3  # dlo: wait block=3 slot=1 bytes=5280 covers final_adaLN.weight, final_adaLN.bias, proj_out.weight, proj_out.bias
final_adaLN_weight  # dlo: slot_view final_adaLN.weight (4096 B)
final_adaLN_bias  # dlo: slot_view final_adaLN.bias (128 B)
proj_out_weight  # dlo: slot_view proj_out.weight (1024 B)
proj_out_bias  # dlo: slot_view proj_out.bias (32 B)
swap_slot_b3  # dlo: swap_slot block=3 slot=1 bytes=5280
prefetch_b1_wrap  # dlo: prefetch block=1 slot=1 bytes=8384 wrap-around
allgather_b1_wrap  # dlo: allgather block=1 slot=1 bytes=8384 wrap-around
""")

    def test_allgather_three_slots(self):
        texts = allgather_results()[0][3]
        self.assertExpectedInline(texts["blocks.md"], """\
# Graph 0: blocks and resident set

- mode: allgather, rank 0 of a 2-rank shard group (why: mode='allgather' option)
- slots: 3 x 38,400 B = 115,200 B on the device (block b lives in slot b % slots)
- block budget: 32,896 B

## Blocks

`bytes`: the block's parameters; `shard bytes`: what this rank keeps in host
memory and copies to the device (the AllGather completes the rest).
`ends because`: why the block closes there (whole layers up to the budget).

| block | first FQN | last FQN | params | bytes | slot | shard bytes | ends because |
| ---: | --- | --- | ---: | ---: | ---: | ---: | --- |
| 0 | patch_embed.weight | modulation_table | 5 | 34,368 | 0 | 17,408 | next layer `time_embed.2` does not fit (34,368 + 4,224 > 37,824 B) |
| 1 | time_embed.2.weight | text_proj.bias | 4 | 8,384 | 1 | 4,352 | next layer `blocks.0` does not fit (8,384 + 37,824 > 37,824 B) |
| 2 | blocks.0.adaLN.weight | blocks.0.fc2_bias | 10 | 37,824 | 2 | 19,200 | next layer `final_adaLN` does not fit (37,824 + 4,224 > 37,824 B) |
| 3 | final_adaLN.weight | proj_out.bias | 4 | 5,280 | 0 | 2,816 | last streamed parameter |
| total | | | 23 | 85,856 | | 43,776 | |

## Resident set

Every parameter of this graph is streamed.

## Measured stalls

No traced run yet. Compile with `options={"trace": True}`, run the model,
then call `dlo_fx.apps.dump.flush(model)` (it also runs when the process exits).
""")
        self.assertExpectedInline(dlo_lines(texts["schedule.py"]), """\
# dlo schedule of graph 0: 4 blocks, 3 slots, mode allgather, dp 2.
# Each schedule node follows a line '# dlo: <kind> block=<graph block> slot=<slot> bytes=<block bytes>';
# a wait also lists the parameters it covers. dlo_fx_runtime_graph_ops_<kind> is
# dlo_fx.runtime.graph.ops.<kind>; _dlo is the graph's schedule. Statements that only free
# values early ('x = None') are left out. Blocks, slots and bytes: blocks.md.
prefetch_b0  # dlo: prefetch block=0 slot=0 bytes=34368
allgather_b0  # dlo: allgather block=0 slot=0 bytes=34368
prefetch_b1  # dlo: prefetch block=1 slot=1 bytes=8384
allgather_b1  # dlo: allgather block=1 slot=1 bytes=8384
prefetch_b2  # dlo: prefetch block=2 slot=2 bytes=37824
allgather_b2  # dlo: allgather block=2 slot=2 bytes=37824
wait_b0  # dlo: wait block=0 slot=0 bytes=34368 covers patch_embed.weight, patch_embed.bias, time_embed.0.weight, time_embed.0.bias, modulation_table
patch_embed_weight  # dlo: slot_view patch_embed.weight (1024 B)
patch_embed_bias  # dlo: slot_view patch_embed.bias (64 B)
time_embed_0_weight  # dlo: slot_view time_embed.0.weight (32768 B)
time_embed_0_bias  # dlo: slot_view time_embed.0.bias (128 B)
modulation_table  # dlo: slot_view modulation_table (384 B)
wait_b1  # dlo: wait block=1 slot=1 bytes=8384 covers time_embed.2.weight, time_embed.2.bias, text_proj.weight, text_proj.bias
time_embed_2_weight  # dlo: slot_view time_embed.2.weight (4096 B)
time_embed_2_bias  # dlo: slot_view time_embed.2.bias (128 B)
text_proj_weight  # dlo: slot_view text_proj.weight (4096 B)
text_proj_bias  # dlo: slot_view text_proj.bias (64 B)
swap_slot_b1  # dlo: swap_slot block=1 slot=1 bytes=8384
prefetch_b1_wrap  # dlo: prefetch block=1 slot=1 bytes=8384 wrap-around
allgather_b1_wrap  # dlo: allgather block=1 slot=1 bytes=8384 wrap-around
wait_b2  # dlo: wait block=2 slot=2 bytes=37824 covers blocks.0.adaLN.weight, blocks.0.adaLN.bias, blocks.0.qkv.weight, blocks.0.qkv.bias, blocks.0.proj.weight, blocks.0.proj.bias, blocks.0.fc1.weight, blocks.0.fc1.bias, blocks.0.fc2_weight, blocks.0.fc2_bias
blocks_0_adaLN_weight  # dlo: slot_view blocks.0.adaLN.weight (12288 B)
blocks_0_adaLN_bias  # dlo: slot_view blocks.0.adaLN.bias (384 B)
blocks_0_qkv_weight  # dlo: slot_view blocks.0.qkv.weight (6144 B)
blocks_0_qkv_bias  # dlo: slot_view blocks.0.qkv.bias (192 B)
blocks_0_proj_weight  # dlo: slot_view blocks.0.proj.weight (2048 B)
blocks_0_proj_bias  # dlo: slot_view blocks.0.proj.bias (64 B)
blocks_0_fc1_weight  # dlo: slot_view blocks.0.fc1.weight (8192 B)
blocks_0_fc1_bias  # dlo: slot_view blocks.0.fc1.bias (256 B)
blocks_0_fc2_weight  # dlo: slot_view blocks.0.fc2_weight (8192 B)
blocks_0_fc2_bias  # dlo: slot_view blocks.0.fc2_bias (64 B)
swap_slot_b0  # dlo: swap_slot block=0 slot=0 bytes=34368
prefetch_b3  # dlo: prefetch block=3 slot=0 bytes=5280
allgather_b3  # dlo: allgather block=3 slot=0 bytes=5280
swap_slot_b2  # dlo: swap_slot block=2 slot=2 bytes=37824
prefetch_b2_wrap  # dlo: prefetch block=2 slot=2 bytes=37824 wrap-around
allgather_b2_wrap  # dlo: allgather block=2 slot=2 bytes=37824 wrap-around
wait_b3  # dlo: wait block=3 slot=0 bytes=5280 covers final_adaLN.weight, final_adaLN.bias, proj_out.weight, proj_out.bias
final_adaLN_weight  # dlo: slot_view final_adaLN.weight (4096 B)
final_adaLN_bias  # dlo: slot_view final_adaLN.bias (128 B)
proj_out_weight  # dlo: slot_view proj_out.weight (1024 B)
proj_out_bias  # dlo: slot_view proj_out.bias (32 B)
swap_slot_b3  # dlo: swap_slot block=3 slot=0 bytes=5280
prefetch_b0_wrap  # dlo: prefetch block=0 slot=0 bytes=34368 wrap-around
allgather_b0_wrap  # dlo: allgather block=0 slot=0 bytes=34368 wrap-around
""")


def test_allgather_ranks_agree_and_dump_apart():
    results = allgather_results()
    for slots in (2, 3):
        zero, one = results[0][slots], results[1][slots]
        assert one["schedule.py"] == zero["schedule.py"]
        assert one["blocks.md"] == zero["blocks.md"].replace("rank 0 of", "rank 1 of")
    assert results[0]["folders"] == ["golden/2/rank_0/graph_0", "golden/3/rank_0/graph_0",
                                     "traced/rank_0/graph_0"]
    assert results[1]["folders"] == [f.replace("rank_0", "rank_1") for f in results[0]["folders"]]


def check_traced(got: dict, kinds: tuple[str, ...], lanes: tuple[str, ...]) -> None:
    blocks = set(range(got["num_blocks"]))
    assert got["table_blocks"] == sorted(blocks)
    assert not got["trace_before_flush"] and got["flushed"]
    for lane in lanes:  # a bar per block per lane
        assert got["svg"]["bar"][lane] == blocks, lane
    assert set(got["trace"]) == set(kinds)
    for kind in kinds:  # spans for every block and kind
        assert got["trace"][kind] == blocks, kind
    stalls = got["stalls"]
    assert stalls.waits == 2 * len(blocks)  # two traced calls
    assert "| total | | %d |" % (2 * len(blocks)) in got["blocks_md"]
    assert "No traced run yet" not in got["blocks_md"]


def test_traced_dump_allgather():
    check_traced(allgather_results()[0]["traced"], ("prefetch", "allgather", "wait", "compute"),
                 ("compute", "h2d", "allgather"))


def test_traced_dump_rank_local(tmp_path):
    check_traced(traced_dump(tmp_path, {"num_slots": 2}), ("prefetch", "wait", "compute"),
                 ("compute", "h2d"))


def test_untraced_timeline_is_predicted_from_bytes(tmp_path):
    model, inputs = small_dit()
    _, (folder,) = dump_model(model, inputs, tmp_path, {"num_slots": 2})  # trace off
    root = ET.parse(folder / "timeline.svg").getroot()
    title = root.find(f"{SVG}title").text
    assert "H2D from bytes at 25 GB/s (assumed)" in title
    assert "compute from bytes at 100 GB/s (assumed)" in title
    bars = svg_bars(folder / "timeline.svg")
    blocks = set(table_blocks((folder / "blocks.md").read_text()))
    assert bars["bar"]["compute"] == bars["bar"]["h2d"] == blocks
    assert "allgather" not in bars["bar"]  # rank-local: the lane is there, empty
    assert bars["stall"]["compute"]  # copies at 25 GB/s are slower than compute at 100
    assert "No traced run yet" in (folder / "blocks.md").read_text()
    assert not (folder / "trace.json").exists()


def test_delaying_prefetches_adds_stall(tmp_path):
    """A user pass that issues each prefetch one block later makes compute wait longer.

    Copies are made slow (`fault_delay`: up to 20 ms each, the same seeded delays in
    both runs) and each block's compute at least 30 ms long, so the normal schedule hides
    the copy of block b+1 behind block b while the delayed one waits for it in full."""
    slow = slow_blocks(0.03)
    normal = stall_total((slow,), tmp_path / "normal", delay_s=0.02)
    delayed = stall_total((slow, delay_prefetches), tmp_path / "delayed", delay_s=0.02)
    assert delayed > normal + 0.05, (normal, delayed)
    schedule = (tmp_path / "delayed" / "graph_0" / "schedule.py").read_text()
    order = [line.split("  # dlo: ")[0] for line in dlo_lines(schedule).splitlines()
             if "# dlo: prefetch" in line or "# dlo: wait" in line]
    assert order.index("prefetch_b2") > order.index("wait_b1")  # issued after block 1 started


def test_write_trace_and_stall_summary(tmp_path):
    model, inputs = small_dit()
    dump_model(model, inputs, tmp_path / "dump", {"trace": True}, calls=2)
    path = dlo_fx.apps.dump.write_trace(model, tmp_path / "all.json")
    events = json.loads(path.read_text())["traceEvents"]
    kinds = {e["cat"] for e in events if e["ph"] == "X"}
    assert kinds == {"prefetch", "wait", "compute"}
    names = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert "MainThread compute" in names
    summary = dlo_fx.apps.dump.stall_summary(model)
    assert str(summary).startswith("dlo stalls: compute waited")
    assert sum(b.stall_ns for b in summary.blocks) == summary.total_ns
    untraced, inputs = small_dit()
    fresh()
    dump_model(untraced, inputs, tmp_path / "plain", {}, calls=1)
    with pytest.raises(ValueError, match="options=\\{'trace': True\\}"):
        dlo_fx.apps.dump.stall_summary(untraced)


def test_graph_breaks_get_one_folder_each(tmp_path):
    """Dynamo reuses one graph for every layer: its folder still gets every layer's spans."""
    model, inputs = tiny_dit(depth=3, graph_break=True)
    dump_model(model, inputs, tmp_path, {"trace": True}, calls=2, fullgraph=False)
    folders = sorted(p.name for p in tmp_path.iterdir())
    assert folders == [f"graph_{i}" for i in range(len(folders))] and len(folders) > 1
    dlo_fx.apps.dump.flush(model)
    streaming = 0
    for name in folders:
        folder = tmp_path / name
        files = {p.name for p in folder.iterdir()}
        assert {"schedule.py", "blocks.md", "timeline.svg"} <= files, name
        waits = (folder / "schedule.py").read_text().count("# dlo: wait")
        assert ("trace.json" in files) == (waits > 0), name  # spans only for blocks
        if waits:
            streaming += 1
            assert set(trace_blocks(folder / "trace.json")["wait"]) == set(range(waits)), name
    assert streaming >= 1


def _dump_from_environment(folder: str) -> None:
    import os

    os.environ["DLO_FX_DUMP_DIR"] = folder
    model, inputs = small_dit()
    compiled = torch.compile(offloaded(model), backend="dlo", fullgraph=True)
    with torch.no_grad():
        compiled(*inputs)


def test_dump_dir_from_environment(tmp_path):
    """In a child process: this process's environment is read by the spawned jobs that
    start meanwhile (tests/conftest.py), which would dump too."""
    spawn(1, in_child, _dump_from_environment, str(tmp_path))
    assert (tmp_path / "graph_0" / "schedule.py").exists()


def test_unwritable_dump_dir_names_it(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    model, inputs = small_dit()
    with pytest.raises(ValueError, match="dump_dir=.*file.*writable folder"):
        dump_model(model, inputs, blocker, {})


# -- dlo-fx dump ---------------------------------------------------------------------------
def cli(*argv: str) -> int:
    return run_dump(add_dump_arguments(argparse.ArgumentParser()).parse_args(list(argv)))


def test_cli_reference_dit_as_a_module(tmp_path, monkeypatch, capsys):
    """``python -m dlo_fx.apps.dump.cli``, run in this process (a subprocess imports torch again)."""
    monkeypatch.setattr(sys, "argv", ["dlo-fx dump", "--layers", "2", "--width", "32",
                                      "--heads", "2", "--size", "4", "--slots", "3",
                                      "--out", str(tmp_path)])
    with pytest.raises(SystemExit) as exit_, warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the module is imported already
        runpy.run_module("dlo_fx.apps.dump.cli", run_name="__main__")
    out = capsys.readouterr()
    assert exit_.value.code == 0, out.err
    assert "reference DiT (2 layers, width 32): 1 graph(s)" in out.out
    assert "dlo stalls: compute waited" in out.out
    files = {p.name for p in (tmp_path / "graph_0").iterdir()}
    assert files == {"schedule.py", "blocks.md", "timeline.svg", "trace.json"}
    assert "- slots: 3 x" in (tmp_path / "graph_0" / "blocks.md").read_text()


def test_cli_wan_factory(tmp_path, capsys):
    assert cli("--model", "dump_cases:wan_factory", "--app-dir", str(TESTS),
               "--out", str(tmp_path), "--calls", "1") == 0
    printed = capsys.readouterr().out
    assert "dump_cases:wan_factory:" in printed
    schedules = [p / "schedule.py" for p in sorted(tmp_path.iterdir())]
    text = "".join(s.read_text() for s in schedules)
    assert "blocks.0.attn1.to_q.weight" in text  # Wan's own parameter names
    for folder in tmp_path.iterdir():
        ET.parse(folder / "timeline.svg")
        json.loads((folder / "trace.json").read_text())


def test_cli_model_with_inputs_function_and_errors(tmp_path, capsys):
    assert cli("--model", "dump_cases:dit_model", "--inputs", "dump_cases:dit_inputs",
               "--app-dir", str(TESTS), "--out", str(tmp_path), "--no-trace") == 0
    assert not (tmp_path / "graph_0" / "trace.json").exists()
    assert (tmp_path / "graph_0" / "blocks.md").exists()
    capsys.readouterr()
    assert cli("--model", "dump_cases:dit_model", "--app-dir", str(TESTS)) == 2
    assert "--inputs" in capsys.readouterr().err
    assert cli("--model", "dump_cases", "--app-dir", str(TESTS)) == 2
    assert "package.module:callable" in capsys.readouterr().err
    assert cli("--model", "no_such_module_here:f") == 2
    assert "cannot import" in capsys.readouterr().err
    assert cli("--layers", "1", "--width", "32", "--heads", "2", "--block-bytes", "0") == 2
    assert "'block_bytes'=0" in capsys.readouterr().err
    assert cli("--compute-gbps", "0") == 2
    assert "compute_gbps" in capsys.readouterr().err


def test_cli_model_made_dlos_keeps_its_options_and_a_differing_flag_is_refused(tmp_path, capsys):
    """A factory returning a model it offloaded itself is dumped with its runtime's options:
    a runtime flag that says otherwise is refused naming both values, never ignored."""
    base = ("--model", "dump_cases:offloaded_dit", "--app-dir", str(TESTS), "--calls", "1",
            "--no-trace")
    assert cli(*base, "--out", str(tmp_path / "a"), "--slots", "2") == 2
    err = capsys.readouterr().err
    assert "--slots 2 (its runtime has 3)" in err and "dlo's already" in err
    assert cli(*base, "--out", str(tmp_path / "b"), "--slots", "3") == 0
    assert "- slots: 3 x" in (tmp_path / "b" / "graph_0" / "blocks.md").read_text()
    assert cli(*base, "--out", str(tmp_path / "c")) == 0  # no flag: the model's own
    assert "- slots: 3 x" in (tmp_path / "c" / "graph_0" / "blocks.md").read_text()


def test_cli_prints_the_plans_prediction_for_a_hardware(tmp_path, capsys):
    assert cli("--layers", "2", "--width", "32", "--heads", "2", "--size", "4", "--calls", "1",
               "--no-trace", "--out", str(tmp_path), "--hardware", "h200") == 0
    printed = capsys.readouterr().out
    assert "predicted on h200 (dlo_fx.plan, not measured)" in printed
    assert "1 graph(s) scheduled" in printed
    assert cli("--layers", "1", "--width", "32", "--heads", "2", "--size", "4", "--no-trace",
               "--out", str(tmp_path / "x"), "--hardware", "no-such-gpu") == 2
    assert "no-such-gpu" in capsys.readouterr().err


def test_timeline_reads_outside_a_browser_at_any_size():
    """Seconds from 1,000 ms (not ``9.58e+03 ms``), hex colours (viewers outside browsers
    draw ``hsl()`` black), the resident blocks as ranges and the subtitle wrapped to the
    picture's width, the title counting streamed and resident blocks apart."""
    import re
    import xml.etree.ElementTree as ET

    from dlo_fx.apps.dump import svg
    from dlo_fx.apps.plan import Hardware
    from models import tiny_flux

    assert svg._ms(9.58) == "9.58 s" and svg._ms(0.0123) == "12.3 ms"
    assert all(re.fullmatch(r"#[0-9a-f]{6}", svg._colour(b)) for b in range(40))
    assert svg.resident_runs([0, 1, 2, 5, 7, 8]) == "R0-R2, R5, R7-R8"
    model, inputs = tiny_flux()
    meta = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    hw = Hardware("slow", 0.0002, 1.0, {"float32": 1e8}, memory_bytes=(1 << 30) + 300_000)
    plan = dlo_fx.plan(model.to("meta"), meta, hardware=hw, options={"block_bytes": 4_000})
    assert len(plan.resident_blocks) > 8 and plan.predicted_step_s > 1.0
    text = svg.render_svg(*_plan_picture(plan))
    assert "hsl(" not in text and "e+0" not in text
    root = ET.fromstring(text)
    lines = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")
             if t.text and ("predicted" in t.text or t.text.startswith(("R", "resident")))]
    assert all(len(line) <= svg.SUBTITLE_CHARS for line in lines), lines
    assert f"{svg.resident_runs(plan.resident_blocks)}" in root.find(
        "{http://www.w3.org/2000/svg}title").text


def _plan_picture(plan):
    from dlo_fx.apps.plan import report
    from dlo_fx.apps.dump.timeline import Timing

    dump = report._dump(plan, Path("unused"))
    prediction, _ = report._prediction(plan)
    timing = Timing(tuple(plan.h2d_s), tuple(plan.gather_s), tuple(plan.compute_s), "test")
    return dump, prediction, timing, "title"
