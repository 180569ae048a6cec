"""Loading a text encoder (a transformers model) at the card's size (issue 61): built on the meta device, then
read one tensor at a time from the folder's safetensors files (stream_load's reader: no mapping of the file, no
bf16 copy of the model in host memory), each Linear weight stored as `text.quantize` says the moment it is read,
and put on the device. `text.offload`: the layers' stored weights wait on the host and each layer is copied to
the device when it runs, the next one prefetched on a side stream: the train node's block swap
(tasks/training/block_swap.py), which carries torchao's NF4 tensors; diffusers' group offloading moves only
the wrapper of a tensor subclass that is not torchao's TorchAOBaseTensor, as NF4Tensor is not.

The stored forms are the denoiser's (tasks/training/quantized_base.py, fp8_base.py): fp8 (plain cast), torchao's
Int8Tensor per row, torchao's NF4; each Linear dequantized to `model.dtype` for its matmul by fp8_base's hook.
Embeddings, norms, biases and convolutions stay in `model.dtype`, and so do the modules transformers keeps in
fp32 (its quantizers leave them unconverted too; with fp8 also at bf16: T5's `wo`, see _unstored). With `text.quantize=none` the weights are those
`from_pretrained(dtype=...)` gives, bit for bit (tests/test_text_load.py).

Checkpoint names are renamed as transformers' own loader renames them (its conversion mapping: e.g. Mistral 3's
`language_model.model.*` -> `model.language_model.*`); a checkpoint that needs one of its converters (fused or
split weights) is loaded by from_pretrained whole, which the log says."""
from __future__ import annotations

import functools
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tasks.config import ConfigError
from tasks.lazy import lazy

torch = lazy("torch")
log = logging.getLogger("loraflow")
KINDS = ("none", "fp8", "int8", "nf4")


@dataclass(frozen=True)
class TextLoading:
    """How cache_text (and live caption encoding) loads the text encoders: text.quantize and text.offload, with
    the train node's storage functions handed in (tasks/training/quantized_base.py: text_loading), which this
    layer may not import: `store(weight, kind)` -> the stored weight or None; `hook(module, dtype)` makes a
    stored Linear compute in `dtype`."""
    quantize: str = "none"
    offload: bool = False
    store: Callable | None = None
    hook: Callable | None = None
    swap: Callable | None = None  # swap(model, dtype): its layers' weights held on the host, copied in per use
    # Linears never stored quantized, by module name (the captioner's lm_head: transformers' quantizers leave the
    # output head alone, and dequantizing a 152k-row head per token would cost more than it saves)
    keep: tuple[str, ...] = ()
    # The language model's output head loaded and run (the captioner's generate); False (cache_text): dropped
    # before loading (drop_head), as the pipelines read hidden states only (a 152k-row head: 1 GiB in bf16, and
    # stored NF4 a 7 GiB dequantize for logits nobody reads)
    head: bool = True


@functools.cache
def _no_head_cls():  # torch is imported lazily (the CLI's startup)
    class NoHead(torch.nn.Module):
        """In place of an output head nobody reads: no weights, logits with an empty last axis."""

        def forward(self, hidden_states):
            return hidden_states[..., :0]
    return NoHead


def drop_head(model) -> bool:
    """The model's output head (a Linear: transformers' get_output_embeddings) replaced by one without weights;
    False where it has none (an encoder: T5, CLIP, a base model)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is not torch.nn.Linear:
        return False
    path = next(p for p, m in model.named_modules() if m is head)
    parent, _, leaf = path.rpartition(".")
    setattr(model.get_submodule(parent), leaf, _no_head_cls()())
    return True


def _renamer(model):
    """checkpoint key -> model key, by transformers' conversion mapping for this model; None where a key needs a
    converter (not a plain rename)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    meta = model.state_dict()

    def rename(key: str) -> str | None:
        new, converter = rename_source_key(key, renamings, converters, model.base_model_prefix, meta)
        return None if converter is not None else new
    return rename


def _module_pattern(names) -> re.Pattern | None:
    return re.compile("|".join(f"(^|\\.){re.escape(k)}($|\\.)" for k in names)) if names else None


def _unstored(model, kind: str, keep: tuple[str, ...] = ()) -> re.Pattern | None:
    """Linears kept in the compute dtype under `kind`: for fp8, the ones transformers may keep in fp32 (T5's `wo`),
    whose caller casts its input to the weight's dtype (a plain fp8 weight would make that input fp8; torchao's
    tensors report the compute dtype); and `keep` (TextLoading.keep)."""
    return _module_pattern((list(model._keep_in_fp32_modules or ()) if kind == "fp8" else []) + list(keep))


