"""Wan image-to-video: a clip trains with its first frame as the condition, fed to the transformer exactly as
diffusers' WanImageToVideoPipeline feeds it while sampling (pipelines/wan/pipeline_wan_i2v.py, `prepare_latents`
and the denoising loop):

- Wan 2.1 I2V-14B and Wan 2.2 I2V-A14B: the VAE latent of (first frame, then zeros up to the clip's length),
  normalised like the clip's, behind a 4-channel mask that is 1 on the first latent frame (the first frame's four
  VAE frames) and 0 after; concatenated to the noisy latents on the channels (16 + 4 + 16 = 36). Wan 2.1 adds the
  first frame's CLIP image states (the penultimate layer, `encode_image`) as `encoder_hidden_states_image`. The
  whole clip is noised and trained against the velocity noise - latents, first frame included; the condition
  stays clean. musubi-tuner trains it the same way (wan_cache_latents.py `encode_and_save_batch`: the mask and
  the zero-padded first-frame latent as `y`, the first frame's CLIP context; wan_train_network.py: `y` and
  `clip_fea` beside the noisy input, target noise - latents).
- Wan 2.2 TI2V-5B (expand_timesteps): the first latent frame of the noisy input is the clean first-frame latent,
  and its tokens get timestep 0 (the pipeline's `first_frame_mask`); the pipeline throws away the prediction on
  that frame, so the loss is on the frames after it.

The condition is cached per clip by cache_latents (tasks/data/first_frame.py) as a control entry; training reads
it as text["control_latents"] ([B, 1, C, F, h, w]) and Wan 2.1's text["control_image_embeds"]. Wan 2.2's adapters:
wan22_i2v.py (A14B, this concatenation) and wan22_ti2v.py."""
from __future__ import annotations

from tasks.lazy import LazyClass, lazy, no_grad
from tasks.models.bases.adapter import Controls, KohyaLayout
from tasks.models.bases.flow_matching import weighted_loss
from tasks.models.bases.real_size import RealSize
from tasks.models.wan import KOHYA_RULES, WanAdapter, WAN_BLOCK

torch = lazy("torch")

# Wan 2.1 I2V's cross-attention also reads the image tokens through its own key/value Linears (Wan's
# cross_attn.k_img / v_img, diffusers' attn2.add_k_proj / add_v_proj): musubi-tuner's lora_wan targets them too
# (every Linear of WanAttentionBlock), and diffusers' Wan LoRA conversion maps k_img / v_img to them.
I2V_KOHYA_RULES = KOHYA_RULES + ((WAN_BLOCK + r"attn2\.add_k_proj", "blocks_{}_cross_attn_k_img", 1),
                                 (WAN_BLOCK + r"attn2\.add_v_proj", "blocks_{}_cross_attn_v_img", 1))


