"""cache_text and sample at the card's size (issue 61): text encoders streamed and stored as text.quantize says,
offloaded with text.offload; the sample node's denoiser stored as the run's model.quantize, the LoRA applied as
training applies it."""
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers

from tasks import cache_text
from tasks.config import ConfigError, compose, resolve_paths, stored_as
from tasks.config_checks import config_errors
from tasks.models import make_adapter, resolve_model
from tasks.models.loading.text_load import TextLoading, load_text_model
from tasks.store import Store
from tasks.training.quantized_base import is_quantized, text_loading

sys.path.insert(0, str(Path(__file__).parent))
from support import run_nodes  # noqa: E402

DEMO = Path(__file__).resolve().parents[1] / "data" / "demo"
# (family, folder): Mistral 3 and Gemma 3 checkpoints need transformers' renames, T5 / umT5 tie their embeddings and
# keep `wo` in fp32 at fp16, Qwen2.5-VL has a vision tower, CLIP-G a projection
ENCODERS = [("flux", "text_encoder"), ("flux", "text_encoder_2"), ("flux2_dev", "text_encoder"),
            ("qwenimage", "text_encoder"), ("ltx2", "text_encoder"), ("wan", "text_encoder"), ("sdxl", "text_encoder_2")]


def _cfg(tmp_path, *extra):
    return resolve_paths(compose("train", [f"data.dir={DEMO}", f"store.root={tmp_path / 'store'}", "data.resolution=32",
                                           "train.max_steps=2", "train.batch_size=2", "train.log_with=none",
                                           "sample.every_n_steps=0", "sample.steps=2", *extra])[0])


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    store, memo = Store(tmp_path_factory.mktemp("text-load")), {}

    def get(family):
        if family not in memo:
            cfg = SimpleNamespace(family=family, path=None, seed=0, arch={}, config=None)
            memo[family] = resolve_model(cfg, store)
        return memo[family]
    return get


def _encoder(folders, family, sub):
    folder = folders(family) / sub
    return getattr(transformers, json.loads((folder / "config.json").read_text())["architectures"][0]), folder


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("family,sub", ENCODERS)
def test_streamed_encoder_is_from_pretrained_bit_for_bit(folders, family, sub, dtype):
    cls, folder = _encoder(folders, family, sub)
    reference = cls.from_pretrained(folder, dtype=dtype).state_dict()
    streamed = load_text_model(cls, folder, dtype).state_dict()
    assert streamed.keys() == reference.keys()
    for name, tensor in reference.items():  # exact: the same bytes cast the same way
        assert streamed[name].dtype == tensor.dtype and torch.equal(streamed[name], tensor), name


@pytest.mark.parametrize("kind", ["fp8", "int8", "nf4"])
@pytest.mark.parametrize("family,sub", [("flux", "text_encoder_2"), ("flux2_dev", "text_encoder"), ("qwenimage", "text_encoder")])
def test_stored_linears_compute_from_their_stored_weights(folders, family, sub, kind):
    cls, folder = _encoder(folders, family, sub)
    model = load_text_model(cls, folder, torch.bfloat16, text_loading(SimpleNamespace(quantize=kind, offload=False)))
    linears = {n: m for n, m in model.named_modules() if type(m) is torch.nn.Linear}
    stored = {n: m for n, m in linears.items() if m.weight.dtype == torch.float8_e4m3fn or is_quantized(m.weight)}
    assert len(stored) > len(linears) // 2, f"{len(stored)} of {len(linears)} Linears stored as {kind}"
    assert all(e.weight.dtype == torch.bfloat16 for e in model.modules() if isinstance(e, torch.nn.Embedding))
    if kind == "fp8":  # T5's `wo` (transformers' fp32 modules) stays in bf16: T5 casts its input to wo's dtype
        assert all(m.weight.dtype == torch.bfloat16 for n, m in linears.items() if n.endswith(".wo"))
    name, layer = next(iter(stored.items()))
    x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(0), dtype=torch.bfloat16)
    weight = layer.weight.to(torch.bfloat16) if kind == "fp8" else layer.weight.dequantize(torch.bfloat16) \
        if kind == "int8" else layer.weight.get_original_weight().to(torch.bfloat16)
    # exact: the hook's matmul is F.linear of the same dequantized weight, on the same kernel
    assert torch.equal(layer(x), torch.nn.functional.linear(x, weight, layer.bias)), name


