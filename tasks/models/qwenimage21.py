"""Qwen-Image 2.1: a single-stream block-causal DiT (QwenImage21Transformer2DModel: the caption's tokens, then the
target image's latents unpatched, one joint sequence; causal over the text, bidirectional inside an image; the text
modulated at t = 0) on AutoencoderKLQwenImage21's latents (/16, 64 channels, RGBA pixels, per-channel
latents_mean/std), text from Qwen3-VL (the last decoder layer's hidden states before its final norm, of the caption
in the pipeline's raw template, the system turn dropped), flow matching. Text-to-image only here (the pipeline's
condition images are not trained).

What follows which reference (diffusers 0.42.1, pipelines/qwenimage21/pipeline_qwenimage21.py):
- Latents: `_encode_vae_image`: the mode of an RGBA frame ([B, 4, 1, H, W]; training pixels get an opaque alpha,
  as `image_processor.preprocess` gives an RGBA image without transparency) normalised by latents_mean/std, which
  `__call__` undoes before `vae.decode`. Sides multiples of 32 (`multiple_of = vae_scale_factor * 2`).
- Text: the pipeline's own `encode_prompt`, one caption at a time (its padding side would make a caption's bytes
  depend on its batch), cached padded to model.max_sequence_length with its mask; the pipeline cuts nothing, so a
  longer caption is refused.
- Training as `__call__` feeds the transformer: the packed latents (`_pack_latents`: a flatten, no 2x2 patches),
  `timestep / 1000`, the caption cut back to its own tokens and no mask (what the pipeline passes for one prompt:
  the target's RoPE frame index follows the caption's real length), `img_mask` = the caption's (no image tokens)
  plus one slot per 2x2 target latents; one forward per item (the transformer reads one layout for the whole
  batch, musubi-tuner's trainer builds each sample's own); target noise - latents (FlowMatchEulerDiscreteScheduler).
- Samples: the pipeline from cached text (prompt_embeds, the mask dropped as for a prompt string), its KV cache
  as it defaults; RGB (the VAE decodes RGBA; alpha dropped).

LoRA names: musubi-tuner's networks.lora_qwen_image_21 (every Linear of QwenImage21TransformerBlock, diffusers'
names) is the kohya file; ComfyUI's Qwen-Image 2.1 model (as Comfy-Org's released file) fuses the MLP's gate_layer
and proj into one `img_mlp.gate_up` (gate rows first, as diffusers' convert_qwen_image21_transformer_checkpoint_to_
diffusers splits it): its file apart (`comfyui_rules`); that single file is also read as model.path (from_single_file).
Sources: tests/test_qwenimage21.py. Untested with the real weights here."""
from __future__ import annotations

import functools

from tasks.lazy import LazyClass, lazy, no_grad
from tasks.models.bases.adapter import BLOCK, KohyaLayout, on_pipeline_device
from tasks.models.bases.flow_matching import TransformerAdapter, noise_latents, weighted_loss
from tasks.models.bases.real_size import RealSize

torch = lazy("torch")
diffusers = lazy("diffusers")
transformers = lazy("transformers")

_SAFE = dict(use_safetensors=True)

# Qwen3-VL-8B (Qwen/Qwen3-VL-8B-Instruct's config.json): context_in_dim 4096 is its width
QWEN3_VL_8B = ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration", dict(
    text_config=dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=262144,
                     rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=False, bos_token_id=151643,
                     eos_token_id=151645, rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                                                           "mrope_section": [24, 20, 20], "mrope_interleaved": True}),
    vision_config=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=4096,
                       patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                       deepstack_visual_indexes=[8, 16, 24], hidden_act="gelu_pytorch_tanh"),
    image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653,
    tie_word_embeddings=False))

