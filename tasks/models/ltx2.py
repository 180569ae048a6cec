"""LTX-2 (Lightricks' audio-video model; diffusers' LTX2Pipeline, pipelines/ltx2/pipeline_ltx2.py), trained as a
VIDEO LoRA: LTX2VideoTransformer3DModel on 1x1x1 patches of the causal video VAE's latents (AutoencoderKLLTX2Video:
/32 in space, /8 in time, 1 + 8k frames, 128 channels normalised per channel), text from Gemma 3 through the
pipeline's connectors, flow matching with the velocity target.

What follows which reference:
- Latents: the VAE's mode, normalised as the pipeline normalises given latents and un-normalises them before
  `vae.decode` (`_normalize_latents` / `_denormalize_latents`: (z - latents_mean) * scaling_factor / latents_std);
  a still image is a one-frame video (the causal VAE encodes the first frame alone).
- Text: the pipeline's own `encode_prompt` (Gemma's hidden states of every layer, left-padded to
  max_sequence_length) and then its own `connectors` (the per-layer norm, the feature projection and the video and
  audio connector transformers, whose learnable registers fill the padding), as `__call__` runs them. The cache
  keeps the connectors' outputs, per caption at that fixed length: `prompt_embeds` (video), `audio_prompt_embeds`
  and `attention_mask` (all ones where registers fill the padding). Gemma's raw stacked states would be
  49 x 3840 values a token with the real Gemma-3-12B. Lightricks' trainer caches text too (ltx-trainer
  scripts/process_captions.py: Gemma's features after the projection; its frozen connectors then run in each
  training step); here the frozen connectors run once, when the text is cached. Sampling feeds the cached outputs
  through `CachedConnectors`, so neither the text encoder nor the connectors are loaded there.
- Training, video only: Lightricks' LTX-2 trainer (packages/ltx-trainer, training_strategies/text_to_video.py with
  `with_audio: false`) passes no audio modality, and ltx-core's BasicAVTransformerBlock then runs no
  audio-to-video attention (`run_a2v` needs audio tokens). diffusers' transformer always runs both streams, so the
  loss calls it with `isolate_modalities=True` (no audio-to-video or video-to-audio attention: the video
  prediction does not depend on the audio input) and a one-token silent (zero) audio latent whose prediction is
  dropped. Tokens and positions as the pipeline makes them: `_pack_latents` (patch 1), `rope.prepare_video_coords`
  for the clip's latent frames at its frame rate (`fps`, the RoPE's time axis in seconds; text["fps"] per item
  when the batch carries it, else `clips.default_fps`), timestep = sigma x 1000 (the transformer's
  timestep_scale_multiplier; the pipeline passes the scheduler's t), target noise - latents (ltx-trainer's
  `video_noise - video_latents`).
- LoRA targets: ltx-trainer's video-only modules (docs/configuration-reference.md, "Understanding Target
  Modules": attn1 and attn2 to_q/to_k/to_v/to_out.0, ff.net.0.proj, ff.net.2), never the audio_* or the
  cross-modal audio_to_video_attn / video_to_audio_attn. These names are the same in ltx-core, ComfyUI and
  diffusers for these modules.
- Sampling: LTX2Pipeline as it is (joint audio-video generation, its CFG, guidance rescale and modality guidance
  defaults); its spatio-temporal guidance only where the transformer has perturbed attention (LTX-2.0 has none:
  the pass would change nothing), and `use_cross_timestep` only for transformers with cross-attention modulation
  (LTX-2.3; the argument's docs call False LTX-2.0's behaviour). The audio is rendered and left out of the Video.
- Sizes: multiples of 32 (the pipeline refuses others). The decoder pads by reflection, so a side needs at least
  two latent cells: 64 px.
- Versions: LTX-2.3 and LTX-2.5 folders (diffusers layout) train and sample as they are; what differs is read from
  the folder. The text encoder is the class model_index.json names (Gemma 3 in 2.0 and 2.3,
  Gemma4UnifiedForConditionalGeneration in 2.5; encode_prompt stacks either's hidden states). 2.3/2.5's connectors
  project per modality (`per_modality_projections`: video 4096, audio 2048 wide, where 2.0 gives both Gemma's
  width), so the cache keeps two widths and CachedConnectors splits at the connectors' video width. Their
  transformer has no caption projection and modulates the text keys/values by `sigma` (passed as the pipeline
  passes it: the scaled timestep); the video latent space (128 channels, /32, /8, per-channel statistics) is
  unchanged. 2.5's optional parts stay unloaded (duration head, Gemma 4 prompt enhancer and processor: num_frames
  is always given, prompt enhancement is off); its samples decode with the conv `vae`, as LTX2Pipeline does (2.5's
  diffusion decoder runs in a pipeline of its own).

Untested with the real weights here."""
from __future__ import annotations

