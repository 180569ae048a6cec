"""The other nodes' memory (issue 61): rows `<model>:<node>:<options>` of `python -m bench.memory --nodes`, and the
whole run's setting per card (`cards`), at the real configs of the full-size models: their text encoders
(bench/text_encoder_configs.py), VAEs and denoisers, as each family declares them (RealSize, bench/family_models.py).

    python -m bench.memory --nodes [--only flux2_dev:cache_text:nf4,...]

Rows (NODE_ROWS): cache_text `bf16|fp8|int8|nf4` (text.quantize; bf16 = none) `+offload` (text.offload); sample
`bf16|fp8|int8|nf4` (model.quantize) `+offload` (sample.offload); cache_latents `untiled|tiled` (data.vae_tiling).
Per row, as the train rows have them:
- measured_gib: the weights as the node stores them on the device (each torchao tensor's own bytes: quantized here
  from real random values, at the real row count or a power-of-two fraction of it times that fraction where a
  weight has over 64 M elements: its bytes are linear in its rows), plus the live peak of the node's real forward
  on fake tensors at full size (bench/memory_peak.py's LivePeak: each op's output storage from its creation to
  its death): the encoders' forward at 512 tokens (CLIP's 77) with each stored Linear's dequantize added at its
  upcast (bench.memory_peak.transient_upcast), the denoiser's inference forward (no grad, its LoRA at rank 16) and
  the VAE's decode at the training size, the VAE's encode (diffusers' tiling where tiled). With an offload the
  device holds the layers' copies the block swap makes, two layers at most (block_swap.BlockSwap): those are
  counted from the module tree, not run (the swap does not run on fake tensors).
- preflight_gib: tasks/run_memory.py's estimate for the same settings from a header-only model folder, as validate
  computes it; host_gib: what waits in host memory (the swapped weights), measured; preflight_host_gib the
  preflight's; host_need_gib the preflight's RAM need with the process and loading.
Cards: the whole run's first setting per node (each node's ladder, least change first) whose preflight leaves
MARGIN_GIB free on a card of N GB; its peak is the largest node's; with `ram` the host RAM bounds each node too."""
from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

from bench.family_models import declared, geometry, model_table, parse, random_adapter, train_config

GIB = 1 << 30
TEXT_LEN = 512


def real(model: str):
    """The model's RealSize: its VAE, encoders and other folders, as its family declares them."""
    return declared()[model][1]


# the node rows are those of the models with a whole-run goal (RealSize.card)
NODE_MODELS = tuple(name for name, (_, rs) in declared().items() if rs.card)
NODE_ROWS = tuple(f"{m}:{node}:{o}" for m in NODE_MODELS for node, opts in (
    ("cache_text", ("bf16", "fp8", "int8", "nf4", "bf16+offload", "nf4+offload")),
    ("sample", ("bf16", "fp8", "int8", "nf4", "nf4+offload")),
    ("cache_latents", ("untiled", "tiled"))) for o in opts)
CARDS = (12, 16, 24, 48, 80)
MARGIN_GIB = 1.0  # bench.memory_families': the CUDA context and fragmentation
TEXT_LADDER = ("bf16", "fp8", "int8", "nf4", "bf16+offload", "fp8+offload", "int8+offload", "nf4+offload")
# The whole run's goals (card GB, host RAM GB; issue 61 item 6 and each family's own)
GOALS = {name: rs.card for name, (_, rs) in declared().items() if rs.card}


