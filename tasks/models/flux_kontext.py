"""FLUX.1 Kontext: Flux's transformer, trained on (control, target) pairs. The control image's latent, packed like
the noisy target's, joins the sequence after it with position ids whose first axis is 1 (the target's are 0),
and the prediction is cut back to the target's tokens: diffusers' examples/dreambooth/
train_dreambooth_lora_flux_kontext.py (cond_model_input, cond_latents_ids[..., 0] = 1, model_pred[:, :orig]),
as FluxKontextPipeline.prepare_latents lays out the image latents it samples with. Without a control image an
item trains as plain Flux (the example's text-to-image mode)."""
from __future__ import annotations

from tasks.lazy import LazyClass, lazy, no_grad
from tasks.models.bases.adapter import Controls
from tasks.models.bases.flow_matching import noise_latents, weighted_loss
from tasks.models.flux import FluxAdapter

torch = lazy("torch")
diffusers = lazy("diffusers")


class FluxKontextAdapter(FluxAdapter):
    family = "flux_kontext"
    # FLUX.1's transformer: FLUX.1's names and version (its kohya file loads where FLUX.1's does)
    pipeline_cls = LazyClass("diffusers", "FluxKontextPipeline")
    controls = Controls(most=1)  # Kontext conditions on one image

    @classmethod
    def reference_controls(cls, control, size):
        return dict(image=control, _auto_resize=False, max_area=size * size)  # else it rescales to ~1 MP

    def training_loss(self, transformer, latents, text, train_cfg, scheduler, generators):
        control = text.get("control_latents")
        if control is None:
            return super().training_loss(transformer, latents, text, train_cfg, scheduler, generators)
        P = diffusers.FluxKontextPipeline
        b, c, h, w = latents.shape
        noisy, noise, timesteps, sigmas = noise_latents(latents, train_cfg, scheduler, generators)
        packed = P._pack_latents(noisy, b, c, h, w)
        cond = control[:, 0].to(latents.dtype)
        ch, cw = cond.shape[-2:]
        packed_cond = P._pack_latents(cond, b, c, ch, cw)
        img_ids = P._prepare_latent_image_ids(b, h // 2, w // 2, latents.device, latents.dtype)
        cond_ids = P._prepare_latent_image_ids(b, ch // 2, cw // 2, latents.device, latents.dtype)
        cond_ids[..., 0] = 1
        embeds = text["prompt_embeds"].to(latents.dtype)
        txt_ids = torch.zeros(embeds.shape[1], 3, dtype=latents.dtype, device=latents.device)
        guidance = None
        if transformer.config.guidance_embeds:
            guidance = torch.full((b,), float(train_cfg.guidance), dtype=latents.dtype, device=latents.device)
        pred = transformer(hidden_states=torch.cat([packed, packed_cond], dim=1), timestep=timesteps / 1000,
                           guidance=guidance, pooled_projections=text["pooled_prompt_embeds"].to(latents.dtype),
                           encoder_hidden_states=embeds, txt_ids=txt_ids, img_ids=torch.cat([img_ids, cond_ids]),
                           return_dict=False)[0][:, : packed.shape[1]]
        vae_scale = self.size_multiple // 2
        pred = P._unpack_latents(pred, height=h * vae_scale, width=w * vae_scale, vae_scale_factor=vae_scale)
        return weighted_loss(pred, noise - latents, sigmas, train_cfg)  # velocity target

    @no_grad
    def sample(self, pipe, prompt, negative, empty, width, height, steps, guidance, true_cfg, seed,
               generator_device="cpu", controls=()):
        # The control image comes fitted to (width, height), as its pairs trained; _auto_resize off, else the
        # pipeline would scale it to one of Kontext's ~1 MP training resolutions (and max_area likewise)
        kwargs = {}
        if negative is not None:
            kwargs = dict(negative_prompt_embeds=negative["prompt_embeds"][None].to(self.dtype),
                          negative_pooled_prompt_embeds=negative["pooled_prompt_embeds"][None].to(self.dtype),
                          true_cfg_scale=true_cfg)
        if controls:
            kwargs.update(image=controls[0], _auto_resize=False)
        kwargs["max_area"] = width * height  # else the pipeline rescales (width, height) to 1 MP
        generator = self.make_generator(pipe, seed, generator_device)
        return pipe(prompt_embeds=prompt["prompt_embeds"][None].to(self.dtype),
                    pooled_prompt_embeds=prompt["pooled_prompt_embeds"][None].to(self.dtype),
                    width=width, height=height, num_inference_steps=steps, guidance_scale=guidance,
                    max_sequence_length=self.max_sequence_length, generator=generator, output_type="pil",
                    **kwargs).images[0]
