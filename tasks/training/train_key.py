"""The train node's key: what determines the LoRA (and what only shapes steps after k, for checkpoints)."""
from __future__ import annotations

from dataclasses import asdict

from tasks import cache_text
from tasks.config import Config, as_plain, stored_as
from tasks.config_schema import TrainConfig
from tasks.data import augment, controls, masks
from tasks.models import adapter_class
from tasks.models.lora_variants import text_encoder_lora as te_lora
from tasks.plan import Plan
from tasks.runtime import runtime
from tasks.store.hashing import key_of, key_of_hex
from tasks.training import w8a8


FP8_BASE_VERSION = "autograd-cast-1"  # the fp8 base's own version, in the key of fp8 runs only

# Settings that shape none of steps 1..k: runs that differ only in these share checkpoints, so raising
# max_steps continues from the latest stored one (unless the LR schedule itself depends on max_steps).
# (sample.every_n_steps stays in: a checkpoint of a run that did not sample has no samples to carry on.)
_NOT_TRAJECTORY = ("train.max_steps", "train.log_every", "train.save_every_n_steps", "train.resume")
# Settings that change nothing the node stores (where the loss curve is logged).
# validate_every_n_steps changes no weight: the validation losses are stored with the LoRA as computed.
_NOT_KEY = ("log_with", "machine_rank", "main_process_ip", "main_process_port",  # (every machine: one key)
            "validate_every_n_steps", "run_name",
            "blocks_to_swap",  # where weights wait between uses: the same LoRA bytes (tests/test_block_swap.py)
            "gradient_checkpointing_offload")  # likewise, saved activations (tests/test_activation_offload.py)
SCHEDULES_WITHOUT_MAX_STEPS = ("constant", "constant_with_warmup")
# Settings added since keys were first stored, with the default at which they change nothing.
CODE_VERSION = "4"  # 4: one generator per (step, batch position): the same draws however many processes
_DEFAULTS = (("gradient_accumulation_steps", 1), ("timestep_sampling", "sigma"), ("noise_offset", 0.0), ("loss", "l2"),
             ("min_snr_gamma", None), ("network", "lora"), ("rslora", False), ("num_machines", 1),
             ("prior_loss_weight", 1.0), ("ema_decay", None), ("text_encoder_lr", None),
             ("compile", False),
             ("shard", "none"), ("shard_offload", False))  # compiled kernels round differently: another LoRA


def inputs(cfg: Config, plan: Plan, latent_keys: dict[str, str], text_keys: dict[str, str]) -> dict:
    """The training key covers the base denoiser, every hyper-parameter and each item's (latent, caption) pair.

    A live-encoded caption is named by the key its cached item would have (text + encoders + settings)."""
    held = set(plan.validation_items)  # data.validation_split: scored, never trained

    texts_of, live = cache_text.caption_texts_of(cfg), {}

    def live_params() -> dict:  # cache_text.params, read once and only when a caption is encoded live
        if not live:
            live.update(cache_text.params(cfg, plan))
        return live

    def pair(it):
        draws = _draws(it)
        mask = [latent_keys[k]] if (k := masks.PREFIX + it["name"]) in latent_keys else []  # data.mask_dir
        mask += [latent_keys[controls.item_name(it["name"], k)] for k in range(len(it.get("controls", [])))]
        if draws:
            return key_of([latent_keys[it["name"]], _caption_key(texts_of, live_params, text_keys, it), *draws, *mask])
        return key_of_hex([latent_keys[it["name"]], _caption_key(texts_of, live_params, text_keys, it), *mask])

    pairs = {f"item:{it['name']}": pair(it) for it in plan.items if it["name"] not in held}
    unused = _unused(cfg.train)
    if not any(it.get("is_reg") for it in plan.items):  # it weighs reg images only
        unused.add("prior_loss_weight")
    return {"node": "train", "code": CODE_VERSION, "family": plan.family, **_family_version(plan),
            "denoiser": plan.ids["denoiser"], "scheduler": plan.ids["scheduler"],
            "dtype": cfg.model.dtype, "storage_dtype": cfg.model.storage_dtype, **_modulation(cfg),
            **({"expert": cfg.model.expert} if cfg.model.expert else {}),  # Wan 2.2's
            "text.cache": cfg.text.cache, **_loss_scaling(cfg), **runtime(),
            **{f"train.{k}": v for k, v in as_plain(cfg.train).items() if k not in _NOT_KEY and k not in unused},
            **_augmentation(cfg), **_sampling(cfg), **_validation(cfg, plan, pair), **_text_encoders(cfg, plan), **pairs}


