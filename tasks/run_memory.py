"""The preflight of the whole run (issue 61): each node's peak on the device and the host RAM it needs, from the
model folder's config.json files and safetensors headers (no weights loaded), as tasks/training/memory.py does for
the train node. `validate` refuses a run that one node cannot fit, before any node runs, naming settings that fit
every node; the report has the figures under `memory_estimate.nodes`.

What each node holds (the nodes run one after another: the run's peak is the largest):
- cache_text: the family's text encoders, all loaded together, their Linear weights stored as `text.quantize` says
  (tasks/models/loading/text_load.py: fp8, torchao's int8 / NF4; embeddings, norms, biases, convolutions in
  model.dtype), one Linear dequantized at a time (tasks/training/memory.py's UPCAST_BYTES x the largest), and one
  forward at model.max_sequence_length tokens (activations_bytes). `text.offload`: the layers' Linear / Conv
  weights wait on the host and at most two layers are on the device (block_swap.swap_every_layer).
- cache_latents: the VAE and one item's encode (tasks/data/vae_tiling.py: encode_peak_gb; `data.vae_tiling`), and
  an image-to-video family's condition encoder.
- train: tasks/training/memory.py's estimate and tasks/training/host_memory.py's host need, as before.
- sample: the denoiser(s) the pipeline runs stored as `model.quantize` (the train node's layers and skip
  patterns), the LoRA, the VAE, no text encoders (cached prompts); the larger of one inference forward at the
  sample size (INFER_FACTORS) with a weight's dequantize, and the VAE's decode (DECODE). `sample.offload`: every
  block's weights wait on the host, at most two blocks on the device (block_swap.py).

Host RAM a node needs: the process (host_memory.PROCESS_GB), what waits there (`host_held_gb`) and its loading's
largest tensor as read and cast. The CUDA context and fragmentation are in no figure: validate compares with the
device's free memory (the context made already) or train.memory_limit_gb; the card advice keeps 1 GiB for them."""
from __future__ import annotations

import functools
import json
import re
import struct
from pathlib import Path

from tasks.config import Config, ConfigError, stored_as, updated
from tasks.training.host_memory import PROCESS_GB
from tasks.training.memory import (GB, UPCAST_BYTES, DTYPE_BYTES, lora_params, block_order, layerwise_skip_patterns,
                                   lora_targets, stored_bytes, weight_bytes)

STORAGE = {"fp8": "float8_e4m3fn", "int8": "int8", "nf4": "nf4"}  # text.quantize -> memory.py's storage names
KINDS = ("none", "fp8", "int8", "nf4")
# One inference forward's live peak (no grad, the LoRA loaded) in values per token x width: (its own peak, what is live
# beside the dequantize of the largest stored Linear), by denoiser class; a family measured on its own declares
# FamilyAdapter.infer_factors (Wan 2.2 TI2V-5B: its AdaLN tensors are per token). Measured by bench.memory_nodes
# (the sample rows' forward_gib: live storages of the forward on fake tensors at the real configs); the second
# from the int8 / NF4 rows (Wan's an upper bound: its forward's own
# peak hides it). Others: the largest
INFER_FACTORS = {"FluxTransformer2DModel": (17.1, 13.4),
                 "QwenImageTransformer2DModel": (14.5, 6.1), "Flux2Transformer2DModel": (29.4, 2.4),
                 "WanTransformer3DModel": (12.3, 9.2), "LTX2VideoTransformer3DModel": (23.2, 7.1)}
