"""What every model family provides. The nodes talk only to this interface; a family's differences
(components, text encoders, latent scaling, loss target, LoRA names, sampling) live in its module."""
from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import torch
from PIL import Image

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class FamilyAdapter(ABC):
    family: str
    # Components each node loads; their digests are the "model identity" in that node's keys.
    latent_components: tuple[str, ...]
    text_components: tuple[str, ...]
    denoiser_components: tuple[str, ...]
    sample_components: tuple[str, ...]
    # Training/sample sizes must be multiples of this (VAE factor x patching).
    size_multiple: int

    def __init__(self, model_dir: str | Path, dtype: str = "float32", max_sequence_length: int = 77):
        self.model_dir = Path(model_dir)
        self.dtype_name = dtype
        self.dtype = DTYPES[dtype]
        self.max_sequence_length = max_sequence_length

    @abstractmethod
    def load_vae(self) -> torch.nn.Module: ...

    @abstractmethod
    def encode_latents(self, vae, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [B,3,H,W] in [-1,1] -> latents [B,C,h,w] ready for the denoiser (scaled/shifted)."""

    @abstractmethod
    def load_text_encoders(self) -> Any: ...

    @abstractmethod
    def encode_text(self, encoders, texts: list[str]) -> list[dict[str, torch.Tensor]]:
        """One dict of named tensors per text (embeddings, pooled, masks), without a batch dimension."""

    @abstractmethod
    def load_denoiser(self) -> torch.nn.Module: ...

    @abstractmethod
    def default_lora_targets(self) -> list[str]: ...

    @abstractmethod
    def training_loss(self, denoiser, latents: torch.Tensor, text: dict[str, torch.Tensor], train_cfg: dict,
                      scheduler, generator: torch.Generator) -> torch.Tensor: ...

    @abstractmethod
    def load_train_scheduler(self) -> Any: ...

    @abstractmethod
    def save_lora(self, lora_state_dict: dict[str, torch.Tensor], out_dir: Path, lora_config: dict) -> Path:
        """Write the LoRA in the format the family's diffusers pipeline loads; returns the file.

        `lora_config` (peft's LoraConfig as a dict) goes into the file's metadata, so a loader applies
        the trained alpha/rank scale, not its default."""

    @abstractmethod
    def load_sampler(self, lora_file: Path | None) -> Any: ...

    @abstractmethod
    def sample(self, pipe, prompt: dict[str, torch.Tensor], negative: dict[str, torch.Tensor] | None,
               empty: dict[str, torch.Tensor], width: int, height: int, steps: int, guidance: float,
               true_cfg: float, seed: int) -> Image.Image:
        """Render one image from cached text tensors (the text encoders are not loaded).

        `negative` is the prompt's own negative (kohya --n) or None; `empty` is the cached empty prompt,
        the unconditional input for families whose CFG needs one. The generator is a CPU generator:
        a seed gives the same image on any machine."""
