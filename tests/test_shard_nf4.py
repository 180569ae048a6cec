"""An NF4 base sharded by FSDP2 (tasks/training/sharding.py) in two gloo processes: the tiny families' Linears are
too small for NF4's blocks to divide by two (they stay whole: tests/test_shard.py), so this builds blocks of 256
wide Linears, as the real models' are, and one 256 x 8 Linear whose single scaler block cannot split.

Each process runs the same input on the same weights (gathered from the shards: the same NF4 bytes) and the LoRA
gradient is summed over the two processes (a reduce-scatter of a + b against an all-reduce of a + b: the same sum).
What may round differently: the gathered NF4 weight is a new tensor, and the bf16 matmul of a later block's backward
(through its dequantized weight, into an earlier block) may take another kernel path for it (measured here: the
last block's and the output layer's gradients are bit-equal, the first block's differ by ~1 bf16 ulp). So the bound
is bf16 rounding of a WIDTH-term sum over the two blocks the gradient passes back through (tests/tolerance.py)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tolerance import rounding

WIDTH = 256


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU(),
                                                              torch.nn.Linear(WIDTH, WIDTH)) for _ in range(2))
        self.out = torch.nn.Linear(WIDTH, 8)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.out(x)


def _lora_grads(net, x) -> dict:
    net(x).float().square().mean().backward()
    out = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone()
           for n, p in net.named_parameters() if p.requires_grad}
    net.zero_grad(set_to_none=True)
    return out


def _rank(rank: int, world: int, init: str, result: str) -> None:
    from peft import LoraConfig, inject_adapter_in_model

    from tasks.training.quantized_base import quantize_base
    from tasks.training.sharding import shard_denoiser
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.manual_seed(0)
    net = Net().to(torch.bfloat16).requires_grad_(False)
    inject_adapter_in_model(LoraConfig(r=4, target_modules=r"blocks\.\d\.[02]|out", init_lora_weights="gaussian"), net)
    for p in net.parameters():
        if p.requires_grad:
            p.data = p.data.float()
            torch.nn.init.normal_(p, std=0.02)  # lora_B too: every LoRA weight gets a gradient
    quantize_base(net, "nf4", torch.bfloat16, ())
    x = torch.randn(3, WIDTH, generator=torch.Generator().manual_seed(rank), dtype=torch.bfloat16)
    ref = _lora_grads(net, x)
    for g in ref.values():  # the data-parallel path: the two processes' gradients summed
        dist.all_reduce(g)
    info = shard_denoiser(net, SimpleNamespace(swap_blocks=("blocks",)), init_device_mesh("cpu", (world,)),
                          torch.device("cpu"))
    sharded = {n: type(p).__name__ for n, p in net.named_parameters()}
    got = _lora_grads(net, x)
    diffs = {n: [(got[n] - ref[n]).abs().max().item(), ref[n].abs().max().item()] for n in ref}
    if rank == 0:
        Path(result).write_text(json.dumps({"diffs": diffs, "info": info, "kinds": sharded, "names": sorted(ref)}))
    dist.destroy_process_group()


def test_an_nf4_base_shards_and_its_lora_gradient_is_the_data_parallel_one(tmp_path):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    result = tmp_path / "result.json"
    mp.spawn(_rank, args=(2, f"file://{tmp_path / 'rendezvous'}", str(result)), nprocs=2, join=True)
    out = json.loads(result.read_text())
    for name, (diff, magnitude) in out["diffs"].items():
        bound = rounding(WIDTH, stages=2, dtype=torch.bfloat16, magnitude=magnitude)
        assert diff <= bound, f"{name}: the sharded gradient differs from the data-parallel one by {diff:.3e} > {bound:.3e}"
    # the blocks' NF4 weights are sharded (DTensors); the 256 x 8 output layer's single scaler block cannot split
    assert out["info"]["kept_whole"] == 1 and out["info"]["units"] == 3
    assert out["kinds"]["blocks.0.0.base_layer.weight"] == "DTensor"
    assert out["kinds"]["out.base_layer.weight"] != "DTensor"
    assert len(out["diffs"]) == 5 * 2  # A and B of five LoRA'd Linears
