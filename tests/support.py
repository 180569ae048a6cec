"""What several test files share: the helpers each once kept private in its own file, public here (issue 44:
tests import shared helpers from this one module, never another test file's private names)."""
from __future__ import annotations

import itertools
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from diffusers import DiffusionPipeline
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict

from conftest import cli_env, temporary_api_env
from families import image_families
from tasks.config import config_of
from tasks.config_schema import ModelConfig, TrainConfig
from tasks import cache_latents, cache_text, sample, train, validate
from tasks.models import make_adapter, resolve_model
from tasks.plan import Plan
from tasks.store import Store

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]  # every page whose commands are checked
RANK, ALPHA = 4, 8  # the hand-made LoRAs' rank and alpha (tests/test_export.py and the client tests)
BF16 = torch.bfloat16
SECTIONS = ("model", "data", "train", "sample", "text", "export", "store", "runner")  # the docs' setting groups
# the wrong spellings the docs show on purpose (terminal.md: the message a misspelt key gets)
MISSPELT_ON_PURPOSE = {"train.lrr"}


def load_pipeline(model_dir):
    return DiffusionPipeline.from_pretrained(model_dir, use_safetensors=True)


def pipeline_denoiser(pipe):
    return pipe.transformer if hasattr(pipe, "transformer") else pipe.unet


def render_64(pipe):
    kw = {"max_sequence_length": 32} if hasattr(pipe, "transformer") else {}
    out = pipe(prompt="a photo of a red circle", height=64, width=64, num_inference_steps=2, output_type="np",
               generator=torch.Generator("cpu").manual_seed(0), **kw)
    return out.images[0]


def trained_lora(model_dir, targets, b_scale=0.1):
    """A LoRA as training leaves it, but with non-zero B (PEFT initialises B to zero)."""
    den = pipeline_denoiser(load_pipeline(model_dir))
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets)
    den.add_adapter(config)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in den.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * b_scale)
    return get_peft_model_state_dict(den), config


def render_peft_reference(model_dir, sd, config, out_dir):
    pipe = load_pipeline(model_dir)
    key = "transformer" if hasattr(pipe, "transformer") else "unet"
    type(pipe).save_lora_weights(out_dir, **{f"{key}_lora_layers": sd,
                                             f"{key}_lora_adapter_metadata": config.to_dict()})
    pipe.load_lora_weights(str(out_dir))
    return render_64(pipe)


@dataclass
class Block:
    origin: str  # file:line of the opening fence
    lang: str
    lines: list  # (line number, text)


def doc_blocks() -> list[Block]:
    blocks = []
    for path in DOCS:
        name, block = path.relative_to(REPO).as_posix(), None
        for n, line in enumerate(path.read_text().splitlines(), 1):
            fence = re.match(r"\s*```(\S*)", line)
            if fence and block is None:
                block = Block(f"{name}:{n}", fence.group(1).lower(), [])
            elif fence:
                blocks.append(block)
                block = None
            elif block is not None:
                block.lines.append((n, line))
        assert block is None, f"{name}: a ``` block is not closed"
    return blocks


def check_overrides(overrides: list[str], where: str, config_name: str = "train") -> int:
    """Compose every member the overrides describe and run the CLI's config checks on it; returns the count."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from tasks.config import ConfigError, compose, resolve_paths
    from tasks.validate import config_errors

    choices = []
    for o in OverridesParser.create().parse_overrides(overrides):
        if not o.is_sweep_override():
            choices.append([o.input_line])
        elif o.is_interval_sweep():  # optuna's interval(a,b): its bounds
            choices.append([f"{o.get_key_element()}={v}" for v in (o.value().start, o.value().end)])
        else:
            choices.append([f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()])
    members = list(itertools.product(*choices))
    for member in members:
        try:
            cfg, _ = compose(config_name, list(member))
            errors = config_errors(resolve_paths(cfg))
        except ConfigError as e:  # a misspelt key, a wrong type, bad syntax
            raise AssertionError(f"{where}: {e}") from None
        assert not errors, f"{where}: {list(member)}:\n  " + "\n  ".join(errors)
    return len(members)


def run_cli(args, cwd, tmp_path, own_api: bool = False):
    """`python -m flows.train ARGS` against the test process's shared API, or (`own_api`) starting its own
    temporary one, as `make run` does."""
    env = (temporary_api_env if own_api else cli_env)(tmp_path / "prefect-home")
    return subprocess.run([sys.executable, "-m", "flows.train", *args], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=600)


def comfyui_merge(family: str, file: dict[str, torch.Tensor], comfy_keys) -> dict[str, torch.Tensor]:
    """{ComfyUI module key: merged delta}, as load_lora + the LoRA weight adapter compute them; fails on any file
    key that load_lora would leave unread, and on a delta whose shape is not the module's."""
    key_map = {"lora_unet_" + k.replace(".", "_"): k for k in comfy_keys}  # model_lora_keys_unet, generic rule
    read, deltas = set(), {}
    for lora_key, module in key_map.items():
        up, down, alpha = (f"{lora_key}.lora_up.weight", f"{lora_key}.lora_down.weight", f"{lora_key}.alpha")
        if up not in file:
            continue
        read |= {up, down} | ({alpha} if alpha in file else set())
        scale = file[alpha].item() / file[down].shape[0] if alpha in file else 1.0
        deltas[module] = scale * (file[up].double() @ file[down].double())
        assert tuple(deltas[module].shape) == comfy_keys[module], (module, deltas[module].shape)
    left = sorted(set(file) - read)
    assert not left, f"ComfyUI would log 'lora key not loaded' for {len(left)} key(s), e.g. {left[:4]}"
    return deltas


