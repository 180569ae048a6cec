"""Issue 61 items 4 and 6: the preflight of every node (tasks/run_memory.py), validate's refusal of a run one node
cannot fit, and bench.memory's node rows `<model>:<node>:<options>` against the live peak they are measured by."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from tasks import run_memory
from tasks.config import ConfigError, compose, resolve_paths, updated
from tasks.models import make_adapter, resolve_model
from tasks.store import Store
from tasks.training.memory import GB
from tolerance import PREFLIGHT_WITHIN

REPO = Path(__file__).resolve().parents[1]
MEASURED = REPO / "bench" / "memory.json"
GIB = 1 << 30


def _tiny(tmp_path, *overrides):
    cfg = resolve_paths(compose("train", [f"store.root={tmp_path / 'store'}", f"data.dir={REPO / 'data' / 'demo'}",
                                          f"sample.prompts_file={REPO / 'data' / 'demo_prompts.txt'}", *overrides])[0])
    return cfg, make_adapter(cfg.model, resolve_model(cfg.model, Store(tmp_path / "store")))


# -- the estimate ----------------------------------------------------------------------------------------------------
def test_the_text_encoders_are_their_published_sizes():
    """bench/text_encoder_configs.py builds each encoder at the parameter count its model card gives (to 0.5 %: the
    cards round to three or four digits)."""
    from bench.text_encoder_configs import NAMES, PARAMS, build

    for name in NAMES:
        params = sum(p.numel() for p in build(name).parameters())
        if name in PARAMS:
            assert params == pytest.approx(PARAMS[name], rel=5e-3), name


@pytest.mark.parametrize("name", ["t5_xxl", "clip_l", "mistral_small_3_1", "qwen2_5_vl_7b", "gemma3_12b"])
def test_linears_and_layers_read_from_names_are_the_modules(name):
    """What the preflight reads from a header's names is what the loader acts on: the nn.Linear weights text.quantize
    stores (text_load: `type(module) is nn.Linear`), and the layers text.offload swaps (block_swap.swap_every_layer:
    the children of the outermost ModuleLists)."""
    from bench.memory_nodes import _layers
    from bench.text_encoder_configs import build

    enc = build(name)
    names = [n for n, _ in enc.named_parameters()]  # a tied weight once, as a checkpoint holds it
    shapes = dict((n, p.shape) for n, p in enc.named_parameters())
    linear = {f"{p}.weight" for p, m in enc.named_modules() if type(m) is torch.nn.Linear} & set(names)
    read = {n for n in names if n.endswith(".weight") and len(shapes[n]) == 2
            and not run_memory._EMBEDDING.search(n.rpartition(".")[0])}
    assert read == linear
    paths = {id(m): p for p, m in enc.named_modules()}
    assert set(run_memory.layers(names)) == {paths[id(layer)] for layer in _layers(enc)}


def test_the_text_estimate_is_what_the_loader_stores(tmp_path):
    """tiny_flux's CLIP and T5 loaded by cache_text's own loader: the bytes on the device equal the preflight's
    weights, as stored (none, fp8) and with text.offload (two layers' copies; the rest of the layers' weights on
    the host: what the block swap moved)."""
    from tasks.training.block_swap import stored_nbytes
    from tasks.training.quantized_base import text_loading

    for quantize, offload in (("none", False), ("fp8", False), ("fp8", True)):
        cfg, adapter = _tiny(tmp_path, f"text.quantize={quantize}", f"text.offload={str(offload).lower()}")
        est = run_memory.cache_text(cfg, adapter)
        adapter.text_loading = text_loading(cfg.text)
        enc = adapter.load_text_encoders()
        loaded = [enc.text_encoder, enc.text_encoder_2]
        held = sum(stored_nbytes(h) for m in loaded for block in m.loraflow_block_swap.hosts for h in block) \
            if offload else 0
        on_device = sum(stored_nbytes(p.data) for m in loaded for p in m.parameters())
        for m in loaded if offload else ():  # the swapped layers' placeholders are empty; each encoder's swap keeps
            per = [sum(stored_nbytes(h) for h in block) for block in m.loraflow_block_swap.hosts]  # two layers' copies
            on_device += sum(sorted(per)[-2:])
        assert est["host_held_gb"] * GB == held, quantize
        assert est["weights_gb"] * GB == pytest.approx(on_device, rel=1e-12), quantize  # the same integers


@pytest.mark.parametrize("quantize", ["none", "nf4"])
def test_cache_text_drops_a_language_models_head_and_the_estimate_follows(tmp_path, quantize):
    """tiny_qwenimage's Qwen2.5-VL (a ForConditionalGeneration with its lm_head in the checkpoint): cache_text's
    loader leaves the head out (no weight of it on the device, logits of zero width), the embeddings are the
    full model's bytes, and the preflight's weights are what is loaded (head excluded); the captioner's loading
    (TextLoading.head) keeps it."""
    import dataclasses

    from tasks.models.loading.text_load import load_text_model
    from tasks.training.block_swap import stored_nbytes
    from tasks.training.quantized_base import text_loading

    cfg, adapter = _tiny(tmp_path, "model=tiny_qwenimage", f"text.quantize={quantize}")
    folder = adapter.model_dir / "text_encoder"
    cls = transformers.Qwen2_5_VLForConditionalGeneration
    loading = text_loading(cfg.text)
    enc = load_text_model(cls, folder, torch.float32, loading)
    full = load_text_model(cls, folder, torch.float32, dataclasses.replace(loading, head=True))
    assert "lm_head.weight" in dict(full.named_parameters()) and not any("lm_head" in n for n, _ in enc.named_parameters())
    ids = torch.tensor([[5, 17, 42, 7, 99]])
    out, ref = enc(input_ids=ids, output_hidden_states=True), full(input_ids=ids, output_hidden_states=True)
    assert out.logits.shape[-1] == 0 and ref.logits.shape[-1] == full.config.text_config.vocab_size
    assert all(torch.equal(a, b) for a, b in zip(out.hidden_states, ref.hidden_states))  # the same ops up to the head
    est = run_memory.cache_text(cfg, adapter)
    # the same integers unquantized; NF4: the formula against torchao's tensors (1 %, as the node rows' host figures)
    rel = 1e-12 if quantize == "none" else 0.01
    assert est["weights_gb"] * GB == pytest.approx(sum(stored_nbytes(p.data) for p in enc.parameters()), rel=rel)


def test_every_node_on_a_tiny_model(tmp_path):
    cfg, adapter = _tiny(tmp_path)
    est = run_memory.run_estimate(cfg, adapter, (64, 64))
    assert set(est["nodes"]) == {"cache_latents", "cache_text", "train", "sample"}
    assert est["peak_gb"] == max(n["device_gb"] for n in est["nodes"].values())
    assert all(n["host_gb"] >= run_memory.PROCESS_GB for n in est["nodes"].values())
    # sample.offload: the blocks' weights on the host; tiny_flux has two blocks, so both copies stay on the device
    offloaded = run_memory.sample(updated(cfg, {"sample.offload": True}), adapter, (64, 64))
    assert offloaded["host_held_gb"] > 0 and offloaded["weights_gb"] == est["nodes"]["sample"]["weights_gb"]
    # sample at 1024 px: the decode's activations grow with the pixels, the weights do not
    big = run_memory.sample(cfg, adapter, (64, 64), [{"width": 1024, "height": 1024}])
    assert big["size"] == [1024, 1024, 1] and big["decode_gb"] > 100 * est["nodes"]["sample"]["decode_gb"]


# -- validate's refusal ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def flux_dev(tmp_path_factory):
    """FLUX.1-dev's folder at full size, header-only: transformer, CLIP-L, T5-XXL, VAE (bench.memory_nodes)."""
    from bench.memory_nodes import adapter_for, write_model

    return adapter_for("flux_dev", write_model("flux_dev", tmp_path_factory.mktemp("models")))


