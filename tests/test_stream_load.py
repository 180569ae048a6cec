"""Issue 43: the train node streams the base in, storing each frozen weight low as it is read
(tasks/models/loading/stream_load.py, tasks/training/base_loading.py). For every family of the registry and every
`model.quantize`, the prepared denoiser equals the one from_pretrained-then-quantize made before, bit for bit:
every parameter and buffer (a torchao tensor's inner tensors included), the LoRA's initial weights and the hooks.
Bad files get one-line errors naming the file."""
from __future__ import annotations

from dataclasses import replace
import json
from pathlib import Path

import pytest
import torch

from tasks.config_schema import ModelConfig
from tasks.config import Config, ConfigError, config_of
from tasks.models import FAMILIES, make_adapter, resolve_model
from tasks.models.loading.stream_load import folder_entries, load_streamed
from tasks.store import Store
from tasks.training import train_setup
from tasks.training.base_loading import plan_loading

REPO = Path(__file__).resolve().parents[1]
KINDS = ["none", "fp8", "int8", "nf4"]


def _family(family: str, root, expert=None):
    import yaml

    # the tiny model's own text length (Wan 2.1 I2V's transformer takes 512 text keys, the others 32 here)
    tokens = yaml.safe_load((REPO / "conf" / "model" / f"tiny_{family}.yaml").read_text())["max_sequence_length"]
    model = ModelConfig(family=family, path=None, seed=0, arch={}, dtype="bfloat16", max_sequence_length=tokens,
                        storage_dtype=None, storage_modulation=False, quantize="none", expert=expert)
    return model, resolve_model(model, Store(root))


def _cfg(model: ModelConfig, kind: str, **train) -> Config:
    return config_of({"model": replace(model, quantize=kind),
                      "train": {"rank": 4, "alpha": None, "target_modules": None, "gradient_checkpointing": False,
                                **train}})


def _tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """A tensor's bytes as a list of plain tensors (a torchao subclass: its inner tensors)."""
    if type(t).__module__.startswith("torchao."):
        names, _ = t.__tensor_flatten__()
        return [x for n in names for x in _tensors(getattr(t, n))]
    return [t.data if isinstance(t, torch.nn.Parameter) else t]


def _bytes(x: torch.Tensor) -> torch.Tensor:
    flat = torch.empty(x.shape, dtype=x.dtype).copy_(x).reshape(-1)  # a fresh contiguous copy, whatever the strides
    return flat.view(torch.uint8) if flat.numel() else flat


def _state(model) -> dict:
    out = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        out[name] = (type(t.data if isinstance(t, torch.nn.Parameter) else t).__name__, t.requires_grad,
                     [(x.dtype, tuple(x.shape), _bytes(x))
                      for x in _tensors(t)])
    hooks = {n: sorted(getattr(m, "_diffusers_hook", None).hooks) if getattr(m, "_diffusers_hook", None) else []
             for n, m in model.named_modules()}
    return {"tensors": out, "hooks": hooks, "types": [type(m).__name__ for m in model.modules()]}


def _assert_equal(a: dict, b: dict, what: str) -> None:
    assert a["types"] == b["types"] and a["hooks"] == b["hooks"], what
    assert a["tensors"].keys() == b["tensors"].keys(), what
    for name, (ta, ga, xa) in a["tensors"].items():
        tb, gb, xb = b["tensors"][name]
        assert (ta, ga) == (tb, gb), (what, name)
        assert [(d, s) for d, s, _ in xa] == [(d, s) for d, s, _ in xb], (what, name)
        assert all(torch.equal(x, y) for (_, _, x), (_, _, y) in zip(xa, xb)), (what, name)  # the same bytes


def _prepared(adapter, cfg, streamed: bool):
    torch.manual_seed(0)  # stream=False: the path before issue 43, from_pretrained whole, stored low afterwards
    return train_setup.prepare_denoiser(adapter, cfg, stream=streamed)[0]


CASES = [(f, None) for f in FAMILIES] + [("wan22", "both")]


@pytest.mark.parametrize("family,expert", CASES, ids=[f if e is None else f"{f}-{e}" for f, e in CASES])
def test_streamed_base_equals_the_loaded_then_quantized_one(family, expert, tmp_path):
    model, folder = _family(family, tmp_path, expert)
    for kind in KINDS:
        cfg = _cfg(model, kind)
        adapter = make_adapter(cfg.model, folder)
        streamed = _prepared(adapter, cfg, True)
        if kind in ("int8", "nf4"):
            assert any(type(p).__module__.startswith("torchao.") for p in streamed.parameters()), kind
        _assert_equal(_state(_prepared(adapter, cfg, False)), _state(streamed), f"{family} {kind}")


@pytest.mark.parametrize("network", ["lokr", "loha"])
def test_lycoris_on_a_streamed_nf4_base(network, tmp_path):
    model, folder = _family("flux", tmp_path)
    cfg = _cfg(model, "nf4", network=network)
    adapter = make_adapter(cfg.model, folder)
    _assert_equal(_state(_prepared(adapter, cfg, False)), _state(_prepared(adapter, cfg, True)),
                  network)


def test_swapped_blocks_load_straight_to_the_host_and_equal_the_swap_after_loading(tmp_path):
    model, folder = _family("flux", tmp_path)
    cfg = _cfg(model, "int8", blocks_to_swap=2)
    adapter = make_adapter(cfg.model, folder)
    plan = plan_loading(adapter, cfg, ())
    n = len(adapter.load_denoiser().transformer_blocks) + len(adapter.load_denoiser().single_transformer_blocks)
    assert len(plan.swapped["transformer"]) == 2 and plan.swapped["transformer"][-1] == \
        f"single_transformer_blocks.{n - len(adapter.load_denoiser().transformer_blocks) - 1}."
    _assert_equal(_state(_prepared(adapter, cfg, False)), _state(_prepared(adapter, cfg, True)),
                  "swap")


