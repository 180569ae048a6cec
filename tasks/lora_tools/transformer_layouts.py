"""diffusers transformer state dict -> the family's released single-file layout, for `merge --into-base --layout
original` (ldm.py does SD1.5 / SDXL's UNet):

- qwenimage: the same keys. Qwen-Image's single files (ComfyUI's diffusion_models/) use diffusers' names, and
  diffusers' `QwenImageTransformer2DModel.from_single_file` maps them unchanged (single_file_model.py).
- zimage: ComfyUI's / Tongyi's names, the reverse of diffusers' `convert_z_image_transformer_checkpoint_to_diffusers`
  (single_file_utils.py): each block's to_q / to_k / to_v stacked into one `attention.qkv.weight`, `to_out.0` as
  `attention.out`, `norm_q` / `norm_k` as `q_norm` / `k_norm`, `all_x_embedder.2-1` / `all_final_layer.2-1` as
  `x_embedder` / `final_layer`. Every tensor maps to exactly one key.
- sd3: SAI's MMDiT names (`joint_blocks.N.x_block.attn.qkv`, `context_block`, `final_layer`, ...), the reverse of
  diffusers' `convert_sd3_transformer_checkpoint_to_diffusers`: q/k/v (and the context's, and SD3.5's attn2)
  stacked into qkv, the last block's context modulation and the final modulation with shift and scale swapped
  back (diffusers' swap_scale_shift is its own inverse). Every tensor maps to exactly one key, or it raises.

- flux2_klein / flux2_dev: BFL's FLUX.2 names (`double_blocks.N.img_attn.qkv`, `single_blocks.N.linear1`, norms'
  `.scale`, ...), the reverse of diffusers' `convert_flux2_transformer_checkpoint_to_diffusers`.

- flux / flux_kontext: BFL's FLUX.1 names (`double_blocks.N.img_attn.qkv`, `img_mod.lin`, `single_blocks.N.linear1`
  = q|k|v|mlp, `modulation.lin`, `final_layer`, `time_in` / `vector_in` / `guidance_in`, norms' `.scale`), the
  reverse of diffusers' `convert_flux_transformer_checkpoint_to_diffusers` (which assumes FLUX.1's 3072 width:
  the test reads back a 3072-wide model of one block of each kind).
Tests: tests/test_lora_tools.py reads each file back with diffusers' own from_single_file."""
from __future__ import annotations

import re

from tasks.lazy import lazy

torch = lazy("torch")

_ZIMAGE_RENAMES = ((".attention.to_out.0.", ".attention.out."), (".attention.norm_q.", ".attention.q_norm."),
                   (".attention.norm_k.", ".attention.k_norm."), ("all_x_embedder.2-1.", "x_embedder."),
                   ("all_final_layer.2-1.", "final_layer."))
_QKV = re.compile(r"(.+\.attention)\.to_([qkv])\.weight")


def to_original(family: str, sd: dict) -> dict:
    """The denoiser's state dict in the layout its family declares (`original_layout` on its adapter)."""
    from tasks.models import adapter_class

    layout = adapter_class(family).original_layout
    if layout == "diffusers":
        return dict(sd)
    if layout == "sd3":
        return _sd3(sd)
    if layout == "flux2":
        return _flux2(sd)
    if layout == "flux":
        return _flux(sd)
    if layout != "zimage":
        raise ValueError(f"{family} has no original single-file layout written here")
    out, qkv = {}, {}
    for key, tensor in sd.items():
        if m := _QKV.fullmatch(key):
            qkv.setdefault(m.group(1), {})[m.group(2)] = tensor
            continue
        for old, new in _ZIMAGE_RENAMES:
            key = key.replace(old, new)
        out[key] = tensor
    for block, parts in qkv.items():
        if set(parts) != {"q", "k", "v"}:
            raise ValueError(f"{block}: to_q, to_k and to_v are fused in the original layout; found {sorted(parts)}")
        out[f"{block}.qkv.weight"] = torch.cat([parts["q"], parts["k"], parts["v"]], dim=0)
    return out


