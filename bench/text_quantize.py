"""How far text.quantize moves the text embeddings (issue 61 item 1): each encoder loaded as cache_text loads it
(tasks/models/loading/text_load.py: load_text_model with text.quantize's TextLoading, bf16 compute) against the
unquantized bf16 encoder, on the output its family's pipeline uses.

    python -m bench.text_quantize [--out bench/text_quantize.json] [--parts real,tiny] [--encoders t5_xxl,...]

Two parts:
- real: each encoder of bench/text_encoder_configs.py at its real widths and vocabulary, at reduced depth (DEPTH
  layers; vision towers 1 layer, unused by text), random weights from the model's own initialisation
  (`_init_weights`, the config's initializer_range) seeded, built in bf16 and saved with save_pretrained into a
  temporary folder; the reference is that in-memory bf16 model's output, the rows load the folder with
  load_text_model per text.quantize. Inputs: random token ids in the vocabulary (no tokenizer offline), BATCH
  sequences of TOKENS tokens without padding (CLIP: bos, 20 / 60 ids, eos, eos-padded to 77, so its pooled
  output reads a real eos). The output the pipeline takes (OUTPUTS): at reduced depth, hidden-state indices are
  scaled (FLUX.2 [dev]'s layers 10, 20, 30 of 40 -> 1, 2, 3 of 4).
- tiny: the tiny families' folders (tasks.models.build_tiny), their text encoders loaded through the adapter
  (pretrained_text_encoder, text_loading) in bf16 and the adapter's own encode_text on demo captions (one with
  a quoted glyph text for HunyuanVideo 1.5's ByT5): every float tensor the cache stores, against `none`.

Per output: rel L2 = |q - r| / |r| over the whole tensor, and the cosine between q and r per token (per row for
pooled outputs): mean and minimum over the tokens whose reference is not zero. Random weights show how the
storage's rounding propagates through each architecture; trained weights have outliers that random ones lack,
and the full depth compounds more layers than the real part runs. Run with ATEN_CPU_CAPABILITY=avx2
ONEDNN_MAX_CPU_ISA=AVX2 HF_HUB_OFFLINE=1 for numbers that hold on any x86."""
from __future__ import annotations

import argparse
import gc
import json
import math
import shutil
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
KINDS = ("none", "fp8", "int8", "nf4")
BATCH, TOKENS = 2, 64
# layers of each encoder's text model in the real part: enough for the hidden states its pipeline reads
DEPTH = {"clip_l": 2, "clip_g": 2, "t5_xxl": 2, "umt5_xxl": 2, "byt5_small": 2, "mistral_small_3_1": 4,
         "qwen2_5_vl_7b": 3, "gemma3_12b": 2, "qwen3_4b": 2}
# encoder -> [(output, who reads it)]; output names are _outputs' keys
OUTPUTS = {
    "clip_l": [("pooler_output", "FLUX.1"), ("hidden_states[-2]", "SD3, SDXL")],
    "clip_g": [("text_embeds", "SD3, SDXL (pooled)"), ("hidden_states[-2]", "SD3, SDXL")],
    "t5_xxl": [("last_hidden_state", "FLUX.1, SD3")],
    "umt5_xxl": [("last_hidden_state", "Wan 2.1 / 2.2")],
    "byt5_small": [("last_hidden_state", "HunyuanVideo 1.5 (glyphs)")],
    "mistral_small_3_1": [("hidden_states[10,20,30] stacked", "FLUX.2 [dev]")],
    "qwen2_5_vl_7b": [("hidden_states[-1]", "Qwen-Image"), ("hidden_states[-3]", "HunyuanVideo 1.5")],
    "gemma3_12b": [("all hidden_states stacked", "LTX-2")],
    "qwen3_4b": [("hidden_states[-2]", "Z-Image")],
}
TINY = ("flux", "sd3", "sdxl", "zimage", "qwenimage", "flux2_dev", "wan", "ltx2", "hunyuan_video15")


def drift(ref, out) -> dict:
    """rel L2 over the whole tensor; cosine per token (last dim) over the tokens whose reference is not zero."""
    import torch

    r, q = ref.detach().float().reshape(-1, ref.shape[-1]), out.detach().float().reshape(-1, ref.shape[-1])
    norm = r.norm()
    live = r.norm(dim=-1) > 0
    cos = torch.nn.functional.cosine_similarity(q[live], r[live], dim=-1).clamp(-1, 1)
    return {"rel_l2": float((q - r).norm() / norm) if norm > 0 else math.nan,
            "cosine": float(cos.mean()) if len(cos) else math.nan,
            "min_cosine": float(cos.min()) if len(cos) else math.nan, "tokens": int(live.sum())}