import functools
import logging

from tasks.data.clips import Video
from tasks.lazy import LazyClass, lazy, no_grad
from tasks.models.bases.adapter import Clips, KohyaLayout, on_pipeline_device
from tasks.models.bases.flow_matching import TransformerAdapter, noise_latents, weighted_loss
from tasks.models.bases.real_size import RealSize

torch = lazy("torch")
diffusers = lazy("diffusers")
np, Image = lazy("numpy"), lazy("PIL.Image")  # decoding a video only; a no-op run imports this module

log = logging.getLogger("loraflow")
_SAFE = dict(use_safetensors=True)
# LTX-2.5's optional parts stay unloaded: its Gemma 4 prompt enhancer and processor (LTX2Pipeline runs them only with
# enable_prompt_enhancement) and its duration head (it predicts num_frames only when a caller omits them)
_UNUSED = dict(prompt_enhancer=None, processor=None, duration_head=None)
_TEXT_PARTS = dict(transformer=None, vae=None, audio_vae=None, vocoder=None, **_UNUSED, **_SAFE)
_WARNED: set[str] = set()


@functools.cache
def _cached_connectors_class() -> type:
    """LTX2Pipeline's `connectors` for text that already went through them (the cache): its `prompt_embeds` are the
    video and audio connector outputs side by side (`video_width` wide, then the audio's: equal in LTX-2.0, 4096
    and 2048 in LTX-2.3/2.5), its mask the connectors' mask. No weights (a scalar buffer gives `pipe.to` a dtype and
    device); a subclass, so the pipeline's type check passes. Defined on first use."""
    from diffusers import ModelMixin
    from diffusers.configuration_utils import register_to_config
    from diffusers.pipelines.ltx2 import LTX2TextConnectors

    class CachedConnectors(LTX2TextConnectors):
        @register_to_config
        def __init__(self, video_width: int = 0):
            ModelMixin.__init__(self)  # none of the connectors' layers
            self.register_buffer("anchor", torch.zeros(()), persistent=False)

        def forward(self, text_encoder_hidden_states, attention_mask, padding_side="left", scale_factor=8):
            video = text_encoder_hidden_states[..., :self.config.video_width]
            return video, text_encoder_hidden_states[..., self.config.video_width:], attention_mask

    return CachedConnectors


