"""Golden scheduled graphs (refresh with EXPECTTEST_ACCEPT=1, then read the diff).

Two slots: the whole graph; three slots: its schedule nodes and slot views only."""

from __future__ import annotations

import torch
from expecttest import TestCase

from dlo_fx.apps.models import example_inputs, reference_dit
from dlo_fx.runtime.weights.owners import reset_runtimes
from dlo_fx.apps.dump.schedule_text import format_schedule

from test_passes import compile_capture


def scheduled(num_slots: int) -> str:
    torch._dynamo.reset()
    reset_runtimes()
    model = reference_dit(width=32, depth=2, heads=2, seed=0)
    inputs = example_inputs(model.config, batch=1, height=4, width=4)
    _, _, (gm,) = compile_capture(model, inputs, {"num_slots": num_slots})
    return format_schedule(gm)


def schedule_nodes(text: str) -> str:
    """The schedule nodes and slot views of a formatted schedule, without the compute."""
    return "\n".join(line for line in text.splitlines()
                     if " block=" in line or "= slot_view(" in line)


class GoldenSchedule(TestCase):
    def test_two_slots(self):
        self.assertExpectedInline(scheduled(2), """\
_dlo = self._dlo
prefetch_b0  # prefetch block=0 slot=0 bytes=33984
prefetch_b1  # prefetch block=1 slot=1 bytes=8384
to = .to(l_latents_)
x = .reshape(to)
permute = .permute(x)
reshape_1 = .reshape(permute)
wait_b0  # wait block=0 slot=0 bytes=33984 covers patch_embed.weight, patch_embed.bias, time_embed.0.weight, time_embed.0.bias
patch_embed_weight = slot_view(patch_embed.weight)
patch_embed_bias = slot_view(patch_embed.bias)
time_embed_0_weight = slot_view(time_embed.0.weight)
time_embed_0_bias = slot_view(time_embed.0.bias)
image = linear(reshape_1, patch_embed_weight, patch_embed_bias)
steps = arange()
mul = mul(steps)
truediv = truediv(mul)
freqs = exp(truediv)
float_1 = .float(l_timestep_)
getitem = getitem(float_1, (slice(None, None, None), None))
getitem_1 = getitem(freqs, (None, slice(None, None, None)))
args = mul(getitem, getitem_1)
cos = cos(args)
sin = sin(args)
cat = cat((cos, sin))
input_1 = linear(cat, time_embed_0_weight, time_embed_0_bias)
swap_slot_b0  # swap_slot block=0 slot=0 bytes=33984
prefetch_b2  # prefetch block=2 slot=0 bytes=37824
input_2 = silu(input_1)
wait_b1  # wait block=1 slot=1 bytes=8384 covers time_embed.2.weight, time_embed.2.bias, text_proj.weight, text_proj.bias
time_embed_2_weight = slot_view(time_embed.2.weight)
time_embed_2_bias = slot_view(time_embed.2.bias)
text_proj_weight = slot_view(text_proj.weight)
text_proj_bias = slot_view(text_proj.bias)
input_3 = linear(input_2, time_embed_2_weight, time_embed_2_bias)
temb = .to(input_3)
to_2 = .to(l_text_)
text_tokens = linear(to_2, text_proj_weight, text_proj_bias)
swap_slot_b1  # swap_slot block=1 slot=1 bytes=8384
prefetch_b3  # prefetch block=3 slot=1 bytes=37824
cond = silu(temb)
x_1 = cat((text_tokens, image))
wait_b2  # wait block=2 slot=0 bytes=37824 covers blocks.0.adaLN.weight, blocks.0.adaLN.bias, blocks.0.qkv.weight, blocks.0.qkv.bias, blocks.0.proj.weight, blocks.0.proj.bias, blocks.0.fc1.weight, blocks.0.fc1.bias, blocks.0.fc2_weight, blocks.0.fc2_bias
blocks_0_adaLN_weight = slot_view(blocks.0.adaLN.weight)
blocks_0_adaLN_bias = slot_view(blocks.0.adaLN.bias)
blocks_0_qkv_weight = slot_view(blocks.0.qkv.weight)
blocks_0_qkv_bias = slot_view(blocks.0.qkv.bias)
blocks_0_proj_weight = slot_view(blocks.0.proj.weight)
blocks_0_proj_bias = slot_view(blocks.0.proj.bias)
blocks_0_fc1_weight = slot_view(blocks.0.fc1.weight)
blocks_0_fc1_bias = slot_view(blocks.0.fc1.bias)
blocks_0_fc2_weight = slot_view(blocks.0.fc2_weight)
blocks_0_fc2_bias = slot_view(blocks.0.fc2_bias)
linear_4 = linear(cond, blocks_0_adaLN_weight, blocks_0_adaLN_bias)
view = .view(linear_4)
modulation_table  # resident modulation_table (384 B)
mod = add(view, modulation_table)
unbind = .unbind(mod)
shift1 = getitem(unbind)
scale1 = getitem(unbind)
gate1 = getitem(unbind)
shift2 = getitem(unbind)
scale2 = getitem(unbind)
gate2 = getitem(unbind)
getitem_8 = getitem(gate1, (slice(None, None, None), None, slice(None, None, None)))
layer_norm = layer_norm(x_1, (32))
getitem_9 = getitem(scale1, (slice(None, None, None), None, slice(None, None, None)))
add_1 = add(getitem_9)
mul_2 = mul(layer_norm, add_1)
getitem_10 = getitem(shift1, (slice(None, None, None), None, slice(None, None, None)))
add_2 = add(mul_2, getitem_10)
linear_5 = linear(add_2, blocks_0_qkv_weight, blocks_0_qkv_bias)
qkv = .view(linear_5)
permute_1 = .permute(qkv)
unbind_1 = .unbind(permute_1)
q = getitem(unbind_1)
k = getitem(unbind_1)
v = getitem(unbind_1)
positions = arange()
getitem_14 = getitem(positions, (slice(None, None, None), None))
getitem_15 = getitem(l_self_buffers_rope_freqs_, (None, slice(None, None, None)))
angles = mul(getitem_14, getitem_15)
cos_1 = cos(angles)
cos_2 = .to(cos_1)
sin_1 = sin(angles)
sin_2 = .to(sin_1)
chunk = .chunk(q)
x1 = getitem(chunk)
x2 = getitem(chunk)
mul_4 = mul(x1, cos_2)
mul_5 = mul(x2, sin_2)
sub = sub(mul_4, mul_5)
mul_6 = mul(x1, sin_2)
mul_7 = mul(x2, cos_2)
add_3 = add(mul_6, mul_7)
q_1 = cat((sub, add_3))
chunk_1 = .chunk(k)
x1_1 = getitem(chunk_1)
x2_1 = getitem(chunk_1)
mul_8 = mul(x1_1, cos_2)
mul_9 = mul(x2_1, sin_2)
sub_1 = sub(mul_8, mul_9)
mul_10 = mul(x1_1, sin_2)
mul_11 = mul(x2_1, cos_2)
add_4 = add(mul_10, mul_11)
k_1 = cat((sub_1, add_4))
out = scaled_dot_product_attention(q_1, k_1, v)
transpose = .transpose(out)
reshape_2 = .reshape(transpose)
linear_6 = linear(reshape_2, blocks_0_proj_weight, blocks_0_proj_bias)
mul_12 = mul(getitem_8, linear_6)
x_2 = add(x_1, mul_12)
layer_norm_1 = layer_norm(x_2, (32))
getitem_20 = getitem(scale2, (slice(None, None, None), None, slice(None, None, None)))
add_6 = add(getitem_20)
mul_13 = mul(layer_norm_1, add_6)
getitem_21 = getitem(shift2, (slice(None, None, None), None, slice(None, None, None)))
add_7 = add(mul_13, getitem_21)
linear_7 = linear(add_7, blocks_0_fc1_weight, blocks_0_fc1_bias)
h = gelu(linear_7)
getitem_22 = getitem(gate2, (slice(None, None, None), None, slice(None, None, None)))
linear_8 = linear(h, blocks_0_fc2_weight, blocks_0_fc2_bias)
swap_slot_b2  # swap_slot block=2 slot=0 bytes=37824
prefetch_b4  # prefetch block=4 slot=0 bytes=5280
mul_14 = mul(getitem_22, linear_8)
x_3 = add(x_2, mul_14)
wait_b3  # wait block=3 slot=1 bytes=37824 covers blocks.1.adaLN.weight, blocks.1.adaLN.bias, blocks.1.qkv.weight, blocks.1.qkv.bias, blocks.1.proj.weight, blocks.1.proj.bias, blocks.1.fc1.weight, blocks.1.fc1.bias, blocks.1.fc2_weight, blocks.1.fc2_bias
blocks_1_adaLN_weight = slot_view(blocks.1.adaLN.weight)
blocks_1_adaLN_bias = slot_view(blocks.1.adaLN.bias)
blocks_1_qkv_weight = slot_view(blocks.1.qkv.weight)
blocks_1_qkv_bias = slot_view(blocks.1.qkv.bias)
blocks_1_proj_weight = slot_view(blocks.1.proj.weight)
blocks_1_proj_bias = slot_view(blocks.1.proj.bias)
blocks_1_fc1_weight = slot_view(blocks.1.fc1.weight)
blocks_1_fc1_bias = slot_view(blocks.1.fc1.bias)
blocks_1_fc2_weight = slot_view(blocks.1.fc2_weight)
blocks_1_fc2_bias = slot_view(blocks.1.fc2_bias)
linear_9 = linear(cond, blocks_1_adaLN_weight, blocks_1_adaLN_bias)
view_2 = .view(linear_9)
mod_1 = add(view_2, modulation_table)
unbind_2 = .unbind(mod_1)
shift1_1 = getitem(unbind_2)
scale1_1 = getitem(unbind_2)
gate1_1 = getitem(unbind_2)
shift2_1 = getitem(unbind_2)
scale2_1 = getitem(unbind_2)
gate2_1 = getitem(unbind_2)
getitem_29 = getitem(gate1_1, (slice(None, None, None), None, slice(None, None, None)))
layer_norm_2 = layer_norm(x_3, (32))
getitem_30 = getitem(scale1_1, (slice(None, None, None), None, slice(None, None, None)))
add_10 = add(getitem_30)
mul_15 = mul(layer_norm_2, add_10)
getitem_31 = getitem(shift1_1, (slice(None, None, None), None, slice(None, None, None)))
add_11 = add(mul_15, getitem_31)
linear_10 = linear(add_11, blocks_1_qkv_weight, blocks_1_qkv_bias)
qkv_1 = .view(linear_10)
permute_2 = .permute(qkv_1)
unbind_3 = .unbind(permute_2)
q_2 = getitem(unbind_3)
k_2 = getitem(unbind_3)
v_1 = getitem(unbind_3)
positions_1 = arange()
getitem_35 = getitem(positions_1, (slice(None, None, None), None))
getitem_36 = getitem(l_self_buffers_rope_freqs_, (None, slice(None, None, None)))
angles_1 = mul(getitem_35, getitem_36)
cos_3 = cos(angles_1)
cos_4 = .to(cos_3)
sin_3 = sin(angles_1)
sin_4 = .to(sin_3)
chunk_2 = .chunk(q_2)
x1_2 = getitem(chunk_2)
x2_2 = getitem(chunk_2)
mul_17 = mul(x1_2, cos_4)
mul_18 = mul(x2_2, sin_4)
sub_2 = sub(mul_17, mul_18)
mul_19 = mul(x1_2, sin_4)
mul_20 = mul(x2_2, cos_4)
add_12 = add(mul_19, mul_20)
q_3 = cat((sub_2, add_12))
chunk_3 = .chunk(k_2)
x1_3 = getitem(chunk_3)
x2_3 = getitem(chunk_3)
mul_21 = mul(x1_3, cos_4)
mul_22 = mul(x2_3, sin_4)
sub_3 = sub(mul_21, mul_22)
mul_23 = mul(x1_3, sin_4)
mul_24 = mul(x2_3, cos_4)
add_13 = add(mul_23, mul_24)
k_3 = cat((sub_3, add_13))
out_1 = scaled_dot_product_attention(q_3, k_3, v_1)
transpose_1 = .transpose(out_1)
reshape_3 = .reshape(transpose_1)
linear_11 = linear(reshape_3, blocks_1_proj_weight, blocks_1_proj_bias)
mul_25 = mul(getitem_29, linear_11)
x_4 = add(x_3, mul_25)
layer_norm_3 = layer_norm(x_4, (32))
getitem_41 = getitem(scale2_1, (slice(None, None, None), None, slice(None, None, None)))
add_15 = add(getitem_41)
mul_26 = mul(layer_norm_3, add_15)
getitem_42 = getitem(shift2_1, (slice(None, None, None), None, slice(None, None, None)))
add_16 = add(mul_26, getitem_42)
linear_12 = linear(add_16, blocks_1_fc1_weight, blocks_1_fc1_bias)
h_1 = gelu(linear_12)
getitem_43 = getitem(gate2_1, (slice(None, None, None), None, slice(None, None, None)))
linear_13 = linear(h_1, blocks_1_fc2_weight, blocks_1_fc2_bias)
swap_slot_b3  # swap_slot block=3 slot=1 bytes=37824
prefetch_b1_wrap  # prefetch block=1 slot=1 bytes=8384 wrap-around
mul_27 = mul(getitem_43, linear_13)
x_5 = add(x_4, mul_27)
x_6 = getitem(x_5, (slice(None, None, None), slice(8, None, None)))
wait_b4  # wait block=4 slot=0 bytes=5280 covers final_adaLN.weight, final_adaLN.bias, proj_out.weight, proj_out.bias
final_adaLN_weight = slot_view(final_adaLN.weight)
final_adaLN_bias = slot_view(final_adaLN.bias)
proj_out_weight = slot_view(proj_out.weight)
proj_out_bias = slot_view(proj_out.bias)
linear_14 = linear(cond, final_adaLN_weight, final_adaLN_bias)
chunk_4 = .chunk(linear_14)
shift = getitem(chunk_4)
scale = getitem(chunk_4)
layer_norm_4 = layer_norm(x_6, (32))
getitem_47 = getitem(scale, (slice(None, None, None), None, slice(None, None, None)))
add_18 = add(getitem_47)
mul_28 = mul(layer_norm_4, add_18)
getitem_48 = getitem(shift, (slice(None, None, None), None, slice(None, None, None)))
add_19 = add(mul_28, getitem_48)
x_7 = linear(add_19, proj_out_weight, proj_out_bias)
swap_slot_b4  # swap_slot block=4 slot=0 bytes=5280
prefetch_b0_wrap  # prefetch block=0 slot=0 bytes=33984 wrap-around
x_8 = .reshape(x_7)
permute_3 = .permute(x_8)
reshape_5 = .reshape(permute_3)
return (reshape_5)""")

    def test_three_slots(self):
        self.assertExpectedInline(schedule_nodes(scheduled(3)), """\
prefetch_b0  # prefetch block=0 slot=0 bytes=33984
prefetch_b1  # prefetch block=1 slot=1 bytes=8384
prefetch_b2  # prefetch block=2 slot=2 bytes=37824
wait_b0  # wait block=0 slot=0 bytes=33984 covers patch_embed.weight, patch_embed.bias, time_embed.0.weight, time_embed.0.bias
patch_embed_weight = slot_view(patch_embed.weight)
patch_embed_bias = slot_view(patch_embed.bias)
time_embed_0_weight = slot_view(time_embed.0.weight)
time_embed_0_bias = slot_view(time_embed.0.bias)
swap_slot_b0  # swap_slot block=0 slot=0 bytes=33984
prefetch_b3  # prefetch block=3 slot=0 bytes=37824
wait_b1  # wait block=1 slot=1 bytes=8384 covers time_embed.2.weight, time_embed.2.bias, text_proj.weight, text_proj.bias
time_embed_2_weight = slot_view(time_embed.2.weight)
time_embed_2_bias = slot_view(time_embed.2.bias)
text_proj_weight = slot_view(text_proj.weight)
text_proj_bias = slot_view(text_proj.bias)
swap_slot_b1  # swap_slot block=1 slot=1 bytes=8384
prefetch_b4  # prefetch block=4 slot=1 bytes=5280
wait_b2  # wait block=2 slot=2 bytes=37824 covers blocks.0.adaLN.weight, blocks.0.adaLN.bias, blocks.0.qkv.weight, blocks.0.qkv.bias, blocks.0.proj.weight, blocks.0.proj.bias, blocks.0.fc1.weight, blocks.0.fc1.bias, blocks.0.fc2_weight, blocks.0.fc2_bias
blocks_0_adaLN_weight = slot_view(blocks.0.adaLN.weight)
blocks_0_adaLN_bias = slot_view(blocks.0.adaLN.bias)
blocks_0_qkv_weight = slot_view(blocks.0.qkv.weight)
blocks_0_qkv_bias = slot_view(blocks.0.qkv.bias)
blocks_0_proj_weight = slot_view(blocks.0.proj.weight)
blocks_0_proj_bias = slot_view(blocks.0.proj.bias)
blocks_0_fc1_weight = slot_view(blocks.0.fc1.weight)
blocks_0_fc1_bias = slot_view(blocks.0.fc1.bias)
blocks_0_fc2_weight = slot_view(blocks.0.fc2_weight)
blocks_0_fc2_bias = slot_view(blocks.0.fc2_bias)
swap_slot_b2  # swap_slot block=2 slot=2 bytes=37824
prefetch_b2_wrap  # prefetch block=2 slot=2 bytes=37824 wrap-around
wait_b3  # wait block=3 slot=0 bytes=37824 covers blocks.1.adaLN.weight, blocks.1.adaLN.bias, blocks.1.qkv.weight, blocks.1.qkv.bias, blocks.1.proj.weight, blocks.1.proj.bias, blocks.1.fc1.weight, blocks.1.fc1.bias, blocks.1.fc2_weight, blocks.1.fc2_bias
blocks_1_adaLN_weight = slot_view(blocks.1.adaLN.weight)
blocks_1_adaLN_bias = slot_view(blocks.1.adaLN.bias)
blocks_1_qkv_weight = slot_view(blocks.1.qkv.weight)
blocks_1_qkv_bias = slot_view(blocks.1.qkv.bias)
blocks_1_proj_weight = slot_view(blocks.1.proj.weight)
blocks_1_proj_bias = slot_view(blocks.1.proj.bias)
blocks_1_fc1_weight = slot_view(blocks.1.fc1.weight)
blocks_1_fc1_bias = slot_view(blocks.1.fc1.bias)
blocks_1_fc2_weight = slot_view(blocks.1.fc2_weight)
blocks_1_fc2_bias = slot_view(blocks.1.fc2_bias)
swap_slot_b3  # swap_slot block=3 slot=0 bytes=37824
prefetch_b0_wrap  # prefetch block=0 slot=0 bytes=33984 wrap-around
wait_b4  # wait block=4 slot=1 bytes=5280 covers final_adaLN.weight, final_adaLN.bias, proj_out.weight, proj_out.bias
final_adaLN_weight = slot_view(final_adaLN.weight)
final_adaLN_bias = slot_view(final_adaLN.bias)
proj_out_weight = slot_view(proj_out.weight)
proj_out_bias = slot_view(proj_out.bias)
swap_slot_b4  # swap_slot block=4 slot=1 bytes=5280
prefetch_b1_wrap  # prefetch block=1 slot=1 bytes=8384 wrap-around""")
