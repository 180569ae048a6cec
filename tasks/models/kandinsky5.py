"""Kandinsky 5.0 Video (text-to-video; Lite 2B, Pro 19B): Kandinsky5Transformer3DModel (text encoder blocks over the
Qwen caption, then visual decoder blocks: self-attention over 1x2x2 patches, cross-attention to the caption, the
CLIP pooled vector added to the time embedding) on HunyuanVideo's causal VAE latents (AutoencoderKLHunyuanVideo: /8
in space, /4 in time, 1 + 4k frames, 16 channels times scaling_factor), flow matching with real CFG.

What follows which reference (diffusers 0.42.1, pipelines/kandinsky5/pipeline_kandinsky.py):
- Latents: the VAE's mode times `vae.config.scaling_factor`, as `__call__` divides by it before `vae.decode` (no
  shift); stored [C, F, h, w] as the other video families store them, handed to the transformer channels-last
  [B, F, h, w, C] as `prepare_latents` makes them; a still image is a one-frame video.
- Text: the pipeline's own `encode_prompt`, one caption a call (the pipeline pads a batch to its longest caption
  and its transformer takes no text mask, so a caption's tokens are those of its own call): Qwen2.5-VL's last hidden
  states after the 128 template tokens, each caption its own length (`prompt_cu_seqlens`), and CLIP's pooled
  output. Cached as a window of model.max_sequence_length (zeros past the caption) plus the mask, so captions stack
  into batches; training and sampling cut each back to its tokens (a batch of unequal captions runs one item a
  transformer call, as musubi-tuner's kandinsky5_train_network.py call_dit does).
- Training, as `__call__` feeds the transformer: hidden_states = cat([noisy, zeros, zero mask]) channels-last where
  the transformer has `visual_cond` (every released video model; the image-to-video adapter puts the first frame
  there), visual_rope_pos / text_rope_pos / scale_factor (`_get_scale_factor` of the pixel size: (1, 2, 2) inside
  480..854 px, else (1, 3.16, 3.16)) and sparse_params (`get_sparse_params`: None but for "nabla" attention) as the
  pipeline computes them; timestep = the scheduler's t = sigma x 1000 (its config's shift), target noise - latents
  (FlowMatchEulerDiscreteScheduler.step: x + (sigma_next - sigma) * v).
- LoRA targets: musubi-tuner's (networks/lora_kandinsky.py: self/cross attention to_query/to_key/to_value/out_layer
  and feed_forward in_layer/out_layer of every text and visual block; modulation left out).
- kohya file: musubi-tuner's names `lora_unet_<module, "." -> "_">` (its DiT, kandinsky5/models/dit.py and nn.py,
  has diffusers' module names), which ComfyUI's generic rule maps onto its Kandinsky5 model (comfy/ldm/kandinsky5/
  model.py: the same names), so the kohya file is the ComfyUI file (tests/test_kandinsky5.py cites the lines).
  diffusers' KandinskyLoraLoaderMixin reads only its own layout: the learning check merges the kohya file.
- LoRA file: diffusers' layout written and read by KandinskyLoraLoaderMixin (save_lora_weights / load_lora_weights).
- Sampling: the pipeline from cached text (no text encoder loaded), CFG at `guidance` (> 1) against the prompt's
  negative, else the cached empty prompt. The pipeline itself, given no negative, encodes its built-in negative
  ("Static, 2D cartoon, ...", its __call__): write it as the prompt's --n to sample as the pipeline does.

Untested with the real weights here."""
from __future__ import annotations

import logging
from types import SimpleNamespace

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
_WARNED: set[str] = set()
_BLOCK = r".*(text|visual)_transformer_blocks\.\d+\."
# the released video models' arch values beside Kandinsky5Transformer3DModel's defaults (musubi-tuner's
# kandinsky5/configs.py TASK_CONFIGS k5-lite-t2v-5s-sd / k5-pro-*-5s-sd, the original repository's configs)
LITE = dict(in_visual_dim=16, out_visual_dim=16, model_dim=1792, ff_dim=7168, visual_cond=True)
PRO = dict(in_visual_dim=16, out_visual_dim=16, time_dim=1024, model_dim=4096, ff_dim=16384, num_text_blocks=4,
           num_visual_blocks=60, axes_dims=(32, 48, 48), visual_cond=True)
