"""samples/grid.png says what it shows (issue 62 item 3): each cell's prompt, cut to fit, and its seed."""
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from tasks.sample import GRID_CELL, LABEL_LINES, fit, make_grid


def _samples(tmp_path: Path, n: int, side: int = 32) -> list[Path]:
    out = []
    for i in range(n):
        out.append(tmp_path / f"{i}.png")
        Image.new("RGB", (side, side), (30 * i, 120, 200)).save(out[-1])
    return out


def test_each_cell_is_labelled_above_its_sample(tmp_path):
    labels = [[f"a prompt number {i} " + "that is far too long to fit in one cell " * 3, f"seed {i}"] for i in range(5)]
    grid = Image.open(make_grid(_samples(tmp_path, 5), tmp_path / "grid.png", columns=4, labels=labels))
    scale = -(-GRID_CELL // 32)
    cell, head = 32 * scale, 4 + 12 * LABEL_LINES
    assert grid.size == (4 * cell, 2 * (cell + head))
    pixels = np.asarray(grid.convert("L"))
    for i in range(5):
        x, y = (i % 4) * cell, (i // 4) * (cell + head)
        assert (pixels[y:y + head, x:x + cell] < 128).any(), f"cell {i} has no label"  # dark text on white
        sample = pixels[y + head:y + head + cell, x:x + cell]
        assert sample.min() == sample.max()  # the sample itself, upscaled without smoothing, below its label
    assert not (tmp_path / ".grid.png.tmp").exists()


def test_a_label_is_cut_to_the_cell_with_an_ellipsis():
    draw = ImageDraw.Draw(Image.new("RGB", (10, 10)))
    text = "a very long prompt " * 10
    cut = fit(draw, text, 150)
    assert cut.endswith("…") and draw.textlength(cut) <= 150 and text.startswith(cut[:-1])
    assert fit(draw, "short", 150) == "short"


def test_without_labels_the_grid_is_the_samples_alone(tmp_path):
    grid = Image.open(make_grid(_samples(tmp_path, 3), tmp_path / "grid.png"))
    assert grid.size == (3 * 32, 32)
