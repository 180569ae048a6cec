"""What broke on the first CUDA runs (issue 34, bench/RESULTS.md), tested where the cause can be seen on the CPU.

1. Cached text reaches the sampler on the pipeline's device: on CUDA the Flux, SD3, FLUX.2, Z-Image and
   Qwen-Image pipelines use given prompt embeddings where they are, and the store holds them on the CPU.
   The meta device stands in for CUDA: moving to it is a real device change, with no GPU.
2. Training turns cuDNN's fused attention off (its backward crashed on an H200); the flag is torch's own and
   can be read on any machine."""
import torch

from bench.gpu import TINY, build
from tasks.models.bases.adapter import on_pipeline_device


class _Pipe:  # diffusers pipelines report where they compute as `_execution_device`
    _execution_device = torch.device("meta")


def test_cached_text_moves_to_the_pipelines_device():
    text = {"prompt_embeds": torch.ones(3, 4), "pooled_prompt_embeds": torch.zeros(4)}
    moved = on_pipeline_device(_Pipe(), text)
    assert set(moved) == set(text)
    assert all(t.device.type == "meta" for t in moved.values())
    assert all(moved[k].shape == text[k].shape and moved[k].dtype == text[k].dtype for k in text)
    assert all(t.device.type == "cpu" for t in text.values())  # the cached dict itself is left as it was


def test_no_negative_prompt_stays_none():
    assert on_pipeline_device(_Pipe(), None) is None


def test_training_keeps_cudnn_attention_off():
    torch.backends.cuda.enable_cudnn_sdp(True)  # torch's default, whatever ran before
    try:
        build(TINY, torch.device("cpu"), fp8=False, ckpt=True, rank=2)  # the train node's prepare_denoiser
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)
