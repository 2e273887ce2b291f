"""In the kernel: a picture of where each rank's time went (``kernel/view/time_shares.py``), shown by a
``--profile`` cell under its summary.

One bar per rank, split into computing, collectives, data and setup, the rank the others waited for said
under them. SVG (any front end shows it, a saved notebook keeps it, nothing to install), with the same
figures as text for front ends that show no pictures.
"""

from __future__ import annotations

from html import escape
from typing import Mapping

from taas_magic.kernel.view.time_shares import COLLECTIVES, COMPUTING, DATA, SETUP, Shares, waited_for

COLOURS = {COMPUTING: "#4c78a8", COLLECTIVES: "#f58518", DATA: "#54a24b", SETUP: "#9d9d9d"}
BAR, ROW, LABEL, LEGEND = 420, 18, 64, 22  # pixels: a full bar's width, a row's height, the labels' column


def bundle(shares: Mapping[int, Shares]) -> dict[str, str]:
    """The picture as a MIME bundle: SVG, and its figures as text."""
    waited = waited_for(shares)
    lines = [f"rank {rank}: {shares[rank].text()}" for rank in sorted(shares)]
    if waited is not None:
        lines.append(waited.text())
    return {"image/svg+xml": svg(shares, waited.text() if waited else ""), "text/plain": "\n".join(lines)}


def svg(shares: Mapping[int, Shares], note: str = "") -> str:
    """One bar per rank, each state's share a stretch of it in its colour, with a legend above."""
    ranks = sorted(shares)
    height = LEGEND + ROW * len(ranks) + (ROW if note else 0) + 4
    width = LABEL + BAR + 8
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">'
    ]
    x = LABEL
    for state, colour in COLOURS.items():
        parts.append(f'<rect x="{x}" y="4" width="10" height="10" fill="{colour}"/>')
        parts.append(f'<text x="{x + 14}" y="13">{state}</text>')
        x += 20 + 7 * len(state)
    for row, rank in enumerate(ranks):
        y = LEGEND + row * ROW
        parts.append(f'<text x="0" y="{y + 12}">rank {rank}</text>')
        parts += _bar(shares[rank], y)
    if note:
        parts.append(f'<text x="{LABEL}" y="{LEGEND + len(ranks) * ROW + 12}">{escape(note)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _bar(shares: Shares, y: int) -> list[str]:
    parts, x = [], float(LABEL)
    names = {COLLECTIVES: shares.collectives_name()}
    for state, colour in COLOURS.items():
        share = shares.share(state)
        if share <= 0:
            continue
        width = share * BAR
        title = f"{names.get(state, state)} {share:.0%}"
        parts.append(
            f'<rect x="{x:.1f}" y="{y + 2}" width="{width:.1f}" height="{ROW - 4}" fill="{colour}">'
            f"<title>{escape(title)}</title></rect>"
        )
        if width >= 7 * len(title) + 6:  # the figure where it fits inside its stretch
            parts.append(f'<text x="{x + 3:.1f}" y="{y + 12}" fill="white">{escape(title)}</text>')
        x += width
    return parts
