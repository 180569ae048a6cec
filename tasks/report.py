"""The run report (contract.md): per-node status, key, counts, seconds and changed inputs; artifacts."""
from __future__ import annotations

import json
import os
from pathlib import Path

from tasks.plan import Plan
from tasks.runtime import cuda_available, torch, versions
from tasks.store.hashing import changed_inputs


NODES = ("caption", "validate", "cache_latents", "cache_text", "train", "sample")


def node_entry(result: dict, previous_inputs: dict | None) -> dict:
    return {"status": "cached" if result["computed"] == 0 else "ran", "key": result["key"],
            "computed": result["computed"], "reused": result["reused"], "seconds": round(result["seconds"], 3),
            "changed": changed_inputs(previous_inputs, result["inputs"]), "repaired": result.get("repaired", []),
            **({"continued_from_step": result["continued_from_step"]} if result.get("continued_from_step") else {}),
            **({"workers": result["workers"]} if "workers" in result else {}),  # caching: {worker: items computed}
            # caption: data.captions, the captioner, images it captioned, hand-written captions kept, empty ones
            **({"captions": result["summary"]} if "summary" in result else {}),
            # cache_text with train.text_encoder_lr: why it encodes nothing (tasks/models/lora_variants/text_encoder_lora.py)
            **({"text_encoding": result["text_encoding"]} if "text_encoding" in result else {})}


def assemble(config_name: str, results: dict, previous: dict, plan: Plan, lora: dict, texts: dict, artifacts: dict,
             run_dir: Path, repaired: list[str]) -> dict:
    """report.json of a flow run: `results` are the five nodes' results, `previous` their inputs in the last
    run of this config (what changed), `artifacts` what publish wrote."""
    report = {"nodes": {n: node_entry(r, previous.get(n)) for n, r in results.items()},
              "artifacts": {**artifacts, "base_model": plan.model_dir,
                            # the steps trained in this run (none when the train node was cached)
                            **({"tensorboard": str(tb)} if (tb := run_dir / "tensorboard").is_dir() else {}),
                            # the caption node's captions as text files (data.captions=auto|regenerate)
                            **({"captions": str(c)} if (c := run_dir / "captions").is_dir() else {})},
              "config_name": config_name, "warnings": plan.warnings + lora.get("sample_warnings", []),
              "loss": lora.get("losses", []),
              # data.validation_split: [{step, loss}] of the held-out items at fixed draws (tasks/training/validation_loss.py)
              "validation_loss": lora.get("validation_loss", []),
              "memory_estimate": plan.memory, "dataset": plan.dataset,
              "dataset_subsets": plan.dataset_subsets,  # folder, images, repeats, is_reg of each
              "text_augmentation": {**plan.augmentation, "cached_caption_texts": texts.get("caption_texts", 0)}}
    report["repaired"] = repaired  # "<kind>/<key>": store entries, runs/<config>, filedigests/<memo>
    # the device and libraries; from the run that trained the LoRA: compile, attention and matmul kernels
    report["runtime"] = {**runtime_entry(), **lora.get("runtime", {})}
    return report


def runtime_entry() -> dict:
    """Where this run computed: {"device": "cpu" | "cuda", "gpu": name (CUDA only), "libs": versions}."""
    if cuda_available():
        return {"device": "cuda", "gpu": torch.cuda.get_device_name(), "libs": versions()}
    return {"device": "cpu", "libs": versions()}


def readable_changes(changed: list[str], prompts_file: str, caption_extension: str = ".txt", limit: int = 6) -> str:
    """The `changed` names of a node for a person: the caption, image or prompt line that was edited."""
    def one(name: str) -> str:
        kind, _, rest = name.partition(":")
        if kind == "caption":
            image = Path(rest.split(":")[0])  # an augmentation variant counts as its caption
            return f"caption {image.with_name(image.stem + caption_extension)}"
        if kind in ("image", "item"):
            return f"{'image' if kind == 'image' else 'image or caption'} {rest}"
        if kind in ("prompt", "negative"):
            return f"{'negative of ' if kind == 'negative' else ''}{Path(prompts_file).name} line {rest}"
        return name
    readable = list(dict.fromkeys(one(n) for n in changed))
    more = f" and {len(readable) - limit} more (report.json lists them)" if len(readable) > limit else ""
    return ", ".join(readable[:limit]) + more


def write_report(run_dir: Path, report: dict) -> Path:
    path = run_dir / "report.json"
    tmp = run_dir / f".report.json.{os.getpid()}"
    tmp.write_text(json.dumps(report, indent=2))
    os.replace(tmp, path)
    return path
