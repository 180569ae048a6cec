"""Issue 47 item 4: LoHa and LoKr (`train.network=loha|lokr`) on the video families (Wan 2.1, Wan 2.2, LTX-2,
HunyuanVideo 1.5). ComfyUI maps no `lycoris_<diffusers module>` name for its video models, only its generic
`lora_unet_<model key>` (tests/comfyui_video.py restates its code), so their LyCORIS file is in ComfyUI's module
names (tasks/training/export_lycoris.py): every key read by ComfyUI's key map and LoHa/LoKr rules, each module's
merged delta the trained one. HunyuanVideo 1.5's q/k/v are one `img_attn.qkv` in ComfyUI's model: their LoHa fuse
exactly, their LoKr share w2 in training (tasks/training/lycoris_fused.py). Through the nodes, each family trains,
renders its samples with the network and publishes that file."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from peft import get_peft_model_state_dict
from safetensors.torch import load_file

from tasks import cache_latents, cache_text, publish, sample, train, validate
from tasks.config import compose, resolve_paths
from tasks.models import adapter_class
from tasks.models.tiny.tiny_hunyuan_video15 import build_tiny_hunyuan_video15
from tasks.models.tiny.tiny_hunyuan_video15_i2v import build_tiny_hunyuan_video15_i2v
from tasks.models.tiny.tiny_ltx2 import build_tiny_ltx2
from tasks.models.tiny.tiny_wan import build_tiny_wan, build_tiny_wan22
from tasks.models.tiny.tiny_wan_i2v import build_tiny_wan22_i2v, build_tiny_wan22_ti2v, build_tiny_wan_i2v
from tasks.models.lora_variants import lycoris
from tasks.store import Store
from tasks.training.export_lycoris import fused_groups, to_lycoris
from comfyui_video import comfy_keys, lycoris_merge
from support import lycoris_magnitude
from tolerance import rounding

REPO = Path(__file__).resolve().parents[1]
BUILDERS = {"wan": build_tiny_wan, "wan22": build_tiny_wan22, "ltx2": build_tiny_ltx2,
            "hunyuan_video15": build_tiny_hunyuan_video15, "hunyuan_video15_i2v": build_tiny_hunyuan_video15_i2v,
            "wan_i2v": build_tiny_wan_i2v,
            "wan22_i2v": build_tiny_wan22_i2v, "wan22_ti2v": build_tiny_wan22_ti2v}
VIDEO = list(BUILDERS)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = BUILDERS[family](tmp_path_factory.mktemp(family) / "model")
        return cache[family]
    return get


_magnitude = lycoris_magnitude



@pytest.mark.parametrize("network", ["loha", "lokr"])
@pytest.mark.parametrize("family", VIDEO)
def test_lycoris_file_is_mapped_completely_by_comfyui_with_the_trained_delta(family, network, tiny):
    rank, alpha = 4, 6.0  # alpha / rank = 1.5: a loader applying 1 (or alpha) would get it wrong
    adapter = adapter_class(family)(tiny(family))
    den = adapter.load_denoiser()
    keys, rows = comfy_keys(family, den)  # before peft wraps the Linears
    den.add_adapter(lycoris.make_config(network, rank, alpha, adapter.default_lora_targets()))
    layers = {n: m for n, m in den.named_modules() if hasattr(m, "get_delta_weight")}
    if network == "lokr":  # as training ties them (tasks/training/train_setup.py)
        lycoris.share_w2(den, fused_groups(family, layers))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # as training leaves it: every factor non-zero (peft starts one at zero)
        for p in den.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    config = {k: sorted(v) if isinstance(v, set) else v for k, v in den.peft_config["default"].to_dict().items()}
    sd = get_peft_model_state_dict(den)
    file = to_lycoris(sd, config, family)
    assert file and all(k.startswith("lora_unet_") for k in file)

    merged = lycoris_merge(file, keys)  # every key read, every delta of its module's shape
    assert set(layers) <= set(rows) and {rows[n][0] for n in layers} == set(merged)
    parts = lycoris.modules_of(sd, network)
    for name, layer in layers.items():
        want = layer.get_delta_weight("default").double()
        key, sl = rows[name]
        bound = rounding(3 * rank, stages=3, magnitude=alpha / rank * _magnitude(parts[name]))
        assert (merged[key][sl] - want).abs().max().item() <= bound, name
        assert want.abs().max() > 0
    if family.startswith("hunyuan_video15"):  # q, k, v fused into ComfyUI's qkv: the case this layout is for
        assert any(k.endswith("_attn.qkv") for k in merged) and len(fused_groups(family, layers)) == 2 * 2


def _cfg(*overrides):
    return resolve_paths(compose("train", list(overrides))[0])


# A few steps through the nodes, each family with one network (HunyuanVideo 1.5 with both: its q/k/v fuse);
# clips of 5 frames (LTX-2's VAE: 1 + 8k, so 9)
DAG = [("wan", "lokr", []), ("wan22", "loha", ["model.expert=both"]), ("ltx2", "lokr", []),
       ("hunyuan_video15", "lokr", []), ("hunyuan_video15", "loha", []), ("wan_i2v", "loha", []),
       ("hunyuan_video15_i2v", "lokr", [])]


@pytest.mark.parametrize("family,network,extra", DAG, ids=[f"{f}-{n}" for f, n, _ in DAG])
def test_dag_trains_samples_and_exports(family, network, extra, tmp_path):
    """The refusal is gone; the network trains (every factor moves), the sample renders with it (not the base
    video), the run's `lycoris` (= `comfyui`) file is in ComfyUI's names, and put back on the model by loraflow's
    loader (the learning check's) it is the trained network."""
    prompts = tmp_path / "prompts.txt"
    first = f" --i {REPO / 'data' / 'demo' / 'img_00.png'}" if adapter_class(family).controls.first_frame else ""
    prompts.write_text(f"a red circle moving right on a blue background{first}\n")  # image-to-video: from an image
    frames = 1 + adapter_class(family).clips.frame_step
    common = [f"store.root={tmp_path / 'store'}", f"model=tiny_{family}", "data=demo_clips", f"data.frames={frames}",
              f"sample.prompts_file={prompts}", "train.max_steps=2", "train.lr=0.02", "train.log_with=none",
              "sample.steps=2", f"train.network={network}", *extra]
    cfg = _cfg(*common)
    assert not validate.config_errors(cfg)
    store = Store(tmp_path / "store")
    plan = validate.run(cfg, store)
    latents, texts = cache_latents.run(cfg, plan, store), cache_text.run(cfg, plan, store)
    lora = train.run(cfg, plan, store, latents["items"], texts["items"])
    files = publish.publish(cfg, plan, store, tmp_path / "run", lora, [])["lora_files"]
    assert set(files) == {"lycoris", "comfyui"} and files["lycoris"] == files["comfyui"]
    exported = load_file(files["lycoris"])
    assert exported and all(k.startswith("lora_unet_") for k in exported)
    assert lycoris.file_network(lora["lora"]) == network and lycoris.is_lycoris_file(files["lycoris"])

    adapter = adapter_class(family)(plan.model_dir)
    trained, back = adapter.load_denoiser(), adapter.load_denoiser()
    lycoris.apply_file(trained, lora["lora"])
    lycoris.apply_lycoris(back, files["lycoris"])
    layers = {n: m for n, m in trained.named_modules() if hasattr(m, "get_delta_weight")}
    other = dict(back.named_modules())
    sd, config, _ = lycoris.read_peft(lora["lora"])
    parts = lycoris.modules_of(sd, network)
    if family.startswith("hunyuan_video15") and network == "lokr":  # trained with one w2 per fused q/k/v
        q, k = (parts[f"transformer_blocks.0.attn.to_{s}"] for s in "qk")
        assert all(torch.equal(q[n], k[n]) for n in q if n.startswith("lokr_w2")) and not torch.equal(
            q["lokr_w1"], k["lokr_w1"])
    # HunyuanVideo 1.5's last block: its caption stream's output is dropped (the transformer returns the video
    # tokens), so its queries, attention output and MLP get no gradient
    last = trained.config.num_layers - 1 if family.startswith("hunyuan_video15") else -1
    unused = rf"transformer_blocks\.{last}\.(attn\.(add_q_proj|to_add_out)|ff_context\..+)"
    for name, layer in layers.items():
        want = layer.get_delta_weight("default").double()
        got = other[name].get_delta_weight("default").double()
        assert want.abs().max() > 0 or re.fullmatch(unused, name), f"{name} did not train"
        scale = config["alpha"] / config["r"]
        bound = rounding(3 * config["r"], stages=3, magnitude=scale * _magnitude(parts[name]))
        assert (got - want).abs().max().item() <= bound, name

    rendered = sample.run(cfg, plan, store, lora["key"], lora["lora"], texts["items"])["samples"]
    base = sample.run(cfg, plan, store, lora["key"] + "-base", _zero_like(lora["lora"], tmp_path), texts["items"])
    with_network, without = _frames(rendered[0], frames), _frames(base["samples"][0], frames)
    assert with_network.shape[0] == frames
    assert (with_network != without).any(), "the sample with the trained network equals the one with a zero delta"


def _zero_like(path, tmp_path):
    """The train node's file with every factor zeroed but the config kept: the base model's render."""
    sd, config, component = lycoris.read_peft(path)
    return lycoris.save_peft(tmp_path / "zero.safetensors", {k: torch.zeros_like(v) for k, v in sd.items()}, config,
                             component)


def _frames(path, frames: int) -> np.ndarray:
    from tasks.data.clips import read_frames

    return np.asarray(read_frames(path, frames))
