"""More of the diffusers zoo: the transformer classes of `zoo_models.ZOO`'s diffusers release
that `make test` leaves out, with variants for their cache and conditioning paths.

`make zoo` runs them after the classes of ``ZOO`` (``DLO_FX_ZOO=all``, tests/test_zoo.py);
the suite runs ``ZOO`` only, to stay in its time budget. Each entry is a tiny config
that keeps what makes the class itself: every block kind, its rotary embeddings, masks with
real padding, its conditioning inputs, KV caches read or filled inside ``forward``.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from zoo_models import ZooModel, _ids, _r, _t


def _dreamlite_gqa(**config):
    """DreamLite with grouped-query attention, as its pipeline's UNet builds it: the class's
    default processor does not handle ``num_kv_heads`` (a shape error in diffusers itself)."""
    from diffusers import DreamLiteTransformer2DModel
    from diffusers.models.attention_processor import Attention
    from diffusers.models.unets.unet_dreamlite import DreamLiteAttnProcessor2_0

    model = DreamLiteTransformer2DModel(**config)
    for module in model.modules():
        if isinstance(module, Attention):
            module.set_processor(DreamLiteAttnProcessor2_0())
    return model


def _flux2_kv(**config):
    """Flux2 with the KV-cache processors the Klein KV pipeline installs."""
    from diffusers import Flux2Transformer2DModel
    from diffusers.models.transformers.transformer_flux2 import (
        Flux2KVAttnProcessor, Flux2KVParallelSelfAttnProcessor)

    model = Flux2Transformer2DModel(**config)
    for block in model.transformer_blocks:
        block.attn.set_processor(Flux2KVAttnProcessor())
    for block in model.single_transformer_blocks:
        block.attn.set_processor(Flux2KVParallelSelfAttnProcessor())
    return model


def _ids4(t, h, w):
    """(h*w, 4) Flux2 ids: (t, h, w, l=0)."""
    g = torch.meshgrid(torch.tensor([float(t)]), torch.arange(float(h)), torch.arange(float(w)),
                       torch.zeros(1), indexing="ij")
    return torch.stack(g, -1).reshape(-1, 4)


# ---- AceStep: sliding + full self-attn layers, GQA, dual timestep, odd length (padding) ----
def _acestep(g):
    return dict(hidden_states=_r(g, 1, 15, 8), timestep=torch.tensor([0.7]),
                timestep_r=torch.tensor([0.3]), encoder_hidden_states=_r(g, 1, 6, 24),
                context_latents=_r(g, 1, 15, 16))


# ---- AnyFlow (bidirectional): per-frame t / r timesteps, image conditioning ----
def _anyflow(g):
    return dict(hidden_states=_r(g, 1, 2, 4, 8, 8), timestep=torch.tensor([[700.0, 650.0]]),
                r_timestep=torch.tensor([[400.0, 350.0]]), encoder_hidden_states=_r(g, 1, 6, 16),
                encoder_hidden_states_image=_r(g, 1, 4, 8))


# ---- AnyFlowFAR (causal, flex attention): training rollout with compressed context + clean copy ----
def _anyflow_far(g):
    # chunk_partition [1, 1, 1] with full_chunk_limit=2 -> 1 compressed chunk (frame 0), 2 full frames
    return dict(hidden_states=_r(g, 1, 3, 4, 8, 8), timestep=torch.tensor([[900.0, 700.0, 500.0]]),
                r_timestep=torch.tensor([[600.0, 400.0, 200.0]]), encoder_hidden_states=_r(g, 1, 6, 16),
                chunk_partition=[1, 1, 1], encoder_hidden_states_image=_r(g, 1, 4, 8),
                clean_hidden_states=_r(g, 1, 2, 4, 8, 8), clean_timestep=torch.tensor([[0.0, 0.0]]))


# ---- AnyFlowFAR autoregressive inference step reading a (pre-filled) KV cache ----
def _anyflow_far_kv(g):
    heads, hd, layers = 2, 12, 2
    # 3 chunks of 1 frame, full_chunk_limit=2: 1 compressed (4 tok), 1 cached full (16 tok), current (16 tok)
    # (pipeline sizes: full = full_chunk_limit * 16 tokens, compressed = (3 - 2 + 1) * 4 tokens)
    kv = {i: dict(compressed_cache=_r(g, 2, 1, heads, 8, hd), full_cache=_r(g, 2, 1, heads, 32, hd))
          for i in range(layers)}
    return dict(hidden_states=_r(g, 1, 1, 4, 8, 8), timestep=torch.tensor([[500.0]]),
                r_timestep=torch.tensor([[200.0]]), encoder_hidden_states=_r(g, 1, 6, 16),
                chunk_partition=[1, 1, 1], encoder_hidden_states_image=_r(g, 1, 4, 8),
                kv_cache=kv, kv_cache_flag={"is_cache_step": False, "num_cached_chunks": 2})


# ---- BriaFibo: CFG batch of 2, per-block text-encoder layers, padded prompt mask, guidance ----
def _bria_fibo(g):
    seq, tok = 6, 16
    mask = torch.ones(2, seq + tok, dtype=torch.bool)
    mask[0, 4:seq] = False
    return dict(hidden_states=_r(g, 2, tok, 4), encoder_hidden_states=_r(g, 2, seq, 32),
                text_encoder_layers=[_r(g, 2, seq, 16) for _ in range(4)],
                timestep=torch.tensor([500.0, 500.0]), img_ids=_ids(4, 4), txt_ids=torch.zeros(seq, 3),
                guidance=torch.tensor([3.5, 3.5]),
                joint_attention_kwargs={"attention_mask": mask[:, None, None, :]})


# ---- BriaFibo2: refiner + perceiver (gist tokens, padded -> gist mask) + injection block,
#      context image of another size (per-token noisy/clean modulation) ----
def _bria_fibo2(g):
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[0, :8] = True
    mask[1, :3] = True
    return dict(hidden_states=_r(g, 2, 4, 8, 8), timestep=torch.tensor([0.6, 0.6]),
                encoder_hidden_states=_r(g, 2, 2, 8, 32), encoder_attention_mask=mask,
                context_latents=[_r(g, 2, 4, 4, 4)])


# ---- ChronoEdit: I2V (added K/V image tokens, 512 text tokens hard-coded), 2-frame temporal skip RoPE ----
def _chronoedit(g):
    return dict(hidden_states=_r(g, 1, 4, 2, 8, 8), timestep=_t(g),
                encoder_hidden_states=_r(g, 1, 512, 16), encoder_hidden_states_image=_r(g, 1, 4, 8))


# ---- Cosmos3 Omni: packed und (causal text) / gen (vision + sound + action) pathways, mRoPE ----
def _cosmos3(g):
    n_txt = 6
    vis = _r(g, 1, 4, 2, 4, 4)            # C=4, T=2, H=4, W=4 -> (2, 2, 2) patches = 8 tokens
    vis_idx = torch.arange(n_txt, n_txt + 8)
    snd_idx = torch.arange(n_txt + 8, n_txt + 11)
    act_idx = torch.arange(n_txt + 11, n_txt + 13)
    L = n_txt + 13
    pos = torch.zeros(3, L, dtype=torch.long)
    pos[:, :n_txt] = torch.arange(n_txt)
    tt, hh, ww = torch.meshgrid(torch.arange(2), torch.arange(2), torch.arange(2), indexing="ij")
    pos[0, vis_idx], pos[1, vis_idx], pos[2, vis_idx] = n_txt + tt.flatten(), hh.flatten(), ww.flatten()
    pos[:, snd_idx] = (n_txt + 2 + torch.arange(3))[None]
    pos[:, act_idx] = (n_txt + 5 + torch.arange(2))[None]
    return dict(
        input_ids=torch.randint(0, 64, (n_txt,), generator=g), text_indexes=torch.arange(n_txt),
        position_ids=pos, und_len=n_txt, sequence_length=L,
        vision_tokens=[vis], vision_token_shapes=[(2, 2, 2)], vision_sequence_indexes=vis_idx,
        vision_mse_loss_indexes=vis_idx[4:], vision_timesteps=torch.full((4,), 600.0),
        vision_noisy_frame_indexes=[torch.tensor([1])],
        sound_tokens=[_r(g, 6, 3)], sound_token_shapes=[(3, 1, 1)], sound_sequence_indexes=snd_idx,
        sound_mse_loss_indexes=snd_idx, sound_timesteps=torch.full((3,), 600.0),
        sound_noisy_frame_indexes=[torch.tensor([0, 1, 2])],
        action_tokens=[_r(g, 2, 5)], action_token_shapes=[(2, 1, 1)], action_sequence_indexes=act_idx,
        action_mse_loss_indexes=act_idx, action_timesteps=torch.full((2,), 600.0),
        action_noisy_frame_indexes=[torch.tensor([0, 1])], action_domain_ids=[torch.tensor(1)])


_COSMOS3 = dict(head_dim=8, hidden_size=32, intermediate_size=64, latent_channel=4, latent_patch_size=2,
                num_attention_heads=4, num_hidden_layers=2, num_key_value_heads=2, patch_latent_dim=16,
                rope_theta=10000.0, rope_axes_dim=[2, 1, 1], vocab_size=64, action_dim=5, action_gen=True,
                num_embodiment_domains=3, sound_dim=6, sound_gen=True)


# ---- DreamLite: self-attn with RMS qk-norm + GQA + masks (linear proj); no-self-attn variant (conv proj) ----
def _dreamlite(g):
    emask = torch.ones(1, 6)
    emask[0, 4:] = 0
    return dict(hidden_states=_r(g, 1, 32, 4, 4), encoder_hidden_states=_r(g, 1, 6, 16),
                encoder_attention_mask=emask)


# ---- ErnieImage: batch of 2 with different text lengths (padding mask), 3-axis RoPE ----
def _ernie(g):
    return dict(hidden_states=_r(g, 2, 4, 8, 8), timestep=torch.tensor([500.0, 500.0]),
                text_bth=_r(g, 2, 6, 24), text_lens=torch.tensor([6, 3]))


# ---- Flux2: guidance, 4-axis RoPE, reference-image tokens (own t coordinate), attention mask ----
def _flux2(g):
    img, ref, seq = _ids4(0, 4, 4), _ids4(10, 2, 2), 6
    txt_ids = torch.zeros(seq, 4)
    txt_ids[:, 3] = torch.arange(float(seq))
    n = seq + 16 + 4
    mask = torch.ones(1, 1, 1, n, dtype=torch.bool)
    mask[..., 4:seq] = False
    return dict(hidden_states=_r(g, 1, 20, 8), encoder_hidden_states=_r(g, 1, seq, 24),
                timestep=torch.tensor([0.5]), img_ids=torch.cat([img, ref]), txt_ids=txt_ids,
                guidance=torch.tensor([4.0]), joint_attention_kwargs={"attention_mask": mask})


# ---- Flux2 Klein KV: extract mode (ref tokens self-attend, blended ref modulation, cache filled inside
#      forward) and cached mode (cached ref K/V injected between text and image tokens) ----
_FLUX2 = dict(patch_size=1, in_channels=8, num_layers=2, num_single_layers=2, attention_head_dim=16,
              num_attention_heads=2, joint_attention_dim=24, timestep_guidance_channels=32, mlp_ratio=3.0,
              axes_dims_rope=(4, 4, 4, 4))


def _flux2_kv_extract(g):
    ref, img, seq = _ids4(10, 2, 2), _ids4(0, 4, 4), 6
    txt_ids = torch.zeros(seq, 4)
    txt_ids[:, 3] = torch.arange(float(seq))
    return dict(hidden_states=_r(g, 1, 20, 8), encoder_hidden_states=_r(g, 1, seq, 24),
                timestep=torch.tensor([0.5]), img_ids=torch.cat([ref, img]), txt_ids=txt_ids,
                kv_cache_mode="extract", num_ref_tokens=4, ref_fixed_timestep=0.0)


def _flux2_kv_cached(g):
    from diffusers.models.transformers.transformer_flux2 import Flux2KVCache
    seq = 6
    txt_ids = torch.zeros(seq, 4)
    txt_ids[:, 3] = torch.arange(float(seq))
    cache = Flux2KVCache(2, 2)
    cache.num_ref_tokens = 4
    for c in cache.double_block_caches + cache.single_block_caches:
        c.store(_r(g, 1, 4, 2, 16), _r(g, 1, 4, 2, 16))
    return dict(hidden_states=_r(g, 1, 16, 8), encoder_hidden_states=_r(g, 1, seq, 24),
                timestep=torch.tensor([0.5]), img_ids=_ids4(0, 4, 4), txt_ids=txt_ids,
                kv_cache=cache, kv_cache_mode="cached")


_ANYFLOW = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4,
                out_channels=4, text_dim=16, freq_dim=32, ffn_dim=32, num_layers=2, cross_attn_norm=True,
                image_dim=8, rope_max_seq_len=32, gate_value=0.25, deltatime_type="t-r")

_A = [
    ZooModel("AceStep", "AceStepTransformer1DModel", dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, in_channels=24, audio_acoustic_hidden_dim=8, patch_size=2,
        sliding_window=3, encoder_hidden_size=24), _acestep),
    ZooModel("AnyFlow", "AnyFlowTransformer3DModel", dict(_ANYFLOW), _anyflow),
    ZooModel("AnyFlowFAR", "AnyFlowFARTransformer3DModel", dict(
        _ANYFLOW, compressed_patch_size=(1, 4, 4), full_chunk_limit=2, chunk_partition=(1, 1, 1)),
        _anyflow_far),
    ZooModel("AnyFlowFAR_kv", "AnyFlowFARTransformer3DModel", dict(
        _ANYFLOW, compressed_patch_size=(1, 4, 4), full_chunk_limit=2, chunk_partition=(1, 1, 1)),
        _anyflow_far_kv),
    ZooModel("BriaFibo", "BriaFiboTransformer2DModel", dict(
        patch_size=1, in_channels=4, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, guidance_embeds=True, axes_dims_rope=[4, 4, 8],
        text_encoder_dim=16), _bria_fibo),
    ZooModel("BriaFibo2", "BriaFibo2Transformer2DModel", dict(
        in_channels=4, patch_size=2, dim=64, n_layers=2, n_refiner_layers=2, n_heads=4, cap_feat_dim=32,
        injection_layer_ids=(1,), perceiver_num_layers=2, min_num_gist_tokens=4, max_num_gist_tokens=8,
        gist_step=2, gist_min_text_len=2, gist_max_text_len=10, axes_dims=(4, 6, 6),
        axes_lens=(16, 16, 16)), _bria_fibo2),
    ZooModel("ChronoEdit", "ChronoEditTransformer3DModel", dict(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
        text_dim=16, freq_dim=32, ffn_dim=32, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", image_dim=8, added_kv_proj_dim=24, rope_max_seq_len=32,
        rope_temporal_skip_len=4), _chronoedit),
    ZooModel("Cosmos3Omni", "Cosmos3OmniTransformer", dict(_COSMOS3), _cosmos3),
    ZooModel("Cosmos3Omni_relu2", "Cosmos3OmniTransformer", dict(
        _COSMOS3, hidden_act="relu2", qk_norm_for_text=False, use_und_k_norm_for_gen=True), _cosmos3),
    ZooModel("DreamLite", _dreamlite_gqa, dict(
        num_attention_heads=4, attention_head_dim=8, in_channels=32, num_layers=2, norm_num_groups=4,
        cross_attention_dim=16, use_linear_projection=True, qk_norm="rms_norm", num_kv_heads=2,
        ff_mult=2), _dreamlite),
    ZooModel("DreamLite_noself", "DreamLiteTransformer2DModel", dict(
        num_attention_heads=4, attention_head_dim=8, in_channels=32, num_layers=2, norm_num_groups=4,
        cross_attention_dim=16, use_self_attention=False, qk_norm="rms_norm", ff_mult=2), _dreamlite),
    ZooModel("ErnieImage", "ErnieImageTransformer2DModel", dict(
        hidden_size=32, num_attention_heads=2, num_layers=2, ffn_hidden_size=64, in_channels=4,
        out_channels=4, patch_size=2, text_in_dim=24, rope_axes_dim=(4, 6, 6)), _ernie),
    ZooModel("Flux2", "Flux2Transformer2DModel", dict(
        patch_size=1, in_channels=8, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=24, timestep_guidance_channels=32, mlp_ratio=3.0,
        axes_dims_rope=(4, 4, 4, 4), guidance_embeds=True), _flux2),
    ZooModel("Flux2KV_extract", _flux2_kv, dict(_FLUX2, guidance_embeds=False),
             _flux2_kv_extract),
    ZooModel("Flux2KV_cached", _flux2_kv, dict(_FLUX2, guidance_embeds=False),
             _flux2_kv_cached),
]


def _grid_ids4(t, h, w, l=0):
    """(t, h, w, l) position ids of a t*h*w grid, flattened."""
    g = torch.meshgrid(torch.arange(float(t)), torch.arange(float(h)), torch.arange(float(w)),
                       torch.tensor([float(l)]), indexing="ij")
    return torch.stack(g, -1).reshape(-1, 4)


def _flux3(g):
    return dict(hidden_states=_r(g, 1, 16, 8), encoder_hidden_states=_r(g, 1, 6, 32),
                timestep=torch.tensor([0.7]), img_ids=_grid_ids4(1, 4, 4),
                txt_ids=torch.stack([torch.zeros(6), torch.zeros(6), torch.zeros(6),
                                     torch.arange(6.0)], -1),
                image_cond_hidden_states=_r(g, 1, 8, 8), image_cond_ids=_grid_ids4(1, 2, 4, l=0) + torch.tensor([10.0, 0, 0, 0]),
                target_timestep=torch.tensor([0.4]))


def _glm(g):
    drop = torch.zeros(1, 16, dtype=torch.bool)
    drop[0, 3] = drop[0, 9] = True
    mask = torch.ones(1, 6)
    mask[0, 4:] = 0
    return dict(hidden_states=_r(g, 1, 4, 8, 8), encoder_hidden_states=_r(g, 1, 6, 16),
                prior_token_id=torch.randint(0, 64, (1, 16), generator=g), prior_token_drop=drop,
                timestep=_t(g), target_size=torch.tensor([[64.0, 64.0]]),
                crop_coords=torch.tensor([[0.0, 0.0]]), attention_mask=mask)


def _helios(g):
    # vanilla layout, history_sizes (long, mid, short-1x) = (4, 2, 1), window of 2 frames
    idx = torch.arange(10)
    prefix, long_, mid, one, cur = idx.split([1, 4, 2, 1, 2])
    return dict(hidden_states=_r(g, 1, 4, 2, 8, 8), timestep=_t(g),
                encoder_hidden_states=_r(g, 1, 6, 16),
                indices_hidden_states=cur[None], indices_latents_history_short=torch.cat([prefix, one])[None],
                indices_latents_history_mid=mid[None], indices_latents_history_long=long_[None],
                latents_history_short=_r(g, 1, 4, 2, 8, 8), latents_history_mid=_r(g, 1, 4, 2, 8, 8),
                latents_history_long=_r(g, 1, 4, 4, 8, 8))


def _hyimage(g):
    m1 = torch.ones(1, 6, dtype=torch.long)
    m1[0, 4:] = 0
    m2 = torch.ones(1, 4, dtype=torch.long)
    m2[0, 3:] = 0
    return dict(hidden_states=_r(g, 1, 4, 8, 8), timestep=_t(g).float(),
                encoder_hidden_states=_r(g, 1, 6, 16), encoder_attention_mask=m1,
                timestep_r=_t(g).float(), encoder_hidden_states_2=_r(g, 1, 4, 8),
                encoder_attention_mask_2=m2, guidance=torch.tensor([3500.0]))


def _framepack(g):
    # vanilla sampling, history_sizes (4x, 2x, 1x) = (4, 2, 1), window of 2 frames
    idx = torch.arange(10)
    prefix, i4, i2, i1, cur = idx.split([1, 4, 2, 1, 2])
    mask = torch.ones(1, 6, dtype=torch.long)
    mask[0, 4:] = 0
    return dict(hidden_states=_r(g, 1, 4, 2, 8, 8), timestep=_t(g).float(),
                encoder_hidden_states=_r(g, 1, 6, 16), encoder_attention_mask=mask,
                pooled_projections=_r(g, 1, 8), image_embeds=_r(g, 1, 3, 12), indices_latents=cur,
                guidance=torch.tensor([6000.0]),
                latents_clean=_r(g, 1, 4, 2, 8, 8), indices_latents_clean=torch.cat([prefix, i1]),
                latents_history_2x=_r(g, 1, 4, 2, 8, 8), indices_latents_history_2x=i2,
                latents_history_4x=_r(g, 1, 4, 4, 8, 8), indices_latents_history_4x=i4)


def _ideogram(g):
    # packed [left-pad][text][image] layout, two prompts of 6 and 4 text tokens, 4x4 image grid
    max_text, gh, gw = 6, 4, 4
    n_img = gh * gw
    L = max_text + n_img
    hh = torch.arange(gh).view(-1, 1).expand(gh, gw).reshape(-1)
    ww = torch.arange(gw).view(1, -1).expand(gh, gw).reshape(-1)
    img_pos = torch.stack([torch.zeros_like(hh), hh, ww], 1) + 65536
    pos = torch.zeros(2, L, 3, dtype=torch.long)
    seg = torch.full((2, L), -1, dtype=torch.long)
    ind = torch.zeros(2, L, dtype=torch.long)
    for b, n in enumerate((6, 4)):
        off = max_text - n
        tp = torch.arange(n)
        pos[b, off:off + n] = torch.stack([tp, tp, tp], 1)
        pos[b, off + n:] = img_pos
        ind[b, off:off + n] = 3
        ind[b, off + n:] = 2
        seg[b, off:] = 1
    return dict(hidden_states=_r(g, 2, L, 8), timestep=torch.tensor([0.3, 0.3]),
                encoder_hidden_states=_r(g, 2, L, 24), position_ids=pos, segment_ids=seg, indicator=ind)


def _joyplus(g):
    # two samples: target 1x4x4 + reference 1x2x2 (20 patches, padded to 24), target 1x4x4 + ref 1x4x2
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, 4:] = 0
    return dict(hidden_states=_r(g, 2, 24, 4, 1, 2, 2), timestep=torch.tensor([500.0, 500.0]),
                encoder_hidden_states=_r(g, 2, 6, 16), encoder_hidden_states_mask=mask,
                shape_list=[[(1, 4, 4), (1, 2, 2)], [(1, 4, 4), (1, 4, 2)]])


_B = [
    ZooModel("Flux3", "Flux3Transformer2DModel", dict(
        in_channels=8, cond_in_channels=8, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, timestep_channels=32, mlp_ratio=2.0,
        axes_dims_rope=(4, 4, 4, 4), flow_map=True),
        _flux3),
    ZooModel("GlmImage", "GlmImageTransformer2DModel", dict(
        patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=8,
        num_attention_heads=2, text_embed_dim=16, time_embed_dim=16, condition_dim=8,
        prior_vq_quantizer_codebook_size=64),
        _glm),
    ZooModel("Helios", "HeliosTransformer3DModel", dict(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4,
        out_channels=4, text_dim=16, freq_dim=32, ffn_dim=64, num_layers=2, rope_dim=(4, 6, 6),
        guidance_cross_attn=True, zero_history_timestep=True, has_multi_term_memory_patch=True,
        is_amplify_history=True, history_scale_mode="per_head"),
        _helios),
    ZooModel("HunyuanImage", "HunyuanImageTransformer2DModel", dict(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=2,
        num_single_layers=2, num_refiner_layers=2, mlp_ratio=2.0, patch_size=(2, 2),
        guidance_embeds=True, text_embed_dim=16, text_embed_2_dim=8, rope_axes_dim=(8, 8),
        use_meanflow=True),
        _hyimage),
    ZooModel("HunyuanVideoFramepack", "HunyuanVideoFramepackTransformer3DModel", dict(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=2,
        num_single_layers=2, num_refiner_layers=2, mlp_ratio=2.0, patch_size=2, patch_size_t=1,
        guidance_embeds=True, text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(4, 6, 6),
        has_image_proj=True, image_proj_dim=12, has_clean_x_embedder=True),
        _framepack),
    ZooModel("Ideogram4", "Ideogram4Transformer2DModel", dict(
        in_channels=8, num_layers=2, attention_head_dim=16, num_attention_heads=2,
        intermediate_size=64, adaln_dim=16, llm_features_dim=24, rope_theta=10000,
        mrope_section=(4, 2, 2)),
        _ideogram),
    ZooModel("JoyImageEditPlus", "JoyImageEditPlusTransformer3DModel", dict(
        patch_size=[1, 2, 2], in_channels=4, hidden_size=32, num_attention_heads=2, text_dim=16,
        mlp_width_ratio=2.0, num_layers=2, rope_dim_list=[4, 6, 6]),
        _joyplus),
    ZooModel("JoyImageEdit", "JoyImageEditTransformer3DModel", dict(
        patch_size=[1, 2, 2], in_channels=4, hidden_size=32, num_attention_heads=2, text_dim=16,
        mlp_width_ratio=2.0, num_layers=2, rope_dim_list=[4, 6, 6], rope_type="mrope"),
        lambda g: dict(hidden_states=_r(g, 1, 2, 4, 1, 8, 8), timestep=torch.tensor([500.0]),
                       encoder_hidden_states=_r(g, 1, 6, 16))),
    ZooModel("Kandinsky5", "Kandinsky5Transformer3DModel", dict(
        in_visual_dim=4, in_text_dim=16, in_text_dim2=8, time_dim=16, out_visual_dim=4,
        patch_size=(1, 2, 2), model_dim=32, ff_dim=64, num_text_blocks=2, num_visual_blocks=2,
        axes_dims=(4, 6, 6), visual_cond=True),
        lambda g: dict(hidden_states=_r(g, 1, 2, 8, 8, 9), encoder_hidden_states=_r(g, 1, 6, 16),
                       timestep=torch.tensor([500.0]), pooled_projections=_r(g, 1, 8),
                       visual_rope_pos=[torch.arange(2), torch.arange(4), torch.arange(4)],
                       text_rope_pos=torch.arange(6), scale_factor=(1.0, 2.0, 2.0))),
    ZooModel("Kandinsky6SR", "Kandinsky6SRTransformer3DModel", dict(
        in_visual_dim=4, out_visual_dim=8, time_dim=16, patch_size=(1, 1, 1), model_dim=32, ff_dim=64,
        num_visual_blocks=2, axes_dims=(4, 6, 6), scale_factor=(1.0, 2.0, 2.0), nabla_threshold=0.8,
        nabla_window=(3, 3, 3)),
        lambda g: dict(hidden_states=_r(g, 1, 2, 8, 8, 9), timestep=torch.tensor([500.0]))),
]


def _glm_kv(g):
    from diffusers.models.transformers.transformer_glm_image import GlmImageKVCache
    kv = GlmImageKVCache(2)
    for c in kv.caches:
        c.store(_r(g, 1, 5, 2, 8), _r(g, 1, 5, 2, 8))
    kv.set_mode("read")
    out = _glm(g)
    out["kv_caches"] = kv
    out.pop("attention_mask")  # diffusers does not extend the text mask over cached keys
    return out


def _framepack_b2(g):
    out = _framepack(g)
    for k in ("hidden_states", "encoder_hidden_states", "pooled_projections", "image_embeds", "latents_clean",
              "latents_history_2x", "latents_history_4x"):
        out[k] = torch.cat([out[k], _r(g, *out[k].shape)])
    out["timestep"] = out["timestep"].repeat(2)
    out["guidance"] = out["guidance"].repeat(2)
    m = torch.ones(2, 6, dtype=torch.long)
    m[0, 4:] = 0
    m[1, 5:] = 0
    out["encoder_attention_mask"] = m
    return out


def _ideogram_tok(g):
    out = _ideogram(g)
    out["timestep"] = torch.rand(2, out["hidden_states"].shape[1], generator=g)
    return out


EXTRA = [
    ZooModel("GlmImageKV", "GlmImageTransformer2DModel", _B[1].config, _glm_kv),
    ZooModel("FramepackB2", "HunyuanVideoFramepackTransformer3DModel", _B[4].config, _framepack_b2),
    ZooModel("Ideogram4Tok", "Ideogram4Transformer2DModel", _B[5].config, _ideogram_tok),
]
_B = _B + EXTRA


def _kandinsky6(g):
    mask = torch.ones(1, 6, dtype=torch.bool)
    mask[:, 4:] = False  # padded prompt
    return dict(hidden_states=_r(g, 1, 3, 8, 8, 9),  # (B, T, H, W, 2*in+1) with visual_cond
                encoder_hidden_states=_r(g, 1, 6, 24), pooled_projections=_r(g, 1, 12),
                timestep=_t(g).float(), audio_hidden_states=_r(g, 1, 10, 6),
                visual_rope_pos=(torch.tensor([0, 1, 0]), torch.arange(4), torch.arange(4)),
                encoder_attention_mask=mask, visual_token_type_ids=torch.tensor([[0, 0, 1]]))


def _krea2(g):
    mask = torch.ones(1, 6, dtype=torch.bool)
    mask[:, 5:] = False
    pos = torch.cat([torch.zeros(6, 3), _ids(4, 4)], 0)
    return dict(hidden_states=_r(g, 1, 16, 8), encoder_hidden_states=_r(g, 1, 6, 3, 32),
                timestep=torch.rand(1, generator=g), position_ids=pos, encoder_attention_mask=mask)


def _ltx2(g):
    b, f, h, w = 2, 2, 4, 4
    n = f * h * w
    enc_mask = torch.ones(b, 8)
    enc_mask[:, 6:] = 0
    a_mask = torch.ones(b, 5)
    a_mask[1, 4:] = 0
    self_mask = torch.ones(b, n, n)
    self_mask[:, : n // 2, n // 2:] = 0.5  # attention strength to "reference" tokens
    kf = torch.zeros(b, n, 1)
    kf[:, : h * w] = 1
    return dict(hidden_states=_r(g, b, n, 8), audio_hidden_states=_r(g, b, 6, 8),
                encoder_hidden_states=_r(g, b, 8, 24), audio_encoder_hidden_states=_r(g, b, 5, 24),
                timestep=torch.tensor([700.0, 700.0]), audio_timestep=torch.tensor([500.0, 500.0]),
                sigma=torch.tensor([0.7, 0.7]), audio_sigma=torch.tensor([0.5, 0.5]),
                encoder_attention_mask=enc_mask, audio_encoder_attention_mask=a_mask,
                num_frames=f, height=h, width=w, fps=24.0, audio_num_frames=6,
                spatio_temporal_guidance_blocks=[1], perturbation_mask=torch.tensor([1.0, 0.0]),
                use_cross_timestep=True, video_self_attention_mask=self_mask, video_keyframes_mask=kf)


def _longcat_audio(g):
    text_mask = torch.ones(1, 6, dtype=torch.bool)
    text_mask[:, 5:] = False
    mask = torch.ones(1, 12, dtype=torch.bool)
    mask[:, 10:] = False
    return dict(hidden_states=_r(g, 1, 12, 8), encoder_hidden_states=_r(g, 1, 6, 16),
                encoder_attention_mask=text_mask, timestep=torch.rand(1, generator=g),
                attention_mask=mask, latent_cond=_r(g, 1, 12, 8))


def _minimax_h3(g):
    # packed layout: 4 text rows, 5 audio rows, 4 conditioning video rows, 8 target video rows
    n_txt, n_aud, n_cond, n_vid = 4, 5, 4, 8
    seq = n_txt + n_aud + n_cond + n_vid
    text_idx = torch.arange(0, n_txt)
    audio_idx = torch.arange(n_txt, n_txt + n_aud)
    video_idx = torch.arange(n_txt + n_aud, seq)
    tags = torch.zeros(seq, dtype=torch.long)
    tags[text_idx] = 1
    tags[audio_idx] = 2
    t_idx = torch.zeros(seq, dtype=torch.long)  # text + cond video at t index 0
    t_idx[audio_idx] = 2
    t_idx[n_txt + n_aud + n_cond:] = 1
    pos = torch.zeros(seq, 3)
    pos[audio_idx, 0] = torch.arange(n_aud).float()
    pos[n_txt + n_aud: n_txt + n_aud + n_cond] = _ids(2, 2)
    tgt = _ids(2, 4)
    tgt[:, 0] = 1.0
    pos[n_txt + n_aud + n_cond:] = tgt
    return dict(hidden_states=_r(g, 1, n_cond + n_vid, 16), audio_hidden_states=_r(g, 1, n_aud, 6),
                encoder_hidden_states=_r(g, 1, n_txt, 16), timestep=torch.tensor([0.0, 0.7, 0.4]),
                timestep_indices=t_idx, token_tags=tags, position_ids=pos, video_indices=video_idx,
                audio_indices=audio_idx, text_indices=text_idx)


def _motif(g):
    mask = torch.ones(1, 6)
    mask[:, 4:] = 0
    return dict(hidden_states=_r(g, 1, 4, 2, 8, 8), timestep=_t(g), encoder_hidden_states=_r(g, 1, 6, 16),
                encoder_attention_mask=mask, image_embeds=_r(g, 1, 3, 12))


def _nucleus(g):
    mask = torch.ones(1, 6, dtype=torch.bool)
    mask[:, 4:] = False
    return dict(hidden_states=_r(g, 1, 16, 16), img_shapes=[(1, 4, 4)],
                encoder_hidden_states=_r(g, 1, 6, 32), encoder_hidden_states_mask=mask,
                timestep=torch.tensor([0.6]))


def _ovis(g):
    mask = torch.ones(1, 6 + 16, dtype=torch.bool)
    mask[:, 4:6] = False  # padded text tokens
    txt_ids = torch.zeros(6, 3)
    txt_ids[:, 1] = torch.arange(6.0)
    return dict(hidden_states=_r(g, 1, 16, 4), encoder_hidden_states=_r(g, 1, 6, 32),
                timestep=torch.tensor([0.5]), img_ids=_ids(4, 4), txt_ids=txt_ids,
                joint_attention_kwargs={"attention_mask": mask})


_C = [
    ZooModel("Kandinsky6", "Kandinsky6Transformer3DModel", dict(
        in_visual_dim=4, out_visual_dim=4, in_text_dim=24, in_text_dim2=12, time_dim=16,
        patch_size=(1, 2, 2), model_dim=32, ff_dim=64, num_text_blocks=2, num_visual_blocks=2,
        axes_dims=(4, 6, 6), visual_cond=True, in_audio_dim=6, out_audio_dim=6, model_dim_a=32,
        time_dim_a=16, ff_dim_a=48, text_token_padding=True, ca_rope=True, cross_gates=True,
        fix_modulation=True, visual_token_type_num_embeddings=2),
        _kandinsky6),
    ZooModel("Krea2", "Krea2Transformer2DModel", dict(
        in_channels=8, num_layers=2, attention_head_dim=16, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, timestep_embed_dim=16, text_hidden_dim=32,
        num_text_layers=3, text_num_attention_heads=2, text_num_key_value_heads=2,
        text_intermediate_size=48, num_layerwise_text_blocks=2, num_refiner_text_blocks=2,
        axes_dims_rope=(4, 6, 6)),
        _krea2),
    ZooModel("LTX2", "LTX2VideoTransformer3DModel", dict(
        in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=16,
        cross_attention_dim=32, gated_attn=True, cross_attn_mod=True, audio_in_channels=8,
        audio_out_channels=8, audio_num_attention_heads=2, audio_attention_head_dim=8,
        audio_cross_attention_dim=16, audio_gated_attn=True, audio_cross_attn_mod=True, num_layers=2,
        caption_channels=24, rope_type="split", perturbed_attn=True, use_keyframes_abs_pos_embedding=True),
        _ltx2),
    ZooModel("LongCatAudioDiT", "LongCatAudioDiTTransformer", dict(
        dit_dim=32, dit_depth=2, dit_heads=2, dit_text_dim=16, latent_dim=8, cross_attn=True,
        adaln_type="global", adaln_use_text_cond=True, long_skip=True, text_conv=True, qk_norm=True,
        cross_attn_norm=True, use_latent_condition=True, ff_mult=2.0),
        _longcat_audio),
    ZooModel("LongCatImage", "LongCatImageTransformer2DModel", dict(
        patch_size=1, in_channels=4, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 6, 6]),
        lambda g: dict(hidden_states=_r(g, 1, 16, 4), encoder_hidden_states=_r(g, 1, 6, 32),
                       timestep=torch.tensor([0.5]), img_ids=_ids(4, 4), txt_ids=torch.zeros(6, 3))),
    ZooModel("MiniMaxH3", "MiniMaxH3Transformer3DModel", dict(
        num_attention_heads=2, attention_head_dim=16, hidden_size=24, num_layers=2, num_refiner_layers=2,
        ffn_dim=48, in_channels=4, audio_in_channels=6, patch_size=(1, 2, 2), text_dim=16, freq_dim=16,
        time_embed_hidden_dim=32, time_embed_dim=24, rope_freq_dim=2),
        _minimax_h3),
    ZooModel("MiniMaxMusic3", "MiniMaxMusic3Transformer1DModel", dict(
        in_channels=4, condition_dim=8, num_layers=2, num_attention_heads=2, attention_head_dim=16,
        ff_inner_dim=32, rotary_dim=8, fourier_embedding_dim=16),
        lambda g: dict(hidden_states=_r(g, 1, 4, 12), timestep=torch.rand(1, generator=g),
                       encoder_hidden_states=_r(g, 1, 12, 8))),
    ZooModel("MotifVideo", "MotifVideoTransformer3DModel", dict(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=2,
        num_single_layers=3, num_decoder_layers=1, mlp_ratio=2.0, patch_size=2, patch_size_t=1,
        text_embed_dim=16, image_embed_dim=12, rope_axes_dim=(4, 6, 6),
        enable_text_cross_attention_dual=True, enable_text_cross_attention_single=True),
        _motif),
    ZooModel("NucleusMoEImage", "NucleusMoEImageTransformer2DModel", dict(
        patch_size=2, in_channels=16, out_channels=4, num_layers=3, attention_head_dim=16,
        num_attention_heads=4, num_key_value_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6),
        mlp_ratio=3.0, moe_enabled=True, dense_moe_strategy="leave_first_block_dense", num_experts=4,
        moe_intermediate_dim=32, capacity_factors=2.0),
        _nucleus),
    ZooModel("OvisImage", "OvisImageTransformer2DModel", dict(
        patch_size=1, in_channels=4, out_channels=4, num_layers=2, num_single_layers=2,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6)),
        _ovis),
]


# --- PRX ---------------------------------------------------------------------------------------
PRX_CFG = dict(in_channels=4, patch_size=2, context_in_dim=16, hidden_size=32, mlp_ratio=2.0,
               num_heads=2, depth=2, axes_dim=[8, 8], bottleneck_size=8, resolution_embeds=True)


def _prx_inputs(g):
    mask = torch.ones(1, 6, dtype=torch.bool)
    mask[:, -2:] = False
    return dict(hidden_states=_r(g, 1, 4, 8, 8), timestep=torch.rand(1, generator=g),
                encoder_hidden_states=_r(g, 1, 6, 16), attention_mask=mask)


# --- QwenImage 2.1 -------------------------------------------------------------------------------
QI21_CFG = dict(patch_size=1, in_channels=8, out_channels=8, num_layers=2, attention_head_dim=16,
                num_attention_heads=2, context_in_dim=16, mlp_ratio=2, axes_dims_rope=(4, 6, 6))
# VLM sequence: 3 text, 1 condition-image slot (2x2 latents), 3 text; then 4 target slots (4x4).
_QI21_IMG_MASK = torch.tensor([[0, 0, 0, 1, 0, 0, 0, 1, 1, 1, 1]], dtype=torch.bool)


def _qi21_inputs(g, cached=False):
    text_mask = torch.ones(1, 7, dtype=torch.bool)
    text_mask[:, -1] = False  # right-padded prompt
    out = dict(hidden_states=_r(g, 1, 4 + 16, 8), encoder_hidden_states=_r(g, 1, 7, 16),
               timestep=torch.tensor([0.6]), img_shapes=[[(1, 2, 2), (1, 4, 4)]],
               img_mask=_QI21_IMG_MASK.clone(), encoder_hidden_states_mask=text_mask)
    if cached:
        from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache
        cache = QwenImage21KVCache(2)
        prefix = 6 + 4  # text tokens + condition-image tokens
        for layer in cache.layer_caches:
            layer.store(_r(g, 1, prefix, 2, 16), _r(g, 1, prefix, 2, 16))
        out.update(kv_cache=cache, kv_cache_mode="cached")
    return out


# --- RFD4 Proteina -------------------------------------------------------------------------------
RFD4_CFG = dict(
    nlayers=2, token_dim=32, nheads=2, dim_cond=16, pair_repr_dim=16, latent_dim=4,
    token_type_emb_dim=8, cath_emb_dim=4, t_emb_dim=16, seq_sep_dim=8, xt_pair_dist_dim=8,
    feats_seq=("xt_bb_ca", "xt_local_latents", "token_type", "sequence_probabilities",
               "cond_a37coors_nm", "secondary_structure", "hotspot", "atom_charge",
               "atomic_element", "chain_centroid_xyz"),
    feats_cond_seq=("time_emb_bb_ca", "time_emb_local_latents", "cath_code", "recycle_remaining"),
    feats_pair_repr=("xt_bb_ca_pair_dists", "bond_mask", "bond_order", "molecule_idx_pair",
                     "token_bond_path_length"),
    feats_pair_cond=("time_emb_bb_ca", "time_emb_local_latents"),
    update_pair_repr_every_n=1, tri_mult_c=8, num_sequence_classes=10, recycle_conditioning_dim=2)


def _rfd4_inputs(g):
    B, N = 1, 8
    pad = torch.ones(B, N, dtype=torch.bool)
    pad[:, -2:] = False
    token_type = torch.randint(0, 7, (B, N), generator=g)
    token_type[:, 2] = 3  # an atomized token, so the charge/element embeddings contribute
    atom37 = torch.rand(B, N, 37, generator=g) > 0.5
    coords = _r(g, B, N, 37, 3)
    coords[:, :, 20:] = float("nan")  # absent atoms
    in_ctx = torch.zeros(B, N, dtype=torch.bool)
    in_ctx[:, 0] = True
    cond = {
        "is_in_context_conditioning": in_ctx,
        "supports_local_latent": torch.ones(B, N, dtype=torch.bool),
        "condition_sequence-probability-ALA_1_residue": torch.rand(B, N, generator=g),
        "condition_sequence-probability-GLY_1_residue": torch.rand(B, N, generator=g),
        "condition_coordinate_1_atom": coords,
        "condition_secondary-structure_1_residue": torch.randint(0, 4, (B, N), generator=g),
        "condition_hotspot_1_atom": torch.randint(0, 2, (B, N, 37), generator=g),
        "charge": torch.randint(-2, 3, (B, N, 2), generator=g),
        "element": torch.randint(0, 20, (B, N, 2), generator=g),
        "condition_ChainCentroid_1_atom": _r(g, B, N, 3),
        "condition_cath-label_1_residue": torch.stack([torch.randint(-1, 5, (B, N), generator=g),
                                                       torch.randint(-1, 43, (B, N), generator=g),
                                                       torch.randint(-1, 1472, (B, N), generator=g)], -1),
        "bond_mask": (torch.rand(B, N, N, generator=g) > 0.7),
        "bond_order": torch.randint(0, 5, (B, N, N), generator=g),
        "molecule_iid": torch.tensor([[0, 0, 0, 1, 1, 1, 2, 2]]),
        "token_bond_path_length": torch.randint(0, 12, (B, N, N), generator=g),
    }
    return dict(bb_ca=_r(g, B, N, 3), local_latents=_r(g, B, N, 4), bb_ca_time=torch.rand(B, generator=g),
                local_latents_time=torch.rand(B, generator=g), padding_mask=pad, token_type=token_type,
                atom37_mask=atom37, conditioning=cond, recycle_depth=2)


# --- SANA-WM -------------------------------------------------------------------------------------
SANAWM_CFG = dict(in_channels=8, num_layers=2, hidden_size=32, num_attention_heads=2,
                  patch_size=(1, 1, 1), softmax_every_n=2, linear_head_dim=16, caption_channels=16,
                  mlp_ratio=2.0, chunk_plucker_channels=12, chunk_plucker_post_attn_blocks=20,
                  cam_attn_compress=1)


def _camera(g, frames=5):
    from diffusers.pipelines.sana_wm.cam_utils import prepare_camera
    poses = []
    for i in range(frames):
        a = 0.05 * i + 0.01 * float(torch.rand(1, generator=g))
        c, s = math.cos(a), math.sin(a)
        pose = np.eye(4, dtype=np.float32)
        pose[:3, :3] = [[c, 0, s], [0, 1, 0], [-s, 0, c]]
        pose[:3, 3] = [0.1 * i, 0.02 * i, -0.05 * i]
        poses.append(pose)
    intr = np.tile(np.array([[12.0, 12.0, 8.0, 8.0]], dtype=np.float32), (frames, 1))
    return prepare_camera(np.stack(poses), intr, target_size=(16, 16), vae_stride=(2, 4, 4))


def _sanawm_inputs(g):
    cam = _camera(g)  # raymap (3, 20), chunk_plucker (12, 3, 4, 4)
    mask = torch.ones(1, 6, dtype=torch.long)
    mask[:, -2:] = 0
    return dict(hidden_states=_r(g, 1, 8, 3, 4, 4), timestep=torch.tensor([[[0.0, 700.0, 700.0]]]),
                encoder_hidden_states=_r(g, 1, 1, 6, 16), mask=mask,
                camera_conditions=cam["raymap"][None], chunk_plucker=cam["chunk_plucker"][None],
                frame_valid_mask=torch.tensor([[1.0, 1.0, 0.0]]))


# --- SANA-WM LTX-2 refiner -----------------------------------------------------------------------
REFINER_CFG = dict(in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=16,
                   cross_attention_dim=32, gated_attn=True, audio_in_channels=4, audio_out_channels=4,
                   audio_num_attention_heads=2, audio_attention_head_dim=4,
                   audio_cross_attention_dim=8, num_layers=2, caption_channels=16)


def _refiner_inputs(g, cache=False):
    import diffusers
    torch.manual_seed(123)  # only the RoPE helper below is used from this throwaway instance
    helper = diffusers.SanaWMLTX2RefinerTransformer3DModel(**REFINER_CFG)
    rope = helper.build_rotary_emb_for_absolute_positions(1, [3, 4], 4, 4, torch.device("cpu"), fps=24.0)
    mask = torch.ones(1, 6)
    mask[:, -2:] = 0
    out = dict(hidden_states=_r(g, 1, 2 * 16, 8), encoder_hidden_states=_r(g, 1, 6, 16),
               timestep=torch.rand(1, 2 * 16, generator=g) * 1000, video_rotary_emb=rope,
               encoder_attention_mask=mask)
    if cache:
        from diffusers.models.transformers.transformer_sana_wm_refiner import SanaWMRefinerKVCache
        kv = SanaWMRefinerKVCache(2)
        for layer in kv.layer_caches:
            layer.store_sink(_r(g, 1, 16, 32), _r(g, 1, 16, 32))
            layer.store_history(_r(g, 1, 16, 32), _r(g, 1, 16, 32))
        kv.sink_pe = helper.build_rotary_emb_for_absolute_positions(1, [1], 4, 4, torch.device("cpu"),
                                                                    fps=24.0)
        out.update(kv_cache=kv, kv_cache_mode="inject_and_capture_post_rope")
    return out


# --- Wan Animate ---------------------------------------------------------------------------------
WANANIM_CFG = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=12,
                   latent_channels=4, out_channels=4, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2,
                   image_dim=16, added_kv_proj_dim=32, rope_max_seq_len=32,
                   motion_encoder_channel_sizes={"8": 8, "4": 8}, motion_encoder_size=8,
                   motion_style_dim=16, motion_dim=4, motion_encoder_dim=16, face_encoder_hidden_dim=16,
                   face_encoder_num_heads=2, inject_face_latents_blocks=1, motion_encoder_batch_size=2)


def _wananim_inputs(g):
    # 3 latent frames (reference + 2), 5 face frames -> 2 motion frames (+1 pad) = 3, tokens 3 * 4.
    return dict(hidden_states=_r(g, 1, 12, 3, 4, 4), timestep=_t(g), encoder_hidden_states=_r(g, 1, 512, 32),
                encoder_hidden_states_image=_r(g, 1, 4, 16), pose_hidden_states=_r(g, 1, 4, 2, 4, 4),
                face_pixel_values=_r(g, 1, 3, 5, 8, 8))


# --- Wan Animate 2 -------------------------------------------------------------------------------
WANANIM2_CFG = dict(patch_size=(1, 2, 2), text_len=8, in_dim=8, dim=32, ffn_dim=64, freq_dim=32,
                    text_dim=16, out_dim=4, num_heads=2, num_layers=2)


def _wananim2_inputs(g, cached=False):
    from diffusers.models.transformers.transformer_wan_animate_2 import WanAnimate2KVCache
    cache = WanAnimate2KVCache(2)
    ref_grid = torch.tensor([[2, 2, 2]])
    out = dict(timestep=torch.tensor([700.0]), encoder_hidden_states=[_r(g, 5, 16)],
               encoder_hidden_states_image=_r(g, 1, 3, 1280), kv_cache=cache)
    if not cached:  # reference pass: 2 frames of 4x4 latents -> 8 tokens
        out.update(hidden_states=[_r(g, 4, 2, 4, 4)], condition_latents=[_r(g, 4, 2, 4, 4)],
                   kv_cache_mode="extract", seq_len=8, offset_grid_sizes=ref_grid)
    else:  # generation pass over 3 frames against a filled reference cache
        for layer in cache.layer_caches:
            layer.store(_r(g, 1, 8, 2, 16), _r(g, 1, 8, 2, 16))
        out.update(hidden_states=[_r(g, 4, 3, 4, 4)], condition_latents=[_r(g, 4, 3, 4, 4)],
                   kv_cache_mode="cached", seq_len=12, reference_grid_sizes=ref_grid, origin_len=8,
                   origin_area=[32, 32])
    return out


# --- Wan VACE ------------------------------------------------------------------------------------
WANVACE_CFG = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4,
                   out_channels=4, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=3, cross_attn_norm=True,
                   qk_norm="rms_norm_across_heads", image_dim=16, added_kv_proj_dim=32, rope_max_seq_len=32,
                   vace_layers=[0, 2], vace_in_channels=8)


def _wanvace_inputs(g):
    return dict(hidden_states=_r(g, 1, 4, 2, 8, 8), timestep=_t(g), encoder_hidden_states=_r(g, 1, 512, 32),
                encoder_hidden_states_image=_r(g, 1, 4, 16), control_hidden_states=_r(g, 1, 8, 2, 8, 8),
                control_hidden_states_scale=torch.tensor([1.0, 0.5]))


# --- Transformer2DModel --------------------------------------------------------------------------
T2D_PIXART_CFG = dict(num_attention_heads=3, attention_head_dim=8, in_channels=4, out_channels=8,
                      num_layers=2, cross_attention_dim=24, attention_bias=True, sample_size=8, patch_size=2,
                      activation_fn="gelu-approximate", num_embeds_ada_norm=1000, norm_type="ada_norm_single",
                      norm_elementwise_affine=False, norm_eps=1e-6, caption_channels=12,
                      use_additional_conditions=True)


def _t2d_pixart_inputs(g):
    mask = torch.ones(1, 6)
    mask[:, -2:] = 0
    return dict(hidden_states=_r(g, 1, 4, 8, 8), encoder_hidden_states=_r(g, 1, 6, 12), timestep=_t(g),
                added_cond_kwargs={"resolution": torch.tensor([[64.0, 64.0]]),
                                   "aspect_ratio": torch.tensor([[1.0]])},
                encoder_attention_mask=mask)


T2D_CONT_CFG = dict(num_attention_heads=2, attention_head_dim=8, in_channels=8, num_layers=2,
                    norm_num_groups=4, cross_attention_dim=16, use_linear_projection=True)


def _t2d_cont_inputs(g):
    mask = torch.ones(1, 6)
    mask[:, -1] = 0
    return dict(hidden_states=_r(g, 1, 8, 8, 8), encoder_hidden_states=_r(g, 1, 6, 16),
                encoder_attention_mask=mask)


T2D_VEC_CFG = dict(num_attention_heads=2, attention_head_dim=8, num_vector_embeds=17, sample_size=4,
                   num_layers=2, cross_attention_dim=16, norm_type="ada_norm", num_embeds_ada_norm=100,
                   attention_bias=True, activation_fn="geglu-approximate")


def _t2d_vec_inputs(g):
    return dict(hidden_states=torch.randint(0, 17, (1, 16), generator=g),
                encoder_hidden_states=_r(g, 1, 6, 16), timestep=torch.randint(0, 100, (), generator=g))  # VQ-Diffusion passes a 0-d step


# --- PriorTransformer ----------------------------------------------------------------------------
PRIOR_CFG = dict(num_attention_heads=2, attention_head_dim=8, num_layers=2, embedding_dim=16,
                 num_embeddings=6, additional_embeddings=4, norm_in_type="layer",
                 embedding_proj_norm_type="layer", time_embed_dim=16, clip_embed_dim=16)


def _prior_inputs(g):
    mask = torch.ones(1, 6, dtype=torch.bool)
    mask[:, -2:] = False
    return dict(hidden_states=_r(g, 1, 16), timestep=_t(g), proj_embedding=_r(g, 1, 16),
                encoder_hidden_states=_r(g, 1, 6, 16), attention_mask=mask)


# --- UNet2DConditionModel (SD-1.5-like) ----------------------------------------------------------
UNET_CFG = dict(sample_size=8, in_channels=4, out_channels=4, block_out_channels=(16, 32),
                layers_per_block=2, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=16,
                attention_head_dim=4, norm_num_groups=8)


def _unet_inputs(g, control=False):
    mask = torch.ones(1, 6)
    mask[:, -1] = 0
    out = dict(sample=_r(g, 1, 4, 8, 8), timestep=_t(g), encoder_hidden_states=_r(g, 1, 6, 16),
               encoder_attention_mask=mask)
    if control:  # ControlNet residuals: conv_in, 2 resnets + downsampler, 2 resnets; and the mid block
        shapes = [(16, 8, 8)] * 3 + [(16, 4, 4)] + [(32, 4, 4)] * 2
        out["down_block_additional_residuals"] = tuple(_r(g, 1, *s) * 0.1 for s in shapes)
        out["mid_block_additional_residual"] = _r(g, 1, 32, 4, 4) * 0.1
    return out


_D = [
    ZooModel("PRX", "PRXTransformer2DModel", PRX_CFG, _prx_inputs),
    ZooModel("QwenImage21", "QwenImage21Transformer2DModel", QI21_CFG, _qi21_inputs),
    ZooModel("QwenImage21KV", "QwenImage21Transformer2DModel", QI21_CFG,
             lambda g: _qi21_inputs(g, cached=True)),
    ZooModel("RFD4Proteina", "RFD4ProteinaTransformer", RFD4_CFG, _rfd4_inputs),
    ZooModel("SanaWM", "SanaWMTransformer3DModel", SANAWM_CFG, _sanawm_inputs),
    ZooModel("SanaWMRefiner", "SanaWMLTX2RefinerTransformer3DModel", REFINER_CFG, _refiner_inputs),
    ZooModel("SanaWMRefinerKV", "SanaWMLTX2RefinerTransformer3DModel", REFINER_CFG,
             lambda g: _refiner_inputs(g, cache=True)),
    ZooModel("WanAnimate", "WanAnimateTransformer3DModel", WANANIM_CFG, _wananim_inputs),
    ZooModel("WanAnimate2", "WanAnimate2Transformer3DModel", WANANIM2_CFG, _wananim2_inputs),
    ZooModel("WanAnimate2Cached", "WanAnimate2Transformer3DModel", WANANIM2_CFG,
             lambda g: _wananim2_inputs(g, cached=True)),
    ZooModel("WanVACE", "WanVACETransformer3DModel", WANVACE_CFG, _wanvace_inputs),
    ZooModel("T2DPixArtAlpha", "Transformer2DModel", T2D_PIXART_CFG, _t2d_pixart_inputs),
    ZooModel("T2DContinuous", "Transformer2DModel", T2D_CONT_CFG, _t2d_cont_inputs),
    ZooModel("T2DVectorized", "Transformer2DModel", T2D_VEC_CFG, _t2d_vec_inputs),
    ZooModel("Prior", "PriorTransformer", PRIOR_CFG, _prior_inputs),
    ZooModel("UNet2DCond", "UNet2DConditionModel", UNET_CFG, _unet_inputs),
    ZooModel("UNet2DCondCtrl", "UNet2DConditionModel", UNET_CFG, lambda g: _unet_inputs(g, control=True)),
]

MORE: list[ZooModel] = _A + _B + _C + _D
