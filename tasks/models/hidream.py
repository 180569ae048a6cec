"""HiDream-I1 (HiDream-ai): a 17 B sparse DiT of 16 double-stream and 32 single-stream blocks, each feed-forward a
mixture of experts (a softmax gate over 4 routed SwiGLU experts, 2 active per token, plus a shared expert), on FLUX.1's
VAE latents (/8, 16 channels, 2x2 patches made by the transformer itself), text from four encoders: the pooled
outputs of CLIP-L and CLIP-G (the modulation, with the timestep), T5-XXL's states and the hidden states of EVERY layer
of Llama 3.1 8B Instruct (block i reads layer llama_layers[i]), flow matching with real CFG.

What follows which reference (diffusers 0.42.1, pipelines/hidream_image/pipeline_hidream_image.py):
- Latents: FLUX.1's (the mode, `(z - shift_factor) * scaling_factor`, the inverse of what `__call__` does before
  vae.decode), unpacked [B, C, h, w]: the transformer patchifies (a non-square image padded to max_seq patches).
- Text: encode_prompt's three tensors per caption, byte for byte: the pooled CLIP-L | CLIP-G vector (each padded to
  min(max_sequence_length, 218), no mask), T5's states (run with its mask) and the stack of Llama's hidden states
  after each layer (`hidden_states[1:]`, run with its mask, output_attentions as the pipeline asks), padding kept.
  At the real size one caption at 128 tokens holds 32 x 128 x 4096 Llama values (32 MiB in bf16), T5's 128 x 4096
  (1 MiB) and 2048 pooled values.
- Training: the pipeline's timestep is the scheduler's t (sigma x 1000) and its velocity is the NEGATED output
  (`noise_pred = -noise_pred`), so the prediction -out is held to noise - latents. In train mode the transformer
  returns [B, C, patches, p*p] (its training unpatchify): folded back to [B, C, h, w] here; the MoE runs its
  differentiable branch in either mode (its eval branch, moe_infer, is no_grad). Sigmas are drawn as ai-toolkit's HiDream trainer draws them
  (FlowMatchEulerDiscreteScheduler, shift 3.0), whatever sampler the folder names.
- Sampling: the pipeline from cached text (no text encoder loaded), CFG at `guidance` (> 1) against the prompt's
  negative, else the cached empty prompt (what the pipeline encodes for no negative). The pipeline rescales every
  request to default_sample_size^2 (1 MP): the asked area is set as that size, so it renders the asked size.
- LoRA targets: ai-toolkit's (extensions_built_in/diffusion_models/hidream/hidream_model.py: every Linear of the two
  block lists, the routed and shared experts included; the gate is a Parameter, not a Linear).
- Files: diffusers' HiDreamImageLoraLoaderMixin reads `transformer.<module>` files and ai-toolkit's / ComfyUI's
  `diffusion_model.<module>`, not kohya names; ComfyUI's HiDream model has diffusers' module names
  (comfy/ldm/hidream/model.py), so the kohya file's `lora_unet_<module, "." -> "_">` is the ComfyUI file (its generic
  rule) and `lycoris_<module>` its LyCORIS file (tests/test_hidream.py cites the lines).

Untested with the real weights here."""
from __future__ import annotations

import logging
import math

from tasks.lazy import LazyClass, lazy, no_grad
from tasks.models.bases.adapter import KohyaLayout, on_pipeline_device
from tasks.models.bases.flow_matching import TransformerAdapter, noise_latents, weighted_loss
from tasks.models.bases.real_size import RealSize
from tasks.models.flux import FLUX1_VAE

torch = lazy("torch")
diffusers = lazy("diffusers")
transformers = lazy("transformers")

log = logging.getLogger("loraflow")
_SAFE = dict(use_safetensors=True)
_TEXT = ("tokenizer", "text_encoder", "tokenizer_2", "text_encoder_2", "tokenizer_3", "text_encoder_3",
         "tokenizer_4", "text_encoder_4")
_WARNED: set[str] = set()

# HiDream-I1-Full/transformer/config.json (diffusers' scripts/convert_hidream_to_diffusers.py writes it): the values
# that differ from HiDreamImageTransformer2DModel's defaults
HIDREAM_I1 = dict(patch_size=2, in_channels=16, out_channels=16, axes_dims_rope=(64, 32, 32),
                  caption_channels=[4096, 4096], llama_layers=list(range(32)) + [31] * 16)
# Its long-context CLIPs (248 positions: the pipeline pads them to 218 tokens), as (config, model, values)
_CLIP = dict(vocab_size=49408, max_position_embeddings=248, layer_norm_eps=1e-5, bos_token_id=0, eos_token_id=2,
             pad_token_id=1)
