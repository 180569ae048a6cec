"""FLUX.2, what [klein] and [dev] share: the FLUX.2 MMDiT (double- then single-stream blocks, 4-axis RoPE) on
its own VAE's latents (AutoencoderKLFlux2, /8, patchified 2x2 and normalised by the VAE's batch-norm
statistics), text as the pipeline's encode_prompt gives it (hidden states of three layers of a language model,
stacked), flow matching. The variants (tasks/models/flux2_klein.py, flux2_dev.py) differ in the pipeline (so the
text encoder and its layers), the guidance (real CFG for [klein], an embedded guidance scale for [dev]) and
how sampling uses a negative prompt."""
from __future__ import annotations

from tasks.lazy import LazyClass, lazy, no_grad
from tasks.models.bases.adapter import BLOCK as _B, SINGLE as _S, Controls
from tasks.models.bases.flow_matching import TransformerAdapter, noise_latents, weighted_loss

torch = lazy("torch")
diffusers = lazy("diffusers")

SAFE = dict(use_safetensors=True)
TEXT_PARTS = dict(transformer=None, vae=None, **SAFE)
SAMPLE_PARTS = dict(text_encoder=None, tokenizer=None, **SAFE)


# The kohya file's names: BFL's FLUX.2 (networks.lora_flux2), as diffusers' _convert_kohya_flux2_lora_to_diffusers
# reads them (Flux2KleinPipeline and Flux2Pipeline)
KOHYA_RULES = (
    (_B + r"attn\.to_([qkv])", "double_blocks_{}_img_attn_qkv", 3),
    (_B + r"attn\.add_([qkv])_proj", "double_blocks_{}_txt_attn_qkv", 3),
    (_B + r"attn\.to_out\.0", "double_blocks_{}_img_attn_proj", 1),
    (_B + r"attn\.to_add_out", "double_blocks_{}_txt_attn_proj", 1),
    (_B + r"ff\.linear_in", "double_blocks_{}_img_mlp_0", 1),
    (_B + r"ff\.linear_out", "double_blocks_{}_img_mlp_2", 1),
    (_B + r"ff_context\.linear_in", "double_blocks_{}_txt_mlp_0", 1),
    (_B + r"ff_context\.linear_out", "double_blocks_{}_txt_mlp_2", 1),
    (_S + r"attn\.to_qkv_mlp_proj", "single_blocks_{}_linear1", 1),  # already one fused Linear in diffusers
    (_S + r"attn\.to_out", "single_blocks_{}_linear2", 1),
)


