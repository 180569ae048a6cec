"""Samples during training: every `sample.every_n_steps` steps the prompts file is re-read and each prompt
is rendered with the LoRA as it is at that step.

sd-scripts crashes mid-training when the prompts file is edited (`'NoneType' object has no attribute
'to'`). Here nothing in the file can stop training: a malformed line is skipped with a warning naming
it, a new or edited prompt is encoded then (and stored, so the next run's cache_text reuses it), and any
other failure at a sample point is a warning. The renders use their own seeded generator, so sampling
never changes the training trajectory.

Each sample point's images are published as soon as they are rendered (users watch them to decide when to
stop): copied to `<run dir>/samples/step_<k>/`, then handed to the `on_rendered` callbacks (TensorBoard
images, a Prefect artifact)."""
from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Callable

from tasks import cache_text, sample
from tasks.config import Config
from tasks.data.prompts import read_prompts
from tasks.plan import Plan
from tasks.store import Store
from tasks.store.hashing import key_of
from tasks.training import checkpoints
from tasks.validate import planned_prompts


CODE_VERSION = "1"
log = logging.getLogger("loraflow")

# Called after each sample point with (step, rendered entries): tests use it to edit the prompts file
# while training runs.
AFTER_SAMPLE_POINT: list[Callable[[int, list[dict]], None]] = []


def entry_keys(rendered: dict[str, list[dict]]) -> dict[int, list[str]]:
    """step -> store keys of the samples rendered at that step (a stored LoRA's `checkpoint_samples`)."""
    return {int(step): [Path(e["path"]).parent.name for e in entries] for step, entries in rendered.items()}


def all_valid(store: Store, rendered: dict[str, list[dict]]) -> bool:
    return all(store.valid(sample.KIND, k) for keys in entry_keys(rendered).values() for k in keys)


def repair(store: Store, lora_kind: str, lora_key: str, trajectory: str, max_steps: int) -> bool:
    """A stored LoRA is only whole with the samples rendered while it trained. If one fails verification,
    the LoRA and the checkpoints from that step on are discarded (report: repaired), so training continues
    from the checkpoint before it and renders that step again, to the same bytes. True if it did so."""
    bad = [step for step, keys in entry_keys(store.meta(lora_kind, lora_key).get("checkpoint_samples", {})).items()
           if not all(store.valid(sample.KIND, k) for k in keys)]
    if not bad:
        return False
    log.warning("train: a sample rendered at step %d failed verification; training again from before it", min(bad))
    for step in range(min(bad), max_steps + 1):
        if store.exists(checkpoints.KIND, checkpoints.checkpoint_key(trajectory, step)):
            store.discard(checkpoints.KIND, checkpoints.checkpoint_key(trajectory, step))
    store.discard(lora_kind, lora_key)
    return True


def publish_step(samples_dir: Path, step: int | str, entries: list[dict]) -> list[str]:
    """Copies one sample point's images to `samples_dir/step_<k>/` under their prompt-line names. Each file
    is written under a temporary name and renamed, so a watcher never opens half a PNG."""
    folder = samples_dir / f"step_{int(step)}"
    folder.mkdir(parents=True, exist_ok=True)
    published = []
    for e in entries:
        dst = folder / f"{e['line']:03d}_{sample.slug(e['prompt'])}{Path(e['path']).suffix}"  # .png, or a video's .mp4
        tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
        shutil.copyfile(e["path"], tmp)
        os.replace(tmp, dst)
        published.append(str(dst))
    return published


