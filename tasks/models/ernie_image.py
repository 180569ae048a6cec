"""ERNIE-Image (Baidu): a single-stream DiT (image patches and caption tokens in one sequence, shared adaLN) on the
FLUX.2 VAE's latents (AutoencoderKLFlux2, /8, patchified 2x2 and normalised by the VAE's batch-norm statistics),
text from a Ministral 3 language model (Mistral3Model: the hidden states before its last layer of the bare caption,
one caption at a time, each its own length), flow matching with a velocity prediction. Follows diffusers'
ErnieImagePipeline (0.42.1): the transformer takes the padded captions and their lengths (text_bth, text_lens) and
the timestep as sigma x 1000, and predicts noise - x0 (scheduler.step adds (sigma_next - sigma) x pred)."""
from __future__ import annotations

import logging

from tasks.lazy import LazyClass, lazy, no_grad
from tasks.models.bases.adapter import KohyaLayout
from tasks.models.bases.flow_matching import TransformerAdapter, noise_latents, weighted_loss
from tasks.models.bases.real_size import RealSize

torch = lazy("torch")
diffusers = lazy("diffusers")
transformers = lazy("transformers")

log = logging.getLogger("loraflow")
_SAFE = dict(use_safetensors=True)
_WARNED: set[str] = set()
# ErnieImagePipeline decodes with sqrt(running_var + 1e-5), not vae.config.batch_norm_eps (its TODO: the hub config
# says 1e-4, the model trained with 1e-5): the cached latents use the same eps, so decoding inverts them exactly
_BN_EPS = 1e-5
# ERNIE-Image's text encoder (baidu/ERNIE-Image text_encoder/config.json, as musubi-tuner's ernie_image_utils.py at
# 07f78ab1 quotes it, ERNIE_IMAGE_TEXT_ENCODER_CONFIG_JSON): Mistral3Model around a Ministral 3 3B text model and a
# Pixtral vision tower the pipeline never runs
_MINISTRAL3 = ("Mistral3Config", "Mistral3Model", dict(
    image_token_index=10, spatial_merge_size=2, projector_hidden_act="gelu", multimodal_projector_bias=False,
    tie_word_embeddings=True, vision_feature_layer=-1,
    text_config=dict(model_type="ministral3", vocab_size=131072, hidden_size=3072, intermediate_size=9216,
                     num_hidden_layers=26, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     max_position_embeddings=262144, rms_norm_eps=1e-5, tie_word_embeddings=True,
                     bos_token_id=1, eos_token_id=2, pad_token_id=11, sliding_window=None,
                     rope_parameters=dict(rope_type="yarn", rope_theta=1000000.0, factor=16.0,
                                          original_max_position_embeddings=16384, beta_fast=32.0, beta_slow=1.0,
                                          mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=0.1)),
    vision_config=dict(model_type="pixtral", hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                       num_attention_heads=16, head_dim=64, image_size=1540, patch_size=14, num_channels=3)))


class _TextEncoders:
    def __init__(self, tokenizer, text_encoder):
        self.tokenizer, self.text_encoder = tokenizer, text_encoder


