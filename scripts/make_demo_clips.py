"""Write the small demo clip dataset (video families: `model=tiny_wan data.dir=data/demo_clips`).

Usage: python scripts/make_demo_clips.py [out_dir]      (default: data/demo_clips)

Four 64x64 H.264 clips of 17 frames at 16 fps, a coloured shape moving across a plain ground, each with a
same-stem .txt caption, plus one still image (a video family trains it as a one-frame video), and a prompts file
next to the folder (<out_dir name>_prompts.txt). Written with PyAV (tasks/data/clips.py: write_mp4).
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

SIZE, FRAMES, FPS = 64, 17, 16
CLIPS = [  # (stem, shape, colour, ground, direction)
    ("red_circle_right", "circle", (220, 40, 40), (40, 70, 210), (1, 0)),
    ("green_square_down", "square", (40, 170, 60), (235, 210, 40), (0, 1)),
    ("yellow_triangle_left", "triangle", (235, 210, 40), (40, 70, 210), (-1, 0)),
    ("blue_circle_up", "circle", (40, 70, 210), (235, 235, 235), (0, -1)),
]
COLOUR_NAMES = {(220, 40, 40): "red", (40, 170, 60): "green", (235, 210, 40): "yellow", (40, 70, 210): "blue",
                (235, 235, 235): "white"}
WORD = {(1, 0): "right", (0, 1): "down", (-1, 0): "left", (0, -1): "up"}


def frame(shape: str, colour, ground, centre: tuple[float, float]) -> np.ndarray:
    img = Image.new("RGB", (SIZE, SIZE), ground)
    d = ImageDraw.Draw(img)
    x, y, r = centre[0], centre[1], 11
    if shape == "circle":
        d.ellipse((x - r, y - r, x + r, y + r), fill=colour)
    elif shape == "square":
        d.rectangle((x - r, y - r, x + r, y + r), fill=colour)
    else:
        d.polygon([(x, y - r), (x - r, y + r), (x + r, y + r)], fill=colour)
    return np.asarray(img)


def main(out: Path) -> None:
    from tasks.data.clips import write_mp4

    out.mkdir(parents=True, exist_ok=True)
    for stem, shape, colour, ground, (dx, dy) in CLIPS:
        start = (SIZE / 2 - dx * 18, SIZE / 2 - dy * 18)
        frames = [frame(shape, colour, ground, (start[0] + dx * 2.25 * k, start[1] + dy * 2.25 * k)) for k in range(FRAMES)]
        write_mp4(frames, out / f"{stem}.mp4", FPS)
        (out / f"{stem}.txt").write_text(f"a {COLOUR_NAMES[colour]} {shape} moving {WORD[(dx, dy)]} on a "
                                         f"{COLOUR_NAMES[ground]} background\n")
    Image.fromarray(frame("square", (220, 40, 40), (40, 170, 60), (SIZE / 2, SIZE / 2))).save(out / "still.png")
    (out / "still.txt").write_text("a red square on a green background\n")
    (out.parent / f"{out.name}_prompts.txt").write_text(
        "a red circle moving right on a blue background\na green square moving down on a yellow background --f 9\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "data" / "demo_clips")
