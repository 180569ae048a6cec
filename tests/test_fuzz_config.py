"""Bad config, generated: kohya prompt lines and override values give a clear error or a warning naming the
line or key, never a traceback, and nothing the pipeline would crash on later is accepted."""
from __future__ import annotations

import dataclasses
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from diffusers import DDIMScheduler
from hypothesis import HealthCheck, given, settings, strategies as st

from tasks import config as config_mod
from tasks.config import ConfigError, compose, resolve_paths
from tasks.data.prompts import PromptLineError, SamplePrompt, parse_prompt_line, read_prompts
from tasks.validate import config_errors
from tasks.models import FAMILIES
from conftest import cli_env

REPO = Path(__file__).resolve().parents[1]
SETTINGS = dict(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.large_base_example, HealthCheck.data_too_large])

# ------------------------------------------------------------------------------------------ prompt lines

NUMBERS = st.one_of(
    st.integers(-10**6, 10**6).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["0", "-0", "+5", "-1", str(10**30), str(2**64 - 1), str(2**64), str(-2**63 - 1),
                     "nan", "inf", "-inf", "1e400", "1e-400", "1.5", "1_000", "0x10", "\u0663", "\uff11", "", " "]),
    st.sampled_from(["1" * 5000, "-" + "9" * 4400, "1" * 1000]),  # past int()'s 4300-digit limit
)
JUNK = st.text(st.characters(blacklist_categories=("Cs",)), max_size=16)  # unicode, tabs, \r, NUL, ...
OPTION = st.builds(lambda letter, gap, value: f" --{letter}{gap}{value}",
                   st.sampled_from(list("nwhsldgNWHSLDG") + ["x", "ww", "1", ""]),
                   st.sampled_from([" ", "\t", "  ", ""]), st.one_of(NUMBERS, JUNK))
LINE = st.builds(lambda prompt, options, tail: prompt + "".join(options) + tail,
                 st.one_of(JUNK, st.sampled_from(["a cat", "#", "  # x", "", "a" * 100_000])),
                 st.lists(OPTION, max_size=6),
                 st.sampled_from(["", " --", " -- ", " --w", "\r", "\t", "\x00", " --w 64 --w 64"]))
DDIM = DDIMScheduler(num_train_timesteps=1000)  # tiny_sd15's sampler: the strictest about steps


def assert_runnable(p: SamplePrompt, n: int) -> None:
    """Every field is one the sampler takes: what parse accepts must not crash sampling later."""
    assert p.line == n and isinstance(p.prompt, str) and p.prompt == p.prompt.strip() != ""
    assert "\x00" not in p.prompt + p.negative
    for size in (p.width, p.height):
        assert size is None or (type(size) is int and 1 <= size <= 16384)
    for scale in (p.guidance, p.true_cfg):
        assert scale is None or (isinstance(scale, float) and math.isfinite(scale) and scale >= 0)
    if p.steps is not None:
        assert type(p.steps) is int and p.steps >= 1
        DDIM.set_timesteps(p.steps)
    if p.seed is not None:
        assert type(p.seed) is int
        torch.Generator().manual_seed(p.seed)


def expect_line(text: str, n: int):
    """(prompt or None, error or None) for one line; fails on any exception but PromptLineError."""
    try:
        p = parse_prompt_line(text, n)
    except PromptLineError as e:
        assert e.line == n and str(e).startswith(f"line {n}: ") and e.reason in str(e)
        return None, e
    if p is None:
        assert text.strip() == "" or text.strip().startswith("#")
    else:
        assert_runnable(p, n)
    return p, None


@settings(max_examples=400, **SETTINGS)
@given(LINE, st.integers(1, 10**6))
def test_prompt_line_parses_to_runnable_values_or_names_its_line(text, n):
    expect_line(text, n)


@pytest.mark.parametrize("text, option", [
    ("a cat --d 18446744073709551616", "d"),  # 2**64: torch.Generator.manual_seed overflows
    ("a cat --d " + "9" * 5000, "d"),  # int() refuses > 4300 digits (was a bare ValueError)
    ("a cat --s 1001", "s"),  # DDIM (sd15) refuses more steps than its 1000 training timesteps
    ("a cat --w 1000000000000000000000000000000", "w"),
    ("a cat --h 20000", "h"),
    ("a\x00c\x00a\x00t", None),  # UTF-16 read as UTF-8
])
def test_values_the_sampler_cannot_take_are_line_errors(text, option):
    with pytest.raises(PromptLineError) as e:
        parse_prompt_line(text, 3)
    assert str(e.value).startswith("line 3: ") and e.value.option == option
    if option:
        assert f"--{option}" in str(e.value)


