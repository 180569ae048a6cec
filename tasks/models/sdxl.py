"""SDXL: CLIP-L and CLIP-G penultimate states concatenated, CLIP-G's pooled projection plus size ids as the
UNet's added conditioning; UNet on VAE /8 latents (diffusers' train_text_to_image_lora_sdxl.py)."""
from __future__ import annotations

from tasks.lazy import LazyClass, lazy
from tasks.models.bases.adapter import KohyaLayout
from tasks.models.bases.unet import VAE_SCALE, UNetAdapter

torch = lazy("torch")


class SDXLAdapter(UNetAdapter):
    family = "sdxl"
    kohya = KohyaLayout("networks.lora", "sdxl_base_v1-0", names="unet", sgm_blocks=True,
                        text_encoder_prefixes=(("text_encoder", "lora_te1"), ("text_encoder_2", "lora_te2")))
    pipeline_cls = LazyClass("diffusers", "StableDiffusionXLPipeline")
    text_components = ("tokenizer", "tokenizer_2", "text_encoder", "text_encoder_2")
    text_encoder_lora_modules = ("text_encoder", "text_encoder_2")  # train.text_encoder_lr
    embed_names = ("prompt_embeds", "pooled_prompt_embeds")
    size_conditioning = True
    latent_version = "2"  # 2: latents stored with their original size and crop offsets
    widest_arch = dict(down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
                       up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
                       block_out_channels=(320, 640, 1280), transformer_layers_per_block=(1, 2, 10),
                       attention_head_dim=(5, 10, 20), use_linear_projection=True, cross_attention_dim=2048,
                       addition_embed_type="text_time", addition_time_embed_dim=256,
                       projection_class_embeddings_input_dim=2816)

    def _encode(self, pipe, texts):
        embeds, _, pooled, _ = pipe.encode_prompt(prompt=texts, device=self.device, num_images_per_prompt=1,
                                                  do_classifier_free_guidance=False)
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}

    def added_cond_kwargs(self, text, latents):
        # time_ids = (orig_h, orig_w, crop_top, crop_left, target_h, target_w) in pixels, as diffusers' SDXL
        # LoRA example and sd-scripts: each image's size before resizing and its crop offsets, recorded with
        # its latent. Without them (a bare call) the item counts as uncropped at the training size, which is
        # what the pipeline passes at sampling time for the same height/width.
        b, _, h, w = latents.shape
        target = torch.tensor([h * VAE_SCALE, w * VAE_SCALE]).repeat(b, 1)
        original = text.get("original_size", target).reshape(b, 2)
        crop = text.get("crop_top_left", torch.zeros_like(target)).reshape(b, 2)
        time_ids = torch.cat([original.cpu(), crop.cpu(), target], dim=1).to(latents.device, latents.dtype)
        return {"text_embeds": text["pooled_prompt_embeds"].to(latents.dtype), "time_ids": time_ids}

    def unconditional(self, pipe, negative, empty):
        # With force_zeros_for_empty_prompt (SDXL base) the pipeline's negative for "no negative prompt" is
        # all zeros, not the encoded empty prompt: leave it to the pipeline.
        if negative is None and pipe.config.get("force_zeros_for_empty_prompt", False):
            return None
        return super().unconditional(pipe, negative, empty)