def test_a_node_that_does_not_fit_is_refused_naming_what_fits_every_node(flux_dev):
    """A 12 GB card (10.18 GiB with 1 GiB for the CUDA context) and training that fits it: the T5 in bf16 (9.2 GiB)
    fits, the NF4 denoiser in the sample node does not (no block swap there); budget 8 GiB: cache_text does not
    either. One line, each node's figure, the settings that make each fit, which then fit."""
    from bench.family_models import parse, train_config

    cfg = train_config(parse("nf4+ckpt+offload+swap20"), 512, 16)
    for budget, said in ((10.18, ["sample.offload=true"]), (8.0, ["text.quantize=fp8", "sample.offload=true"])):
        train = {"total_gb": 7.0, "host_gb": 3.6, "host_need_gb": 5.5, "budget_gb": budget, "budget_source": "a card"}
        with pytest.raises(ConfigError) as e:
            run_memory.check(cfg, flux_dev, (1024, 1024), (), train)
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith("the run will not fit in memory: ") and "sample about" in msg
        assert ("cache_text about" in msg) == (budget < 9)
        fixes = re.search(r"every node fits with: (.*)$", msg).group(1)
        assert [f.split(" (")[0] for f in fixes.split("; ")] == said, msg
        fixed = updated(cfg, {"sample.offload": True, **({"text.quantize": "fp8"} if budget < 9 else {})})
        assert run_memory.check(fixed, flux_dev, (1024, 1024), (), train)["peak_gb"] <= budget


