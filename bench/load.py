"""Loading a full-size base as the train node does (issue 43): peak host RSS, wall time and the bytes held, per
`model.quantize`, for the streamed loader and, as the before, from_pretrained whole then quantized.

    python -m bench.load [--out bench/load.json] [--models flux_dev,qwenimage] [--only fp8,int8,nf4]
                         [--before nf4] [--dir ~/.cache/loraflow/bench_load]

It writes a full-size transformer with random bf16 weights in diffusers' layout (sharded at 10 GB with an index,
as the hub's folders are; FLUX.1-dev ~22 GiB, Qwen-Image ~38 GiB) once into --dir and reuses it. Each row runs in
its own process: `tasks.training.train_setup.prepare_denoiser` (the train node's loading: the LoRA added,
the base stored as asked), then reads the process's peak RSS (VmHWM: everything resident, file pages included; peak_rss_anon_gib, polled: the
anonymous part, what cannot be reclaimed — diffusers' from_pretrained maps the checkpoint, so its pages count in
RSS but the kernel may drop them, at the price of reading them again)
and the bytes of the prepared denoiser. A guard in this process kills a row when the machine's available memory
falls under 1 GiB (so the bench never takes the machine down) and reports how far it got.

Rows (contract): {"name": "<model>:<quantize>", "path": "stream" | "bf16-then-quantize", "peak_rss_gib",
"device_gib" (the prepared denoiser's tensors, on the device it trains on: the host here when there is no GPU),
"quantized_weights_gib" (the base's weights as stored: quantized Linears plus what stays in bf16), "seconds"}.
Goal: peak RSS <= quantized_weights_gib + 2 GiB for fp8/int8/nf4. `none` holds the bf16 base: on a machine
without a GPU that is all host memory, so its row states what it needs instead of running when it cannot fit.

Text rows (issue 61), `<model>_text:<quantize>` (`--models qwenimage_text,ltx2_text,flux2_dev_text`): the family's
text encoder at its real config (bench/text_encoder_configs.py: Qwen2.5-VL 7B, Gemma 3 12B, Mistral Small 3.1 24B,
vision towers included), random bf16 weights (std 0.02) written once into --dir/<model>_text/text_encoder in
transformers' checkpoint layout (the hub's key names, as save_pretrained writes them: e.g. Mistral 3's
`language_model.model.*`; shards of 5 GB with model.safetensors.index.json), then loaded in each row's process by
`tasks.models.loading.text_load.load_text_model` with `text.quantize`'s TextLoading, as cache_text loads it (on
the CPU here; text.offload off). Same fields and goal; quantized_weights_gib is the loaded encoder's tensors.
A kind whose stored encoder (estimated from the meta model) would not fit this machine's memory with 2 GiB to
spare is recorded with `needs_host_gib` instead of run, whatever its kind. Checkpoints are written one at a time;
one is deleted after its rows when the disk would not hold the next one (`notes` says so)."""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
GIB = 1 << 30
SHARD = 10 * 10 ** 9  # diffusers' save_pretrained default max_shard_size ("10GB")
GUARD = 1 * GIB  # kill a row when the machine has less available
CHUNK = 1 << 27  # tensors above this many entries are drawn in parts of rows (the same values for smaller ones)
TEXT_SHARD = 5 * 10 ** 9  # the hub's shards of these encoders (Mistral Small 3.1: 10 files, Gemma 3 12B: 5)
# <model>_text -> the encoder of bench/text_encoder_configs.py its pipeline folder holds in text_encoder/
TEXT = {"qwenimage_text": "qwen2_5_vl_7b", "ltx2_text": "gemma3_12b", "flux2_dev_text": "mistral_small_3_1"}


def models() -> dict:
    from bench.flux_train import FLUX_DEV

    # (diffusers class, config, adapter) at the real architectures; QwenImageTransformer2DModel's defaults are Qwen-Image's
    return {"flux_dev": ("FluxTransformer2DModel", FLUX_DEV, "tasks.models.flux:FluxAdapter"),
            "qwenimage": ("QwenImageTransformer2DModel", {}, "tasks.models.qwenimage:QwenImageAdapter")}


