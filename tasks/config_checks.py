"""The config checks that read no file and load no model: every bad key or value collected at once, each with
the key and the fix. The CLI runs them before starting Prefect (flows/cli.py), the validate node again first
(tasks/validate.py)."""
from __future__ import annotations

import importlib.util

from tasks.config import Config, ConfigError
from tasks.config_schema import TrainConfig
from tasks.data import augment, controls, first_frame, subsets, video
from tasks.data.sizes import resolve_size
from tasks.models import adapter_class
from tasks.models.lora_variants import text_encoder_lora as te_lora
from tasks.runtime import cuda_available
from tasks.training import memory, sharding, validation_loss as validation, w8a8
from tasks.training.compiled_blocks import compile_errors

_CHOICES = {("data", "resolution_type"): ("pixels", "area"), ("train", "lr_scheduler"):
            ("constant", "constant_with_warmup", "linear", "cosine"), ("train", "weighting_scheme"):
            ("none", "logit_normal", "mode", "sigma_sqrt", "cosmap"), ("model", "dtype"): ("float32", "bfloat16", "float16"),
            ("export", "format"): ("kohya", "diffusers", "comfyui", "both"), ("sample", "generator_device"): ("cpu", "device"),
            ("train", "resume"): ("auto", "never"), ("train", "optimizer"): ("adamw", "adamw8bit", "prodigy", "adafactor", "lion8bit"),
            ("train", "mixed_precision"): ("no", "bf16", "fp16"), ("train", "log_with"): ("tensorboard", "none"), ("train", "shard"): ("none", "fsdp"),
            ("train", "timestep_sampling"): ("sigma", "uniform", "shift", "flux_shift"), ("runner", "name"): ("local", "dask"), ("train", "loss"): ("l2", "huber"),
            ("train", "network"): ("lora", "dora", "loha", "lokr"), ("learning", "scorer"): (None, "shapes"),
            ("data", "captions"): ("file", "auto", "regenerate"), ("caption", "quantize"): ("none", "fp8", "int8", "nf4"),
            ("caption", "dtype"): (None, "float32", "bfloat16", "float16")}
_POSITIVE = (("train", "max_steps"), ("train", "lr"), ("train", "rank"), ("train", "batch_size"),
             ("train", "log_every"), ("train", "num_processes"), ("train", "gradient_accumulation_steps"),
             ("train", "discrete_flow_shift"), ("runner", "n_workers"), ("sample", "steps"), ("data", "resolution"), ("model", "max_sequence_length"),
             ("caption", "max_new_tokens"), ("caption", "timeout"))
def value(cfg: Config, section: str, key: str):
    """The setting `section.key` of cfg (the checks below are tables of keys)."""
    return getattr(getattr(cfg, section), key)


def check_config(cfg: Config) -> list[str]:
    errors = []
    for (section, key), allowed in _CHOICES.items():
        if value(cfg, section, key) not in allowed:
            errors.append(f"{section}.{key}={value(cfg, section, key)!r}: choose one of "
                          f"{', '.join('null' if a is None else a for a in allowed)}")
    for section, key in _POSITIVE:
        if not value(cfg, section, key) > 0:
            errors.append(f"{section}.{key}={value(cfg, section, key)!r}: must be greater than 0")
    errors += _check_device(cfg) + _check_ranges(cfg)
    n, batch = cfg.train.num_processes, cfg.train.batch_size
    if isinstance(n, int) and isinstance(batch, int) and n > max(batch, 1):
        errors.append(f"train.num_processes={n} with train.batch_size={batch}: each step's batch is split across "
                      f"the processes; use train.batch_size={n} or more, or fewer processes")
    errors += _machine_errors(cfg.train)
    if not cfg.data.bucket_max_aspect >= 1:
        errors.append(f"data.bucket_max_aspect={cfg.data.bucket_max_aspect!r}: must be at least 1 (e.g. 2.0)")
    for section, key in (("sample", "every_n_steps"), ("train", "save_every_n_steps")):
        if value(cfg, section, key) < 0:
            errors.append(f"{section}.{key}={value(cfg, section, key)!r}: must be 0 (off) or a number of steps")
    if cfg.data.missing_caption not in ("error", "empty"):
        errors.append(f"data.missing_caption={cfg.data.missing_caption!r}: choose error or empty")
    if cfg.data.bad_files not in ("error", "skip"):
        errors.append(f"data.bad_files={cfg.data.bad_files!r}: choose error (stop, list them) or skip "
                      "(leave them out, train the rest)")
    if not cfg.caption.batch_size >= 0:
        errors.append(f"caption.batch_size={cfg.caption.batch_size!r}: images a batch, or 0 for the most the card allows")
    if not cfg.caption.temperature >= 0:
        errors.append(f"caption.temperature={cfg.caption.temperature!r}: 0 (greedy) or more (sampled from caption.seed)")
    if cfg.caption.endpoint and not cfg.caption.endpoint.startswith(("http://", "https://")):
        errors.append(f"caption.endpoint={cfg.caption.endpoint!r}: an OpenAI-compatible server's URL, e.g. "
                      "http://127.0.0.1:8000/v1")
    return errors