@pytest.fixture
def copy_on_host(monkeypatch):
    """The block swap's copies run on the CPU too (there the weights are otherwise used where they are)."""
    from tasks.training.block_swap import BlockSwap

    monkeypatch.setattr(BlockSwap, "copy_on_host", True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["none", "fp8", "nf4"])
@pytest.mark.parametrize("family,sub", [("qwenimage", "text_encoder"), ("flux", "text_encoder_2")])
def test_offloaded_encoder_gives_the_same_embeddings(folders, family, sub, kind, dtype, copy_on_host):
    cls, folder = _encoder(folders, family, sub)
    ids = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    outs = []
    for offload in (False, True):
        model = load_text_model(cls, folder, dtype, text_loading(SimpleNamespace(quantize=kind, offload=offload)))
        if offload:  # every layer's Linear weights held by the swap on the host, the modules empty placeholders
            layers = [layer for m in model.modules() if isinstance(m, torch.nn.ModuleList) for layer in m]
            assert len(model.loraflow_block_swap.hosts) >= 2
            assert all(lin.weight.numel() == 0 for layer in layers for lin in layer.modules()
                       if isinstance(lin, torch.nn.Linear))
        with torch.no_grad():
            outs.append(model(input_ids=ids, output_hidden_states=True).hidden_states[-1])
    assert torch.equal(*outs)  # exact: the swap copies weights (copy_on_host), never changes a value


def test_a_checkpoint_of_another_encoder_is_refused_in_one_line(folders):
    cls, _ = _encoder(folders, "flux2_dev", "text_encoder")
    with pytest.raises(ConfigError, match=r"lacks .* weights of Mistral3ForConditionalGeneration"):
        load_text_model(cls, folders("qwenimage") / "text_encoder", torch.bfloat16)


def test_text_quantize_is_checked_and_keyed(tmp_path):
    assert any("text.quantize='int4'" in e for e in config_errors(_cfg(tmp_path, "text.quantize=int4")))
    assert any("text.quantize=nf4 with train.text_encoder_lr" in e for e in config_errors(
        _cfg(tmp_path, "model=tiny_sd15", "text.quantize=nf4", "train.text_encoder_lr=1e-4")))
    plain = _cfg(tmp_path)
    assert "text_quantize" not in cache_text.params(plain, SimpleNamespace(ids={"text": "x"}, family="flux"))
    keys = [cache_text.text_key(_cfg(tmp_path, f"text.quantize={q}"), SimpleNamespace(ids={"text": "x"}, family="flux"),
                                "a red circle") for q in ("none", "fp8", "int8", "nf4")]
    assert len(set(keys)) == 4


def test_quantized_embeddings_never_stand_in_for_bf16_ones(tmp_path):
    """A run with text.quantize=nf4, then the same run at none: every text is encoded again; nf4 again reuses its own.
    The samples of a quantized base are keyed apart from the bf16 base's, and offloading changes no byte."""
    base = ("model.dtype=bfloat16",)
    runs = {}
    for name, extra in (("nf4", ("text.quantize=nf4", "model.quantize=nf4")), ("none", ()),
                        ("nf4_again", ("text.quantize=nf4", "model.quantize=nf4", "sample.offload=true"))):
        cfg = _cfg(tmp_path, *base, *extra)
        runs[name] = run_nodes(cfg, Store(cfg.store.root))
    text = {n: r[2] for n, r in runs.items()}
    assert text["nf4"]["computed"] > 0 and text["none"]["computed"] == text["nf4"]["computed"]
    assert text["nf4_again"]["computed"] == 0 and text["nf4_again"]["reused"] == text["nf4"]["computed"]
    samples = {n: r[4] for n, r in runs.items()}
    assert not set(samples["nf4"]["samples"]) & set(samples["none"]["samples"])
    # sample.offload is not in the key (it changes no value): the offloaded run reuses the nf4 run's samples
    assert samples["nf4_again"]["computed"] == 0 and samples["nf4_again"]["samples"] == samples["nf4"]["samples"]


