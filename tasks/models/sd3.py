"""SD3: two CLIP-G/L towers (pooled + penultimate states) and T5, MMDiT on 2x2 latent patches (VAE /8),
flow matching. Training follows diffusers' examples/dreambooth/train_dreambooth_lora_sd3.py."""
from __future__ import annotations

from tasks.lazy import LazyClass, lazy, no_grad
from tasks.models.bases.adapter import BLOCK as _B, KohyaLayout
from tasks.models.bases.flow_matching import TransformerAdapter, noise_latents, weighted_loss

torch = lazy("torch")
diffusers = lazy("diffusers")

# use_safetensors=True: never fall back to pickled .bin weights.
_SAFE = dict(use_safetensors=True)
_TEXT_PARTS = dict(transformer=None, vae=None, **_SAFE)
_SAMPLE_PARTS = dict(text_encoder=None, text_encoder_2=None, text_encoder_3=None,
                     tokenizer=None, tokenizer_2=None, tokenizer_3=None, **_SAFE)


# The kohya file's names: SAI's MMDiT (networks.lora_sd3's layout; sd-scripts and ComfyUI load it)
KOHYA_RULES = (
    (_B + r"attn\.to_([qkv])", "joint_blocks_{}_x_block_attn_qkv", 3),
    (_B + r"attn\.add_([qkv])_proj", "joint_blocks_{}_context_block_attn_qkv", 3),
    (_B + r"attn\.to_out\.0", "joint_blocks_{}_x_block_attn_proj", 1),
    (_B + r"attn\.to_add_out", "joint_blocks_{}_context_block_attn_proj", 1),
    (_B + r"attn2\.to_([qkv])", "joint_blocks_{}_x_block_attn2_qkv", 3),  # SD3.5 (MMDiT-X) dual attention
    (_B + r"attn2\.to_out\.0", "joint_blocks_{}_x_block_attn2_proj", 1),
    (_B + r"ff\.net\.0\.proj", "joint_blocks_{}_x_block_mlp_fc1", 1),
    (_B + r"ff\.net\.2", "joint_blocks_{}_x_block_mlp_fc2", 1),
    (_B + r"ff_context\.net\.0\.proj", "joint_blocks_{}_context_block_mlp_fc1", 1),
    (_B + r"ff_context\.net\.2", "joint_blocks_{}_context_block_mlp_fc2", 1),
)


