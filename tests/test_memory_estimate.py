"""Preflight memory estimate: read from configs and safetensors headers; when a run will not fit, the
message names the settings that would make it fit."""
from __future__ import annotations

import json
import struct

import pytest
import torch

from tasks.config import ConfigError, config_of, updated
from tasks.config_schema import ModelConfig
from tasks.training.memory import GB, estimate, fitting_settings
from tasks.models import make_adapter, resolve_model
from tasks.models.flux import FluxAdapter
from tasks.models.qwenimage import QwenImageAdapter
from tasks.store import Store
from tasks.training.train_setup import prepare_denoiser

FLUX_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                axes_dims_rope=(16, 56, 56))
TARGETS = ["to_k", "to_q", "to_v", "to_out.0"]


# Tongyi-MAI/Z-Image-Turbo's transformer/config.json
ZIMAGE_TURBO = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=3840, n_layers=30,
                    n_refiner_layers=2, n_heads=30, n_kv_heads=30, norm_eps=1e-5, qk_norm=True, cap_feat_dim=2560,
                    rope_theta=256.0, t_scale=1000.0, axes_dims=[32, 48, 48], axes_lens=[1536, 512, 512])


@pytest.fixture(scope="module")
def flux_dev_headers(tmp_path_factory):
    """FLUX.1-dev's transformer as config + a header-only safetensors file (shapes, no weights)."""
    from diffusers import FluxTransformer2DModel

    return _headers(FluxTransformer2DModel, FLUX_DEV, tmp_path_factory.mktemp("flux-dev"))


