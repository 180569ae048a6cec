"""Krea 2 (Krea AI): a single-stream MMDiT (Krea2Transformer2DModel: text and 2x2-patched image tokens in one sequence
through every block; GQA attention with a sigmoid output gate, SwiGLU, AdaLN-single modulation) on the Qwen-Image VAE
(AutoencoderKLQwenImage, /8, 16 channels, per-channel latents_mean/std), text from Qwen3-VL-4B (a stack of 12 of its
hidden states per token, fused by the transformer's own text-fusion stage), flow matching with CFG.

What follows which reference (diffusers 0.42.1, pipelines/krea2/pipeline_krea2.py):
- Latents: the VAE's mode of one frame, (z - latents_mean) / latents_std, as `__call__` un-does it before
  `vae.decode` (latents / (1 / std) + mean); stored [B, 16, H/8, W/8], packed 2x2 (`_pack_latents`) for the model.
- Text: the pipeline's own `encode_prompt`: the caption after Qwen-Image's system prefix, padded to a fixed length
  IN THE MIDDLE ([prefix | prompt | PAD | assistant suffix]), positions counting real tokens only, the hidden states
  `text_encoder_select_layers` stacked ([L, 12, 2560]), the 34 prefix tokens dropped; its bool mask stored as int64.
  Every caption has the same length (model.max_sequence_length), so no cut-back is needed for sampling.
- Training: timestep = sigma (`t / num_train_timesteps`, in [0, 1]; the model scales by 1000 itself), position ids
  `prepare_position_ids` (text at the origin), the mask as `encoder_attention_mask`; velocity target noise - latents
  (FlowMatchEulerDiscreteScheduler.step: x + (sigma_next - sigma) v).
- Sampling: `guidance` is the pipeline's guidance_scale in Krea's convention (cond + g (cond - uncond), off at 0: the
  Raw model card's 4.5, the distilled Turbo's 0), against the prompt's negative or the cached empty prompt.
- LoRA targets: the 28 blocks' attention (to_q/k/v, to_gate, to_out.0) and SwiGLU (gate/up/down) Linears; ai-toolkit
  (extensions_built_in/diffusion_models/krea2/krea2.py: target_lin_modules ["SingleStreamDiT"]) wraps every Linear of
  the model, these are its blocks' share (the text fusion, embedders and final layer left out, as for other families).
- Files: the diffusers file is read by Krea2LoraLoaderMixin. The kohya file is in the original checkpoint's names,
  which ComfyUI's model has (comfy/ldm/krea2/model.py: blocks.N.attn.wq/wk/wv/gate/wo, blocks.N.mlp.gate/up/down,
  txtfusion.*, first, tmlp.0/2, tproj.1, txtmlp.1/3, last.linear), loaded by its generic `lora_unet_<model key>` rule
  (comfy/lora.py model_lora_keys_unet); diffusers reads no `lora_unet_` file for Krea 2
  (`_convert_non_diffusers_krea2_lora_to_diffusers` takes `diffusion_model.` / `base_model.model.` lora_A/B keys
  only), so the learning check merges it as ComfyUI does. No q/k/v fusion anywhere: the kohya file is the ComfyUI file.
Untested with the real weights here."""
from __future__ import annotations

import logging

from tasks.lazy import LazyClass, lazy, no_grad
from tasks.models.bases.adapter import BLOCK, KohyaLayout
from tasks.models.bases.flow_matching import TransformerAdapter, noise_latents, weighted_loss
from tasks.models.bases.real_size import RealSize

torch = lazy("torch")
diffusers = lazy("diffusers")

log = logging.getLogger("loraflow")
_SAFE = dict(use_safetensors=True)
_TEXT_PARTS = dict(transformer=None, vae=None, **_SAFE)
_SAMPLE_PARTS = dict(text_encoder=None, tokenizer=None, **_SAFE)
_WARNED: set[str] = set()
PATCH = 2  # Krea2Pipeline's patch_size

# diffusers' name -> the original checkpoint's (= ComfyUI's), read backwards from diffusers'
# convert_krea2_transformer_checkpoint_to_diffusers (loaders/single_file_utils.py) and
# _convert_non_diffusers_krea2_lora_to_diffusers (loaders/lora_conversion_utils.py)
_ATTN = (("to_q", "wq"), ("to_k", "wk"), ("to_v", "wv"), ("to_gate", "gate"), ("to_out\\.0", "wo"))
_FF = (("gate", "gate"), ("up", "up"), ("down", "down"))


def _block_rules(diffusers_prefix: str, original: str) -> tuple:
    return (tuple((diffusers_prefix + rf"attn\.{d}", f"{original}_{{}}_attn_{o}", 1) for d, o in _ATTN)
            + tuple((diffusers_prefix + rf"ff\.{d}", f"{original}_{{}}_mlp_{o}", 1) for d, o in _FF))


