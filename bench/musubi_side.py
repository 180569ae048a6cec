"""Issue 45 item 4: musubi-tuner's own LoRA training step beside loraflow's, in one process, on the same DiT
architecture with random bf16 weights: step time, peak memory and MFU per setting, the two trainers alternated.

    bash bench/musubi_source.sh                        # once: musubi-tuner into bench/third_party/ (untracked)
    python -m bench.musubi_side                        # CUDA: Qwen-Image, 1024 px (bench/musubi_side.json)
    python -m bench.musubi_side --family flux_kontext  # FLUX.1 Kontext [dev] (needs einops for musubi's Flux)
    python -m bench.musubi_side --tiny                 # smoke test on any machine: a 3-block DiT at 64 px

Both sides: batch 1, 1024x1024 (128x128 latents, 2x2 patches: 4096 image tokens; Kontext adds its control image's
4096), 512 text tokens (all real: musubi passes no mask, loraflow an all-ones mask), LoRA rank 16 and alpha 16 in
fp32 on the same modules (musubi's defaults, below), gradient checkpointing of every block, AdamW lr 1e-4,
gradient clipping at 1.0, bf16 autocast. A step is forward, backward, clipping and the optimizer step (timed
with torch.cuda.synchronize); its median over `--steps` steps after `--warmup` per unit, pooled over `--rounds`
rounds; each round builds musubi's unit, then loraflow's, per setting (A B A B ...). Peak memory is
torch.cuda.max_memory_allocated over a unit's steps (model building excluded). MFU: the FLOPs of one step
(forward, checkpoint recompute, backward) counted by torch's FlopCounterMode in each trainer's first unit, over
the median step and the card's dense bf16 peak (bench.gpu_speed.PEAK_BF16: H100/H200 989e12). A unit that raises
is recorded (`error`) and the others still run. The JSON is rewritten after every unit (`complete` is false until
the last) and `--budget S` starts no unit after S seconds: a run cut short on a lent GPU keeps what it measured.

Settings (comma list; `+` joins parts): `bf16`; `fp8` (musubi `--fp8_base`: the whole DiT cast to float8_e4m3fn,
computed under autocast, vs loraflow `model.quantize=fp8` with its default `model.matmul=auto`: fp8 W8A8 matmuls
on a GPU with them, the row's `matmul` says); `fp8scaled` (musubi `--fp8_base --fp8_scaled`, the fp8 recipe its
Qwen-Image docs give, block-scaled weights; loraflow has no scaled fp8: `model.quantize=fp8` again);
`dequant` (loraflow `model.matmul=dequantize`); `swapN` (musubi `--blocks_to_swap N` vs loraflow
`train.blocks_to_swap=N`); `h2d` / `pinned` (musubi `--block_swap_h2d_only` / `--use_pinned_memory_for_block_swap`,
CUDA only; loraflow's swap is always host-to-device only and pinned).

musubi-tuner (kohya-ss/musubi-tuner at MUSUBI_COMMIT, src/musubi_tuner/), what each unit runs of it:
- the DiT: qwen_image/qwen_image_model.py QwenImageTransformer2DModel with create_model's config (60 blocks, 3072
  wide: diffusers' config too), attn_mode "torch" (`--sdpa`); flux/flux_models.py Flux(configs_flux_dev_context).
  Random bf16 weights made on the device replace load_qwen_image_model / load_flow_model's file; `--fp8_scaled`
  runs that loader's fp8 step on them (optimize_state_dict_with_fp8 + apply_fp8_monkey_patch, with
  FP8_OPTIMIZATION_TARGET_KEYS / _EXCLUDE_KEYS; Flux.fp8_optimization);
- training/trainer_base.py NetworkTrainer: _load_dit_and_swap's block swap (enable_block_swap with
  BlockSwapConfig.from_args, move_to_device_except_swap_blocks), _build_network's LoRA
  (networks/lora_qwen_image.py / lora_flux.py create_arch_network, apply_to) and enable_gradient_checkpointing,
  get_optimizer (`--optimizer_type adamw`), _prepare_with_accelerator (the fp8 cast, accelerator.prepare,
  prepare_block_swap_before_forward), and _run_training_loop's step: process_batch
  (get_noisy_model_input_and_timesteps, call_dit, compute_loss), accelerator.backward, clip_grad_norm_,
  optimizer.step, zero_grad (no lr scheduler: a constant lr); accelerator from training/accelerator_setup.py prepare_accelerator; the arguments
  parsed by its own parser (training/parser_common.py setup_parser_common + the family's setup_parser) from the
  flags its docs give (docs/qwen_image.md, flux_kontext.md);
- qwen_image_train_network.py QwenImageNetworkTrainer.call_dit; flux_kontext_train_network.py
  FluxKontextNetworkTrainer.call_dit.
Those trainer modules import musubi's dataset and sampling code at import time (cv2, voluptuous, torchvision),
which the step never runs and loraflow's environment does not have: so the methods above are compiled from
musubi's own source text (ast, unchanged, their file and line numbers kept: `from_source`) into one small class;
everything else is imported as it is. The loader's CPU-first placement of a swapped model is skipped (weights are
made on the device; musubi's prepare_block_swap_before_forward then moves the swapped blocks' weights to the host:
the same placement at the first step).

musubi's LoRA targets are its defaults: for Qwen-Image every Linear of a QwenImageTransformerBlock (its `_mod_`
exclude pattern matches no dotted module name, so the AdaLN modulation linears img_mod.1 / txt_mod.1 are in), for
Kontext every Linear of the double/single blocks but the modulation and norms. loraflow trains the same modules
(peft; diffusers' Qwen-Image names are musubi's, Flux's are unfused: q/k/v where musubi has one qkv Linear, so
Kontext's loraflow LoRA has more parameters at the same rank; `lora_params` per row), unless `--targets own`
(each trainer's own default: loraflow's is the image-stream attention). Process-wide: cuDNN attention is off
for both (loraflow's train node turns it off; its backward crashed at 4608 tokens, bench/RESULTS.md)."""
from __future__ import annotations