def _shallow(cfg, depth: int):
    """The config with `depth` layers in its text model (the last `depth` layer types: Gemma 3's global layer
    kept) and one in its vision tower."""
    text = getattr(cfg, "text_config", cfg)
    for attr in ("num_hidden_layers", "num_layers"):
        if hasattr(text, attr):
            setattr(text, attr, depth)
    if getattr(text, "layer_types", None):
        text.layer_types = list(text.layer_types)[-depth:]
    if hasattr(text, "max_window_layers"):
        text.max_window_layers = min(text.max_window_layers, depth)
    vision = getattr(cfg, "vision_config", None)
    if vision is not None:
        for attr in ("num_hidden_layers", "depth"):
            if hasattr(vision, attr):
                setattr(vision, attr, 1)
        if hasattr(vision, "fullatt_block_indexes"):
            vision.fullatt_block_indexes = [0]
    return cfg


def _inputs(name: str, cfg, seed: int = 1):
    """(input_ids [BATCH, L], attention_mask): random ids in the vocabulary, as described in the module doc."""
    import torch

    g = torch.Generator().manual_seed(seed)
    text = getattr(cfg, "text_config", cfg)
    vocab = text.vocab_size
    if name.startswith("clip"):  # bos, ids, eos, eos-padded to 77 (the pooled output reads the eos: argmax id)
        ids = torch.full((BATCH, 77), 49407)
        for i, n in enumerate((20, 60)[:BATCH]):
            ids[i, 0] = 49406
            ids[i, 1:n + 1] = torch.randint(0, 49406, (n,), generator=g)
        return ids, torch.ones_like(ids)
    if name in ("t5_xxl", "umt5_xxl", "byt5_small"):  # ids past the special ones, then eos (1)
        ids = torch.randint(3 if name == "byt5_small" else 10, min(vocab, 32000) if name == "t5_xxl" else vocab - 200,
                            (BATCH, TOKENS), generator=g)
        ids[:, -1] = 1
        return ids, torch.ones_like(ids)
    # the decoders: ids in the ordinary text range (below every vision / special token of these vocabularies)
    ids = torch.randint(1000, min(vocab, 100000), (BATCH, TOKENS), generator=g)
    return ids, torch.ones_like(ids)


def _outputs(name: str, model, ids, mask, depth: int) -> dict:
    """{output name: tensor} as OUTPUTS names them."""
    import torch

    with torch.no_grad():
        if name.startswith("clip"):
            out = model(ids, output_hidden_states=True)
            first = "pooler_output" if name == "clip_l" else "text_embeds"
            return {first: getattr(out, first), "hidden_states[-2]": out.hidden_states[-2]}
        if name in ("t5_xxl", "umt5_xxl", "byt5_small"):
            return {"last_hidden_state": model(input_ids=ids, attention_mask=mask).last_hidden_state}
        kwargs = {} if name == "qwen3_4b" else {"logits_to_keep": 1, "use_cache": False}  # the lm_head's logits unused
        hs = model(input_ids=ids, attention_mask=mask, output_hidden_states=True, **kwargs).hidden_states
    if name == "mistral_small_3_1":  # Flux2Pipeline: layers (10, 20, 30) of 40, stacked per token
        layers = [round(k * depth / 40) for k in (10, 20, 30)]
        return {"hidden_states[10,20,30] stacked": torch.cat([hs[k] for k in layers], dim=-1)}
    if name == "qwen2_5_vl_7b":
        return {"hidden_states[-1]": hs[-1], "hidden_states[-3]": hs[-3]}
    if name == "gemma3_12b":  # LTX2Pipeline: every hidden state stacked, flattened per token
        return {"all hidden_states stacked": torch.stack(hs, dim=-1).flatten(2, 3)}
    return {"hidden_states[-2]": hs[-2]}  # Z-Image


def _loading(kind: str):
    from types import SimpleNamespace

    from tasks.training.quantized_base import text_loading

    return text_loading(SimpleNamespace(quantize=kind, offload=False))


def measure_real(name: str, kinds=KINDS[1:], work: Path | None = None, depth: int | None = None) -> list[dict]:
    """The real-architecture rows of encoder `name`: built at reduced depth, saved, loaded per kind."""
    import torch

    from bench.text_encoder_configs import config, model_class
    from tasks.models.loading.text_load import load_text_model

    depth = depth or DEPTH[name]
    cfg, cls = _shallow(config(name), depth), model_class(name)
    t0 = time.perf_counter()
    torch.manual_seed(0)
    model = cls._from_config(cfg, dtype=torch.bfloat16).eval()  # the model's own _init_weights, seeded
    params = sum(p.numel() for p in model.parameters())
    ids, mask = _inputs(name, cfg)
    reference = _outputs(name, model, ids, mask, depth)
    folder = Path(tempfile.mkdtemp(prefix=f"tq_{name}_", dir=work))
    try:
        model.save_pretrained(folder, max_shard_size="1GB")
        del model
        gc.collect()
        rows = []
        for kind in kinds:
            t = time.perf_counter()
            loaded = load_text_model(cls, folder, torch.bfloat16, _loading(kind))
            out = _outputs(name, loaded, ids, mask, depth)
            del loaded
            gc.collect()
            for output, users in OUTPUTS[name]:
                rows.append({"part": "real", "encoder": name, "class": cls.__name__, "depth": depth,
                             "params": params, "output": output, "used_by": users, "quantize": kind,
                             "tokens_shape": list(ids.shape), **drift(reference[output], out[output]),
                             "seconds": time.perf_counter() - t})
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    for r in rows:
        r["encoder_seconds"] = time.perf_counter() - t0
    return rows