def to_tensorboard(accelerator) -> Callable[[int, list[str]], None]:
    """A callback that adds a sample point's images to the run's TensorBoard (when it has one)."""
    def add_images(step: int, paths: list[str]) -> None:
        import numpy as np
        from PIL import Image

        for tracker in accelerator.trackers:
            if tracker.name == "tensorboard":
                for path in paths:
                    if Path(path).suffix == ".mp4":  # a video: TensorBoard's animated image
                        add_video(tracker.writer, f"samples/{Path(path).stem}", path, step)
                        continue
                    with Image.open(path) as image:
                        tracker.writer.add_image(f"samples/{Path(path).stem}", np.asarray(image.convert("RGB")),
                                                 step, dataformats="HWC")
                tracker.writer.flush()
    return add_images


def add_video(writer, tag: str, path, step: int) -> None:
    """An mp4 sample in TensorBoard as an animated GIF (what its add_video writes; this makes the GIF with PIL
    instead of moviepy)."""
    import io

    from PIL import Image
    from tensorboard.compat.proto.summary_pb2 import Summary

    from tasks.data.clips import inspect_clip, read_frames

    _, info = inspect_clip(path)
    frames = [Image.fromarray(f) for f in read_frames(path, info.frames)]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:], duration=round(1000 / info.fps), loop=0)
    image = Summary.Image(height=frames[0].height, width=frames[0].width, colorspace=3, encoded_image_string=buf.getvalue())
    writer._get_file_writer().add_summary(Summary(value=[Summary.Value(tag=tag, image=image)]), step)


