"""Point labels that do not overlap, for the report's plots (matplotlib).

Each label goes to the first offset around its point, ring by ring outwards, where its text
overlaps no label placed before it and no point, and stays inside the axes; a label away from
its point gets a leader line. Extents are the renderer's, so the rule holds for the fonts and
the size the figure is drawn at. Where no offset is free (a crowd denser than the rings
reach), the label goes where it overlaps least.
"""

from __future__ import annotations

from matplotlib.text import Text
from matplotlib.transforms import Bbox

__all__ = ["place_labels", "text_extent"]

#: Directions around a point, the diagonals first (they leave the point's row and column free).
_DIRECTIONS = ((1, 1), (1, -1), (-1, 1), (-1, -1), (1, 0), (-1, 0), (0, 1), (0, -1))
#: Half the side of the square around a point that labels keep off, in points (the Pareto
#: front's ring around a point included).
_POINT_PT = 7
#: Distances from the point, in points (1/72 inch), the first just off the point; from the
#: second on, a leader line.
_RINGS = (_POINT_PT + 1, 16, 26, 38, 52, 68, 86, 106, 128, 152, 178, 206)
#: A label's alignment to its offset: to the right of it, the text starts there.
_ALIGN_X = {1: "left", 0: "center", -1: "right"}
_ALIGN_Y = {1: "bottom", 0: "center", -1: "top"}


def text_extent(label: Text, renderer) -> Bbox:
    """The box of a label's text alone (an annotation's extent includes its leader line)."""
    label.update_positions(renderer)  # an annotation's text is placed here, not when made
    return Text.get_window_extent(label, renderer)


def _overlap(a: Bbox, b: Bbox) -> float:
    width = min(a.x1, b.x1) - max(a.x0, b.x0)
    height = min(a.y1, b.y1) - max(a.y0, b.y0)
    return max(0.0, width) * max(0.0, height)


def _outside(box: Bbox, frame: Bbox) -> float:
    return box.width * box.height - _overlap(box, frame)


def _annotate(ax, text: str, point, dx: int, dy: int, radius: float, fontsize: float, leader: bool):
    label = ax.annotate(text, point, xytext=(dx * radius, dy * radius), textcoords="offset points", fontsize=fontsize,
                        ha=_ALIGN_X[dx], va=_ALIGN_Y[dy],
                        arrowprops={"arrowstyle": "-", "color": "0.5", "lw": 0.5, "shrinkB": 3} if leader else None)
    label.set_in_layout(False)
    return label


def place_labels(ax, points: list[tuple[float, float]], texts: list[str], fontsize: float = 7) -> list:
    """Annotate each of ``points`` (data coordinates) with its text, in the order given (the
    more important first: they get the nearest places). The figure is drawn first, so its
    layout and limits are final: the labels take no part in the layout afterwards."""
    fig = ax.figure
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    half = _POINT_PT * fig.dpi / 72
    taken = [Bbox.from_extents(x - half, y - half, x + half, y + half) for x, y in ax.transData.transform(points)]
    labels = []
    for point, text in zip(points, texts):
        best = None  # (cost, radius, dx, dy, box)
        probe = _annotate(ax, text, point, 1, 1, 0, fontsize, leader=False)  # moved from place to place
        for radius in _RINGS:
            for dx, dy in _DIRECTIONS:
                probe.xyann = (dx * radius, dy * radius)
                probe.set(ha=_ALIGN_X[dx], va=_ALIGN_Y[dy])
                box = text_extent(probe, renderer)
                cost = sum(_overlap(box, other) for other in taken) + _outside(box, frame)
                if best is None or cost < best[0]:
                    best = (cost, radius, dx, dy, box)
                if cost == 0:
                    break
            if best[0] == 0:
                break
        probe.remove()
        _, radius, dx, dy, box = best
        labels.append(_annotate(ax, text, point, dx, dy, radius, fontsize, leader=radius > _RINGS[0]))
        taken.append(box)
    return labels
