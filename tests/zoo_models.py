"""The diffusers zoo: one row per transformer class, a tiny config and its inputs.

Each row is ``ZooModel(name, class name, config kwargs, inputs(gen) -> kwargs)``. Weights are
drawn from a seeded generator (so zero-initialised output projections do not hide a wrong
block), inputs from another; both are rebuilt identically for the resident reference and
for the compiled twin. Parameters keep ``requires_grad=True`` as a user's model does; the
calls run under ``torch.no_grad()``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class ZooModel:
    name: str
    cls: str | Callable[..., torch.nn.Module]  # a diffusers class name, or a factory
    config: dict
    inputs: Callable[[torch.Generator], dict]


def _r(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen)


def _t(gen: torch.Generator, batch: int = 1) -> torch.Tensor:
    return torch.randint(0, 1000, (batch,), generator=gen)


def _ids(height: int, width: int) -> torch.Tensor:
    grid = torch.meshgrid(torch.zeros(1), torch.arange(float(height)), torch.arange(float(width)),
                          indexing="ij")
    return torch.stack(grid, -1).reshape(-1, 3)


def _flux_like(gen, channels=4, text=32, tokens=16, seq=6, pooled=None, guidance=False):
    out = dict(hidden_states=_r(gen, 1, tokens, channels), encoder_hidden_states=_r(gen, 1, seq, text),
               timestep=torch.tensor([0.5]), img_ids=_ids(4, tokens // 4), txt_ids=torch.zeros(seq, 3))
    if pooled:
        out["pooled_projections"] = _r(gen, 1, pooled)
    if guidance:
        out["guidance"] = torch.tensor([3.5])
    return out


ZOO: list[ZooModel] = [
    ZooModel("Allegro", "AllegroTransformer3DModel", dict(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, num_layers=2,
        cross_attention_dim=16, sample_width=8, sample_height=8, sample_frames=8, caption_channels=8),
        lambda g: dict(hidden_states=_r(g, 1, 4, 2, 8, 8), encoder_hidden_states=_r(g, 1, 8, 8),
                       timestep=_t(g))),
    ZooModel("AuraFlow", "AuraFlowTransformer2DModel", dict(
        sample_size=16, patch_size=2, in_channels=4, num_mmdit_layers=2, num_single_dit_layers=2,
        attention_head_dim=8, num_attention_heads=4, caption_projection_dim=32,
        joint_attention_dim=32, out_channels=4, pos_embed_max_size=64),
        lambda g: dict(hidden_states=_r(g, 1, 4, 8, 8), encoder_hidden_states=_r(g, 1, 8, 32),
                       timestep=_t(g))),
    ZooModel("Bria", "BriaTransformer2DModel", dict(
        patch_size=1, in_channels=4, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=[4, 4, 8]),
        lambda g: _flux_like(g)),
    ZooModel("Chroma", "ChromaTransformer2DModel", dict(
        patch_size=1, in_channels=4, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=[4, 4, 8],
        approximator_num_channels=8, approximator_hidden_dim=16, approximator_layers=2),
        lambda g: _flux_like(g)),
    ZooModel("CogVideoX", "CogVideoXTransformer3DModel", dict(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, time_embed_dim=2,
        text_embed_dim=8, num_layers=2, sample_width=8, sample_height=8, sample_frames=8,
        patch_size=2, temporal_compression_ratio=4, max_text_seq_length=8),
        lambda g: dict(hidden_states=_r(g, 1, 1, 4, 8, 8), encoder_hidden_states=_r(g, 1, 8, 8),
                       timestep=_t(g))),
    ZooModel("CogView3Plus", "CogView3PlusTransformer2DModel", dict(
        patch_size=2, in_channels=4, num_layers=2, attention_head_dim=4, num_attention_heads=2,
        out_channels=4, text_embed_dim=8, time_embed_dim=8, condition_dim=2, pos_embed_max_size=8,
        sample_size=8),
        lambda g: dict(hidden_states=_r(g, 1, 4, 8, 8), encoder_hidden_states=_r(g, 1, 8, 8),
                       original_size=torch.tensor([[64, 64]]), target_size=torch.tensor([[64, 64]]),
                       crop_coords=torch.tensor([[0, 0]]), timestep=_t(g))),
    ZooModel("CogView4", "CogView4Transformer2DModel", dict(
        patch_size=2, in_channels=4, num_layers=2, attention_head_dim=4, num_attention_heads=4,
        out_channels=4, text_embed_dim=8, time_embed_dim=8, condition_dim=4),
        lambda g: dict(hidden_states=_r(g, 1, 4, 8, 8), encoder_hidden_states=_r(g, 1, 8, 8),
                       timestep=_t(g), original_size=torch.tensor([[64, 64]]),
                       target_size=torch.tensor([[64, 64]]), crop_coords=torch.tensor([[0, 0]]))),
    ZooModel("ConsisID", "ConsisIDTransformer3DModel", dict(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, time_embed_dim=2,
        text_embed_dim=8, num_layers=2, sample_width=8, sample_height=8, sample_frames=8,
        patch_size=2, temporal_compression_ratio=4, max_text_seq_length=8, cross_attn_interval=1,
        is_kps=False, is_train_face=True, cross_attn_dim_head=1, cross_attn_num_heads=1,
        LFE_id_dim=2, LFE_vit_dim=2, LFE_depth=5, LFE_dim_head=8, LFE_num_heads=2,
        LFE_num_id_token=1, LFE_num_querie=1, LFE_output_dim=10, LFE_ff_mult=1, LFE_num_scale=1),
        lambda g: dict(hidden_states=_r(g, 1, 1, 4, 8, 8), encoder_hidden_states=_r(g, 1, 8, 8),
                       timestep=_t(g), id_vit_hidden=[_r(g, 1, 2, 2)], id_cond=_r(g, 1, 2))),
    ZooModel("Cosmos", "CosmosTransformer3DModel", dict(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=12, num_layers=2,
        mlp_ratio=2, text_embed_dim=16, adaln_lora_dim=4, max_size=(4, 32, 32), patch_size=(1, 2, 2),
        rope_scale=(2.0, 1.0, 1.0), concat_padding_mask=False, extra_pos_embed_type="learnable"),
        lambda g: dict(hidden_states=_r(g, 1, 4, 1, 8, 8), timestep=_t(g),
                       encoder_hidden_states=_r(g, 1, 8, 16), attention_mask=torch.ones(1, 8),
                       fps=30)),
    ZooModel("DiT", "DiTTransformer2DModel", dict(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, num_layers=2,
        norm_num_groups=4, sample_size=8, patch_size=2),
        lambda g: dict(hidden_states=_r(g, 1, 4, 8, 8), timestep=_t(g),
                       class_labels=torch.tensor([3]))),
    ZooModel("EasyAnimate", "EasyAnimateTransformer3DModel", dict(
        attention_head_dim=16, num_attention_heads=2, in_channels=4, mmdit_layers=2, num_layers=2,
        out_channels=4, patch_size=2, sample_height=60, sample_width=90, text_embed_dim=16,
        time_embed_dim=8, time_position_encoding_type="3d_rope", timestep_activation_fn="silu"),
        lambda g: dict(hidden_states=_r(g, 1, 4, 1, 8, 8), timestep=_t(g),
                       encoder_hidden_states=_r(g, 1, 8, 16))),
    ZooModel("Flux", "FluxTransformer2DModel", dict(
        patch_size=1, in_channels=4, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
        guidance_embeds=True, axes_dims_rope=(4, 4, 8)),
        lambda g: _flux_like(g, pooled=32, guidance=True)),
    ZooModel("HiDream", "HiDreamImageTransformer2DModel", dict(
        patch_size=2, in_channels=4, out_channels=4, num_layers=1, num_single_layers=1,
        attention_head_dim=8, num_attention_heads=4, caption_channels=[8, 4], text_emb_dim=8,
        num_routed_experts=2, num_activated_experts=2, axes_dims_rope=(4, 2, 2),
        max_resolution=(32, 32), llama_layers=(0, 1), force_inference_output=True),
        lambda g: dict(hidden_states=_r(g, 1, 4, 8, 8), encoder_hidden_states_t5=_r(g, 1, 8, 8),
                       encoder_hidden_states_llama3=_r(g, 2, 1, 8, 4), pooled_embeds=_r(g, 1, 8),
                       timesteps=_t(g))),
    ZooModel("HunyuanDiT", "HunyuanDiT2DModel", dict(
        sample_size=8, patch_size=2, in_channels=4, num_layers=4, attention_head_dim=8,
        num_attention_heads=2, cross_attention_dim=8, cross_attention_dim_t5=8,
        pooled_projection_dim=4, hidden_size=16, text_len=4, text_len_t5=4,
        activation_fn="gelu-approximate"),
        lambda g: dict(hidden_states=_r(g, 1, 4, 8, 8), encoder_hidden_states=_r(g, 1, 4, 8),
                       text_embedding_mask=torch.ones(1, 4), encoder_hidden_states_t5=_r(g, 1, 4, 8),
                       text_embedding_mask_t5=torch.ones(1, 4), timestep=_t(g).float(),
                       image_meta_size=torch.tensor([[1024.0, 1024, 16, 16, 0, 0]]),
                       style=torch.zeros(1, dtype=torch.long),
                       image_rotary_emb=[torch.ones(16, 8), torch.zeros(16, 8)])),
    ZooModel("HunyuanVideo", "HunyuanVideoTransformer3DModel", dict(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=10, num_layers=2,
        num_single_layers=2, num_refiner_layers=1, patch_size=1, patch_size_t=1,
        guidance_embeds=True, text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(2, 4, 4)),
        lambda g: dict(hidden_states=_r(g, 1, 4, 1, 8, 8), timestep=_t(g).float(),
                       encoder_hidden_states=_r(g, 1, 6, 16), pooled_projections=_r(g, 1, 8),
                       encoder_attention_mask=torch.ones(1, 6), guidance=torch.tensor([3.5]))),
    ZooModel("HunyuanVideo15", "HunyuanVideo15Transformer3DModel", dict(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=2,
        num_refiner_layers=1, mlp_ratio=2.0, patch_size=1, patch_size_t=1, text_embed_dim=16,
        text_embed_2_dim=8, image_embed_dim=12, rope_axes_dim=(2, 2, 4), target_size=16,
        task_type="t2v"),
        lambda g: dict(hidden_states=_r(g, 1, 4, 1, 8, 8), timestep=torch.tensor([1.0]),
                       encoder_hidden_states=_r(g, 1, 6, 16), encoder_hidden_states_2=_r(g, 1, 4, 8),
                       encoder_attention_mask=torch.ones(1, 6),
                       encoder_attention_mask_2=torch.ones(1, 4), image_embeds=torch.zeros(1, 3, 12))),
    ZooModel("LTX", "LTXVideoTransformer3DModel", dict(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8,
        cross_attention_dim=16, num_layers=2, qk_norm="rms_norm_across_heads", caption_channels=16),
        lambda g: dict(hidden_states=_r(g, 1, 2 * 8 * 8, 4), encoder_hidden_states=_r(g, 1, 8, 16),
                       timestep=_t(g), encoder_attention_mask=torch.ones(1, 8, dtype=torch.bool),
                       num_frames=2, height=8, width=8)),
    ZooModel("Latte", "LatteTransformer3DModel", dict(
        sample_size=8, num_layers=2, patch_size=2, attention_head_dim=4, num_attention_heads=2,
        caption_channels=8, in_channels=4, cross_attention_dim=8, out_channels=8,
        attention_bias=True, activation_fn="gelu-approximate", num_embeds_ada_norm=1000,
        norm_type="ada_norm_single", norm_elementwise_affine=False, norm_eps=1e-6, video_length=2),
        lambda g: dict(hidden_states=_r(g, 1, 4, 2, 8, 8), encoder_hidden_states=_r(g, 1, 8, 8),
                       timestep=_t(g), enable_temporal_attentions=True)),
    ZooModel("Lumina2", "Lumina2Transformer2DModel", dict(
        sample_size=16, patch_size=2, in_channels=4, hidden_size=24, num_layers=2,
        num_refiner_layers=1, num_attention_heads=3, num_kv_heads=1, multiple_of=2,
        ffn_dim_multiplier=None, norm_eps=1e-5, scaling_factor=1.0, axes_dim_rope=(4, 2, 2),
        axes_lens=(128, 128, 128), cap_feat_dim=32),
        lambda g: dict(hidden_states=_r(g, 1, 4, 8, 8), encoder_hidden_states=_r(g, 1, 8, 32),
                       timestep=torch.rand(1, generator=g),
                       encoder_attention_mask=torch.ones(1, 8, dtype=torch.bool))),
    ZooModel("LuminaNext", "LuminaNextDiT2DModel", dict(
        sample_size=16, patch_size=2, in_channels=4, hidden_size=24, num_layers=2,
        num_attention_heads=3, num_kv_heads=1, multiple_of=16, ffn_dim_multiplier=None,
        norm_eps=1e-5, learn_sigma=False, qk_norm=True, cross_attention_dim=32, scaling_factor=1.0),
        lambda g: dict(hidden_states=_r(g, 1, 4, 8, 8), encoder_hidden_states=_r(g, 1, 8, 32),
                       timestep=torch.rand(1, generator=g), encoder_mask=torch.ones(1, 8),
                       image_rotary_emb=_r(g, 384, 384, 4), cross_attention_kwargs={})),
    ZooModel("Mochi", "MochiTransformer3DModel", dict(
        patch_size=2, num_attention_heads=2, attention_head_dim=8, num_layers=2,
        pooled_projection_dim=16, in_channels=4, out_channels=None, qk_norm="rms_norm",
        text_embed_dim=16, time_embed_dim=4, activation_fn="swiglu", max_sequence_length=16),
        lambda g: dict(hidden_states=_r(g, 1, 4, 2, 8, 8), encoder_hidden_states=_r(g, 1, 8, 16),
                       timestep=_t(g), encoder_attention_mask=torch.ones(1, 8, dtype=torch.bool))),
    ZooModel("OmniGen", "OmniGenTransformer2DModel", dict(
        hidden_size=16, num_attention_heads=4, num_key_value_heads=4, intermediate_size=32,
        num_layers=3, pad_token_id=0, vocab_size=1000, in_channels=4, time_step_dim=4,
        rope_scaling={"long_factor": [1, 2], "short_factor": [1, 2]}),
        lambda g: dict(hidden_states=_r(g, 1, 4, 8, 8), timestep=torch.rand(1, generator=g),
                       input_ids=torch.randint(0, 10, (1, 24), generator=g),
                       input_img_latents=[_r(g, 1, 4, 8, 8)], input_image_sizes={0: [[0, 16]]},
                       attention_mask=torch.ones(1, 24 + 1 + 16, 24 + 1 + 16),
                       position_ids=torch.arange(24 + 1 + 16)[None])),
    ZooModel("PixArt", "PixArtTransformer2DModel", dict(
        sample_size=8, num_layers=2, patch_size=2, attention_head_dim=2, num_attention_heads=2,
        in_channels=4, cross_attention_dim=8, out_channels=8, attention_bias=True,
        activation_fn="gelu-approximate", num_embeds_ada_norm=8, norm_type="ada_norm_single",
        norm_elementwise_affine=False, norm_eps=1e-6, use_additional_conditions=False,
        caption_channels=None),
        lambda g: dict(hidden_states=_r(g, 1, 4, 8, 8), timestep=_t(g),
                       encoder_hidden_states=_r(g, 1, 8, 8),
                       added_cond_kwargs={"aspect_ratio": None, "resolution": None})),
    ZooModel("QwenImage", "QwenImageTransformer2DModel", dict(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
        num_attention_heads=4, joint_attention_dim=16, guidance_embeds=False,
        axes_dims_rope=(8, 4, 4)),
        lambda g: dict(hidden_states=_r(g, 1, 16, 16), encoder_hidden_states=_r(g, 1, 8, 16),
                       encoder_hidden_states_mask=torch.ones(1, 8, dtype=torch.long),
                       timestep=torch.tensor([1.0]), img_shapes=[(1, 4, 4)])),
    ZooModel("SD3", "SD3Transformer2DModel", dict(
        sample_size=8, patch_size=1, in_channels=4, num_layers=3, attention_head_dim=8,
        num_attention_heads=4, caption_projection_dim=32, joint_attention_dim=32,
        pooled_projection_dim=64, out_channels=4, pos_embed_max_size=16, dual_attention_layers=(0,),
        qk_norm="rms_norm"),
        lambda g: dict(hidden_states=_r(g, 1, 4, 8, 8), encoder_hidden_states=_r(g, 1, 8, 32),
                       pooled_projections=_r(g, 1, 64), timestep=_t(g))),
    ZooModel("Sana", "SanaTransformer2DModel", dict(
        patch_size=1, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=4,
        num_attention_heads=2, num_cross_attention_heads=2, cross_attention_head_dim=4,
        cross_attention_dim=8, caption_channels=8, sample_size=8),
        lambda g: dict(hidden_states=_r(g, 1, 4, 8, 8), encoder_hidden_states=_r(g, 1, 8, 8),
                       timestep=_t(g))),
    ZooModel("SanaVideo", "SanaVideoTransformer3DModel", dict(
        in_channels=16, out_channels=16, num_attention_heads=2, attention_head_dim=12, num_layers=2,
        num_cross_attention_heads=2, cross_attention_head_dim=12, cross_attention_dim=24,
        caption_channels=16, mlp_ratio=2.5, dropout=0.0, attention_bias=False, sample_size=8,
        patch_size=(1, 2, 2), norm_elementwise_affine=False, norm_eps=1e-6,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=32),
        lambda g: dict(hidden_states=_r(g, 1, 16, 2, 8, 8), encoder_hidden_states=_r(g, 1, 8, 16),
                       timestep=_t(g))),
    ZooModel("SkyReelsV2", "SkyReelsV2Transformer3DModel", dict(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4,
        out_channels=4, text_dim=16, freq_dim=32, ffn_dim=32, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=32),
        lambda g: dict(hidden_states=_r(g, 1, 4, 2, 8, 8), encoder_hidden_states=_r(g, 1, 8, 16),
                       timestep=_t(g))),
    ZooModel("Wan", "WanTransformer3DModel", dict(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4,
        out_channels=4, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=3, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=32),
        lambda g: dict(hidden_states=_r(g, 1, 4, 2, 8, 8), timestep=_t(g),
                       encoder_hidden_states=_r(g, 1, 6, 32))),
    ZooModel("ZImage", "ZImageTransformer2DModel", dict(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=16, n_layers=2,
        n_refiner_layers=1, n_heads=1, n_kv_heads=2, qk_norm=True, cap_feat_dim=16,
        rope_theta=256.0, t_scale=1000.0, axes_dims=[8, 4, 4], axes_lens=[256, 32, 32]),
        lambda g: dict(x=[_r(g, 16, 1, 8, 8)], cap_feats=[_r(g, 16, 16)], t=torch.tensor([0.5]))),
]

BY_NAME = {m.name: m for m in ZOO}


def by_name(name: str) -> ZooModel:
    """The entry ``name`` of `ZOO` or of `zoo_more.MORE` (imported when first asked for)."""
    if name not in BY_NAME:
        from zoo_more import MORE

        BY_NAME.update((m.name, m) for m in MORE)
    return BY_NAME[name]


def build(entry: ZooModel, seed: int = 0):
    """A fresh model of ``entry`` with seeded weights, and its inputs."""
    import diffusers

    torch.manual_seed(seed)
    cls = getattr(diffusers, entry.cls) if isinstance(entry.cls, str) else entry.cls
    model = cls(**entry.config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype) * 0.05)
    return model, entry.inputs(torch.Generator().manual_seed(seed + 1))


def outputs(out) -> list[torch.Tensor]:
    """Every tensor a forward returned, in order (``sample``, tuples, lists)."""
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for item in out for t in outputs(item)]
    return []