def _check_ranges(cfg: Config) -> list[str]:
    """Numbers that compose types but nothing above bounds (nan, inf, out of range), each bound being what
    a later stage needs; a value past it would crash that stage, hang, or train/sample nonsense."""
    import math

    from tasks.data.prompts import MAX_SEED, MAX_SIDE, MAX_STEPS

    def finite(v):
        return isinstance(v, int) or math.isfinite(v)

    rules = [  # (section, key, ok(value), the rule as the message states it); null passes where the schema allows
        ("train", "lr", finite, "a finite number > 0"),
        ("train", "seed", lambda v: 0 <= v <= 2**32 - 1, "in 0..2**32-1 (numpy's seed range)"),
        ("train", "alpha", lambda v: finite(v) and v > 0, "a finite number > 0, or null (alpha = rank)"),
        ("train", "weight_decay", lambda v: finite(v) and v >= 0, "a finite number >= 0"),
        ("train", "warmup_steps", lambda v: v >= 0, "0 (off) or a number of steps"),
        ("train", "max_grad_norm", finite, "a finite number (0 or less: no clipping)"),
        ("train", "logit_mean", finite, "a finite number"),
        ("train", "logit_std", lambda v: finite(v) and v >= 0, "a finite number >= 0"),
        # SD3's mode density keeps timesteps in [0, 1] only for scales in [-1, 2/(pi-2)]
        ("train", "mode_scale", lambda v: finite(v) and -1 <= v <= 2 / (math.pi - 2), "in [-1, 1.75]"),
        ("train", "guidance", lambda v: finite(v) and v >= 0, "a finite number >= 0"),
        ("train", "noise_offset", lambda v: finite(v) and v >= 0, "a finite number >= 0 (0: off; sd-scripts uses ~0.05-0.1)"),
        ("train", "huber_c", lambda v: finite(v) and v > 0, "a finite number > 0 (sd-scripts' default 0.1)"),
        ("train", "min_snr_gamma", lambda v: finite(v) and v > 0, "a finite number > 0 (5 in the paper), or null (off)"),
        ("train", "ema_decay", lambda v: finite(v) and 0 < v < 1, "in (0, 1), e.g. 0.999, or null (off)"),
        ("train", "text_encoder_lr", lambda v: finite(v) and v > 0,
         "a finite number > 0 (e.g. 5e-5, kohya's text_encoder_lr), or null (off: the text encoders stay frozen)"),
        ("train", "prior_loss_weight", lambda v: finite(v) and v >= 0, "a finite number >= 0 (kohya's default 1.0)"),
        ("train", "memory_limit_gb", lambda v: finite(v) and v > 0, "a finite number > 0, or null (free memory)"),
        ("runner", "shard_size", lambda v: isinstance(v, int) and v > 0, "a number of items > 0, or null (4 shards a worker)"),
        ("data", "bucket_max_aspect", finite, "a finite number >= 1"),
        ("model", "seed", lambda v: 0 <= v <= MAX_SEED, "in 0..2**64-1 (torch's seed range)"),
        # DDIM (sd15) refuses more steps than its 1000 training timesteps
        ("sample", "steps", lambda v: v <= MAX_STEPS, f"at most {MAX_STEPS}"),
        ("sample", "seed", lambda v: 0 <= v <= MAX_SEED, "in 0..2**64-1 (torch's seed range)"),
        ("sample", "cfg", lambda v: finite(v) and v >= 0, "a finite number >= 0"),
        ("sample", "true_cfg", lambda v: finite(v) and v >= 0, "a finite number >= 0"),
        ("sample", "width", lambda v: v <= MAX_SIDE, f"at most {MAX_SIDE} pixels"),
        ("sample", "height", lambda v: v <= MAX_SIDE, f"at most {MAX_SIDE} pixels"),
        # every variant of every caption is encoded and stored
        ("text", "variants", lambda v: not isinstance(v, int) or v <= 1000,
         "at most 1000 (for a new draw every step: text.fresh_draws=true)"),
    ]
    area = cfg.data.resolution_type == "area"
    most = MAX_SIDE**2 / 2**20 if area else MAX_SIDE
    rules.append(("data", "resolution", lambda v: finite(v) and v <= most,
                  f"a finite number, at most {most:g} {'megapixels' if area else 'pixels'}"))
    errors = []
    for section, key, ok, rule in rules:
        v = value(cfg, section, key)
        if v is not None and not ok(v):
            errors.append(f"{section}.{key}={v!r}: must be {rule}")
    return errors