import __future__
import argparse
import ast
import dataclasses
import gc
import json
import logging
import statistics
import sys
import time
import traceback
from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

from bench.flux_train import FLUX_DEV, TRAIN_CFG, random_model, train_step
from bench.gpu_speed import peak_flops

HERE = Path(__file__).resolve().parent
MUSUBI_SRC = HERE / "third_party" / "musubi_tuner" / "src"  # bench/musubi_source.sh writes it
MUSUBI_COMMIT = "30c658c4f4b0bf05038b3346eff9670259b10fc7"  # bench/musubi_source.sh
GIB = 1 << 30
RANK = 16
LR = 1e-4

# Qwen-Image's DiT: musubi's create_model = diffusers' transformer/config.json
QWEN_IMAGE = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                  num_attention_heads=24, joint_attention_dim=3584, axes_dims_rope=(16, 56, 56))
QWEN_TINY = dict(QWEN_IMAGE, num_layers=3, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=64,
                 axes_dims_rope=(4, 6, 6))
# FLUX.1 Kontext [dev]: FLUX.1-dev's transformer (musubi's configs_flux_dev_context); tiny: enough single blocks for
# musubi's swap (it swaps 2(N - N//2) + 1 single blocks and keeps 2)
KONTEXT_TINY = dict(FLUX_DEV, num_layers=2, num_single_layers=5, attention_head_dim=16, num_attention_heads=2,
                    joint_attention_dim=64, pooled_projection_dim=32, axes_dims_rope=(4, 6, 6))
# musubi's default LoRA modules, as peft targets on diffusers' models (see the docstring)
QWEN_TARGETS = ("img_mod.1", "txt_mod.1", "attn.to_q", "attn.to_k", "attn.to_v", "attn.add_q_proj",
                "attn.add_k_proj", "attn.add_v_proj", "attn.to_out.0", "attn.to_add_out", "img_mlp.net.0.proj",
                "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2")
KONTEXT_TARGETS = (r"(transformer_blocks|single_transformer_blocks)\.\d+\.(attn\.(to_q|to_k|to_v|add_q_proj|add_k_proj"
                   r"|add_v_proj|to_out\.0|to_add_out)|ff(_context)?\.net\.(0\.proj|2)|proj_mlp|proj_out)")
# musubi's command line (its docs' recipe; rank, alpha, lr and optimizer as loraflow's side)
MUSUBI_FLAGS = ["--dit", "random-weights", "--dataset_config", "none", "--sdpa", "--mixed_precision", "bf16",
                "--weighting_scheme", "none", "--optimizer_type", "adamw", "--learning_rate", str(LR),
                "--gradient_checkpointing", "--network_dim", str(RANK), "--network_alpha", str(RANK),
                "--max_grad_norm", "1.0", "--seed", "42"]
FAMILY_FLAGS = {"qwenimage": ["--timestep_sampling", "shift", "--discrete_flow_shift", "2.2",
                              "--network_module", "networks.lora_qwen_image"],
                "flux_kontext": ["--timestep_sampling", "flux_shift", "--network_module", "networks.lora_flux"]}