def _headers(cls, config, root):
    with torch.device("meta"):
        model = cls(**config)
    folder = root / "transformer"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(dict(model.config)))
    header, offset = {}, 0
    for name, t in model.state_dict().items():
        n = t.numel() * 2
        header[name] = {"dtype": "BF16", "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    (folder / "diffusion_pytorch_model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    return folder.parent


def test_zimage_turbo_at_1024(tmp_path):
    from diffusers import ZImageTransformer2DModel

    from tasks.models.zimage import ZImageAdapter

    folder = _headers(ZImageTransformer2DModel, ZIMAGE_TURBO, tmp_path)
    est = estimate(_cfg(), folder, "transformer", ZImageAdapter.LORA_TARGETS, (1024, 1024), 512,
                   ZImageTransformer2DModel, geometry=ZImageAdapter.activation_geometry)
    assert 6.1e9 < est["params"] < 6.2e9 and 11 < est["weights_gb"] < 12  # Z-Image: 6.15 B parameters
    # rank 16 on q/k/v/out and w1/w2/w3 of 30 layers + 4 refiner layers
    assert est["lora_params"] == 34 * 16 * (4 * 2 * 3840 + 3 * (3840 + 10240))
    assert est["activations_gb"] > 0


def test_qwenimage_at_1024(tmp_path):
    from diffusers import QwenImageTransformer2DModel

    folder = _headers(QwenImageTransformer2DModel, {}, tmp_path)  # Qwen/Qwen-Image's config: the class defaults
    est = estimate(_cfg(), folder, "transformer", TARGETS, (1024, 1024), 512, QwenImageTransformer2DModel,
                   geometry=QwenImageAdapter.activation_geometry)
    assert 20.3e9 < est["params"] < 20.5e9 and 37 < est["weights_gb"] < 39  # Qwen-Image: 20.4 B parameters
    assert est["lora_params"] == 60 * 4 * 16 * (2 * 3072)  # rank 16 on to_q/k/v/out of 60 blocks, width 3072


def test_flux2_dev_at_1024(tmp_path):
    from diffusers import Flux2Transformer2DModel

    from tasks.models.flux2_dev import Flux2DevAdapter

    # black-forest-labs/FLUX.2-dev's transformer config: the class defaults (8 double, 48 single blocks, width
    # 6144, in 128 = 32 VAE channels x 2x2, joint 15360 = 3 x Mistral's 5120, guidance embedding)
    folder = _headers(Flux2Transformer2DModel, {}, tmp_path)
    est = estimate(_cfg(), folder, "transformer", Flux2DevAdapter.LORA_TARGETS, (1024, 1024), 512,
                   Flux2Transformer2DModel, geometry=Flux2DevAdapter.activation_geometry)
    assert 32.1e9 < est["params"] < 32.3e9 and 59 < est["weights_gb"] < 61  # FLUX.2 [dev]: 32.2 B parameters
    # rank 16 on every block projection, r x (in + out) in units of the width D: a double block 38 D (eight
    # D->D attention projections: 16 D; each stream's MLP D->6D and 3D->D: 11 D), a single block 15 D (the
    # fused D->9D and 4D->D)
    assert est["lora_params"] == 16 * 6144 * (8 * 38 + 48 * 15)
    assert est["activations_gb"] > 0


def _cfg(**train):
    return config_of({"model": {"dtype": "bfloat16", "storage_dtype": None, "max_sequence_length": 512},
            "train": {"rank": 16, "batch_size": 1, "optimizer": "adamw", "mixed_precision": "bf16",
                      "gradient_checkpointing": False, **train}})


def _est(folder, cfg):
    from diffusers import FluxTransformer2DModel

    return estimate(cfg, folder, "transformer", TARGETS, (1024, 1024), cfg.model.max_sequence_length,
                    FluxTransformer2DModel, geometry=FluxAdapter.activation_geometry)


def test_flux_dev_at_1024(flux_dev_headers):
    plain = _est(flux_dev_headers, _cfg())
    assert 11.8e9 < plain["params"] < 12.0e9 and 22 < plain["weights_gb"] < 23  # FLUX.1-dev: 11.9 B parameters
    checkpointed = _est(flux_dev_headers, _cfg(gradient_checkpointing=True))
    assert checkpointed["activations_gb"] < plain["activations_gb"] / 10
    fp8 = _est(flux_dev_headers, updated(_cfg(gradient_checkpointing=True), {"model.storage_dtype": "float8_e4m3fn"}))
    # the AdaLN modulation linears (3.2 B parameters) stay bf16 under diffusers' layerwise casting
    assert checkpointed["weights_gb"] / 2 < fp8["weights_gb"] < checkpointed["weights_gb"] * 0.7
    assert plain["total_gb"] > 24 and fp8["total_gb"] < 20

    fits = fitting_settings(_cfg(), 24.0, lambda c: _est(flux_dev_headers, c))
    assert any(f.startswith("model.storage_dtype=float8_e4m3fn") for f in fits) or \
        any("train.gradient_checkpointing=true" in f for f in fits)


def test_flux_dev_quantized_and_swapped(flux_dev_headers):
    """model.quantize and train.blocks_to_swap in the estimate, and the settings a refusal names for a card."""
    from diffusers import FluxTransformer2DModel

    lists = ("transformer_blocks", "single_transformer_blocks")

    def est(cfg):
        return estimate(cfg, flux_dev_headers, "transformer", TARGETS, (1024, 1024), 512, FluxTransformer2DModel, lists,
                        geometry=FluxAdapter.activation_geometry)

    ckpt = _cfg(gradient_checkpointing=True)
    with_model = lambda **m: updated(ckpt, {f"model.{k}": v for k, v in m.items()})  # noqa: E731
    bf16, int8, nf4 = est(ckpt), est(with_model(quantize="int8")), est(with_model(quantize="nf4"))
    # the block Linears (all but 0.1 B of the 11.9 B) at 1 and ~0.52 bytes; the modulation linears stay bf16
    assert int8["weights_gb"] < 0.75 * bf16["weights_gb"] and nf4["weights_gb"] < int8["weights_gb"] - 2
    # model.matmul=bnb: the same bytes held; bnb's dequantize writes the bf16 weight at once (torchao's NF4 decodes
    # through int64 indices), so less in flight
    bnb = est(with_model(quantize="nf4", matmul="bnb"))
    assert bnb["weights_gb"] == nf4["weights_gb"] and bnb["transient_gb"] < nf4["transient_gb"]
    swap = est(updated(ckpt, {"model.quantize": "int8", "train.blocks_to_swap": 38}))
    assert 4 < swap["host_gb"] and swap["weights_gb"] + swap["host_gb"] > int8["weights_gb"]  # + one layer in flight
    assert bf16["host_gb"] == 0
    fits = fitting_settings(_cfg(), 8.0, est, max_swap=57)
    assert len(fits) == 1 and "train.blocks_to_swap=" in fits[0] and "model.quantize=" in fits[0], fits
    with pytest.raises(ConfigError, match="this model has 57 transformer blocks"):
        est(updated(ckpt, {"train.blocks_to_swap": 58}))


def test_flux_dev_fp8_weights_are_the_bytes_the_fp8_base_keeps(flux_dev_headers):
    from diffusers import FluxTransformer2DModel

    from tasks.training.fp8_base import store_base_low
    from tasks.training.memory import layerwise_skip_patterns

    with torch.device("meta"):
        model = FluxTransformer2DModel(**FLUX_DEV).to(torch.bfloat16).requires_grad_(False)
    store_base_low(model, torch.float8_e4m3fn, torch.bfloat16, layerwise_skip_patterns(FluxTransformer2DModel))
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    fp8 = _est(flux_dev_headers, updated(_cfg(), {"model.storage_dtype": "float8_e4m3fn"}))
    assert fp8["weights_gb"] * GB == held
    fp8_all = _est(flux_dev_headers, updated(_cfg(), {"model.storage_dtype": "float8_e4m3fn",
                                                   "model.storage_modulation": True}))
    assert held - fp8_all["weights_gb"] * GB > 3.0 * GB  # the 3.2 B AdaLN modulation parameters, a byte each


@pytest.mark.parametrize("family,modulation", [("flux", False), ("flux", True), ("sd3", False), ("sd3", True),
                                               ("sdxl", False), ("zimage", False), ("zimage", True),
                                               ("qwenimage", True)])
def test_estimated_weights_are_what_the_train_node_holds(family, modulation, tmp_path):
    """The estimate's weight bytes equal those the denoiser the train node prepares holds (fp8 base; its
    parameters and saved buffers, LoRA left out), for transformers with AdaLN and a UNet with convolutions
    and group norms."""
    model = ModelConfig(family=family, path=None, seed=0, arch={}, dtype="bfloat16", max_sequence_length=32,
                        storage_dtype="float8_e4m3fn", storage_modulation=modulation)
    adapter = make_adapter(model, resolve_model(model, Store(tmp_path)))
    cfg = config_of({"model": model, "train": {"rank": 4, "alpha": None, "target_modules": None,
                                               "gradient_checkpointing": False, "batch_size": 1, "optimizer": "adamw",
                                               "mixed_precision": "bf16"}})
    denoiser, lora = prepare_denoiser(adapter, cfg)
    held = sum(t.numel() * t.element_size() for n, t in denoiser.state_dict().items() if "lora_" not in n)
    est = estimate(cfg, adapter.model_dir, adapter.denoiser_subfolder, adapter.default_lora_targets(), (64, 64), 32,
                   adapter.denoiser_cls, geometry=adapter.activation_geometry)
    assert est["weights_gb"] * GB == held
    assert est["lora_params"] == sum(p.numel() for p in lora.values())


def test_a_run_that_will_not_fit_names_the_settings(workspace):
    with pytest.raises(ConfigError) as e:
        workspace.run("train.memory_limit_gb=0.0001")
    message = str(e.value)
    assert "will not fit in memory" in message and "train.memory_limit_gb" in message
    assert "gradient_checkpointing" in message and "model.quantize=fp8|int8|nf4" in message and "batch_size=1" in message
    assert "train.blocks_to_swap (up to 2)" in message


def test_the_report_carries_the_estimate(workspace):
    r = workspace.run()
    m = r["memory_estimate"]
    assert m["params"] > 0 and m["lora_params"] > 0 and m["total_gb"] > 0 and m["budget_source"]


def test_image_to_video_families_take_their_own_activation_constants():
    """Wan's image-to-video families share WanTransformer3DModel with Wan 2.1, so the class name cannot tell their
    constants apart: each adapter declares them (activation_factors, activation_extras; measured by bench.memory)."""
    from tasks.models import adapter_class
    from tasks.models.ltx2 import LTX2Adapter
    from tasks.models.wan import WanAdapter
    from tasks.training.memory import Factors, TRANSIENT_FACTOR, family_factors

    wan = Factors(*WanAdapter.activation_factors, text_offloaded=1.0)  # the caption states, copied with each block
    assert family_factors(adapter_class("wan")) == family_factors(adapter_class("wan22_i2v")) == wan
    assert family_factors(adapter_class("wan_i2v")) == Factors(31.7, 1.05, 31.8, TRANSIENT_FACTOR, 1.0, 1.5)
    assert family_factors(adapter_class("wan22_ti2v")) == Factors(50.6, 1.31, 50.8, 19.0, 7.0, 1.0)
    assert family_factors(LTX2Adapter) == Factors(*LTX2Adapter.activation_factors, text_offloaded=1.5)
    assert family_factors(FluxAdapter) is None  # the denoiser class's (FLUX.1's measured ones)


def test_wan22_ti2v_5b_at_704x1280_121_frames(tmp_path):
    """Wan 2.2 TI2V-5B's real config (diffusers' convert_wan_to_diffusers.py, "Wan2.2-TI2V-5B"): 5.0 B parameters,
    27,280 tokens at 704x1280 and 121 frames on its /16 VAE; its constants in each term of the estimate."""
    from diffusers import WanTransformer3DModel

    from tasks.models.wan22_ti2v import TI2V_5B as WAN22_TI2V_5B
    from tasks.models import adapter_class
    from tasks.training.memory import family_factors

    adapter = adapter_class("wan22_ti2v")
    folder = _headers(WanTransformer3DModel, WAN22_TI2V_5B, tmp_path)
    f = family_factors(adapter)

    def est(**train):
        cfg = updated(_cfg(gradient_checkpointing=True, **train), {"data.frames": 121})
        return estimate(cfg, folder, "transformer", adapter.LORA_TARGETS, (1280, 704), 512, WanTransformer3DModel,
                        adapter.swap_blocks, geometry=adapter.activation_geometry, factors=f)

    ckpt, off = est(), est(gradient_checkpointing_offload=True)
    assert 4.99e9 < ckpt["params"] < 5.01e9
    tokens, width = 31 * (704 // 32) * (1280 // 32), 24 * 128
    unit = tokens * width * 2
    assert ckpt["activations_gb"] * GB == pytest.approx((30 * 1.31 + 50.8) * unit, rel=1e-12)
    assert ckpt["transient_gb"] * GB == pytest.approx(19.0 * unit, rel=1e-12)  # bf16: no dequantize dominates
    # the offload copies each block's hidden states, its per-token timestep embedding and the caption to the host
    assert off["host_gb"] * GB == pytest.approx(30 * (7 * tokens + 512) * width * 2, rel=1e-12)
    assert off["activations_gb"] * GB == pytest.approx((30 * 0.31 + 1 + 50.8) * unit, rel=1e-9)
