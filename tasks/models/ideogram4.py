"""Ideogram 4 (ideogram-ai/ideogram-v4): a single-stream DiT (Ideogram4Transformer2DModel, 34 blocks, 4608 wide) over
one packed sequence [left-padded caption | image tokens], with a block-diagonal segment mask and 3-axis MRoPE, on
the FLUX.2 VAE's latents (AutoencoderKLFlux2, /8, 2x2 patches normalised by its batch norm), text from Qwen3-VL
(13 tapped decoder layers, concatenated per token: 53248 wide), flow matching with asymmetric CFG: a second model,
`unconditional_transformer`, denoises the image tokens alone with zeroed text features.

What follows which reference (diffusers 0.42.1, pipelines/ideogram4/pipeline_ideogram4.py):
- Latents: the VAE's mode, 2x2 patches packed into channels in the pipeline's order (row patch, column patch, VAE
  channel: the inverse of its `z.view(B, gh, gw, p, p, C).permute(0, 5, 1, 3, 2, 4)` before `vae.decode`), minus
  `vae.bn.running_mean`, over sqrt(running_var + batch_norm_eps). Stored [B, 4C, H/16, W/16]; a token is a column.
- Text: the pipeline's own `encode_prompt` (chat template, left padding to max_sequence_length, the 13 taps, padding
  zeroed), stored as its text window [L, 53248] and the mask of the caption's tokens (`indicator == LLM_TOKEN`).
  The pipeline refuses a caption longer than its window; so does encode_text (a ConfigError, exit 2).
- Training: the conditional transformer on [zeros | noisy tokens] with the caption's features, the position,
  segment and indicator ids of `Ideogram4Pipeline._prepare_ids`, timestep 1 - sigma (the pipeline's model time,
  0 = noise), output negated (the pipeline steps the scheduler with -v): target noise - latents. The text window is
  cut to the batch's longest caption (left padding: its last k tokens): the padding is its own attention segment,
  so the image tokens' prediction does not change (SimpleTuner's Ideogram 4 model trains on such a cut window).
- LoRA targets: every block's attention q/k/v and output and its SwiGLU w1/w2/w3, the Linears musubi-tuner's
  networks/lora_ideogram4.py (`attention.(qkv|o)`, `feed_forward.w[123]` of Ideogram4TransformerBlock) and
  SimpleTuner's Ideogram 4 model (DEFAULT_LORA_TARGET qkv, o, w1, w2, w3) train. Not adaln_modulation.
- kohya file: musubi-tuner's names, `lora_unet_layers_<i>_attention_qkv` (q/k/v fused exactly), `..._attention_o`,
  `..._feed_forward_w1/2/3`: the original checkpoint's modules, which ComfyUI's Ideogram 4 model has (its generic
  `lora_unet_<key>` rule maps them), so the kohya file is the ComfyUI file. diffusers' Ideogram4 loader reads only
  `diffusion_model.`-prefixed (ai-toolkit) files: the learning check merges the kohya file as ComfyUI does.
- LoRA file: diffusers' layout (`transformer.*`), Ideogram4LoraLoaderMixin; its load_lora_weights loads it into
  `transformer` alone, so the unconditional transformer stays the base model, in training's samples and after.
- Sampling: the pipeline's own __call__ (logit-normal sigmas, both transformers, v = g pos + (1 - g) neg, decode),
  its encode_prompt step answered from the cache. The guidance is constant (sample.cfg; the pipeline's default
  schedule, 7.0 then 3.0 for the last 3 of 48 steps, is for 48 steps only). A prompt's --n is not used: the
  unconditional branch reads no text.

Untested with the real weights here."""
from __future__ import annotations

import functools
import logging

from tasks.lazy import LazyClass, lazy, no_grad
from tasks.models.bases.adapter import KohyaLayout
from tasks.models.bases.flow_matching import TransformerAdapter, noise_latents, weighted_loss
from tasks.models.bases.real_size import RealSize

torch = lazy("torch")
diffusers = lazy("diffusers")