CLIP_L = ("CLIPTextConfig", "CLIPTextModelWithProjection", dict(
    _CLIP, hidden_size=768, intermediate_size=3072, projection_dim=768, num_hidden_layers=12, num_attention_heads=12,
    hidden_act="quick_gelu"))
CLIP_G = ("CLIPTextConfig", "CLIPTextModelWithProjection", dict(
    _CLIP, hidden_size=1280, intermediate_size=5120, projection_dim=1280, num_hidden_layers=32,
    num_attention_heads=20, hidden_act="gelu"))
LLAMA_31_8B = ("LlamaConfig", "LlamaForCausalLM", dict(  # meta-llama/Meta-Llama-3.1-8B-Instruct's config.json
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
    tie_word_embeddings=False, hidden_act="silu"))


def _balanced_moe(self, x):
    """MOEFeedForwardSwiGLU's training branch with each routed expert taking an equal share of the token copies (the
    balance its gate's auxiliary loss aims for) instead of the gate's choice, which is data-dependent (boolean-mask
    indexing): under FakeTensorMode (bench.memory: shapes, no values) the same shapes and saved bytes as a balanced
    routing. The gate still runs and weighs the copies."""
    dtype, identity, shape = x.dtype, x, x.shape
    _, weight, _ = self.gate(x)
    x = x.view(-1, x.shape[-1]).repeat_interleave(self.num_activated_experts, dim=0)
    y = torch.cat([expert(part).to(dtype) for expert, part in zip(self.experts, x.chunk(len(self.experts)))])
    y = (y.view(*weight.shape, -1) * weight.unsqueeze(-1)).sum(dim=1)
    return y.view(*shape).to(dtype) + self.shared_experts(identity)


class _TextEncoders:
    def __init__(self, **parts):
        self.__dict__.update(parts)