INFER_DEFAULT = (37.4, 13.4)
# A VAE decode's live peak: factor x its last level's activation (c0 x H/p x W/p x frames in flight, as vae_tiling's
# encode; c0 the decoder's base width, p the pixels a patch folds) plus the decoded clip, by VAE class (Wan 2.2's
# residual VAE apart), measured likewise. Frames in flight: the Wan / Qwen-Image decoder makes 4 frames a latent
# frame (its causal cache), LTX-2's all of them at once
DECODE = {"AutoencoderKL": (6.0, lambda f: 1), "AutoencoderKLFlux2": (6.0, lambda f: 1),
          "AutoencoderKLQwenImage": (18.0, lambda f: min(f, 4)), "AutoencoderKLWan": (13.3, lambda f: min(f, 4)),
          "AutoencoderKLWan+residual": (21.0, lambda f: min(f, 4)), "AutoencoderKLLTX2Video": (2.3, lambda f: f + 1),
          # HunyuanVideo's (Kandinsky 5): every frame at once; measured by bench.memory --nodes (kandinsky5_lite:sample:
          # nf4, 33 frames at 768x512: a decode peak of 14.45 GiB = 4.65 x the first level at full size x 33 frames)
          "AutoencoderKLHunyuanVideo": (4.7, lambda f: f),
          # Qwen-Image 2.1's (its 144-wide decoder): qwenimage21:sample at 1024 px, a decode peak of 6.28 GiB = 22.3 x
          # the last level at full size (the default read it 6 % low)
          "AutoencoderKLQwenImage21+residual": (22.4, lambda f: min(f, 4))}
DECODE_DEFAULT = (21.0, lambda f: f)
# transformers' modules a text encoder keeps out of fp8 (text_load._unstored: T5's `wo`, `_keep_in_fp32_modules`),
# and in fp32 under float16 (its dtype plan), by the architecture config.json names
KEEP_FP32 = {"T5EncoderModel": ("wo",), "UMT5EncoderModel": ("wo",)}
_EMBEDDING = re.compile(r"(^|\.)(shared|relative_attention_bias|[^.]*embed[^.]*)$")  # nn.Embedding module paths


_ELEMENT = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
            "U8": 1, "BOOL": 1}


@functools.lru_cache(maxsize=64)
def _entries_at(folder: str, stamp: tuple) -> dict:
    """The headers of the files from_pretrained reads (stream_load.folder_entries' choice: the sharded index's, else
    the canonical file); header-only files read too (the benchmarks' full-size folders)."""
    folder = Path(folder)
    index = sorted(folder.glob("*.safetensors.index.json"), key=lambda p: (p.name.count(".") > 3, p.name))
    canonical = [folder / n for n in ("diffusion_pytorch_model.safetensors", "model.safetensors") if (folder / n).exists()]
    files = [folder / f for f in sorted(set(json.loads(index[0].read_text())["weight_map"].values()))] if index else \
        canonical[:1] or sorted(folder.glob("*.safetensors"))
    out = {}
    for file in files:
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        out.update({k: (tuple(v["shape"]), _numel(v["shape"]) * _ELEMENT.get(v["dtype"], 2))
                    for k, v in header.items() if k != "__metadata__"})
    return out


def entries(folder: Path) -> dict[str, tuple[tuple, int]]:
    """name -> (shape, bytes in the file) of a model folder's tensors (read once per file version)."""
    stamp = tuple((f.name, f.stat().st_mtime_ns, f.stat().st_size) for f in sorted(Path(folder).glob("*.safetensors*")))
    return _entries_at(str(folder), stamp)