def write_model(name: str, root: Path) -> Path:
    """root/<name>/transformer: config.json, shards and index of random bf16 weights (std 0.02); reused when whole."""
    import diffusers
    import torch

    cls_name, arch, _ = models()[name]
    folder = root / name / "transformer"
    done = folder / ".complete"
    if done.exists():
        return folder.parent
    folder.mkdir(parents=True, exist_ok=True)
    cls = getattr(diffusers, cls_name)
    with torch.device("meta"):
        model = cls(**arch)
    model.save_config(folder)
    shapes = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    shards = _shards(shapes, SHARD)
    files = [f"diffusion_pytorch_model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    g = torch.Generator().manual_seed(0)
    for file, names in zip(files, shards):
        _write_shard(folder / file, {n: shapes[n] for n in names}, g)
        print(f"  wrote {file}", flush=True)
    index = {"metadata": {"total_size": sum(2 * _numel(s) for s in shapes.values())},
             "weight_map": {n: f for f, names in zip(files, shards) for n in names}}
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    done.write_text("")
    return folder.parent


def _text_layout(encoder: str) -> dict:
    """checkpoint key -> shape of `encoder` as transformers' save_pretrained names it (tied weights left out,
    its conversion mapping reverted: the hub's layout), from the model on the meta device."""
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    from bench.text_encoder_configs import build

    model = build(encoder)
    state = revert_weight_conversion(model, remove_tied_weights_from_state_dict(model.state_dict(), model))
    return {k: tuple(t.shape) for k, t in state.items()}


def write_text_model(name: str, root: Path) -> Path:
    """root/<name>/text_encoder: config.json, shards and index of random bf16 weights (std 0.02), in the layout
    transformers' save_pretrained writes; reused when whole."""
    import torch

    from bench.text_encoder_configs import config

    folder = root / name / "text_encoder"
    done = folder / ".complete"
    if done.exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    config(TEXT[name]).save_pretrained(folder)
    shapes = _text_layout(TEXT[name])
    shards = _shards(shapes, TEXT_SHARD)
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for i, (file, names) in enumerate(zip(files, shards)):
        if (folder / file).exists():  # written whole by an interrupted run (a shard is renamed when complete)
            continue
        g = torch.Generator().manual_seed(i)  # per shard: an interrupted write resumes with the same values
        _write_shard(folder / file, {n: shapes[n] for n in names}, g)
        print(f"  wrote {name}/text_encoder/{file}", flush=True)
    index = {"metadata": {"total_size": sum(2 * _numel(s) for s in shapes.values())},
             "weight_map": {n: f for f, names in zip(files, shards) for n in names}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    done.write_text("")
    return folder


def text_checkpoint_bytes(name: str) -> int:
    return sum(2 * _numel(s) for s in _text_layout(TEXT[name]).values())


def text_stored_estimate(name: str, kind: str) -> int:
    """Bytes of the encoder as `kind` stores it, from the meta model (load_text_model's rules: a language model's
    output head dropped, as cache_text loads it; every nn.Linear weight stored but one tied to an embedding, all
    else bf16; NF4: 4 bits plus an int8 scale per 64 and an fp32 one per 256 of those; int8: a byte plus a bf16
    scale per row)."""
    import torch

    from bench.text_encoder_configs import build
    from tasks.models.loading.text_load import drop_head

    model, total = build(TEXT[name]), 0
    drop_head(model)
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}  # a tied lm_head's
    linear = {id(m.weight) for m in model.modules() if type(m) is torch.nn.Linear} - embedded
    for p in [*model.parameters(), *model.buffers()]:
        n = p.numel()
        if kind == "none" or id(p) not in linear:
            total += n * p.element_size()
        elif kind == "fp8":
            total += n
        elif kind == "int8":
            total += n + 2 * p.shape[0]
        else:
            total += n // 2 + n // 64 + 4 * (n // (64 * 256)) if n % 64 == 0 else 2 * n
    return total


def _shards(shapes: dict, limit: int) -> list[list[str]]:
    """Tensor names in file order, cut into shards of at most `limit` bf16 bytes (a bigger tensor alone)."""
    shards, current, size = [], [], 0
    for n, s in shapes.items():
        nbytes = 2 * _numel(s)
        if current and size + nbytes > limit:
            shards.append(current)
            current, size = [], 0
        current.append(n)
        size += nbytes
    shards.append(current)
    return shards


def _numel(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def _write_shard(path: Path, shapes: dict, g) -> None:
    """A safetensors file written tensor by tensor (never a whole shard in memory): temp name, fsync, rename."""
    import torch

    header, offset = {}, 0
    for n, s in shapes.items():
        header[n] = {"dtype": "BF16", "shape": list(s), "data_offsets": [offset, offset + 2 * _numel(s)]}
        offset += 2 * _numel(s)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads its header to 8 bytes
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for n, s in shapes.items():
            rows = max(1, CHUNK // max(1, _numel(s[1:]))) if len(s) > 1 and _numel(s) > CHUNK else s[0] if s else 1
            for start in range(0, s[0] if s else 1, rows):  # a text encoder's 1 B-entry embedding: in parts
                part = (min(rows, s[0] - start), *s[1:]) if s else s
                t = (torch.randn(part, generator=g) * 0.02).to(torch.bfloat16) if len(s) > 1 else \
                    torch.zeros(part, dtype=torch.bfloat16)
                f.write(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        f.flush()
        os.fsync(f.fileno())
    tmp.rename(path)


def _nbytes(t) -> int:
    if type(t).__module__.startswith("torchao."):
        names, _ = t.__tensor_flatten__()
        return sum(_nbytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def _status(field: str, pid: str = "self") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def run_text_row(name: str, kind: str, root: Path) -> dict:
    """In the row's own process: cache_text's loading of the encoder (load_text_model, text.quantize=kind, on the
    CPU), then what it held."""
    from types import SimpleNamespace

    import torch

    from bench.text_encoder_configs import model_class
    from tasks.models.loading.text_load import load_text_model
    from tasks.training.quantized_base import text_loading

    loading = text_loading(SimpleNamespace(quantize=kind, offload=False))
    base_rss = _status("VmRSS")
    t = time.perf_counter()
    model = load_text_model(model_class(TEXT[name]), root / name / "text_encoder", torch.bfloat16, loading, "cpu")
    seconds = time.perf_counter() - t
    tensors = {id(p): p for p in [*model.parameters(), *model.buffers()]}.values()  # tied weights once
    held = sum(_nbytes(p.data if isinstance(p, torch.nn.Parameter) else p) for p in tensors)
    return {"name": f"{name}:{kind}", "path": "stream", "peak_rss_gib": _status("VmHWM") / GIB,
            "rss_before_loading_gib": base_rss / GIB, "device": "cpu", "device_gib": held / GIB,
            "quantized_weights_gib": held / GIB, "seconds": seconds, "encoder": TEXT[name],
            "checkpoint_gib": text_checkpoint_bytes(name) / GIB}


def run_row(name: str, kind: str, path: str, root: Path) -> dict:
    """In the row's own process: the train node's loading, then what it held."""
    import importlib

    import torch

    if name in TEXT:
        return run_text_row(name, kind, root)

    from tasks.config import config_of
    from tasks.training.train_setup import prepare_denoiser

    _, _, ref = models()[name]
    module, cls = ref.split(":")
    adapter = getattr(importlib.import_module(module), cls)(root / name, "bfloat16", 512)
    cfg = config_of({"model": {"family": adapter.family, "dtype": "bfloat16", "quantize": kind, "storage_dtype": None,
                               "storage_modulation": False},
                     "train": {"rank": 16, "alpha": None, "target_modules": None, "gradient_checkpointing": True}})
    base_rss = _status("VmRSS")
    t = time.perf_counter()
    denoiser, lora = prepare_denoiser(adapter, cfg, stream=path == "stream")
    seconds = time.perf_counter() - t
    ids = {id(p) for p in lora.values()}
    tensors = [*denoiser.parameters(), *denoiser.buffers()]
    weights = sum(_nbytes(p.data if isinstance(p, torch.nn.Parameter) else p) for p in tensors if id(p) not in ids)
    held = sum(_nbytes(p.data if isinstance(p, torch.nn.Parameter) else p) for p in tensors)
    device = next(iter(lora.values())).device.type
    return {"name": f"{name}:{kind}", "path": path, "peak_rss_gib": _status("VmHWM") / GIB,
            "rss_before_loading_gib": base_rss / GIB, "device": device, "device_gib": held / GIB,
            "quantized_weights_gib": weights / GIB, "seconds": seconds}


def _available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def guarded(name: str, kind: str, path: str, root: Path, timeout: float | None = None) -> dict:
    """One row in a child process, killed if the machine runs short of memory or after `timeout` seconds (then:
    how far it got)."""
    cmd = [sys.executable, "-m", "bench.load", "--row", f"{name}:{kind}", "--path", path, "--dir", str(root)]
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=HERE.parent,
                             env={**os.environ, "HF_HUB_OFFLINE": "1"})
    peak, anon, t, killed, late = 0, 0, time.perf_counter(), False, False
    while child.poll() is None:
        try:  # file-backed pages (a mapped checkpoint) are resident but reclaimable; anonymous ones are not
            peak = max(peak, _status("VmRSS", str(child.pid)))
            anon = max(anon, _status("RssAnon", str(child.pid)))
        except (OSError, ValueError):
            pass
        if _available() < GUARD:
            child.send_signal(signal.SIGKILL)
            killed = True
        elif timeout and time.perf_counter() - t > timeout and not late:
            child.send_signal(signal.SIGKILL)
            late = True
        time.sleep(0.2)
    out = child.stdout.read()
    if killed or late or child.returncode:
        return {"name": f"{name}:{kind}", "path": path, "status": "killed: the machine ran out of memory" if killed
                else f"not measured: stopped after {timeout:.0f} s (--row-timeout)" if late
                else f"failed (exit {child.returncode})", "peak_rss_gib": peak / GIB, "peak_rss_anon_gib": anon / GIB,
                "seconds": time.perf_counter() - t, "machine_memory_gib": _status_total() / GIB}
    return {**json.loads(out.strip().splitlines()[-1]), "peak_rss_anon_gib": anon / GIB}  # polled every 0.2 s


def _status_total() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return 0


def needs_row(name: str, root: Path) -> dict:
    """`none` where there is no GPU: the bf16 base is held in host memory whole; what that needs."""
    from tasks.models.loading.stream_load import folder_entries

    entries = folder_entries(root / name / "transformer")
    weights = sum(e.end - e.start for e in entries.values())
    return {"name": f"{name}:none", "path": "stream", "status": "not run: no GPU, so the bf16 base is held in host "
            "memory whole", "needs_host_gib": weights / GIB, "quantized_weights_gib": weights / GIB,
            "machine_memory_gib": _status_total() / GIB}


def needs_text_row(name: str, kind: str, available: int | None = None) -> dict:
    """A text row whose stored encoder would not fit this machine's memory (or, given `available`, the memory
    the machine had available then: it is shared): what it needs (an estimate)."""
    need = text_stored_estimate(name, kind)
    why = "no GPU, so the bf16 encoder is held in host memory whole" if kind == "none" else \
        f"the encoder stored as {kind} does not fit this machine's memory with 2 GiB to spare"
    if available is not None:
        why = f"{why.split(',')[0]}: it would need about {need / GIB + 2:.1f} GiB, and the machine (shared) had " \
              f"{available / GIB:.1f} GiB available"
    return {"name": f"{name}:{kind}", "path": "stream", "status": f"not run: {why}", "needs_host_gib": need / GIB,
            "quantized_weights_gib": need / GIB, "estimated": True, "encoder": TEXT[name],
            "checkpoint_gib": text_checkpoint_bytes(name) / GIB, "machine_memory_gib": _status_total() / GIB}


def _text_rows(name: str, kinds: list[str], root: Path, timeout: float | None, emit) -> None:
    """The text model's rows: written once, then each kind run (or what it needs recorded)."""
    import torch

    fits = {k: torch.cuda.is_available() or text_stored_estimate(name, k) <= _status_total() - 2 * GIB for k in kinds}
    if any(fits.values()):
        write_text_model(name, root)
    for kind in kinds:
        if not fits[kind]:
            emit(needs_text_row(name, kind), kind)
        elif not torch.cuda.is_available() and text_stored_estimate(name, kind) + 2 * GIB > _available():
            emit(needs_text_row(name, kind, _available()), kind)  # others' work holds the rest now
        else:
            emit(guarded(name, kind, "stream", root, timeout), kind)


def _room_for(name: str, root: Path) -> bool:
    """Whether the disk holds `name`'s checkpoint (with 2 GiB to spare), or it is written already."""
    import shutil

    if name in TEXT:
        folder, size = root / name / "text_encoder", text_checkpoint_bytes(name)
    else:
        folder, size = root / name / "transformer", 0
    return (folder / ".complete").exists() or shutil.disk_usage(root).free >= size + 2 * GIB


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.load", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(HERE / "load.json"))
    ap.add_argument("--models", default="flux_dev")
    ap.add_argument("--only", default="none,fp8,int8,nf4")
    ap.add_argument("--before", default="nf4", help="kinds also loaded the old way (from_pretrained, then quantize)")
    ap.add_argument("--paths", default="stream,bf16-then-quantize", help="which loading paths to run")
    ap.add_argument("--dir", default=str(Path.home() / ".cache" / "loraflow" / "bench_load"))
    ap.add_argument("--row-timeout", type=float, default=None, help="stop a row after S seconds (recorded as not measured)")
    ap.add_argument("--row", help=argparse.SUPPRESS)
    ap.add_argument("--path", default="stream", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    root = Path(args.dir).expanduser()
    if args.row:
        name, kind = args.row.split(":")
        print(json.dumps(run_row(name, kind, args.path, root)))
        return 0
    import torch

    t0, rows, notes = time.perf_counter(), [], {}
    root.mkdir(parents=True, exist_ok=True)
    names = args.models.split(",")
    for i, name in enumerate(names):
        if name in TEXT:
            def emit(r, k, name=name):
                rows.append(r)
                if "quantized_weights_gib" in r and "status" not in r:
                    r["goal_gib"] = r["quantized_weights_gib"] + 2
                    r["meets"] = k == "none" or r["peak_rss_gib"] <= r["goal_gib"]
                _write(Path(args.out), rows, t0, torch, notes)
                print(f"  {r['name']:<20} " + (r.get("status") or f"peak RSS {r['peak_rss_gib']:6.2f} GiB (weights as "
                      f"stored {r['quantized_weights_gib']:.2f}) {r['seconds']:.0f} s"), flush=True)
            _text_rows(name, args.only.split(","), root, args.row_timeout, emit)
            later = next(iter(names[i + 1:]), None)
            if later and (root / name).exists() and not _room_for(later, root):
                import shutil

                shutil.rmtree(root / name)
                notes[name] = f"checkpoint deleted after its rows: the disk would not hold {later}'s beside it"
                _write(Path(args.out), rows, t0, torch, notes)
            continue
        write_model(name, root)
        for kind in args.only.split(","):
            plans = [("stream", kind)] + ([("bf16-then-quantize", kind)] if kind in args.before.split(",") else [])
            plans = [p for p in plans if p[0] in args.paths.split(",")]
            for path, k in plans:
                if k == "none" and not torch.cuda.is_available() and \
                        needs_row(name, root)["needs_host_gib"] * GIB > _status_total() - 2 * GIB:
                    rows.append(needs_row(name, root))
                else:
                    rows.append(guarded(name, k, path, root))
                r = rows[-1]
                if "quantized_weights_gib" in r and "status" not in r:
                    r["goal_gib"] = r["quantized_weights_gib"] + 2
                    r["meets"] = k == "none" or r["peak_rss_gib"] <= r["goal_gib"]
                _write(Path(args.out), rows, t0, torch, notes)  # after every row: a long run interrupted keeps what it measured
                print(f"  {r['name']:<18} {r['path']:<19} " + (r.get("status") or
                      f"peak RSS {r['peak_rss_gib']:6.2f} GiB (weights as stored {r['quantized_weights_gib']:.2f}) "
                      f"{r['seconds']:.0f} s"), flush=True)
    print(f"wrote {args.out} in {time.perf_counter() - t0:.0f} s")
    return 0


def _write(out: Path, rows: list[dict], t0: float, torch, notes: dict | None = None) -> None:
    """The rows into `out`, merged with the rows of earlier runs that this one did not measure again."""
    doc = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "machine": {"cpu": _cpu(), "cores": os.cpu_count(), "memory_gib": _status_total() / GIB,
                       "cuda": torch.cuda.is_available(), "torch": torch.__version__},
           "total_seconds": time.perf_counter() - t0}
    previous = json.loads(out.read_text()) if out.exists() else {"rows": []}
    keep = [r for r in previous.get("rows", []) if (r["name"], r["path"]) not in {(x["name"], x["path"]) for x in rows}]
    doc["rows"] = keep + rows
    if notes or previous.get("notes"):
        doc["notes"] = {**previous.get("notes", {}), **(notes or {})}
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(out)


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


if __name__ == "__main__":
    sys.exit(main())
