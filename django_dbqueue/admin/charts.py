"""Small inline SVG charts for the queues' overview: no JavaScript, nothing from a CDN.

Every label goes through Django's escaping, so a queue name holding markup
is drawn as text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString


@dataclass(frozen=True)
class Series:
    label: str
    color: str
    values: Sequence[int]


def hourly_bars(
    hours: Sequence[datetime], series: Sequence[Series], *, width: int = 360, height: int = 80, title: str = ""
) -> SafeString:
    """Grouped bars, one group per hour, one bar per series; each bar has a tooltip with its number."""
    top = max((v for s in series for v in s.values), default=0)
    left, bottom, label_height = 28, 14, 12
    plot_w, plot_h = width - left, height - bottom - label_height
    group_w = plot_w / max(len(hours), 1)
    bar_w = max(group_w / max(len(series), 1) - 1, 1)
    bars = []
    for h, hour in enumerate(hours):
        for s, line in enumerate(series):
            value = line.values[h]
            bar_h = 0 if top == 0 else plot_h * value / top
            bars.append(
                (
                    f"{left + h * group_w + s * (bar_w + 1):.1f}",
                    f"{label_height + plot_h - bar_h:.1f}",
                    f"{bar_w:.1f}",
                    f"{bar_h:.1f}",
                    line.color,
                    f"{hour:%H}:00 UTC: {value} {line.label}",
                )
            )
    # A label every six hours, and the current hour's at the right edge (anchored at its end to stay inside).
    ticks = [
        (f"{left + h * group_w:.1f}", height - 2, "start", f"{hour:%H}h") for h, hour in enumerate(hours) if h % 6 == 0
    ]
    if hours:
        ticks.append((str(width), height - 2, "end", f"{hours[-1]:%H}h"))
    legend = [
        (left + 70 * n, 10, line.color, f"{line.label} ({sum(line.values)})", left + 70 * n + 12)
        for n, line in enumerate(series)
    ]
    return format_html(
        '<svg xmlns="http://www.w3.org/2000/svg" class="dbqueue-chart" width="{}" height="{}" viewBox="0 0 {} {}" '
        'role="img" aria-label="{}"><title>{}</title>'
        '<text x="0" y="{}" font-size="9">{}</text><text x="0" y="{}" font-size="9">0</text>'
        '<line x1="{}" y1="{}" x2="{}" y2="{}" stroke="#999"/>{}{}{}</svg>',
        width,
        height,
        width,
        height,
        title,
        title,
        label_height + 8,
        top,
        height - bottom,
        left,
        height - bottom,
        width,
        height - bottom,
        format_html_join(
            "",
            '<rect x="{}" y="{}" width="{}" height="{}" fill="{}"><title>{}</title></rect>',
            bars,
        ),
        format_html_join("", '<text x="{}" y="{}" font-size="9" text-anchor="{}">{}</text>', ticks),
        format_html_join(
            "",
            '<rect x="{}" y="2" width="9" height="9" fill="{}"/><text x="{}" y="{}" font-size="9">{}</text>',
            ((x, color, text_x, y, text) for x, y, color, text, text_x in legend),
        ),
    )