def _numel(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def _weights_folder(model_dir: Path, name: str) -> Path | None:
    folder = Path(model_dir) / name
    return folder if folder.is_dir() and any(folder.glob("*.safetensors")) else None


def _loading_gb(ents: dict, dtype_bytes: int | None = None) -> float:
    """Host bytes of a streamed load at its largest tensor: as read, and its copy cast to `dtype_bytes` where the file
    holds another dtype (text_load: on the host with text.offload, else on the device); None: the denoiser's streamed
    load, an fp32 copy (host_memory.loading_gb)."""
    shape, file = max(ents.values(), key=lambda e: _numel(e[0]), default=((), 0))
    n = _numel(shape)
    cast = n * 4 if dtype_bytes is None else n * dtype_bytes if n and file != n * dtype_bytes else 0
    return (file + cast) / GB


def _whole(ents: dict) -> float:
    """Host bytes of a module diffusers' from_pretrained reads whole (the VAE, LTX-2's connectors): its file."""
    return float(sum(b for _, b in ents.values()))


def layers(names) -> dict[str, list[str]]:
    """The children of the outermost ModuleLists, as block_swap.swap_every_layer finds them, by name: the first
    numeric component of a path; a list's indices run 0..n-1 (an nn.Sequential's skip the parameterless modules
    between its layers, Qwen2.5-VL's merger.mlp: not a ModuleList)."""
    lists: dict[str, dict[int, list[str]]] = {}
    for n in names:
        parts = n.split(".")
        i = next((i for i, p in enumerate(parts) if p.isdigit()), None)
        if i is not None:
            lists.setdefault(".".join(parts[:i]), {}).setdefault(int(parts[i]), []).append(n)
    return {f"{lst}.{i}": members for lst, idx in lists.items() if sorted(idx) == list(range(len(idx)))
            for i, members in idx.items()}


def _castable(name: str, shape) -> bool:
    """A Linear's or a convolution's weight (what text.quantize stores where 2-D, what a swap moves), by its name."""
    return name.endswith(".weight") and len(shape) >= 2 and not _EMBEDDING.search(name.rpartition(".")[0])


# -- cache_text ------------------------------------------------------------------------------------------------------
def _text_config(config: dict) -> dict:
    return {**config, **(config.get("text_config") or {})}


def text_activations(config: dict, tokens: int, act_bytes: int = 2, head: bool = True) -> float:
    """Bytes one text forward holds at its peak (batch 1): a decoder language model returns every layer's hidden
    states (the pipelines read some of them) and fills its KV cache, then the logits (`head`: its output head
    loaded, text_load.TextLoading.head) or one layer's gated MLP; an encoder (T5, CLIP) two states, its MLP and
    T5's position bias."""
    c = _text_config(config)
    h = c.get("hidden_size") or c.get("d_model")
    n = c.get("num_hidden_layers") or c.get("num_layers")
    inter = c.get("intermediate_size") or c.get("d_ff") or 4 * h
    heads = c.get("num_attention_heads") or c.get("num_heads")
    kind = str(config.get("model_type", ""))
    if kind.startswith("clip"):
        tokens = min(tokens, c.get("max_position_embeddings", tokens))
    if kind in ("t5", "umt5") or kind.startswith("clip"):
        bias = 2 * heads * tokens * tokens * act_bytes if kind in ("t5", "umt5") else 0
        return (2 * tokens * h + 3 * tokens * inter) * act_bytes + bias
    kv, hd = c.get("num_key_value_heads") or heads, c.get("head_dim") or h // heads
    states = ((n + 1) * tokens * h + 2 * n * tokens * kv * hd) * act_bytes
    lm = head and is_lm(config)
    return states + max(tokens * c.get("vocab_size", 0) * act_bytes if lm else 0, 3 * tokens * inter * act_bytes)


def is_lm(config: dict) -> bool:
    """A language model with an output head (`lm_head`), by its config.json's architectures."""
    return any(a.endswith(("ForCausalLM", "ForConditionalGeneration")) for a in config.get("architectures") or ())


def text_encoder(folder: Path, dtype: str, quantize: str, offload: bool, tokens: int, keep: tuple = (),
                 head: bool = True) -> dict:
    """One text encoder as cache_text loads it (the module doc), bytes; `keep`: Linears never stored
    (text_load.TextLoading.keep); `head`: a language model's output head loaded (TextLoading.head; cache_text
    drops it)."""
    config = json.loads((folder / "config.json").read_text())
    ents = entries(folder)
    if not head and is_lm(config):
        ents = {k: v for k, v in ents.items() if not re.search(r"(^|\.)lm_head\.", k)}
    arch = next(iter(config.get("architectures") or ()), "")
    fp32 = KEEP_FP32.get(arch, ()) if dtype == "float16" else ()
    unstored = (KEEP_FP32.get(arch, ()) if quantize == "fp8" else ()) + tuple(keep)

    def under(name, modules):
        return any(re.search(f"(^|\\.){m}($|\\.)", name) for m in modules)

    size, stored, largest = {}, set(), 0
    for name, (shape, _) in ents.items():
        elements = _numel(shape)
        linear = _castable(name, shape) and len(shape) == 2
        if under(name, fp32):
            size[name] = elements * 4
        elif linear and quantize != "none" and not under(name, unstored) and not (quantize == "nf4" and elements % 64):
            size[name], largest = stored_bytes(elements, STORAGE[quantize]), max(largest, elements)
            stored.add(name)
        else:
            size[name] = elements * DTYPE_BYTES[dtype]
    held = resident_copies = 0.0
    if offload:  # the layers' Linear / Conv weights wait on the host; copies of two layers at most on the device
        per_layer = [sum(size[n] for n in members if _castable(n, ents[n][0])) for members in layers(ents).values()]
        held, resident_copies = float(sum(per_layer)), float(sum(sorted(per_layer)[-2:]))
    act_bytes = 4 if dtype == "float32" else 2
    return {"weights": sum(size.values()) - held + resident_copies, "held": held, "activations": text_activations(config, tokens, act_bytes, head),
            "transient": UPCAST_BYTES.get(STORAGE.get(quantize), 0.0) * largest,
            "loading": _loading_gb(ents, DTYPE_BYTES[dtype] if offload else 0) * GB}


def cache_text(cfg: Config, adapter) -> dict:
    tc, mc = cfg.text, cfg.model
    parts = {}
    for name in adapter.text_components:
        folder = _weights_folder(adapter.model_dir, name)
        if folder is None:
            continue
        if name.startswith("text_encoder"):  # transformers' encoders (text_load.py); others (LTX-2's connectors) as-is
            parts[name] = text_encoder(folder, mc.dtype, tc.quantize, tc.offload, mc.max_sequence_length, head=False)
        else:
            ents = entries(folder)
            parts[name] = {"weights": sum(_numel(s) for s, _ in ents.values()) * DTYPE_BYTES[mc.dtype], "held": 0.0,
                           "activations": 0.0, "transient": 0.0, "loading": _whole(ents)}
    weights = sum(p["weights"] for p in parts.values())
    # the encoders run one after another: the largest forward and dequantize
    peak = max((p["activations"] + p["transient"] for p in parts.values()), default=0.0)
    held = sum(p["held"] for p in parts.values())
    setting = f"text.quantize={tc.quantize}" + (" text.offload=true" if tc.offload else "")
    return _node((weights + peak) / GB, held / GB, max((p["loading"] for p in parts.values()), default=0) / GB,
                 setting, weights_gb=weights / GB, activations_gb=peak / GB)


def _node(device_gb: float, held_gb: float, loading_gb: float, setting: str, **parts) -> dict:
    return {"device_gb": device_gb, "host_gb": PROCESS_GB + held_gb + loading_gb, "host_held_gb": held_gb,
            "setting": setting, **parts}


# -- cache_latents ---------------------------------------------------------------------------------------------------
def encode_gb(vae_config: dict, width: int, height: int, frames: int, dtype: str, tiled: bool) -> float:
    """One item's VAE encode, its weights included (GiB): data.vae_tiling's estimate (tasks/data/vae_tiling.py)."""
    from tasks.data.vae_tiling import encode_peak_gb

    return encode_peak_gb(vae_config, width, height, frames, dtype, tiled)


def cache_latents(cfg: Config, adapter, size: tuple[int, int], budget_gb: float | None) -> dict:
    mc, mode = cfg.model, cfg.data.vae_tiling
    folder = Path(adapter.model_dir) / "vae"
    config = {**json.loads((folder / "config.json").read_text()), **getattr(adapter, "vae_tiling", {})}
    frames = cfg.data.frames if adapter.clips else 1
    untiled = encode_gb(config, *size, frames, mc.dtype, tiled=False)
    tiled = mode == "tiled" or mode == "auto" and budget_gb is not None and untiled > budget_gb  # as cache_latents does
    device = encode_gb(config, *size, frames, mc.dtype, tiled=True) if tiled else untiled
    other = 0.0  # an image-to-video family's condition encoder (Wan 2.1's CLIP), loaded beside the VAE
    for name in adapter.latent_components:
        f = _weights_folder(adapter.model_dir, name) if name != "vae" else None
        other += sum(_numel(s) for s, _ in entries(f).values()) * DTYPE_BYTES[mc.dtype] / GB if f else 0.0
    vae_ents = entries(folder)
    setting = f"data.vae_tiling={mode}" + (f" ({'tiled' if tiled else 'untiled'})" if mode == "auto" else "")
    return _node(device + other, 0.0, _whole(vae_ents) / GB, setting, tiled=tiled,
                 untiled_gb=untiled + other)


# -- sample ----------------------------------------------------------------------------------------------------------
def sample_size(cfg: Config, size: tuple[int, int], prompts=(), clips: bool = False) -> tuple[int, int, int]:
    """The largest image (or clip) the sample node renders: the prompts' --w / --h, else sample.width / height,
    else the training size; a video family's frames (a prompt's, else data.frames)."""
    sc = cfg.sample

    def frames(p):
        return (p.get("frames") or cfg.data.frames) if clips else 1
    sizes = [(p.get("width") or sc.width or size[0], p.get("height") or sc.height or size[1], frames(p))
             for p in prompts] or [(sc.width or size[0], sc.height or size[1], frames({}))]
    return max(sizes, key=lambda s: s[0] * s[1] * s[2])


def decode_gb(vae_config: dict, width: int, height: int, frames: int, dtype: str) -> float:
    """A VAE decode's live peak (GiB), weights aside: DECODE's factor x the decoder's last level at full size, and
    the decoded pixels."""
    from tasks.data.vae_tiling import level_channels

    kind = vae_config.get("_class_name", "") + ("+residual" if vae_config.get("is_residual") else "")
    factor, in_flight = DECODE.get(kind, DECODE_DEFAULT)
    c0 = vae_config.get("decoder_base_dim") or level_channels(vae_config)[0]
    patch = vae_config.get("patch_size") if kind in ("AutoencoderKLLTX2Video", "AutoencoderKLWan+residual") else 1
    patch = (patch[0] if isinstance(patch, (list, tuple)) else patch) or 1
    size = 4 if dtype == "float32" else 2
    level = c0 * (width // patch) * (height // patch) * in_flight(frames) * size
    return (factor * level + 3 * width * height * frames * size) / GB


def sample(cfg: Config, adapter, size: tuple[int, int], prompts=()) -> dict:
    mc, dtype = cfg.model, cfg.model.dtype
    stored = stored_as(mc)
    skip = layerwise_skip_patterns(adapter.denoiser_cls, mc.storage_modulation) if stored else ()
    resident = held = lora = 0.0
    largest, loading, config = 0, 0.0, None
    for sub in adapter.sample_denoisers():
        folder = Path(adapter.model_dir) / sub
        ents = entries(folder)
        shapes = {k: list(s) for k, (s, _) in ents.items()}
        per = weight_bytes(shapes, dtype, stored, skip)
        largest = max([largest] + [_numel(shapes[k]) for k, b in per.items() if stored and k.endswith(".weight")
                                   and len(shapes[k]) >= 2 and b < _numel(shapes[k]) * DTYPE_BYTES[dtype]])
        swapped = copies = 0.0
        if cfg.sample.offload:  # every block's Linear / Conv weights wait on the host, copies of two on the device
            blocks = [sum(b for k, b in per.items() if k.startswith(f"{name}.{i}.") and k.endswith(".weight")
                          and len(shapes[k]) >= 2) for name, i in block_order(shapes, adapter.swap_blocks)]
            swapped, copies = sum(blocks), sum(sorted(blocks)[-2:])
        resident += sum(per.values()) - swapped + copies
        held += swapped
        loading = max(loading, _loading_gb(ents))
        if sub == adapter.denoiser_subfolder:
            config = json.loads((folder / "config.json").read_text())
            lora = lora_params(shapes, lora_targets(cfg.train, adapter), cfg.train.rank) * DTYPE_BYTES[dtype]
    w, h, frames = sample_size(cfg, size, prompts, adapter.clips is not None)
    tokens, width, _ = adapter.activation_geometry(config, (w, h), mc.max_sequence_length, frames)
    act = 4 if dtype == "float32" else 2
    peak, beside = adapter.infer_factors or INFER_FACTORS.get(config.get("_class_name"), INFER_DEFAULT)
    from tasks.training import w8a8

    upcast = f"{stored}+bnb" if stored == "nf4" and w8a8.resolve(mc) == "bnb" else stored
    dequantize = UPCAST_BYTES.get(upcast, 0.0) * largest
    forward = max(peak * tokens * width * act, dequantize + beside * tokens * width * act if dequantize else 0.0)
    vae = Path(adapter.model_dir) / "vae"
    vae_bytes = sum(_numel(s) for s, _ in entries(vae).values()) * DTYPE_BYTES[dtype]
    decode = decode_gb(json.loads((vae / "config.json").read_text()), w, h, frames, dtype) * GB
    device = resident + lora + vae_bytes + max(forward, decode)
    setting = f"model.quantize={mc.quantize}" + (" sample.offload=true" if cfg.sample.offload else "")
    return _node(device / GB, held / GB, loading, setting, weights_gb=(resident + lora + vae_bytes) / GB,
                 forward_gb=forward / GB, decode_gb=decode / GB, size=[w, h, frames])


# -- the run ---------------------------------------------------------------------------------------------------------
def train_setting(cfg: Config) -> str:
    tc = cfg.train
    return " ".join([f"model.quantize={cfg.model.quantize}"] + [s for s, on in (
        ("train.gradient_checkpointing=true", tc.gradient_checkpointing),
        ("train.gradient_checkpointing_offload=true", tc.gradient_checkpointing_offload),
        (f"train.blocks_to_swap={tc.blocks_to_swap}", tc.blocks_to_swap)) if on])


def nodes(cfg: Config, adapter, size: tuple[int, int], prompts=(), train: dict | None = None,
          budget_gb: float | None = None) -> dict:
    """{"nodes": {node: {device_gb, host_gb, host_held_gb, setting, ...}}, "peak_gb", "host_gb"} for this run;
    `prompts`: the plan's sample prompts (a list; none: the sample node renders nothing and loads nothing), or ()
    for the default sample size; `train`: the train node's estimate (memory.preflight + host_memory.preflight)."""
    out = {"cache_latents": cache_latents(cfg, adapter, size, budget_gb), "cache_text": cache_text(cfg, adapter)}
    if train is not None:
        out["train"] = {"device_gb": train["total_gb"], "host_gb": train.get("host_need_gb", PROCESS_GB + train["host_gb"]),
                        "host_held_gb": train["host_gb"], "setting": train_setting(cfg)}
    out["sample"] = sample(cfg, adapter, size, prompts) if prompts != [] else _node(0.0, 0.0, 0.0, "no sample prompts")
    return {"nodes": out, "peak_gb": max(n["device_gb"] for n in out.values()),
            "host_gb": max(n["host_gb"] for n in out.values())}


def run_estimate(cfg: Config, adapter, size: tuple[int, int], prompts=(), train: dict | None = None,
                 budget_gb: float | None = None) -> dict:
    """The whole run's estimate (`nodes`), the train node's computed here when not given."""
    if train is None:
        from tasks.training import host_memory, memory

        train = memory.estimate(cfg, adapter.model_dir, adapter.denoiser_subfolder, lora_targets(cfg.train, adapter),
                                size, cfg.model.max_sequence_length,
                                adapter.denoiser_cls if stored_as(cfg.model) else None, adapter.swap_blocks,
                                adapter.denoisers, geometry=adapter.activation_geometry,
                                factors=memory.family_factors(adapter))
        train.update(host_memory.preflight(cfg, adapter, size, train, cuda=False))
    return nodes(cfg, adapter, size, prompts, train, budget_gb)


# What makes a node fit, in the order to try (each node's settings touch that node alone)
def remedies(cfg: Config, node: str) -> list[dict]:
    if node == "cache_text":
        kinds = KINDS[KINDS.index(cfg.text.quantize):]
        return [{"text.quantize": k} for k in kinds[1:]] + \
            ([] if cfg.text.offload else [{"text.quantize": k, "text.offload": True} for k in kinds])
    if node == "sample":
        return [] if cfg.sample.offload else [{"sample.offload": True}]
    if node == "cache_latents":
        return [] if cfg.data.vae_tiling in ("tiled", "auto") else [{"data.vae_tiling": "tiled"}]
    return []


def _said(change: dict, cfg: Config) -> str:
    # text.quantize unchanged beside text.offload is not said
    return " ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in change.items()
                    if str(_get(cfg, k)) != str(v))


def _get(cfg: Config, key: str):
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def _node_of(node: str, cfg: Config, adapter, size, prompts, budget_gb) -> dict:
    return {"cache_text": lambda: cache_text(cfg, adapter), "sample": lambda: sample(cfg, adapter, size, prompts),
            "cache_latents": lambda: cache_latents(cfg, adapter, size, budget_gb)}[node]()


def fitting(cfg: Config, adapter, size, prompts, node: str, budget_gb: float, host_gb: float | None) -> tuple | None:
    """(the settings, the node's estimate) of the first remedy that fits the device and the host; None."""
    for change in remedies(cfg, node):
        est = _node_of(node, updated(cfg, change), adapter, size, prompts, budget_gb)
        if est["device_gb"] <= budget_gb and (host_gb is None or est["host_gb"] <= host_gb):
            return _said(change, cfg), est
    return None


def check(cfg: Config, adapter, size: tuple[int, int], prompts, train: dict, host: tuple[float, str] | None = None) -> dict:
    """The run's estimate; raises ConfigError (one line) when a node other than train (whose preflight refused
    already) exceeds the device budget (train's: train.memory_limit_gb or the device's free memory) or, with a
    GPU (`host` given), the available RAM, naming settings that fit every node."""
    budget, source = train.get("budget_gb"), train.get("budget_source", "")
    est = nodes(cfg, adapter, size, prompts, train, budget)
    over = {n: e for n, e in est["nodes"].items() if n != "train" and (
        budget is not None and e["device_gb"] > budget or host is not None and e["host_gb"] > host[0])}
    if not over:
        return est
    fits, stuck = [], []
    for n in over:
        found = fitting(cfg, adapter, size, prompts, n, budget if budget is not None else float("inf"),
                        host[0] if host else None)
        if found:
            fits.append(f"{found[0]} ({n} {_gib(found[1]['device_gb'])} GiB, {_gib(found[1]['host_gb'])} GiB RAM)")
        else:
            stuck.append(n)
    needs = ", ".join(f"{n} about {_gib(e['device_gb'])} GiB ({e['setting']}; {_gib(e['host_gb'])} GiB RAM)"
                      for n, e in over.items())
    limits = (f"{_gib(budget)} GiB ({source})" if budget is not None else "no device limit") + \
        (f", {_gib(host[0])} GiB RAM ({host[1]})" if host else "")
    hint = ("every node fits with: " + "; ".join(fits)) if fits and not stuck else \
        (f"nothing in {', '.join(_knobs(n) for n in stuck)} makes {' or '.join(stuck)} fit: " +
         " and ".join(_smaller(n) for n in stuck) + ", or a bigger device" +
         (f"; the others fit with: {'; '.join(fits)}" if fits else ""))
    raise ConfigError(f"the run will not fit in memory: {needs} > {limits}; {hint}")


def _gib(x: float) -> str:
    return f"{x:.1f}" if x >= 0.95 else f"{x:.2g}"  # a tiny model's budget (tests) keeps its digits


def _smaller(node: str) -> str:
    return {"cache_text": "a smaller model.max_sequence_length",
            "sample": "smaller sample sizes (--w / --h, sample.width / sample.height) or fewer frames",
            "cache_latents": "a smaller data.resolution or fewer data.frames"}[node]


def _knobs(node: str) -> str:
    return {"cache_text": "text.quantize=fp8|int8|nf4 and text.offload=true", "sample": "sample.offload=true",
            "cache_latents": "data.vae_tiling=tiled"}[node]