def _check_device(cfg: Config) -> list[str]:
    """Settings this machine cannot run, each with the alternative."""
    errors, cuda = [], cuda_available()
    errors += compile_errors(cfg.train, cuda)
    if cfg.train.mixed_precision == "fp16" and not cuda:
        errors.append("train.mixed_precision=fp16 needs a CUDA GPU; on the CPU use train.mixed_precision=bf16 or no")
    mp = cfg.train.mixed_precision
    if cfg.model.dtype == "float16" and (mp == "bf16" or not cuda):
        # fp16 weights train under accelerate's fp16 autocast with its loss scaler (LoRA weights fp32), as
        # the references: CUDA only, and no bf16 autocast over fp16 weights.
        why = "train.mixed_precision=bf16 contradicts it" if mp == "bf16" else "that needs a CUDA GPU"
        errors.append(f"model.dtype=float16 trains with fp16 loss scaling and {why}; use model.dtype=bfloat16 "
                      "or float32" + (" (or train.mixed_precision=fp16 / no)" if cuda else ""))
    optimizer = cfg.train.optimizer
    if optimizer in ("adamw8bit", "lion8bit"):
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            errors.append(f"train.optimizer={optimizer} needs bitsandbytes (pip install bitsandbytes) and a CUDA GPU; "
                          "use train.optimizer=adamw" + (" (or prodigy, adafactor)" if optimizer == "lion8bit" else ""))
        else:
            if not cuda:
                errors.append(f"train.optimizer={optimizer} needs a CUDA GPU; on the CPU use train.optimizer=adamw")
    if optimizer == "prodigy":
        try:
            import prodigyopt  # noqa: F401
        except ImportError:
            errors.append("train.optimizer=prodigy needs prodigyopt (pip install prodigyopt); or use train.optimizer=adamw")
    storage, quantize = cfg.model.storage_dtype, cfg.model.quantize
    if storage not in (None, "float8_e4m3fn", "float8_e5m2"):
        errors.append(f"model.storage_dtype={storage!r}: choose float8_e4m3fn, float8_e5m2 or null")
    if quantize not in ("none", "fp8", "int8", "nf4"):
        errors.append(f"model.quantize={quantize!r}: choose none, fp8, int8 or nf4")
    elif cfg.model.matmul not in w8a8.MODES:
        errors.append(f"model.matmul={cfg.model.matmul!r}: choose auto, dequantize, w8a8 or bnb")
    elif cfg.model.matmul == "w8a8" and quantize not in ("fp8", "int8") and storage != "float8_e4m3fn":
        errors.append(f"model.matmul=w8a8 multiplies an fp8 or int8 base in its own type; with model.quantize="
                      f"{quantize} there is none (nf4's is model.matmul=bnb, bitsandbytes' matmul_4bit); set "
                      "model.quantize=fp8 or int8, or model.matmul=auto")
    elif cfg.model.matmul == "w8a8" and w8a8.kind_of(cfg.model) == "fp8" and cuda_available() \
            and not w8a8.available("fp8"):
        errors.append("model.matmul=w8a8 on an fp8 base needs torch._scaled_mm's fp8 kernel, which this GPU lacks "
                      "(compute capability 8.9+: Ada, Hopper); set model.matmul=dequantize or auto")
    elif cfg.model.matmul == "bnb" and quantize != "nf4":
        errors.append(f"model.matmul=bnb multiplies an nf4 base by bitsandbytes' matmul_4bit; with model.quantize="
                      f"{quantize} there is none; set model.quantize=nf4, or model.matmul=auto")
    elif cfg.model.matmul == "bnb" and importlib.util.find_spec("bitsandbytes") is None:  # looked up, not imported
        errors.append(w8a8.BNB_MISSING)
    elif quantize != "none" and storage:
        errors.append(f"model.quantize={quantize} with model.storage_dtype={storage}: two ways to store the base; "
                      "keep one (model.quantize=fp8 is model.storage_dtype=float8_e4m3fn)")
    if cfg.text.quantize not in ("none", "fp8", "int8", "nf4"):
        errors.append(f"text.quantize={cfg.text.quantize!r}: choose none, fp8, int8 or nf4")
    elif (cfg.text.quantize != "none" or cfg.text.offload) and cfg.train.text_encoder_lr is not None:
        setting = f"text.quantize={cfg.text.quantize}" if cfg.text.quantize != "none" else "text.offload=true"
        errors.append(f"{setting} with train.text_encoder_lr: the text encoders train, in model.dtype on the "
                      f"device; drop {setting.split('=')[0]} or train.text_encoder_lr")
    if cfg.data.vae_tiling not in ("auto", "tiled", "untiled"):
        errors.append(f"data.vae_tiling={cfg.data.vae_tiling!r}: choose auto, tiled or untiled")
    return errors


