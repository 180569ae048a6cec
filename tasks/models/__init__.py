"""Model families: one adapter module each (base.py is the interface; flow_matching, unet, flux2 and losses are
shared), the tiny builders, and LoRA on the text encoders; this module picks an adapter and finds the model's
files. May import tasks.store, tasks.data, tasks.config and tasks.runtime; never training or a node."""
from __future__ import annotations

import importlib
from pathlib import Path

from tasks.config import ConfigError
from tasks.config_schema import ModelConfig
from tasks.lazy import settle
from tasks.store.hashing import digest_tree, key_of
from tasks.models.bases.adapter import FamilyAdapter
from tasks.store import Store

# Bump when the tiny builder changes what it writes: the tiny model's store key includes it.
TINY_BUILDER_VERSION = "1"
# Bump when converting a single-file checkpoint changes what lands in the store.
SINGLE_FILE_VERSION = "1"


# family -> (adapter class, tiny builder), as "module:name" so a family's heavy imports load only when used.
FAMILIES = {
    "flux": ("tasks.models.flux:FluxAdapter", "tasks.models.tiny.tiny_flux:build_tiny_flux"),
    "flux_kontext": ("tasks.models.flux_kontext:FluxKontextAdapter", "tasks.models.tiny.tiny_flux:build_tiny_flux_kontext"),
    "sd3": ("tasks.models.sd3:SD3Adapter", "tasks.models.tiny.tiny_sd3:build_tiny_sd3"),
    "sdxl": ("tasks.models.sdxl:SDXLAdapter", "tasks.models.tiny.tiny_unet:build_tiny_sdxl"),
    "sd15": ("tasks.models.sd15:SD15Adapter", "tasks.models.tiny.tiny_unet:build_tiny_sd15"),
    "zimage": ("tasks.models.zimage:ZImageAdapter", "tasks.models.tiny.tiny_zimage:build_tiny_zimage"),
    "qwenimage": ("tasks.models.qwenimage:QwenImageAdapter", "tasks.models.tiny.tiny_qwenimage:build_tiny_qwenimage"),
    "qwenimage_edit": ("tasks.models.qwenimage_edit:QwenImageEditAdapter",
                       "tasks.models.tiny.tiny_qwenimage_edit:build_tiny_qwenimage_edit"),
    "flux2_klein": ("tasks.models.flux2_klein:Flux2KleinAdapter", "tasks.models.tiny.tiny_flux2:build_tiny_flux2"),
    "flux2_dev": ("tasks.models.flux2_dev:Flux2DevAdapter", "tasks.models.tiny.tiny_flux2_dev:build_tiny_flux2_dev"),
    "wan": ("tasks.models.wan:WanAdapter", "tasks.models.tiny.tiny_wan:build_tiny_wan"),
    "wan22": ("tasks.models.wan22:Wan22Adapter", "tasks.models.tiny.tiny_wan:build_tiny_wan22"),
    "wan_i2v": ("tasks.models.wan_i2v:WanI2VAdapter", "tasks.models.tiny.tiny_wan_i2v:build_tiny_wan_i2v"),
    "wan22_i2v": ("tasks.models.wan22_i2v:Wan22I2VAdapter", "tasks.models.tiny.tiny_wan_i2v:build_tiny_wan22_i2v"),
    "wan22_ti2v": ("tasks.models.wan22_ti2v:Wan22TI2VAdapter", "tasks.models.tiny.tiny_wan_i2v:build_tiny_wan22_ti2v"),
    "ltx2": ("tasks.models.ltx2:LTX2Adapter", "tasks.models.tiny.tiny_ltx2_versions:build_tiny_ltx2"),
    "hunyuan_video15": ("tasks.models.hunyuan_video15:HunyuanVideo15Adapter",
                        "tasks.models.tiny.tiny_hunyuan_video15:build_tiny_hunyuan_video15"),
    "hunyuan_video15_i2v": ("tasks.models.hunyuan_video15_i2v:HunyuanVideo15I2VAdapter",
                            "tasks.models.tiny.tiny_hunyuan_video15_i2v:build_tiny_hunyuan_video15_i2v"),
    "qwenimage21": ("tasks.models.qwenimage21:QwenImage21Adapter",
                    "tasks.models.tiny.tiny_qwenimage21:build_tiny_qwenimage21"),
    "chroma": ("tasks.models.chroma:ChromaAdapter", "tasks.models.tiny.tiny_chroma:build_tiny_chroma"),
    "hidream": ("tasks.models.hidream:HiDreamAdapter", "tasks.models.tiny.tiny_hidream:build_tiny_hidream"),
    "ernie_image": ("tasks.models.ernie_image:ErnieImageAdapter",
                    "tasks.models.tiny.tiny_ernie_image:build_tiny_ernie_image"),
    "krea2": ("tasks.models.krea2:Krea2Adapter", "tasks.models.tiny.tiny_krea2:build_tiny_krea2"),
    "ideogram4": ("tasks.models.ideogram4:Ideogram4Adapter", "tasks.models.tiny.tiny_ideogram4:build_tiny_ideogram4"),
    "kandinsky5": ("tasks.models.kandinsky5:Kandinsky5Adapter", "tasks.models.tiny.tiny_kandinsky5:build_tiny_kandinsky5"),
    "kandinsky5_i2v": ("tasks.models.kandinsky5_i2v:Kandinsky5I2VAdapter",
                       "tasks.models.tiny.tiny_kandinsky5_i2v:build_tiny_kandinsky5_i2v"),
    "lumina2": ("tasks.models.lumina2:Lumina2Adapter", "tasks.models.tiny.tiny_lumina2:build_tiny_lumina2"),
}