def _captions() -> list[str]:
    demo = sorted((REPO / "data" / "demo").glob("*.txt"))[:3]
    return [p.read_text().strip() for p in demo] + ['a sign that reads "OPEN" on a red door']


def measure_tiny(family: str, kinds=KINDS, work: Path | None = None) -> list[dict]:
    """The tiny family's cached text tensors per text.quantize against `none` (the adapter's encode_text)."""
    import torch
    from omegaconf import OmegaConf

    from tasks.models import adapter_class, build_tiny

    folder = Path(tempfile.mkdtemp(prefix=f"tq_tiny_{family}_", dir=work)) / family
    try:
        build_tiny(family, folder, 0, {})
        length = int(OmegaConf.load(REPO / "conf" / "model" / f"tiny_{family}.yaml").max_sequence_length)
        adapter = adapter_class(family)(folder, "bfloat16", length)
        texts, outs = _captions(), {}
        for kind in ("none", *[k for k in kinds if k != "none"]):
            adapter.text_loading = _loading(kind)
            encoders = adapter.load_text_encoders()
            items = adapter.encode_text(encoders, texts)
            del encoders
            outs[kind] = {k: torch.stack([it[k] for it in items]) for k, v in items[0].items()
                          if v.is_floating_point() and "mask" not in k}  # HunyuanVideo 1.5 stores float masks
        rows = []
        for kind in kinds:
            for output, ref in outs["none"].items():
                rows.append({"part": "tiny", "family": family, "output": output, "quantize": kind,
                             "shape": list(ref.shape), **drift(ref, outs[kind][output])})
        return rows
    finally:
        shutil.rmtree(folder.parent, ignore_errors=True)


def _line(r: dict) -> str:
    who = f"{r['encoder']} ({r['depth']} layers)" if r["part"] == "real" else f"tiny {r['family']}"
    return f"  {who:<30} {r['output']:<34} {r['quantize']:<5} rel L2 {r['rel_l2']:.4f}  cos {r['cosine']:.5f} " \
           f"(min {r['min_cosine']:.5f})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.text_quantize", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(HERE / "text_quantize.json"))
    ap.add_argument("--parts", default="tiny,real")
    ap.add_argument("--encoders", default=",".join(DEPTH), help="the real part's encoders (bench/text_encoder_configs.py)")
    ap.add_argument("--families", default=",".join(TINY), help="the tiny part's families")
    ap.add_argument("--kinds", default="fp8,int8,nf4", help="the real part's kinds (the tiny part adds none)")
    args = ap.parse_args(argv)
    import torch

    from bench.common import machine_info, versions

    t0, rows, out = time.perf_counter(), [], Path(args.out)
    doc = {"machine": machine_info(), "versions": versions(), "batch": BATCH, "tokens": TOKENS, "depth": DEPTH,
           "compute_dtype": "bfloat16", "inputs": "real part: random token ids in each vocabulary (no tokenizer "
           "offline); tiny part: the tiny tokenizers on demo captions", "rows": rows}
    parts, kinds = args.parts.split(","), args.kinds.split(",")
    jobs = [("tiny", f) for f in args.families.split(",") if "tiny" in parts] + \
           [("real", e) for e in args.encoders.split(",") if "real" in parts]
    done = {job for job in jobs}
    previous = json.loads(out.read_text()).get("rows", []) if out.exists() else []
    keep = [r for r in previous if (r["part"], r.get("family") or r.get("encoder")) not in done]
    for part, name in jobs:
        t = time.perf_counter()
        new = measure_tiny(name) if part == "tiny" else measure_real(name, kinds)
        rows += new
        for r in new:
            if r["quantize"] != "none":
                print(_line(r), flush=True)
        print(f"  ({part} {name}: {time.perf_counter() - t:.0f} s)", flush=True)
        doc["rows"] = keep + rows  # after every encoder / family: an interrupted run keeps what it measured
        doc["total_seconds"] = time.perf_counter() - t0
        out.write_text(json.dumps(doc, indent=1) + "\n")
    doc["rows"], doc["total_seconds"] = keep + rows, time.perf_counter() - t0
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out} in {doc['total_seconds']:.0f} s; torch {torch.__version__}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
