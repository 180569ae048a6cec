"""The learning check's per-family settings (bench/learns.py): the tiny model's width and the training run each
model memorises its image or clip with; each choice's measured reason beside it."""
from __future__ import annotations

# The default targets (attention) suit a pretrained base; a random tiny one must learn to denoise the image
# from scratch, and a LoRA on attention alone cannot hold that: the MLPs too (the UNet: its convolutions).
_UNET = ["to_k", "to_q", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2", "proj_in", "proj_out", "time_emb_proj",
         "conv1", "conv2", "conv_in", "conv_out"]
# Per family: the tiny model's width (model.arch; wider than the default so that a rank-16 LoRA can hold the
# image), and the training settings. Chosen to reach the bound in about 3 min or less on 2 cores.
SETTINGS: dict[str, dict] = {
    # the pretrained demo base (data/demo_base), taught one shape it has never seen: the base a wrong timestep
    # or latent convention fights (tests/test_learns_mutations.py)
    "demo_flux": {"arch": {}, "rank": 16, "steps": 300, "lr": 1e-3},
    "tiny_flux": {"arch": {"num_attention_heads": 8}, "rank": 16, "steps": 300, "lr": 1e-3},
    "tiny_sd3": {"arch": {"num_layers": 2, "attention_head_dim": 16, "num_attention_heads": 8, "caption_projection_dim": 128}, "rank": 16,
                 "steps": 300, "lr": 3e-3, "targets": [f"{m}.{p}" for m, ps in (
                     ("attn", ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")),
                     ("ff", ("net.0.proj", "net.2")), ("ff_context", ("net.0.proj", "net.2"))) for p in ps]},
    "tiny_sdxl": {"arch": {}, "rank": 16, "steps": 300, "lr": 3e-3, "targets": _UNET},
    "tiny_sd15": {"arch": {}, "rank": 16, "steps": 300, "lr": 1e-3, "targets": _UNET},
    "tiny_zimage": {"arch": {"dim": 64, "n_heads": 4, "n_kv_heads": 4, "n_layers": 2}, "rank": 16, "steps": 300,
                    "lr": 3e-3},
    "tiny_qwenimage": {"arch": {"num_attention_heads": 4}, "rank": 16, "steps": 300, "lr": 3e-3,
                       "targets": ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj",
                                   "to_add_out", "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj",
                                   "txt_mlp.net.2"]},
    "tiny_flux2_klein": {"arch": {"num_attention_heads": 8, "num_layers": 2, "num_single_layers": 2}, "rank": 16,
                         "steps": 300, "lr": 1e-2},
    "tiny_flux2_dev": {"arch": {"num_attention_heads": 8, "num_layers": 2, "num_single_layers": 2}, "rank": 16,
                       "steps": 300, "lr": 1e-2},
}
# `<model>+<network>`: the same run with train.network (LoHa/LoKr: their LyCORIS file, put on the model as
# ComfyUI merges it, tasks/models/lora_variants/lycoris.py apply_lycoris). At the LoRA's lr 1e-3 neither reaches the bound
# in 300 steps (measured ratios 0.84 LoKr, 0.19 LoHa): peft starts one factor of each at zero and the other's
# products are small, so they take the larger lr LyCORIS' guides give (LoKr 1e-2: 0.073; LoHa 3e-3: 0.028).
# FLUX.1 Kontext: one (control, target) pair, the control the target's negative; rendered with the control
SETTINGS["tiny_flux_kontext"] = {**SETTINGS["tiny_flux"], "control": True}
SETTINGS["tiny_flux2_klein+ref"] = {**SETTINGS["tiny_flux2_klein"], "control": True}  # FLUX.2: one reference
# Qwen-Image-Edit: its pipeline encodes the control at ~1 MP (4096 tokens beside the target's 16), so one image a
# batch: measured 0.128 in 2.5 min (a batch of 4: 0.074 in 9 min on 2 cores)
SETTINGS["tiny_qwenimage_edit"] = {**SETTINGS["tiny_qwenimage"], "control": True, "batch": 1}
# `<model>+int8|nf4`: trained on a quantized base (model.quantize, QLoRA), the files rendered on the full base
# Wan 2.1: one 9-frame clip (the demo image sliding right), rendered by WanPipeline at 9 frames; every Linear of
# its blocks is a default target already
SETTINGS["tiny_wan"] = {"arch": {"num_attention_heads": 8, "attention_head_dim": 24, "ffn_dim": 256}, "rank": 16,
                        "steps": 600, "lr": 1e-2, "clip": True}
