"""A sweep compared by eye: `<sweep dir>/compare.png` (a row per prompt, a column per member labelled with its
swept overrides, as A1111's X/Y plot) and `<sweep dir>/loss.png` (the members' loss curves overlaid). Both
are read from the members' report.json, so any launcher's members are compared the same way."""
from __future__ import annotations

import json
import os
from pathlib import Path

CELL = 192  # px: a cell's least width (tiny samples are upscaled, unsmoothed, as in the run's grid)
LINE = 12  # px per text line (PIL's default font)
HEAD_LINES = 3  # a column's header: member number, then its swept overrides over two lines
GAP = 4  # px between columns


def member_label(member: dict) -> str:
    shown = member.get("swept") or member.get("overrides") or []
    return f"#{member['member']}: " + (" ".join(shown) if shown else "(defaults)")


def ordered(members: list[dict], by_objective: bool) -> list[dict]:
    """The members that finished, in launch order; with an objective (Optuna), best first."""
    done = [m for m in members if m.get("status") != "failed" and m.get("report")]
    if by_objective:
        done.sort(key=lambda m: (m.get("objective") is None, m.get("objective") or 0.0))
    return done


def _wrap(draw, text: str, width: int, lines: int) -> list[str]:
    from tasks.sample import fit

    out, words = [], text.split(" ")
    while words and len(out) < lines:
        line = words.pop(0)
        while words and draw.textlength(line + " " + words[0]) <= width:
            line += " " + words.pop(0)
        out.append(line)
    if words and out:
        out[-1] = fit(draw, out[-1] + " " + " ".join(words), width)
    return [fit(draw, line, width) for line in out]


def compare_png(members: list[dict], out: Path, by_objective: bool = False) -> Path | None:
    """The members' final samples side by side; None when no member has samples."""
    from PIL import Image, ImageDraw

    from tasks.sample import fit, preview

    cols = []
    for m in ordered(members, by_objective):
        artifacts = json.loads(Path(m["report"]).read_text()).get("artifacts", {})
        if artifacts.get("samples"):
            cols.append((m, artifacts["samples"], artifacts.get("sample_labels") or []))
    if not cols:
        return None
    rows = max(len(samples) for _, samples, _ in cols)
    tiles = [[preview(p) for p in samples] for _, samples, _ in cols]
    w = max(max(t.width for t in col) for col in tiles)
    h = max(max(t.height for t in col) for col in tiles)
    scale = max(1, -(-CELL // w))
    w, h = w * scale, h * scale
    head = 4 + LINE * HEAD_LINES
    grid = Image.new("RGB", (len(cols) * (w + GAP) - GAP, head + rows * (h + LINE + 4)), "white")
    draw = ImageDraw.Draw(grid)
    for c, (m, _, _) in enumerate(cols):
        for j, line in enumerate(_wrap(draw, member_label(m), w - 6, HEAD_LINES)):
            draw.text((c * (w + GAP) + 3, 2 + LINE * j), line, fill="black")
    labels = next((lab for _, _, lab in cols if lab), [])
    for r in range(rows):
        y = head + r * (h + LINE + 4)
        text = f"prompt {r + 1}: {labels[r]}" if r < len(labels) else f"prompt {r + 1}"
        draw.rectangle((0, y, grid.width, y + LINE + 3), fill="#eeeeee")
        draw.text((3, y + 2), fit(draw, text, grid.width - 6), fill="black")
        for c, col in enumerate(tiles):
            if r < len(col):
                t = col[r]
                grid.paste(t.resize((t.width * scale, t.height * scale), Image.NEAREST), (c * (w + GAP), y + LINE + 4))
    tmp = out.with_name(f".{out.name}.{os.getpid()}")
    grid.save(tmp, format="PNG")
    os.replace(tmp, out)
    return out


def loss_png(members: list[dict], out: Path, by_objective: bool = False) -> Path | None:
    from tasks import charts

    curves = {member_label(m): json.loads(Path(m["report"]).read_text()).get("loss") or []
              for m in ordered(members, by_objective)}
    return charts.overlay_chart(out, curves, title=f"sweep {out.parent.name}: training loss per member")