SAFE = st.text(st.characters(blacklist_categories=("Cs", "Cc", "Zl", "Zp")), min_size=1, max_size=20).map(str.strip)


@settings(max_examples=200, **SETTINGS)
@given(prompt=SAFE, negative=st.none() | SAFE, width=st.none() | st.integers(1, 16384),
       steps=st.none() | st.integers(1, 1000), guidance=st.none() | st.floats(0, 1e6),
       seed=st.none() | st.integers(0, 2**64 - 1))
def test_every_runnable_prompt_round_trips(prompt, negative, width, steps, guidance, seed):
    """Sensible lines are never rejected: a line written from valid values parses back to them."""
    if not prompt or prompt.startswith("#") or " --" in " " + prompt or negative and " --" in " " + negative:
        return
    line = prompt + "".join(f" --{o} {v!r}" if isinstance(v, float) else f" --{o} {v}" for o, v in (
        ("n", negative), ("w", width), ("s", steps), ("l", guidance), ("d", seed)) if v is not None)
    assert parse_prompt_line(line, 7) == SamplePrompt(7, prompt, negative or "", width, None, steps, guidance, None, seed)


FILE_LINE = st.one_of(LINE.map(lambda t: t.encode("utf-8", "surrogatepass")),
                      st.binary(max_size=24)).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))


@settings(max_examples=100, **SETTINGS)
@given(st.lists(FILE_LINE, max_size=10), st.sampled_from([b"\n", b"\r\n", b"\r"]), st.booleans())
def test_read_prompts_keeps_exactly_the_good_lines(tmp_path_factory, lines, newline, bom):
    if lines and lines[0].startswith((b"\xef\xbb\xbf", b"\xff\xfe", b"\xfe\xff")):
        lines[0] = b"x" + lines[0]
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + newline.join(lines))
    good, bad = [], []
    for n, raw in enumerate(lines, start=1):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            bad.append((n, "UTF-8"))
            continue
        p, error = expect_line(text, n)
        if error:
            bad.append((n, error.reason))
        elif p:
            good.append(p)
    prompts, warnings = read_prompts(path)  # never raises for a bad line
    assert prompts == good
    assert len(warnings) == len(bad)
    for w, (n, reason) in zip(warnings, bad):
        assert w.startswith(f"{path}:{n}: ") and reason in w


def test_non_utf8_and_utf16_files_warn_naming_the_file(tmp_path):
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("caf\xe9 au lait --s 2\na dog\n".encode("latin-1"))
    prompts, warnings = read_prompts(latin)
    assert [p.prompt for p in prompts] == ["a dog"] and warnings == [f"{latin}:1: not valid UTF-8 (byte 3); line skipped"]
    utf16 = tmp_path / "utf16.txt"  # Notepad's "Unicode": was read as UTF-8, every prompt full of NULs
    utf16.write_text("a cat --w 64\na dog --d 3\n", encoding="utf-16")
    assert [(p.prompt, p.width, p.seed) for p in read_prompts(utf16)[0]] == [("a cat", 64, None), ("a dog", None, 3)]
    broken = tmp_path / "broken16.txt"
    broken.write_bytes(b"\xff\xfea\x00b")
    assert read_prompts(broken) == ([], [f"{broken}: starts with a UTF-16 byte-order mark but is not valid UTF-16 "
                                         f"(byte 4); no prompts read; save it as UTF-8"])


# --------------------------------------------------------------------------------------- override values

def _schema_keys() -> list[str]:
    """Every scalar or list key of the typed schema (dicts such as model.arch are not single values)."""
    root = config_mod.RootConfig()
    return [f"{s.name}.{f.name}" for s in dataclasses.fields(root)
            for f in dataclasses.fields(getattr(root, s.name)) if "Dict" not in str(f.type)]


KEYS = _schema_keys()


def _fin(v):
    return isinstance(v, int) or math.isfinite(v)


def _size(v):
    return v is None or 16 <= v <= 16384 and v % 16 == 0  # tiny_flux's multiple


def _in(*allowed):
    return lambda v: v in allowed


