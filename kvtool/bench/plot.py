"""The --plot PNG: hit tokens achieved vs ideal per measured request, and TTFT by connector.

Drawn with Pillow (vLLM depends on it, so it is in every kvtool environment that can run a pair);
matplotlib is not a kvtool dependency.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from kvtool.pair.profiles import PROFILES
from kvtool.errors import UserError

if TYPE_CHECKING:
    from .results import ConnectorReport

WIDTH, HEIGHT = 1400, 900
MARGIN = 70
COLORS = {name: connector.color for name, connector in PROFILES.items()}
FALLBACK_COLORS = [(148, 103, 189), (140, 86, 75), (227, 119, 194)]
IDEAL_COLOR = (200, 200, 200)
AXIS_COLOR = (60, 60, 60)


def connector_color(connector: str, index: int) -> tuple[int, int, int]:
    return COLORS.get(connector, FALLBACK_COLORS[index % len(FALLBACK_COLORS)])


def write_plot(path: Path, reports: dict[str, ConnectorReport]) -> None:
    try:
        from PIL import Image, ImageDraw
    except ImportError:
        raise UserError("--plot needs Pillow (pip install pillow); run again without --plot or install it") from None

    image = Image.new("RGB", (WIDTH, HEIGHT), "white")
    draw = ImageDraw.Draw(image)
    connectors = list(reports)
    requests = [report.requests for report in reports.values()]
    count = max((len(r) for r in requests), default=0)

    # Top panel: per measured request (consumer; chat's producer too), the ideal (grey) behind each
    # connector's achieved hit.
    top, bottom = MARGIN, HEIGHT // 2 + 60
    left, right = MARGIN, WIDTH - MARGIN
    draw.text((left, 20), "hit tokens per measured request: ideal (grey, dark line) vs achieved", fill=AXIS_COLOR)
    peak = max([1] + [r.ideal_tokens for rs in requests for r in rs] + [r.hit_tokens for rs in requests for r in rs])
    draw.line([(left, bottom), (right, bottom)], fill=AXIS_COLOR)
    draw.line([(left, top), (left, bottom)], fill=AXIS_COLOR)
    for index, connector in enumerate(connectors):  # legend
        lx = right - 220
        ly = 16 + 14 * index
        draw.rectangle([lx, ly, lx + 10, ly + 10], fill=connector_color(connector, index))
        draw.text((lx + 16, ly), connector, fill=AXIS_COLOR)
    draw.text((8, top), str(peak), fill=AXIS_COLOR)
    draw.text((8, bottom - 10), "0", fill=AXIS_COLOR)
    if count:
        slot = (right - left) / count
        bar = max(1.0, slot * 0.8 / max(1, len(connectors)))
        for position in range(count):
            x0 = left + position * slot + slot * 0.1
            ideal = next((rs[position].ideal_tokens for rs in requests if position < len(rs)), 0)
            draw.rectangle([x0, bottom - (bottom - top) * ideal / peak, x0 + slot * 0.8, bottom], fill=IDEAL_COLOR)
            for index, rs in enumerate(requests):
                if position < len(rs):
                    height = (bottom - top) * rs[position].hit_tokens / peak
                    bx = x0 + index * bar
                    draw.rectangle(
                        [bx, bottom - height, bx + bar - 1, bottom], fill=connector_color(connectors[index], index)
                    )
            ideal_y = bottom - (bottom - top) * ideal / peak
            draw.line([(x0, ideal_y), (x0 + slot * 0.8, ideal_y)], fill=AXIS_COLOR, width=2)
        workload_starts: dict[str, int] = {}
        for position, r in enumerate(requests[0]):
            workload_starts.setdefault(r.workload, position)
        for name, position in workload_starts.items():
            x = left + position * slot
            draw.line([(x, bottom), (x, bottom + 8)], fill=AXIS_COLOR)
            draw.text((x + 2, bottom + 10), name, fill=AXIS_COLOR)

    # Bottom panel: TTFT p50 and p90 by connector.
    top2, bottom2 = bottom + 60, HEIGHT - MARGIN
    draw.text((left, top2 - 20), "consumer TTFT by connector, ms: p50 (solid) and p90 (outline)", fill=AXIS_COLOR)
    summaries = [report.summary for report in reports.values()]
    peak_ms = max([1.0] + [s.ttft_ms_p90 or 0.0 for s in summaries])
    draw.line([(left, bottom2), (right, bottom2)], fill=AXIS_COLOR)
    slot2 = (right - left) / max(1, len(connectors))
    for index, (connector, summary) in enumerate(zip(connectors, summaries, strict=True)):
        x0 = left + index * slot2 + slot2 * 0.25
        x1 = x0 + slot2 * 0.5
        for value, solid in ((summary.ttft_ms_p90, False), (summary.ttft_ms_p50, True)):
            if value is None:
                continue
            y = bottom2 - (bottom2 - top2) * value / peak_ms
            color = connector_color(connector, index)
            draw.rectangle([x0, y, x1, bottom2], fill=color if solid else None, outline=color, width=2)
        p50, p90 = summary.ttft_ms_p50, summary.ttft_ms_p90
        label = f"{connector}: p50 {p50:.0f} / p90 {p90:.0f}" if p50 is not None and p90 is not None else connector
        draw.text((x0, bottom2 + 8), label, fill=AXIS_COLOR)

    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        image.save(path, format="PNG")
    except OSError as exc:
        raise UserError(f"cannot write the plot {path}: {exc.strerror or exc}") from None
