"""`model.expert=both`: Wan 2.2's two experts trained as one LoRA, as musubi-tuner does with `--dit_high_noise`
(wan_train_network.py: one network on the DiT, the high-noise weights swapped in for a timestep at or above the
boundary, the low-noise ones below it).

Here both experts are resident (musubi-tuner swaps one expert's weights into the other's module; its
`--offload_inactive_dit` parks the idle one on the host; `train.blocks_to_swap` is ours, counted over both).
peft gives each expert its layers, then the low expert's LoRA parameters are replaced by the high expert's
own Parameter objects: one set of weights, one optimizer state, gradients from both experts adding up. Each
item's timestep picks its expert; a batch whose items fall on both sides runs each expert on its own items
(musubi-tuner redraws the batch onto the first item's side instead, as only one expert is resident there), so
an item's draw never depends on the others and data-parallel processes draw what one process draws.

DoRA is refused with it (validate): its magnitude starts as the base weight's norm, which differs per expert."""
from __future__ import annotations

import copy

import torch
from diffusers import WanTransformer3DModel


class TwoExperts(torch.nn.Module):
    """The high-noise (`transformer`) and low-noise (`transformer_2`) experts behind one denoiser call."""

    # the fp8/quantized base reads these from the denoiser's class (tasks/training/memory.py)
    _keep_in_fp32_modules = WanTransformer3DModel._keep_in_fp32_modules
    _skip_layerwise_casting_patterns = WanTransformer3DModel._skip_layerwise_casting_patterns

    def __init__(self, high: torch.nn.Module, low: torch.nn.Module, boundary: float):
        super().__init__()
        self.high, self.low, self.boundary = high, low, float(boundary)

    # what the loop and the adapters read from a denoiser
    @property
    def config(self):
        return self.low.config

    @property
    def dtype(self) -> torch.dtype:
        return self.low.dtype

    @property
    def device(self) -> torch.device:
        return self.low.device

    @property
    def blocks(self) -> list[torch.nn.Module]:
        """train.blocks_to_swap takes the last N of these: the low expert's blocks, then the high expert's."""
        return [*self.high.blocks, *self.low.blocks]

    def add_adapter(self, config) -> None:
        self.high.add_adapter(config)
        self.low.add_adapter(copy.deepcopy(config))
        tie_adapters(self.high, self.low)

    def enable_gradient_checkpointing(self, gradient_checkpointing_func=None) -> None:
        self.high.enable_gradient_checkpointing(gradient_checkpointing_func)
        self.low.enable_gradient_checkpointing(gradient_checkpointing_func)

    def forward(self, hidden_states, timestep, return_dict: bool = False, **kwargs):
        """The experts' prediction per item (a tuple, as the adapters call the denoiser with return_dict=False)."""
        high = timestep >= self.boundary
        if bool(high.all()) or not bool(high.any()):
            expert = self.high if bool(high.all()) else self.low
            return expert(hidden_states=hidden_states, timestep=timestep, return_dict=False, **kwargs)
        n = hidden_states.shape[0]
        parts, order = [], []
        for expert, rows in ((self.high, high.nonzero().flatten()), (self.low, (~high).nonzero().flatten())):
            mine = {k: v[rows] if torch.is_tensor(v) and v.ndim and v.shape[0] == n else v for k, v in kwargs.items()}
            parts.append(expert(hidden_states=hidden_states[rows], timestep=timestep[rows], return_dict=False,
                                **mine)[0])
            order.append(rows)
        return (torch.cat(parts)[torch.argsort(torch.cat(order))],)


def tie_adapters(source: torch.nn.Module, target: torch.nn.Module) -> int:
    """Makes each trainable (adapter) parameter of `target` the same Parameter object as `source`'s of the same
    name; returns how many. The two models must have the same adapter layers (the same architecture, config)."""
    theirs = dict(source.named_parameters())
    tied = 0
    for name, p in list(target.named_parameters()):
        if not p.requires_grad:
            continue
        mine = theirs.get(name)
        if mine is None or mine.shape != p.shape:
            raise ValueError(f"the two experts' adapter layers differ at {name}")
        parent, leaf = name.rsplit(".", 1)
        target.get_submodule(parent)._parameters[leaf] = mine
        tied += 1
    return tied
