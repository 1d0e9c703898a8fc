"""Tiny diffusers pipelines built locally: word-level tokenizers from the `tokenizers`
package, tiny CLIP / T5 / UMT5 text encoders from `transformers` configs, tiny VAEs and
transformers, every weight seeded. Nothing is downloaded.

Each model has the fewest layers (Dynamo traces every layer at each compile, the tests'
main cost) that still stream at least three blocks through the two slots, so a slot is
reused within one call: Flux one double and one single block, Wan and UMT5 one layer,
CLIP one layer, T5 two (one would give two blocks), SD3 two."""

from __future__ import annotations


import torch

WORDS = ("a cat dog red blue green sky tree house car sun moon over under the small big "
         "photo of painting night day bad blurry").split()


def tokenizer(max_length: int):
    """A word-level fast tokenizer (pad 0, eos 1, unk 2) as transformers' class."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>",
                                                       special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                                   unk_token="<unk>", model_max_length=max_length)


VOCAB = len(WORDS) + 3


def _is_norm_scale(name: str, p: torch.Tensor) -> bool:
    """A normalisation layer's scale: seeded around 1, not 0."""
    return name.endswith("norm.weight") or (".norm" in name and name.endswith("weight")
                                            and p.dim() == 1)


def _seeded(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dtype.is_floating_point:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05
                        + (1.0 if _is_norm_scale(name, p) else 0.0))
    return module.eval().requires_grad_(False)


def clip(seed: int, hidden: int = 32, projection: bool = False):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=64,
                            num_hidden_layers=1, num_attention_heads=2,
                            max_position_embeddings=16, projection_dim=hidden,
                            pad_token_id=0, bos_token_id=1, eos_token_id=1)
    cls = CLIPTextModelWithProjection if projection else CLIPTextModel
    return _seeded(cls(config), seed)


def t5(seed: int, d_model: int = 32, umt5: bool = False):
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    kw = dict(vocab_size=VOCAB, d_model=d_model, d_kv=8, d_ff=64, num_layers=1 if umt5 else 2,
              num_heads=4,
              relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1,
              decoder_start_token_id=0)
    model = UMT5EncoderModel(UMT5Config(**kw)) if umt5 else T5EncoderModel(T5Config(**kw))
    return _seeded(model, seed)


def flux(seed: int = 0):
    from diffusers import (AutoencoderKL, FlowMatchEulerDiscreteScheduler,
                           FluxPipeline, FluxTransformer2DModel)

    torch.manual_seed(seed)
    transformer = _seeded(FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
        pooled_projection_dim=32, guidance_embeds=False, axes_dims_rope=(4, 4, 8)), seed)
    vae = _seeded(AutoencoderKL(
        in_channels=3, out_channels=3, block_out_channels=(8,), layers_per_block=1,
        down_block_types=("DownEncoderBlock2D",), up_block_types=("UpDecoderBlock2D",),
        latent_channels=4, norm_num_groups=4, use_quant_conv=False,
        use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035), seed + 1)
    return FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae,
                        text_encoder=clip(seed + 2), tokenizer=tokenizer(16),
                        text_encoder_2=t5(seed + 3), tokenizer_2=tokenizer(32),
                        transformer=transformer)


def wan(seed: int = 0, two_transformers: bool = False):
    from diffusers import (AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline,
                           WanTransformer3DModel)

    def transformer(s):
        torch.manual_seed(s)
        return _seeded(WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16,
            in_channels=16, out_channels=16, text_dim=32, freq_dim=32, ffn_dim=64,
            num_layers=1, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
            rope_max_seq_len=32), s)

    vae = _seeded(AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1],
                                   num_res_blocks=1, temperal_downsample=[False, True, True]),
                  seed + 1)
    return WanPipeline(tokenizer=tokenizer(16), text_encoder=t5(seed + 2, umt5=True),
                       vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
                       transformer=transformer(seed),
                       transformer_2=transformer(seed + 5) if two_transformers else None,
                       boundary_ratio=0.5 if two_transformers else None)


def sd3(seed: int = 0):
    from diffusers import (AutoencoderKL, FlowMatchEulerDiscreteScheduler,
                           SD3Transformer2DModel, StableDiffusion3Pipeline)

    torch.manual_seed(seed)
    transformer = _seeded(SD3Transformer2DModel(
        sample_size=32, patch_size=1, in_channels=4, num_layers=2, attention_head_dim=8,
        num_attention_heads=4, caption_projection_dim=32, joint_attention_dim=32,
        pooled_projection_dim=64, out_channels=4), seed)
    vae = _seeded(AutoencoderKL(
        in_channels=3, out_channels=3, block_out_channels=(8,), layers_per_block=1,
        down_block_types=("DownEncoderBlock2D",), up_block_types=("UpDecoderBlock2D",),
        latent_channels=4, norm_num_groups=4, use_quant_conv=False,
        use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035), seed + 1)
    return StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae,
        text_encoder=clip(seed + 2, projection=True), tokenizer=tokenizer(16),
        text_encoder_2=clip(seed + 3, projection=True), tokenizer_2=tokenizer(16),
        text_encoder_3=None, tokenizer_3=None)  # Flux and Wan cover T5 / UMT5


BUILDERS = {"flux": flux, "wan": wan, "sd3": sd3}


