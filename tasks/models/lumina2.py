"""Lumina Image 2.0 (Alpha-VLLM): NextDiT, the lineage of Z-Image's transformer (a context refiner on the caption, a
noise refiner on 2x2 patches of the FLUX.1 VAE's latents, then joint blocks over both), with GQA attention, text from
Gemma 2 2B, flow matching with Lumina's CFG (truncation, renormalisation).

What follows which reference (diffusers 0.42.1, pipelines/lumina2/pipeline_lumina2.py):
- Latents: Z-Image's (the mode, `(z - shift_factor) * scaling_factor`, the inverse of what `__call__` does before
  vae.decode); the transformer takes them unpacked, [B, C, h, w], and patches them itself.
- Text: `encode_prompt` prepends `system_prompt + " <Prompt Start> "` to each prompt, but encodes a negative (and the
  default negative "") as written; `_get_gemma_prompt_embeds` pads to max_sequence_length (right padding), runs Gemma
  with the mask and keeps the hidden states before the last layer, padding included, in the encoder's dtype. The
  cache key is the text alone, so each text is stored both ways: `prompt_embeds` / `attention_mask` (as a prompt)
  and `negative_prompt_embeds` / `negative_attention_mask` (as a negative or the unconditional empty prompt).
- Training: the timestep `1 - t / num_train_timesteps` = 1 - sigma (Lumina's t = 1 is the clean image), the
  pipeline negates the output before the scheduler step, so the prediction is `-out` against noise - latents (as
  Z-Image); the padded caption and its mask as the pipeline passes them (the transformer cuts each caption back).
- Sampling: the pipeline from cached text, CFG at `guidance` > 1 (the pipeline's do_classifier_free_guidance) with
  its defaults cfg_trunc_ratio 1.0 and cfg_normalization True (sample.* has no setting for them).
- Names: sd-scripts' networks.lora_lumina and ComfyUI's Lumina 2 model (comfy/ldm/lumina/model.py NextDiT) use the
  original Alpha-VLLM modules: `attention.qkv` (q | k | v rows, k and v GQA-narrow), `attention.out`,
  `feed_forward.w1/w2/w3`, `adaLN_modulation.1`; ComfyUI's generic rule maps `lora_unet_<module>`, so the kohya file
  is the ComfyUI file (tests/test_lumina2.py cites the lines). diffusers reads only `diffusion_model.`-prefixed
  files for Lumina 2, with 2304 / 768 split widths hard-coded: the learning check merges the kohya file as ComfyUI.

Untested with the real weights here."""
from __future__ import annotations

import logging

from tasks.lazy import LazyClass, lazy, no_grad
from tasks.models.bases.adapter import KohyaLayout, on_pipeline_device
from tasks.models.bases.flow_matching import TransformerAdapter, noise_latents, weighted_loss
from tasks.models.bases.real_size import RealSize
from tasks.models.flux import FLUX1_VAE
from tasks.models.zimage import ZImageAdapter

torch = lazy("torch")
diffusers = lazy("diffusers")
transformers = lazy("transformers")

log = logging.getLogger("loraflow")
_SAFE = dict(use_safetensors=True)
_WARNED: set[str] = set()
# Lumina2Pipeline.__init__'s system_prompt and encode_prompt's separator (pipeline_lumina2.py, diffusers 0.42.1)
SYSTEM_PROMPT = ("You are an assistant designed to generate superior images with the superior degree of image-text "
                 "alignment based on textual prompts or user prompts.")


def _block_rules(kind: str) -> tuple:
    b = kind + r"\.(\d+)\."
    return ((b + r"attn\.to_([qkv])", kind + "_{}_attention_qkv", 3), (b + r"attn\.to_out\.0", kind + "_{}_attention_out", 1),
            (b + r"feed_forward\.linear_1", kind + "_{}_feed_forward_w1", 1),
            (b + r"feed_forward\.linear_2", kind + "_{}_feed_forward_w2", 1),
            (b + r"feed_forward\.linear_3", kind + "_{}_feed_forward_w3", 1),
            (b + r"norm1\.linear", kind + "_{}_adaLN_modulation_1", 1))


# diffusers Linear -> the original module (diffusers' convert_lumina2_to_diffusers read backwards: single_file_utils.py
# LUMINA_KEY_MAP, FINAL_LAYER_MAP); q/k/v stacked into the fused qkv. The final layer's, for targets that include it
KOHYA_RULES = (*_block_rules("layers"), *_block_rules("noise_refiner"), *_block_rules("context_refiner"),
               (r"norm_out\.linear_1", "final_layer_adaLN_modulation_1", 1), (r"norm_out\.linear_2", "final_layer_linear", 1),
               (r"x_embedder", "x_embedder", 1))
# Gemma 2 2B (google/gemma-2-2b, Lumina-Image-2.0's text_encoder): transformers' Gemma2Config defaults are its config
GEMMA2_2B = ("Gemma2Config", "Gemma2Model", {})


