"""Clips in the plan (issue 33): which frames of each clip train, the frame buckets, and the sample defaults of a
video family. Pure core, like the rest of tasks.data: the family's facts (its VAE's frame step, its native rate)
come in as arguments.

A clip trains at data.frames frames taken at data.fps (null: the clip's own rate) from its start, or, where it is
shorter, at the most it has on the VAE's 1 + step*k rule: its frame count is its frame bucket (a batch is drawn
from one shape), as musubi-tuner's and diffusion-pipe's frame buckets. A still image in a video family is a
one-frame video."""
from __future__ import annotations

from tasks.config_schema import Config, DataConfig
from tasks.data.clips import ClipInfo, vae_frames


def errors(cfg: Config, adapter_cls) -> list[str]:
    """Config errors of data.frames / data.fps, the smallest side a video family renders, and what a video
    family does not train yet."""
    dc, family, clips = cfg.data, cfg.model.family, adapter_cls.clips
    frames, fps, out = dc.frames, dc.fps, []
    if not isinstance(frames, int) or frames < 1:
        out.append(f"data.frames={frames!r}: frames per clip sample, 1 or more (e.g. 17)")
    elif clips and frames != vae_frames(frames, clips.frame_step):
        lo, frame_step = vae_frames(frames, clips.frame_step), clips.frame_step
        out.append(f"data.frames={frames}: {family}'s video VAE takes 1 + {frame_step}k frames; use data.frames={lo} "
                   f"or data.frames={lo + frame_step}")
    if fps is not None and not (isinstance(fps, (int, float)) and 0 < fps <= 240):
        out.append(f"data.fps={fps!r}: the rate clips are resampled to, in frames per second (e.g. 16), or null "
                   "for each clip's own rate")
    if clips:
        for key, on in (("mask_dir", dc.mask_dir), ("alpha_mask", dc.alpha_mask),
                        ("control_dirs", dc.control_dirs)):
            if on:
                out.append(f"data.{key}: not available for video families yet ({family}); drop it to train clips")
        side = clips.min_side
        if side and dc.resolution_type == "pixels" and dc.resolution < side:
            out.append(f"data.resolution={dc.resolution:g}: {family} renders sides of {side} px or more (its "
                       f"VAE decoder); use data.resolution={side} or more")
        network = cfg.train.network
        # ComfyUI maps no `lycoris_<diffusers module>` for its video models: a family's LyCORIS file must be in its
        # ComfyUI names (its KohyaLayout's lycoris_names, tasks/training/export_lycoris.py)
        if network in ("loha", "lokr") and adapter_cls.kohya.lycoris_names != "comfyui":
            out.append(f"train.network={network}: not available for {family} yet: no loader of video LoRAs "
                       "reads a LyCORIS file in diffusers' names; use train.network=lora or dora")
    return out


def attach(dc: DataConfig, plan_items: list[dict], items: list, clips) -> None:
    """Each clip's plan entry gains `clip`: {frames, fps} (what its latent is encoded from, in its key);
    `items` are the dataset items beside their entries (tasks.data.dataset.Item, with .clip and .size); `clips`:
    the family's tasks.models.bases.adapter.Clips (a dataset holds clips only for a video family)."""
    for entry, item in zip(plan_items, items):
        if item.clip is not None:
            frames, rate, span = item.clip
            info = ClipInfo(int(frames), float(rate), *item.size, float(span))
            fps = float(dc.fps) if dc.fps else float(rate)
            entry["clip"] = {"frames": info.train_frames(dc.frames, dc.fps, clips.frame_step), "fps": fps}


def frames_of(entry: dict) -> int:
    """The frames an item trains at: a clip's, or 1 (an image)."""
    return entry["clip"]["frames"] if "clip" in entry else 1


def bucket_name(entry: dict, size) -> str:
    """A batch bucket as the log names it: 64x64, or a clip's 64x64, 17 frames."""
    w, h = entry.get("size", size)
    return f"{w}x{h}" + (f", {entry['clip']['frames']} frames" if "clip" in entry else "")


def sample_defaults(dc: DataConfig, default_fps: float) -> dict:
    """A video family's sample length and rate: data.frames at data.fps (else the family's native rate)."""
    return {"frames": dc.frames, "fps": float(dc.fps or default_fps)}
