"""Loading a denoiser one tensor at a time (issue 43): the model is built on the meta device (accelerate's
`init_empty_weights`), then each tensor is read from the folder's safetensors file(s), cast as diffusers'
`from_pretrained(dtype=...)` casts it, handed to the caller's `store` (the train node quantizes it there:
tasks/training/quantized_base.py) and put in place on the device `place` names. The host never holds more than
one tensor in the compute dtype, so a 24 GB base loads on a machine with far less RAM.

Why not diffusers' own `quantization_config`: its torchao path has no NF4, and its loader reads a whole
shard (or a single-file checkpoint whole) into host memory before placing it; the stored weights must also stay
the very tensors today's `quantize_base` made (bit for bit, tests/test_stream_load.py). Why not safetensors'
`safe_open`: it maps the whole file, and every page read stays in the process's RSS until the file is closed
(a 10 GB shard = 10 GB of RSS); a positioned read into a fresh tensor holds just that tensor.

A file's header is checked before anything is read: a truncated file, a missing one or one of another
architecture (missing, unexpected or reshaped weights) is a ConfigError naming the file and the fix."""
from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from tasks.config import ConfigError
from tasks.lazy import lazy

torch = lazy("torch")

# safetensors' dtype names (its format spec)
_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn",
           "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
           "BOOL": "bool"}
# Keys of fp8 files saved with scales (ComfyUI's "scaled fp8", musubi-tuner's fp8-scaled) beside `<module>.weight`
SCALE_SUFFIXES = (".scale_weight", ".scale_input")


@dataclass(frozen=True)
class Entry:
    file: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offsets in the file
    end: int


def read_header(file: Path) -> dict[str, Entry]:
    """Tensor name -> where it lies, from a safetensors header; checks the file holds every byte it declares."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ValueError("no header")
            (n,) = struct.unpack("<Q", raw)
            if n > size - 8:
                raise ValueError("header longer than the file")
            header = json.loads(f.read(n))
    except FileNotFoundError:
        raise ConfigError(f"{file}: the model file is missing; download the model again or fix model.path") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"{file}: not a safetensors file ({e}); download it again") from None
    out = {}
    for name, h in header.items():
        if name == "__metadata__":
            continue
        a, b = h["data_offsets"]
        out[name] = Entry(str(file), h["dtype"], tuple(h["shape"]), 8 + n + a, 8 + n + b)
    last = max((e.end for e in out.values()), default=8 + n)
    if last > size:
        raise ConfigError(f"{file}: truncated ({size:,} bytes of the {last:,} its header declares); "
                          "download it again")
    return out


def folder_entries(folder: Path) -> dict[str, Entry]:
    """Every tensor of a diffusers model folder: its sharded index's files, or its one safetensors file (the
    canonical name first: hub folders also hold variants such as diffusion_pytorch_model.fp16.safetensors,
    which from_pretrained reads only when asked)."""
    # the canonical index first: a hub folder may also hold a variant's (model.fp16.safetensors.index.json)
    indexes = sorted(folder.glob("*.safetensors.index.json"), key=lambda p: (p.name.count(".") > 3, p.name))
    index = next(iter(indexes), None)
    # diffusers' name, then transformers' (a text encoder's folder, tasks/models/loading/text_load.py)
    canonical = [folder / n for n in ("diffusion_pytorch_model.safetensors", "model.safetensors") if (folder / n).exists()]
    if index is not None:
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        paths = [folder / f for f in files]
    elif canonical:
        paths = canonical[:1]
    else:
        paths = sorted(folder.glob("*.safetensors"))
    if not paths:
        raise ConfigError(f"{folder}: no safetensors weights; download the model again or fix model.path")
    out = {}
    for p in paths:
        out.update(read_header(p))
    return out


def read_tensor(entry: Entry, fd: int) -> "torch.Tensor":
    """One tensor, read with a positioned read into its own buffer (no mapping of the file)."""
    dtype = getattr(torch, _DTYPES[entry.dtype])
    n = entry.end - entry.start
    buf = torch.empty(n, dtype=torch.uint8)
    view, got = memoryview(buf.numpy()), 0
    while got < n:
        k = os.preadv(fd, [view[got:]], entry.start + got)
        if k <= 0:
            raise ConfigError(f"{entry.file}: ended early while reading; download it again")
        got += k
    return buf.view(dtype).reshape(entry.shape) if n else torch.empty(entry.shape, dtype=dtype)


def iter_tensors(entries: dict[str, Entry]) -> Iterator[tuple[str, "torch.Tensor"]]:
    """(name, tensor) in file order (sequential reads), one at a time."""
    fds: dict[str, int] = {}
    try:
        for name, e in sorted(entries.items(), key=lambda kv: (kv[1].file, kv[1].start)):
            if e.file not in fds:
                fds[e.file] = os.open(e.file, os.O_RDONLY)
            yield name, read_tensor(e, fds[e.file])
    finally:
        for fd in fds.values():
            os.close(fd)


# store(module path, module, weight in the compute dtype on its device) -> the tensor to hold instead, or None
Store = Callable[[str, "torch.nn.Module", "torch.Tensor"], "torch.Tensor | None"]


def load_streamed(cls, folder: Path, dtype: "torch.dtype", store: Store | None = None,
                  place: Callable[[str], str] = lambda name: "cpu") -> "torch.nn.Module":
    """`cls.from_pretrained(folder, dtype=dtype)`'s model, tensor by tensor (the module doc)."""
    from accelerate import init_empty_weights
    from accelerate.utils import set_module_tensor_to_device

    entries = folder_entries(folder)
    return_freed_memory()
    from diffusers.models.modeling_utils import no_init_weights

    # as from_pretrained builds it: no init draws from the RNG, tensors made in __init__ in `dtype`
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with no_init_weights(), init_empty_weights():
            model = cls.from_config(cls.load_config(folder))
    finally:
        torch.set_default_dtype(default)
    own = model.state_dict()  # once: building it per entry was quadratic in the tensor count
    extra = _check_architecture(model, entries, folder) | {n for n in entries if n not in own}
    keep32 = list(cls._keep_in_fp32_modules or [])
    modules = dict(model.named_modules())
    # fp8 files saved with scales: W = fp8 x scale_weight, read first (a scalar or a row each)
    scales = {name[: -len(".scale_weight")]: t for name, t in
              iter_tensors({n: e for n, e in entries.items() if n.endswith(".scale_weight")})}
    for name, raw in iter_tensors({n: e for n, e in entries.items() if not n.endswith(SCALE_SUFFIXES) and n not in extra}):
        module_path, _, leaf = name.rpartition(".")
        kwargs = {}
        if raw.is_floating_point():  # diffusers' load_model_dict_into_meta: floats to dtype, keep-in-fp32 modules fp32
            kwargs["dtype"] = torch.float32 if any(k in name.split(".") for k in keep32) else dtype
            scale = scales.get(module_path) if leaf == "weight" else None
            value = raw.to(place(name))
            if scale is not None:
                value = value.float() * scale.to(value.device).float().reshape(-1, *[1] * (value.dim() - 1))
            value = value.to(kwargs["dtype"])
        else:
            value = raw.to(place(name))
        del raw
        # An fp8 file's weight stored as fp8 again is the same bytes: its cast to bf16 and back is exact
        stored = store(module_path, modules[module_path], value) if store and leaf == "weight" else None
        if stored is not None:
            modules[module_path]._parameters[leaf] = torch.nn.Parameter(stored, requires_grad=False)
        else:
            set_module_tensor_to_device(model, name, value.device, value=value.contiguous(), **kwargs)
    model.register_to_config(_name_or_path=str(folder))
    return model.eval()