class MusubiMissing(RuntimeError):
    pass


# -- settings ----------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Setting:
    name: str
    fp8: bool = False
    scaled: bool = False
    dequant: bool = False
    swap: int = 0
    h2d: bool = False
    pinned: bool = False

    @classmethod
    def parse(cls, name: str) -> "Setting":
        parts = name.split("+")
        swaps = [int(p[4:]) for p in parts if p.startswith("swap") and p[4:].isdigit()]
        unknown = [p for p in parts if p not in ("bf16", "fp8", "fp8scaled", "dequant", "h2d", "pinned")
                   and not (p.startswith("swap") and p[4:].isdigit())]
        if unknown:
            raise ValueError(f"setting {name!r}: unknown {unknown} (parts: bf16, fp8, fp8scaled, dequant, swapN, h2d, "
                             "pinned, joined by +)")
        return cls(name, fp8="fp8" in parts or "fp8scaled" in parts, scaled="fp8scaled" in parts,
                   dequant="dequant" in parts, swap=swaps[0] if swaps else 0, h2d="h2d" in parts,
                   pinned="pinned" in parts)

    def musubi_flags(self, swap: int) -> list[str]:
        return ((["--fp8_base"] if self.fp8 else []) + (["--fp8_scaled"] if self.scaled else [])
                + (["--blocks_to_swap", str(swap)] if swap else []) + (["--block_swap_h2d_only"] if self.h2d else [])
                + (["--use_pinned_memory_for_block_swap"] if self.pinned else []))

    def loraflow_overrides(self, swap: int) -> dict:
        model = {"quantize": "fp8", "matmul": "dequantize" if self.dequant else "auto"} if self.fp8 else {}
        return {"model": model, "train": {"blocks_to_swap": swap} if swap else {}}


# -- the two families --------------------------------------------------------------------------------------------
def max_swap(family: str, arch: dict) -> int:
    """The most blocks each trainer can swap in this architecture (musubi's enable_block_swap asserts)."""
    if family == "qwenimage":
        return arch["num_layers"] - 1
    n = 0
    while (n + 1) // 2 <= arch["num_layers"] - 2 and ((n + 1) - (n + 1) // 2) * 2 + 1 <= arch["num_single_layers"] - 2:
        n += 1
    return n


def make_inputs(family: str, arch: dict, resolution: int, text_len: int, device) -> dict:
    """One batch's cached tensors (random, seeded), shared by both trainers."""
    import torch

    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=torch.bfloat16)

    latent = resolution // 8
    channels = 16  # the VAE's; both DiTs take 2x2 patches of them (in_channels 64)
    data = {"latents": rnd(1, channels, latent, latent), "text": rnd(1, text_len, arch["joint_attention_dim"])}
    if family == "flux_kontext":
        data.update(control=rnd(1, channels, latent, latent), pooled=rnd(1, arch["pooled_projection_dim"]))
    return data


def musubi_batch(family: str, data: dict) -> dict:
    """The batch musubi's dataloader hands a step (its cached latents and text encoder outputs): new tensors each
    step, as from its dataloader (call_dit sets requires_grad on some of them in place)."""
    data = {k: v.clone() for k, v in data.items()}
    if family == "qwenimage":  # latents B, C, 1, H, W; vl_embed: a list of each item's (L, D), no padding
        return {"latents": data["latents"][:, :, None], "vl_embed": [data["text"][0]], "timesteps": None}
    return {"latents": data["latents"], "latents_control": data["control"], "t5_vec": data["text"],
            "clip_l_pooler": data["pooled"], "timesteps": None}


def loraflow_inputs(family: str, data: dict):
    """(latents, text) as loraflow's train node reads them from its store."""
    import torch

    if family == "qwenimage":
        mask = torch.ones(data["text"].shape[:2], dtype=torch.int64, device=data["text"].device)
        return data["latents"], {"prompt_embeds": data["text"], "attention_mask": mask}
    return data["latents"], {"prompt_embeds": data["text"], "pooled_prompt_embeds": data["pooled"],
                             "control_latents": data["control"][:, None]}