class HiDreamAdapter(TransformerAdapter):
    family = "hidream"
    swap_blocks = ("double_stream_blocks", "single_stream_blocks")  # train.blocks_to_swap, in run order
    # lora_unet_<diffusers module>: ComfyUI's generic rule (its model has diffusers' names); ai-toolkit's base version
    kohya = KohyaLayout("networks.lora", "hidream_i1", names="named")
    reference_kohya = "merge"  # diffusers' HiDream loader reads `diffusion_model.` / `transformer.` keys, not kohya's
    original_layout = "diffusers"  # the released single files hold diffusers' names (from_single_file strips a prefix)
    pipeline_cls = LazyClass("diffusers", "HiDreamImagePipeline")
    denoiser_cls = LazyClass("diffusers", "HiDreamImageTransformer2DModel")
    denoiser_subfolder = "transformer"
    text_components = _TEXT
    sample_parts = dict(**{k: None for k in _TEXT}, **_SAFE)
    LORA_TARGETS = (r"(double_stream_blocks|single_stream_blocks)\.\d+\.block\.(adaLN_modulation\.1"
                    r"|attn1\.to_(q|k|v|out)(_t)?|ff_[it]\.(w[123]|shared_experts\.w[123]|experts\.\d+\.w[123]))")

    # HiDream-I1-Full (diffusers layout at HiDream-ai/HiDream-I1-Full; Llama from meta-llama/Meta-Llama-3.1-8B-Instruct,
    # which the preset names as text_encoder_4 through its own folder): 17 B transformer, four text encoders, FLUX.1's
    # VAE. Rows: the card table's picks at 1024 px, 512 tokens (bench.memory --families, 2026-11-29; peak / preflight
    # GiB): bf16+ckpt 36.6 / 36.3 (48 GB cards), fp8+ckpt (24 GB), nf4+ckpt 13.0 / 12.8 (16 GB),
    # nf4+ckpt+offload+swap10 (12 GB; swap24 measured 8.6 / 8.1, 5.1 GiB on the host). The whole run fits 12 GB
    # with 5.0 GB of host RAM (cache_text: the four encoders in NF4, 8.3 GiB, Llama's head dropped). Under
    # bench.memory's fake tensors (no values) the MoE runs balanced and the output unpatchifies as in training, in
    # the train and the sample rows alike (training_loss)
    real_sizes = (RealSize(
        name="hidream_i1_full", denoiser="HiDreamImageTransformer2DModel", arch=HIDREAM_I1,
        text=(("text_encoder", CLIP_L), ("text_encoder_2", CLIP_G), ("text_encoder_3", "t5_xxl"),
              ("text_encoder_4", LLAMA_31_8B)),
        vae=("AutoencoderKL", FLUX1_VAE),
        rows=("bf16+ckpt", "fp8+ckpt", "nf4+ckpt", "nf4+ckpt+offload+swap10"), card=(12, 32)),)

    # train.gradient_checkpointing_offload: each block's inputs (one token x width value a token: the image and the
    # caption windows) and the RoPE table every block takes (64 x 2 x 2 fp32 a token: 0.2 of a bf16 token x 2560), a
    # host copy each; measured 0.258 GiB above 1.0 at 1024 px, 512 tokens, 48 blocks (bench.memory --families)
    activation_extras = {"offloaded": 1.2}

    @staticmethod
    def activation_geometry(config: dict, size: tuple[int, int], text_tokens: int, frames: int = 1):
        """Every block attends over the image's 2x2 patches and three caption windows (T5, the last Llama layer
        carried through the double blocks, and the block's own Llama layer)."""
        w, h = size
        patch = config.get("patch_size") or 2
        tokens = (h // (8 * patch)) * (w // (8 * patch)) + 3 * text_tokens
        return tokens, config["num_attention_heads"] * config["attention_head_dim"], \
            config["num_layers"] + config["num_single_layers"]

    @staticmethod
    def bench_batch(config: dict, size: tuple[int, int], frames: int, text_len: int):
        w, h = size
        z = lambda *s: torch.zeros(*s, dtype=torch.bfloat16)  # noqa: E731
        t5, llama = config["caption_channels"]
        layers = max(config["llama_layers"]) + 1
        return z(1, config["in_channels"], h // 8, w // 8), {
            "pooled_prompt_embeds": z(1, config["text_emb_dim"]), "prompt_embeds_t5": z(1, text_len, t5),
            "prompt_embeds_llama3": z(1, layers, text_len, llama)}

    # -- latents ---------------------------------------------------------------------------------
    def load_vae(self):
        return diffusers.AutoencoderKL.from_pretrained(self.model_dir, subfolder="vae", dtype=self.dtype,
                                                       **_SAFE).to(self.device).eval()

    @no_grad
    def encode_latents(self, vae, pixels):
        z = vae.encode(pixels.to(vae.device, vae.dtype, non_blocking=True)).latent_dist.mode()
        return (z - vae.config.shift_factor) * vae.config.scaling_factor

    # -- text ------------------------------------------------------------------------------------
    def load_text_encoders(self):
        import json

        index = json.loads((self.model_dir / "model_index.json").read_text())  # the classes the pipeline loads
        return _TextEncoders(**{t: getattr(transformers, index[t][1]).from_pretrained(self.model_dir, subfolder=t)
                                for t in _TEXT if t.startswith("tokenizer")}, **self.text_encoder_parts())

    @no_grad
    def encode_text(self, enc, texts):
        # HiDreamImagePipeline.encode_prompt's computation (a test holds the bytes equal)
        L, dev = self.max_sequence_length, self.device

        def pooled(tokenizer, encoder):  # _get_clip_prompt_embeds: the projected pooled output, no mask
            ids = tokenizer(texts, padding="max_length", max_length=min(L, 218), truncation=True,
                            return_tensors="pt").input_ids
            return encoder(ids.to(dev), output_hidden_states=True)[0].to(encoder.dtype)

        pool = torch.cat([pooled(enc.tokenizer, enc.text_encoder), pooled(enc.tokenizer_2, enc.text_encoder_2)], -1)
        t5 = enc.tokenizer_3(texts, padding="max_length", max_length=min(L, enc.tokenizer_3.model_max_length),
                             truncation=True, add_special_tokens=True, return_tensors="pt")
        t5_embeds = enc.text_encoder_3(t5.input_ids.to(dev), attention_mask=t5.attention_mask.to(dev))[0]
        t5_embeds = t5_embeds.to(enc.text_encoder_3.dtype)
        tok4 = enc.tokenizer_4
        tok4.pad_token = tok4.eos_token  # as the pipeline's __init__ sets it
        ll = tok4(texts, padding="max_length", max_length=min(L, tok4.model_max_length), truncation=True,
                  add_special_tokens=True, return_tensors="pt")
        out = enc.text_encoder_4(ll.input_ids.to(dev), attention_mask=ll.attention_mask.to(dev),
                                 output_hidden_states=True, output_attentions=True)
        llama = torch.stack(out.hidden_states[1:], dim=1)  # [B, layers, L, D]: the pipeline's stack, batch first
        for text, m in zip(texts, ll.attention_mask):
            if m.all() and text not in _WARNED:  # a full window: maybe cut
                _WARNED.add(text)
                log.warning("text may be truncated at model.max_sequence_length=%d tokens: %.80r", L, text)
        pool, t5_embeds, llama = pool.cpu(), t5_embeds.cpu(), llama.cpu()
        return [{"pooled_prompt_embeds": pool[i], "prompt_embeds_t5": t5_embeds[i], "prompt_embeds_llama3": llama[i]}
                for i in range(len(texts))]

    @staticmethod
    def pipeline_text(text: dict, dtype) -> dict:
        """Cached (batched) tensors -> the transformer's keyword arguments (Llama's stack layers-first)."""
        return dict(pooled_embeds=text["pooled_prompt_embeds"].to(dtype),
                    encoder_hidden_states_t5=text["prompt_embeds_t5"].to(dtype),
                    encoder_hidden_states_llama3=text["prompt_embeds_llama3"].to(dtype).transpose(0, 1))

    # -- training --------------------------------------------------------------------------------
    def load_denoiser(self):
        return self.pretrained_denoiser(diffusers.HiDreamImageTransformer2DModel, "transformer")

    def load_train_scheduler(self):
        # ai-toolkit's HiDream scheduler_config (the released Full folder names a UniPC sampler)
        return diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)

    def training_loss(self, transformer, latents, text, train_cfg, scheduler, generators):
        b, c, h, w = latents.shape
        noisy, noise, timesteps, sigmas = noise_latents(latents, train_cfg, scheduler, generators)
        kw = self.pipeline_text({k: v.to(latents.device) for k, v in text.items()}, latents.dtype)
        # the MoE's differentiable branch whatever the mode: its eval branch (moe_infer) is no_grad, so an eval-mode
        # denoiser (the stored-base checks, a caller's) would pass no gradient through the routed experts
        moe = [m for m in transformer.modules() if type(m).__name__ == "MOEFeedForwardSwiGLU"]
        fake = isinstance(latents, torch._subclasses.fake_tensor.FakeTensor)
        # under bench.memory's fake tensors (shapes, no values) the transformer unpatchifies as in training too: its
        # eval branch slices by the image-size tensor's values (the same output bytes either way)
        flagged = moe + [transformer] if fake else moe
        modes = [m.training for m in flagged]
        for m in flagged:
            m.training = True
        if fake:  # routing by value cannot run there; kept for the checkpointed blocks' recompute in backward
            for m in moe:
                m.forward = _balanced_moe.__get__(m)
        try:
            out = transformer(hidden_states=noisy, timesteps=timesteps, return_dict=False, **kw)[0]
        finally:
            for m, mode in zip(flagged, modes):
                m.training = mode
        if out.shape != latents.shape:  # train mode: [B, C, max_seq, p*p], row-major patches (padded if not square)
            p = transformer.config.patch_size
            out = out[:, :, : (h // p) * (w // p)].reshape(b, c, h // p, w // p, p, p)
            out = out.permute(0, 1, 2, 4, 3, 5).reshape(b, c, h, w)
        return weighted_loss(-out, noise - latents, sigmas, train_cfg)  # the pipeline negates the output

    # -- sampling --------------------------------------------------------------------------------
    @staticmethod
    def render_area(pipe, width: int, height: int) -> None:
        """The pipeline scales every request to the area (default_sample_size * vae_scale_factor)^2: set that area to
        the asked one (rounded up by the least step, so the floor to 16 px keeps the asked sides)."""
        side = math.sqrt(width * height) / pipe.vae_scale_factor
        while (side * pipe.vae_scale_factor) ** 2 < width * height:
            side = math.nextafter(side, math.inf)
        pipe.default_sample_size = side

    @classmethod
    def reference_pipeline(cls, base, text_tokens: int):
        """HiDreamImagePipeline as loaded from the folder, rendering the asked size (render_area) instead of 1 MP:
        the learning check renders at the training size."""
        import functools

        base_call = diffusers.HiDreamImagePipeline.__call__

        class HiDreamImagePipeline(diffusers.HiDreamImagePipeline):  # its name, which the learning check reads
            @functools.wraps(base_call)  # its signature, which callers inspect
            def __call__(self, *args, width=None, height=None, **kwargs):
                if width and height:
                    cls.render_area(self, width, height)
                return base_call(self, *args, width=width, height=height, **kwargs)

        return HiDreamImagePipeline.from_pretrained(base, use_safetensors=True)

    @no_grad
    def sample(self, pipe, prompt, negative, empty, width, height, steps, guidance, true_cfg, seed, generator_device="cpu"):
        # Real CFG at `guidance` > 1 (the pipeline's do_classifier_free_guidance); `true_cfg` is unused
        def embeds(d, prefix):
            d = on_pipeline_device(pipe, d)
            return {f"{prefix}pooled_prompt_embeds": d["pooled_prompt_embeds"][None].to(self.dtype),
                    f"{prefix}prompt_embeds_t5": d["prompt_embeds_t5"][None].to(self.dtype),
                    f"{prefix}prompt_embeds_llama3": d["prompt_embeds_llama3"][:, None].to(self.dtype)}

        kwargs = embeds(prompt, "")
        if guidance > 1:
            kwargs.update(embeds(negative if negative is not None else empty, "negative_"))
        self.render_area(pipe, width, height)
        generator = self.make_generator(pipe, seed, generator_device)
        return pipe(**kwargs, width=width, height=height, num_inference_steps=steps, guidance_scale=guidance,
                    max_sequence_length=self.max_sequence_length, generator=generator, output_type="pil").images[0]