# ComfyUI's model names (see the module docstring): diffusers' but for the fused MLP input
COMFYUI_RULES = tuple((BLOCK + pattern, name, size) for pattern, name, size in (
    (r"attn\.to_q", "transformer_blocks_{}_attn_to_q", 1), (r"attn\.to_k", "transformer_blocks_{}_attn_to_k", 1),
    (r"attn\.to_v", "transformer_blocks_{}_attn_to_v", 1), (r"attn\.to_out\.0", "transformer_blocks_{}_attn_to_out_0", 1),
    (r"img_mlp\.(gate_layer|proj)", "transformer_blocks_{}_img_mlp_gate_up", 2),
    (r"img_mlp\.out", "transformer_blocks_{}_img_mlp_out", 1)))


def _text_processor_cls():
    from tasks.models.tiny.qwen3vl_text_processor import text_processor_cls

    return text_processor_cls()


def __getattr__(name):  # the class is made when first used: a no-op run imports no transformers
    if name == "TextProcessor":
        return _text_processor_cls()
    raise AttributeError(name)


def text_processor(model_dir):
    """The processor of a Qwen-Image 2.1 folder (processor/: the tokenizer and its chat template)."""
    from pathlib import Path

    folder = Path(model_dir) / "processor"
    template = folder / "chat_template.jinja"
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    return _text_processor_cls()(tokenizer, template.read_text() if template.is_file() else None)