def call_kwargs(kind: str, height: int = 16, width: int = 16, cfg: bool = True,
                short_text: bool = True) -> dict:
    """Arguments of a short pipeline call with classifier-free guidance; ``short_text=False``
    leaves ``max_sequence_length`` at the pipeline's default (as the README calls Flux)."""
    kw = dict(prompt="a red cat over the tree", negative_prompt="blurry bad photo",
              height=height, width=width, num_inference_steps=2, output_type="pt",
              generator=torch.Generator().manual_seed(7))
    if kind == "flux":
        kw.update(true_cfg_scale=2.0 if cfg else 1.0, max_sequence_length=32)
    elif kind == "wan":
        kw.update(guidance_scale=3.0 if cfg else 1.0, num_frames=5, max_sequence_length=16)
    else:
        kw.update(guidance_scale=3.0 if cfg else 1.0, max_sequence_length=16)
    if not short_text:
        del kw["max_sequence_length"]
    return kw


def images(pipe, kind: str, **kw) -> torch.Tensor:
    """The pipeline's decoded output as a tensor."""
    with torch.no_grad():
        out = pipe(**call_kwargs(kind, **kw))
    return out.frames if kind == "wan" else out.images


# -- compile_pipeline: resident vs dlo through pipe(...) -------------------------------------------
SIZES = {"flux": [(16, 16), (32, 16)], "wan": [(32, 32), (32, 48)], "sd3": [(16, 16), (32, 16)]}
"""Two resolutions per kind: the second recompiles the transformer with dynamic shapes."""


def check_bit_exact_with_cfg_two_resolutions(kind: str, reference, pipe, **kw) -> None:
    """``pipe`` (compiled with `compile_pipeline`) equals ``reference`` bit for bit with CFG
    at both resolutions and back at the first; its transformer and text encoders are
    streamed, its VAE is not."""
    from dlo_fx.runtime.weights.stored import is_stored

    sizes = SIZES[kind]
    for height, width in sizes + sizes[:1]:
        expected = images(reference, kind, height=height, width=width, **kw)
        assert torch.equal(images(pipe, kind, height=height, width=width, **kw), expected), \
            (kind, height, width)
    streamed = [n for n in ("transformer", "text_encoder", "text_encoder_2", "text_encoder_3")
                if getattr(pipe, n, None) is not None]
    for name in streamed:  # the text encoders are streamed too (the compiled module's own
        module = getattr(pipe, name)  # parameters stay: its hooks run eagerly on every call)
        own = {id(p) for p in module.parameters(recurse=False)}
        assert all(is_stored(p) for p in module.parameters()
                   if p.numel() > 16 and id(p) not in own), name
    assert not any(is_stored(p) for p in pipe.vae.parameters())  # the VAE only if asked


def compile_pipeline_case(kind: str) -> None:
    """A resident pipeline and its `compile_pipeline` twin (2 slots), compared by
    `check_bit_exact_with_cfg_two_resolutions`: run in a forked child by a spawned job of
    test_diffusers (its assertions raise there, with their traceback)."""
    from dlo_fx import compile_pipeline

    reference, pipe = BUILDERS[kind](), BUILDERS[kind]()
    assert compile_pipeline(pipe, options={"num_slots": 2}) is pipe
    check_bit_exact_with_cfg_two_resolutions(kind, reference, pipe)


def readme_quick_start_case(readme: str) -> None:
    """Both snippets of the README's diffusers quick start, on a tiny Flux pipeline saved
    here, at a tiny size: each gives the resident pipeline's image. The first snippet's
    pipeline (bfloat16, compiled by `compile_pipeline`) is also Flux's case of
    `check_bit_exact_with_cfg_two_resolutions`, checked before the second snippet starts
    afresh: its calls keep the README's text length, so the transformer compiles once more
    only for the second resolution. Run in a forked child by a spawned job of
    test_diffusers (its assertions raise there, with their traceback)."""
    import re
    import tempfile
    from pathlib import Path

    import numpy as np
    from diffusers import FluxPipeline

    from dlo_fx.runtime.weights.owners import reset_runtimes

    text = Path(readme).read_text()
    section = text[text.index("## Diffusers quick start"):text.index("## Any DiT")]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 2, blocks
    with tempfile.TemporaryDirectory() as folder:
        flux().save_pretrained(folder)
        reference = FluxPipeline.from_pretrained(folder, torch_dtype=torch.bfloat16)
        expected = np.asarray(reference("a red cat over the tree", height=16, width=16,
                                        num_inference_steps=2,
                                        generator=torch.Generator().manual_seed(0)).images[0])
        namespace: dict = {}
        for index, code in enumerate(blocks):
            torch._dynamo.reset()
            reset_runtimes()
            code = code.replace('"FLUX.1-dev"', repr(folder))
            code = code.replace("height=1024, width=1024", "height=16, width=16")
            code = code.replace("num_inference_steps=28)", "num_inference_steps=2, "
                                "generator=torch.Generator().manual_seed(0))")
            exec(compile(code, readme, "exec"), namespace)
            assert np.array_equal(np.asarray(namespace["image"]), expected)
            if index == 0:
                assert isinstance(namespace["pipe"], FluxPipeline)
                check_bit_exact_with_cfg_two_resolutions("flux", reference, namespace["pipe"],
                                                         short_text=False)
