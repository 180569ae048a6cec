"""Qwen-Image-Edit-Plus (2509; 2511 has the same layout): Qwen-Image's transformer trained on (control, target)
pairs, laid out as diffusers' QwenImageEditPlusPipeline.__call__ samples (pipeline_qwenimage_edit_plus.py,
diffusers 0.42.1):
- each control image is VAE-encoded at about 1 MP (`calculate_dimensions(VAE_IMAGE_SIZE, ratio)`), normalised
  like the target, packed 2x2 and appended to the noisy target's tokens; `img_shapes` lists the target's and
  each control's (1, h/2, w/2), so each image gets its own frame index in Qwen's RoPE; the prediction is cut
  back to the target's tokens (`noise_pred[:, : latents.size(1)]`);
- the text encoder sees the controls too: each resized to about 384x384 (CONDITION_IMAGE_SIZE) and put as
  "Picture k: <|vision_start|><|image_pad|><|vision_end|>" before the instruction in the edit template
  (`_get_qwen_prompt_embeds`), so a caption's cached embedding is keyed by its control images as well.
Control images are first fitted (cover + centre crop) to their target's size, then resized as the pipeline
resizes the images it is given; sampling hands the pipeline the same fitted image, so it sees what training saw.
"""
from __future__ import annotations

from tasks.lazy import LazyClass, lazy, no_grad
from tasks.models.bases.adapter import Controls, KohyaLayout
from tasks.models.bases.flow_matching import noise_latents, weighted_loss
from tasks.models.qwenimage import QwenImageAdapter

torch = lazy("torch")
diffusers = lazy("diffusers")
_edit = lazy("diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus")

_SAFE = dict(use_safetensors=True)