KOHYA_RULES = (
    *_block_rules(BLOCK, "blocks"),
    *_block_rules(r"text_fusion\.layerwise_blocks\.(\d+)\.", "txtfusion_layerwise_blocks"),
    *_block_rules(r"text_fusion\.refiner_blocks\.(\d+)\.", "txtfusion_refiner_blocks"),
    *((d, o, 1) for d, o in ((r"img_in", "first"), (r"time_embed\.linear_1", "tmlp_0"),
                             (r"time_embed\.linear_2", "tmlp_2"), (r"time_mod_proj", "tproj_1"),
                             (r"txt_in\.linear_1", "txtmlp_1"), (r"txt_in\.linear_2", "txtmlp_3"),
                             (r"text_fusion\.projector", "txtfusion_projector"),
                             (r"final_layer\.linear", "last_linear"))),
)

# Qwen/Qwen3-VL-4B-Instruct's config.json (Krea 2's text encoder; the pipeline holds Qwen3VLModel): the keys that
# shape the model
QWEN3_VL_4B = ("Qwen3VLConfig", "Qwen3VLModel", dict(
    text_config=dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=262144,
                     rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=True, bos_token_id=151643,
                     eos_token_id=151645, rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                                                           "mrope_section": [24, 20, 20], "mrope_interleaved": True}),
    vision_config=dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2560,
                       patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                       deepstack_visual_indexes=[5, 11, 17], hidden_act="gelu_pytorch_tanh"),
    image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653,
    tie_word_embeddings=True))


def pack(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, h, w] -> [B, (h/2)(w/2), 4C]: Krea2Pipeline._pack_latents."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // PATCH, PATCH, w // PATCH, PATCH).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // PATCH) * (w // PATCH), c * PATCH * PATCH)