class _Moves:
    """Tensors moved from a diffusers state dict to original keys; `left()` names what did not move."""

    def __init__(self, sd: dict):
        self.src, self.out = dict(sd), {}

    def mv(self, a: str, b: str, f=None):
        for end in ("weight", "bias"):
            if f"{a}.{end}" in self.src:
                t = self.src.pop(f"{a}.{end}")
                self.out[f"{b}.{end}"] = f(t) if f else t

    def fuse(self, parts: list[str], b: str):  # q, k, v stacked into one qkv
        for end in ("weight", "bias"):
            if f"{parts[0]}.{end}" in self.src:
                self.out[f"{b}.{end}"] = torch.cat([self.src.pop(f"{p}.{end}") for p in parts], dim=0)

    def norm(self, a: str, b: str):  # RMSNorm weights are `.scale` in BFL's files
        if f"{a}.weight" in self.src:
            self.out[f"{b}.scale"] = self.src.pop(f"{a}.weight")

    def done(self, what: str) -> dict:
        if self.src:
            raise ValueError(f"{len(self.src)} {what} weight(s) have no original name, e.g. {sorted(self.src)[:3]}")
        return self.out


def _swap(t):  # diffusers' swap_scale_shift: the halves exchanged (its own inverse)
    shift, scale = t.chunk(2, dim=0)
    return torch.cat([scale, shift], dim=0)


def _sd3(sd: dict) -> dict:
    m = _Moves(sd)
    m.out["pos_embed"] = m.src.pop("pos_embed.pos_embed")
    for a, b in (("pos_embed.proj", "x_embedder.proj"), ("context_embedder", "context_embedder"),
                 ("time_text_embed.timestep_embedder.linear_1", "t_embedder.mlp.0"),
                 ("time_text_embed.timestep_embedder.linear_2", "t_embedder.mlp.2"),
                 ("time_text_embed.text_embedder.linear_1", "y_embedder.mlp.0"),
                 ("time_text_embed.text_embedder.linear_2", "y_embedder.mlp.2"), ("proj_out", "final_layer.linear")):
        m.mv(a, b)
    m.mv("norm_out.linear", "final_layer.adaLN_modulation.1", _swap)
    n = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("transformer_blocks."))
    for i in range(n):
        d, x, c = f"transformer_blocks.{i}.", f"joint_blocks.{i}.x_block.", f"joint_blocks.{i}.context_block."
        m.fuse([f"{d}attn.to_{s}" for s in "qkv"], f"{x}attn.qkv")
        m.fuse([f"{d}attn.add_{s}_proj" for s in "qkv"], f"{c}attn.qkv")
        m.fuse([f"{d}attn2.to_{s}" for s in "qkv"], f"{x}attn2.qkv")
        for a, b in (("attn.to_out.0", f"{x}attn.proj"), ("attn.to_add_out", f"{c}attn.proj"),
                     ("attn2.to_out.0", f"{x}attn2.proj"), ("norm1.linear", f"{x}adaLN_modulation.1"),
                     ("ff.net.0.proj", f"{x}mlp.fc1"), ("ff.net.2", f"{x}mlp.fc2"),
                     ("ff_context.net.0.proj", f"{c}mlp.fc1"), ("ff_context.net.2", f"{c}mlp.fc2"),
                     ("attn.norm_q", f"{x}attn.ln_q"), ("attn.norm_k", f"{x}attn.ln_k"),
                     ("attn.norm_added_q", f"{c}attn.ln_q"), ("attn.norm_added_k", f"{c}attn.ln_k"),
                     ("attn2.norm_q", f"{x}attn2.ln_q"), ("attn2.norm_k", f"{x}attn2.ln_k")):
            m.mv(d + a, b)
        m.mv(f"{d}norm1_context.linear", f"{c}adaLN_modulation.1", _swap if i == n - 1 else None)
    return m.done("SD3")

_FLUX2_TOP = (("x_embedder", "img_in"), ("context_embedder", "txt_in"),
              ("time_guidance_embed.timestep_embedder.linear_1", "time_in.in_layer"),
              ("time_guidance_embed.timestep_embedder.linear_2", "time_in.out_layer"),
              ("time_guidance_embed.guidance_embedder.linear_1", "guidance_in.in_layer"),
              ("time_guidance_embed.guidance_embedder.linear_2", "guidance_in.out_layer"),
              ("double_stream_modulation_img.linear", "double_stream_modulation_img.lin"),
              ("double_stream_modulation_txt.linear", "double_stream_modulation_txt.lin"),
              ("single_stream_modulation.linear", "single_stream_modulation.lin"), ("proj_out", "final_layer.linear"))
