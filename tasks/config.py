"""Typed config schema (Hydra structured configs) and composition for CLI and deployments.

The schema is registered in Hydra's ConfigStore and named first in ``conf/train.yaml``'s defaults, so
a misspelt key or a wrong type fails at composition, before any work, with the full key in the message.
"""
from __future__ import annotations

import os
import difflib
from dataclasses import MISSING as MISSING_FIELD, dataclass, field, fields, is_dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

REPO = Path(__file__).resolve().parents[1]
CONF_DIR = REPO / "conf"


@dataclass
class ModelConfig:
    name: str = "tiny_flux"
    family: str = "flux"
    # A diffusers folder or hub id. None: build the tiny model from `arch`/`seed` into the store.
    path: Optional[str] = None
    # With a single-file path (.safetensors): the diffusers folder or hub id that supplies the configs and
    # the components the file lacks.
    config: Optional[str] = None
    seed: int = 0
    arch: Dict[str, Any] = field(default_factory=dict)
    dtype: str = "float32"
    # float8_e4m3fn | float8_e5m2: the denoiser's base weights stored in fp8 while training (layerwise casting)
    storage_dtype: Optional[str] = None
    # With storage_dtype: also store the AdaLN modulation linears (Flux, SD3; a quarter of Flux's weights) in it,
    # as sd-scripts' --fp8_base does. false: kept in `dtype`, diffusers' default for layerwise casting.
    storage_modulation: bool = False
    # none | fp8 | int8 | nf4: the frozen base stored quantized while training (fp8 = storage_dtype=float8_e4m3fn;
    # int8 / nf4: torchao's tensors, tasks/training/quantized_base.py)
    quantize: str = "none"
    # auto | dequantize | w8a8: how an fp8 / int8 base multiplies (tasks/training/w8a8.py); auto: w8a8 on a GPU
    # with the kernel, else dequantize (the weight upcast, then a compute-dtype matmul)
    matmul: str = "auto"
    max_sequence_length: int = 32
    # Wan 2.2: high | low, the expert a run trains, or both (one LoRA; tasks/models/wan22.py); null elsewhere
    expert: Optional[str] = None


@dataclass
class SubsetConfig:
    """One folder of data.subsets (kohya's dataset-config subsets): its images train `repeats` times per epoch."""
    dir: str = MISSING
    repeats: int = 1
    caption_extension: Optional[str] = None  # None: data.caption_extension
    # Regularisation (class) images for prior preservation: their loss is weighted by train.prior_loss_weight
    is_reg: bool = False


@dataclass
class DataConfig:
    dir: str = MISSING
    # Folders with their own repeats / caption extension / is_reg (tasks/data/subsets.py). When given, data.dir is
    # not read; when empty, data.dir's `N_name/` subfolders (kohya's convention) are read as subsets.
    subsets: List[SubsetConfig] = field(default_factory=list)
    # true: each image's mirror image is cached as its own latent and trained as one more item
    flip_aug: bool = False
    # Refused when true: latents are cached once per image, so a crop drawn anew each epoch cannot be cached
    random_crop: bool = False
    resolution: float = 64
    resolution_type: str = "pixels"  # pixels | area (megapixels)
    missing_caption: str = "error"  # error | empty
    # error: an unusable file (unreadable/too small image, non-UTF-8 caption, refused symlink) stops the run,
    # every one listed; skip: such files are left out (listed in report.json 'dataset'), the rest trains.
    bad_files: str = "error"
    caption_extension: str = ".txt"
    # Masked loss (tasks/data/masks.py): a grayscale mask per image by stem in mask_dir (white trains), or each
    # image's own alpha channel; the loss of masked-out pixels is zeroed (sd-scripts' apply_masked_loss).
    mask_dir: Optional[str] = None
    alpha_mask: bool = False
    # Edit pairs (tasks/data/controls.py): control images by the target's stem, one folder per reference
    control_dirs: List[str] = field(default_factory=list)
    # Video families (tasks/data/video.py): frames per clip sample (1 + 4k for Wan's VAE; a shorter clip trains
    # at what it has, its frame bucket) and the rate clips are resampled to (null: each clip's own)
    frames: int = 17
    fps: Optional[float] = None
    # Aspect-ratio buckets: each image trains at the bucket nearest its aspect (about the area of
    # data.resolution); every batch is drawn from one bucket.
    buckets: bool = False
    bucket_max_aspect: float = 2.0
    # Validation loss (tasks/training/validation_loss.py): this fraction of the images, a fixed seeded choice, is held out:
    # cached like the others, never trained on, scored at fixed timesteps and noise. 0: off.
    validation_split: float = 0.0
    # Caption augmentation, kohya meanings; all of it works with the text cache (see text.variants).
    caption_dropout_rate: float = 0.0
    shuffle_caption: bool = False
    keep_tokens: int = 0
    keep_tokens_separator: str = ""
    caption_tag_dropout_rate: float = 0.0
    token_warmup_step: float = 0  # 0: off; below 1: a fraction of train.max_steps
    token_warmup_min: int = 1