def check_sizes(cfg: Config, multiple: int) -> list[str]:
    errors = []
    for key in ("width", "height"):
        value = getattr(cfg.sample, key)
        if value is not None and (value <= 0 or value % multiple):
            lo, hi = max(multiple, value // multiple * multiple), (max(value, 0) // multiple + 1) * multiple
            errors.append(f"sample.{key}={value}: must be a multiple of {multiple} for model.family="
                          f"{cfg.model.family}; use sample.{key}={lo} or {hi}")
    return errors


def config_errors(cfg: Config) -> list[str]:
    """Every error of the config alone (no file read, no model loaded), each naming its key: what the CLI
    checks before Prefect's API starts, and run() first."""
    errors = check_config(cfg)
    try:
        adapter_cls = adapter_class(cfg.model.family)
    except ConfigError as e:
        return errors + [str(e)]
    errors += check_sizes(cfg, adapter_cls.size_multiple) + augment.errors(cfg.data, cfg.text)
    most, tokens = adapter_cls.max_text_tokens, cfg.model.max_sequence_length
    if isinstance(tokens, int) and tokens > most:  # the family's pipeline refuses more (adapter.max_text_tokens)
        errors.append(f"model.max_sequence_length={tokens}: must be at most {most} for model.family={cfg.model.family}")
    if cfg.train.timestep_sampling != "sigma" and not adapter_cls.flow_matching:
        errors.append(f"train.timestep_sampling={cfg.train.timestep_sampling}: flow-matching families only "
                      f"(Flux, SD3, Z-Image, Qwen-Image, FLUX.2 [klein]); {cfg.model.family} samples DDPM "
                      f"timesteps: use train.timestep_sampling=sigma")
    errors += _loss_and_network_errors(cfg, adapter_cls) + memory.errors(cfg, adapter_cls) + subsets.subset_errors(cfg.data)
    errors += validation.errors(cfg) + sharding.errors(cfg, adapter_cls)
    if cfg.sample.offload and not adapter_cls.swap_blocks:
        errors.append(f"sample.offload=true swaps the denoiser's transformer blocks in from the host; "
                      f"model.family={cfg.model.family} has none: set it to false")
    errors += te_lora.errors(cfg, adapter_cls) + controls.errors(cfg.data, cfg.model.family, adapter_cls)
    errors += video.errors(cfg, adapter_cls) + first_frame.errors(cfg, adapter_cls)
    if cfg.data.random_crop:
        errors.append("data.random_crop=true: latents are cached once per image (center crop), so a crop drawn "
                      "anew each step cannot come from the cache; use data.buckets=true to keep each image's "
                      "aspect, or data.flip_aug=true for a cached augmentation")
    tc = cfg.text
    if tc.offload_encoders and (tc.fresh_draws or not tc.cache):
        why = "text.fresh_draws=true" if tc.fresh_draws else "text.cache=false"
        errors.append(f"text.offload_encoders=true with {why}: {why.split('=')[0]} encodes captions in the train node, "
                      f"which needs the text encoders loaded; drop one of the two (with text.cache=true and "
                      f"text.fresh_draws=false, augmentations use cached variants: text.variants=N)")
    if not errors:
        try:
            resolve_size(cfg.data.resolution, cfg.data.resolution_type, adapter_cls.size_multiple)
        except ConfigError as e:
            errors.append(str(e))
    return errors


def _machine_errors(tc: TrainConfig) -> list[str]:
    m, rank, n = tc.num_machines, tc.machine_rank, tc.num_processes
    if not isinstance(m, int) or m < 1:
        return [f"train.num_machines={m!r}: must be 1 or more"]
    errors = []
    if not isinstance(rank, int) or not 0 <= rank < m:
        errors.append(f"train.machine_rank={rank!r}: must be in 0..{m - 1} (train.num_machines={m})")
    if m > 1 and isinstance(n, int) and n % m:
        errors.append(f"train.num_processes={n} with train.num_machines={m}: num_processes is the total over all "
                      f"machines, a multiple of num_machines (e.g. train.num_processes={m * max(1, n // m)})")
    if m > 1 and not (tc.main_process_ip and tc.main_process_port):
        errors.append(f"train.num_machines={m}: set train.main_process_ip and train.main_process_port (machine 0's "
                      "address, the same on every machine)")
    return errors


def _loss_and_network_errors(cfg: Config, adapter_cls) -> list[str]:
    tc, family, errors = cfg.train, cfg.model.family, []
    if tc.min_snr_gamma is not None and adapter_cls.flow_matching:
        # Min-SNR is defined on a DDPM schedule's SNR; sd-scripts and diffusers' Flux/SD3 trainers apply none
        errors.append(f"train.min_snr_gamma={tc.min_snr_gamma}: epsilon / v-prediction families only (SD1.5, "
                      f"SDXL); {family} trains by flow matching: use train.weighting_scheme instead, or "
                      "train.min_snr_gamma=null")
    if tc.network in ("loha", "lokr"):
        # peft's LoHa/LoKr (tasks/models/lora_variants/lycoris.py) on the denoiser; peft has no rsLoRA for them, and the text
        # encoders' LoRA (tasks/models/lora_variants/text_encoder_lora.py) is a plain LoRA in diffusers' layout
        if tc.rslora:
            errors.append(f"train.network={tc.network} with train.rslora=true: rsLoRA's alpha / sqrt(rank) is a "
                          "LoRA option (peft has none for LoHa/LoKr); set train.rslora=false")
        if tc.text_encoder_lr is not None:
            errors.append(f"train.network={tc.network} with train.text_encoder_lr: the text encoders train a "
                          "plain LoRA only; use train.network=lora, or train.text_encoder_lr=null")
    if tc.network == "lokr" and not adapter_cls.lokr_file:
        errors.append(f"train.network=lokr: {family}'s ComfyUI model fuses q, k and v of unequal widths (GQA) into one "
                      "Linear, which no single LoKr holds exactly; use train.network=loha or lora")
    url = cfg.export.files_url
    if url is not None and not str(url).startswith(("http://", "https://")):
        errors.append(f"export.files_url={url}: not an http(s) URL; give the address that serves the folder "
                      "loraflow runs in (e.g. http://HOST:8000), or leave it null")
    if tc.network == "dora" and tc.text_encoder_lr is not None and cfg.export.format != "diffusers":
        # the kohya/ComfyUI files carry the denoiser's DoRA as dora_scale; the text encoders' have no writer here
        errors.append(f"train.network=dora with train.text_encoder_lr and export.format={cfg.export.format}: "
                      "the text encoders' DoRA magnitudes have no kohya layout here; set export.format=diffusers "
                      "or drop train.text_encoder_lr")
    return errors
