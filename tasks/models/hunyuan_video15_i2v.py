"""HunyuanVideo 1.5 image-to-video: a clip trains with its first frame as the condition, fed to the transformer
exactly as diffusers' HunyuanVideo15ImageToVideoPipeline feeds it while sampling (diffusers 0.42.1,
pipelines/hunyuan_video1_5/pipeline_hunyuan_video1_5_image2video.py). Everything else (latents, text, LoRA targets,
files) is the text-to-video adapter's (tasks/models/hunyuan_video15.py), which this one extends.

- The condition (`prepare_cond_latents_and_mask`, `_get_image_latents`): the first frame encoded alone by the VAE
  (its mode x scaling_factor, a one-frame video), repeated over the clip's latent frames and zeroed after the first,
  then a one-channel mask, 1 on the first latent frame and 0 after: [C + 1, F', h, w], concatenated after the noisy
  latents on the channels (`torch.cat([latents, cond_latents_concat, mask_concat], dim=1)`: 2C + 1 = 65 in).
- The image tokens (`encode_image` / `_get_image_embeds`): the first frame through the pipeline's SigLIP
  `feature_extractor.preprocess(images=..., do_resize=True, do_convert_rgb=True)` and the `image_encoder`'s
  last_hidden_state (729 x 1152 for the released so400m-patch14-384), passed as `image_embeds` (non-zero: the
  transformer attends to them; the text-to-video zeros are masked out).
- Noise: the pipeline starts every latent frame, the first included, from noise and steps them all with the
  scheduler (the condition stays clean beside them), so training noises the whole clip at one sigma and trains the
  velocity noise - latents on every frame, with the condition and image tokens clean; timestep = the scheduler's t.
  musubi-tuner trains it the same way (kohya-ss/musubi-tuner 30c658c, src/musubi_tuner/hv_1_5_cache_latents.py
  lines 50-84: the first frame's latent zero-padded to the clip's latent frames plus a one-channel mask, and the
  first frame's SigLIP last_hidden_state; hv_1_5_train_network.py lines 386-459: `torch.cat([noisy_model_input,
  cond_latents], dim=1)`, `vision_states`, target noise - latents). One difference: musubi caches the condition
  latent unscaled (its cache line 62 leaves out scaling_factor) while its own sampler (hv_1_5_train_network.py line
  238) and diffusers scale it; this adapter follows diffusers, as trained and sampled alike.

The condition is cached per clip by cache_latents (tasks/data/first_frame.py) as a control entry: "latents"
[C + 1, F', h, w] and "image_embeds" [tokens, width]; training reads text["control_latents"] and
text["control_image_embeds"] ([B, 1, ...]).

Sampling: the pipeline's __call__ takes no height/width; it sizes the clip as the bucket of
`transformer.config.target_size` (640 for 480p) nearest the image's aspect ratio
(HunyuanVideo15ImageProcessor.calculate_default_height_width). loraflow renders at the prompt's --w/--h as it
trains (data.resolution), so `sample` answers the pipeline's size question with that size for its call; the --i
image, already fitted to it, is resized by the pipeline to the same size (a no-op).

Untested with the real weights here."""
from __future__ import annotations

import importlib
import json

from tasks.lazy import LazyClass, lazy, no_grad
from tasks.models.bases.adapter import BLOCK, Controls, KohyaLayout
from tasks.models.flux import KOHYA_RULES as FLUX1_RULES
from tasks.models.hunyuan_video15 import MUSUBI_RULES, VISION_TOKENS, HunyuanVideo15Adapter

torch = lazy("torch")


