"""The benchmark as a picture: wall time and peak RSS per process against checkpoint size, one row of two
panels per format, one line per way of merging (the cp floor dashed). Drawn with Pillow alone."""
from __future__ import annotations

from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

PANEL_W, PANEL_H, MARGIN = 560, 340, 70
COLORS = ["#444444", "#d62728", "#9467bd", "#1f77b4", "#2ca02c", "#ff7f0e", "#8c564b"]
GIB = 2 ** 30


def _font(size: int):
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow before 10.1: one bitmap size
        return ImageFont.load_default()


def _ticks(top: float) -> list[float]:
    """About five round steps from 0 past `top`."""
    raw = top / 5 or 1
    step = next(m * 10 ** e for e in range(-3, 7) for m in (1, 2, 5) if m * 10 ** e >= raw)
    return [i * step for i in range(int(top / step) + 2)]


def _panel(draw: ImageDraw.ImageDraw, box: tuple[int, int], title: str, unit: str,
           series: dict[str, list[tuple[float, float]]], floor: str, colors: dict[str, str]) -> None:
    """One chart at `box` (left, top): x = checkpoint GiB, y in `unit`; a line and dots per series."""
    left, top = box
    x0, y0, x1, y1 = left + MARGIN, top + 40, left + PANEL_W - 20, top + PANEL_H - 45
    xs = [x for points in series.values() for x, _ in points]
    ys = [y for points in series.values() for _, y in points]
    x_ticks, y_ticks = _ticks(max(xs)), _ticks(max(ys))
    x_max, y_max = x_ticks[-1], y_ticks[-1]

    def at(x: float, y: float) -> tuple[float, float]:
        return x0 + (x1 - x0) * x / x_max, y1 - (y1 - y0) * y / y_max

    small, big = _font(13), _font(16)
    draw.text((left + MARGIN, top + 10), title, fill="black", font=big)
    for t in y_ticks:
        _, y = at(0, t)
        draw.line([(x0, y), (x1, y)], fill="#e6e6e6")
        draw.text((x0 - 8, y), f"{t:g}", fill="black", font=small, anchor="rm")
    for t in x_ticks:
        x, _ = at(t, 0)
        draw.text((x, y1 + 8), f"{t:g}", fill="black", font=small, anchor="mt")
    draw.rectangle([x0, y0, x1, y1], outline="black")
    draw.text(((x0 + x1) / 2, y1 + 26), "checkpoint size (GiB)", fill="black", font=small, anchor="mt")
    draw.text((left + 8, y0 - 22), unit, fill="black", font=small)
    for i, (name, points) in enumerate(series.items()):
        color = colors[name]
        pts = [at(x, y) for x, y in sorted(points)]
        if len(pts) > 1:
            if name == floor:  # dashed: the floor is a bound, not a contender
                for a, b in zip(pts, pts[1:]):
                    for k in range(0, 20, 2):
                        draw.line([(a[0] + (b[0] - a[0]) * k / 20, a[1] + (b[1] - a[1]) * k / 20),
                                   (a[0] + (b[0] - a[0]) * (k + 1) / 20, a[1] + (b[1] - a[1]) * (k + 1) / 20)],
                                  fill=color, width=2)
            else:
                draw.line(pts, fill=color, width=2)
        for x, y in pts:
            draw.ellipse([x - 4, y - 4, x + 4, y + 4], fill=color)
        draw.text((x0 + 10, y0 + 8 + 17 * i), name, fill=color, font=small)


def draw_chart(rows: list[tuple], path: Path, floor: str) -> None:
    """rows: (format, checkpoint bytes, run name, wall s, peak RSS bytes), medians per run."""
    formats = list(dict.fromkeys(r[0] for r in rows))
    names = list(dict.fromkeys(r[2] for r in rows))
    colors = {name: COLORS[i % len(COLORS)] for i, name in enumerate(names)}  # one color per run everywhere
    image = Image.new("RGB", (2 * PANEL_W, PANEL_H * len(formats)), "white")
    draw = ImageDraw.Draw(image)
    for i, fmt in enumerate(formats):
        wall: dict[str, list[tuple[float, float]]] = {}
        rss: dict[str, list[tuple[float, float]]] = {}
        for f, size, name, seconds, peak in rows:
            if f == fmt:
                wall.setdefault(name, []).append((size / GIB, seconds))
                rss.setdefault(name, []).append((size / GIB, peak / GIB))
        _panel(draw, (0, i * PANEL_H), f"{fmt}: wall time", "seconds", wall, floor, colors)
        _panel(draw, (PANEL_W, i * PANEL_H), f"{fmt}: peak RSS of one process", "GiB", rss, floor, colors)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