class ErnieImageAdapter(TransformerAdapter):
    family = "ernie_image"
    swap_blocks = ("layers",)  # train.blocks_to_swap: its one list of blocks
    # The released single files (ComfyUI's diffusion_models/) hold diffusers' names (diffusers'
    # convert_ernie_image_transformer_checkpoint_to_diffusers only strips a `model.diffusion_model.` prefix)
    original_layout = "diffusers"
    # musubi-tuner's networks.lora_ernie_image names each Linear `lora_unet_<its module path, "." -> "_">` on a model
    # with diffusers' module names (ernie_image_model.py), and ComfyUI's model (comfy/ldm/ernie/model.py) has them
    # too, read by its generic `lora_unet_<key>` rule: one file for both. ComfyUI maps no `lycoris_` name for it.
    kohya = KohyaLayout("networks.lora_ernie_image", "ernie_image", names="named", lycoris_names="comfyui")
    reference_kohya = "merge"  # ErnieImageLoraLoaderMixin reads PEFT / `diffusion_model.` keys, no `lora_unet_`
    pipeline_cls = LazyClass("diffusers", "ErnieImagePipeline")
    denoiser_cls = LazyClass("diffusers", "ErnieImageTransformer2DModel")
    denoiser_subfolder = "transformer"
    sample_parts = dict(text_encoder=None, tokenizer=None, **_SAFE)  # no prompt enhancer (pe) either: none saved

    # baidu/ERNIE-Image: an 8 B transformer (ComfyUI's ErnieImageModel and musubi-tuner's defaults; diffusers' class
    # defaults are a smaller 3072-wide one), the Ministral 3 3 B text encoder, the FLUX.2 VAE (its class defaults)
    real_sizes = (RealSize(
        "ernie_image", "ErnieImageTransformer2DModel",
        arch=dict(hidden_size=4096, num_attention_heads=32, num_layers=36, ffn_hidden_size=12288, text_in_dim=3072),
        text=(("text_encoder", _MINISTRAL3),), vae=("AutoencoderKLFlux2", {}),
        # the card table's picks (bench.memory --families, 1024 px, 512 text tokens, rank 16; measured GiB):
        # bf16+ckpt 18.4 for 24 GB cards, fp8+ckpt for 16 GB, nf4+ckpt 7.3 for 12 GB (no swap needed)
        rows=("bf16+ckpt", "fp8+ckpt", "nf4+ckpt"), card=(12, 32)),)
    # The sample node's forward (bench.memory --nodes, 1024 px, 512 tokens): its own peak 0.918 GiB = 26.1 values a
    # token x width; its largest stored Linear is the shared adaLN_modulation (4096 -> 6 x 4096), dequantized before
    # the blocks with 2.1 beside it (NF4: 1.392 GiB), not the table's 13.4 inside a block (which read it 29 % high)
    infer_factors = (26.1, 2.1)

    @staticmethod
    def bench_batch(config: dict, size: tuple[int, int], frames: int, text_len: int):
        w, h = size
        latents = torch.zeros(1, config["in_channels"], h // 16, w // 16, dtype=torch.bfloat16)
        text = {"prompt_embeds": torch.zeros(1, text_len, config["text_in_dim"], dtype=torch.bfloat16),
                "attention_mask": torch.ones(1, text_len, dtype=torch.int64)}
        return latents, text

    @staticmethod
    def activation_geometry(config: dict, size: tuple[int, int], text_tokens: int, frames: int = 1) -> tuple[int, int, int]:
        """One sequence of image patches (/16: VAE /8, 2x2 patches, patch_size 1) and caption tokens in every block."""
        w, h = size
        p = 16 * config.get("patch_size", 1)
        return (h // p) * (w // p) + text_tokens, config["hidden_size"], config["num_layers"]

    # -- latents ---------------------------------------------------------------------------------
    def load_vae(self):
        return diffusers.AutoencoderKLFlux2.from_pretrained(self.model_dir, subfolder="vae", dtype=self.dtype,
                                                            **_SAFE).to(self.device).eval()

    @no_grad
    def encode_latents(self, vae, pixels):
        # The mode, 2x2 patches into channels, the batch-norm statistics removed: the inverse of what the pipeline
        # does before vae.decode. Stored [B, 4C, H/16, W/16].
        z = self.pipeline_cls._patchify_latents(
            vae.encode(pixels.to(vae.device, vae.dtype, non_blocking=True)).latent_dist.mode())
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(z.device, z.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + _BN_EPS).to(z.device, z.dtype)
        return (z - mean) / std

    # -- text ------------------------------------------------------------------------------------
    def load_text_encoders(self):
        return _TextEncoders(
            tokenizer=transformers.AutoTokenizer.from_pretrained(self.model_dir, subfolder="tokenizer"),
            text_encoder=self.pretrained_text_encoder("text_encoder"))  # streamed, stored, placed

    @no_grad
    def encode_text(self, enc, texts):
        # ErnieImagePipeline.encode_prompt's computation (a test holds the bytes equal): each caption alone, with
        # the tokenizer's special tokens (<s>), no padding and no mask, hidden_states[-2]. Cut at
        # max_sequence_length tokens, as musubi-tuner's encode_text (MAX_SEQ_LENGTH 512); the pipeline cuts only at
        # the tokenizer's own limit. Stored padded to the window with zeros and a mask, so captions stack into
        # batches; training and sampling cut each back to its length, as the pipeline's _pad_text lays them out.
        out = []
        for text in texts:
            ids = enc.tokenizer(text, add_special_tokens=True, truncation=False, padding=False)["input_ids"]
            if len(ids) > self.max_sequence_length and text not in _WARNED:
                _WARNED.add(text)
                log.warning("text truncated at model.max_sequence_length=%d tokens: %.80r",
                            self.max_sequence_length, text)
            ids = ids[:self.max_sequence_length] or [enc.tokenizer.bos_token_id if enc.tokenizer.bos_token_id
                                                     is not None else 0]  # the pipeline's empty-caption rule
            hidden = enc.text_encoder(input_ids=torch.tensor([ids], device=self.device),
                                      output_hidden_states=True).hidden_states[-2][0].cpu()
            embeds = hidden.new_zeros(self.max_sequence_length, hidden.shape[-1])
            embeds[:len(ids)] = hidden
            mask = torch.zeros(self.max_sequence_length, dtype=torch.int64)
            mask[:len(ids)] = 1
            out.append({"prompt_embeds": embeds, "attention_mask": mask})
        return out

    @staticmethod
    def text_inputs(prompt_embeds, attention_mask):
        """Cached [B, L, D] + [B, L] -> the transformer's (text_bth, text_lens): the window cut to the batch's
        longest caption, the rest zeros, as the pipeline's _pad_text builds it."""
        from torch._subclasses.fake_tensor import is_fake

        lens = attention_mask.sum(1).to(torch.long)
        # bench.memory's fake tensors have no values: the whole window (its batch is all caption, bench_batch)
        return prompt_embeds if is_fake(lens) else prompt_embeds[:, :int(lens.max())], lens

    # -- training --------------------------------------------------------------------------------
    def load_denoiser(self):
        return self.pretrained_denoiser(diffusers.ErnieImageTransformer2DModel, "transformer")

    # musubi-tuner's networks/lora_ernie_image.py (07f78ab1): every Linear of each ErnieImageSharedAdaLNBlock but
    # those matching `.*(adaLN_modulation|norm).*` (none of the block's Linears): the attention's q, k, v and out,
    # and the MLP's gate, up and down projections. Not the embedders, the shared modulation or the final layer.
    LORA_TARGETS = r"layers\.\d+\.(self_attention\.(to_[qkv]|to_out\.0)|mlp\.(gate_proj|up_proj|linear_fc2))"

    def training_loss(self, transformer, latents, text, train_cfg, scheduler, generators):
        noisy, noise, timesteps, sigmas = noise_latents(latents, train_cfg, scheduler, generators)
        text_bth, lens = self.text_inputs(text["prompt_embeds"].to(latents.dtype), text["attention_mask"])
        pred = transformer(hidden_states=noisy, timestep=timesteps.to(latents.dtype), text_bth=text_bth,
                           text_lens=lens.to(latents.device), return_dict=False)[0]
        return weighted_loss(pred, noise - latents, sigmas, train_cfg)  # velocity target

    # -- sampling --------------------------------------------------------------------------------
    @no_grad
    def sample(self, pipe, prompt, negative, empty, width, height, steps, guidance, true_cfg, seed, generator_device="cpu"):
        # Real CFG at `guidance` (the pipeline's guidance_scale, on above 1: ERNIE-Image 4.0, the Turbo 1.0)
        # against the prompt's negative, else the cached empty prompt (the pipeline's own negative is "");
        # `true_cfg` is unused. No prompt enhancer: the cached caption is what trained.
        def embeds(d):
            return [d["prompt_embeds"][: int(d["attention_mask"].sum())].to(pipe._execution_device, self.dtype)]

        uncond = negative if negative is not None else empty
        generator = self.make_generator(pipe, seed, generator_device)
        return pipe(prompt_embeds=embeds(prompt), negative_prompt_embeds=embeds(uncond) if guidance > 1 else None,
                    width=width, height=height, num_inference_steps=steps, guidance_scale=guidance,
                    generator=generator, output_type="pil", use_pe=False).images[0]
