"""Model families: one adapter module each; this module picks one and finds the model's files."""
from __future__ import annotations

import importlib
from pathlib import Path

from tasks.hashing import digest_tree, key_of
from tasks.models.base import FamilyAdapter
from tasks.store import Store

# Bump when the tiny builder changes what it writes: the tiny model's store key includes it.
TINY_BUILDER_VERSION = "1"


# family -> (adapter class, tiny builder), as "module:name" so a family's heavy imports load only when used.
FAMILIES = {
    "flux": ("tasks.models.flux:FluxAdapter", "tasks.models.tiny:build_tiny_flux"),
    "sd3": ("tasks.models.sd3:SD3Adapter", "tasks.models.tiny_families:build_tiny_sd3"),
    "sdxl": ("tasks.models.sdxl:SDXLAdapter", "tasks.models.tiny_families:build_tiny_sdxl"),
    "sd15": ("tasks.models.sd15:SD15Adapter", "tasks.models.tiny_families:build_tiny_sd15"),
}


def _load(ref: str):
    module, name = ref.split(":")
    return getattr(importlib.import_module(module), name)


def adapter_class(family: str) -> type[FamilyAdapter]:
    if family not in FAMILIES:
        raise ValueError(f"model.family={family!r} is not supported; choose one of {sorted(FAMILIES)}")
    return _load(FAMILIES[family][0])


def make_adapter(model_cfg: dict, model_dir: Path) -> FamilyAdapter:
    return adapter_class(model_cfg["family"])(model_dir, model_cfg["dtype"], model_cfg["max_sequence_length"])


def _build_tiny(family: str, out_dir: Path, seed: int, arch: dict) -> None:
    _load(FAMILIES[family][1])(out_dir, seed=seed, arch=arch or None)


def resolve_model(model_cfg: dict, store: Store) -> Path:
    """The folder of the model in diffusers layout: a local folder, a hub snapshot, or the tiny model
    built from config (once; then it is a store entry like any other artifact)."""
    path = model_cfg.get("path")
    if not path:
        family, seed, arch = model_cfg["family"], int(model_cfg["seed"]), dict(model_cfg.get("arch") or {})
        key = key_of({"tiny": family, "seed": seed, "arch": arch, "builder": TINY_BUILDER_VERSION})
        if not store.valid("models", key):
            store.put("models", key, "", lambda p: _build_tiny(family, p, seed, arch), meta={"tiny": family})
        return store.get_path("models", key)
    local = Path(path).expanduser()
    if local.is_dir():
        if not (local / "model_index.json").is_file():
            raise FileNotFoundError(f"model.path={path}: not a diffusers folder (no model_index.json)")
        return local
    if local.exists():
        raise ValueError(f"model.path={path}: single-file checkpoints are not supported yet; "
                         "convert it to a diffusers folder (diffusers' from_single_file + save_pretrained)")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(path))
    except Exception as e:
        raise FileNotFoundError(f"model.path={path}: not a local folder and not loadable from the hub "
                                f"(offline or unknown id): {e}") from e


def component_ids(model_dir: Path, names: tuple[str, ...], store: Store) -> dict[str, str]:
    """Identity of each component: digest of its config and weight files, not its path."""
    return {name: digest_tree(model_dir / name, digest=store.file_digest) for name in names}