def generator(seed=0):
    return torch.Generator().manual_seed(seed)


def tiny_family(family, tmp_path, storage=None):
    model = ModelConfig(family=family, path=None, seed=0, arch={}, dtype="bfloat16", max_sequence_length=32, storage_dtype=storage, storage_modulation=False)
    adapter = make_adapter(model, resolve_model(model, Store(tmp_path)))
    cfg = config_of({"model": model, "train": {"rank": 4, "alpha": None, "target_modules": None,
                                     "gradient_checkpointing": False}})
    return adapter, cfg


def one_image_inputs(adapter):
    pixels = torch.rand(1, 3, 64, 64, generator=generator()) * 2 - 1
    latents = adapter.encode_latents(adapter.load_vae(), pixels.to(BF16)).to(BF16)
    text = {k: v[None] for k, v in adapter.encode_text(adapter.load_text_encoders(), ["a red circle"])[0].items()}
    return latents, text


def one_step_loss(adapter, denoiser, latents, text):
    train_cfg = TrainConfig(weighting_scheme="none", logit_mean=0.0, logit_std=1.0, mode_scale=1.29, guidance=1.0)
    return adapter.training_loss(denoiser, latents, text, train_cfg, adapter.load_train_scheduler(), [generator(3)])


def run_nodes(cfg, store):
    plan = validate.run(cfg, store)
    lat, txt = cache_latents.run(cfg, plan, store), cache_text.run(cfg, plan, store)
    lora = train.run(cfg, plan, store, lat["items"], txt["items"])
    smp = sample.run(cfg, plan, store, lora["key"], lora["lora"], txt["items"])
    return plan, lat, txt, lora, smp


def a_plan(**fields) -> Plan:
    """A Plan with the fields a test names, the others empty (a key test's plan names only what the key reads)."""
    return Plan(**{**dict(family="flux", model_dir="", ids={}, size=[64, 64], items=[], prompts=[], warnings=[],
                          augmentation={}, dataset=[], dataset_subsets=[]), **fields})


# ---------------------------------------------------------------- the docs' commands
PYTHONS = {".venv/bin/python", "python", "python3"}


CONSOLE = {"loraflow", "loraflow-explain", "loraflow-lora", "prefect", "pip", "tensorboard", "accelerate"}


PROGRAMS = PYTHONS | CONSOLE | {"make", "export"}


@dataclass
class Command:
    origin: str  # file:line
    env: dict
    argv: list

    def __str__(self):
        return " ".join(self.argv)


def _first_word(text: str) -> str:
    words = [w for w in text.split() if not re.match(r"[A-Z_][A-Z0-9_]*=", w)]
    return words[0] if words else ""


def _is_command_block(block: Block) -> bool:
    if block.lang in ("bash", "sh", "shell"):
        return True
    if block.lang:
        return False
    first = next((t for _, t in block.lines if t.strip() and not t.strip().startswith("#")), "")
    return _first_word(first) in PROGRAMS


def _without_comment(line: str) -> str:
    """The line up to a `#` that starts a word outside quotes, as the shell reads it."""
    quote = None
    for i, c in enumerate(line):
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def doc_commands() -> list[Command]:
    """Every shell command of README.md and docs/ (continuations joined, leading VAR=value as its env)."""
    commands = []
    for block in filter(_is_command_block, doc_blocks()):
        file = block.origin.split(":")[0]
        pending, start = "", None
        for n, line in block.lines:
            text = line.strip()
            if not pending and (not text or text.startswith("#")):
                continue
            start = start or n
            if text.endswith("\\"):
                pending += text[:-1] + " "
                continue
            words = shlex.split(_without_comment(pending + text).replace("$PWD", str(REPO)))
            env = {}
            while words and re.match(r"[A-Z_][A-Z0-9_]*=", words[0]):
                key, value = words.pop(0).split("=", 1)
                env[key] = value
            commands.append(Command(f"{file}:{start}", env, words))
            pending, start = "", None
    return commands