def test_dora_keeps_the_load_then_quantize_path(tmp_path):
    model, folder = _family("flux", tmp_path)
    cfg = _cfg(model, "int8", network="dora")
    assert plan_loading(make_adapter(cfg.model, folder), cfg, ()) is None


def _copy_transformer(folder, tmp_path):
    import shutil

    out = tmp_path / "copy"
    shutil.copytree(folder / "transformer", out)
    return out


def test_a_truncated_or_missing_file_is_one_line(tmp_path):
    import diffusers

    _, folder = _family("flux", tmp_path)
    sub = _copy_transformer(folder, tmp_path)
    file = next(sub.glob("*.safetensors"))
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 100])
    with pytest.raises(ConfigError, match=r"truncated .* download it again") as e:
        load_streamed(diffusers.FluxTransformer2DModel, sub, torch.bfloat16)
    assert str(file) in str(e.value) and "\n" not in str(e.value)
    file.unlink()
    with pytest.raises(ConfigError, match="no safetensors weights"):
        load_streamed(diffusers.FluxTransformer2DModel, sub, torch.bfloat16)
    file.write_bytes(b"\x01")
    with pytest.raises(ConfigError, match="not a safetensors file"):
        load_streamed(diffusers.FluxTransformer2DModel, sub, torch.bfloat16)


def test_a_checkpoint_of_another_family_is_one_line(tmp_path):
    import diffusers

    _, flux = _family("flux", tmp_path / "flux")
    _, sd3 = _family("sd3", tmp_path / "sd3")
    sub = _copy_transformer(flux, tmp_path)
    for f in sub.glob("*.safetensors"):
        f.unlink()
    import shutil

    for f in (sd3 / "transformer").glob("*.safetensors"):
        shutil.copy(f, sub)
    with pytest.raises(ConfigError, match=r"model family .*model.family / model.path"):
        load_streamed(diffusers.FluxTransformer2DModel, sub, torch.bfloat16)


def test_extra_weights_are_left_out_with_a_warning_as_from_pretrained_does(tmp_path, caplog):
    import diffusers
    from safetensors.torch import load_file, save_file

    _, folder = _family("flux", tmp_path)
    sub = _copy_transformer(folder, tmp_path)
    file = next(sub.glob("*.safetensors"))
    sd = load_file(file)
    save_file({**sd, "extra_head.weight": torch.ones(2, 2)}, file)
    with caplog.at_level("WARNING", logger="loraflow"):
        got = load_streamed(diffusers.FluxTransformer2DModel, sub, torch.float32).state_dict()
    assert "extra_head.weight" in caplog.text and "left out" in caplog.text
    assert got.keys() == sd.keys() and all(torch.equal(got[k], sd[k]) for k in sd)


def test_an_fp8_file_with_scales_loads_as_weight_times_scale(tmp_path):
    """A ComfyUI "scaled fp8" / musubi-tuner fp8-scaled file: `<module>.weight` in e4m3fn and `.scale_weight`."""
    import diffusers
    from safetensors.torch import load_file, save_file

    _, folder = _family("flux", tmp_path)
    sub = _copy_transformer(folder, tmp_path)
    file = next(sub.glob("*.safetensors"))
    sd = load_file(file)
    scaled, expect = {}, {}
    for name, t in sd.items():
        if name.endswith(".weight") and t.dim() == 2:
            scale = t.float().abs().amax() / 448.0  # e4m3fn's largest normal
            scaled[name] = (t.float() / scale).to(torch.float8_e4m3fn)
            scaled[name[: -len("weight")] + "scale_weight"] = scale.reshape(1)
            expect[name] = (scaled[name].float() * scale).to(torch.bfloat16)
        else:
            scaled[name], expect[name] = t, t.to(torch.bfloat16)
    scaled["scaled_fp8"] = torch.zeros(0, dtype=torch.float8_e4m3fn)
    save_file(scaled, file)
    assert any(n.endswith(".scale_weight") for n in folder_entries(sub))
    got = load_streamed(diffusers.FluxTransformer2DModel, sub, torch.bfloat16).state_dict()
    assert got.keys() == expect.keys()
    assert all(torch.equal(got[n], expect[n]) for n in expect)  # the same arithmetic: exact


def test_the_stream_reads_each_file_once_in_order(tmp_path):
    """Sharded folders: the index's files; every tensor of the header exactly once."""
    from safetensors.torch import load_file, save_file

    _, folder = _family("flux", tmp_path)
    sub = _copy_transformer(folder, tmp_path)
    file = next(sub.glob("*.safetensors"))
    sd = load_file(file)
    names = sorted(sd)
    half = len(names) // 2
    shards = {"a-00001-of-00002.safetensors": names[:half], "a-00002-of-00002.safetensors": names[half:]}
    for shard, keys in shards.items():
        save_file({k: sd[k] for k in keys}, sub / shard)
    file.unlink()
    (sub / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: s for s, keys in shards.items() for k in keys}}))
    import diffusers

    got = load_streamed(diffusers.FluxTransformer2DModel, sub, torch.bfloat16).state_dict()
    ref = diffusers.FluxTransformer2DModel.from_pretrained(sub, dtype=torch.bfloat16).state_dict()
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)