@dataclass
class TrainConfig:
    max_steps: int = 100
    lr: float = 1e-3
    rank: int = 4
    alpha: Optional[float] = None  # None: alpha = rank
    seed: int = 0
    batch_size: int = 2
    optimizer: str = "adamw"
    weight_decay: float = 0.0
    lr_scheduler: str = "constant"
    warmup_steps: int = 0
    max_grad_norm: float = 1.0
    weighting_scheme: str = "none"  # none | logit_normal | mode | sigma_sqrt | cosmap
    # Flow matching (Flux, SD3): sigma draws from the scheduler's sigma table (the diffusers examples);
    # uniform / shift / flux_shift draw a continuous sigma, shifted by discrete_flow_shift or the
    # resolution-dependent Flux mu (sd-scripts' --timestep_sampling)
    timestep_sampling: str = "sigma"
    discrete_flow_shift: float = 3.0  # used by timestep_sampling=shift
    gradient_accumulation_steps: int = 1  # micro-batches of train.batch_size per optimizer step
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    guidance: float = 1.0  # Flux-dev's distilled guidance value fed while training
    # Loss options (tasks/models/bases/losses.py), sd-scripts' meanings: noise + noise_offset * randn(b, c, 1, 1);
    # l2 | huber (pseudo-Huber, constant huber_c); min-SNR-gamma weights (SD1.5/SDXL only; null: off)
    noise_offset: float = 0.0
    loss: str = "l2"
    huber_c: float = 0.1
    min_snr_gamma: Optional[float] = None
    # kohya's --prior_loss_weight: the loss weight of regularisation images (data.subsets with is_reg: true)
    prior_loss_weight: float = 1.0
    # peft adapter: lora | dora (LoraConfig(use_dora=True)) | loha | lokr; rslora: scale alpha/sqrt(rank)
    network: str = "lora"
    rslora: bool = False
    # An exponential moving average of the LoRA weights (ema = decay * ema + (1 - decay) * w after each
    # optimizer step), kept in checkpoints and exported beside the plain LoRA; null: off
    ema_decay: Optional[float] = None
    # A LoRA on the text encoders too (SD1.5/SDXL; kohya's --text_encoder_lr), in its own optimizer group at
    # this lr; captions are then encoded live (tasks/models/lora_variants/text_encoder_lora.py). null: off, only the denoiser trains
    text_encoder_lr: Optional[float] = None
    target_modules: Optional[List[str]] = None  # None: the family adapter's default
    log_every: int = 10
    gradient_checkpointing: bool = False
    # With gradient_checkpointing: the blocks' saved inputs wait in host memory (tasks/training/activation_offload.py)
    gradient_checkpointing_offload: bool = False
    compile: bool = False  # regional torch.compile of the repeated blocks (tasks/training/compiled_blocks.py)
    # The last N transformer blocks' frozen weights wait on the host, copied in per use (training/block_swap.py)
    blocks_to_swap: int = 0
    memory_limit_gb: Optional[float] = None  # preflight budget; None: the device's free memory
    mixed_precision: str = "no"  # no | bf16 | fp16 (fp16 needs CUDA), through accelerate
    save_every_n_steps: int = 0  # 0: a checkpoint at the last step only
    # With data.validation_split: the held-out loss every N steps (0: at the last step only); not in the key
    validate_every_n_steps: int = 0
    # auto: continue from the latest stored checkpoint of the same trajectory (an interrupted run, or a
    # run whose max_steps grew); never: always start from step 0
    resume: str = "auto"
    # >1: the train node runs under `accelerate launch` with this many processes (data parallel; each
    # step's batch of train.batch_size is split across them). gloo on the CPU, one GPU each with CUDA.
    num_processes: int = 1
    # Several machines (accelerate's multi-node): every machine runs the same command with its own
    # machine_rank; num_processes is the total over all machines; machine 0 at main_process_ip:port leads.
    # Machines other than 0 wait for machine 0 to store the LoRA: the store must be shared.
    num_machines: int = 1
    machine_rank: int = 0
    main_process_ip: Optional[str] = None
    main_process_port: Optional[int] = None
    log_with: str = "tensorboard"  # tensorboard: loss and lr in <run dir>/tensorboard | none


