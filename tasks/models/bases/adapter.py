"""What every model family provides. The nodes talk only to this interface; a family's differences
(components, text encoders, latent scaling, loss target, LoRA names, sampling) live in its module."""
from __future__ import annotations

import functools
import os
import shutil
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.config_schema import ModelConfig, TrainConfig
from tasks.lazy import lazy
from tasks.models.loading import fp8_single_file

torch = lazy("torch")
Image = lazy("PIL.Image")  # named by annotations only here


def _quiet_diffusers_bars() -> None:
    """HF_HUB_DISABLE_PROGRESS_BARS: transformers and huggingface_hub honour it; diffusers' "Loading pipeline
    components" bar does not. Called before an adapter's first model load."""
    if os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS", "").lower() in ("1", "true", "yes"):
        from diffusers.utils import logging as diffusers_logging

        diffusers_logging.disable_progress_bar()


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)  # follows the hub cache's symlinks; no second copy of multi-GB encoders
    except OSError:
        shutil.copy2(src, dst)


def _check_loaded(file: Path, modules: dict[str, torch.nn.Module]) -> None:
    """diffusers loads single files non-strictly: weights the file lacks stay on the meta device."""
    from tasks.config import ConfigError

    missing = [f"{name}.{p}" for name, m in modules.items() for p, t in m.state_dict().items() if t.is_meta]
    if missing:
        raise ConfigError(f"model.path={file}: the file lacks {len(missing)} weights of the architecture in "
                          f"model.config (e.g. {', '.join(missing[:3])}); is model.config the right base model?")


# Regexes of diffusers' transformer blocks (kohya rules): double-stream / joint blocks, and Flux's single blocks
BLOCK, SINGLE = r"transformer_blocks\.(\d+)\.", r"single_transformer_blocks\.(\d+)\."


@dataclass(frozen=True)
class KohyaLayout:
    """How the family's LoRA is named in the kohya file (sd-scripts, ComfyUI, Forge): declared by each adapter,
    read by tasks/training/export.py and loraflow-lora.

    names: "rules" = each diffusers Linear matched by `rules` (regex, kohya module format, group size: > 1 where the
    original checkpoint has ONE fused Linear, e.g. qkv, for several diffusers ones); "named" = the diffusers module
    names with "." -> "_" (one Linear each); "unet" = diffusers' own convert_state_dict_to_kohya (SD1.x, SDXL;
    `sgm_blocks`: then SGM block names, as sd-scripts' SDXL LoRAs use)."""
    network_module: str  # sd-scripts' ss_network_module
    base_version: str  # sd-scripts' ss_base_model_version
    names: str = "rules"
    rules: tuple = ()
    drop: str | None = None  # modules no kohya loader of the family has: left out with a warning (a regex)
    sgm_blocks: bool = False
    text_encoder_prefixes: tuple = ()  # (pipeline component, kohya prefix) for train.text_encoder_lr
    # ComfyUI's own model names differ from the kohya file's (Z-Image: q/k/v fused): a ComfyUI file apart
    # (tasks/training/export_comfyui.py); False: the kohya file is the ComfyUI file
    comfyui_fuses_qkv: bool = False
    # The same for a "rules" family whose reference trainer and ComfyUI disagree (HunyuanVideo 1.5: musubi-tuner
    # keeps q/k/v apart, ComfyUI's model fuses them): ComfyUI's names, as `rules`; () = the kohya file's
    comfyui_rules: tuple = ()
    # The LyCORIS file's names (train.network=loha|lokr, tasks/training/export_lycoris.py): "diffusers" =
    # `lycoris_<diffusers module>`, which ComfyUI maps for the image families; "comfyui" = the ComfyUI file's
    # modules (`lora_unet_<ComfyUI's module>`, as LyCORIS's lycoris.kohya names them), the only LyCORIS names
    # ComfyUI maps for its video models (its generic rule); a fused module's LoHa/LoKr are fused exactly
    lycoris_names: str = "diffusers"