# -- musubi-tuner ------------------------------------------------------------------------------------------------
def from_source(path: Path, names: list[str], env: dict) -> dict:
    """Functions, classes and constants of one musubi file ("name" or "Class.method"), compiled from its own
    source in a namespace holding `env` (annotations left unevaluated). Returns {name: object}."""
    tree = ast.parse(path.read_text(), str(path))
    top = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            top[node.name] = node
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            top[node.targets[0].id] = node
    nodes = []
    for name in names:
        owner, _, method = name.partition(".")
        node = top[owner]
        if method:
            node = next(n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == method)
        nodes.append(node)
    ns = dict(env)
    code = compile(ast.Module(body=nodes, type_ignores=[]), str(path), "exec",
                   flags=__future__.annotations.compiler_flag, dont_inherit=True)
    exec(code, ns)  # noqa: S102 (musubi's pinned source, see the module docstring)
    return {name: ns[name.rpartition(".")[2]] for name in names}


def load_musubi(family: str) -> SimpleNamespace:
    """musubi-tuner's pieces for one family: its modules, and a trainer class of its own methods."""
    if not (MUSUBI_SRC / "musubi_tuner").is_dir():
        raise MusubiMissing(f"{MUSUBI_SRC.parent} is missing: run `bash bench/musubi_source.sh` first")
    if str(MUSUBI_SRC) not in sys.path:
        sys.path.insert(0, str(MUSUBI_SRC))
    import importlib
    import math
    import random
    from dataclasses import dataclass, field

    import torch
    import transformers

    if family == "flux_kontext":
        try:
            import einops
        except ImportError as e:
            raise MusubiMissing("musubi-tuner's FLUX.1 Kontext model needs einops (pip install einops)") from e
    from musubi_tuner.modules.custom_offloading_utils import BlockSwapConfig
    from musubi_tuner.modules.scheduling_flow_match_discrete import FlowMatchDiscreteScheduler
    from musubi_tuner.training import timesteps
    from musubi_tuner.training.accelerator_setup import prepare_accelerator
    from musubi_tuner.training.parser_common import setup_parser_common
    from musubi_tuner.utils import train_utils

    pkg = MUSUBI_SRC / "musubi_tuner"
    base = from_source(pkg / "training/trainer_base.py", ["DiTOutput"], {"dataclass": dataclass, "field": field})
    env = dict(torch=torch, math=math, random=random, ast=ast, importlib=importlib, transformers=transformers,
               train_utils=train_utils, logger=logging.getLogger("musubi_tuner.training.trainer_base"),
               DiTOutput=base["DiTOutput"], **{k: getattr(timesteps, k) for k in (
                   "compute_density_for_timestep_sampling", "compute_ideogram4_shift_timestep", "get_sigmas",
                   "compute_loss_weighting_for_sd3")})
    methods = from_source(pkg / "training/trainer_base.py", [f"NetworkTrainer.{m}" for m in (
        "__init__", "get_bucketed_timestep", "get_noisy_model_input_and_timesteps", "process_batch", "compute_loss",
        "get_optimizer", "_prepare_with_accelerator")], env)
    if family == "qwenimage":
        from musubi_tuner.networks import lora_qwen_image as network
        from musubi_tuner.qwen_image import qwen_image_model as model

        utils = SimpleNamespace(**from_source(pkg / "qwen_image/qwen_image_utils.py", [
            "VAE_SCALE_FACTOR", "pack_latents", "unpack_latents", "add_model_version_args",
            "resolve_model_version_args"], {"torch": torch}))
        own = from_source(pkg / "qwen_image_train_network.py", [
            "QwenImageNetworkTrainer.call_dit", "QwenImageNetworkTrainer.scale_shift_latents",
            "qwen_image_setup_parser"], {**env, "qwen_image_model": model, "qwen_image_utils": utils})
        setup_parser = own.pop("qwen_image_setup_parser")
    else:
        from musubi_tuner.flux import flux_models as model
        from musubi_tuner.networks import lora_flux as network

        utils = SimpleNamespace(**from_source(pkg / "flux/flux_utils.py", ["prepare_img_ids"],
                                              {"torch": torch, "einops": einops}))
        own = from_source(pkg / "flux_kontext_train_network.py", [
            "FluxKontextNetworkTrainer.call_dit", "FluxKontextNetworkTrainer.scale_shift_latents",
            "flux_kontext_setup_parser"],
            {**env, "flux_models": model, "flux_utils": utils, "rearrange": einops.rearrange})
        setup_parser = own.pop("flux_kontext_setup_parser")
    trainer = type(f"Musubi{family}Trainer", (), {k.rpartition(".")[2]: v for k, v in {**methods, **own}.items()})
    return SimpleNamespace(model=model, network=network, utils=utils, trainer=trainer,
                           BlockSwapConfig=BlockSwapConfig, FlowMatchDiscreteScheduler=FlowMatchDiscreteScheduler,
                           prepare_accelerator=prepare_accelerator, parser=lambda: setup_parser(setup_parser_common()))


