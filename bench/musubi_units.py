"""The two trainers of bench.musubi_side, each one training setup that takes steps: musubi-tuner's (its own
modules and NetworkTrainer methods, compiled from its pinned source where its trainer modules cannot be imported:
the module docstring of bench/musubi_side.py says which) and loraflow's (the train node's prepare_denoiser and
loss on random weights)."""
from __future__ import annotations

import __future__
import ast
import dataclasses
import logging
import sys
from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

from bench import musubi_settings  # its MUSUBI_SRC read at call time (tests point it elsewhere)
from bench.flux_train import FLUX_DEV, TRAIN_CFG, random_model, train_step
from bench.musubi_settings import (
    FAMILY_FLAGS, HERE, KONTEXT_TARGETS, MUSUBI_FLAGS, MusubiMissing, QWEN_TARGETS, RANK, Setting,
    loraflow_inputs, musubi_batch,
)
from tasks.config import config_of


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
    if not (musubi_settings.MUSUBI_SRC / "musubi_tuner").is_dir():
        raise MusubiMissing(f"{musubi_settings.MUSUBI_SRC.parent} is missing: run `bash bench/musubi_source.sh` first")
    if str(musubi_settings.MUSUBI_SRC) not in sys.path:
        sys.path.insert(0, str(musubi_settings.MUSUBI_SRC))
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

    pkg = musubi_settings.MUSUBI_SRC / "musubi_tuner"
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
        cfg = config_of({"model": {"storage_dtype": None, "storage_modulation": False, "quantize": "none",
                                   "matmul": "auto", **over["model"]},
                         "train": {"rank": RANK, "alpha": None, "target_modules": None, "gradient_checkpointing": True,
                                   "blocks_to_swap": 0, **over["train"]}})
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
                     "matmul": w8a8.resolve(cfg.model) if setting.fp8 else None}

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