def _load(ref: str):
    module, name = ref.split(":")
    return getattr(importlib.import_module(module), name)


def adapter_class(family: str) -> type[FamilyAdapter]:
    if family not in FAMILIES:
        raise ConfigError(f"model.family={family!r} is not supported; choose one of {sorted(FAMILIES)}")
    return _load(FAMILIES[family][0])


def make_adapter(model_cfg: ModelConfig, model_dir: Path) -> FamilyAdapter:
    adapter = adapter_class(model_cfg.family)(model_dir, model_cfg.dtype, model_cfg.max_sequence_length)
    adapter.configure(model_cfg)
    return adapter


def build_tiny(family: str, out_dir: Path, seed: int, arch: dict) -> None:
    settle("diffusers")  # the model libraries, imported once with the collector paused (tasks/lazy.py)
    _load(FAMILIES[family][1])(out_dir, seed=seed, arch=arch or None)


def resolve_model(model_cfg: ModelConfig, store: Store) -> Path:
    """The folder of the model in diffusers layout: a local folder, a hub snapshot, a single-file checkpoint
    converted once with diffusers' from_single_file, or the tiny model built from config (once). Built and
    converted folders are store entries like any other artifact."""
    path = model_cfg.path
    if not path:
        family, seed, arch = model_cfg.family, int(model_cfg.seed), dict(model_cfg.arch or {})
        key = key_of({"tiny": family, "seed": seed, "arch": arch, "builder": TINY_BUILDER_VERSION})
        if not store.valid("models", key):
            store.put("models", key, "", lambda p: build_tiny(family, p, seed, arch), meta={"tiny": family})
        return store.get_path("models", key)
    if Path(path).expanduser().is_file():
        return _from_single_file(model_cfg, Path(path).expanduser(), store)
    return _diffusers_folder(path, "model.path")


def _diffusers_folder(path: str, key: str) -> Path:
    local = Path(path).expanduser()
    if local.is_dir():
        if not (local / "model_index.json").is_file():
            raise FileNotFoundError(f"{key}={path}: not a diffusers folder (no model_index.json)")
        return local
    if path.startswith(("/", ".", "~")) or path.count("/") > 1 or local.suffix:  # a local path, not a hub id
        raise FileNotFoundError(f"{key}={path}: no such file or folder")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(path))
    except Exception as e:
        raise FileNotFoundError(f"{key}={path}: not a local folder and not loadable from the hub "
                                f"(offline or unknown id): {e}") from e


def _from_single_file(model_cfg: ModelConfig, file: Path, store: Store) -> Path:
    """A .safetensors checkpoint (original or diffusers key layout) -> a diffusers folder in the store, keyed
    by the file's digest and the identity of the config it is read with; converted once."""
    if file.suffix != ".safetensors":
        # .ckpt/.pt/.bin are pickles: loading one can run arbitrary code.
        raise ConfigError(f"model.path={file}: only .safetensors single files are loaded (pickle formats can "
                          "run code); convert it first, e.g. with safetensors' convert script")
    if not model_cfg.config:
        raise ConfigError(f"model.path={file} is a single file: set model.config= a diffusers folder or hub id of "
                          "the same architecture (it supplies the configs, tokenizers and any component the file "
                          "lacks), e.g. model.config=black-forest-labs/FLUX.1-dev")
    config_dir = _diffusers_folder(model_cfg.config, "model.config")
    family, dtype = model_cfg.family, model_cfg.dtype
    from tasks.models.loading.fp8_single_file import holds_fp8

    # an fp8 transformer file is kept as stored (fp8_single_file.py): another folder than the cast one
    key = key_of({"single_file": store.file_digest(file), "config": digest_tree(config_dir, digest=store.file_digest),
                  "family": family, "dtype": dtype, "code": SINGLE_FILE_VERSION,
                  **({"as_stored": "fp8"} if adapter_class(family).single_file_holds == "denoiser" and holds_fp8(file)
                     else {})})
    if not store.valid("models", key):
        adapter = adapter_class(family)(config_dir, dtype)
        store.put("models", key, "", lambda p: adapter.convert_single_file(file, p),
                  meta={"single_file": str(file), "config": str(config_dir)})
    return store.get_path("models", key)


def component_ids(model_dir: Path, names: tuple[str, ...], store: Store) -> dict[str, str]:
    """Identity of each component: digest of its config and weight files, not its path."""
    return {name: digest_tree(model_dir / name, digest=store.file_digest) for name in names}