def musubi_args(m, family: str, flags: list[str]):
    """musubi's arguments, parsed by its own parser; then what its family's main() sets."""
    args = m.parser().parse_args(MUSUBI_FLAGS + FAMILY_FLAGS[family] + flags)
    if family == "qwenimage":
        args.dit_dtype = "bfloat16"
        m.utils.resolve_model_version_args(args)
    else:
        args.dit_dtype = None
    return args


def musubi_dit(m, family: str, arch: dict, device):
    """musubi's DiT with random bf16 weights made on `device` (in place of its loader's file)."""
    import torch

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            if family == "qwenimage":
                return m.model.QwenImageTransformer2DModel(**arch, attn_mode="torch", split_attn=False)
            params = m.model.configs_flux_dev_context.params
            if arch is not FLUX_DEV:  # --tiny: the same model, smaller
                params = dataclasses.replace(
                    params, vec_in_dim=arch["pooled_projection_dim"], context_in_dim=arch["joint_attention_dim"],
                    hidden_size=arch["num_attention_heads"] * arch["attention_head_dim"],
                    num_heads=arch["num_attention_heads"], depth=arch["num_layers"],
                    depth_single_blocks=arch["num_single_layers"], axes_dim=list(arch["axes_dims_rope"]))
            return m.model.Flux(params, "torch", False)
    finally:
        torch.set_default_dtype(previous)


class MusubiUnit:
    """One musubi-tuner training setup (its NetworkTrainer.train up to the loop) and its loop's step."""

    def __init__(self, family: str, setting: Setting, swap: int, arch: dict, device, data: dict):
        import torch

        m = self.m = load_musubi(family)
        self.flags = setting.musubi_flags(swap)
        args = self.args = musubi_args(m, family, self.flags)
        self.trainer = trainer = m.trainer()
        trainer.__init__()
        trainer.is_edit, trainer.is_layered, trainer.num_timestep_buckets = False, False, None
        self.accelerator = acc = m.prepare_accelerator(args)
        # _prepare_accelerator_and_dtypes
        self.dit_dtype = torch.bfloat16
        dit_weight_dtype = (None if args.fp8_scaled else torch.float8_e4m3fn) if args.fp8_base else self.dit_dtype
        # _load_dit_and_swap: load_transformer (here random weights; --fp8_scaled as its loader does it)
        model = musubi_dit(m, family, arch, acc.device)
        if args.fp8_scaled:
            sd = model.state_dict()
            if family == "qwenimage":
                from musubi_tuner.modules.fp8_optimization_utils import (apply_fp8_monkey_patch,
                                                                         optimize_state_dict_with_fp8)

                sd = optimize_state_dict_with_fp8(sd, acc.device, m.model.FP8_OPTIMIZATION_TARGET_KEYS,
                                                  m.model.FP8_OPTIMIZATION_EXCLUDE_KEYS, move_to_device=True)
                apply_fp8_monkey_patch(model, sd, use_scaled_mm=False)
            else:
                sd = model.fp8_optimization(sd, acc.device, move_to_device=True)
            model.load_state_dict(sd, strict=True, assign=True)
            del sd
        model.eval()
        model.requires_grad_(False)
        trainer.blocks_to_swap = args.blocks_to_swap or 0
        if trainer.blocks_to_swap:
            config = m.BlockSwapConfig.from_args(args, acc.device, supports_backward=True)
            model.enable_block_swap(trainer.blocks_to_swap, config)
            model.move_to_device_except_swap_blocks(acc.device)
        # _build_network
        network = m.network.create_arch_network(1.0, args.network_dim, args.network_alpha, None, None, model,
                                                neuron_dropout=args.network_dropout)
        network.apply_to(None, model, apply_text_encoder=False, apply_unet=True)
        model.enable_gradient_checkpointing(args.gradient_checkpointing_cpu_offload)
        network.enable_gradient_checkpointing()
        # _build_optimizer_and_dataloader (no dataset, no lr scheduler: a constant lr) and _prepare_with_accelerator
        params, _ = network.prepare_optimizer_params(unet_lr=args.learning_rate)
        _, _, optimizer, _, _ = trainer.get_optimizer(args, params)
        (self.model, self.network, self.optimizer, _, _, self.training_model,
         self.network_dtype) = trainer._prepare_with_accelerator(args, acc, model, network, optimizer, None, None,
                                                                 torch.bfloat16, self.dit_dtype, dit_weight_dtype)
        self.scheduler = m.FlowMatchDiscreteScheduler(shift=args.discrete_flow_shift, reverse=True, solver="euler")
        self.family, self.data = family, data
        self.lora_params = sum(p.numel() for p in acc.unwrap_model(self.network).parameters())
        self.info = {"musubi_flags": " ".join(self.flags),
                     "lora_modules": len(acc.unwrap_model(self.network).unet_loras)}

    def loss(self, step: int):
        # _run_training_loop: scale_shift_latents, noise, process_batch
        import torch

        batch = musubi_batch(self.family, self.data)
        latents = self.trainer.scale_shift_latents(batch["latents"])
        noise = torch.randn_like(latents)
        loss, _ = self.trainer.process_batch(self.args, self.accelerator, self.model, self.network, batch, latents,
                                             noise, self.scheduler, self.dit_dtype, self.network_dtype, None, step)
        return loss

    def backward(self, loss):
        self.accelerator.backward(loss)

    def step(self, step: int):
        acc, args = self.accelerator, self.args
        with acc.accumulate(self.training_model):
            loss = self.loss(step)
            acc.backward(loss)
            if acc.sync_gradients and args.max_grad_norm != 0.0:
                acc.clip_grad_norm_(acc.unwrap_model(self.network).get_trainable_params(), args.max_grad_norm)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return loss

    def zero_grad(self):
        self.optimizer.zero_grad(set_to_none=True)

    def close(self):
        self.accelerator.free_memory()  # accelerate keeps what it prepared
        self.model = self.network = self.optimizer = self.training_model = self.accelerator = None