class CheckpointSampler:
    def __init__(self, cfg: Config, plan: Plan, store: Store, adapter, samples_dir: Path | None = None,
                 on_rendered: list[Callable[[int, list[str]], None]] | None = None, live_text: Callable | None = None):
        """`samples_dir`: the run's samples folder, filled as each point is rendered; `on_rendered`:
        called with (step, published paths) after that (failures are warnings); `live_text`: text -> its
        tensors from the encoders being trained (train.text_encoder_lr), used instead of the text cache."""
        self.live_text = live_text
        self.cfg, self.plan, self.store, self.adapter = cfg, plan, store, adapter
        self.samples_dir, self.on_rendered = samples_dir, list(on_rendered or [])
        self.every = int(cfg.sample.every_n_steps)
        self.prompts_file = cfg.sample.prompts_file
        self.rendered: dict[str, list[dict]] = {}  # step -> [{"line", "prompt", "path"}]
        self.warnings: list[str] = []

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def __call__(self, step: int, denoiser, state_key: str) -> None:
        """Render every prompt at this step; `state_key` names the training state (trajectory + step)."""
        try:
            entries = self._render(step, denoiser, state_key)
        except Exception as e:  # noqa: BLE001 -- nothing at a sample point may stop training
            self._warn(step, f"sampling failed ({type(e).__name__}: {e}); training goes on")
            entries = []
        finally:
            denoiser.train()
        self.rendered[str(step)] = entries
        self._publish(step, entries)
        for hook in AFTER_SAMPLE_POINT:
            hook(step, entries)

    def _publish(self, step: int, entries: list[dict]) -> None:
        if self.samples_dir is None or not entries:
            return
        try:
            paths = publish_step(self.samples_dir, step, entries)
        except OSError as e:  # a full or read-only run folder: the samples stay in the store
            self._warn(step, f"could not copy the samples to {self.samples_dir}: {e}")
            return
        log.info("sample at step %d: %s", step, paths[0] if len(paths) == 1 else Path(paths[0]).parent)
        for callback in self.on_rendered:
            try:
                callback(step, paths)
            except Exception as e:  # noqa: BLE001 -- a view of the samples must not stop training
                self._warn(step, f"could not publish the samples ({type(e).__name__}: {e})")

    def _warn(self, step: int, message: str) -> None:
        self.warnings.append(f"step {step}: {message}")
        log.warning("sample at step %d: %s", step, message)

    def _prompts(self, step: int) -> list[dict]:
        prompts, warnings = read_prompts(self.prompts_file)  # re-read: the user may have edited it
        planned, size_warnings = planned_prompts(prompts, self.prompts_file, self.adapter.size_multiple)
        for w in warnings + size_warnings:
            self._warn(step, w)
        return planned

    def _seen(self, p: dict, s: dict) -> dict | None:
        """The --i images a prompt's texts are encoded with, where the text encoder sees them (cache_text)."""
        if not (p.get("images") and self.adapter.controls.seen_by_text):
            return None
        return {"images": p["images"], "size": [s["width"], s["height"]]}

    def _text_keys(self, step: int, texts: list[tuple[str, dict | None]]) -> dict[tuple, str]:
        """{(text, images digests): cache key} of (text, seen images) pairs, each encoded now if not cached."""
        keys = {_ident(t, seen): cache_text.text_key(self.cfg, self.plan, t, seen) for t, seen in texts}
        if self.live_text:  # encoded at render time by the trained encoders; the keys name the texts only
            return keys
        todo = {keys[_ident(t, seen)]: (t, seen) for t, seen in texts}
        new = {k: ts for k, ts in todo.items() if not self.store.valid(cache_text.KIND, k)}
        if new:  # encoders loaded for this sample point only
            encoders = self.adapter.load_text_encoders()
            for k, (t, seen) in new.items():
                images = {"images": [cache_text.seen_images(seen)]} if seen else {}
                self.store.put_tensors(cache_text.KIND, k, self.adapter.encode_text(encoders, [t], **images)[0],
                                       meta={"text": t})
            del encoders
            log.info("sample at step %d: encoded %d new prompt text(s)", step, len(new))
        return keys

    def _render(self, step: int, denoiser, state_key: str) -> list[dict]:
        prompts = self._prompts(step)
        seen = {p["line"]: self._seen(p, sample.settings(self.cfg, self.plan, p)) for p in prompts}
        keys = self._text_keys(step, [(t, seen[p["line"]]) for p in prompts for t in (p["prompt"], p["negative"], "")])
        def tensors(text: str, sn: dict | None):
            if self.live_text:  # the trained encoders' (no family with them sees images)
                return self.live_text(text)
            return self.store.get_tensors(cache_text.KIND, keys[_ident(text, sn)])

        pipe, entries = None, []
        for p in prompts:
            s = sample.settings(self.cfg, self.plan, p)
            key = key_of({"node": "checkpoint_sample", "code": CODE_VERSION, "state": state_key, **s,
                          "model": self.plan.ids["sample"], "prompt": keys[_ident(p["prompt"], seen[p["line"]])],
                          "negative": keys[_ident(p["negative"], seen[p["line"]])] if p["negative"] else None,
                          "empty": keys[_ident("", seen[p["line"]])],
                          **sample.control_inputs(p)})
            if not self.store.valid(sample.KIND, key):
                if pipe is None:
                    pipe = self.adapter.load_sampler(None, denoiser=denoiser)
                    denoiser.eval()
                try:
                    sn = seen[p["line"]]
                    texts = (tensors(p["prompt"], sn), tensors(p["negative"], sn) if p["negative"] else None, tensors("", sn))
                    image = sample.render(self.adapter, pipe, texts, s, p)
                except Exception as e:  # noqa: BLE001 -- one bad prompt costs its image only
                    self._warn(step, f"{self.prompts_file}:{p['line']}: not rendered ({type(e).__name__}: {e})")
                    continue
                with self.store.tmp_dir("checkpoint-sample") as tmp:
                    self.store.put_file(sample.KIND, key, sample.save_sample(image, tmp),
                                        meta={"prompt": p["prompt"], "step": step, **s})
            entries.append({"line": p["line"], "prompt": p["prompt"], "path": str(self.store.get_path(sample.KIND, key))})
        log.info("sample at step %d: %d image(s)", step, len(entries))
        return entries


def _ident(text: str, seen: dict | None) -> tuple:
    """A text and the images its encoder sees, as a dict key."""
    return (text, *cache_text.seen_part(seen).get("images", ()), *(seen["size"] if seen else ()))