_FLUX2_DOUBLE = (("attn.to_out.0", "img_attn.proj"), ("ff.linear_in", "img_mlp.0"), ("ff.linear_out", "img_mlp.2"),
                 ("attn.to_add_out", "txt_attn.proj"), ("ff_context.linear_in", "txt_mlp.0"),
                 ("ff_context.linear_out", "txt_mlp.2"))
_FLUX2_DOUBLE_NORMS = (("attn.norm_q", "img_attn.norm.query_norm"), ("attn.norm_k", "img_attn.norm.key_norm"),
                       ("attn.norm_added_q", "txt_attn.norm.query_norm"), ("attn.norm_added_k", "txt_attn.norm.key_norm"))
_FLUX2_SINGLE = (("attn.to_qkv_mlp_proj", "linear1"), ("attn.to_out", "linear2"))
_FLUX2_SINGLE_NORMS = (("attn.norm_q", "norm.query_norm"), ("attn.norm_k", "norm.key_norm"))


def _bfl(sd: dict, top, double, single, what: str) -> dict:
    """BFL's layout (FLUX.1 and FLUX.2 share its frame): the top-level names, each double block (q/k/v of both
    streams fused, `double` renamed, the norms), each single block (`single(m, d, o)` moves its Linears)."""
    m = _Moves(sd)
    for a, b in top:
        m.mv(a, b)
    m.mv("norm_out.linear", "final_layer.adaLN_modulation.1", _swap)
    for i in sorted({int(k.split(".")[1]) for k in sd if k.startswith("transformer_blocks.")}):
        d, o = f"transformer_blocks.{i}.", f"double_blocks.{i}."
        m.fuse([f"{d}attn.to_{s}" for s in "qkv"], f"{o}img_attn.qkv")
        m.fuse([f"{d}attn.add_{s}_proj" for s in "qkv"], f"{o}txt_attn.qkv")
        for a, b in double:
            m.mv(d + a, o + b)
        for a, b in _FLUX2_DOUBLE_NORMS:
            m.norm(d + a, o + b)
    for i in sorted({int(k.split(".")[1]) for k in sd if k.startswith("single_transformer_blocks.")}):
        d, o = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
        single(m, d, o)
        for a, b in _FLUX2_SINGLE_NORMS:
            m.norm(d + a, o + b)
    return m.done(what)


def _flux2(sd: dict) -> dict:
    def single(m, d, o):
        for a, b in _FLUX2_SINGLE:
            m.mv(d + a, o + b)
    return _bfl(sd, _FLUX2_TOP, _FLUX2_DOUBLE, single, "FLUX.2")

_FLUX_TOP = (("x_embedder", "img_in"), ("context_embedder", "txt_in"), ("proj_out", "final_layer.linear"),
             ("time_text_embed.timestep_embedder.linear_1", "time_in.in_layer"),
             ("time_text_embed.timestep_embedder.linear_2", "time_in.out_layer"),
             ("time_text_embed.text_embedder.linear_1", "vector_in.in_layer"),
             ("time_text_embed.text_embedder.linear_2", "vector_in.out_layer"),
             ("time_text_embed.guidance_embedder.linear_1", "guidance_in.in_layer"),
             ("time_text_embed.guidance_embedder.linear_2", "guidance_in.out_layer"))
_FLUX_DOUBLE = (("norm1.linear", "img_mod.lin"), ("norm1_context.linear", "txt_mod.lin"),
                ("attn.to_out.0", "img_attn.proj"), ("attn.to_add_out", "txt_attn.proj"), ("ff.net.0.proj", "img_mlp.0"),
                ("ff.net.2", "img_mlp.2"), ("ff_context.net.0.proj", "txt_mlp.0"), ("ff_context.net.2", "txt_mlp.2"))


def _flux(sd: dict) -> dict:
    def single(m, d, o):  # linear1 = q | k | v | mlp
        m.fuse([f"{d}attn.to_q", f"{d}attn.to_k", f"{d}attn.to_v", f"{d}proj_mlp"], f"{o}linear1")
        m.mv(f"{d}proj_out", f"{o}linear2")
        m.mv(f"{d}norm.linear", f"{o}modulation.lin")
    return _bfl(sd, _FLUX_TOP, _FLUX_DOUBLE, single, "Flux")