# -- loraflow ----------------------------------------------------------------------------------------------------
class LoraflowUnit:
    """The train node's own setup (tasks.training.train_setup.prepare_denoiser, make_optimizer) and step
    (bench.flux_train.train_step: the adapter's training_loss, backward, clipping, AdamW)."""

    def __init__(self, family: str, setting: Setting, swap: int, arch: dict, device, data: dict, targets: str):
        from diffusers import FlowMatchEulerDiscreteScheduler

        from tasks.training import w8a8
        from tasks.training.train_setup import make_optimizer, prepare_denoiser

        if family == "qwenimage":
            from diffusers import QwenImageTransformer2DModel as cls

            from tasks.models.qwenimage import QwenImageAdapter as base
        else:
            from diffusers import FluxTransformer2DModel as cls

            from tasks.models.flux_kontext import FluxKontextAdapter as base
        same = {"qwenimage": QWEN_TARGETS, "flux_kontext": KONTEXT_TARGETS}[family]

        class Random(base):
            if targets == "musubi":
                LORA_TARGETS = same

            def load_denoiser(self):
                return random_model(cls, arch, device)

        over = setting.loraflow_overrides(swap)
        cfg = {"model": {"storage_dtype": None, "storage_modulation": False, "quantize": "none", "matmul": "auto",
                         **over["model"]},
               "train": {"rank": RANK, "alpha": None, "target_modules": None, "gradient_checkpointing": True,
                         "blocks_to_swap": 0, **over["train"]}}
        self.adapter = Random(HERE, "bfloat16")  # (no model folder is read)
        self.model, named = prepare_denoiser(self.adapter, cfg, stream=False)
        self.model.train()
        self.params = list(named.values())
        self.optimizer = make_optimizer(TRAIN_CFG, self.params)
        self.scheduler = FlowMatchEulerDiscreteScheduler()
        self.latents, self.text = loraflow_inputs(family, data)
        self.lora_params = sum(p.numel() for p in self.params)
        overrides = [f"{s}.{k}={v}" for s in ("model", "train") for k, v in over[s].items()]
        self.info = {"loraflow_overrides": " ".join(overrides),
                     "matmul": w8a8.resolve(cfg["model"]) if setting.fp8 else None}

    def loss(self, step: int):
        import torch

        with torch.autocast(self.latents.device.type, dtype=torch.bfloat16):
            return self.adapter.training_loss(self.model, self.latents, self.text, TRAIN_CFG, self.scheduler,
                                              [torch.Generator().manual_seed(step)])

    def backward(self, loss):
        loss.backward()

    def step(self, step: int):
        import torch

        return train_step(self.adapter, self.model, self.params, self.optimizer, self.scheduler, self.latents,
                          self.text, [torch.Generator().manual_seed(step)])

    def zero_grad(self):
        self.optimizer.zero_grad(set_to_none=True)

    def close(self):
        self.model = self.params = self.optimizer = None