# ---------------------------------------------------------------- stored bases (fp8, int8, nf4)
def assert_same_step(adapter, reference, stored):
    """Loss, input gradient and LoRA gradients of one step through `stored` (denoiser, LoRA) are the same bits
    as through `reference`, which holds the stored weights upcast."""
    latents, text = one_image_inputs(adapter)
    results = []
    for denoiser, lora in (reference, stored):
        x = latents.clone().requires_grad_(True)
        loss = one_step_loss(adapter, denoiser, x, text)
        loss.backward()
        results.append((loss.detach(), x.grad, {n: p.grad for n, p in lora.items()}))
    (ref_loss, ref_dx, ref_grads), (loss, dx, grads) = results
    assert torch.equal(loss, ref_loss)
    assert dx is not None and torch.count_nonzero(dx) > 0
    assert torch.equal(dx, ref_dx)
    assert any(torch.count_nonzero(g) for g in grads.values())
    for name, g in grads.items():
        assert torch.equal(g, ref_grads[name]), name


def family_sweep(tmp_path, *overrides):
    """Every family through the CLI with `overrides`, as one Hydra sweep (`-m model=...`): one process and one
    Prefect API for all eight, instead of one start-up each. Member i trained image_families()[i]."""
    data = tmp_path / "data"
    shutil.copytree(REPO / "data" / "demo", data)
    sweep = tmp_path / "sweep"
    proc = run_cli(["-m", "model=" + ",".join(f"tiny_{f}" for f in image_families()), *overrides,
                 f"data.dir={data}", f"store.root={tmp_path / 'store'}", f"hydra.sweep.dir={sweep}",
                 "train.max_steps=2", "train.log_every=1", "sample.steps=2"], REPO, tmp_path)
    return proc, sweep


# ---------------------------------------------------------------- ComfyUI's key maps
# float32 products of rank-4 factors with entries of magnitude <= ~1: the merged delta and the PEFT delta are
# each one matmul of the same numbers (the fused file only multiplies up by alpha / rank, exactly 2.0 here), so
# they agree to a few float32 roundings of the delta's magnitude
REL = 8 * torch.finfo(torch.float32).eps


def comfyui_unet_key_map(denoiser_names, ldm_names=()):
    """comfy/lora.py model_lora_keys_unet, for a UNet: `lora_unet_<ldm name, _>`, `lora_unet_<diffusers name, _>`,
    and diffusers-LoRA keys `[unet.]<diffusers name>` with `.to_` -> `.processor.to_` and `.to_out.0` -> `.to_out`."""
    out = {f"lora_unet_{n.replace('.', '_')}": n for n in ldm_names}
    for n in denoiser_names:
        out[f"lora_unet_{n.replace('.', '_')}"] = n
        for p in ("", "unet."):
            d = p + n.replace(".to_", ".processor.to_")
            out[d[:-2] if d.endswith(".to_out.0") else d] = n
    return out


def box_clip(path, n: int, color, fps: float = 8, first=None) -> Path:
    """An mp4 of a box of `color` moving right 2 px a frame over a grey ground, 40x40, `n` frames (the video
    tests' clip); `first`: another colour for the first frame's box (an image-to-video edit)."""
    import numpy as np

    from tasks.data.clips import write_mp4

    frames = []
    for i in range(n):
        a = np.full((40, 40, 3), 40, np.uint8)
        a[12:26, 2 + 2 * i:14 + 2 * i] = first if (i == 0 and first) else color
        frames.append(a)
    return write_mp4(frames, path, fps)


DATA_URL = re.compile(r"!\[([^\]]*)\]\(data:image/(png|jpeg);base64,([A-Za-z0-9+/=]+)\)")


def pictures(markdown: str) -> list:
    """(alt text, decoded PIL picture) of each data-URL image in a markdown artifact (flows/artifacts.py)."""
    import base64
    import io

    from PIL import Image

    return [(alt, Image.open(io.BytesIO(base64.b64decode(data)))) for alt, _, data in DATA_URL.findall(markdown)]


def lycoris_magnitude(parts: dict) -> float:
    """The largest sum of |terms| behind an element of the delta: what its float32 rounding scales with."""
    a = {k: v.detach().double().abs() for k, v in parts.items()}
    if "hada_w1_a" in a:
        return (a["hada_w1_a"] @ a["hada_w1_b"]).max().item() * (a["hada_w2_a"] @ a["hada_w2_b"]).max().item()
    w2 = a["lokr_w2"] if "lokr_w2" in a else a["lokr_w2_a"] @ a["lokr_w2_b"]
    return a["lokr_w1"].max().item() * w2.max().item()