# What a value must satisfy to be accepted (the contract's ranges and what later stages need); keys not here
# (paths, names, free text) only have to give a clean error or none.
SENSIBLE = {
    "train.lr": lambda v: _fin(v) and v > 0, "train.max_steps": lambda v: v > 0, "train.rank": lambda v: v > 0,
    "train.batch_size": lambda v: v > 0, "train.log_every": lambda v: v > 0, "train.seed": lambda v: 0 <= v < 2**32,
    "train.alpha": lambda v: v is None or _fin(v) and v > 0, "train.weight_decay": lambda v: _fin(v) and v >= 0,
    "train.warmup_steps": lambda v: v >= 0, "train.max_grad_norm": _fin, "train.logit_mean": _fin,
    "train.logit_std": lambda v: _fin(v) and v >= 0, "train.mode_scale": lambda v: _fin(v) and -1 <= v <= 1.76,
    "train.guidance": lambda v: _fin(v) and v >= 0, "train.memory_limit_gb": lambda v: v is None or _fin(v) and v > 0,
    "train.save_every_n_steps": lambda v: v >= 0,
    "train.optimizer": _in("adamw", "adamw8bit", "prodigy", "adafactor", "lion8bit"),
    "train.lr_scheduler": _in("constant", "constant_with_warmup", "linear", "cosine"),
    "train.weighting_scheme": _in("none", "logit_normal", "mode", "sigma_sqrt", "cosmap"),
    "train.mixed_precision": _in("no", "bf16", "fp16"), "train.resume": _in("auto", "never"),
    "train.noise_offset": lambda v: _fin(v) and v >= 0, "train.huber_c": lambda v: _fin(v) and v > 0,
    "train.loss": _in("l2", "huber"), "train.network": _in("lora", "dora", "loha", "lokr"),
    "train.min_snr_gamma": lambda v: v is None,  # the default family (Flux) refuses any gamma
    "train.ema_decay": lambda v: v is None or _fin(v) and 0 < v < 1,
    "model.dtype": _in("float32", "bfloat16", "float16"), "model.storage_dtype": _in(None, "float8_e4m3fn", "float8_e5m2"),
    "model.family": _in(*FAMILIES), "model.seed": lambda v: 0 <= v < 2**64,
    "model.max_sequence_length": lambda v: 1 <= v <= 512,
    "data.resolution": lambda v: _fin(v) and 16 <= v <= 16384 and v % 16 == 0,
    "data.resolution_type": _in("pixels", "area"), "data.missing_caption": _in("error", "empty"),
    "data.bucket_max_aspect": lambda v: _fin(v) and v >= 1,
    "data.validation_split": lambda v: _fin(v) and 0 <= v < 1, "train.validate_every_n_steps": lambda v: v >= 0,
    "data.caption_dropout_rate": lambda v: 0 <= v <= 1, "data.caption_tag_dropout_rate": lambda v: 0 <= v <= 1,
    "data.keep_tokens": lambda v: v >= 0, "data.token_warmup_step": lambda v: _fin(v) and v >= 0,
    "data.token_warmup_min": lambda v: v >= 0, "text.variants": lambda v: 1 <= v <= 1000,
    "sample.steps": lambda v: 1 <= v <= 1000, "sample.cfg": lambda v: _fin(v) and v >= 0,
    "sample.true_cfg": lambda v: _fin(v) and v >= 0, "sample.seed": lambda v: 0 <= v < 2**64,
    "sample.width": _size, "sample.height": _size, "sample.every_n_steps": lambda v: v >= 0,
    "sample.generator_device": _in("cpu", "device"), "export.format": _in("kohya", "diffusers", "comfyui", "both"),
}
GOOD = ["train.lr=1e-4", "train.seed=4294967295", "train.alpha=null", "train.alpha=16", "train.mode_scale=-1",
        "train.memory_limit_gb=8", "train.max_grad_norm=0", "data.resolution=1024", "data.resolution_type=area", "data.resolution=16384",
        "data.caption_dropout_rate=1", "text.variants=1000", "sample.steps=1000", "sample.seed=18446744073709551615",
        "sample.width=16384", "sample.cfg=0", "model.max_sequence_length=512", "model.seed=0", "export.format=kohya",
        "train.noise_offset=0.1", "train.loss=huber", "train.huber_c=0.5", "train.rslora=true",
        "train.ema_decay=0.999", "train.ema_decay=null", "train.optimizer=prodigy", "train.optimizer=adafactor"]
VALUES = st.one_of(
    st.integers(-10**40, 10**40).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["0", "-0", "1", "-1", "16", "64", "0.5", "1.5", "3.5", "1e-4", "nan", "NaN", "inf", "-inf", "1e400",
                     str(10**30), str(2**32), str(2**64), "true", "false", "null", "[]", "[1,2]", "{}", "{a: 1}", "''",
                     "'x", '"', "\\", "${foo}", "${train.lr}", "${data.resolution}", "'${train.rank}'", "${oc.env:HOME}",
                     "${now:%Y}", "${oc.decode:'[1'}", "${", "}", "a=b", "=", "???", "x,y", "~", "1_000", "0x10", " ",
                     "", "\u00e9", "area", "pixels", "empty", "both", "bf16", "fp16", "cosine", "float16", "sd15",
                     "'a\x00b'", "x" * 300, "~/x", "'~nouser/x'"]),
    st.text(max_size=10),
    st.text(max_size=8).map(lambda s: "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"),
)
KEY_RE = {k: re.compile(rf"(?<![\w.]){re.escape(k)}(?!\w)") for k in KEYS}