class LTX2Adapter(TransformerAdapter):
    family = "ltx2"
    kohya = KohyaLayout("networks.lora_ltx2", "ltx2", names="named", lycoris_names="comfyui")  # ltx-core's = ComfyUI's
    # LTX-2's video stream (48 blocks, 4096 wide, the audio stream one token): measured on LTX-2 at 768x512, 121 and 49
    # frames (bench.memory --families: 36.7/37.4 per block without checkpointing; 1.025/1.028 and 39.6/40.4 with)
    activation_factors = (37.0, 1.03, 40.0)
    activation_extras = {"text_offloaded": 1.5}  # video and audio captions, 4096 + 2048 wide at a 4096 width
    # frame_step: the VAE's temporal factor (pipeline.vae_temporal_compression_ratio); 24 fps: LTX-2's native rate
    # (the pipeline's frame_rate default); min_side: the decoder pads by reflection, so a side needs two latent cells
    clips = Clips(frame_step=8, default_fps=24.0, min_side=64)
    latent_version = "2"  # a latent is stored with the frame rate it was taken at ("fps")
    # data.vae_tiling: time tiled too (16-frame tiles); diffusers 0.42.1's _encode reads the decoding flag for it
    vae_tiling = {"use_framewise_encoding": True, "use_framewise_decoding": True}
    size_multiple = 32  # VAE /32 (vae_spatial_compression_ratio), 1x1 patches
    swap_blocks = ("transformer_blocks",)  # train.blocks_to_swap
    max_text_tokens = 1024  # LTX2Pipeline's default window (Gemma 3; a multiple of the connectors' 128 registers)
    pipeline_cls = LazyClass("diffusers", "LTX2Pipeline")
    reference_kohya = "merge"  # diffusers reads no kohya layout for LTX-2
    denoiser_cls = LazyClass("diffusers", "LTX2VideoTransformer3DModel")
    denoiser_subfolder = "transformer"
    text_components = ("tokenizer", "text_encoder", "connectors")
    sample_components = ("transformer", "vae", "audio_vae", "vocoder", "scheduler")
    # ltx-trainer's video-only target modules, by full path: the video stream's self- and text cross-attention and
    # its feed-forward in every block (audio_attn1/2, audio_ff and the cross-modal attentions do not match)
    LORA_TARGETS = (r".*transformer_blocks\.\d+\.(attn1|attn2)\.(to_q|to_k|to_v|to_out\.0)"
                    r"|.*transformer_blocks\.\d+\.ff\.net\.(0\.proj|2)")

    # -- latents ---------------------------------------------------------------------------------
    @staticmethod
    def activation_geometry(config: dict, size: tuple[int, int], text_tokens: int, frames: int = 1) -> tuple[int, int, int]:
        """1x1x1 patches of (1 + (F - 1) / 8) latent frames, /32 in space; the caption is cross-attention's keys
        (the audio stream: one token when training video only)."""
        w, h = size
        st, sh, sw = config.get("vae_scale_factors", (8, 32, 32))
        latent_frames = 1 + (frames - 1) // st
        p = config["patch_size"]
        tokens = (latent_frames // config["patch_size_t"]) * (h // (sh * p)) * (w // (sw * p))
        return tokens, config["num_attention_heads"] * config["attention_head_dim"], config["num_layers"]

    def load_vae(self):
        return diffusers.AutoencoderKLLTX2Video.from_pretrained(self.model_dir, subfolder="vae", dtype=self.dtype,
                                                                **_SAFE).to(self.device).eval()

    @no_grad
    def encode_latents(self, vae, pixels):
        # pixels [B, 3, F, H, W] (an image: [B, 3, H, W], one frame) -> the mode, normalised as the pipeline
        # normalises latents: [B, C, 1 + (F - 1) / 8, H / 32, W / 32]
        if pixels.ndim == 4:
            pixels = pixels[:, :, None]
        z = vae.encode(pixels.to(vae.device, vae.dtype, non_blocking=True)).latent_dist.mode()
        return self.pipeline_cls._normalize_latents(z, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)

    # -- text ------------------------------------------------------------------------------------
    def load_text_encoders(self):
        # tokenizer, Gemma 3 and the connectors, in the pipeline that runs them
        return self.pipeline_cls.from_pretrained(self.model_dir, dtype=self.dtype, **self.text_encoder_parts(),
                                                 **_TEXT_PARTS).to(self.device)

    @no_grad
    def encode_text(self, pipe, texts):
        embeds, mask, _, _ = pipe.encode_prompt(texts, do_classifier_free_guidance=False, device=self.device,
                                                max_sequence_length=self.max_sequence_length)
        for text, m in zip(texts, mask):
            if int(m.sum()) == self.max_sequence_length and text not in _WARNED:  # a full window: maybe cut
                _WARNED.add(text)
                log.warning("text may be truncated at model.max_sequence_length=%d Gemma tokens: %.80r",
                            self.max_sequence_length, text)
        # the pipeline's next step in __call__: the connectors, with the tokenizer's (left) padding side
        video, audio, mask = pipe.connectors(embeds, mask, padding_side=pipe.tokenizer.padding_side)
        video, audio, mask = video.cpu(), audio.cpu(), mask.to(torch.int64).cpu()
        return [{"prompt_embeds": video[i], "audio_prompt_embeds": audio[i], "attention_mask": mask[i]}
                for i in range(len(texts))]

    # -- training --------------------------------------------------------------------------------
    def load_denoiser(self):
        return self.pretrained_denoiser(self.denoiser_cls, "transformer")

    def training_loss(self, transformer, latents, text, train_cfg, scheduler, generators):
        if latents.ndim == 4:  # [B, C, h, w]: never stored by this family, but a one-frame video all the same
            latents = latents[:, :, None]
        b, _, f, h, w = latents.shape
        noisy, noise, timesteps, sigmas = noise_latents(latents, train_cfg, scheduler, generators)
        cfg, pack = transformer.config, self.pipeline_cls
        fps = text["fps"].to(latents.device, torch.float32).view(b, 1, 1) if "fps" in text else self.clips.default_fps
        video_coords = transformer.rope.prepare_video_coords(b, f, h, w, latents.device, fps=fps)
        # video only: one silent audio token, the two streams isolated (no cross-modal attention)
        audio = torch.zeros(b, 1, cfg.audio_in_channels, device=latents.device, dtype=latents.dtype)
        audio_coords = transformer.audio_rope.prepare_audio_coords(b, 1, latents.device)
        t = timesteps.to(latents.dtype)
        mask = text["attention_mask"].to(latents.device)
        pred = transformer(hidden_states=pack._pack_latents(noisy, cfg.patch_size, cfg.patch_size_t),
                           audio_hidden_states=audio, encoder_hidden_states=text["prompt_embeds"].to(latents.dtype),
                           audio_encoder_hidden_states=text["audio_prompt_embeds"].to(latents.dtype),
                           timestep=t, sigma=t, encoder_attention_mask=mask, audio_encoder_attention_mask=mask,
                           num_frames=f, height=h, width=w, audio_num_frames=1, video_coords=video_coords,
                           audio_coords=audio_coords, isolate_modalities=True, return_dict=False)[0]
        pred = pack._unpack_latents(pred, f, h, w, cfg.patch_size, cfg.patch_size_t)
        return weighted_loss(pred, noise - latents, sigmas, train_cfg)  # velocity target

    # -- sampling --------------------------------------------------------------------------------
    @property
    def sample_parts(self) -> dict:
        # the text arrives as cached connector outputs (CachedConnectors): no Gemma, tokenizer or connector weights
        return dict(text_encoder=None, tokenizer=None, connectors=_cached_connectors_class()(self._video_text_width()),
                    **_UNUSED, **_SAFE)

    def _video_text_width(self) -> int:
        """The video connector's output width (the connectors' config): LTX-2.0 projects Gemma's states to its width
        for both streams; LTX-2.3/2.5 (`per_modality_projections`) to each stream's own (`video_hidden_dim`)."""
        import json

        c = json.loads((self.model_dir / "connectors" / "config.json").read_text())
        return c["video_hidden_dim"] if c.get("per_modality_projections") else c["caption_channels"]

    def _embeds(self, pipe, d: dict, name: str) -> dict:
        d = on_pipeline_device(pipe, d)
        return {f"{name}_embeds": torch.cat([d["prompt_embeds"], d["audio_prompt_embeds"]], -1)[None].to(self.dtype),
                f"{name}_attention_mask": d["attention_mask"][None]}

    @no_grad
    def sample(self, pipe, prompt, negative, empty, width, height, steps, guidance, true_cfg, seed,
               generator_device="cpu", frames=1, fps=24.0):
        # CFG at `guidance` against the prompt's negative, else the cached empty prompt (the pipeline always runs
        # CFG: its audio guidance defaults to 7); `true_cfg` is unused. Frames 1 + 8k, sides multiples of 32.
        if min(width, height) < 2 * self.size_multiple:  # one latent cell: the decoder's reflection pad fails
            from tasks.config import ConfigError

            raise ConfigError(f"LTX-2 renders sides of 64 px or more (its VAE decoder pads by reflection); "
                              f"{width}x{height} asked: raise data.resolution or sample.width/height "
                              "(a prompt's --w/--h)")
        uncond = negative if negative is not None else empty
        t = pipe.transformer.config
        stg = {} if t.perturbed_attn else dict(stg_scale=0.0, audio_stg_scale=0.0, spatio_temporal_guidance_blocks=None)
        generator = self.make_generator(pipe, seed, generator_device)
        out = pipe(**self._embeds(pipe, prompt, "prompt"), **self._embeds(pipe, uncond, "negative_prompt"),
                   guidance_scale=guidance, width=width, height=height, num_frames=frames, frame_rate=float(fps),
                   num_inference_steps=steps, max_sequence_length=self.max_sequence_length, generator=generator,
                   use_cross_timestep=bool(t.cross_attn_mod or t.audio_cross_attn_mod), output_type="np",
                   **stg).frames[0]
        return Video([Image.fromarray(f) for f in (np.clip(out, 0, 1) * 255).round().astype(np.uint8)], float(fps))

    # -- full size (bench.memory: tasks/models/bases/real_size.py) --------------------------------
    # LTX2VideoTransformer3DModel's defaults are Lightricks/LTX-2's (48 blocks, 4096 wide video stream); its video
    # stream at 768x512, 121 and 49 frames; the text connectors at their class defaults (LTX-2's)
    real_sizes = tuple(RealSize(name, "LTX2VideoTransformer3DModel", size=(768, 512), frames=frames,
                                vae=("AutoencoderKLLTX2Video", {}), text=(("text_encoder", "gemma3_12b"),),
                                modules=(("connectors", "diffusers.pipelines.ltx2.connectors:LTX2TextConnectors"),),
                                **kw) for name, frames, kw in (
        ("ltx2", 121, dict(rows=("bf16", "bf16+ckpt", "nf4+ckpt", "nf4+ckpt+offload"), cards=(1,))),
        ("ltx2_49f", 49, dict(rows=("bf16", "bf16+ckpt")))))

    @staticmethod
    def bench_batch(config, size, frames, text_len):
        # 128-channel latents (/8 in time, /32 in space); the connectors' video and audio text (LTX-2.3/2.5, without
        # the transformer's caption projection: at the streams' cross-attention widths)
        (w, h), z = size, lambda *s: torch.zeros(*s, dtype=torch.bfloat16)  # noqa: E731
        video, audio = ((config["caption_channels"],) * 2 if config.get("use_prompt_embeddings", True)
                        else (config["cross_attention_dim"], config["audio_cross_attention_dim"]))
        return z(1, 128, 1 + (frames - 1) // 8, h // 32, w // 32), {
            "prompt_embeds": z(1, text_len, video),
            "audio_prompt_embeds": z(1, text_len, audio),
            "attention_mask": torch.ones(1, text_len, dtype=torch.int64)}