@dataclass
class SampleConfig:
    prompts_file: str = MISSING
    steps: int = 4
    cfg: float = 3.5  # guidance (kohya --l)
    true_cfg: float = 2.0  # real classifier-free guidance, used when a prompt has a negative (--n / --g)
    seed: int = 0
    width: Optional[int] = None  # None: the training resolution
    height: Optional[int] = None
    grid: bool = True
    every_n_steps: int = 0  # >0: render the prompts file with the LoRA every N training steps
    # cpu: the start noise is drawn on the CPU (a seed gives the same image on any machine); device: on
    # the sampler's device.
    generator_device: str = "cpu"


@dataclass
class TextConfig:
    # false: captions are encoded live in the training loop (the encoders stay loaded); sample prompts
    # and the empty prompt are still cached, so sampling works either way.
    cache: bool = True
    # Shuffle / tag dropout with the cache: this many pre-encoded variants per caption (and warm-up length),
    # drawn from variants_seed and the caption, so a re-run reuses them.
    variants: int = 4
    variants_seed: int = 0
    fresh_draws: bool = False  # true: a new draw every step, encoded on demand (encoders stay loaded)
    offload_encoders: bool = False  # true: the train node must never load the text encoders


@dataclass
class ExportConfig:
    # kohya (sd-scripts/kohya key names) | diffusers (PEFT names) | comfyui (ComfyUI's own layout) | both
    # (kohya + diffusers); every run also gets a comfyui file (the kohya file where ComfyUI maps it fully)
    format: str = "both"


@dataclass
class StoreConfig:
    # A folder, or an fsspec URL (s3://bucket/loraflow, gs://..., memory://...) that machines share.
    root: str = ".loraflow/store"
    # With a URL root: the local working copy (None: ~/.cache/loraflow/stores/<hash of the URL>).
    cache_dir: Optional[str] = None
    # true: digest every big model file again (its path/size/mtime/inode memo is not trusted this run)
    rehash: bool = False


@dataclass
class RunnerConfig:
    # local: caching in the flow's process | dask: shards of missing items as Prefect tasks on Dask
    name: str = "local"
    address: Optional[str] = None  # an existing Dask scheduler (tcp://host:8786); None: a LocalCluster
    n_workers: int = 2  # the LocalCluster's worker processes (one thread each)
    shard_size: Optional[int] = None  # items per shard; None: 4 shards a worker


@dataclass
class LearningConfig:
    # The demo's learning score (tasks/learning.py): base vs LoRA on the generated world's prompts, into the
    # report's `learning` and samples/before_after.png. null: off (experiment=demo turns it on).
    scorer: Optional[str] = None  # shapes: tasks/demo (the world of data/demo_base and data/demo_concept)
    concept_prompts: int = 16  # prompts of the taught concept, spread over the world's colour pairs
    kept_prompts: int = 16  # prompts of what the base already knew
    seeds: List[int] = field(default_factory=lambda: [0])
    steps: int = 20
    guidance: float = 1.0
    max_sequence_length: int = 32