class FirstFrameConcat:
    """Wan 2.1 / 2.2 A14B I2V: the mask and the first-frame latent concatenated to the noisy latents."""
    controls = Controls(most=1, required=True, first_frame=True)
    pipeline_cls = LazyClass("diffusers", "WanImageToVideoPipeline")
    image_encoder = False  # Wan 2.1: the CLIP image states of the first frame

    def load_condition_encoder(self):
        """The first frame's image encoder and its processor (Wan 2.1), as the pipeline holds them; None."""
        if not self.image_encoder:
            return None
        from transformers import CLIPImageProcessor, CLIPVisionModel

        processor = CLIPImageProcessor.from_pretrained(self.model_dir, subfolder="image_processor")
        encoder = CLIPVisionModel.from_pretrained(self.model_dir, subfolder="image_encoder", dtype=self.dtype,
                                                  use_safetensors=True)
        return processor, encoder.to(self.device).eval()

    @no_grad
    def encode_condition(self, vae, encoder, pixels, images, frames: int) -> list[dict]:
        """pixels [B, 3, H, W] in [-1, 1] (each clip's first frame as it trains; `images`: the same as PIL images)
        -> per clip {"latents": [4 + C, F', h, w]} (and "image_embeds" [tokens, width] with an image encoder)."""
        b, _, h, w = pixels.shape
        video = torch.cat([pixels[:, :, None], pixels.new_zeros(b, 3, frames - 1, h, w)], dim=2)
        z = self.encode_latents(vae, video)
        mask = torch.zeros_like(z[:, :4])
        mask[:, :, 0] = 1  # the pipeline's mask_lat_size: the first frame's four VAE frames are given
        out = [{"latents": y} for y in torch.cat([mask, z], dim=1)]
        if encoder is not None:
            processor, model = encoder
            inputs = processor(images=list(images), return_tensors="pt").to(model.device)
            states = model(**{k: v.to(model.dtype) for k, v in inputs.items()}, output_hidden_states=True).hidden_states[-2]
            for entry, e in zip(out, states):
                entry["image_embeds"] = e
        return out

    def training_loss(self, transformer, latents, text, train_cfg, scheduler, generators):
        noisy, noise, timesteps, sigmas = self.draw(latents, train_cfg, scheduler, generators)
        cond = text["control_latents"][:, 0].to(latents.dtype)
        embeds = text.get("control_image_embeds")
        pred = transformer(hidden_states=torch.cat([noisy, cond], dim=1), timestep=timesteps.to(latents.dtype),
                           encoder_hidden_states=text["prompt_embeds"].to(latents.dtype),
                           encoder_hidden_states_image=None if embeds is None else embeds[:, 0].to(latents.dtype),
                           return_dict=False)[0]
        return weighted_loss(pred, noise - latents, sigmas, train_cfg)  # velocity target, every frame


    @staticmethod
    def bench_batch(config, size, frames, text_len):
        # bench.memory's full-size inputs: Wan's latents and text, the mask + first-frame latent condition (4 + 16
        # channels) and, for Wan 2.1, the first frame's CLIP states (CLIP ViT-H/14 at 224 px: 256 patches + class)
        (w, h), z = size, lambda *s: torch.zeros(*s, dtype=torch.bfloat16)  # noqa: E731
        f = 1 + (frames - 1) // 4
        text = {"prompt_embeds": z(1, text_len, config["text_dim"]), "control_latents": z(1, 1, 20, f, h // 8, w // 8)}
        if config.get("image_dim"):
            text["control_image_embeds"] = z(1, 1, 257, config["image_dim"])
        return z(1, 16, f, h // 8, w // 8), text

class WanI2VAdapter(FirstFrameConcat, WanAdapter):
    """Wan 2.1 I2V-14B (480P / 720P): one transformer, the CLIP image encoder."""
    family = "wan_i2v"
    kohya = KohyaLayout("networks.lora_wan", "wan2.1_i2v", rules=I2V_KOHYA_RULES, lycoris_names="comfyui")
    image_encoder = True
    # the CLIP image tokens' keys, values and attention in every block's cross-attention (bench.memory: per block
    # 31.6 / 31.8 at 480x832, 81 / 33 frames; checkpointed 1.051 / 1.052; recompute 31.7 / 31.9); the caption's 512
    # tokens and the image's 257 are offloaded beside each block
    activation_factors = (31.7, 1.05, 31.8)
    activation_extras = {"text_offloaded": 1.5}
    TEXT_TOKENS = 512  # diffusers' WanAttnProcessor takes the keys before the last 512 as the image's (hard-coded)
    # the first frame's CLIP states are cached with the condition, and the sampler encodes its --i image with them
    latent_components = ("vae", "image_encoder", "image_processor")
    sample_components = ("transformer", "vae", "scheduler", "image_encoder", "image_processor")
    def configure(self, model_cfg):
        super().configure(model_cfg)
        if self.max_sequence_length != self.TEXT_TOKENS:
            from tasks.config import ConfigError

            raise ConfigError(f"model.max_sequence_length={self.max_sequence_length}: Wan 2.1 I2V's cross-attention "
                              f"reads the last {self.TEXT_TOKENS} keys as the text and the ones before as the image "
                              f"(diffusers' WanAttnProcessor); set model.max_sequence_length={self.TEXT_TOKENS}")

    LORA_TARGETS = (r".*blocks\.\d+\.(attn1\.(to_q|to_k|to_v|to_out\.0)|attn2\.(to_q|to_k|to_v|to_out\.0|add_k_proj|"
                    r"add_v_proj))|.*blocks\.\d+\.ffn\.net\.(0\.proj|2)")

    # -- full size (bench.memory: tasks/models/bases/real_size.py) --------------------------------
    # diffusers' scripts/convert_wan_to_diffusers.py "Wan-I2V-14B-480p": 36 input channels (16 noisy + 4 mask + 16
    # first-frame latent), the CLIP ViT-H image states (image_dim 1280) through their own key/value projections
    # (added_kv_proj_dim 5120); else Wan 2.1 T2V-14B's. At its model card's 480x832, 81 frames, and 33 for the smaller
    # cards. The CLIP image encoder (laion/CLIP-ViT-H-14's vision tower) is encoded with the latents.
    real_sizes = tuple(RealSize(name, "WanTransformer3DModel", {"in_channels": 36, "image_dim": 1280, "added_kv_proj_dim": 5120},
                                size=(832, 480), frames=frames, vae=("AutoencoderKLWan", {}),
                                text=(("text_encoder", "umt5_xxl"),), image_encoders=(("image_encoder", "clip_vit_h"),),
                                rows=rows, cards=(1,)) for name, frames, rows in (
        ("wan21_i2v_14b", 81, ("nf4+ckpt", "nf4+ckpt+offload", "nf4+ckpt+offload+swap17")),
        ("wan21_i2v_14b_33f", 33, ("nf4+ckpt", "nf4+ckpt+offload+swap12", "nf4+ckpt+offload+swap31"))))
