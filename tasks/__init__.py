"""The pure core of loraflow: plain functions, no Prefect (flows/ wraps them in tasks and a flow).

The top level is the DAG: one module per node (validate, cache_latents, cache_text, train, sample, publish)
and its glue (config: the Hydra schema; items: per-item status and background writes; report: what changed;
runtime: device and library versions in keys; lazy: heavy libraries imported on first use). Everything else
lives in a sub-package by concern, each saying what it may import (checked by tests/test_imports.py):

- store/     content-addressed entries, keys and their bookkeeping; imports nothing else of the project
- data/      what goes in: images, captions, datasets, prompts, caption augmentation
- models/    one adapter per family, the tiny builders, LoRA on the text encoders
- training/  the train node's parts: set-up, keys, checkpoints, processes, memory, export
"""
import logging as _logging


class _KnownImportNoise(_logging.Filter):
    """Drops the log lines torchao 0.18 causes at import in every process that imports diffusers (which imports
    torchao when it is installed), none of which touches what loraflow uses of it (its int8 and NF4 tensors):
    its CUDA-only extensions failing to load beside the CPU build of torch, torch 2.13 deprecating how it
    registers two Enums, and diffusers 0.42 looking for tensor classes torchao has moved. peft imports bitsandbytes
    (model.matmul=bnb) when it is installed, and bitsandbytes 0.50 on an AVX512-BF16 CPU fails to load its optional
    CPU inference kernel from a hub (the `kernels` package, not installed): loraflow's 4-bit matmul never uses it.
    Without triton (a CPU machine) torchao warns that its triton int8 matmul is missing: on the CPU its safe_int_mm
    (model.matmul=int8) does not use that kernel."""

    NEEDLES = ("Failed to load", "is an Enum subclass and is now natively supported",
               "Unable to import `torchao` Tensor objects", "Detected no triton, on systems without Triton")

    def filter(self, record: _logging.LogRecord) -> bool:
        return not any(n in record.getMessage() for n in self.NEEDLES)


for _name in ("torchao", "torchao.kernel.intmm", "torch.utils._pytree", "diffusers.quantizers.torchao.torchao_quantizer",
              "bitsandbytes.backends.cpu.ops"):
    _logging.getLogger(_name).addFilter(_KnownImportNoise())