def load_text_model(cls, folder: Path, dtype, loading: TextLoading = TextLoading(), device: str = "cpu"):
    """`cls.from_pretrained(folder, dtype=dtype)`'s model, streamed and stored as `loading` says, placed on `device`
    (or group-offloaded to it with loading.offload). Returns the model in eval mode."""
    from accelerate import init_empty_weights
    from accelerate.utils import set_module_tensor_to_device

    from tasks.models.loading.stream_load import return_freed_memory, folder_entries, iter_tensors

    if loading.quantize not in KINDS:
        raise ConfigError(f"text.quantize={loading.quantize!r}: choose one of {', '.join(KINDS)}")
    if loading.quantize != "none" and (loading.store is None or loading.hook is None):
        raise ValueError("TextLoading with a quantize kind needs its store and hook")  # a bug, not a user error
    folder = Path(folder)
    config = cls.config_class.from_pretrained(folder)
    entries = folder_entries(folder)
    return_freed_memory()
    with init_empty_weights():
        model = cls._from_config(config, dtype=dtype)
    if not loading.head:  # its weights then not in the state dict: never read from the checkpoint
        drop_head(model)
    rename = _renamer(model)
    names = {k: rename(k) for k in entries}
    if any(v is None for v in names.values()):  # a converter's checkpoint: transformers' own loader
        log.info("%s: this checkpoint's weights need transformers' converters; loaded by from_pretrained", folder)
        return _placed(cls.from_pretrained(folder, dtype=dtype, use_safetensors=True), loading, device, dtype)
    own = model.state_dict()
    _check(model, own, set(names.values()), folder)
    keep32 = _module_pattern(model._get_dtype_plan(dtype))  # transformers' fp32 weights at this dtype
    unstored = _unstored(model, loading.quantize, loading.keep)
    modules = dict(model.named_modules())
    store_device = "cpu" if loading.offload else device
    stored_paths = []
    for key, raw in iter_tensors({k: e for k, e in entries.items() if names[k] in own}):
        name = names[key]
        module_path, _, leaf = name.rpartition(".")
        module = modules[module_path]
        if raw.is_floating_point():
            fp32 = keep32 is not None and keep32.search(name)
            value = raw.to(store_device).to(torch.float32 if fp32 else dtype)
            if loading.quantize != "none" and leaf == "weight" and type(module) is torch.nn.Linear and not fp32 \
                    and not (unstored and unstored.search(name)):
                stored = loading.store(value, loading.quantize)
                if stored is not None:
                    module._parameters["weight"] = torch.nn.Parameter(stored, requires_grad=False)
                    stored_paths.append(module_path)
                    continue
        else:
            value = raw.to(store_device)
        del raw
        kwargs = {"dtype": value.dtype} if value.is_floating_point() else {}  # else it casts to the meta dtype
        set_module_tensor_to_device(model, name, value.device, value=value.contiguous(), **kwargs)
    model.tie_weights()
    left = [n for n, t in model.state_dict().items() if t.is_meta]
    if left:
        raise ConfigError(f"{folder}: the checkpoint lacks {len(left)} weights of {cls.__name__} (e.g. "
                          f"{', '.join(left[:3])}); download the text encoder again or fix model.path")
    modules = dict(model.named_modules())
    for path in stored_paths:  # each stored Linear dequantized to `dtype` for its matmul, one layer at a time
        loading.hook(modules[path], dtype)
    return _placed(model, loading, device, dtype, moved=True)


def _placed(model, loading: TextLoading, device: str, dtype, moved: bool = False):
    """On the device, with its layers swapped in from the host (text.offload); from_pretrained's model stored now."""
    if not moved and loading.quantize != "none":
        raise ConfigError(f"text.quantize={loading.quantize}: {type(model).__name__}'s checkpoint needs "
                          "transformers' converters, which the streamed loader does not run; use text.quantize=none")
    model.eval().requires_grad_(False)
    if not loading.head:
        drop_head(model)
    if loading.offload:
        if loading.swap is None:
            raise ValueError("TextLoading with offload needs its swap")  # a bug, not a user error
        loading.swap(model, dtype)
    return model.to(device)  # what is not swapped; a swapped weight stays with its hook on the host


def _check(model, own: dict, have: set, folder: Path) -> None:
    """Refuses missing or reshaped weights (a checkpoint of another encoder); tied weights may be absent."""
    tied = set(getattr(model, "_tied_weights_keys", None) or {})
    missing = sorted(n for n in set(own) - have if n not in tied)
    if missing:
        raise ConfigError(f"{folder}: the checkpoint lacks {len(missing)} weights of {type(model).__name__} as its "
                          f"config.json describes (e.g. {', '.join(missing[:3])}); is it this family's text encoder?")