def known_layout_forward(transformer, hidden_states, encoder_hidden_states, timestep, height: int, width: int):
    """QwenImage21Transformer2DModel.forward for one text-only prompt (all its tokens valid, then the target image),
    its layout written from the known sizes instead of read from the image mask's values (`nonzero`, `.tolist()`),
    which bench.memory's fake tensors (shapes, no values) do not have; their RoPE table is an empty one of its shape.
    tests/test_qwenimage21.py holds it equal to the forward on real tensors."""
    t, n, hw = transformer, encoder_hidden_states.shape[1], height * width
    hidden = t.img_in(hidden_states)
    joint = torch.cat([t.txt_in(encoder_hidden_states), hidden], dim=1)  # the text slots, then the target's tokens
    target = torch.cat([torch.zeros(n, dtype=torch.bool), torch.ones(hw, dtype=torch.bool)]).to(hidden.device)
    if isinstance(hidden, torch._subclasses.fake_tensor.FakeTensor):
        rotary = torch.empty(n + hw, sum(t.pos_embed.axes_dim) // 2, dtype=torch.complex64, device=hidden.device)
    else:
        rotary = t.pos_embed([(1, height, width)], target, device=hidden.device)
    timestep = timestep.to(hidden.dtype)
    mask = None
    if t.config.causal_condition:  # the text modulated at t = 0
        timestep, mask = torch.cat([timestep, timestep.new_zeros(1)]), target
    temb = t.time_text_embed(timestep, hidden)
    modulation = t.modulation(temb)
    for block in t.transformer_blocks:  # QwenImage21AttnProcessor's segments: the caption, causal
        args = (joint, modulation, rotary, None, mask, None, None, None, [(0, n, True)], None)
        joint = (t._gradient_checkpointing_func(block, *args) if torch.is_grad_enabled() and t.gradient_checkpointing
                 else block(*args))
    return t.proj_out(t.norm_out(joint, temb, mask))


class QwenImage21Adapter(TransformerAdapter):
    family = "qwenimage21"
    # kohya: musubi-tuner's names; ComfyUI's (COMFYUI_RULES), and its LyCORIS file: its generic `lora_unet_<key>`
    kohya = KohyaLayout("networks.lora_qwen_image_21", "qwen_image_21", names="named", comfyui_rules=COMFYUI_RULES,
                        lycoris_names="comfyui")
    # diffusers' Qwen-Image kohya converter splits `gate_layer` into `gate.layer`: the kohya file is merged
    reference_kohya = "merge"
    swap_blocks = ("transformer_blocks",)  # train.blocks_to_swap
    max_text_tokens = 1024  # the pipeline has no limit; a window this long is ~2 x the preset's
    size_multiple = 32  # VAE /16, one text-encoder image slot per 2x2 latents (the pipeline's multiple_of)
    pipeline_cls = LazyClass("diffusers", "QwenImage21Pipeline")
    denoiser_cls = LazyClass("diffusers", "QwenImage21Transformer2DModel")
    denoiser_subfolder = "transformer"
    text_components = ("processor", "text_encoder")
    # every Linear of QwenImage21TransformerBlock: what musubi-tuner's networks.lora_qwen_image_21 wraps
    LORA_TARGETS = r"transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v|to_out\.0)|img_mlp\.(proj|gate_layer|out))"
    # Qwen/Qwen-Image-2.1: the class defaults are its config (32 blocks of 4096, SwiGLU 3x, context 4096), 7.1 B
    # parameters (13.3 GiB in bf16), Qwen3-VL-8B beside it. Rows (bench.memory --families, 1024 px, 512 tokens, rank
    # 16; measured / peak GiB): bf16+ckpt 16.2 / 16.7 (24 GB cards), fp8+ckpt 9.6 / 10.0 (12-16 GB), nf4+ckpt 6.4 /
    # 7.1. Measured through known_layout_forward (its fake tensors have no mask values to read). Not a row:
    # nf4+ckpt+offload+swap8 (4.6 / 5.3, preflight 4.9; its host preflight 1.96 GiB for the measured 2.04 of the
    # swapped NF4 blocks, outside the rows' 1 %)
    real_sizes = (RealSize("qwenimage21", "QwenImage21Transformer2DModel", text=(("text_encoder", QWEN3_VL_8B),),
                           vae=("AutoencoderKLQwenImage21", {}), card=(12, 32),
                           rows=("bf16+ckpt", "fp8+ckpt", "nf4+ckpt")),)

    @classmethod
    def reference_pipeline(cls, base, text_tokens):
        # its __init__ reads the processor, which transformers builds only with torchvision: passed in
        return cls.pipeline_cls.from_pretrained(base, processor=text_processor(base), **_SAFE)

    @property
    def sample_parts(self):
        return dict(text_encoder=None, processor=text_processor(self.model_dir), **_SAFE)

    @staticmethod
    def activation_geometry(config: dict, size: tuple[int, int], text_tokens: int, frames: int = 1) -> tuple[int, int, int]:
        """One sequence: the caption's tokens, then the target's latents (/16, no patches), in every block."""
        w, h = size
        p = config.get("patch_size", 1)
        return ((h // (16 * p)) * (w // (16 * p)) + text_tokens,
                config["num_attention_heads"] * config["attention_head_dim"], config["num_layers"])

    @staticmethod
    def bench_batch(config: dict, size: tuple[int, int], frames: int, text_len: int):
        w, h = size
        z = dict(dtype=torch.bfloat16)
        return torch.zeros(1, config["in_channels"], h // 16, w // 16, **z), {
            "prompt_embeds": torch.zeros(1, text_len, config["context_in_dim"], **z),
            "attention_mask": torch.ones(1, text_len, dtype=torch.int64)}

    # -- latents ---------------------------------------------------------------------------------
    def load_vae(self):
        return diffusers.AutoencoderKLQwenImage21.from_pretrained(self.model_dir, subfolder="vae", dtype=self.dtype,
                                                                  **_SAFE).to(self.device).eval()

    @no_grad
    def encode_latents(self, vae, pixels):
        pixels = pixels.to(vae.device, vae.dtype, non_blocking=True)
        if vae.config.in_channels == 4 and pixels.shape[1] == 3:  # RGBA: opaque
            pixels = torch.cat([pixels, torch.ones_like(pixels[:, :1])], dim=1)
        z = vae.encode(pixels[:, :, None]).latent_dist.mode()
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(z.device, z.dtype)
        std = torch.tensor(vae.config.latents_std).view(shape).to(z.device, z.dtype)
        return ((z - mean) / std)[:, :, 0]

    # -- text ------------------------------------------------------------------------------------
    def load_text_encoders(self):
        return self.pipeline_cls.from_pretrained(self.model_dir, dtype=self.dtype, transformer=None, vae=None,
                                                 processor=text_processor(self.model_dir),
                                                 **self.text_encoder_parts(), **_SAFE).to(self.device)

    @no_grad
    def encode_text(self, pipe, texts):
        out = []
        for text in texts:
            embeds, _, image_pad = pipe.encode_prompt([text], device=self.device)
            n = embeds.shape[1]
            if n > self.max_sequence_length:
                from tasks.config import ConfigError
                raise ConfigError(f"model.max_sequence_length={self.max_sequence_length}: the text {text[:40]!r} is "
                                  f"{n} tokens (template included); QwenImage21Pipeline cuts nothing: set "
                                  f"model.max_sequence_length={n} or more")
            assert not image_pad.any()  # text only
            pad = self.max_sequence_length - n
            out.append({"prompt_embeds": torch.nn.functional.pad(embeds[0], (0, 0, 0, pad)).cpu(),
                        "attention_mask": torch.nn.functional.pad(torch.ones(n, dtype=torch.int64), (0, pad))})
        return out

    # -- training --------------------------------------------------------------------------------
    def load_denoiser(self):
        return self.pretrained_denoiser(self.denoiser_cls, "transformer")

    def predict(self, transformer, noisy, timesteps, embeds, mask):
        """The transformer's velocity for each item as QwenImage21Pipeline.__call__ asks it for one prompt."""
        b, c, h, w = noisy.shape
        fake = isinstance(noisy, torch._subclasses.fake_tensor.FakeTensor)  # bench.memory: all-ones masks
        preds = []
        for i in range(b):
            packed, t = noisy[i:i + 1].reshape(1, c, h * w).transpose(1, 2), timesteps[i:i + 1] / 1000
            if fake:
                pred = known_layout_forward(transformer, packed, embeds[i:i + 1], t, h, w)
                preds.append(pred[:, -h * w:].transpose(1, 2).reshape(1, c, h, w))
                continue
            n = int(mask[i].sum())
            img_mask = torch.cat([torch.zeros(1, n, dtype=torch.bool), torch.ones(1, h * w // 4, dtype=torch.bool)], 1)
            pred = transformer(hidden_states=packed, timestep=t, encoder_hidden_states=embeds[i:i + 1, :n],
                               img_shapes=[[(1, h, w)]], img_mask=img_mask.to(noisy.device), return_dict=False)[0]
            preds.append(pred[:, -h * w:].transpose(1, 2).reshape(1, c, h, w))
        return torch.cat(preds)

    def training_loss(self, transformer, latents, text, train_cfg, scheduler, generators):
        noisy, noise, timesteps, sigmas = noise_latents(latents, train_cfg, scheduler, generators)
        pred = self.predict(transformer, noisy, timesteps.to(latents.dtype), text["prompt_embeds"].to(latents.dtype),
                            text["attention_mask"])
        return weighted_loss(pred, noise - latents, sigmas, train_cfg)  # velocity target

    # -- sampling --------------------------------------------------------------------------------
    def embeds(self, d: dict, name: str) -> dict:
        """A cached text as the pipeline's `<name>_embeds(_mask)`, cut to its own tokens, mask all ones (dropped)."""
        n = int(d["attention_mask"].sum())
        return {f"{name}_embeds": d["prompt_embeds"][None, :n].to(self.dtype),
                f"{name}_embeds_mask": torch.ones(1, n, dtype=torch.int64, device=d["prompt_embeds"].device)}

    @no_grad
    def sample(self, pipe, prompt, negative, empty, width, height, steps, guidance, true_cfg, seed, generator_device="cpu"):
        # True CFG at `true_cfg` (the pipeline's true_cfg_scale, on when > 1; Qwen-Image 2.1 is sampled without)
        # against the prompt's negative, else the cached empty prompt; `guidance` is unused (no distilled guidance)
        kwargs = self.embeds(on_pipeline_device(pipe, prompt), "prompt")
        if true_cfg > 1:
            kwargs.update(self.embeds(on_pipeline_device(pipe, negative if negative is not None else empty),
                                      "negative_prompt"))
        generator = self.make_generator(pipe, seed, generator_device)
        image = pipe(**kwargs, true_cfg_scale=true_cfg, width=width, height=height, num_inference_steps=steps,
                     generator=generator, output_type="pil").images[0]
        return image.convert("RGB")