@pytest.mark.parametrize("quantize", ["fp8", "nf4"])
def test_sample_node_applies_the_lora_as_training_did(tmp_path, quantize):
    """The streamed, stored sampler renders the bytes of the whole-model path: from_pretrained in bf16, the LoRA
    file loaded, then the base stored by train_setup's own functions (the order prepare_denoiser uses)."""
    from tasks.training.memory import layerwise_skip_patterns
    from tasks.training.stored_sampler import load_stored_sampler, store_like_training

    cfg = _cfg(tmp_path, "model.dtype=bfloat16", f"model.quantize={quantize}", "train.max_steps=1")
    plan, _, txt, lora, _ = run_nodes(cfg, Store(cfg.store.root))
    store = Store(cfg.store.root)
    prompt = {k: v[None] for k, v in store.get_tensors(cache_text.KIND, next(v for k, v in txt["items"].items() if k.startswith("prompt:"))).items()}

    def render(pipe):
        return pipe(prompt_embeds=prompt["prompt_embeds"].to(torch.bfloat16),
                    pooled_prompt_embeds=prompt["pooled_prompt_embeds"].to(torch.bfloat16), width=32, height=32,
                    num_inference_steps=2, guidance_scale=1.0, generator=torch.Generator().manual_seed(0),
                    output_type="pt").images

    adapter = make_adapter(cfg.model, plan.model_dir)
    streamed = load_stored_sampler(adapter, cfg, Path(lora["lora"]))
    assert any(type(m.weight).__name__ == "NF4Tensor" or m.weight.dtype == torch.float8_e4m3fn
               for m in streamed.transformer.modules() if isinstance(m, torch.nn.Linear))
    whole = adapter.load_sampler(Path(lora["lora"]))
    whole.transformer.requires_grad_(False)
    store_like_training(whole.transformer, stored_as(cfg.model), torch.bfloat16,
                        layerwise_skip_patterns(adapter.denoiser_cls), "dequantize")
    assert torch.equal(render(streamed), render(whole))  # exact: the same stored weights, LoRA and kernels


def test_offloaded_sampler_renders_the_same_bytes(tmp_path, copy_on_host):
    """sample.offload: every block's stored weights on the host, copied in per use (the copies run on the CPU too
    here), the rest placed; the same images as the placed sampler."""
    from tasks.training.stored_sampler import load_stored_sampler

    cfg = _cfg(tmp_path, "model.dtype=bfloat16", "model.quantize=nf4", "train.max_steps=1")
    plan, _, txt, lora, _ = run_nodes(cfg, Store(cfg.store.root))
    prompt = Store(cfg.store.root).get_tensors(cache_text.KIND, next(v for k, v in txt["items"].items() if k.startswith("prompt:")))
    adapter = make_adapter(cfg.model, plan.model_dir)
    images = []
    for offload in (False, True):
        pipe = load_stored_sampler(adapter, _cfg(tmp_path, "model.dtype=bfloat16", "model.quantize=nf4",
                                                 f"sample.offload={str(offload).lower()}"), Path(lora["lora"]))
        if offload:
            swap = pipe.transformer.loraflow_block_swap
            assert len(swap.hosts) == len(pipe.transformer.transformer_blocks) + len(pipe.transformer.single_transformer_blocks)
        images.append(pipe(prompt_embeds=prompt["prompt_embeds"][None].to(torch.bfloat16),
                           pooled_prompt_embeds=prompt["pooled_prompt_embeds"][None].to(torch.bfloat16), width=32,
                           height=32, num_inference_steps=2, guidance_scale=1.0,
                           generator=torch.Generator().manual_seed(0), output_type="pt").images)
    assert torch.equal(*images)  # exact: the swap copies stored weights, never changes a value
    assert any("sample.offload=true swaps" in e for e in config_errors(_cfg(tmp_path, "model=tiny_sd15", "sample.offload=true")))
