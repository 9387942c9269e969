"""A workflow's graph as inline SVG, drawn server-side: layered boxes and arrows, no JavaScript.

A step's layer is the length of the longest path from a root to it, so
every edge points down. The drawing is bounded: past ``MAX_DRAWN`` steps
only the first layers that fit are drawn, and the picture says how many
steps and layers are left out. Every label goes through Django's escaping.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

# The most steps one drawing holds; a larger workflow shows its first layers.
MAX_DRAWN = 200
# A box and the gaps around it, in SVG units.
BOX_W, BOX_H, GAP_X, GAP_Y, MARGIN = 120, 34, 16, 36, 8
COLORS = {
    "waiting": "#d0d7de",
    "enqueued": "#79c0ff",
    "acked": "#7ee787",
    "dead": "#ff7b72",
    "expired": "#e3b341",
    "cancelled": "#c297ff",
}


@dataclass(frozen=True)
class Node:
    name: str
    state: str


def layers(nodes: Sequence[Node], edges: Sequence[tuple[str, str]]) -> list[list[Node]]:
    """Nodes by layer (longest path from a root), each layer in the nodes' given (declaration) order."""
    parents: dict[str, list[str]] = {node.name: [] for node in nodes}
    for parent, child in edges:
        if parent in parents and child in parents:
            parents[child].append(parent)
    depth: dict[str, int] = {}
    for node in nodes:  # iterative: a 10,000-step chain must not recurse 10,000 deep
        stack = [node.name]
        while stack:
            name = stack[-1]
            if name in depth:
                stack.pop()
                continue
            todo = [p for p in parents[name] if p not in depth]
            if todo:
                stack.extend(todo)
            else:
                depth[name] = 1 + max((depth[p] for p in parents[name]), default=-1)
                stack.pop()
    rows: list[list[Node]] = [[] for _ in range(1 + max(depth.values(), default=-1))]
    for node in nodes:
        rows[depth[node.name]].append(node)
    return rows


def workflow_svg(nodes: Sequence[Node], edges: Sequence[tuple[str, str]], *, limit: int = MAX_DRAWN) -> SafeString:
    """The graph as an <svg>: one box per drawn step, coloured by its state, an arrow per drawn edge."""
    rows = layers(nodes, edges)
    drawn: list[list[Node]] = []
    count = 0
    for row in rows:
        if count + len(row) > limit:
            if not drawn:  # one layer wider than the limit: its first boxes
                drawn.append(row[:limit])
                count = limit
            break
        drawn.append(row)
        count += len(row)
    left_out = len(nodes) - count
    where: dict[str, tuple[float, float]] = {}
    boxes = []
    for y, row in enumerate(drawn):
        for x, node in enumerate(row):
            bx, by = MARGIN + x * (BOX_W + GAP_X), MARGIN + y * (BOX_H + GAP_Y)
            where[node.name] = (bx, by)
            label = node.name if len(node.name) <= 16 else node.name[:15] + "…"
            middle = f"{bx + BOX_W / 2:.1f}"
            boxes.append(
                (
                    node.name,
                    bx,
                    by,
                    BOX_W,
                    BOX_H,
                    COLORS.get(node.state, "#ffffff"),
                    f"{node.name}: {node.state}",
                    middle,
                    by + 14,
                    label,
                    middle,
                    by + 27,
                    node.state,
                )
            )
    lines = [
        (f"{where[p][0] + BOX_W / 2:.1f}", where[p][1] + BOX_H, f"{where[c][0] + BOX_W / 2:.1f}", where[c][1])
        for p, c in edges
        if p in where and c in where
    ]
    width = 2 * MARGIN + max((len(row) for row in drawn), default=1) * (BOX_W + GAP_X)
    height = 2 * MARGIN + max(len(drawn), 1) * (BOX_H + GAP_Y) + (14 if left_out else 0)
    note = (
        format_html(
            '<text class="dbqueue-graph-more" x="{}" y="{}" font-size="11">{} more step(s) not drawn: the first {} of '
            "{} layers are drawn (at most {} steps); the table below lists the steps.</text>",
            MARGIN,
            height - 6,
            left_out,
            len(drawn),
            len(rows),
            limit,
        )
        if left_out
        else ""
    )
    if not nodes:
        note = format_html('<text x="{}" y="{}" font-size="11">No steps.</text>', MARGIN, MARGIN + 12)
    return format_html(
        '<svg xmlns="http://www.w3.org/2000/svg" class="dbqueue-graph" width="{}" height="{}" viewBox="0 0 {} {}" '
        'role="img" aria-label="workflow graph"><defs><marker id="dbqueue-arrow" viewBox="0 0 10 10" refX="10" '
        'refY="5" markerWidth="6" markerHeight="6" orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z" '
        'fill="#666"/></marker></defs>{}{}{}</svg>',
        width,
        height,
        width,
        height,
        format_html_join(
            "",
            '<line x1="{}" y1="{}" x2="{}" y2="{}" stroke="#666" marker-end="url(#dbqueue-arrow)"/>',
            lines,
        ),
        format_html_join(
            "",
            '<g class="dbqueue-step" data-step="{}"><rect x="{}" y="{}" width="{}" height="{}" rx="4" fill="{}" '
            'stroke="#444"><title>{}</title></rect><text x="{}" y="{}" font-size="11" text-anchor="middle">{}</text>'
            '<text x="{}" y="{}" font-size="9" text-anchor="middle">{}</text></g>',
            boxes,
        ),
        note,
    )