def test_validate_refuses_before_any_node_and_reports_every_node(tmp_path):
    """Through validate.run on tiny_flux: the report's memory_estimate has each node; with sample prompts at 1024 px
    and a budget the train node fits (train.memory_limit_gb), the sample node's decode does not: one line."""
    from tasks import validate

    cfg, _ = _tiny(tmp_path)
    plan = validate.run(cfg, Store(tmp_path / "store"))
    nodes = plan.memory["nodes"]
    assert set(nodes) == {"cache_latents", "cache_text", "train", "sample"}
    assert plan.memory["run_peak_gb"] == max(n["device_gb"] for n in nodes.values())
    assert nodes["train"]["device_gb"] == plan.memory["total_gb"]  # the train node's estimate, as before
    cfg, _ = _tiny(tmp_path, "sample.width=1024", "sample.height=1024", "train.memory_limit_gb=0.02")
    with pytest.raises(ConfigError) as e:
        validate.run(cfg, Store(tmp_path / "store"))
    msg = str(e.value)
    assert "\n" not in msg and "sample about" in msg and "train.memory_limit_gb" in msg
    assert "will not fit in memory" in msg and not msg.startswith("training")


def test_the_cli_says_one_line_and_exits_2(tmp_path):
    from conftest import cli_env

    done = subprocess.run([sys.executable, "-m", "flows.train", f"data.dir={REPO / 'data' / 'demo'}",
                           f"store.root={tmp_path / 'store'}", f"sample.prompts_file={REPO / 'data' / 'demo_prompts.txt'}",
                           "sample.width=1024", "sample.height=1024", "train.memory_limit_gb=0.02",
                           f"hydra.run.dir={tmp_path / 'run'}"],
                          cwd=REPO, env=cli_env(tmp_path / "prefect"), capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "the run will not fit in memory: sample about" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout


# -- bench.memory's node rows ----------------------------------------------------------------------------------------
def test_a_node_rows_measured_peak_and_its_preflight_agree(tmp_path):
    """FLUX.1-dev's T5 and CLIP in fp8 and its VAE's encode at 1024 px, at full size on fake tensors: the live peak
    the row measures is the committed one, and the preflight (run_memory, from headers) within 10 % of it (the
    issue's promise for the preflight: tolerance.PREFLIGHT_WITHIN)."""
    from bench import memory_nodes

    rows = {r["name"]: r for r in json.loads(MEASURED.read_text())["configs"]}
    for name in ("flux_dev:cache_text:fp8", "flux_dev:cache_latents:untiled"):
        r = memory_nodes.row(name, tmp_path)
        assert r["measured_gib"] == rows[name]["measured_gib"], name  # integer byte counts, one division
        assert r["preflight_gib"] == pytest.approx(rows[name]["preflight_gib"], rel=1e-12), name  # same sums
        assert r["preflight_gib"] == pytest.approx(r["measured_gib"], rel=PREFLIGHT_WITHIN), name


def test_the_committed_node_rows_and_the_whole_runs_cards(tmp_path):
    """Every node row in bench/memory.json: its preflight as the code computes it now, within 10 % of its measured
    peak, its host figure the preflight's (1 %: the NF4 / int8 bytes, formula against torchao's tensors); `cards` the
    whole run's setting per card (each node's), its peak the largest node's."""
    from bench import memory_nodes

    doc = json.loads(MEASURED.read_text())
    rows = {r["name"]: r for r in doc["configs"] if r["name"].count(":") == 2}
    assert set(rows) == set(memory_nodes.NODE_ROWS)
    for name, r in rows.items():
        est = memory_nodes.preflight(name, tmp_path)
        assert est["device_gb"] == pytest.approx(r["preflight_gib"], rel=1e-12), name
        assert r["preflight_gib"] == pytest.approx(r["measured_gib"], rel=PREFLIGHT_WITHIN), name
        assert r["preflight_host_gib"] == pytest.approx(r["host_gib"], rel=0.01, abs=1e-9), name
    for key, per_card in doc["run_cards"].items():
        for card, advice in per_card.items():
            assert doc["cards"][key][card] == memory_nodes.card_text(advice)
            if advice["setting"] is not None:
                assert set(advice["setting"]) == {"train", "cache_text", "sample", "cache_latents"}
                assert advice["peak_gb"] == max(n["device_gb"] for n in advice["nodes"].values())
                assert advice["peak_gb"] <= int(card) * 1e9 / GIB - memory_nodes.MARGIN_GIB
    flux = memory_nodes.run_advice("flux_dev", tmp_path, 12)
    assert memory_nodes.card_text(flux) == doc["cards"]["flux_dev"]["12"]