@dataclass(frozen=True)
class Clips:
    """A video family's clips (Wan, LTX-2, HunyuanVideo 1.5): latents [C, F, h, w] from clips of 1 + frame_step x k
    frames (an image is one frame); its `sample` takes `frames` and `fps` and returns a tasks.data.clips.Video."""
    frame_step: int  # the VAE's temporal factor
    default_fps: float = 16.0  # the family's native rate: its samples' when data.fps is null
    min_side: int = 0  # the smallest side (px) its VAE decoder renders; validate refuses less


@dataclass(frozen=True)
class Controls:
    """An edit family's control images (data.control_dirs, a prompt's --i): its training_loss reads
    text["control_latents"] ([B, K, C, h, w]) and its `sample` takes `controls`."""
    most: int  # how many control images a sample takes
    min_side: int = 0  # the smallest control image (px a side) the pipeline takes
    required: bool = False  # the pipeline renders only from a control image (every pair and --i needs one)
    # The text encoder sees the control images (Qwen-Image-Edit): encode_text takes `images` (per text, its
    # controls as fitted to the target) and a text's cache key names them (tasks/cache_text.py)
    seen_by_text: bool = False
    # Image-to-video: the control is each clip's first frame (or a same-stem image, data.condition_image), encoded
    # by the adapter's `encode_condition` (tasks/data/first_frame.py); its `sample` renders a clip from it
    first_frame: bool = False


