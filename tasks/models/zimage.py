"""Z-Image (Tongyi-MAI): a single-stream DiT (S3-DiT) on 2x2 latent patches of the FLUX.1 VAE (/8, 16
channels), text from Qwen3 (the hidden states before its last layer, of the chat-templated caption, padding
dropped), flow matching. Follows diffusers' ZImagePipeline: its transformer takes lists (one latent
[C, 1, h, w] and one caption [L_i, D] per item, each caption its own length), the timestep as 1 - sigma, and
predicts the negative of the velocity the other flow-matching families predict."""
from __future__ import annotations

import logging

from tasks.lazy import LazyClass, lazy, no_grad
from tasks.models.bases.adapter import KohyaLayout
from tasks.models.bases.flow_matching import TransformerAdapter, noise_latents, weighted_loss

torch = lazy("torch")
diffusers = lazy("diffusers")
transformers = lazy("transformers")

log = logging.getLogger("loraflow")
_SAFE = dict(use_safetensors=True)
_SAMPLE_PARTS = dict(text_encoder=None, tokenizer=None, **_SAFE)
_WARNED: set[str] = set()


class _TextEncoders:
    def __init__(self, tokenizer, text_encoder):
        self.tokenizer, self.text_encoder = tokenizer, text_encoder


class ZImageAdapter(TransformerAdapter):
    swap_blocks = ("layers",)  # train.blocks_to_swap (the main layers; the refiners stay)
    family = "zimage"
    original_layout = "zimage"  # loraflow-lora merge --into-base --layout original
    kohya = KohyaLayout("networks.lora_zimage", "zimage", names="named", comfyui_fuses_qkv=True)  # diffusers' Z-Image converter reads it
    pipeline_cls = LazyClass("diffusers", "ZImagePipeline")
    denoiser_cls = LazyClass("diffusers", "ZImageTransformer2DModel")
    denoiser_subfolder = "transformer"
    sample_parts = _SAMPLE_PARTS

    # -- latents ---------------------------------------------------------------------------------
    @staticmethod
    def activation_geometry(config: dict, size: tuple[int, int], text_tokens: int, frames: int = 1) -> tuple[int, int, int]:
        """A single-stream DiT: image and caption tokens in one sequence. The refiners run on the image
        (noise_refiner) or the caption (context_refiner) tokens alone: counted as one full block per refiner layer
        (an overestimate of the caption side's share)."""
        w, h = size
        patch = config["all_patch_size"][0]
        tokens = (h // (8 * patch)) * (w // (8 * patch)) + text_tokens
        return tokens, config["dim"], config["n_layers"] + config["n_refiner_layers"]

    def load_vae(self):
        return diffusers.AutoencoderKL.from_pretrained(self.model_dir, subfolder="vae", dtype=self.dtype, **_SAFE).to(self.device).eval()

    @no_grad
    def encode_latents(self, vae, pixels):
        # The mode, not a sample: the cached latent is then a pure function of the image. The pipeline
        # decodes with latents / scaling_factor + shift_factor, so this is its inverse.
        z = vae.encode(pixels.to(vae.device, vae.dtype, non_blocking=True)).latent_dist.mode()
        return (z - vae.config.shift_factor) * vae.config.scaling_factor

    # -- text ------------------------------------------------------------------------------------
    def load_text_encoders(self):
        return _TextEncoders(
            tokenizer=transformers.AutoTokenizer.from_pretrained(self.model_dir, subfolder="tokenizer"),
            text_encoder=self.pretrained_text_encoder("text_encoder"))  # streamed, stored, placed

    @no_grad
    def encode_text(self, enc, texts):
        # The computation of ZImagePipeline._encode_prompt (a test holds the bytes equal): the caption in
        # Qwen3's chat template (thinking on, as the pipeline asks), padded to max_sequence_length, the
        # penultimate hidden states. The pipeline keeps only the unpadded tokens, so each caption has its own
        # length; the cache stores the padded window (zeros past the mask) and the mask, so captions stack
        # into batches, and training and sampling cut each back to its tokens.
        chats = [enc.tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                                   add_generation_prompt=True, enable_thinking=True) for t in texts]
        inputs = enc.tokenizer(chats, padding="max_length", max_length=self.max_sequence_length,
                               truncation=True, return_tensors="pt")
        mask = inputs.attention_mask.bool()
        hidden = enc.text_encoder(input_ids=inputs.input_ids.to(self.device), attention_mask=mask.to(self.device),
                                  output_hidden_states=True).hidden_states[-2]
        hidden = hidden.to(enc.text_encoder.dtype).cpu()
        hidden = hidden.masked_fill(~mask[..., None], 0)
        for text, m in zip(texts, mask):
            if m.all() and text not in _WARNED:  # a full window: the caption (or the template's end) may be cut
                _WARNED.add(text)
                log.warning("text may be truncated at model.max_sequence_length=%d tokens (chat template "
                            "included): %.80r", self.max_sequence_length, text)
        return [{"prompt_embeds": hidden[i], "attention_mask": mask[i].to(torch.int64)} for i in range(len(texts))]

    @staticmethod
    def caption_features(prompt_embeds: torch.Tensor, attention_mask: torch.Tensor) -> list[torch.Tensor]:
        """Cached [B, L, D] + [B, L] -> the pipeline's list of per-caption [L_i, D] (padding dropped)."""
        return [e[m.bool()] for e, m in zip(prompt_embeds, attention_mask)]

    # -- training --------------------------------------------------------------------------------
    def load_denoiser(self):
        return self.pretrained_denoiser(diffusers.ZImageTransformer2DModel, "transformer")

    # Attention and feed-forward projections of the main layers and both refiners (the image-side
    # noise_refiner and the caption-side context_refiner): the Linear layers the Z-Image LoRAs in circulation
    # train. Not the embedders, the adaLN modulation or the final layer.
    LORA_TARGETS = (r"(layers|noise_refiner|context_refiner)\.\d+\."
                    r"(attention\.(to_[qkv]|to_out\.0)|feed_forward\.w[123])")

    def training_loss(self, transformer, latents, text, train_cfg, scheduler, generators):
        noisy, noise, timesteps, sigmas = noise_latents(latents, train_cfg, scheduler, generators)
        caps = self.caption_features(text["prompt_embeds"].to(latents.dtype), text["attention_mask"])
        t = (1000 - timesteps.to(latents.dtype)) / 1000  # the pipeline's timestep: 1 - sigma
        out = transformer(list(noisy.unsqueeze(2).unbind(0)), t, caps, return_dict=False)[0]
        pred = -torch.stack(out).squeeze(2)  # the pipeline negates the output: noise - x0, the velocity
        return weighted_loss(pred, noise - latents, sigmas, train_cfg)

    # -- sampling --------------------------------------------------------------------------------
    @no_grad
    def sample(self, pipe, prompt, negative, empty, width, height, steps, guidance, true_cfg, seed, generator_device="cpu"):
        # Real CFG at `guidance` (the pipeline's guidance_scale: pos + g * (pos - neg), off at 0, as
        # Z-Image-Turbo is sampled); `true_cfg` is unused. The unconditional input is the prompt's negative,
        # else the cached empty prompt (no text encoder is loaded to encode "").
        def caps(d):
            return self.caption_features(d["prompt_embeds"][None].to(self.dtype), d["attention_mask"][None])

        uncond = negative if negative is not None else empty
        generator = self.make_generator(pipe, seed, generator_device)
        return pipe(prompt_embeds=caps(prompt), negative_prompt_embeds=caps(uncond) if guidance > 0 else None,
                    width=width, height=height, num_inference_steps=steps, guidance_scale=guidance,
                    max_sequence_length=self.max_sequence_length, generator=generator, output_type="pil").images[0]
