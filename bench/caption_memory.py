"""The caption node's preflight at the captioners' real sizes (tasks/captioning/memory.py): Qwen2.5-VL-7B-Instruct
built on the meta device from its published config (bench/text_encoder_configs.py), written as a header-only
folder, estimated at each caption.quantize, with caption.offload, at caption.max_pixels 1 MP (the default) and the
repository's own 12.8 MP limit. Preflight only: no measured row (the generate loop is not on bench.memory's fake
tensors, and no GPU ran it).

    python -m bench.caption_memory        # prints the table, writes bench/caption_memory.json"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
# Qwen/Qwen2.5-VL-7B-Instruct's preprocessor_config.json (the limits that decide the vision tokens)
PREPROCESSOR = {"patch_size": 14, "temporal_patch_size": 2, "merge_size": 2, "min_pixels": 3136,
                "max_pixels": 12845056, "image_processor_type": "Qwen2VLImageProcessor"}
MODELS = {"qwen2_5_vl_7b": ("qwen2_5_vl_7b", PREPROCESSOR)}
ROWS = [("none", False, None), ("fp8", False, None), ("int8", False, None), ("nf4", False, None),
        ("nf4", True, None), ("none", False, 12845056), ("nf4", False, 12845056)]


def folder_of(name: str, root: Path) -> Path:
    """The captioner's folder as the hub has it, but header-only: config.json, preprocessor_config.json and a
    safetensors header of its bf16 shapes (tasks/run_memory.py reads no more)."""
    from bench.text_encoder_configs import build

    encoder, pre = MODELS[name]
    model = build(encoder)
    folder = root / name
    folder.mkdir(parents=True)
    config = json.loads(model.config.to_json_string())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": [type(model).__name__]}))
    (folder / "preprocessor_config.json").write_text(json.dumps(pre))
    header, offset = {}, 0
    for key, t in model.state_dict().items():
        header[key] = {"dtype": "BF16", "shape": list(t.shape), "data_offsets": [offset, offset + t.numel() * 2]}
        offset += t.numel() * 2
    raw = json.dumps(header).encode()
    (folder / "model.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw)
    return folder


def main(argv=None) -> None:
    from tasks.captioning.memory import estimate

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(HERE / "caption_memory.json"))
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in MODELS:
            folder = folder_of(name, Path(tmp))
            for quantize, offload, pixels in ROWS:
                e = estimate(folder, "bfloat16", quantize, offload, 128, pixels or 1024 * 1024)
                option = quantize if quantize != "none" else "bf16"
                label = f"{name}:caption:{option}" + ("+offload" if offload else "") + \
                    (f"+px{pixels // 10**6}m" if pixels else "")
                rows.append({"name": label, "preflight_gib": round(e["device_gb"], 2),
                             "weights_gib": round(e["weights_gb"], 2), "activations_gib": round(e["activations_gb"], 2),
                             "host_gib": round(e["host_gb"], 2), "setting": e["setting"]})
                print(f"{label:40s} {e['device_gb']:6.2f} GiB (weights {e['weights_gb']:.2f}, activations "
                      f"{e['activations_gb']:.2f}), host {e['host_gb']:.2f} GiB")
    Path(args.out).write_text(json.dumps({"rows": rows, "max_new_tokens": 128}, indent=1) + "\n")


if __name__ == "__main__":
    main()
