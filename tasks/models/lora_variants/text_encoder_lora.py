"""train.text_encoder_lr: a LoRA on the family's text encoders too (SD1.5: CLIP-L; SDXL: CLIP-L and CLIP-G),
trained at its own learning rate, as sd-scripts' `--text_encoder_lr` and diffusers' `--train_text_encoder`
(train_dreambooth_lora_sdxl.py: peft LoraConfig on q/k/v/out_proj, a second optimizer param group,
save_lora_weights(text_encoder_lora_layers=..., text_encoder_2_lora_layers=...)).

A trained encoder's outputs change every step, so nothing of the text cache can be used: captions are
encoded live in the train node (the `text.cache=false` path, with gradients), and the sample node and the
samples rendered during training encode their prompts with the LoRA'd encoders. cache_text then encodes
nothing. Which components train lives in the adapter (`text_encoder_lora_modules`); a family without it
refuses the setting."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from tasks.config import Config
from tasks.config_schema import TrainConfig
from tasks.models.lora_variants import lycoris

# report.json nodes.cache_text.text_encoding, when the encoders train
LIVE = ("live: train.text_encoder_lr trains the text encoders, so nothing is read from the text cache; captions "
        "are encoded in train, sample prompts in sample (and at each sample.every_n_steps point) with the trained "
        "encoders")


def enabled(cfg: Config) -> bool:
    return cfg.train.text_encoder_lr is not None


def text_settings(cfg: Config) -> dict:
    """cfg.text as training meets it: with trained encoders every caption is encoded live, as with
    text.cache=false (augment.text_mode reads it)."""
    return replace(cfg.text, cache=False) if enabled(cfg) else cfg.text


def errors(cfg: Config, adapter_cls) -> list[str]:
    if not enabled(cfg):
        return []
    lr, family, out = cfg.train.text_encoder_lr, cfg.model.family, []
    if not adapter_cls.text_encoder_lora_modules:
        out.append(f"train.text_encoder_lr={lr}: train.text_encoder_lr is supported for sd15/sdxl (their CLIP text "
                   f"encoders, as sd-scripts and diffusers train them); model.family={family} trains its denoiser "
                   "only: set train.text_encoder_lr=null")
    if cfg.train.network == "dora":
        # diffusers 0.42.1 + transformers 5 load a text encoder's DoRA magnitudes under the wrong name (peft's
        # `lora_magnitude_vector` vs the expected `...lora_magnitude_vector.weight`): they would be re-initialised
        out.append(f"train.text_encoder_lr={lr} with train.network=dora: diffusers' load_lora_weights does not "
                   "restore a text encoder's DoRA magnitudes (they load re-initialised), so the samples and the "
                   "exported file would not be what was trained; use train.network=lora, or "
                   "train.text_encoder_lr=null")
    if cfg.text.offload_encoders:
        out.append(f"train.text_encoder_lr={lr} with text.offload_encoders=true: the train node trains the text "
                   "encoders, so it must load them; drop one of the two")
    return out


def peft_config(module) -> dict:
    """A module's peft config for the LoRA file's metadata. peft keeps target_modules as a set: sorted, or its
    order (hence the file's bytes) changes per process. base_model_name_or_path (a text encoder's is its
    folder in the store) left out: the same LoRA from another store has the same bytes."""
    config = {k: sorted(v) if isinstance(v, (set, frozenset)) else v
              for k, v in module.peft_config["default"].to_dict().items()}
    return {**config, "base_model_name_or_path": None}


def add_lora(adapter, pipe, tc: TrainConfig) -> dict:
    """peft LoRA layers (fp32) on each trained text encoder of `pipe` (the pipeline the live path loaded),
    with the denoiser's rank, alpha and rslora; returns {"<component>.<name>": parameter}. Called
    after the denoiser's LoRA is made, so that one is initialised as in a run without this setting."""
    from peft import LoraConfig

    alpha = tc.alpha if tc.alpha is not None else tc.rank
    named = {}
    for component in adapter.text_encoder_lora_modules:
        encoder = getattr(pipe, component)
        encoder.requires_grad_(False)
        encoder.add_adapter(LoraConfig(r=tc.rank, lora_alpha=alpha, init_lora_weights="gaussian",
                                       target_modules=list(adapter.text_encoder_lora_targets),
                                       use_rslora=bool(tc.rslora)))  # (DoRA refused: see errors)
        if tc.gradient_checkpointing:
            encoder.gradient_checkpointing_enable()
        encoder.train()
        for name, p in encoder.named_parameters():
            if p.requires_grad:
                p.data = p.data.float()  # LoRA weights train in fp32 whatever the base dtype
                named[f"{component}.{name}"] = p
    return named


def add_to_training(adapter, pipe, tc: TrainConfig, named: dict) -> tuple[dict, list]:
    """(every trained parameter by name, the optimizer's parameters): with `pipe` (the encoders to train),
    their LoRA's parameters join the denoiser's (checkpoints, EMA, clipping and the gradient exchange cover
    both) and form an optimizer group of their own at train.text_encoder_lr; without, as always."""
    if pipe is None:
        return named, list(named.values())
    encoders = add_lora(adapter, pipe, tc)
    return {**named, **encoders}, [{"params": list(named.values())},
                                   {"params": list(encoders.values()), "lr": tc.text_encoder_lr}]


def writer(adapter, denoiser, pipe, state: dict | None = None):
    """folder -> the LoRA file written there: the denoiser's layers and, with `pipe` (trained encoders), each
    encoder's as `text_encoder.*` / `text_encoder_2.*` with its own peft config (diffusers' save_lora_weights).
    `state`: the denoiser's peft state dict, already gathered (train.shard=fsdp), instead of its parameters'."""
    from peft.utils import get_peft_model_state_dict

    def of(holder) -> dict:
        return get_peft_model_state_dict(holder) if state is None else state

    def write(folder):
        extra = {} if pipe is None else {"text_encoders": {
            c: (_hub_layout(getattr(pipe, c), get_peft_model_state_dict(getattr(pipe, c))), peft_config(getattr(pipe, c)))
            for c in adapter.text_encoder_lora_modules}}
        holder = adapter.lora_holder(denoiser)
        if lycoris.file_kind(peft_config(holder)):  # LoHa/LoKr: no diffusers LoRA file takes them
            return lycoris.save_peft(Path(folder) / "pytorch_lora_weights.safetensors",
                                     of(holder), peft_config(holder), adapter.denoiser_subfolder)
        return adapter.save_lora(of(holder), folder, peft_config(holder), **extra)
    return write


def _hub_layout(encoder, state_dict: dict) -> dict:
    # transformers 5 flattened CLIPTextModel (`encoder.layers.0...`); LoRA files everywhere (and sd-scripts'
    # lora_te_text_model_* names) have `text_model.encoder.layers.0...`, which diffusers strips again on load
    # for a flattened model (lora_base._load_lora_into_text_encoder). Written in that layout.
    if hasattr(encoder, "text_model"):
        return state_dict
    return {f"text_model.{k}": v for k, v in state_dict.items()}


def live_prompts(adapter, pipe):
    """text -> its tensors from the LoRA'd encoders as they are now (samples during training), no gradients."""
    import torch

    @torch.no_grad()
    def encode(text: str) -> dict:
        was = [getattr(pipe, c).training for c in adapter.text_encoder_lora_modules]
        for c in adapter.text_encoder_lora_modules:
            getattr(pipe, c).eval()
        try:
            return adapter.encode_text(pipe, [text])[0]
        finally:
            for c, mode in zip(adapter.text_encoder_lora_modules, was):
                getattr(pipe, c).train(mode)
    return encode
