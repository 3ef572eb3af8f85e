"""A load sweep's plot (``kvtool bench --load ... --sweep-rates ... --plot``): TTFT p99 against the
request rate each run sent, one line per connector (p50 thinner beneath it). Drawn with Pillow, as
``kvtool.bench.plot`` is."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kvtool.bench.plot import AXIS_COLOR, MARGIN, connector_color
from kvtool.errors import UserError

from .options import LoadOptions, LoadResult

WIDTH, HEIGHT = 1200, 800
TICKS = 5


def sweep_points(results: Sequence[LoadResult]) -> dict[str, list[tuple[float, float, float]]]:
    """Per connector, its runs' (sent requests a second, TTFT p50, TTFT p99) in ms, by rate; runs with no
    rate (fewer than two requests) or no TTFT (every request failed) are left out. Pure."""
    points: dict[str, list[tuple[float, float, float]]] = {}
    for result in results:
        rate, ttft = result.sent_rate, result.summary.ttft_ms
        if rate is None or ttft.get("p99") is None or ttft.get("p50") is None:
            continue
        points.setdefault(result.connector, []).append((rate, ttft["p50"], ttft["p99"]))
    return {connector: sorted(runs) for connector, runs in points.items()}


def write_sweep_plot(path: Path, results: Sequence[LoadResult], options: LoadOptions) -> None:
    try:
        from PIL import Image, ImageDraw
    except ImportError:
        raise UserError("--plot needs Pillow (pip install pillow); run again without --plot or install it") from None

    points = sweep_points(results)
    image = Image.new("RGB", (WIDTH, HEIGHT), "white")
    draw = ImageDraw.Draw(image)
    left, right, top, bottom = MARGIN + 20, WIDTH - MARGIN, MARGIN, HEIGHT - MARGIN
    title = f"kvtool bench --load {options.load}: TTFT p99 (thick) and p50 (thin), ms, against requests sent a second"
    draw.text((left, 20), title, fill=AXIS_COLOR)
    every = [point for runs in points.values() for point in runs]
    x_peak = max([0.001] + [rate for rate, _, _ in every]) * 1.1
    y_peak = max([1.0] + [p99 for _, _, p99 in every]) * 1.1
    draw.line([(left, bottom), (right, bottom)], fill=AXIS_COLOR)
    draw.line([(left, top), (left, bottom)], fill=AXIS_COLOR)
    for tick in range(TICKS + 1):
        x = left + (right - left) * tick / TICKS
        y = bottom - (bottom - top) * tick / TICKS
        draw.text((x - 10, bottom + 8), f"{x_peak * tick / TICKS:.2f}", fill=AXIS_COLOR)
        draw.text((8, y - 6), f"{y_peak * tick / TICKS:.0f}", fill=AXIS_COLOR)

    def at(rate: float, ms: float) -> tuple[float, float]:
        return left + (right - left) * rate / x_peak, bottom - (bottom - top) * ms / y_peak

    for index, (connector, runs) in enumerate(points.items()):
        color = connector_color(connector, index)
        for column, width in ((2, 4), (1, 1)):
            line = [at(run[0], run[column]) for run in runs]
            if len(line) > 1:
                draw.line(line, fill=color, width=width)
            for x, y in line:
                draw.ellipse([x - 4, y - 4, x + 4, y + 4], outline=color, fill=color if column == 2 else None)
        draw.rectangle([right - 220, 16 + 16 * index, right - 210, 26 + 16 * index], fill=color)
        draw.text((right - 204, 16 + 16 * index), connector, fill=AXIS_COLOR)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        image.save(path, format="PNG")
    except OSError as exc:
        raise UserError(f"cannot write the plot {path}: {exc.strerror or exc}") from None