def outcome(override: str, key: str) -> list[str]:
    """[] if the override is accepted, else the error messages; fails on any other exception, on an
    error that does not name the key, or on an accepted value outside SENSIBLE."""
    try:
        cfg, _ = compose("train", [override])
        plain = resolve_paths(cfg)
    except ConfigError as e:
        msg = str(e).replace(str([override]), "")  # compose also lists the overrides: the key must be named besides
        assert KEY_RE[key].search(msg), msg
        return [msg]
    errors = config_errors(plain)
    for e in errors:
        assert KEY_RE[key].search(e), (override, e)
    section, name = key.split(".")
    if not errors and key in SENSIBLE:
        assert SENSIBLE[key](getattr(getattr(plain, section), name)), f"{override} accepted as {getattr(getattr(plain, section), name)!r}"
    return errors


def test_defaults_are_clean_and_every_schema_key_is_fuzzed():
    assert config_errors(resolve_paths(compose("train", [])[0])) == []
    assert set(SENSIBLE) <= set(KEYS) and len(KEYS) > 60


@pytest.mark.parametrize("override", GOOD)
def test_sensible_edge_values_are_accepted(override):
    assert outcome(override, override.split("=")[0]) == []


@settings(max_examples=150, **SETTINGS)
@given(st.sampled_from(KEYS), VALUES)
def test_override_value_is_accepted_sensibly_or_rejected_naming_the_key(key, value):
    outcome(f"{key}={value}", key)


@pytest.mark.parametrize("override", [
    "train.lr=inf", "train.lr=${foo}", "train.max_steps=${train.lr}", "train.lr='x", "train.lr=a=b",
    "train.seed=-1", "train.seed=4294967296", "sample.seed=18446744073709551616", "sample.steps=1001",
    "sample.cfg=nan", "sample.width=1000000000000000000000000000000", "data.resolution=inf", "data.resolution=1e30",
    "data.bucket_max_aspect=inf", "text.variants=1000000000000000000000000000000", "train.alpha=0",
    "train.mode_scale=100", "train.logit_std=-1", "train.memory_limit_gb=nan", "model.max_sequence_length=513",
    "train.huber_c=0", "train.noise_offset=nan", "train.min_snr_gamma=5",
    "hydra.run.dir=${nope}", "data.dir=???", "data.dir='a\x00b'", "model.path=" + "x" * 300,
])
def test_found_defects_are_rejected_naming_the_key(override):
    """Each of these was accepted (and crashed, hung or trained nonsense later) or escaped as a non-ConfigError."""
    key = override.split("=")[0]
    KEY_RE.setdefault(key, re.compile(re.escape(key)))
    assert outcome(override, key) != []


# ------------------------------------------------------------------------------------------------ the CLI

CLI_CASES = {  # name: (overrides, keys the message must name)
    "values": (["train.lr=nan", "data.resolution=-64", "data.caption_dropout_rate=1.5", "sample.steps=5000"],
               ["train.lr", "data.resolution", "data.caption_dropout_rate", "sample.steps"]),
    "syntax": (["train.lr='x"], ["train.lr"]),
    "interpolation": (["train.rank=${foo}"], ["train.rank"]),
    "bad_key": (["train.lrr=1e-4"], ["train.lrr"]),
}


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
    """Every case's `python -m flows.train`, started at once: each is mostly interpreter start-up."""
    started = {}
    for name, (overrides, _) in CLI_CASES.items():
        tmp = tmp_path_factory.mktemp(name)
        env = cli_env(tmp / "prefect-home")  # the test process's shared API
        started[name] = tmp, subprocess.Popen(
            [sys.executable, "-m", "flows.train", *overrides, f"hydra.run.dir={tmp / 'run'}", f"store.root={tmp / 'store'}"],
            cwd=REPO, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    results = {}
    for name, (tmp, proc) in started.items():
        stdout, stderr = proc.communicate(timeout=300)
        results[name] = tmp, proc.returncode, stdout, stderr
    return results


@pytest.mark.parametrize("case", list(CLI_CASES))
def test_cli_stops_with_exit_2_naming_the_key_and_no_traceback(cli_runs, case):
    tmp, returncode, stdout, stderr = cli_runs[case]
    assert returncode == 2, stderr[-3000:]
    assert "stopped before training" in stderr
    assert all(k in stderr for k in CLI_CASES[case][1]), stderr[-3000:]
    assert "Traceback" not in stderr + stdout
    assert not (tmp / "store").exists() and not (tmp / "run").exists()  # stopped before any work