def key_of_node(cfg: Config, plan: Plan, latent_keys: dict, text_keys: dict) -> str:
    return key_of(inputs(cfg, plan, latent_keys, text_keys))


def _text_encoders(cfg: Config, plan: Plan) -> dict:
    # train.text_encoder_lr: the encoders (and tokenizers) being trained are part of what is trained
    return {"text_encoders": plan.ids["text"]} if te_lora.enabled(cfg) else {}


def _validation(cfg: Config, plan: Plan, pair) -> dict:
    # The held-out items (their losses are stored with the LoRA), only when data.validation_split is set.
    from tasks.training.validation_loss import DRAWS, VALIDATION_SEED

    held = set(plan.validation_items)
    if not held:
        return {}
    return {"validation": {"split": cfg.data.validation_split, "seed": VALIDATION_SEED, "draws": DRAWS,
                           "items": {it["name"]: pair(it) for it in plan.items if it["name"] in held}}}


def _draws(item: dict) -> list[dict]:
    # How an item is drawn (data.subsets, kohya N_name folders), in its pair only when not the default, so
    # the items of a plain folder keep their keys.
    draws = {k: item[k] for k in ("repeats", "is_reg") if k in item}
    return [draws] if draws else []


def _unused(tc: TrainConfig) -> set[str]:
    """Settings added since keys were first stored, left out of the key while they have no effect (at their
    default), so every earlier LoRA keeps its key."""
    out = {k for k, default in _DEFAULTS if getattr(tc, k) == default}
    out |= {"huber_c"} if tc.loss != "huber" else set()
    return out | ({"discrete_flow_shift"} if tc.timestep_sampling != "shift" else set())


def _family_version(plan: Plan) -> dict:
    # The family's own training version (FamilyAdapter.train_version), in the key only once it is set.
    version = adapter_class(plan.family).train_version
    return {"family_version": version} if version else {}


def _loss_scaling(cfg: Config) -> dict:
    # fp16 weights train with accelerate's fp16 loss scaling whatever train.mixed_precision says (since issue 18)
    return {"loss_scaling": "fp16"} if cfg.model.dtype == "float16" else {}


def _modulation(cfg: Config) -> dict:
    # In the key only where it changes the weights: every existing key stays as it was. An fp8 base's
    # LoRA bytes changed with tasks/training/fp8_base.py (the autograd-safe cast replaced layerwise casting).
    quantize = cfg.model.quantize
    if not stored_as(cfg.model):
        return {}
    return {"fp8_base": FP8_BASE_VERSION, **({"quantize": quantize} if quantize != "none" else {}),
            **({"storage_modulation": True} if cfg.model.storage_modulation else {}),
            # activations quantized per token (tasks/training/w8a8.py), or bitsandbytes' NF4 (nf4_kernel.py: its own
            # double quantization): other numbers than the fallback's
            **({"matmul": matmul} if (matmul := w8a8.resolve(cfg.model)) != "dequantize" else {})}


def _sampling(cfg: Config) -> dict:
    # Samples during training are outputs of this node (the prompts file's content is not: it is re-read
    # at each sample point, and editing it must not retrain).
    every = cfg.sample.every_n_steps
    return {"sample.every_n_steps": every} if every else {}


def _augmentation(cfg: Config) -> dict:
    aug = cache_text.caption_aug(cfg)
    if not augment.active(aug):
        return {}
    return {"augment": {**asdict(aug), "mode": augment.text_mode(te_lora.text_settings(cfg), aug),
                        "variants_seed": cfg.text.variants_seed}}


def trajectory_key(node_inputs: dict, tc: TrainConfig) -> str:
    keep = {k: v for k, v in node_inputs.items() if k not in _NOT_TRAJECTORY}
    if tc.lr_scheduler not in SCHEDULES_WITHOUT_MAX_STEPS:
        keep["train.max_steps"] = tc.max_steps
    return key_of(keep)


def _caption_key(texts_of, live_params, text_keys: dict, item: dict) -> str:
    """The caption's identity for the training key: its cached texts' keys (all variants), or, when
    training encodes captions itself, the key its cached item would have (text + encoders + settings).
    `texts_of`: cache_text.caption_texts_of(cfg); `live_params()`: cache_text.params(cfg, plan)."""
    labels = texts_of(item)
    if labels:
        owner = cache_text.caption_owner(item)  # a flipped twin's caption is its source's
        return key_of_hex(sorted(text_keys[cache_text.caption_name(owner, label)] for label in labels))
    return key_of({**live_params(), "text": item["caption"]})