log = logging.getLogger("loraflow")
_SAFE = dict(use_safetensors=True)
_L = r"layers\.(\d+)\."
# diffusers Linear -> the original checkpoint's module (its names: ComfyUI's comfy/ldm/ideogram4/model.py, musubi-tuner,
# diffusers' _convert_non_diffusers_ideogram4_lora_to_diffusers); q/k/v are the row blocks of one `attention.qkv`
KOHYA_RULES = (
    (_L + r"attention\.to_([qkv])", "layers_{}_attention_qkv", 3),
    (_L + r"attention\.to_out\.0", "layers_{}_attention_o", 1),
    (_L + r"feed_forward\.w1", "layers_{}_feed_forward_w1", 1),
    (_L + r"feed_forward\.w2", "layers_{}_feed_forward_w2", 1),
    (_L + r"feed_forward\.w3", "layers_{}_feed_forward_w3", 1),
    (_L + r"adaln_modulation", "layers_{}_adaln_modulation", 1),
    (r"(input_proj|llm_cond_proj|adaln_proj)", "{}", 1),  # the embedders keep their names
    (r"t_embedding\.mlp_(in|out)", "t_embedding_mlp_{}", 1),
    (r"final_layer\.(linear|adaln_modulation)", "final_layer_{}", 1),
)
# Qwen3-VL-8B-Instruct's config.json (the text encoder's, a Qwen3VLModel: the pipeline's head-less body)
QWEN3_VL_8B = ("Qwen3VLConfig", "Qwen3VLModel", dict(
    text_config=dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=262144,
                     rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                                                         "mrope_section": [24, 20, 20], "mrope_interleaved": True},
                     tie_word_embeddings=False),
    vision_config=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=4096,
                       patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                       deepstack_visual_indexes=[8, 16, 24]),
    image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653,
    tie_word_embeddings=False))
# The FLUX.2 VAE (AutoencoderKLFlux2's defaults are its config: 32 channels, /8, 2x2 patches)
FLUX2_VAE = ("AutoencoderKLFlux2", {})


@functools.cache
def _pipeline_class():
    """diffusers' Ideogram4Pipeline, but (1) its encode_prompt step reads cached text when `prompt` is a list of the
    cache's dicts, and (2) `guidance_scale` alone is enough (the default per-step schedule is for 48 steps)."""
    base = diffusers.Ideogram4Pipeline

    class Ideogram4Pipeline(base):  # the same name: bench/ keys pipelines by class name
        def encode_prompt(self, prompt, grid_h, grid_w, max_sequence_length, device):
            if not prompt or not isinstance(prompt[0], dict):
                return super().encode_prompt(prompt, grid_h, grid_w, max_sequence_length, device)
            # encode_prompt's outputs from the cached window: the features (float32, as it returns them) and the
            # ids its _prepare_ids lays out for those caption lengths, the image region's features zeros
            feats = torch.stack([d["prompt_embeds"] for d in prompt]).to(device, torch.float32)
            lengths = [int(d["attention_mask"].sum()) for d in prompt]
            ids = self._prepare_ids(lengths, grid_h, grid_w, max_sequence_length, device)
            pad = feats.new_zeros(len(prompt), grid_h * grid_w, feats.shape[-1])
            return (torch.cat([feats, pad], dim=1), *ids)

        def __call__(self, prompt=None, height=2048, width=2048, num_inference_steps=48, guidance_scale=None,
                     guidance_schedule=None, max_sequence_length=2048, **kwargs):
            if guidance_scale is None and guidance_schedule is None:  # the pipeline's recommended schedule
                guidance_schedule = (7.0,) * (num_inference_steps - 3) + (3.0,) * min(3, num_inference_steps)
            return super().__call__(prompt=prompt, height=height, width=width,
                                    num_inference_steps=num_inference_steps, guidance_scale=guidance_scale,
                                    guidance_schedule=guidance_schedule, max_sequence_length=max_sequence_length,
                                    **kwargs)

    return Ideogram4Pipeline