class _WholeWindow:
    """What Lumina2RotaryPosEmbed reads of a mask (its shape, each row's sum as a list) for an all-ones mask."""

    def __init__(self, shape):
        self.shape = shape

    def sum(self, dim):
        return _Sums([self.shape[1]] * self.shape[0])


class _Sums(list):
    def tolist(self):
        return list(self)


class _TextEncoders:
    def __init__(self, tokenizer, text_encoder):
        self.tokenizer, self.text_encoder = tokenizer, text_encoder


class Lumina2Adapter(TransformerAdapter):
    family = "lumina2"
    swap_blocks = ("layers",)  # train.blocks_to_swap (the joint blocks; the refiners stay)
    # sd-scripts' networks.lora_lumina names (ss_base_model_version "lumina2", lumina_train_network.py); ComfyUI maps
    # no `lycoris_` name that fits Lumina 2 (its branch reads Z-Image's names with equal q/k/v widths): the LyCORIS
    # file is in the ComfyUI model's names too
    kohya = KohyaLayout("networks.lora_lumina", "lumina2", rules=KOHYA_RULES, lycoris_names="comfyui")
    lokr_file = False  # LoKr: q | k | v of unequal widths in ComfyUI's one attention.qkv share no w2 (refused)
    original_layout = None  # the "zimage" writer maps Z-Image's diffusers names, not these (none written yet)
    reference_kohya = "merge"  # diffusers' Lumina 2 converter reads only `diffusion_model.` files at 2304 / 768 widths
    pipeline_cls = LazyClass("diffusers", "Lumina2Pipeline")
    denoiser_cls = LazyClass("diffusers", "Lumina2Transformer2DModel")
    denoiser_subfolder = "transformer"
    sample_parts = dict(text_encoder=None, tokenizer=None, **_SAFE)
    cfg_trunc_ratio = 1.0  # Lumina2Pipeline.__call__'s defaults (the model card samples with 0.25)
    cfg_normalization = True

    # The Linears of every JointTransformerBlock (the joint layers and both refiners): attention q/k/v/out, the
    # SwiGLU's three and the adaLN modulation where the block has one (not the context refiner): diffusion-pipe's
    # lumina_2 adapter_target_modules = ['JointTransformerBlock'], the set diffusers' Lumina 2 LoRA converter reads.
    # sd-scripts' networks.lora_lumina also trains FinalLayer's two Linears (rules above map them if targeted).
    LORA_TARGETS = (r"(layers|noise_refiner|context_refiner)\.\d+\."
                    r"(attn\.(to_[qkv]|to_out\.0)|feed_forward\.linear_[123]|norm1\.linear)")

    # Lumina-Image-2.0 (diffusers layout at Alpha-VLLM/Lumina-Image-2.0): transformer/config.json is the class
    # defaults (2304 wide, 26 layers, 2 refiner layers, 24 heads, 8 KV heads) but for cap_feat_dim 2304 (Gemma 2 2B's
    # width); FLUX.1's VAE. 2.6 B parameters.
    # bench.memory --families at 1024 px, 512 text tokens, rank 16 (2026-11-29; GiB measured / peak): bf16+ckpt
    # 8.71 / 8.87, fp8+ckpt 6.53 / 6.68, nf4+ckpt 5.47 / 5.63 (every card from 12 GB: bf16+ckpt); bf16 33.03 / 33.17
    real_sizes = (RealSize(name="lumina_image2", denoiser="Lumina2Transformer2DModel", arch={"cap_feat_dim": 2304},
                           text=(("text_encoder", GEMMA2_2B),), vae=("AutoencoderKL", FLUX1_VAE),
                           rows=("bf16+ckpt", "fp8+ckpt", "nf4+ckpt"), card=(12, 32)),)

    # The preflight's activation constants (tasks/training/memory.py), measured on Lumina-Image-2.0 (bench.memory
    # --families, rows above): without checkpointing 27.74 GiB saved = 50.1 per block x token x width over the 28
    # counted blocks (FLUX.1's 22.6: GQA repeats k / v, the 6144-wide SwiGLU, float32 RoPE products); with it 3.43
    # GiB = 173 units: diffusers checkpoints `layers` only, so the refiners keep all they save (spread as 4.40 per
    # block beside one block's 50.1 recompute). FLUX.1's left the preflight 25-39 % under the peak; these, within 2 %
    activation_factors = (50.1, 4.40, 50.1)

    @staticmethod
    def bench_batch(config: dict, size: tuple[int, int], frames: int, text_len: int):
        w, h = size
        z = dict(dtype=torch.bfloat16)
        embeds, mask = torch.zeros(1, text_len, config["cap_feat_dim"], **z), torch.ones(1, text_len, dtype=torch.int64)
        return torch.zeros(1, config["in_channels"], h // 8, w // 8, **z), {
            "prompt_embeds": embeds, "attention_mask": mask,
            "negative_prompt_embeds": embeds.clone(), "negative_attention_mask": mask.clone()}

    @staticmethod
    def activation_geometry(config: dict, size: tuple[int, int], text_tokens: int, frames: int = 1) -> tuple[int, int, int]:
        """Caption and image tokens in one sequence in the joint layers; the refiners run on one side each, counted
        as one full block per refiner layer (as Z-Image's)."""
        w, h = size
        patch = config["patch_size"]
        tokens = (h // (8 * patch)) * (w // (8 * patch)) + text_tokens
        return tokens, config["hidden_size"], config["num_layers"] + config["num_refiner_layers"]

    # -- latents: Z-Image's (the FLUX.1 VAE's mode, shifted and scaled) --------------------------------------------
    load_vae = ZImageAdapter.load_vae
    encode_latents = ZImageAdapter.encode_latents

    # -- text ------------------------------------------------------------------------------------
    def load_text_encoders(self):
        tokenizer = transformers.AutoTokenizer.from_pretrained(self.model_dir, subfolder="tokenizer")
        tokenizer.padding_side = "right"  # as Lumina2Pipeline.__init__ sets it
        return _TextEncoders(tokenizer=tokenizer, text_encoder=self.pretrained_text_encoder("text_encoder"))

    def _gemma(self, enc, texts):
        """Lumina2Pipeline._get_gemma_prompt_embeds: (hidden states before the last layer, the tokenizer's mask)."""
        inputs = enc.tokenizer(texts, padding="max_length", max_length=self.max_sequence_length, truncation=True,
                               return_tensors="pt")
        mask = inputs.attention_mask
        hidden = enc.text_encoder(inputs.input_ids.to(self.device), attention_mask=mask.to(self.device),
                                  output_hidden_states=True).hidden_states[-2]
        for text, m in zip(texts, mask):
            if m.all() and text not in _WARNED:  # a full window: the caption may be cut
                _WARNED.add(text)
                log.warning("text may be truncated at model.max_sequence_length=%d Gemma tokens (system prompt "
                            "included): %.80r", self.max_sequence_length, text)
        return hidden.to(enc.text_encoder.dtype).cpu(), mask

    @no_grad
    def encode_text(self, enc, texts):
        # encode_prompt's computation (a test holds the bytes equal): as a prompt, after the system prompt; as a
        # negative, as written (module docstring)
        embeds, mask = self._gemma(enc, [f"{SYSTEM_PROMPT} <Prompt Start> {t}" for t in texts])
        neg, neg_mask = self._gemma(enc, list(texts))
        return [{"prompt_embeds": embeds[i], "attention_mask": mask[i], "negative_prompt_embeds": neg[i],
                 "negative_attention_mask": neg_mask[i]} for i in range(len(texts))]

    # -- training --------------------------------------------------------------------------------
    def load_denoiser(self):
        return self.pretrained_denoiser(diffusers.Lumina2Transformer2DModel, "transformer")

    def training_loss(self, transformer, latents, text, train_cfg, scheduler, generators):
        from torch._subclasses.fake_tensor import is_fake

        noisy, noise, timesteps, sigmas = noise_latents(latents, train_cfg, scheduler, generators)
        t = 1 - timesteps.to(latents.dtype) / scheduler.config.num_train_timesteps  # the pipeline's current_timestep
        mask = text["attention_mask"].to(latents.device, torch.int64)
        # bench.memory's fake tensors have no values, and the rope embedder reads each caption's length from the mask
        # (`.sum(dim=1).tolist()`): there, every caption is the whole window, as bench_batch's all-ones mask says
        hook = transformer.rope_embedder.register_forward_pre_hook(
            lambda module, args: (args[0], _WholeWindow(args[1].shape))) if is_fake(mask) else None
        try:
            out = transformer(hidden_states=noisy, timestep=t,
                              encoder_hidden_states=text["prompt_embeds"].to(latents.device, latents.dtype),
                              encoder_attention_mask=mask, return_dict=False)[0]
        finally:
            if hook is not None:
                hook.remove()
        return weighted_loss(-out, noise - latents, sigmas, train_cfg)  # the pipeline steps with -out: the velocity

    # -- sampling --------------------------------------------------------------------------------
    @no_grad
    def sample(self, pipe, prompt, negative, empty, width, height, steps, guidance, true_cfg, seed, generator_device="cpu"):
        # CFG at `guidance` > 1 against the prompt's negative, else the empty prompt, each encoded as the pipeline
        # encodes a negative; `true_cfg` is unused
        def embeds(d, prefix, key):
            d = on_pipeline_device(pipe, d)
            return {f"{prefix}prompt_embeds": d[f"{key}prompt_embeds"][None].to(self.dtype),
                    f"{prefix}prompt_attention_mask": d[f"{key}attention_mask"][None]}

        kwargs = embeds(prompt, "", "")
        if guidance > 1:
            kwargs.update(embeds(negative if negative is not None else empty, "negative_", "negative_"))
        generator = self.make_generator(pipe, seed, generator_device)
        return pipe(**kwargs, width=width, height=height, num_inference_steps=steps, guidance_scale=guidance,
                    cfg_trunc_ratio=self.cfg_trunc_ratio, cfg_normalization=self.cfg_normalization,
                    max_sequence_length=self.max_sequence_length, generator=generator, output_type="pil").images[0]