# -- the model folder ------------------------------------------------------------------------------------------------
def _write(module, sub: Path, config: dict) -> None:
    """config.json and a header-only safetensors file of the module's bf16 shapes (tied weights once)."""
    sub.mkdir(parents=True, exist_ok=True)
    sub.joinpath("config.json").write_text(json.dumps(config, default=list))
    header, offset = {}, 0
    for name, t in module.named_parameters():  # a tied weight under its first name, as save_pretrained writes it
        n = t.numel() * 2
        header[name] = {"dtype": "BF16", "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    file = "diffusion_pytorch_model.safetensors" if "_class_name" in config else "model.safetensors"
    sub.joinpath(file).write_bytes(len(raw).to_bytes(8, "little") + raw)


def vae(model: str, device: str = "meta"):
    import diffusers
    import torch

    cls, arch = real(model).vae
    with torch.device(device):
        return getattr(diffusers, cls)(**arch).to(torch.bfloat16).eval().requires_grad_(False)


def write_model(model: str, root: Path) -> Path:
    """A header-only model folder of `model`: transformer (+ transformer_2), text encoders, VAE, the rest."""
    import torch

    from bench.fake_step import model_headers
    from bench.text_encoder_configs import build

    folder = Path(root) / model
    if (folder / "vae" / "config.json").exists():
        return folder
    adapter, _, _ = random_adapter(model, torch.device("meta"))
    den = adapter.load_denoiser()
    model_headers(den, folder)
    for sub in real(model).denoisers[1:]:  # Wan 2.2 A14B's second expert, Ideogram 4's unconditional transformer
        model_headers(den, folder / "_2")
        (folder / "_2" / "transformer").rename(folder / sub)
        (folder / "_2").rmdir()
    for sub, name in (*real(model).text, *real(model).image_encoders):
        enc = build(name)
        _write(enc, folder / sub, {**enc.config.to_dict(), "architectures": [type(enc).__name__]})
    for sub, ref in real(model).modules:  # other modules at their class defaults (LTX-2's text connectors)
        import importlib

        module, name = ref.split(":")
        with torch.device("meta"):
            m = getattr(importlib.import_module(module), name)()
        _write(m, folder / sub, {**dict(m.config), "_class_name": name})
    v = vae(model)
    _write(v, folder / "vae", {**dict(v.config), "_class_name": type(v).__name__})
    return folder


def adapter_for(model: str, folder: Path):
    """The family's adapter on the header-only folder (as validate makes it on a real one)."""
    import importlib

    module, name = model_table()[model][0].split(":")
    return getattr(importlib.import_module(module), name)(folder, "bfloat16", TEXT_LEN)


# -- settings --------------------------------------------------------------------------------------------------------
def node_config(model: str, node: str, options: str):
    """The run's config for a node row: the train node's bf16+ckpt, the sample rows' model.quantize their own."""
    from tasks.config import updated

    parts = options.split("+")
    store = parts[0] if node == "sample" else "bf16"
    cfg = train_config({"store": store, "ckpt": True, "swap": 0, "offload": False}, TEXT_LEN, 16, geometry(model, 1024)[1])
    changes = {"cache_text": {"text.quantize": "none" if parts[0] == "bf16" else parts[0], "text.offload": "offload" in parts},
               "sample": {"sample.offload": "offload" in parts},
               "cache_latents": {"data.vae_tiling": parts[0]}}[node]
    return updated(cfg, changes)


def preflight(name: str, root: Path, train: dict | None = None) -> dict:
    """tasks/run_memory.py's estimate of row `name`'s node, as validate computes it."""
    from tasks import run_memory

    model, node, options = name.split(":")
    folder = write_model(model, root)
    cfg = node_config(model, node, options)
    adapter = adapter_for(model, folder)
    size = geometry(model, 1024)[0]
    if node == "cache_text":
        return run_memory.cache_text(cfg, adapter)
    if node == "sample":
        return run_memory.sample(cfg, adapter, size)
    return run_memory.cache_latents(cfg, adapter, size, None)


# -- measured --------------------------------------------------------------------------------------------------------
def stored_nbytes(shape: tuple, kind: str) -> int:
    """Bytes of torchao's tensor for a bf16 weight of this shape (family_models.quantized_bytes), a big one's from a
    power-of-two fraction of its rows (its bytes are linear in the rows: int8's per-row scale, NF4's blocks)."""
    from bench.family_models import quantized_bytes

    if kind == "fp8":
        return shape[0] * shape[1]
    k = 1
    while shape[0] % (2 * k) == 0 and shape[0] * shape[1] // k > 64 << 20:
        k *= 2
    return k * quantized_bytes((shape[0] // k, shape[1]), kind)


def _layers(model) -> list:
    """block_swap.swap_every_layer's layers: the children of the outermost ModuleLists."""
    import torch

    named = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.ModuleList)]
    return [layer for n, m in named if not any(n.startswith(o + ".") for o, _ in named) for layer in m]


def _stored_sizes(model, kind: str, linears, unstored=()) -> dict[int, int]:
    """id(parameter) -> bytes on the device as stored: each Linear in `linears` as `kind`, the rest bf16."""
    out = {}
    for path, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            size = p.numel() * 2
            if name == "weight" and id(module) in linears and kind != "bf16" and path not in unstored:
                size = stored_nbytes(tuple(p.shape), kind)
            out[id(p)] = size
    return out


def _offload(model, layers, sizes) -> tuple[int, int]:
    """(bytes the host holds, device copies of the two largest layers) of the swapped layers' Linear / Conv weights."""
    from tasks.training.fp8_base import CASTABLE

    per = [sum(sizes.get(id(m.weight), 0) for m in layer.modules() if isinstance(m, CASTABLE)) for layer in layers]
    return sum(per), sum(sorted(per)[-2:])


def _fake_peak(module, run, kinds_of=None) -> int:
    """The live peak of `run()` over `module` made fake, its parameters and buffers not counted."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from bench.fake_step import to_fake
    from bench.memory_peak import LivePeak, transient_upcast

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    to_fake(module, [], mode)
    tracker = LivePeak()
    kinds = kinds_of(module) if kinds_of else {}
    with mode, transient_upcast(tracker, kinds):
        tracker.ignore([*module.parameters(), *module.buffers()])
        with torch.no_grad():
            inputs = run(None)
            tracker.ignore([t for t in inputs.values() if torch.is_tensor(t)])
            with tracker:
                run(inputs)
    return tracker.peak


def measure_text(model: str, options: str) -> dict:
    """cache_text: every encoder stored and placed as the options say, the largest forward on top."""
    import torch

    from bench.text_encoder_configs import build
    from tasks.models.loading.text_load import drop_head
    from tasks.training.fp8_base import HOOK_NAME, StorageCastHook
    from diffusers.hooks import HookRegistry

    parts = options.split("+")
    kind, offload = parts[0], "offload" in parts
    weights = held = peak = 0
    for _, name in real(model).text:
        enc = build(name)
        drop_head(enc)  # as cache_text loads it (text_load.TextLoading.head)
        unstored = set()
        if kind == "fp8":  # text_load._unstored: transformers' fp32 modules stay in the compute dtype
            unstored = {p for p, _ in enc.named_modules() if any(p == k or p.endswith("." + k) for k in enc._keep_in_fp32_modules or ())}
        linears = {id(m) for p, m in enc.named_modules() if type(m) is torch.nn.Linear and p not in unstored}
        sizes = _stored_sizes(enc, kind, linears)
        total = sum(sizes.values())
        if offload:
            host, copies = _offload(enc, _layers(enc), sizes)
            total, held = total - host + copies, held + host
        weights += total
        if kind != "bf16":  # fp8_base's hook (its cast runs on the fake weights; the dequantize's inside is added)
            for m in (m for m in enc.modules() if id(m) in linears):
                HookRegistry.check_if_exists_or_initialize(m).register_hook(
                    StorageCastHook(torch.float8_e4m3fn, torch.bfloat16), HOOK_NAME)
        peak = max(peak, _fake_peak(enc, _text_forward(enc), lambda e: {
            id(m.weight): (kind, 0, p) for p, m in e.named_modules() if id(m) in linears} if kind != "bf16" else {}))
    return {"device": weights + peak, "host": held, "activations": peak}


def _text_forward(enc):
    import torch

    kind = enc.config.model_type
    tokens = min(TEXT_LEN, getattr(enc.config, "max_position_embeddings", TEXT_LEN)) if kind.startswith("clip") else TEXT_LEN

    def run(inputs):
        if inputs is None:
            ids = {"input_ids": torch.zeros(1, tokens, dtype=torch.long)}
            if not (kind.startswith("clip") or kind in ("t5", "umt5")):  # the pipelines' decoder LMs: all states
                ids.update(attention_mask=torch.ones(1, tokens, dtype=torch.long), output_hidden_states=True)
            return ids
        out = enc(**inputs)
        del out
    return run


def measure_latents(model: str, options: str) -> dict:
    import torch

    v = vae(model)
    if options == "tiled":
        v.enable_tiling()
    weights = sum(p.numel() * 2 for p in v.parameters())
    (w, h), frames = geometry(model, 1024)
    video = type(v).__name__ not in ("AutoencoderKL", "AutoencoderKLFlux2")
    # RGB, or RGBA where the encoder takes 4 unpatched channels (Qwen-Image 2.1's VAE: its adapter adds the alpha)
    c = v.config.in_channels if getattr(v.config, "in_channels", 3) == 4 and not getattr(v.config, "patch_size", None) else 3
    shape = (1, c, frames, h, w) if video else (1, c, h, w)
    pixels = c * w * h * frames * 2

    def run(inputs):
        if inputs is None:
            return {"x": torch.zeros(*shape, dtype=torch.bfloat16)}
        v.encode(inputs["x"]).latent_dist.mode()
    return {"device": weights + pixels + _fake_peak(v, run), "host": 0}


def decode_peak(model: str, w: int, h: int, frames: int) -> tuple[int, int]:
    """(VAE weights, its decode's live peak) at this size."""
    import torch

    v = vae(model)
    weights = sum(p.numel() * 2 for p in v.parameters())
    name = type(v).__name__
    if name in ("AutoencoderKL", "AutoencoderKLFlux2"):
        shape = (1, v.config.latent_channels, h // 8, w // 8)
    elif name == "AutoencoderKLLTX2Video":
        shape = (1, v.config.latent_channels, 1 + (frames - 1) // 8, h // 32, w // 32)
    else:  # the Wan VAEs' names, else HunyuanVideo's (latent_channels, spatial_compression_ratio); /4 in time each
        s = getattr(v.config, "scale_factor_spatial", None) or getattr(v.config, "spatial_compression_ratio", 8)
        c = getattr(v.config, "z_dim", None) or v.config.latent_channels
        shape = (1, c, 1 + (frames - 1) // 4, h // s, w // s)

    def run(inputs):
        if inputs is None:
            return {"z": torch.zeros(*shape, dtype=torch.bfloat16)}
        v.decode(inputs["z"]).sample
    return weights, _fake_peak(v, run)


def measure_sample(model: str, options: str) -> dict:
    """sample: the denoiser stored as model.quantize with its LoRA (bf16, as the pipeline's loader makes it), the
    VAE; the larger of the inference forward (with the dequantize) and the decode."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.hooks import HookRegistry

    from bench.family_models import batch_inputs
    from bench.flux_train import TRAIN_CFG
    from tasks.training.block_swap import blocks
    from tasks.training.fp8_base import HOOK_NAME
    from tasks.training.train_setup import prepare_denoiser

    parts = options.split("+")
    kind, offload = parts[0], "offload" in parts
    adapter, _, _ = random_adapter(model, torch.device("meta"))
    stored = kind != "bf16"
    den, named = prepare_denoiser(adapter, train_config({"store": "fp8" if stored else "bf16", "ckpt": False,
                                                         "swap": 0, "offload": False}, TEXT_LEN, 16))
    den.eval()
    for p in named.values():  # the pipeline's loader makes the LoRA in the compute dtype
        p.data = p.data.to(torch.bfloat16)
    lora = {id(p) for p in named.values()}
    hooked = {id(m) for m in den.modules() if hasattr(m, "weight") and isinstance(m, torch.nn.Linear)
              and HookRegistry.check_if_exists_or_initialize(m).get_hook(HOOK_NAME) is not None}
    sizes = {k: v for k, v in _stored_sizes(den, kind if kind in ("int8", "nf4") else "bf16", hooked).items()
             if k not in lora}
    if kind == "fp8":  # the fp8 hooks stored the weights at 1 byte already
        sizes = {id(p): p.numel() * p.element_size() for p in den.parameters() if id(p) not in lora}
    base, held = sum(sizes.values()), 0
    if offload:
        host, copies = _offload(den, blocks(den, adapter.swap_blocks), sizes)
        base, held = base - host + copies, host
    n = max(len(real(model).denoisers), 1)  # the pipeline's denoisers, stored alike (Ideogram 4's unconditional one:
    base, held = base * n, held * n  # the same architecture), run one after the other: one forward's peak
    lora_bytes = sum(p.numel() for p in named.values()) * 2
    scheduler = FlowMatchEulerDiscreteScheduler()
    (w, h), frames = geometry(model, 1024)

    def run(inputs):
        if inputs is None:
            latents, text = batch_inputs(model, dict(den.config), 1024, TEXT_LEN)
            return {"latents": latents, **text}
        text = {k: v for k, v in inputs.items() if k != "latents"}
        with torch.autocast("cpu", dtype=torch.bfloat16):
            adapter.training_loss(den, inputs["latents"], text, TRAIN_CFG, scheduler, [torch.Generator().manual_seed(0)])

    forward = _fake_peak(den, run, lambda d: {id(m.weight): (kind, 0, p) for p, m in d.named_modules()
                                              if id(m) in hooked} if stored else {})
    vae_bytes, decode = decode_peak(model, w, h, frames)
    return {"device": base + lora_bytes + vae_bytes + max(forward, decode), "host": held, "forward": forward,
            "decode": decode}


MEASURE = {"cache_text": measure_text, "sample": measure_sample, "cache_latents": measure_latents}


def row(name: str, root: Path) -> dict:
    t0 = time.perf_counter()
    model, node, options = name.split(":")
    m = MEASURE[node](model, options)
    est = preflight(name, root)
    measured = m["device"] / GIB
    return {"name": name, "node": node, "measured_gib": measured, "preflight_gib": est["device_gb"],
            "estimate_error": est["device_gb"] / measured - 1, "host_gib": m["host"] / GIB,
            "preflight_host_gib": est["host_held_gb"], "host_need_gib": est["host_gb"], "setting": est["setting"],
            **({"forward_gib": m["forward"] / GIB, "decode_gib": m["decode"] / GIB} if "forward" in m else {}),
            "size": list(geometry(model, 1024)[0]), "frames": geometry(model, 1024)[1], "text_tokens": TEXT_LEN,
            "seconds": time.perf_counter() - t0}


# -- the whole run per card ------------------------------------------------------------------------------------------
def run_advice(model: str, root: Path, card_gb: int, copies: int = 1, ram_gb: float | None = None, ladder=None) -> dict:
    """Each node's first setting (its ladder) whose preflight leaves MARGIN_GIB free on the card (and fits `ram_gb`
    of host RAM): {"setting": {node: options}, "nodes": {node: (device, host)}, "peak_gb", "host_gb"} or, where a
    node fits nothing, {"setting": None, "stuck": node}."""
    from bench.memory_families import LADDER
    from tasks import run_memory
    from tasks.config import updated
    from tasks.training.host_memory import host_need
    from tasks.training.memory import block_order, estimate, family_factors, header_shapes, lora_targets

    folder = write_model(model, root)
    adapter = adapter_for(model, folder)
    budget = card_gb * 1e9 / GIB - MARGIN_GIB
    size, frames = geometry(model, 1024)
    shapes = header_shapes(folder / "transformer")
    loading = max(n * 6 for n in (_numel(s) for s in shapes.values())) / GIB  # a bf16 tensor read and its fp32 copy
    n_blocks = copies * len(block_order(shapes, adapter.swap_blocks))
    ok = lambda e: e["device_gb"] <= budget and (ram_gb is None or e["host_gb"] <= ram_gb)  # noqa: E731
    out, cfg = {"setting": {}, "nodes": {}}, None
    for options in ladder or [*LADDER, *(f"nf4+ckpt+offload+swap{n}" for n in range(1, n_blocks + 1))]:  # `ladder`: fsdp
        c = train_config(parse(options), TEXT_LEN, 16, frames)
        est = estimate(c, folder, "transformer", lora_targets(c.train, adapter), size, TEXT_LEN,
                       adapter.denoiser_cls, adapter.swap_blocks, copies, geometry=adapter.activation_geometry,
                       factors=family_factors(adapter))
        node = {"device_gb": est["total_gb"], "host_gb": host_need(c, est, loading)["host_need_gb"]}  # fsdp: the machine
        if ok(node):
            out["setting"]["train"], out["nodes"]["train"], cfg = options, node, c
            break
    if cfg is None:
        return {"setting": None, "stuck": "train"}
    ladders = {"cache_text": [(o, {"text.quantize": "none" if o.split("+")[0] == "bf16" else o.split("+")[0],
                                   "text.offload": "offload" in o}) for o in TEXT_LADDER],
               "sample": [(f"{cfg.model.quantize.replace('none', 'bf16')}{off}", {"sample.offload": bool(off)})
                          for off in ("", "+offload")],
               "cache_latents": [(t, {"data.vae_tiling": t}) for t in ("untiled", "tiled")]}
    for node, ladder in ladders.items():
        for options, change in ladder:
            c = updated(cfg, change)
            est = {"cache_text": lambda: run_memory.cache_text(c, adapter),
                   "sample": lambda: run_memory.sample(c, adapter, size),
                   "cache_latents": lambda: run_memory.cache_latents(c, adapter, size, None)}[node]()
            if ok(est):
                out["setting"][node], out["nodes"][node] = options, {k: est[k] for k in ("device_gb", "host_gb")}
                break
        else:
            return {"setting": None, "stuck": node}
    out["peak_gb"] = max(n["device_gb"] for n in out["nodes"].values())
    out["host_gb"] = max(n["host_gb"] for n in out["nodes"].values())
    return out


def card_text(advice: dict) -> str:
    """`cards`' string: "<setting> (<GiB> GiB)", the setting each node's ("train: nf4+ckpt; cache_text: nf4; ...")."""
    if advice["setting"] is None:
        return f"does not fit ({advice['stuck']})"
    said = "; ".join(f"{n}: {advice['setting'][n]}" for n in ("train", "cache_text", "sample", "cache_latents"))
    return f"{said} ({advice['peak_gb']:.1f} GiB)"


def _numel(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def cards(root: Path) -> tuple[dict, dict]:
    """(`cards`, `run_cards`): the whole run's setting per card for every card-table row, and its figures."""
    from bench.memory_families import CARD_ROWS

    full = {key: {str(c): run_advice(m, root, c, n) for c in CARDS} for key, m, n in CARD_ROWS}
    return {k: {c: card_text(a) for c, a in v.items()} for k, v in full.items()}, full


def goals(root: Path) -> dict:
    """Item 6: each goal's card and RAM, the whole run's setting that fits both, or what stops it."""
    out = {}
    for model, (card, ram) in GOALS.items():
        a = run_advice(model, root, card, ram_gb=ram * 1e9 / GIB)
        out[model] = {"card_gb": card, "ram_gb": ram, "reached": a["setting"] is not None, **a}
        if a["setting"] is None:  # what it needs without the RAM bound
            out[model]["without_ram"] = run_advice(model, root, card)
    return out


def main(out: Path, only: str | None) -> int:
    """The node rows (all, or `only`'s with two colons) merged by name into `out`; cards and goals rewritten."""
    import tempfile

    names = [n for n in only.split(",") if n.count(":") == 2] if only else list(NODE_ROWS)
    t0 = time.perf_counter()
    doc = json.loads(out.read_text()) if out.exists() else {"configs": []}
    with tempfile.TemporaryDirectory() as tmp:
        new = []
        for name in names:
            new.append(row(name, Path(tmp)))
            r = new[-1]
            print(f"  {name:<34} measured {r['measured_gib']:6.2f} GiB  preflight {r['preflight_gib']:6.2f} GiB "
                  f"({r['estimate_error'] * 100:+.1f} %)  host {r['host_gib']:5.2f} GiB  {r['seconds']:.1f} s", flush=True)
            with contextlib.suppress(Exception):
                from bench.family_models import quantized_bytes
                quantized_bytes.cache_clear()
        doc["configs"] = [r for r in doc.get("configs", []) if r["name"] not in {n["name"] for n in new}] + new
        doc["cards"], doc["run_cards"] = cards(Path(tmp))
        from bench.memory_families import CARD_ROWS, advice

        doc["train_cards"] = {key: {str(c): advice(m, Path(tmp), c, copies=n) for c in CARDS} for key, m, n in CARD_ROWS}
        doc["run_goals"] = goals(Path(tmp))
    doc["nodes_seconds"] = time.perf_counter() - t0
    out.write_text(json.dumps(doc, indent=1, default=list))
    for key, per in doc["cards"].items():
        print(f"| {key} | " + " | ".join(per.values()) + " |")
    for model, g in doc["run_goals"].items():
        print(f"goal {model}: {g['card_gb']} GB + {g['ram_gb']} GB RAM: " +
              (card_text(g) + f", host {g['host_gb']:.1f} GiB" if g["reached"] else f"not reached ({g['stuck']})"))
    print(f"wrote {out} in {doc['nodes_seconds']:.0f} s")
    return 0