def packed_ids(mask, gh: int, gw: int):
    """Ideogram4Pipeline._prepare_ids for a left-padded window's mask [B, k] (1 on the caption's tokens), without its
    loop over Python ints: (position_ids [B, k + N, 3], segment_ids, indicator) of [window | gh x gw image tokens]."""
    from diffusers.models.transformers import transformer_ideogram4 as T

    b, k = mask.shape
    m = mask.long()
    text_pos = (m.cumsum(dim=1) - 1) * m  # 0, 1, ... on the caption's tokens, 0 on the padding
    hw = torch.arange(gh * gw, device=m.device)
    image = torch.stack([torch.zeros_like(hw), hw // gw, hw % gw], dim=1) + T.IMAGE_POSITION_OFFSET
    position_ids = torch.cat([text_pos[..., None].expand(b, k, 3), image.expand(b, gh * gw, 3)], dim=1)
    ones = m.new_ones(b, gh * gw)
    segment_ids = torch.cat([torch.where(m.bool(), 1, T.SEQUENCE_PADDING_INDICATOR), ones], dim=1)
    indicator = torch.cat([m * T.LLM_TOKEN_INDICATOR, ones * T.OUTPUT_IMAGE_INDICATOR], dim=1)
    return position_ids, segment_ids, indicator


class _PipelineClass:
    name = "Ideogram4Pipeline"  # as LazyClass: the folder's class, read without importing (tasks/lora_tools/models.py)

    def __get__(self, obj, owner=None) -> type:
        return _pipeline_class()


class Ideogram4Adapter(TransformerAdapter):
    family = "ideogram4"
    original_layout = None  # no single-file layout is written (diffusers reads none for Ideogram 4)
    kohya = KohyaLayout("networks.lora_ideogram4", "ideogram4", rules=KOHYA_RULES, lycoris_names="comfyui")
    reference_kohya = "merge"
    swap_blocks = ("layers",)  # train.blocks_to_swap
    max_text_tokens = 2048  # the pipeline's max_sequence_length default (structured JSON captions are long)
    pipeline_cls = _PipelineClass()
    denoiser_cls = LazyClass("diffusers", "Ideogram4Transformer2DModel")
    denoiser_subfolder = "transformer"
    sample_components = ("transformer", "unconditional_transformer", "vae", "scheduler")
    sample_parts = dict(text_encoder=None, tokenizer=None, **_SAFE)
    LORA_TARGETS = r"layers\.\d+\.(attention\.(to_[qkv]|to_out\.0)|feed_forward\.w[123])"
    real_sizes = (RealSize("ideogram4", "Ideogram4Transformer2DModel", text=(("text_encoder", QWEN3_VL_8B),),
                           vae=FLUX2_VAE, card=(16, 32), denoisers=("transformer", "unconditional_transformer"),
                           rows=("bf16+ckpt", "fp8+ckpt", "bf16+ckpt+swap16", "int8+ckpt")),)
    # The sample node rows hold both transformers (one forward at a time). Not a row: nf4+ckpt (measured 8.17 GiB,
    # peak 9.27; the preflight's 10.54 is 14 % over, the largest Linear's dequantized copy counted on top of the
    # activations), nor nf4+ckpt+offload+swap16 (the preflight's host 3.38 GiB for the measured 4.05 of its swapped
    # NF4 blocks): the 12 GB card's train pick (nf4+ckpt+offload) is the preflight's, the goal 16 GB.
    # The sample node's forward (bench.memory --nodes, 1024 px, 512 tokens): its own peak 2.785 GiB = 70.4 values a
    # token x width (an RMSNorm's float32 copies), 24.2 beside the NF4 dequantize: the table's default read it 47 % low
    infer_factors = (70.5, 24.2)

    @staticmethod
    def activation_geometry(config: dict, size: tuple[int, int], text_tokens: int, frames: int = 1) -> tuple[int, int, int]:
        """One sequence: the caption window (an upper bound: training cuts it to the batch's longest caption) and
        the image's 2x2 patches of /8 latents, through every block."""
        w, h = size
        return ((h // 16) * (w // 16) + text_tokens, config["num_attention_heads"] * config["attention_head_dim"],
                config["num_layers"])

    @staticmethod
    def bench_batch(config: dict, size: tuple[int, int], frames: int, text_len: int):
        w, h = size
        return torch.zeros(1, config["in_channels"], h // 16, w // 16, dtype=torch.bfloat16), {
            "prompt_embeds": torch.zeros(1, text_len, config["llm_features_dim"], dtype=torch.bfloat16),
            "attention_mask": torch.ones(1, text_len, dtype=torch.int64)}

    def sample_denoisers(self):
        return ("transformer", "unconditional_transformer")  # both run at every step

    @classmethod
    def reference_pipeline(cls, base, text_tokens):
        return cls.pipeline_cls.from_pretrained(base, **_SAFE)  # guidance_scale alone, as bench/learns.py calls it

    # -- latents ---------------------------------------------------------------------------------
    def load_vae(self):
        return diffusers.AutoencoderKLFlux2.from_pretrained(self.model_dir, subfolder="vae", dtype=self.dtype,
                                                            **_SAFE).to(self.device).eval()

    @no_grad
    def encode_latents(self, vae, pixels):
        z = vae.encode(pixels.to(vae.device, vae.dtype, non_blocking=True)).latent_dist.mode()
        b, c, h, w = z.shape
        z = z.view(b, c, h // 2, 2, w // 2, 2).permute(0, 3, 5, 1, 2, 4).reshape(b, 4 * c, h // 2, w // 2)
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(z.device, z.dtype)
        std = torch.sqrt(vae.bn.running_var + vae.config.batch_norm_eps).view(1, -1, 1, 1).to(z.device, z.dtype)
        return (z - mean) / std

    # -- text ------------------------------------------------------------------------------------
    def load_text_encoders(self):
        # the text encoder streamed, stored as text.quantize says and placed (pretrained_text_encoder)
        return self.pipeline_cls.from_pretrained(self.model_dir, dtype=self.dtype, transformer=None,
                                                 unconditional_transformer=None, vae=None,
                                                 **self.text_encoder_parts(), **_SAFE)

    @no_grad
    def encode_text(self, pipe, texts):
        from diffusers.models.transformers.transformer_ideogram4 import LLM_TOKEN_INDICATOR

        from tasks.config import ConfigError

        try:
            feats, _, _, indicator = pipe.encode_prompt(texts, 0, 0, self.max_sequence_length, self.device)
        except ValueError as e:  # a caption longer than the window: the pipeline refuses it
            raise ConfigError(f"{e} (chat template included): raise model.max_sequence_length (at most "
                              f"{self.max_text_tokens}) or shorten the caption") from e
        mask = (indicator == LLM_TOKEN_INDICATOR).to(torch.int64).cpu()
        feats = feats.to(self.dtype).cpu()  # computed in the encoder's dtype: exact
        return [{"prompt_embeds": feats[i], "attention_mask": mask[i]} for i in range(len(texts))]

    # -- training --------------------------------------------------------------------------------
    def load_denoiser(self):
        return self.pretrained_denoiser(self.denoiser_cls, "transformer")

    def training_loss(self, transformer, latents, text, train_cfg, scheduler, generators):
        b, c, gh, gw = latents.shape
        noisy, noise, timesteps, sigmas = noise_latents(latents, train_cfg, scheduler, generators)
        mask = text["attention_mask"].to(latents.device)
        from torch._subclasses.fake_tensor import is_fake

        # left-padded: every caption is in the window's last k tokens (bench.memory's fake tensors have no values:
        # the whole window, which its all-ones mask gives)
        k = mask.shape[1] if is_fake(mask) else max(int(mask.sum(dim=1).max()), 1)
        feats = text["prompt_embeds"][:, -k:].to(latents.device, latents.dtype)
        ids = packed_ids(mask[:, -k:], gh, gw)
        tokens = noisy.permute(0, 2, 3, 1).reshape(b, gh * gw, c)
        hidden = torch.cat([tokens.new_zeros(b, k, c), tokens], dim=1)
        cond = torch.cat([feats, feats.new_zeros(b, gh * gw, feats.shape[-1])], dim=1)
        t = (1000 - timesteps.to(latents.dtype)) / 1000  # the pipeline's model time: 1 - sigma
        out = transformer(hidden_states=hidden, timestep=t, encoder_hidden_states=cond, position_ids=ids[0],
                          segment_ids=ids[1], indicator=ids[2], return_dict=False)[0][:, k:]
        pred = -out.reshape(b, gh, gw, c).permute(0, 3, 1, 2)  # the pipeline steps with -v: noise - x0
        return weighted_loss(pred, noise - latents, sigmas, train_cfg)

    # -- sampling --------------------------------------------------------------------------------
    @no_grad
    def sample(self, pipe, prompt, negative, empty, width, height, steps, guidance, true_cfg, seed, generator_device="cpu"):
        # `guidance` is the pipeline's guidance_scale (v = g pos + (1 - g) uncond, at every step); `true_cfg` is
        # unused; the unconditional transformer reads no text, so neither `negative` nor `empty` is used
        if negative is not None:
            log.warning("Ideogram 4 samples without a negative prompt (its unconditional model reads no text); "
                        "--n is ignored")
        generator = self.make_generator(pipe, seed, generator_device)
        return pipe(prompt=[prompt], width=width, height=height, num_inference_steps=steps, guidance_scale=guidance,
                    max_sequence_length=int(prompt["attention_mask"].shape[0]), generator=generator,
                    output_type="pil").images[0]
