"""Kandinsky 5.0 I2V (image-to-video; Pro 19B), trained as diffusers' Kandinsky5I2VPipeline samples it
(pipelines/kandinsky5/pipeline_kandinsky_i2v.py, diffusers 0.42.1): `prepare_latents` puts the clean latent of the
given image in the first latent frame of the noisy input itself, leaves the condition channels zero and sets the mask
channel to 1 on that frame; the denoising loop steps only frames 1: (its prediction for frame 0 is thrown away) and
`normalize_first_frame` then matches the first frames' statistics to the later ones. So training replaces the first
noisy latent frame by the clean condition, feeds the zero condition and that mask, and takes the loss on the frames
after it (all frames of a one-frame item, which has no later frame). Everything else is the text-to-video adapter's
(tasks/models/kandinsky5.py): the text encoders and prompt template are the same.

Differences noted, not copied: the pipeline encodes the image with `latent_dist.sample(generator)`, the cache with
the mode (a pure function of the frame); musubi-tuner's kandinsky5_train_network.py (call_dit, lines 796-840 at
kohya-ss/musubi-tuner 30c658c) instead keeps frame 0 noisy, puts the first frame's latent in the condition channels
and trains every frame: what the original Kandinsky code does, not what the diffusers pipeline samples.

The condition is cached per clip by cache_latents (tasks/data/first_frame.py) as a control entry: "latents"
[C, 1, h, w]; training reads text["control_latents"] ([B, 1, C, 1, h, w]).

Untested with the real weights here."""
from __future__ import annotations

from tasks.lazy import LazyClass, lazy, no_grad
from tasks.models.bases.adapter import Controls, KohyaLayout
from tasks.models.bases.flow_matching import noise_latents, weighted_loss
from tasks.models.bases.real_size import RealSize
from tasks.models.kandinsky5 import PRO, TEXT_ENCODERS, VAE, Kandinsky5Adapter

torch = lazy("torch")


class Kandinsky5I2VAdapter(Kandinsky5Adapter):
    family = "kandinsky5_i2v"
    # musubi-tuner trains I2V with the same network module (networks.lora_kandinsky, --task k5-pro-i2v-*); the base
    # version names the image-to-video model
    kohya = KohyaLayout("networks.lora_kandinsky", "kandinsky5_i2v", names="named", lycoris_names="comfyui")
    controls = Controls(most=1, required=True, first_frame=True)
    pipeline_cls = LazyClass("diffusers", "Kandinsky5I2VPipeline")
    text_pipeline_cls = LazyClass("diffusers", "Kandinsky5I2VPipeline")  # the same encode_prompt and template
    # bench.memory: Pro at 512x512 (the sd task's resolution), 33 frames
    real_sizes = (RealSize("kandinsky5_i2v_pro", "Kandinsky5Transformer3DModel", arch=PRO, size=(512, 512), frames=33,
                           text=TEXT_ENCODERS, vae=VAE, rows=("nf4+ckpt", "nf4+ckpt+swap30"),
                           card=(24, 64)),)

    @staticmethod
    def bench_batch(config, size, frames, text_len):
        latents, text = Kandinsky5Adapter.bench_batch(config, size, frames, text_len)
        c, h, w = latents.shape[1], latents.shape[3], latents.shape[4]
        return latents, {**text, "control_latents": torch.zeros(1, 1, c, 1, h, w, dtype=torch.bfloat16)}

    # -- the condition ---------------------------------------------------------------------------
    def load_condition_encoder(self):
        return None  # the VAE alone encodes the first frame

    @no_grad
    def encode_condition(self, vae, encoder, pixels, images, frames: int) -> list[dict]:
        """The first frame encoded alone as a one-frame video (prepare_latents' image_video): [C, 1, h, w] per clip."""
        return [{"latents": z} for z in self.encode_latents(vae, pixels[:, :, None])]

    # -- training --------------------------------------------------------------------------------
    def visual_input(self, transformer, x, text):
        """Channels-last noisy latents [B, F, h, w, C]: frame 0 the clean condition, zero condition channels, the
        mask 1 on frame 0 (prepare_latents)."""
        cond = text["control_latents"][:, 0].to(x.device, x.dtype).permute(0, 2, 3, 4, 1)  # [B, 1, h, w, C]
        x = torch.cat([cond, x[:, 1:]], dim=1)
        mask = x.new_zeros(*x.shape[:-1], 1)
        mask[:, 0] = 1.0
        return torch.cat([x, torch.zeros_like(x), mask], dim=-1)

    def training_loss(self, transformer, latents, text, train_cfg, scheduler, generators):
        if latents.ndim == 4:
            latents = latents[:, :, None]
        noisy, noise, timesteps, sigmas = noise_latents(latents, train_cfg, scheduler, generators)
        x = self.visual_input(transformer, noisy.permute(0, 2, 3, 4, 1), text)
        pred = self.predict(transformer, x, text, timesteps.to(latents.dtype)).permute(0, 4, 1, 2, 3)
        first = 1 if latents.shape[2] > 1 else 0  # the frames the pipeline steps
        return weighted_loss(pred[:, :, first:], (noise - latents)[:, :, first:], sigmas, train_cfg)

    # -- sampling --------------------------------------------------------------------------------
    def load_sampler(self, lora_file, denoiser=None):
        return finite_first_frames(super().load_sampler(lora_file, denoiser))

    @classmethod
    def reference_pipeline(cls, base, text_tokens):
        return finite_first_frames(super().reference_pipeline(base, text_tokens))

    @no_grad
    def sample(self, pipe, prompt, negative, empty, width, height, steps, guidance, true_cfg, seed,
               generator_device="cpu", frames=1, fps=24.0, controls=()):
        # As text-to-video, from `controls[0]`: the --i image fitted to (width, height), which the pipeline encodes
        generator = self.make_generator(pipe, seed, generator_device)
        out = pipe(image=controls[0], **self.guided(pipe, prompt, negative, empty, guidance), height=height,
                   width=width, num_frames=frames, num_inference_steps=steps, guidance_scale=guidance,
                   max_sequence_length=self.max_sequence_length, generator=generator, output_type="np").frames[0]
        return self.frames_video(out, fps)


def finite_first_frames(pipe):
    """The pipeline with normalize_first_frame skipped below 5 latent frames (17 frames), where the pipeline's own
    matches its first 4 frames to an empty reference: the mean and std of nothing, NaN in every frame it touches.
    From 5 latent frames on, the pipeline's own method."""
    own = pipe.normalize_first_frame

    def normalize_first_frame(latents, *args, **kwargs):
        return latents if latents.shape[1] < 5 else own(latents, *args, **kwargs)

    pipe.normalize_first_frame = normalize_first_frame
    return pipe
