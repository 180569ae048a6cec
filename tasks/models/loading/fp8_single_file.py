"""A transformer single file stored in fp8 (`flux1-dev-fp8.safetensors` and its kind) converted to a diffusers
folder as stored (issue 43): its tensors keep the file's dtypes, so the fp8 weights stay fp8 and the train node
streams them in as they are (tasks/models/loading/stream_load.py; with `model.quantize=fp8` they are held as read).
diffusers' from_single_file would cast every tensor to one dtype (bf16: twice the bytes, the whole model in host
memory; fp8: the norms too).

The key mapping is diffusers' own: the same `checkpoint_mapping_fn` from_single_file applies to this class
(renames, and q/k/v split by torch.chunk, which keeps fp8). Files saved with scales (ComfyUI's "scaled fp8",
musubi-tuner's fp8-scaled: `<module>.scale_weight` beside each fp8 weight) are dequantized to the compute dtype
first (W = fp8 x scale): the mapping knows no scale keys."""
from __future__ import annotations

from pathlib import Path

from tasks.config import ConfigError
from tasks.lazy import lazy
from tasks.models.loading.stream_load import SCALE_SUFFIXES, iter_tensors, read_header

torch = lazy("torch")

FP8 = ("F8_E4M3", "F8_E5M2")


def holds_fp8(file: Path) -> bool:
    """Whether a safetensors file stores its weight matrices in fp8 (read from its header only)."""
    header = read_header(file)
    matrices = [e for n, e in header.items() if n.endswith(".weight") and len(e.shape) == 2]
    return bool(matrices) and sum(e.dtype in FP8 for e in matrices) * 2 >= len(matrices)


def convert(cls, file: Path, config_dir: Path, subfolder: str, compute_dtype, out: Path) -> None:
    """`file` -> out/ (config.json + one safetensors file in the file's dtypes), keys as from_single_file maps them."""
    from accelerate import init_empty_weights
    from diffusers.loaders.single_file_model import (SINGLE_FILE_LOADABLE_CLASSES,
                                                     _should_convert_state_dict_to_diffusers)
    from diffusers.models.modeling_utils import no_init_weights
    from safetensors.torch import save_file

    header = read_header(file)
    scales = {n[: -len(".scale_weight")]: t for n, t in
              iter_tensors({n: e for n, e in header.items() if n.endswith(".scale_weight")})}
    checkpoint = {}
    for name, t in iter_tensors({n: e for n, e in header.items() if not n.endswith(SCALE_SUFFIXES)}):
        if name == "scaled_fp8":  # ComfyUI's marker
            continue
        scale = scales.get(name[: -len(".weight")]) if name.endswith(".weight") else None
        if scale is not None:
            t = (t.float() * scale.float().reshape(-1, *[1] * (t.dim() - 1))).to(compute_dtype)
        checkpoint[name] = t
    config = cls.load_config(config_dir, subfolder=subfolder)
    with no_init_weights(), init_empty_weights():
        model = cls.from_config(config)
    expected = model.state_dict()
    mapping = SINGLE_FILE_LOADABLE_CLASSES.get(cls.__name__, {}).get("checkpoint_mapping_fn")
    if mapping is not None and _should_convert_state_dict_to_diffusers(expected, checkpoint):
        checkpoint = mapping(config=config, checkpoint=checkpoint)
    missing = sorted(set(expected) - set(checkpoint))
    if missing:
        raise ConfigError(f"model.path={file}: the file lacks {len(missing)} weights of the architecture in "
                          f"model.config (e.g. {', '.join(missing[:3])}); is model.config the right base model?")
    folder = Path(out) / subfolder
    folder.mkdir(parents=True, exist_ok=True)
    model.save_config(folder)
    # the store's put writes into a temporary folder and renames it whole: no half-written entry survives a kill
    save_file({k: checkpoint[k].contiguous() for k in expected}, folder / "diffusion_pytorch_model.safetensors")