class FamilyAdapter(ABC):
    family: str
    # Components each node loads; their digests are the "model identity" in that node's keys.
    latent_components: tuple[str, ...]
    text_components: tuple[str, ...]
    denoiser_components: tuple[str, ...]
    sample_components: tuple[str, ...]
    # Training/sample sizes must be multiples of this (VAE factor x patching).
    size_multiple: int

    @staticmethod
    @abstractmethod
    def activation_geometry(config: dict, size: tuple[int, int], text_tokens: int, frames: int = 1) -> tuple[int, int, int]:
        """(tokens, width, blocks) of the denoiser, from its config.json, at this training size (and a clip's
        frames): what the preflight estimate (tasks/training/memory.py) scales the saved activations by."""

    def __init__(self, model_dir: str | Path, dtype: str = "float32", max_sequence_length: int = 77):
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"model.dtype={dtype}: one of float32, bfloat16, float16")
        self.model_dir = Path(model_dir)
        self.dtype_name = dtype
        self.max_sequence_length = max_sequence_length

    kohya: KohyaLayout  # the kohya file's names (every family declares it; tests/test_family_declarations.py)
    # The released single-file layout `loraflow-lora merge --into-base --layout original` writes
    # (tasks/lora_tools/transformer_layouts.py, ldm.py): "ldm" (SD1.x/SDXL's UNet), "flux", "flux2", "sd3",
    # "zimage", "diffusers" (Qwen-Image's files use diffusers' names); None: not written (use --layout diffusers)
    original_layout: str | None = None
    # Constructor arguments that widen the denoiser class's defaults to every released variant's block structure,
    # so loraflow-lora maps a LoRA of any variant without its config.json (tasks/lora_tools/names.py); {}: the
    # defaults are already the largest model (FLUX.1, FLUX.2 [dev], Z-Image, Qwen-Image; SD1.5's UNet)
    widest_arch: dict = {}
    # The preflight's activation constants (per block, per checkpointed block, one recompute; saved values per token
    # x width), where measured on the family itself (tasks/training/memory.py); None: FLUX.1's
    activation_factors: tuple[float, float, float] | None = None
    # The rest of tasks/training/memory.py's Factors where the family's differ (measured by bench.memory): what a
    # block's backward holds in flight, what train.gradient_checkpointing_offload copies per token x width and per
    # text token x width (a caption that is a block input beside the sequence); {}: the defaults
    activation_extras: dict = {}
    # The sample node's inference forward (tasks/run_memory.py's INFER_FACTORS: its own peak, what is live beside the
    # largest stored Linear's dequantize) where measured on the family itself; None: the table's
    infer_factors: tuple[float, float] | None = None
    # The benchmarks' knowledge of the family (issue 64 item 4), declared here, read by bench/ through the registry:
    # its full-size models (tasks/models/bases/real_size.py; bench.memory's rows, node rows and card table), and how
    # the learning check renders its kohya file: "diffusers" (the pipeline's load_lora_weights reads it) or "merge"
    # (diffusers reads no kohya layout for it: merged as ComfyUI merges it, bench/learns_loaders.py). The tiny
    # model's learning-check settings are its builder module's LEARNS (bench/learns_settings.py).
    real_sizes: tuple = ()
    reference_kohya: str = "diffusers"
    # train.network=lokr: False where the LyCORIS file cannot hold the trained LoKr exactly (Lumina 2: ComfyUI's one
    # attention.qkv of unequal q / k / v widths, GQA, whose row blocks cannot share one w2; tasks/training/
    # lycoris_fused.py): refused at validate (tasks/config_checks.py)
    lokr_file: bool = True

    @staticmethod
    def bench_batch(config: dict, size: tuple[int, int], frames: int, text_len: int):
        """(latents, text) of one cached item at this size, as zeros in bfloat16 of the cache's shapes (what the
        train node hands training_loss), for bench.memory's full-size rows; families with `real_sizes` define it."""
        raise NotImplementedError("the family declares no real_sizes")

    @classmethod
    def reference_pipeline(cls, base: Path, text_tokens: int):
        """The family's own diffusers pipeline on a base folder, loaded as a user of diffusers loads it: the learning
        check's renderer (bench/learns_loaders.py), `text_tokens` the tiny model's model.max_sequence_length. The
        class the folder names; an image-to-video family's own pipeline (Wan 2.2 TI2V-5B's folder names WanPipeline).
        A family whose pipeline needs more to load or to render as it trained overrides this."""
        import diffusers

        if cls.controls.first_frame:
            return cls.pipeline_cls.from_pretrained(base, use_safetensors=True)
        return diffusers.DiffusionPipeline.from_pretrained(base, use_safetensors=True)

    @classmethod
    def reference_controls(cls, control, size: int) -> dict:
        """The pipeline's call arguments for one control image at a square `size` (the learning check's render):
        an image-to-video pipeline's first frame, else a list of references (FLUX.2, Qwen-Image-Edit)."""
        return dict(image=control) if cls.controls.first_frame else dict(image=[control])

    def configure(self, model_cfg: ModelConfig) -> None:
        """Model options a family reads beyond the common ones (Wan 2.2: model.expert); none by default."""
        if model_cfg.expert:
            from tasks.config import ConfigError

            raise ConfigError(f"model.expert={model_cfg.expert}: only Wan 2.2 (model.family=wan22) has experts; "
                              f"drop it for model.family={self.family}")

    # dtype and device read torch: made when first used, so validate's preflight (an adapter for its model
    # paths and LoRA targets) imports no torch on a no-op run
    @functools.cached_property
    def dtype(self) -> torch.dtype:
        _quiet_diffusers_bars()  # the first model load is near
        return getattr(torch, self.dtype_name)

    @functools.cached_property
    def device(self) -> torch.device:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def make_generator(self, pipe, seed: int, generator_device: str) -> torch.Generator:
        """The sampler's generator lives on the device of the tensors it fills. "cpu" (default): diffusers'
        randn_tensor fills CPU tensors and moves them, so a seed gives the same start noise on any machine;
        "device": it fills tensors on the pipeline's device (faster on GPU, machine-dependent)."""
        device = torch.device("cpu") if generator_device == "cpu" else pipe._execution_device
        return torch.Generator(device).manual_seed(seed)

    # Single-file checkpoints: "pipeline" files hold every component (SD1.5/SDXL, A1111/civitai style);
    # "denoiser" files hold only the transformer (flux1-dev.safetensors), the rest comes from model_dir.
    single_file_holds = "pipeline"
    pipeline_cls: type
    denoiser_cls: type
    denoiser_subfolder: str
    # The diffusers LoRA file's key prefix where it is not denoiser_subfolder (Wan 2.2: either expert's file is
    # `transformer.*`, loaded into transformer_2 by load_into_transformer_2=True)
    lora_file_component: str | None = None
    # A model with several denoisers: {name: subfolder} (Wan 2.2: high / low), for loraflow-lora's --expert
    experts: dict[str, str] = {}

    def convert_single_file(self, file: Path, out_dir: Path) -> None:
        """Read a single-file checkpoint with diffusers' from_single_file (configs from self.model_dir, no
        network) and save it as a diffusers folder at out_dir."""
        local = dict(config=str(self.model_dir), dtype=self.dtype, local_files_only=True)
        if self.single_file_holds == "denoiser" and fp8_single_file.holds_fp8(file):
            # an fp8 file: kept in its own dtypes, read as stored (tasks/models/loading/fp8_single_file.py)
            fp8_single_file.convert(self.denoiser_cls, file, self.model_dir, self.denoiser_subfolder, self.dtype, out_dir)
            shutil.copytree(self.model_dir, out_dir, dirs_exist_ok=True, copy_function=_link_or_copy,
                            ignore=lambda d, names: [self.denoiser_subfolder] if Path(d) == self.model_dir else [])
        elif self.single_file_holds == "denoiser":
            denoiser = self.denoiser_cls.from_single_file(str(file), subfolder=self.denoiser_subfolder, **local)
            _check_loaded(file, {self.denoiser_subfolder: denoiser})
            # The other components are the config's files, linked byte for byte: their identities (and so
            # the cached latents and text) stay those of the base model.
            shutil.copytree(self.model_dir, out_dir, dirs_exist_ok=True, copy_function=_link_or_copy,
                            ignore=lambda d, names: [self.denoiser_subfolder] if Path(d) == self.model_dir else [])
            denoiser.save_pretrained(Path(out_dir) / self.denoiser_subfolder, safe_serialization=True)
        else:
            pipe = self.pipeline_cls.from_single_file(str(file), **local)
            _check_loaded(file, {n: c for n, c in pipe.components.items() if isinstance(c, torch.nn.Module)})
            pipe.save_pretrained(out_dir, safe_serialization=True)

    @abstractmethod
    def load_vae(self) -> torch.nn.Module: ...

    def latent_settings(self) -> dict:
        """What besides model.dtype changes the latent's bytes (e.g. an upcast VAE), for the latent's key;
        empty where nothing does, so existing keys stay as they were."""
        return {}

    @abstractmethod
    def encode_latents(self, vae, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [B,3,H,W] in [-1,1] -> latents [B,C,h,w] ready for the denoiser (scaled/shifted)."""

    @abstractmethod
    def load_text_encoders(self) -> Any: ...

    # How load_text_encoders stores and places the encoders (text.quantize, text.offload): set by the nodes that
    # encode text (tasks/models/loading/text_load.py: TextLoading); None = as stored, on the device
    text_loading = None

    def pretrained_text_encoder(self, subfolder: str, cls: type | None = None) -> torch.nn.Module:
        """The transformers text encoder in `self.model_dir/subfolder` (its class from model_index.json unless
        given), streamed in, stored as self.text_loading says and placed on the device (text_load.py)."""
        import json

        import transformers

        from tasks.models.loading.text_load import TextLoading, load_text_model

        if cls is None:
            cls = getattr(transformers, json.loads((self.model_dir / "model_index.json").read_text())[subfolder][1])
        _quiet_diffusers_bars()
        return load_text_model(cls, self.model_dir / subfolder, self.dtype, self.text_loading or TextLoading(),
                               str(self.device))

    def text_encoder_parts(self) -> dict[str, torch.nn.Module]:
        """Every transformers text encoder of the model folder (model_index.json), loaded by
        pretrained_text_encoder: from_pretrained keyword arguments that hand them to the family's pipeline."""
        import json

        index = json.loads((self.model_dir / "model_index.json").read_text())
        return {name: self.pretrained_text_encoder(name) for name, spec in index.items()
                if name.startswith("text_encoder") and isinstance(spec, list) and spec[0] == "transformers"
                and spec[1] is not None and (self.model_dir / name).is_dir()}

    @abstractmethod
    def encode_text(self, encoders, texts: list[str]) -> list[dict[str, torch.Tensor]]:
        """One dict of named tensors per text (embeddings, pooled, masks), without a batch dimension."""

    @abstractmethod
    def load_denoiser(self) -> torch.nn.Module: ...

    # How `pretrained_denoiser` reads the weights: None = diffusers' from_pretrained (sampling, tools); the train
    # node sets a WeightLoading (tasks/training/train_setup.py) to stream them (tasks/models/loading/stream_load.py)
    weight_loading = None

    def pretrained_denoiser(self, cls: type, subfolder: str) -> torch.nn.Module:
        """`cls` from `self.model_dir/subfolder` in `self.dtype`: from_pretrained, or streamed tensor by tensor
        (each weight stored as the train node's plan says, on the device it names) when weight_loading is set."""
        if self.weight_loading is None:
            return cls.from_pretrained(self.model_dir, subfolder=subfolder, dtype=self.dtype, use_safetensors=True)
        from tasks.models.loading.stream_load import load_streamed

        plan = self.weight_loading
        return load_streamed(cls, self.model_dir / subfolder, self.dtype, plan.store,
                             lambda name: plan.place(subfolder, name))

    # The family's own training version, in the LoRA's key when set: bumped where one family's LoRA bytes
    # change, so the other families' keys stay as they were.
    train_version: str | None = None
    latent_version: str | None = None  # the same for the latent's key
    # Whether a latent is stored with its image's original size and crop offsets (SDXL's size conditioning);
    # training passes them to the loss beside the text tensors.
    size_conditioning = False
    flow_matching = False  # train.timestep_sampling other than sigma applies (tasks/models/bases/flow_matching.py)
    # train.text_encoder_lr (tasks/models/lora_variants/text_encoder_lora.py): the pipeline's text encoders that get a LoRA and the
    # modules it targets in them; () = the family trains no text encoder (the setting is refused)
    controls = Controls(most=0)  # an edit family's control images; most=0: a text-to-image family
    # train.blocks_to_swap: the denoiser's block lists, in the order they run (tasks/training/block_swap.py);
    # () = none to swap (the UNets: the setting is refused)
    swap_blocks: tuple[str, ...] = ()
    # The most text tokens model.max_sequence_length may ask for (FluxPipeline and StableDiffusion3Pipeline refuse a
    # T5 length above 512); a family whose pipeline reads more declares its own
    max_text_tokens: int = 512
    clips: Clips | None = None  # a video family's clips; None: an image family
    # data.vae_tiling: attributes set on the VAE after diffusers' enable_tiling (tile sizes, temporal tiling flags);
    # {}: diffusers' defaults. In a tiled latent's key (tasks/data/vae_tiling.py)
    vae_tiling: dict = {}

    @classmethod
    def control_size(cls, width: int, height: int) -> tuple[int, int]:
        """The size a control image of a (width, height) target is encoded at: the target's, unless the
        family's pipeline resizes its controls otherwise."""
        return width, height
    text_encoder_lora_modules: tuple[str, ...] = ()
    text_encoder_lora_targets: tuple[str, ...] = ()

    @abstractmethod
    def default_lora_targets(self) -> list[str] | str:
        """peft target_modules: names matched by suffix, or one regex matched against whole module paths."""

    @abstractmethod
    def training_loss(self, denoiser, latents: torch.Tensor, text: dict[str, torch.Tensor], train_cfg: TrainConfig,
                      scheduler, generators: list[torch.Generator]) -> torch.Tensor:
        """Mean loss over the batch; every random draw for item i comes from generators[i]."""

    @abstractmethod
    def load_train_scheduler(self) -> Any: ...

    @abstractmethod
    def save_lora(self, lora_state_dict: dict[str, torch.Tensor], out_dir: Path, lora_config: dict) -> Path:
        """Write the LoRA in the format the family's diffusers pipeline loads; returns the file.

        `lora_config` (peft's LoraConfig as a dict) goes into the file's metadata, so a loader applies
        the trained alpha/rank scale, not its default."""

    @abstractmethod
    def load_sampler(self, lora_file: Path | None, denoiser: torch.nn.Module | None = None) -> Any:
        """The family's pipeline without text encoders, with the LoRA file loaded, or around `denoiser`,
        the model being trained (samples during training use the LoRA as it is at that step)."""

    denoisers = 1  # how many denoisers training holds (Wan 2.2's model.expert=both: 2, one LoRA)

    def lora_holder(self, denoiser):
        """The module whose peft layers are the LoRA to write (the denoiser itself but for Wan 2.2's two experts)."""
        return denoiser

    # The sample node's denoisers, streamed and stored as training stored them (tasks/training/stored_sampler.py):
    # {subfolder: model}, handed to the pipeline by live()
    sampler_parts: dict = {}

    def sample_denoisers(self) -> tuple[str, ...]:
        """The subfolders of every denoiser the family's pipeline runs (Wan 2.2: both experts, whichever trains),
        each of class denoiser_cls (named, not read: the preflight imports no torch)."""
        return (self.denoiser_subfolder,)

    def live(self, denoiser) -> dict:
        """from_pretrained kwargs that plug the model being trained into a pipeline, or the sample node's stored
        denoisers (none: the pipeline loads them)."""
        return dict(self.sampler_parts) if denoiser is None else {self.denoiser_subfolder: denoiser}

    def place(self, pipe, denoiser):
        # A pipeline around the training model stays on its device; otherwise the sampling device (a swapped
        # block's weights stay on the host with their hooks: sample.offload)
        return pipe.to(self.device if denoiser is None else denoiser.device)

    @abstractmethod
    def sample(self, pipe, prompt: dict[str, torch.Tensor], negative: dict[str, torch.Tensor] | None,
               empty: dict[str, torch.Tensor], width: int, height: int, steps: int, guidance: float,
               true_cfg: float, seed: int, generator_device: str = "cpu") -> Image.Image:
        """Render one image from cached text tensors (the text encoders are not loaded).

        `negative` is the prompt's own negative (kohya --n) or None; `empty` is the cached empty prompt,
        the unconditional input for families whose CFG needs one. The generator is a CPU generator:
        a seed gives the same image on any machine."""


def on_pipeline_device(pipe, text: dict | None) -> dict | None:
    """Cached text tensors (the store's, on the CPU) on the pipeline's device. diffusers' Flux, SD3, FLUX.2,
    Z-Image and Qwen-Image pipelines use given prompt embeddings where they are (SD1.5/SDXL move them), so on
    CUDA the adapters' `sample` must get them there."""
    if text is None:
        return None
    device = pipe._execution_device
    return {k: v.to(device) for k, v in text.items()}


def load_lora_file(pipe, denoiser_subfolder: str, lora_file) -> None:
    """A LoRA file into a pipeline: diffusers' load_lora_weights, or for LoHa/LoKr (which it does not read) peft
    on the denoiser itself, from the train node's file or the exported LyCORIS file (tasks/models/lora_variants/lycoris.py)."""
    from tasks.models.lora_variants import lycoris

    if lycoris.file_network(lora_file):
        lycoris.apply_file(getattr(pipe, denoiser_subfolder), lora_file)
    elif lycoris.is_lycoris_file(lora_file):  # an exported LyCORIS file (the learning check reads exports)
        lycoris.apply_lycoris(getattr(pipe, denoiser_subfolder), lora_file)
    else:
        pipe.load_lora_weights(str(lora_file))