# -- timing ------------------------------------------------------------------------------------------------------
def cpu_cuda_calls():
    """musubi's offloader calls torch.cuda.set_device in its copy thread whatever the device
    (custom_offloading_utils.py, Offloader._submit_move_blocks): on a machine without CUDA those two calls are
    made no-ops, so the CPU smoke test runs its swap. Never used with CUDA."""
    import torch

    stack = ExitStack()
    stack.enter_context(mock.patch.object(torch.cuda, "set_device", lambda device: None))
    stack.enter_context(mock.patch.object(torch.cuda, "current_device", lambda: 0))
    return stack


def run_unit(trainer: str, family: str, setting: Setting, a, arch: dict, device, data: dict, count_flops: bool) -> dict:
    import torch

    cuda = device.type == "cuda"
    swap = min(setting.swap, max_swap(family, arch))
    out = {"setting": setting.name, "trainer": trainer, "swap": swap, "step_s": [], "error": None}
    unit = None
    with ExitStack() as stack:
        if trainer == "musubi" and swap and not cuda:
            stack.enter_context(cpu_cuda_calls())
        try:
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            t = time.perf_counter()
            unit = (MusubiUnit(family, setting, swap, arch, device, data) if trainer == "musubi"
                    else LoraflowUnit(family, setting, swap, arch, device, data, a.targets))
            out.update(unit.info, build_s=time.perf_counter() - t, lora_params=unit.lora_params)
            if count_flops:
                out["flops"] = step_flops(unit)
            if cuda:
                torch.cuda.synchronize()
                out["weights_gib"] = torch.cuda.memory_allocated() / GIB
                torch.cuda.reset_peak_memory_stats()
            for step in range(a.warmup + a.steps):
                t = time.perf_counter()
                loss = unit.step(step)
                if cuda:
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t
                if step >= a.warmup:
                    out["step_s"].append(dt)
                print(f"  {trainer} {setting.name}: step {step + 1}/{a.warmup + a.steps} {dt:.3f} s "
                      f"loss {loss.item():.4g}", flush=True)
                del loss
        except Exception as e:  # recorded; the other units still run
            out["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:500]
            out["traceback"] = traceback.format_exc()[-3000:]
            print(f"  {trainer} {setting.name}: {out['error']}", flush=True)
        finally:
            if unit is not None:
                unit.close()
            del unit
            gc.collect()
            if cuda:
                try:  # after a CUDA error the context may be gone: keep the error above
                    out["peak_gib"] = torch.cuda.max_memory_allocated() / GIB
                    torch.cuda.empty_cache()
                except Exception as e:  # noqa: BLE001
                    out["error"] = out["error"] or f"{type(e).__name__}: {e}"
    return out


def step_flops(unit) -> float:
    """FLOPs of one step's loss and backward (forward, checkpoint recompute, backward), counted by torch."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        unit.backward(unit.loss(0))
    unit.zero_grad()
    return float(counter.get_total_flops())


def summarise(units: list[dict], peak: float | None) -> list[dict]:
    """One row per (setting, trainer): the median of every measured step of its rounds, the largest peak."""
    rows, flops = {}, {u["trainer"]: u["flops"] for u in units if u.get("flops")}
    for u in units:
        r = rows.setdefault((u["setting"], u["trainer"]), {
            "setting": u["setting"], "trainer": u["trainer"], "step_s": None, "peak_gib": None, "mfu": None,
            "error": None, "steps": [], "rounds": 0, "flops": flops.get(u["trainer"])})
        r["rounds"] += 1
        r["steps"] += u["step_s"]
        r["error"] = r["error"] or u["error"]
        if u.get("peak_gib") is not None:
            r["peak_gib"] = max(r["peak_gib"] or 0.0, u["peak_gib"])
        for k in ("swap", "musubi_flags", "loraflow_overrides", "matmul", "lora_params", "lora_modules", "weights_gib"):
            if k in u:
                r[k] = u[k]
        r.setdefault("tracebacks", []).extend([u["traceback"]] if u.get("traceback") else [])
    for r in rows.values():
        r["step_s"] = statistics.median(r["steps"]) if r["steps"] else None
        if r["step_s"] and r["flops"] and peak:
            r["mfu"] = r["flops"] / r["step_s"] / peak
    return list(rows.values())


def figures(rows: list[dict], family: str, arch_name: str) -> list[dict]:
    out = []
    by = {(r["setting"], r["trainer"]): r for r in rows}
    for setting in dict.fromkeys(r["setting"] for r in rows):
        mu, lf = by.get((setting, "musubi"), {}), by.get((setting, "loraflow"), {})
        if mu.get("step_s") and lf.get("step_s"):
            value = lf["step_s"] / mu["step_s"]
            out.append({"name": f"musubi-tuner vs loraflow, {arch_name} {setting}: loraflow/musubi step ratio "
                                f"(rank {RANK}, checkpointing, AdamW)", "value": value, "unit": "x",
                        "goal": "<= 1.0", "meets": value <= 1.0})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.musubi_side", description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="a tiny DiT at 64 px: a smoke test on any machine")
    ap.add_argument("--family", choices=("qwenimage", "flux_kontext"), default="qwenimage")
    ap.add_argument("--settings", default="bf16,fp8,swap16", help="comma list (module docstring); default %(default)s")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="measured steps per unit")
    ap.add_argument("--warmup", type=int, default=1, help="unmeasured steps first, per unit")
    ap.add_argument("--resolution", type=int, default=None, help="pixels (default 1024; --tiny 64)")
    ap.add_argument("--text-len", type=int, default=None, help="text tokens (default 512; --tiny 16)")
    ap.add_argument("--targets", choices=("musubi", "own"), default="musubi",
                    help="LoRA modules: musubi's defaults on both sides, or each trainer's own default")
    ap.add_argument("--budget", type=float, default=None, help="seconds: start no unit after this many")
    ap.add_argument("--out", default=None, help="default bench/musubi_side[_flux_kontext][_tiny].json")
    a = ap.parse_args(argv)
    try:
        settings = [Setting.parse(s) for s in a.settings.split(",") if s]
        load_musubi(a.family)
    except (ValueError, MusubiMissing) as e:
        print(e, file=sys.stderr)
        return 2
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)  # for both (module docstring)
    full = FLUX_DEV if a.family == "flux_kontext" else QWEN_IMAGE
    arch = (KONTEXT_TINY if a.family == "flux_kontext" else QWEN_TINY) if a.tiny else full
    a.resolution = a.resolution or (64 if a.tiny else 1024)
    a.text_len = a.text_len or (16 if a.tiny else 512)
    name = {"qwenimage": "Qwen-Image", "flux_kontext": "FLUX.1 Kontext [dev]"}[a.family]
    arch_name = f"{'tiny ' if a.tiny else ''}{name} {a.resolution} px"
    data = make_inputs(a.family, arch, a.resolution, a.text_len, device)
    suffix = ("" if a.family == "qwenimage" else f"_{a.family}") + ("_tiny" if a.tiny else "")
    out = Path(a.out or HERE / f"musubi_side{suffix}.json")
    peak = peak_flops(device)
    head = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "musubi_commit": MUSUBI_COMMIT,
            "family": a.family, "arch": arch_name, "torch": torch.__version__, "resolution": a.resolution,
            "text_len": a.text_len, "rank": RANK, "targets": a.targets, "rounds": a.rounds, "steps": a.steps,
            "warmup": a.warmup, "peak_bf16_flops": peak}
    units, rows, figs, t0, counted = [], [], [], time.time(), set()
    plan = [(r, s, trainer) for r in range(a.rounds) for s in settings for trainer in ("musubi", "loraflow")]
    for r, s, trainer in plan:  # A B, every setting, every round
        if a.budget and time.time() - t0 > a.budget:
            print(f"--budget {a.budget} s spent: {len(plan) - len(units)} units not run", flush=True)
            break
        print(f"round {r + 1}/{a.rounds} {s.name} {trainer} ...", flush=True)
        units.append(run_unit(trainer, a.family, s, a, arch, device, data, count_flops=trainer not in counted))
        counted |= {trainer} if units[-1].get("flops") else set()
        rows = summarise(units, peak)  # written after every unit: a run cut short keeps what it measured
        figs = figures(rows, a.family, arch_name)
        result = {**head, "complete": len(units) == len(plan), "rows": rows, "figures": figs,
                  "seconds": round(time.time() - t0, 1)}
        out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    for r in rows:
        nan = float("nan")
        print(f"{r['setting']:>14} {r['trainer']:>8}: {r['step_s'] or nan:.3f} s  MFU {r['mfu'] or nan:.3f}"
              f"  peak {r['peak_gib'] or nan:.2f} GiB  {r['error'] or ''}")
    for f in figs:
        print(f"{f['name']}: {f['value']:.3f} ({'meets' if f['meets'] else 'misses'} {f['goal']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
