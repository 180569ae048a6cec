"""train.gradient_checkpointing_offload: gradient checkpointing whose saved block inputs wait in host memory, as
musubi-tuner's `--gradient_checkpointing_cpu_offload` and OneTrainer's CPU_OFFLOADED checkpointing keep them.

With checkpointing a block keeps only its inputs for backward (its internals are recomputed there); at Wan 2.1
14B's 81 frames those inputs are 40 x 0.32 GiB, most of the run's activations (docs/memory.md). PyTorch's own
pieces do it: torch.utils.checkpoint (non-reentrant, as diffusers' default) saves the block's inputs through
the saved-tensor hooks of the caller (its `_NoopSaveInputs`), and its own hooks take every save inside the
block; so a `torch.autograd.graph.save_on_cpu` context around the checkpoint call sends exactly those inputs to
host memory (pinned with CUDA) and brings them back when the block is recomputed. The graph is plain
checkpointing's, so the gradients are its bytes on any device (tests/test_activation_offload.py). The copy to
the host blocks the stream (save_on_cpu's), once per block and step; the copy back does not.

diffusers calls it for every block of the denoiser (`enable_gradient_checkpointing(offloaded_checkpoint)`),
whatever the family."""
from __future__ import annotations

import torch
from torch.autograd.graph import save_on_cpu
from torch.utils.checkpoint import checkpoint


def offloaded_checkpoint(module, *args):
    """diffusers' gradient_checkpointing_func: module(*args) checkpointed, its saved inputs on the host."""
    with save_on_cpu(pin_memory=torch.cuda.is_available()):
        return checkpoint(module.__call__, *args, use_reentrant=False)