class SD3Adapter(TransformerAdapter):
    swap_blocks = ("transformer_blocks",)  # train.blocks_to_swap
    family = "sd3"
    original_layout = "sd3"  # loraflow-lora merge --into-base --layout original
    # SD3.5 Large has 38 blocks, SD3.5 Medium a second attention (attn2) in some: every block gets one here
    widest_arch = dict(num_layers=38, dual_attention_layers=tuple(range(38)))
    kohya = KohyaLayout("networks.lora_sd3", "sd3", rules=KOHYA_RULES)
    pipeline_cls = LazyClass("diffusers", "StableDiffusion3Pipeline")
    reference_kohya = "merge"  # diffusers' SD3 pipeline reads no kohya layout
    denoiser_cls = LazyClass("diffusers", "SD3Transformer2DModel")
    denoiser_subfolder = "transformer"
    sample_parts = _SAMPLE_PARTS
    text_components = ("tokenizer", "tokenizer_2", "tokenizer_3", "text_encoder", "text_encoder_2", "text_encoder_3")

    # The SD3 LoRA example's --precondition_outputs (default 1): the loss compares x0 estimates
    # (x_t - sigma * v against x0) rather than velocities; that is the velocity loss weighted by sigma^2.
    precondition_outputs = True

    # -- latents ---------------------------------------------------------------------------------
    def load_vae(self):
        # On the device (CUDA when there is one); the caller stores what it returns on the CPU.
        return diffusers.AutoencoderKL.from_pretrained(self.model_dir, subfolder="vae", dtype=self.dtype, **_SAFE).to(self.device).eval()

    @no_grad
    def encode_latents(self, vae, pixels):
        # The mode, not a sample: the cached latent is then a pure function of the image.
        z = vae.encode(pixels.to(vae.device, vae.dtype, non_blocking=True)).latent_dist.mode()
        return (z - vae.config.shift_factor) * vae.config.scaling_factor

    # -- text ------------------------------------------------------------------------------------
    def load_text_encoders(self):
        return diffusers.StableDiffusion3Pipeline.from_pretrained(self.model_dir, dtype=self.dtype, **self.text_encoder_parts(),
                                                                  **_TEXT_PARTS).to(self.device)

    @no_grad
    def encode_text(self, pipe, texts):
        # prompt_embeds = [77 CLIP tokens (both towers' states, zero-padded to T5 width) ; T5 tokens].
        embeds, _, pooled, _ = pipe.encode_prompt(prompt=texts, prompt_2=None, prompt_3=None,
                                                  do_classifier_free_guidance=False, device=self.device,
                                                  max_sequence_length=self.max_sequence_length)
        # SD3's transformer takes no mask; it is stored (T5 part only) for consumers that want it.
        ids = pipe.tokenizer_3(texts, padding="max_length", max_length=self.max_sequence_length,
                               truncation=True, add_special_tokens=True, return_tensors="pt").input_ids
        mask = (ids != pipe.tokenizer_3.pad_token_id).to(torch.int64)
        embeds, pooled = embeds.cpu(), pooled.cpu()
        return [{"prompt_embeds": embeds[i], "pooled_prompt_embeds": pooled[i], "attention_mask": mask[i]}
                for i in range(len(texts))]

    # -- training --------------------------------------------------------------------------------
    def load_denoiser(self):
        return self.pretrained_denoiser(diffusers.SD3Transformer2DModel, "transformer")

    # The SD3 LoRA example's defaults: the joint attention's image and context projections.
    # (The last block is context_pre_only and has no to_add_out; PEFT skips names that are absent.)
    LORA_TARGETS = ("attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
                    "attn.to_k", "attn.to_out.0", "attn.to_q", "attn.to_v")

    def training_loss(self, transformer, latents, text, train_cfg, scheduler, generators):
        noisy, noise, timesteps, sigmas = noise_latents(latents, train_cfg, scheduler, generators)
        # SD3 takes timesteps in [0, 1000], unscaled (Flux divides by 1000).
        pred = transformer(hidden_states=noisy, timestep=timesteps,
                           encoder_hidden_states=text["prompt_embeds"].to(latents.dtype),
                           pooled_projections=text["pooled_prompt_embeds"].to(latents.dtype), return_dict=False)[0]
        if self.precondition_outputs:
            pred, target = noisy - sigmas * pred, latents  # x0 estimate vs. x0
        else:
            target = noise - latents  # velocity from data to noise
        return weighted_loss(pred, target, sigmas, train_cfg)

    # -- sampling --------------------------------------------------------------------------------
    @no_grad
    def sample(self, pipe, prompt, negative, empty, width, height, steps, guidance, true_cfg, seed, generator_device="cpu"):
        # Real CFG at `guidance` (SD3 has no distilled guidance, so `true_cfg` is unused). The unconditional
        # input comes from the cache -- the prompt's negative, else the empty prompt -- embeds and pooled
        # both: with no text encoders loaded the pipeline cannot encode "" itself.
        uncond = negative if negative is not None else empty
        generator = self.make_generator(pipe, seed, generator_device)
        return pipe(prompt_embeds=prompt["prompt_embeds"][None].to(self.dtype),
                    pooled_prompt_embeds=prompt["pooled_prompt_embeds"][None].to(self.dtype),
                    negative_prompt_embeds=uncond["prompt_embeds"][None].to(self.dtype),
                    negative_pooled_prompt_embeds=uncond["pooled_prompt_embeds"][None].to(self.dtype),
                    width=width, height=height, num_inference_steps=steps, guidance_scale=guidance,
                    max_sequence_length=self.max_sequence_length, generator=generator, output_type="pil").images[0]
