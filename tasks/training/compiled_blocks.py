"""`train.compile=true`: regional `torch.compile` of the denoiser's repeated blocks (issue 45), and what the report
says about the kernels a run used (`runtime.compile`, `runtime.attention`, `runtime.matmul`).

Regional, not the whole model: each transformer block class compiles once and is reused for every block of it,
so compile time is that of one or two blocks, not of 57 (the PyTorch regional-compilation recipe; musubi-tuner
compiles per block too). diffusers' `compile_repeated_blocks` does it where the model declares `_repeated_blocks`
(Flux, FLUX.2, Qwen-Image, Z-Image, Wan, LTX-2, HunyuanVideo 1.5, the UNets' BasicTransformerBlock); elsewhere
(SD3) the blocks of the family's own `swap_blocks` lists are compiled the same way, by hand. It is applied after
peft, the stored base's hooks, block swap and gradient checkpointing are in place, so the compiled graph is the
one training runs (the LoRA layers and the fp8/quantized upcast inside each block; checkpointing calls the
compiled block). Compiled kernels fuse and reorder arithmetic: the LoRA differs from eager's by rounding
(tests/test_compiled_blocks.py bounds it), so the setting is in the LoRA's key."""
from __future__ import annotations

import shutil

from tasks.config_schema import TrainConfig
from tasks.lazy import lazy

torch = lazy("torch")


def compile_errors(tc: TrainConfig, cuda: bool) -> list[str]:
    """validate's check: what torch.compile needs on this machine (inductor's C++ compiler on the CPU, Triton on
    CUDA), refused in one line before anything runs."""
    if not tc.compile:
        return []
    if cuda:
        import importlib.util

        if importlib.util.find_spec("triton") is None:
            return ["train.compile=true needs Triton on CUDA (pip install triton, as torch's CUDA wheels bring it); "
                    "or drop train.compile"]
        return []
    if not (shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")):
        return ["train.compile=true on the CPU needs a C++ compiler (g++ or clang++) for torch's inductor; install "
                "one or drop train.compile"]
    return []


def compile_blocks(denoiser, swap_lists: tuple[str, ...]) -> int:
    """Compiles each repeated block of the denoiser (of each expert, for Wan 2.2's two); returns how many blocks."""
    from diffusers import ModelMixin

    models = [denoiser] if isinstance(denoiser, ModelMixin) else [m for m in denoiser.children()
                                                                  if isinstance(m, ModelMixin)]
    n = 0
    for model in models:
        names = getattr(model, "_repeated_blocks", None)
        if names:
            model.compile_repeated_blocks()
            n += sum(type(m).__name__ in names for m in model.modules())
            continue
        for block in (b for name in swap_lists for b in getattr(model, name, ())):
            block.compile()
            n += 1
    return n


def attention_backend() -> str:
    """The scaled-dot-product attention kernels this run allows, in torch's order of preference."""
    if not torch.cuda.is_available():
        return "cpu: torch's flash-attention CPU kernel where it applies, else math"
    allowed = [name for name, on in (("flash", torch.backends.cuda.flash_sdp_enabled()),
                                     ("memory-efficient", torch.backends.cuda.mem_efficient_sdp_enabled()),
                                     ("cudnn", torch.backends.cuda.cudnn_sdp_enabled()),
                                     ("math", torch.backends.cuda.math_sdp_enabled())) if on]
    return " > ".join(allowed) + ("" if "cudnn" in allowed else " (cuDNN off: its backward crashed on FLUX.1-dev)")


def matmul_path(stored: str | None, compute_dtype: str, mode: str = "dequantize") -> str:
    """How the frozen base's Linears multiply: the kernel path of a stored base (model.matmul resolved: w8a8, the
    stored type's own matmul with activations quantized per token; bnb, an NF4 base through bitsandbytes'
    matmul_4bit; or the fallback, the weight upcast or dequantized to the compute dtype inside fp8_base's autograd
    Function, then a plain matmul)."""
    if not stored:
        return f"{compute_dtype} matmul"
    if mode == "bnb":
        return (f"nf4: bnb-nf4, bitsandbytes' NF4 through bnb.matmul_4bit in {compute_dtype}; input gradient "
                "through its dequantize_4bit")
    if mode == "w8a8" and stored == "int8":
        return ("int8: w8a8, per-token int8 activations x int8 weight (torch._int_mm, the weight column-major, on "
                "CUDA; torchao's exact safe_int_mm on the CPU), forward and input gradient")
    if mode == "w8a8":
        return (f"{stored}: w8a8, per-token float8_e4m3fn activations x fp8 weight (torch._scaled_mm); input "
                "gradient per token in float8_e5m2")
    if stored in ("int8", "nf4"):
        return f"{stored}: torchao dequantize to {compute_dtype}, then {compute_dtype} matmul (fallback)"
    return f"{stored}: cast to {compute_dtype}, then {compute_dtype} matmul (fallback)"