class Flux2Adapter(TransformerAdapter):
    original_layout = "flux2"  # loraflow-lora merge --into-base --layout original
    swap_blocks = ("transformer_blocks", "single_transformer_blocks")  # train.blocks_to_swap, in run order
    pipeline_cls: type  # Flux2KleinPipeline or Flux2Pipeline: the same static latent/id helpers
    # Reference images (data.control_dirs, --i): the pipelines take a list; 4 here (BFL's guides give up to 10
    # for [dev] at high memory cost; the issue asks for several)
    controls = Controls(most=4, min_side=64)  # Flux2ImageProcessor.check_image_input refuses smaller references
    denoiser_cls = LazyClass("diffusers", "Flux2Transformer2DModel")
    denoiser_subfolder = "transformer"
    sample_parts = SAMPLE_PARTS

    # -- latents ---------------------------------------------------------------------------------
    def load_vae(self):
        return diffusers.AutoencoderKLFlux2.from_pretrained(self.model_dir, subfolder="vae", dtype=self.dtype, **SAFE).to(self.device).eval()

    @no_grad
    def encode_latents(self, vae, pixels):
        # The pipeline's _encode_vae_image: the mode, 2x2 patches into channels, the batch-norm statistics
        # removed (the pipeline puts them back before decoding). Stored [B, 4C, H/16, W/16].
        z = self.pipeline_cls._patchify_latents(
            vae.encode(pixels.to(vae.device, vae.dtype, non_blocking=True)).latent_dist.mode())
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(z.device, z.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(z.device, z.dtype)
        return (z - mean) / std

    # -- text ------------------------------------------------------------------------------------
    def load_text_encoders(self):
        # the text encoder streamed, stored as text.quantize says and placed (pretrained_text_encoder)
        return self.pipeline_cls.from_pretrained(self.model_dir, dtype=self.dtype, **self.text_encoder_parts(),
                                                 **TEXT_PARTS).to(self.device)

    @no_grad
    def encode_text(self, pipe, texts):
        # The pipeline's own encode_prompt: every caption padded to max_sequence_length (the transformer
        # takes no mask; the padding's states are part of the input, as in the pipeline).
        embeds, _ = pipe.encode_prompt(texts, device=self.device, max_sequence_length=self.max_sequence_length)
        embeds = embeds.cpu()
        return [{"prompt_embeds": embeds[i]} for i in range(len(texts))]

    # -- training --------------------------------------------------------------------------------
    def load_denoiser(self):
        return self.pretrained_denoiser(diffusers.Flux2Transformer2DModel, "transformer")

    # Every projection of the blocks (attention of both streams, the MLPs, the single blocks' fused
    # qkv+mlp input and output): the Linears FLUX.2 LoRAs in kohya/BFL layout name. Not the modulation,
    # embedders or the final layer.
    LORA_TARGETS = (r"transformer_blocks\.\d+\.(attn\.(to_[qkv]|to_out\.0|add_[qkv]_proj|to_add_out)"
                    r"|ff(_context)?\.linear_(in|out))"
                    r"|single_transformer_blocks\.\d+\.attn\.(to_qkv_mlp_proj|to_out)")

    def training_loss(self, transformer, latents, text, train_cfg, scheduler, generators):
        b, c, h, w = latents.shape
        P = self.pipeline_cls
        noisy, noise, timesteps, sigmas = noise_latents(latents, train_cfg, scheduler, generators)
        embeds = text["prompt_embeds"].to(latents.dtype)
        packed = P._pack_latents(noisy)  # [B, h*w, C]
        img_ids = P._prepare_latent_ids(noisy).to(latents.device)
        n_target = packed.shape[1]
        packed, img_ids = self.with_references(packed, img_ids, text.get("control_latents"), latents.dtype)
        txt_ids = P._prepare_text_ids(embeds).to(latents.device)
        guidance = None  # [dev]'s guidance embedding gets train.guidance, as diffusers' example its --guidance_scale
        if transformer.config.guidance_embeds:
            guidance = torch.full((b,), float(train_cfg.guidance), dtype=torch.float32, device=latents.device)
        pred = transformer(hidden_states=packed, encoder_hidden_states=embeds, timestep=timesteps.to(latents.dtype) / 1000,
                           img_ids=img_ids, txt_ids=txt_ids, guidance=guidance, return_dict=False)[0]
        pred = pred[:, :n_target].permute(0, 2, 1).reshape(b, c, h, w)
        return weighted_loss(pred, noise - latents, sigmas, train_cfg)  # velocity target

    # -- sampling --------------------------------------------------------------------------------
    def with_references(self, packed, img_ids, control, dtype):
        """Reference images (data.control_dirs; [B, K, C, h, w] latents, encoded like targets): each packed and
        appended after the target's tokens, with position ids whose time axis is 10 + 10 k, as
        Flux2Pipeline.prepare_image_latents / _prepare_image_ids lay out the images it is given."""
        if control is None:
            return packed, img_ids
        P, b = self.pipeline_cls, packed.shape[0]
        refs = [control[:, k].to(dtype) for k in range(control.shape[1])]
        ids = P._prepare_image_ids([r[:1] for r in refs]).to(img_ids.device, img_ids.dtype).repeat(b, 1, 1)
        return torch.cat([packed, *(P._pack_latents(r) for r in refs)], dim=1), torch.cat([img_ids, ids], dim=1)

    @no_grad
    def render(self, pipe, prompt, width, height, steps, guidance, seed, generator_device, controls=(), **kwargs):
        """The pipeline from the cached prompt embeddings (it makes the text ids); kwargs: the variant's own;
        `controls`: reference images (--i), fitted to the sample's size as their pairs trained."""
        if controls:
            kwargs["image"] = list(controls)
        generator = self.make_generator(pipe, seed, generator_device)
        return pipe(prompt_embeds=prompt["prompt_embeds"][None].to(self.dtype), guidance_scale=guidance,
                    width=width, height=height, num_inference_steps=steps,
                    max_sequence_length=self.max_sequence_length, generator=generator, output_type="pil",
                    **kwargs).images[0]

    @staticmethod
    def bench_batch(config, size, frames, text_len):
        # bench.memory's full-size inputs: the VAE's 32 channels patchified 2x2 (128 at /16); the stacked text states
        w, h = size
        return torch.zeros(1, config["in_channels"], h // 16, w // 16, dtype=torch.bfloat16), {
            "prompt_embeds": torch.zeros(1, text_len, config["joint_attention_dim"], dtype=torch.bfloat16)}