class HunyuanVideo15I2VAdapter(HunyuanVideo15Adapter):
    family = "hunyuan_video15_i2v"
    # musubi-tuner trains I2V with the same network module (networks.lora_hv_1_5, --task i2v); the base version
    # names the image-to-video model
    kohya = KohyaLayout("networks.lora_hv_1_5", "hunyuan_video_1_5_i2v", rules=MUSUBI_RULES,
                        comfyui_rules=tuple(r for r in FLUX1_RULES if r[0].startswith(BLOCK)), lycoris_names="comfyui")
    controls = Controls(most=1, required=True, first_frame=True)
    image_tokens = VISION_TOKENS  # the first frame's SigLIP states, attended to (HunyuanVideo15ImageToVideoPipeline)
    pipeline_cls = LazyClass("diffusers", "HunyuanVideo15ImageToVideoPipeline")
    # the first frame's SigLIP states are cached with the condition, and the sampler encodes its --i image with them
    latent_components = ("vae", "image_encoder", "feature_extractor")
    sample_components = ("transformer", "vae", "scheduler", "guider", "image_encoder", "feature_extractor")

    # -- the condition ---------------------------------------------------------------------------
    def _component(self, name: str, **kw):
        """A pipeline component as from_pretrained loads it: the library and class model_index.json names."""
        library, cls = json.loads((self.model_dir / "model_index.json").read_text())[name]
        return getattr(importlib.import_module(library), cls).from_pretrained(self.model_dir, subfolder=name, **kw)

    def load_condition_encoder(self):
        """The pipeline's SigLIP feature extractor and image encoder."""
        encoder = self._component("image_encoder", dtype=self.dtype, use_safetensors=True)
        return self._component("feature_extractor"), encoder.to(self.device).eval()

    @no_grad
    def encode_condition(self, vae, encoder, pixels, images, frames: int) -> list[dict]:
        """pixels [B, 3, H, W] in [-1, 1] (each clip's first frame as it trains; `images`: the same as PIL images)
        -> per clip {"latents": [C + 1, F', h, w], "image_embeds": [tokens, width]}."""
        z = self.encode_latents(vae, pixels)  # [B, C, 1, h, w]: the first frame alone, scaled
        latent_frames = (frames - 1) // 4 + 1  # prepare_latents: (num_frames - 1) // vae_scale_factor_temporal + 1
        cond = torch.cat([z, z.new_zeros(*z.shape[:2], latent_frames - 1, *z.shape[3:])], dim=2)
        mask = torch.zeros_like(cond[:, :1])
        mask[:, :, 0] = 1.0
        processor, model = encoder
        inputs = processor.preprocess(images=list(images), do_resize=True, return_tensors="pt", do_convert_rgb=True)
        states = model(**inputs.to(device=model.device, dtype=model.dtype)).last_hidden_state
        return [{"latents": y, "image_embeds": e} for y, e in zip(torch.cat([cond, mask], dim=1), states)]

    # -- training --------------------------------------------------------------------------------
    def condition(self, transformer, noisy, text):
        """The cached condition (latent + mask channels) and the first frame's SigLIP states."""
        return (text["control_latents"][:, 0].to(noisy.device, noisy.dtype),
                text["control_image_embeds"][:, 0].to(noisy.device, noisy.dtype))

    # -- sampling --------------------------------------------------------------------------------
    @no_grad
    def sample(self, pipe, prompt, negative, empty, width, height, steps, guidance, true_cfg, seed,
               generator_device="cpu", frames=1, fps=15.0, controls=()):
        # As text-to-video (real CFG through the guider, the cached empty prompt as the negative), from
        # `controls[0]`: the --i image fitted to (width, height); rendered at that size (module docstring)
        embeds = self.guided_embeds(pipe, prompt, negative if negative is not None else empty, guidance)
        generator = self.make_generator(pipe, seed, generator_device)
        sizes = pipe.video_processor
        sizes.calculate_default_height_width = lambda **_: (height, width)
        try:
            out = pipe(image=controls[0], **embeds, num_frames=frames, num_inference_steps=steps,
                       generator=generator, output_type="np").frames[0]
        finally:
            del sizes.calculate_default_height_width  # the class's own again
        return self.frames_video(out, fps)