class VisionTextProcessor:
    """What Qwen2VLProcessor.__call__ gives the pipeline for text and images: the image processor's
    `pixel_values` and `image_grid_thw`, and each `<|image_pad|>` of the text repeated once per merged patch
    (grid t*h*w / merge_size**2, Qwen2VLProcessor.replace_image_token), then tokenized. transformers builds the
    real processor only with torchvision (it checks for its video processor); this one also always uses the
    PIL image processor, so the bytes are the same on every machine."""

    def __init__(self, tokenizer, image_processor):
        self.tokenizer, self.image_processor = tokenizer, image_processor

    def __call__(self, text: list[str], images=None, padding=True, return_tensors="pt"):
        from transformers import BatchFeature

        feats = dict(self.image_processor(images=images, return_tensors=return_tensors)) if images else {}
        if images:
            counts = iter((feats["image_grid_thw"].prod(dim=-1) // self.image_processor.merge_size ** 2).tolist())
            pad = "<|image_pad|>"
            text = ["".join(part if i == 0 else pad * next(counts) + part for i, part in enumerate(t.split(pad)))
                    for t in text]
        enc = self.tokenizer(text, padding=padding, return_tensors=return_tensors)
        return BatchFeature({**enc, **feats})


class QwenImageEditAdapter(QwenImageAdapter):
    family = "qwenimage_edit"
    kohya = KohyaLayout("networks.lora_qwen_image", "qwen_image_edit", names="named")
    pipeline_cls = LazyClass("diffusers", "QwenImageEditPlusPipeline")
    # Qwen-Image-Edit-Plus: up to 3 images ("Picture 1..3"); the pipeline renders only from an image
    controls = Controls(most=3, required=True, seen_by_text=True)
    sample_parts = dict(text_encoder=None, tokenizer=None, processor=None, **_SAFE)

    @classmethod
    def reference_pipeline(cls, base, text_tokens):
        # transformers builds the folder's Qwen2VLProcessor only with torchvision: vision_text_processor's docstring
        pipe = cls.pipeline_cls.from_pretrained(base, use_safetensors=True, processor=None)
        pipe.processor = vision_text_processor(base)
        return pipe

    @classmethod
    def control_size(cls, width, height):
        w, h = _edit.calculate_dimensions(_edit.VAE_IMAGE_SIZE, width / height)
        return int(w), int(h)

    # -- text ------------------------------------------------------------------------------------
    def load_text_encoders(self):
        processor = vision_text_processor(self.model_dir)
        pipe = diffusers.QwenImageEditPlusPipeline.from_pretrained(
            self.model_dir, transformer=None, vae=None, processor=None, dtype=self.dtype, **self.text_encoder_parts(),
            **_SAFE).to(self.device)
        pipe.processor = processor  # set after loading: from_pretrained takes only ProcessorMixin subclasses
        return pipe

    @no_grad
    def encode_text(self, pipe, texts, images=None):
        # One text at a time with its own control images, through the pipeline's encode_prompt (its template,
        # its 64 dropped tokens). The pipeline does not cut the sequence (image tokens come first): a text
        # longer than max_sequence_length is refused rather than cut.
        out = []
        for text, imgs in zip(texts, images or [[]] * len(texts)):
            cond = [pipe.image_processor.resize(img, *_condition_hw(img)) for img in imgs]
            embeds, mask = pipe.encode_prompt([text], image=cond or None, device=self.device)
            if embeds.shape[1] > self.max_sequence_length:
                from tasks.config import ConfigError
                raise ConfigError(f"model.max_sequence_length={self.max_sequence_length}: the text {text[:40]!r} with "
                                  f"{len(imgs)} control image(s) is {embeds.shape[1]} tokens (each image is ~200); "
                                  f"set model.max_sequence_length={embeds.shape[1]} or more")
            out += self.padded(embeds, mask)
        return out

    # -- training --------------------------------------------------------------------------------
    def training_loss(self, transformer, latents, text, train_cfg, scheduler, generators):
        control = text.get("control_latents")  # [B, K, C, ch, cw]
        if control is None:  # every pair has one (controls.required); plain Qwen-Image otherwise
            return super().training_loss(transformer, latents, text, train_cfg, scheduler, generators)
        P = diffusers.QwenImageEditPlusPipeline
        b, c, h, w = latents.shape
        noisy, noise, timesteps, sigmas = noise_latents(latents, train_cfg, scheduler, generators)
        packed = P._pack_latents(noisy, b, c, h, w)
        ch, cw = control.shape[-2:]
        conds = [P._pack_latents(control[:, k].to(latents.dtype), b, c, ch, cw) for k in range(control.shape[1])]
        shapes = [(1, h // 2, w // 2)] + [(1, ch // 2, cw // 2)] * len(conds)
        pred = transformer(hidden_states=torch.cat([packed, *conds], dim=1), timestep=timesteps.to(latents.dtype) / 1000,
                           encoder_hidden_states=text["prompt_embeds"].to(latents.dtype),
                           encoder_hidden_states_mask=text["attention_mask"].to(latents.device),
                           img_shapes=[shapes] * b, return_dict=False)[0][:, : packed.shape[1]]
        vae_scale = self.size_multiple // 2
        pred = P._unpack_latents(pred, h * vae_scale, w * vae_scale, vae_scale)[:, :, 0]
        return weighted_loss(pred, noise - latents, sigmas, train_cfg)  # velocity target

    # -- sampling --------------------------------------------------------------------------------
    @no_grad
    def sample(self, pipe, prompt, negative, empty, width, height, steps, guidance, true_cfg, seed,
               generator_device="cpu", controls=()):
        # `controls` come fitted to (width, height) as their pairs trained; the pipeline resizes them for its
        # VAE and its text encoder as in training. The prompt's texts were encoded with these controls (their
        # cache keys name them); true CFG against its negative, else the empty prompt with the same controls.
        kwargs = self.embeds(prompt, "prompt")
        if true_cfg > 1:
            kwargs.update(self.embeds(negative if negative is not None else empty, "negative_prompt"))
        generator = self.make_generator(pipe, seed, generator_device)
        return pipe(image=list(controls), **kwargs, true_cfg_scale=true_cfg, width=width, height=height,
                    num_inference_steps=steps, generator=generator, output_type="pil").images[0]


def _condition_hw(img) -> tuple[int, int]:
    """(height, width) the pipeline gives its text encoder a control image at (CONDITION_IMAGE_SIZE area)."""
    w, h = _edit.calculate_dimensions(_edit.CONDITION_IMAGE_SIZE, img.width / img.height)
    return int(h), int(w)


def vision_text_processor(model_dir) -> VisionTextProcessor:
    """The processor of a Qwen-Image-Edit folder (processor/: the tokenizer and the image processor's config)."""
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil

    return VisionTextProcessor(AutoTokenizer.from_pretrained(model_dir, subfolder="processor"),
                               Qwen2VLImageProcessorPil.from_pretrained(model_dir, subfolder="processor"))
