"""HunyuanVideo 1.5 (text-to-video): HunyuanVideo15Transformer3DModel (double-stream blocks over the video tokens and
the caption, 1x1x1 patches) on the causal video VAE's latents (AutoencoderKLHunyuanVideo15: /16 in space, /4 in
time, 1 + 4k frames, 32 channels scaled by scaling_factor), text from Qwen2.5-VL (its chat template, hidden state
-3) and ByT5 (the prompt's quoted glyph text), flow matching with real CFG through the pipeline's guider.

What follows which reference (diffusers 0.42.1, pipelines/hunyuan_video1_5/pipeline_hunyuan_video1_5.py):
- Latents: the VAE's mode times `vae.config.scaling_factor`, as `__call__` divides by it before `vae.decode` (no
  shift); a still image is a one-frame video (the causal VAE encodes the first frame alone). Frame counts 1 + 4k
  (`prepare_latents`: (num_frames - 1) // vae_scale_factor_temporal + 1), sides multiples of 16 (patch 1).
- Text: the pipeline's own `encode_prompt`, cached per caption as it returns them: `prompt_embeds` and
  `prompt_embeds_mask` (Qwen2.5-VL, the template's first `prompt_template_encode_start_idx` = 108 tokens dropped),
  `prompt_embeds_2` and `prompt_embeds_mask_2` (ByT5 of the quoted text; zeros and an empty mask without quotes),
  the masks in the dtype encode_prompt gives them. The lengths are hard-coded attributes of the pipeline
  (`tokenizer_max_length` = 1000, `tokenizer_2_max_length` = 256): this adapter sets them on its pipeline
  instance, to model.max_sequence_length and min(256, model.max_sequence_length), so every caption is stored at
  those fixed lengths (the real model keeps 1000 / 256 with model.max_sequence_length=1000).
- Training, text-to-video as `__call__` feeds the transformer: hidden_states = cat([noisy, zeros, zero mask
  [B, 1, F, h, w]]) (`prepare_cond_latents_and_mask` for t2v), `image_embeds` zeros (all-zero embeds make the
  transformer mask every image token out as a key), but [B, 0, image_embed_dim] instead of the pipeline's 729
  (`vision_num_semantic_tokens`): the video tokens' prediction is the same (bit for bit on the CPU, checked by
  tests/test_hunyuan_video15.py), without 729 dead queries in every block (at 64 px the tiny model trains 2x as
  fast; at 480p they are ~1.5 % of the tokens), timestep = the scheduler's
  t = sigma x 1000, the sigmas drawn from the scheduler's table with its config's `shift` (5.0 for 480p t2v; 9.0
  for 720p), target noise - latents (FlowMatchEulerDiscreteScheduler.step: x + (sigma_next - sigma) * v).
- LoRA targets: every attention and MLP Linear of the double-stream blocks (image and caption streams: to_q/k/v,
  to_out.0, add_q/k/v_proj, to_add_out, ff and ff_context), the attention/MLP part of what musubi-tuner's
  networks/lora_hv_1_5.py wraps (every Linear of MMDoubleStreamBlock; its modulation Linears are left out here).
- kohya file: musubi-tuner's (networks/lora_hv_1_5.py at kohya-ss/musubi-tuner 30c658c: networks.lora's
  `lora_unet_<module path, "." -> "_">` over MMDoubleStreamBlock, whose q, k and v are three Linears
  img_attn_q/k/v, its MLP img_mlp.fc1/fc2: hunyuan_video_1_5/hunyuan_video_1_5_modules.py), so musubi-tuner reads
  it; ComfyUI's model fuses q/k/v (Flux's DoubleStreamBlock: img_attn.qkv, img_mlp.0/2), so its file is apart
  (`comfyui_rules`: the names musubi's own convert_hunyuan_video_1_5_lora_to_comfy.py writes). The LyCORIS file
  (LoHa/LoKr) is in ComfyUI's names; q/k/v's LoKr share w2 there (tasks/training/lycoris_fused.py).
- LoRA file: diffusers' layout (`transformer.<module>.lora_A.weight`, peft config in the metadata), written with
  HunyuanVideoLoraLoaderMixin.save_lora_weights; HunyuanVideo15Pipeline has no LoRA loader in diffusers 0.42.1, so
  it is loaded with the transformer's own `load_lora_adapter(file, prefix="transformer", use_safetensors=True)`
  (without use_safetensors it reads no metadata and applies alpha = rank).
- Sampling: the pipeline from cached text (no text encoders loaded), CFG at `guidance` through a copy of its
  guider (`guider.new(guidance_scale=...)`) against the prompt's negative or the cached empty prompt.

Untested with the real weights here."""
from __future__ import annotations