# Wan 2.2, one LoRA on both experts (model.expert=both): the same clip, the file loaded into both experts
SETTINGS["tiny_wan22+both"] = {**SETTINGS["tiny_wan"], "expert": "both", "steps": 900}
# HunyuanVideo 1.5: the same clip, its kohya file merged by ComfyUI's rule (diffusers reads none for it). The
# default tiny model (16 wide) reaches 0.199 / 0.193 after 600 / 1200 steps at lr 1e-2; twice as wide, 300 steps
# at 3e-3 (at 1e-2 it memorises so hard that a halved scale or a misnamed block still renders under the bound)
SETTINGS["tiny_hunyuan_video15"] = {"arch": {"num_attention_heads": 4, "attention_head_dim": 16,
                                             "rope_axes_dim": [4, 4, 8]}, "rank": 16, "steps": 300, "lr": 3e-3,
                                    "clip": True}
# LTX-2's video stream: the same clip (9 frames = 1 + 8k, 2 latent frames of 2x2 at 64 px), ltx-trainer's targets
SETTINGS["tiny_ltx2"] = {"arch": {}, "rank": 16, "steps": 1200, "lr": 1e-2, "clip": True}
# Image-to-video (issue 47): the same clip, trained from its first frame (decoded from the mp4, as loraflow reads
# it) and rendered by WanImageToVideoPipeline from that frame (--i in the prompts file)
SETTINGS["tiny_wan_i2v"] = {**SETTINGS["tiny_wan"], "i2v": True}
SETTINGS["tiny_wan22_i2v+both"] = {**SETTINGS["tiny_wan22+both"], "i2v": True}
# Wan 2.2 TI2V-5B: its /16 VAE has 48 channels, so at 64 px a frame is 2x2 tokens of 192 values each, and a tiny
# random base must learn to denoise all of them through the LoRA. Measured ratios (2026-11-27, 2 cores): 0.74 at Wan
# 2.1's settings (192 wide, 600 steps), 0.50 at 384 wide, 0.33 at 768 wide (1200 steps, lr 3e-3), 0.13 with 4
# blocks of 768: the tiny model's capacity (the real 5B is 3072 wide, 30 blocks), not the conditioning
SETTINGS["tiny_wan22_ti2v"] = {"arch": {"num_attention_heads": 32, "attention_head_dim": 24, "ffn_dim": 1024,
                                        "num_layers": 4}, "rank": 16, "steps": 1200, "lr": 3e-3, "clip": True,
                               "i2v": True}
# HunyuanVideo 1.5 I2V: the same clip from its first frame, rendered by HunyuanVideo15ImageToVideoPipeline (sized by
# its own rule: the target_size bucket nearest the image's aspect, SIZE for the square first frame)
SETTINGS["tiny_hunyuan_video15_i2v"] = {**SETTINGS["tiny_hunyuan_video15"], "i2v": True}
SETTINGS["tiny_flux+int8"] = {**SETTINGS["tiny_flux"], "quantize": "int8"}
SETTINGS["tiny_flux+nf4"] = {**SETTINGS["tiny_flux"], "quantize": "nf4"}
SETTINGS["tiny_qwenimage+nf4"] = {**SETTINGS["tiny_qwenimage"], "quantize": "nf4"}
SETTINGS["tiny_sd15+int8"] = {**SETTINGS["tiny_sd15"], "quantize": "int8"}  # its attention Linears (convs stay)
# model.matmul=w8a8 (tasks/training/w8a8.py): the activations quantized per token as well (issue 45)
SETTINGS["tiny_flux+int8+w8a8"] = {**SETTINGS["tiny_flux"], "quantize": "int8", "matmul": "w8a8"}
SETTINGS["tiny_flux+fp8+w8a8"] = {**SETTINGS["tiny_flux"], "quantize": "fp8", "matmul": "w8a8"}
SETTINGS["tiny_flux+lokr"] = {**SETTINGS["tiny_flux"], "network": "lokr", "lr": 1e-2}
SETTINGS["tiny_flux+loha"] = {**SETTINGS["tiny_flux"], "network": "loha", "lr": 3e-3}