def unpack(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """pack's inverse: Krea2Pipeline._unpack_latents without its frame axis."""
    b, _, ch = tokens.shape
    x = tokens.view(b, h // PATCH, w // PATCH, ch // (PATCH * PATCH), PATCH, PATCH).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, ch // (PATCH * PATCH), h, w)


class Krea2Adapter(TransformerAdapter):
    family = "krea2"
    # the original names (ComfyUI's model), one Linear each; ComfyUI maps no `lycoris_` name for Krea 2, only its
    # generic `lora_unet_<model key>`: the LyCORIS file is in those names too
    kohya = KohyaLayout("networks.lora_krea2", "krea2", rules=KOHYA_RULES, lycoris_names="comfyui")
    reference_kohya = "merge"  # diffusers' Krea 2 loader reads no kohya file (see the module docstring)
    swap_blocks = ("transformer_blocks",)  # train.blocks_to_swap
    pipeline_cls = LazyClass("diffusers", "Krea2Pipeline")
    denoiser_cls = LazyClass("diffusers", "Krea2Transformer2DModel")
    denoiser_subfolder = "transformer"
    sample_parts = _SAMPLE_PARTS
    LORA_TARGETS = r"transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v|to_gate|to_out\.0)|ff\.(gate|up|down))"
    # Krea 2 Raw (krea/Krea-2-Raw: the class defaults are its config, as ComfyUI's SingleStreamDiT defaults and
    # ai-toolkit's KREA2_MMDIT_CONFIG give it: 6144 wide, 28 blocks, SwiGLU 16384; text fusion 2560 wide, 6912),
    # 12.5 B parameters. bench.memory at 1024 px, 512 text tokens, rank 16 (the card table's settings): bf16+ckpt
    # 27.8 GiB (48 GB cards), fp8+ckpt for 24 GB, nf4+ckpt 10.1 GiB (16 GB), nf4+ckpt+offload+swap6 for 12 GB
    real_sizes = (RealSize("krea2_raw", "Krea2Transformer2DModel", text=(("text_encoder", QWEN3_VL_4B),),
                           vae=("AutoencoderKLQwenImage", {}),
                           rows=("bf16+ckpt", "fp8+ckpt", "nf4+ckpt"), card=(12, 32)),)
    # not a row: nf4+ckpt+offload+swap6 (measured 7.59 GiB, peak 8.91; the preflight's 10.00 is 12 % over, with Flux's
    # activation constants: Krea 2's own are not measured yet)

    @staticmethod
    def activation_geometry(config: dict, size: tuple[int, int], text_tokens: int, frames: int = 1) -> tuple[int, int, int]:
        """One sequence of 2x2 patches (/16 px) and the caption in every block; the text fusion runs on the caption
        alone, before any LoRA target, and saves nothing for backward."""
        w, h = size
        tokens = (h // (8 * PATCH)) * (w // (8 * PATCH)) + text_tokens
        return tokens, config["num_attention_heads"] * config["attention_head_dim"], config["num_layers"]

    @staticmethod
    def bench_batch(config: dict, size: tuple[int, int], frames: int, text_len: int):
        w, h = size
        z = dict(dtype=torch.bfloat16)
        return torch.zeros(1, config["in_channels"] // (PATCH * PATCH), h // 8, w // 8, **z), {
            "prompt_embeds": torch.zeros(1, text_len, config["num_text_layers"], config["text_hidden_dim"], **z),
            "prompt_embeds_mask": torch.ones(1, text_len, dtype=torch.int64)}

    # -- latents ---------------------------------------------------------------------------------
    def load_vae(self):
        return diffusers.AutoencoderKLQwenImage.from_pretrained(self.model_dir, subfolder="vae", dtype=self.dtype,
                                                                **_SAFE).to(self.device).eval()

    @no_grad
    def encode_latents(self, vae, pixels):
        # one frame of the video VAE; the mode, normalised per channel as the pipeline un-normalises it
        z = vae.encode(pixels.to(vae.device, vae.dtype, non_blocking=True)[:, :, None]).latent_dist.mode()
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(z.device, z.dtype)
        std = torch.tensor(vae.config.latents_std).view(shape).to(z.device, z.dtype)
        return ((z - mean) / std)[:, :, 0]

    # -- text ------------------------------------------------------------------------------------
    def load_text_encoders(self):
        return self.pipeline_cls.from_pretrained(self.model_dir, dtype=self.dtype, **self.text_encoder_parts(),
                                                 **_TEXT_PARTS).to(self.device)

    @no_grad
    def encode_text(self, pipe, texts):
        embeds, mask = pipe.encode_prompt(texts, device=self.device, max_sequence_length=self.max_sequence_length)
        embeds, mask = embeds.cpu(), mask.cpu()
        for text, m in zip(texts, mask):
            if m.all() and text not in _WARNED:  # the window is full: the caption may have been cut
                _WARNED.add(text)
                log.warning("text may be truncated at model.max_sequence_length=%d tokens: %.80r",
                            self.max_sequence_length, text)
        return [{"prompt_embeds": embeds[i], "prompt_embeds_mask": mask[i].to(torch.int64)} for i in range(len(texts))]

    # -- training --------------------------------------------------------------------------------
    def load_denoiser(self):
        return self.pretrained_denoiser(self.denoiser_cls, "transformer")

    def training_loss(self, transformer, latents, text, train_cfg, scheduler, generators):
        _, _, h, w = latents.shape
        noisy, noise, timesteps, sigmas = noise_latents(latents, train_cfg, scheduler, generators)
        embeds = text["prompt_embeds"].to(latents.dtype)
        positions = self.pipeline_cls.prepare_position_ids(embeds.shape[1], h // PATCH, w // PATCH, latents.device)
        # the pipeline's timestep: t / num_train_timesteps in float32, then the latents' dtype
        t = (timesteps.float() / scheduler.config.num_train_timesteps).to(latents.dtype)
        pred = transformer(hidden_states=pack(noisy), encoder_hidden_states=embeds, timestep=t, position_ids=positions,
                           encoder_attention_mask=text["prompt_embeds_mask"].to(latents.device).bool(),
                           return_dict=False)[0]
        return weighted_loss(unpack(pred, h, w), noise - latents, sigmas, train_cfg)  # velocity target

    # -- sampling --------------------------------------------------------------------------------
    def embeds(self, d: dict, name: str) -> dict:
        """A cached text as the pipeline's `<name>_embeds` and bool `<name>_embeds_mask`, on the pipeline's device."""
        return {f"{name}_embeds": d["prompt_embeds"][None].to(self.dtype),
                f"{name}_embeds_mask": d["prompt_embeds_mask"][None].bool()}

    @no_grad
    def sample(self, pipe, prompt, negative, empty, width, height, steps, guidance, true_cfg, seed, generator_device="cpu"):
        # CFG at `guidance` (Krea's convention, on above 0) against the prompt's negative, else the cached empty
        # prompt (the pipeline's own default negative is ""); `true_cfg` is unused
        device = pipe._execution_device
        kwargs = self.embeds(prompt, "prompt")
        if guidance > 0:
            kwargs.update(self.embeds(negative if negative is not None else empty, "negative_prompt"))
        kwargs = {k: v.to(device) for k, v in kwargs.items()}
        generator = self.make_generator(pipe, seed, generator_device)
        return pipe(**kwargs, guidance_scale=guidance, width=width, height=height, num_inference_steps=steps,
                    max_sequence_length=self.max_sequence_length, generator=generator, output_type="pil").images[0]