import logging
from pathlib import Path

from tasks.data.clips import Video
from tasks.lazy import LazyClass, lazy, no_grad
from tasks.models.bases.adapter import BLOCK, Clips, KohyaLayout, load_lora_file, on_pipeline_device
from tasks.models.flux import KOHYA_RULES as FLUX1_RULES
from tasks.models.bases.flow_matching import TransformerAdapter, noise_latents, weighted_loss

torch = lazy("torch")
diffusers = lazy("diffusers")
np, Image = lazy("numpy"), lazy("PIL.Image")  # decoding a video only; a no-op run imports this module

log = logging.getLogger("loraflow")
_SAFE = dict(use_safetensors=True)
VISION_TOKENS = 729  # HunyuanVideo15Pipeline.vision_num_semantic_tokens (SigLIP's tokens; zeros for t2v)
_BYT5_MAX = 256  # HunyuanVideo15Pipeline.tokenizer_2_max_length
_TEXT_KEYS = ("prompt_embeds", "prompt_embeds_mask", "prompt_embeds_2", "prompt_embeds_mask_2")
_WARNED: set[str] = set()
# musubi-tuner's module of each diffusers Linear of a double-stream block (diffusers' own
# scripts/convert_hunyuan_video1_5_to_diffusers.py maps them one to one: img_attn_q -> attn.to_q, img_mlp.fc1 ->
# ff.net.0.proj, img_mod.linear -> norm1.linear, txt_ likewise), named as networks.lora does
MUSUBI_RULES = tuple((BLOCK + diffusers, f"double_blocks_{{}}_{musubi}", 1) for diffusers, musubi in (
    (r"attn\.to_q", "img_attn_q"), (r"attn\.to_k", "img_attn_k"), (r"attn\.to_v", "img_attn_v"),
    (r"attn\.to_out\.0", "img_attn_proj"), (r"attn\.add_q_proj", "txt_attn_q"), (r"attn\.add_k_proj", "txt_attn_k"),
    (r"attn\.add_v_proj", "txt_attn_v"), (r"attn\.to_add_out", "txt_attn_proj"), (r"ff\.net\.0\.proj", "img_mlp_fc1"),
    (r"ff\.net\.2", "img_mlp_fc2"), (r"ff_context\.net\.0\.proj", "txt_mlp_fc1"), (r"ff_context\.net\.2", "txt_mlp_fc2"),
    (r"norm1\.linear", "img_mod_linear"), (r"norm1_context\.linear", "txt_mod_linear")))


