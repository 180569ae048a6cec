"""Composing the config for the CLI and deployments, and the typed config every node reads.

`compose` runs Hydra as the CLI does; `resolve_paths` turns the composed DictConfig into the schema's
dataclasses (tasks/config_schema.py) with paths made absolute. Nodes read attributes (`cfg.train.lr`);
`as_plain`/`from_plain` are the JSON form for keys, Prefect parameters and accelerate's workers.
"""
from __future__ import annotations

import copy
import os
import difflib
import typing
from datetime import datetime
from dataclasses import MISSING as MISSING_FIELD, asdict, fields, is_dataclass
from pathlib import Path
from typing import List

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from tasks.config_schema import REPO, Config, ModelConfig, RootConfig, SubsetConfig

CONF_DIR = REPO / "conf"


def register() -> None:
    """The schema in Hydra's ConfigStore (conf/train.yaml's defaults name it first), and the resolvers."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="loraflow_schema", node=RootConfig)
    if not OmegaConf.has_resolver("repo"):
        OmegaConf.register_new_resolver("repo", lambda: str(REPO))
    if not OmegaConf.has_resolver("now"):  # Hydra registers it only in its CLI path
        OmegaConf.register_new_resolver("now", lambda fmt: datetime.now().strftime(fmt))


register()


class ConfigError(ValueError):
    """A config value is wrong; the message names the key and the fix."""


# The CLI composes a run's config before Hydra starts (its pre-flight check, flows/cli.py) and the flow
# composes it again from its parameters; the flow takes the pre-flight's config once instead (0.1 s of a
# no-op's start-up, bench/RESULTS.md figure 6). Keyed by the config name and the overrides that are not
# Hydra's own (hydra.*, hydra/...): those shape the run folder and the launcher, never the job's config.
_held: dict[tuple, DictConfig] = {}
_held_modes: dict[tuple, object] = {}  # (config name, every override) -> its hydra.mode, for Hydra's main


def held_hydra_mode(config_name: str, overrides: List[str]) -> tuple[bool, object]:
    """(True, hydra.mode) of a config composed with `hold` (None unless a config or override sets it), once;
    (False, None) where none was."""
    key = (config_name, tuple(overrides))
    return (key in _held_modes), _held_modes.pop(key, None)


def _job_key(config_name: str, overrides: List[str]) -> tuple:
    return config_name, tuple(o for o in overrides if not o.lstrip("+~").startswith(("hydra.", "hydra/")))


def _literal_run_dir(overrides: List[str]) -> Path | None:
    """The run folder a `hydra.run.dir=PATH` override names, where it is a plain value (the CLI's flow run
    passes Hydra's output folder so); None where it is absent or interpolated."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    named = [o for o in overrides if o.startswith("hydra.run.dir=")]
    if not named:
        return None
    value = OverridesParser.create().parse_override(named[-1]).value()
    return Path(value) if isinstance(value, str) and "${" not in value else None


def compose(config_name: str = "train", overrides: List[str] | None = None,
            hold: bool = False) -> tuple[DictConfig, Path]:
    """Compose like the CLI does (for deployments, which bypass Hydra's CLI). Returns (cfg, run_dir).
    `hold`: keep the config for the next compose of the same job (the flow run the CLI starts next), which
    takes it once, with the run folder its `hydra.run.dir=` names."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    overrides = list(overrides or [])
    held = _held.pop(_job_key(config_name, overrides), None)
    if held is not None and not hold and (run_dir := _literal_run_dir(overrides)) is not None:
        return held, run_dir
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
    mode = cfg.hydra.mode
    with _unlocked(cfg):
        del cfg["hydra"]
    if hold:
        _held[_job_key(config_name, overrides)] = copy.deepcopy(cfg)
        _held_modes[(config_name, tuple(overrides))] = mode
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


def resolve_paths(cfg: DictConfig, cwd: str | os.PathLike | None = None) -> RootConfig:
    """The typed config, with relative paths made absolute (against the caller's cwd)."""
    cwd = Path(cwd or os.getcwd())
    try:
        plain = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as e:  # train.lr=${nope}, a recursive or mistyped interpolation, data.dir=???
        raise _config_error(e) from e
    for section, key in (("data", "dir"), ("sample", "prompts_file"), ("store", "root"), ("store", "cache_dir"),
                         ("model", "path"), ("model", "config"), ("caption", "model")):
        value = plain[section].get(key)
        if value is None or (section, key) == ("store", "root") and "://" in value:  # an fsspec URL
            continue
        try:  # a NUL byte or a name too long for the file system: a clear error, not OSError/ValueError
            if "\x00" in value:
                raise ValueError("embedded NUL character")
            path = cwd / os.path.expanduser(value)
            if section not in ("model", "caption"):
                plain[section][key] = str(path.resolve())
            elif value and path.exists():  # a local path (else a hub id or tiny_vlm, kept as is)
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
    return from_plain(plain)


def as_plain(cfg: RootConfig) -> dict:
    """The config as JSON-able dicts, keys in the schema's order (what keys hash and workers receive)."""
    return asdict(cfg)


def from_plain(plain: dict, node: type = RootConfig, where: str = ""):
    """The dataclasses back from `as_plain`'s dicts; a key the schema lacks is a ConfigError naming it."""
    hints = typing.get_type_hints(node)
    names = {f.name for f in fields(node)}
    unknown = sorted(set(plain) - names)
    if unknown:
        raise ConfigError(f"{where}{unknown[0]} is not a loraflow setting")
    values = {}
    for name, value in plain.items():
        kind = hints[name]
        if is_dataclass(kind) and isinstance(value, dict):
            value = from_plain(value, kind, f"{where}{name}.")
        elif typing.get_origin(kind) is list and typing.get_args(kind) == (SubsetConfig,):
            value = [from_plain(v, SubsetConfig, f"{where}{name}[{i}].") if isinstance(v, dict) else v
                     for i, v in enumerate(value)]
        values[name] = value
    return node(**values)


def stored_as(mc: ModelConfig) -> str | None:
    """How the frozen base is stored in training: float8_e4m3fn / float8_e5m2 (model.storage_dtype, or
    model.quantize=fp8), int8 or nf4 (model.quantize); None: in model.dtype."""
    q = mc.quantize or "none"
    if q == "fp8":
        return "float8_e4m3fn"
    return q if q in ("int8", "nf4") else mc.storage_dtype


def config_of(sections: dict) -> RootConfig:
    """A config from partial sections over the schema's defaults, for code that builds one without Hydra
    (benchmarks, tests): `config_of({"train": {"rank": 16}})`. A key the schema lacks is a ConfigError."""
    plain = as_plain(RootConfig())
    for section, values in sections.items():
        if section not in plain:
            raise ConfigError(f"{section} is not a loraflow config group")
        plain[section].update(asdict(values) if is_dataclass(values) else values)
    return from_plain(plain)


def updated(cfg: RootConfig, settings: dict) -> RootConfig:
    """A copy of cfg with dotted settings changed: `updated(cfg, {"train.blocks_to_swap": 4})`."""
    new = copy.deepcopy(cfg)
    for dotted, value in settings.items():
        section, key = dotted.split(".")
        group = getattr(new, section)
        if key not in {f.name for f in fields(group)}:
            raise ConfigError(f"{dotted} is not a loraflow setting")
        setattr(group, key, value)
    return new