TEXT_ENCODERS = (("text_encoder", "qwen2_5_vl_7b"), ("text_encoder_2", "clip_l"))
VAE = ("AutoencoderKLHunyuanVideo", {})  # the class defaults are HunyuanVideo's VAE


class Kandinsky5Adapter(TransformerAdapter):
    family = "kandinsky5"
    # musubi-tuner's network module and ss_base_model_version (ARCHITECTURE_KANDINSKY5_FULL); ComfyUI maps no
    # `lycoris_` name for it, only the generic `lora_unet_<model key>`: the LyCORIS file in those names
    kohya = KohyaLayout("networks.lora_kandinsky", "kandinsky5", names="named", lycoris_names="comfyui")
    original_layout = "diffusers"  # the released DiT files (kandinsky5lite_t2v_sft_5s.safetensors) use these names
    widest_arch = dict(num_text_blocks=4, num_visual_blocks=60)  # Pro's blocks (loraflow-lora without config.json)
    # frame_step: the VAE's temporal factor; 24 fps: the rate of the pipeline's example (export_to_video(fps=24))
    clips = Clips(frame_step=4, default_fps=24.0)
    latent_version = "2"  # a latent is stored with the frame rate it was taken at ("fps"), as the video families
    size_multiple = 16  # VAE /8, then 1x2x2 patches (check_inputs: height and width divisible by 16)
    swap_blocks = ("visual_transformer_blocks",)  # train.blocks_to_swap (the text blocks are 2 or 4)
    max_text_tokens = 1024  # check_inputs refuses max_sequence_length above 1024 (the text RoPE's table)
    pipeline_cls = LazyClass("diffusers", "Kandinsky5T2VPipeline")
    text_pipeline_cls = LazyClass("diffusers", "Kandinsky5T2VPipeline")  # the same encode_prompt for I2V
    denoiser_cls = LazyClass("diffusers", "Kandinsky5Transformer3DModel")
    denoiser_subfolder = "transformer"
    reference_kohya = "merge"  # KandinskyLoraLoaderMixin reads no kohya layout
    text_components = ("tokenizer", "text_encoder", "tokenizer_2", "text_encoder_2")
    sample_parts = dict(text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None, **_SAFE)
    LORA_TARGETS = (_BLOCK + r"(self_attention|cross_attention)\.(to_query|to_key|to_value|out_layer)|"
                    + _BLOCK + r"feed_forward\.(in_layer|out_layer)")
    # bench.memory: Lite at the pipeline example's 768x512, 33 frames (1 + 4k; its example renders 121). The whole run
    # fits 24 GB: below, the sample node's untiled HunyuanVideo decode (14.5 GiB measured at this size) does not
    real_sizes = (RealSize("kandinsky5_lite", "Kandinsky5Transformer3DModel", arch=LITE, size=(768, 512), frames=33,
                           text=TEXT_ENCODERS, vae=VAE, rows=("bf16+ckpt", "nf4+ckpt"),
                           card=(24, 32)),)

    @staticmethod
    def bench_batch(config, size, frames, text_len):
        # 16-channel latents [1, C, 1 + (F - 1) / 4, h, w]; the Qwen window (all tokens real), CLIP's pooled vector
        (w, h), z = size, lambda *s: torch.zeros(*s, dtype=torch.bfloat16)  # noqa: E731
        return (z(1, config["in_visual_dim"], 1 + (frames - 1) // 4, h // 8, w // 8),
                {"prompt_embeds_qwen": z(1, text_len, config["in_text_dim"]),
                 "attention_mask": torch.ones(1, text_len, dtype=torch.int64),
                 "prompt_embeds_clip": z(1, config["in_text_dim2"])})

    @staticmethod
    def activation_geometry(config: dict, size: tuple[int, int], text_tokens: int, frames: int = 1) -> tuple[int, int, int]:
        """1x2x2 patches of (1 + (F - 1) / 4) latent frames /8 in space, and the caption (the text blocks' sequence,
        the visual blocks' cross-attention keys), counted as one sequence in every block (an overestimate)."""
        w, h = size
        t, ph, pw = config["patch_size"]
        tokens = ((1 + (frames - 1) // 4) // t) * (h // (8 * ph)) * (w // (8 * pw)) + text_tokens
        return tokens, config["model_dim"], config["num_text_blocks"] + config["num_visual_blocks"]

    # -- latents ---------------------------------------------------------------------------------
    def load_vae(self):
        return diffusers.AutoencoderKLHunyuanVideo.from_pretrained(self.model_dir, subfolder="vae", dtype=self.dtype,
                                                                   **_SAFE).to(self.device).eval()

    @no_grad
    def encode_latents(self, vae, pixels):
        # pixels [B, 3, F, H, W] (an image: [B, 3, H, W], one frame) -> mode x scaling_factor: [B, C, F', H/8, W/8]
        if pixels.ndim == 4:
            pixels = pixels[:, :, None]
        z = vae.encode(pixels.to(vae.device, vae.dtype, non_blocking=True)).latent_dist.mode()
        return z * vae.config.scaling_factor

    # -- text ------------------------------------------------------------------------------------
    def load_text_encoders(self):
        # both encoders streamed, stored as text.quantize says and placed (pretrained_text_encoder)
        pipe = self.text_pipeline_cls.from_pretrained(self.model_dir, dtype=self.dtype, transformer=None, vae=None,
                                                      **self.text_encoder_parts(), **_SAFE)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    @no_grad
    def encode_text(self, pipe, texts):
        n, out = self.max_sequence_length, []
        for text in texts:  # one caption a call: the pipeline's own numbers for it (module docstring)
            qwen, clip, cu = pipe.encode_prompt([text], max_sequence_length=n, device=self.device, dtype=self.dtype)
            length = int(cu[-1])
            if length == n and text not in _WARNED:  # a full window: the caption may be cut
                _WARNED.add(text)
                log.warning("text may be truncated at model.max_sequence_length=%d Qwen2.5-VL tokens: %.80r", n, text)
            window = qwen.new_zeros(n, qwen.shape[-1])
            window[:length] = qwen[0]
            mask = torch.zeros(n, dtype=torch.int64)
            mask[:length] = 1
            out.append({"prompt_embeds_qwen": window.cpu(), "attention_mask": mask, "prompt_embeds_clip": clip[0].cpu()})
        return out

    # -- training --------------------------------------------------------------------------------
    def load_denoiser(self):
        return self.pretrained_denoiser(self.denoiser_cls, "transformer")

    def training_loss(self, transformer, latents, text, train_cfg, scheduler, generators):
        if latents.ndim == 4:  # [B, C, h, w]: a one-frame video
            latents = latents[:, :, None]
        noisy, noise, timesteps, sigmas = noise_latents(latents, train_cfg, scheduler, generators)
        x = self.visual_input(transformer, noisy.permute(0, 2, 3, 4, 1), text)
        pred = self.predict(transformer, x, text, timesteps.to(latents.dtype))
        return weighted_loss(pred.permute(0, 4, 1, 2, 3), noise - latents, sigmas, train_cfg)  # velocity target

    def visual_input(self, transformer, x, text):
        """Channels-last noisy latents [B, F, h, w, C] -> what __call__ feeds: with `visual_cond`, zero condition
        latents and a zero mask channel after them (prepare_latents; image-to-video: the first frame's)."""
        if not transformer.config.visual_cond:
            return x
        return torch.cat([x, torch.zeros_like(x), x.new_zeros(*x.shape[:-1], 1)], dim=-1)

    def predict(self, transformer, x, text, timesteps):
        """The transformer's velocity [B, F, h, w, C] for channels-last inputs, with the rope positions, scale
        factor and sparse parameters __call__ computes; each caption cut to its tokens."""
        _, f, h, w, _ = x.shape
        pipe_cls = diffusers.Kandinsky5T2VPipeline
        scale = pipe_cls._get_scale_factor(None, h * 8, w * 8)  # of the pixel size (vae_scale_factor_spatial 8)
        sparse = pipe_cls.get_sparse_params(SimpleNamespace(transformer=transformer, fast_sta_nabla=pipe_cls.fast_sta_nabla),
                                            x, x.device)
        p = transformer.config.patch_size
        rope = [torch.arange(f, device=x.device), torch.arange(h // p[1], device=x.device),
                torch.arange(w // p[2], device=x.device)]
        embeds = text["prompt_embeds_qwen"].to(x.device, x.dtype)
        pooled = text["prompt_embeds_clip"].to(x.device, x.dtype)
        lengths = caption_lengths(text["attention_mask"])
        groups = [range(len(lengths))] if len(set(lengths)) == 1 else [range(i, i + 1) for i in range(len(lengths))]
        # return_dict=False: the tensor itself (Kandinsky5Transformer3DModel.forward returns no tuple)
        out = [transformer(hidden_states=x[g.start:g.stop], encoder_hidden_states=embeds[g.start:g.stop, :lengths[g.start]],
                           pooled_projections=pooled[g.start:g.stop], timestep=timesteps[g.start:g.stop],
                           visual_rope_pos=rope, text_rope_pos=torch.arange(lengths[g.start], device=x.device),
                           scale_factor=scale, sparse_params=sparse, return_dict=False) for g in groups]
        return out[0] if len(out) == 1 else torch.cat(out)

    # -- sampling --------------------------------------------------------------------------------
    def cached_embeds(self, pipe, d: dict, prefix: str = "") -> dict:
        """The pipeline's prompt kwargs from one cached text: the caption's tokens, CLIP's vector, cu_seqlens."""
        d = on_pipeline_device(pipe, d)
        n = int(d["attention_mask"].sum())
        return {f"{prefix}prompt_embeds_qwen": d["prompt_embeds_qwen"][None, :n].to(self.dtype),
                f"{prefix}prompt_embeds_clip": d["prompt_embeds_clip"][None].to(self.dtype),
                f"{prefix}prompt_cu_seqlens": torch.tensor([0, n], dtype=torch.int32, device=d["attention_mask"].device)}

    def guided(self, pipe, prompt, negative, empty, guidance) -> dict:
        kw = self.cached_embeds(pipe, prompt)
        if guidance > 1.0:  # the pipeline's CFG condition; the unconditional input as the module docstring says
            kw.update(self.cached_embeds(pipe, negative if negative is not None else empty, "negative_"))
        return kw

    @no_grad
    def sample(self, pipe, prompt, negative, empty, width, height, steps, guidance, true_cfg, seed,
               generator_device="cpu", frames=1, fps=24.0):
        # Real CFG at `guidance` (> 1); `true_cfg` is unused. Frames 1 + 4k, sides multiples of 16.
        generator = self.make_generator(pipe, seed, generator_device)
        out = pipe(**self.guided(pipe, prompt, negative, empty, guidance), height=height, width=width,
                   num_frames=frames, num_inference_steps=steps, guidance_scale=guidance,
                   max_sequence_length=self.max_sequence_length, generator=generator, output_type="np").frames[0]
        return self.frames_video(out, fps)

    @staticmethod
    def frames_video(frames, fps: float) -> Video:
        return Video([Image.fromarray(f) for f in (np.clip(frames, 0, 1) * 255).round().astype(np.uint8)], float(fps))


def caption_lengths(mask) -> list[int]:
    """Each cached caption's token count; a fake mask (bench.memory's FakeTensorMode: shapes, no values; its
    bench_batch's mask is all ones) counts the whole window."""
    from torch._subclasses.fake_tensor import is_fake

    if is_fake(mask):
        return [mask.shape[1]] * mask.shape[0]
    return [int(n) for n in mask.sum(dim=1)]