class HunyuanVideo15Adapter(TransformerAdapter):
    family = "hunyuan_video15"
    # kohya: musubi-tuner's names (MUSUBI_RULES); ComfyUI's model is built from Flux's DoubleStreamBlock: Flux's
    # double-block rules (no single blocks; its embedders are no LoRA targets)
    kohya = KohyaLayout("networks.lora_hv_1_5", "hunyuan_video_1_5", rules=MUSUBI_RULES,
                        comfyui_rules=tuple(r for r in FLUX1_RULES if r[0].startswith(BLOCK)), lycoris_names="comfyui")
    # frame_step: the VAE's temporal factor (pipeline.vae_scale_factor_temporal); 15 fps: the rate of the pipeline's
    # example (export_to_video(..., fps=15))
    clips = Clips(frame_step=4, default_fps=15.0)
    latent_version = "2"  # a latent is stored with the frame rate it was taken at ("fps")
    size_multiple = 16  # VAE /16 (vae_scale_factor_spatial), 1x1 patches
    swap_blocks = ("transformer_blocks",)  # train.blocks_to_swap
    max_text_tokens = 1000  # the pipeline's tokenizer_max_length (Qwen2.5-VL), its preset's model.max_sequence_length
    pipeline_cls = LazyClass("diffusers", "HunyuanVideo15Pipeline")
    reference_kohya = "merge"  # diffusers reads none for HunyuanVideo 1.5 (ComfyUI's fused names)
    # the text encoders' pipeline: the text-to-video one for image-to-video too (the same encode_prompt, "Copied
    # from" it), so caching text loads no image encoder
    text_pipeline_cls = LazyClass("diffusers", "HunyuanVideo15Pipeline")
    denoiser_cls = LazyClass("diffusers", "HunyuanVideo15Transformer3DModel")
    denoiser_subfolder = "transformer"
    text_components = ("tokenizer", "text_encoder", "tokenizer_2", "text_encoder_2")
    sample_components = ("transformer", "vae", "scheduler", "guider")
    sample_parts = dict(text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None, **_SAFE)
    # the double-stream blocks' attention (both streams) and feed-forwards, by full path: the token refiner's
    # `context_embedder.token_refiner.refiner_blocks` and the embedders do not match
    LORA_TARGETS = (r".*transformer_blocks\.\d+\.attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj"
                    r"|to_add_out)|.*transformer_blocks\.\d+\.(ff|ff_context)\.net\.(0\.proj|2)")

    # -- latents ---------------------------------------------------------------------------------
    # image tokens training feeds: none for text-to-video (the pipeline's VISION_TOKENS zeros are masked out either
    # way: see the docstring); image-to-video's adapter: the first frame's
    image_tokens = 0

    @classmethod
    def activation_geometry(cls, config: dict, size: tuple[int, int], text_tokens: int, frames: int = 1) -> tuple[int, int, int]:
        """1x1x1 patches of (1 + (F - 1) / 4) latent frames, /16 in space, joined in every block by the Qwen
        caption, the ByT5 window (min(256, its length)) and the image tokens training feeds (`image_tokens`)."""
        w, h = size
        latent_frames = 1 + (frames - 1) // 4
        p = config["patch_size"]
        tokens = (latent_frames // config["patch_size_t"]) * (h // (16 * p)) * (w // (16 * p))
        tokens += text_tokens + min(256, text_tokens) + cls.image_tokens
        return tokens, config["num_attention_heads"] * config["attention_head_dim"], config["num_layers"]

    def load_vae(self):
        return diffusers.AutoencoderKLHunyuanVideo15.from_pretrained(self.model_dir, subfolder="vae", dtype=self.dtype,
                                                                     **_SAFE).to(self.device).eval()

    @no_grad
    def encode_latents(self, vae, pixels):
        # pixels [B, 3, F, H, W] (an image: [B, 3, H, W], one frame) -> the mode x scaling_factor (the pipeline
        # divides by it before decoding): [B, C, 1 + (F - 1) / 4, H / 16, W / 16]
        if pixels.ndim == 4:
            pixels = pixels[:, :, None]
        z = vae.encode(pixels.to(vae.device, vae.dtype, non_blocking=True)).latent_dist.mode()
        return z * vae.config.scaling_factor

    @classmethod
    def reference_pipeline(cls, base, text_tokens):
        # its text windows as the adapter trained them; no CFG: the pipeline takes its scale from the guider
        pipe = super().reference_pipeline(base, text_tokens)
        cls(base, "float32", text_tokens).set_text_lengths(pipe)
        pipe.guider = pipe.guider.new(guidance_scale=1.0)
        return pipe

    # -- text ------------------------------------------------------------------------------------
    def set_text_lengths(self, pipe):
        """The pipeline's hard-coded text windows, from model.max_sequence_length (see the module docstring)."""
        pipe.tokenizer_max_length = self.max_sequence_length
        pipe.tokenizer_2_max_length = min(_BYT5_MAX, self.max_sequence_length)
        return pipe

    def load_text_encoders(self):
        # HunyuanVideo15Pipeline.__init__ reads vae.config (diffusers 0.42.1 fails with vae=None): the VAE is
        # loaded with the pipeline and dropped; only the two text encoders go to the device
        # the two text encoders streamed, stored as text.quantize says and placed (pretrained_text_encoder)
        pipe = self.text_pipeline_cls.from_pretrained(self.model_dir, dtype=self.dtype, transformer=None,
                                                      **self.text_encoder_parts(), **_SAFE)
        pipe.vae = None
        return self.set_text_lengths(pipe)

    @no_grad
    def encode_text(self, pipe, texts):
        out = pipe.encode_prompt(texts, device=self.device, dtype=self.dtype, batch_size=len(texts))
        for text, m in zip(texts, out[1]):
            if int(m.sum()) == pipe.tokenizer_max_length and text not in _WARNED:  # a full window: maybe cut
                _WARNED.add(text)
                log.warning("text may be truncated at model.max_sequence_length=%d Qwen2.5-VL tokens: %.80r",
                            pipe.tokenizer_max_length, text)
        out = [t.cpu() for t in out]
        return [{k: t[i] for k, t in zip(_TEXT_KEYS, out)} for i in range(len(texts))]

    # -- training --------------------------------------------------------------------------------
    def load_denoiser(self):
        return self.pretrained_denoiser(self.denoiser_cls, "transformer")

    def training_loss(self, transformer, latents, text, train_cfg, scheduler, generators):
        if latents.ndim == 4:  # [B, C, h, w]: never stored by this family, but a one-frame video all the same
            latents = latents[:, :, None]
        noisy, noise, timesteps, sigmas = noise_latents(latents, train_cfg, scheduler, generators)
        cond, image_embeds = self.condition(transformer, noisy, text)
        inputs = torch.cat([noisy, cond], dim=1)
        t = {k: text[k].to(latents.device) for k in _TEXT_KEYS}
        pred = transformer(hidden_states=inputs, image_embeds=image_embeds, timestep=timesteps.to(latents.dtype),
                           encoder_hidden_states=t["prompt_embeds"].to(latents.dtype),
                           encoder_attention_mask=t["prompt_embeds_mask"],
                           encoder_hidden_states_2=t["prompt_embeds_2"].to(latents.dtype),
                           encoder_attention_mask_2=t["prompt_embeds_mask_2"], return_dict=False)[0]
        return weighted_loss(pred, noise - latents, sigmas, train_cfg)  # velocity target

    def condition(self, transformer, noisy, text):
        """(the channels after the noisy latents, image_embeds): text-to-video's are zeros, condition latents and
        a zero mask channel (prepare_cond_latents_and_mask) and no image tokens (the pipeline's 729 zeros are masked
        out; hunyuan_video15_i2v.py: the first frame's)."""
        b, _, f, h, w = noisy.shape
        return (torch.cat([torch.zeros_like(noisy), noisy.new_zeros(b, 1, f, h, w)], dim=1),
                noisy.new_zeros(b, self.image_tokens, transformer.config.image_embed_dim))

    # -- the LoRA file ---------------------------------------------------------------------------
    def save_lora(self, lora_state_dict, out_dir, lora_config):
        # HunyuanVideo15Pipeline has no save_lora_weights; HunyuanVideo's loader mixin writes the same layout
        # (`transformer.` prefix, the peft config as `transformer.*` metadata)
        from diffusers.loaders.lora_pipeline import HunyuanVideoLoraLoaderMixin

        HunyuanVideoLoraLoaderMixin.save_lora_weights(out_dir, transformer_lora_layers=lora_state_dict,
                                                      transformer_lora_adapter_metadata=lora_config,
                                                      safe_serialization=True)
        return Path(out_dir) / "pytorch_lora_weights.safetensors"

    def load_sampler(self, lora_file, denoiser=None):
        from tasks.models.lora_variants import lycoris

        pipe = self.pipeline_cls.from_pretrained(self.model_dir, dtype=self.dtype, **self.live(denoiser),
                                                 **self.sample_parts)
        if lora_file is not None:
            if lycoris.file_network(lora_file) or lycoris.is_lycoris_file(lora_file):
                load_lora_file(pipe, self.denoiser_subfolder, lora_file)
            else:  # no pipe.load_lora_weights in diffusers 0.42.1: the transformer's peft loader reads the file;
                # use_safetensors=True, else it skips the file's metadata (the trained alpha) and scales by 1
                pipe.transformer.load_lora_adapter(str(lora_file), prefix="transformer", use_safetensors=True)
        pipe.set_progress_bar_config(disable=True)
        return self.place(pipe, denoiser)

    # -- sampling --------------------------------------------------------------------------------
    @no_grad
    def sample(self, pipe, prompt, negative, empty, width, height, steps, guidance, true_cfg, seed,
               generator_device="cpu", frames=1, fps=15.0):
        # Real CFG at `guidance` against the prompt's negative, else the cached empty prompt (the pipeline
        # cannot encode "" without its text encoders); `true_cfg` is unused. Frames 1 + 4k, sides multiples of 16.
        embeds = self.guided_embeds(pipe, prompt, negative if negative is not None else empty, guidance)
        generator = self.make_generator(pipe, seed, generator_device)
        out = pipe(**embeds, width=width, height=height, num_frames=frames, num_inference_steps=steps,
                   generator=generator, output_type="np").frames[0]
        return self.frames_video(out, fps)

    def guided_embeds(self, pipe, prompt: dict, uncond: dict, guidance: float) -> dict:
        """The pipeline's prompt/negative kwargs from cached text, its guider at `guidance`."""
        pipe.guider = pipe.guider.new(guidance_scale=guidance)
        embeds = {}
        for name, d in (("", prompt), ("negative_", uncond)):
            d = on_pipeline_device(pipe, d)
            embeds.update({f"{name}{k}": d[k][None].to(self.dtype) for k in _TEXT_KEYS})
        return embeds

    @staticmethod
    def frames_video(frames, fps: float) -> Video:
        return Video([Image.fromarray(f) for f in (np.clip(frames, 0, 1) * 255).round().astype(np.uint8)], float(fps))