def return_freed_memory() -> None:
    """glibc raises its mmap threshold to the size of each large block freed, so the next tensors of that size
    come from the heap, and the heap it cannot shrink grows by what is freed in between: loading a 12 B base
    tensor by tensor left 2.4 GiB above the weights (bench/load.json). A fixed threshold keeps every tensor
    over 1 MiB in its own mapping, handed back to the system when freed (0.2 GiB). Process-wide from here on;
    it changes where memory comes from, never a value."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        if libc is not None and hasattr(libc, "mallopt"):
            libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD (malloc.h)
    except OSError:
        pass  # not glibc: its own allocator, nothing to set


def _check_architecture(model, entries: dict[str, Entry], folder: Path) -> set[str]:
    """Refuses missing or reshaped weights (another family or architecture); returns the checkpoint's extra
    weights, which are left out as from_pretrained leaves them out."""
    expected = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    have = {n for n in entries if not n.endswith(SCALE_SUFFIXES)}
    missing = sorted(set(expected) - have)
    ignore = getattr(type(model), "_keys_to_ignore_on_load_unexpected", None) or ()
    extra = sorted(n for n in have - set(expected) if n != "scaled_fp8" and not any(re.search(p, n) for p in ignore))
    shaped = sorted(n for n in have & set(expected) if entries[n].shape != expected[n])
    if missing or shaped:
        detail = (f"lacks {len(missing)} of its weights (e.g. {', '.join(missing[:3])})" if missing else
                  f"has {len(shaped)} weights of another shape (e.g. {shaped[0]}: {list(entries[shaped[0]].shape)} "
                  f"where the architecture has {list(expected[shaped[0]])})")
        raise ConfigError(f"{folder}: the checkpoint {detail} for {type(model).__name__} as its config.json "
                          "describes; is it a checkpoint of this model family (model.family / model.path)?")
    if extra:  # from_pretrained leaves them out with a warning too (a file's extras, e.g. another head)
        import logging

        logging.getLogger("loraflow").warning(
            "%s: %d weights of the checkpoint are not in %s and are left out (e.g. %s)", folder, len(extra),
            type(model).__name__, ", ".join(extra[:3]))
    return set(extra)