@dataclass
class RootConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    text: TextConfig = field(default_factory=TextConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    learning: LearningConfig = field(default_factory=LearningConfig)


def register() -> None:
    cs = ConfigStore.instance()
    cs.store(name="loraflow_schema", node=RootConfig)
    if not OmegaConf.has_resolver("repo"):
        OmegaConf.register_new_resolver("repo", lambda: str(REPO))
    if not OmegaConf.has_resolver("now"):  # Hydra registers it only in its CLI path
        OmegaConf.register_new_resolver("now", lambda fmt: datetime.now().strftime(fmt))


register()


class ConfigError(ValueError):
    """A config value is wrong; the message names the key and the fix."""


def compose(config_name: str = "train", overrides: List[str] | None = None) -> tuple[DictConfig, Path]:
    """Compose like the CLI does (for deployments, which bypass Hydra's CLI). Returns (cfg, run_dir)."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    overrides = list(overrides or [])
    check_known_keys(overrides)
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    from hydra.errors import HydraException, OverrideParseException

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        try:
            cfg = hydra_compose(config_name=config_name, overrides=overrides, return_hydra_config=True)
        except HydraException as e:  # a misspelt key or wrong type: Hydra's message names the key
            cause = f" ({e.__cause__})" if e.__cause__ else ""
            # A syntax error ("mismatched input '='") names no key: say which override it is.
            bad = f"override {e.override!r} is not valid override syntax: " if isinstance(e, OverrideParseException) else ""
            raise ConfigError(f"config {config_name!r} with overrides {overrides}: {bad}{e}{cause}") from e
    try:
        run_dir = Path(str(cfg.hydra.run.dir))
    except OmegaConfBaseException as e:  # hydra.run.dir=${nope}
        raise _config_error(e) from e
    with _unlocked(cfg):
        del cfg["hydra"]
    return cfg, run_dir


def known_keys(node=RootConfig, prefix: str = "") -> tuple[set[str], set[str]]:
    """Every setting of the schema as a dotted key, and the free-form sections (Dict fields such as
    model.arch) under which any key is accepted."""
    keys, open_sections = set(), set()
    for f in fields(node):
        key = f"{prefix}{f.name}"
        if is_dataclass(f.default_factory() if f.default_factory is not MISSING_FIELD else f.default):
            sub_keys, sub_open = known_keys(f.default_factory(), key + ".")
            keys |= sub_keys | {key}
            open_sections |= sub_open
        else:
            keys.add(key)
            if getattr(f.type, "__origin__", None) is dict or str(f.type).startswith(("Dict", "typing.Dict")):
                open_sections.add(key)
    return keys, open_sections


def check_known_keys(overrides: List[str]) -> None:
    """A key the schema does not know, with or without Hydra's `+`, is refused naming the nearest key:
    Hydra would suggest `+key=`, which adds the misspelt key and trains as if it were not there."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException:
        return  # a syntax error: compose() names the override
    keys, open_sections = known_keys()
    for o in parsed:
        key = o.key_or_group
        if o.package is not None or "/" in key or key.split(".")[0] == "hydra" or key in keys:
            continue
        if key == "experiment" and (REPO / "conf" / "experiment").is_dir():  # a config group with no key of its own
            continue
        if any(key.startswith(section + ".") for section in open_sections):
            continue
        near = difflib.get_close_matches(key, sorted(keys), n=1, cutoff=0.6)
        hint = f"; did you mean {near[0]}?" if near else ""
        raise ConfigError(f"{key} is not a loraflow setting{hint} (every key and its default: "
                          "python -m flows.train --cfg job)")


def _config_error(e: OmegaConfBaseException) -> ConfigError:
    """OmegaConf's resolution error as a ConfigError that starts with the key."""
    key = getattr(e, "full_key", None) or "config"
    reason = str(getattr(e, "msg", None) or e).split("\n    full_key:")[0]
    return ConfigError(f"{key}: {reason}")


class _unlocked:
    def __init__(self, cfg):
        self.cfg = cfg

    def __enter__(self):
        OmegaConf.set_struct(self.cfg, False)

    def __exit__(self, *exc):
        OmegaConf.set_struct(self.cfg, True)


def resolve_paths(cfg: DictConfig, cwd: str | os.PathLike | None = None) -> dict:
    """Plain dict of the config with relative paths made absolute (against the caller's cwd)."""
    cwd = Path(cwd or os.getcwd())
    try:
        plain = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as e:  # train.lr=${nope}, a recursive or mistyped interpolation, data.dir=???
        raise _config_error(e) from e
    for section, key in (("data", "dir"), ("sample", "prompts_file"), ("store", "root"), ("store", "cache_dir"),
                         ("model", "path"), ("model", "config")):
        value = plain[section].get(key)
        if value is None or (section, key) == ("store", "root") and "://" in value:  # an fsspec URL
            continue
        try:  # a NUL byte or a name too long for the file system: a clear error, not OSError/ValueError
            if "\x00" in value:
                raise ValueError("embedded NUL character")
            path = cwd / os.path.expanduser(value)
            if section != "model":
                plain[section][key] = str(path.resolve())
            elif value and path.exists():  # a local path (else a hub id, kept as is)
                plain[section][key] = str(path.resolve())
        except (OSError, ValueError) as e:
            raise ConfigError(f"{section}.{key}={value[:200]!r}: not a usable path ({e})") from e
    subsets = plain["data"].get("subsets") or []
    if not isinstance(subsets, list) or not all(isinstance(x, dict) and isinstance(x.get("dir"), str) for x in subsets):
        # an interpolation (data.subsets=${train.lr}) escapes the schema's type check
        raise ConfigError(f"data.subsets={str(subsets)[:200]}: must be a list of {{dir, repeats, caption_extension, "
                          "is_reg}}, e.g. 'data.subsets=[{dir: a, repeats: 2}]'")
    for i, subset in enumerate(subsets):
        try:
            if "\x00" in subset["dir"]:
                raise ValueError("embedded NUL character")
            subset["dir"] = str((cwd / os.path.expanduser(subset["dir"])).resolve())
        except (OSError, ValueError) as e:
            raise ConfigError(f"data.subsets[{i}].dir={subset['dir'][:200]!r}: not a usable path ({e})") from e
    return plain


def stored_as(mc: dict) -> str | None:
    """How the frozen base is stored in training: float8_e4m3fn / float8_e5m2 (model.storage_dtype, or
    model.quantize=fp8), int8 or nf4 (model.quantize); None: in model.dtype."""
    q = mc.get("quantize") or "none"
    if q == "fp8":
        return "float8_e4m3fn"
    return q if q in ("int8", "nf4") else mc.get("storage_dtype")
