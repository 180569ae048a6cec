"""The config's schema: one dataclass per Hydra group, the types every node reads (`cfg.train.lr`).

Registered in Hydra's ConfigStore (by tasks/config.py, so that reading the schema imports neither Hydra nor
OmegaConf) and named first in ``conf/train.yaml``'s defaults, so a misspelt key or a
wrong type fails at composition, before any work, with the full key in the message; in code, a misspelt
attribute fails at type-check time (and tests/test_config_attributes.py checks every `cfg.<group>.<key>`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
MISSING = "???"  # omegaconf.MISSING: composition fails while such a setting is unset (imports nothing here)


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
    # auto | dequantize | w8a8 | bnb: how a stored base multiplies (tasks/training/w8a8.py): w8a8 an fp8 / int8
    # one, bnb an nf4 one (bitsandbytes' matmul_4bit, nf4_kernel.py); auto: bnb for nf4 on a CUDA GPU that has its
    # kernels, else dequantize (the weight upcast, then a compute-dtype matmul; faster than w8a8 on an H200)
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
    # file: captions are the caption files (as kohya reads them) | auto: an image without one is captioned by
    # caption.model (the caption node, tasks/caption.py) | regenerate: as auto, every model caption made anew.
    # A hand-written caption file always wins.
    captions: str = "file"
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
    # Image-to-video families (tasks/data/first_frame.py): each clip's condition image, first_frame (null: the
    # default) or beside (a same-stem image next to the clip)
    condition_image: Optional[str] = None
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
    # cache_latents' VAE: auto (tiled where the preflight says an untiled encode does not fit the device) | tiled |
    # untiled; a tiled latent differs from an untiled one, so its key says which (tasks/cache_latents.py)
    vae_tiling: str = "auto"


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
    # The flow run's name in Prefect's UI; null: made from the family, the data folder and the overrides
    run_name: Optional[str] = None
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
    # none: every process holds the whole base (data parallel); fsdp: the frozen base sharded over the run's
    # processes with torch's FSDP2, one unit per repeated block (tasks/training/sharding.py)
    shard: str = "none"
    # With train.shard=fsdp: the shards wait in host memory between uses (FSDP2's CPUOffloadPolicy)
    shard_offload: bool = False
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
    # The final sample node's denoiser (tasks/sample.py): streamed in and stored as model.quantize, as training
    # stored it; offload: every block waits on the host, copied in as it runs (the train node's block swap)
    offload: bool = False


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
    # none | fp8 | int8 | nf4: how cache_text stores the text encoders' Linear weights as it streams them in
    # (tasks/models/loading/text_load.py); in each text's cache key, so embeddings of differently stored
    # encoders never mix
    quantize: str = "none"
    # true: the encoders' layers wait on the host and are copied to the GPU one at a time, the next prefetched
    # (the train node's block swap over every layer), for an encoder that does not fit the card even quantized
    offload: bool = False


@dataclass
class CaptionConfig:
    # The caption node (tasks/caption.py; data.captions=auto|regenerate). A vision-language model's folder or hub
    # id (Qwen2.5-VL / Qwen3-VL instruct models), tiny_vlm (built locally, for tests), or with `endpoint` the
    # model name an OpenAI-compatible server serves.
    model: str = "Qwen/Qwen2.5-VL-7B-Instruct"
    prompt: str = ("Describe this image in one or two sentences as a caption for training an image generator: "
                   "the subject, its appearance, the setting, the composition and the style. Write only the caption.")
    max_new_tokens: int = 128  # the token budget of one caption
    temperature: float = 0.0  # 0: greedy (the same caption every time); else sampled from `seed`
    seed: int = 0
    # the largest image the model sees, in pixels (Qwen2.5-VL's own limit is 12.8 MP: 16k vision tokens); in the key
    max_pixels: Optional[int] = 1048576
    # images a generate call (left-padded; 1 is exact, larger is faster on a GPU); 0: the largest (up to 16) whose
    # preflight fits the card (tasks/captioning/memory.py)
    batch_size: int = 1
    dtype: Optional[str] = None  # null: model.dtype
    quantize: str = "none"  # none | fp8 | int8 | nf4: its Linears stored so, as text.quantize stores the encoders
    offload: bool = False  # its layers wait on the host, one at a time on the GPU (as text.offload)
    # An OpenAI-compatible server (vLLM, Ollama, llama.cpp server): its /v1 URL, e.g. http://127.0.0.1:8000/v1
    endpoint: Optional[str] = None
    timeout: float = 120.0  # seconds one request may take
    # true: each caption also written next to its image as <stem><data.caption_extension> (never over a
    # hand-written one; .loraflow-captions.json in the folder records what loraflow wrote)
    beside_images: bool = False


@dataclass
class ExportConfig:
    # kohya (sd-scripts/kohya key names) | diffusers (PEFT names) | comfyui (ComfyUI's own layout) | both
    # (kohya + diffusers); every run also gets a comfyui file (the kohya file where ComfyUI maps it fully)
    format: str = "both"
    # A URL serving the folder loraflow runs in (e.g. `python -m http.server 8000` there: http://HOST:8000):
    # the LoRA files then appear in Prefect's UI as links under it; null: as their paths (a browser on another
    # machine cannot open a file:// link)
    files_url: Optional[str] = None


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
    caption: CaptionConfig = field(default_factory=CaptionConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    learning: LearningConfig = field(default_factory=LearningConfig)


Config = RootConfig  # the name nodes annotate with
