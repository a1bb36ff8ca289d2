"""The training curves PNG (``output_dir/curves.png``): one panel per curve the run logs, on honest axes.

Why the panels are chosen from the history: a recipe without a KL term logs no ``kl/mean``, and an empty "not
logged" panel only takes room from the curves that are there; a panel is drawn when at least one of its keys appears
in the history (a key logged only as non-finite values still gets its panel, which says so: that is news).

Why each panel has a minimum y-span: matplotlib zooms a nearly constant series until its float noise fills the
axis (a response length of 2.000 tokens drawn from 1.992 to 2.000 with a "+1.99" offset), which looks like a trend.
Each panel's span is at least what is meaningful for its metric (a few tokens for a length, a few hundredths of a
0/1 reward), never below the metric's natural floor (lengths, entropies and shares are >= 0), and tick labels are
plain numbers (no offset notation). :func:`curve_panels` decides which panels and which limits (pure, tested);
:func:`curves_figure` draws exactly that; :func:`plot_curves` writes the PNG.
"""

from __future__ import annotations

import io
import math
import numbers
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from mmrlhf.trainer.tracking import atomic_write


@dataclass(frozen=True)
class CurvePanel:
    """A panel the curves PNG may hold."""

    title: str
    keys: tuple[str, ...]  # plotted together; the panel is drawn when any of them was logged
    ylabel: str
    min_span: float  # the smallest y-range shown: differences below it are noise for this metric
    floor: float | None = None  # the metric's natural lower bound (the axis never starts far below it)
    fixed: tuple[float, float] | None = None  # limits regardless of the data (a share in [0, 1])


CURVE_PANELS: tuple[CurvePanel, ...] = (
    # A 0/1 reward's batch mean moves by a few hundredths between steps from sampling alone.
    CurvePanel("reward", ("reward/mean", "eval/reward/mean"), "mean reward", min_span=0.05),
    # k1 KL may be negative: no floor. Below 1e-3 nats a KL term does not pull.
    CurvePanel("KL to reference", ("kl/mean",), "KL", min_span=1e-3),
    CurvePanel("response length", ("response_length/mean",), "tokens", min_span=4.0, floor=0.0),
    CurvePanel("policy entropy", ("policy/entropy",), "nats / token", min_span=0.1, floor=0.0),
    CurvePanel("groups with reward variance", ("groups/with_variance_frac",), "share of groups", min_span=1.0,
               floor=0.0, fixed=(-0.05, 1.05)),
)
MARGIN = 0.05  # of the shown span, above and below the data


@dataclass(frozen=True)
class Series:
    key: str
    steps: list[int]
    values: list[float]
    non_finite: int  # values skipped (None / NaN / inf)


@dataclass(frozen=True)
class PanelView:
    """A panel as it is drawn: its series and its y-limits (None: nothing finite to bound)."""

    panel: CurvePanel
    series: list[Series]  # the panel's keys that were logged, in the panel's order
    ylim: tuple[float, float] | None

    @property
    def title(self) -> str:
        return self.panel.title


def series(history: Sequence[Mapping[str, Any]], key: str) -> Series | None:
    """``key``'s finite points sorted by step, with the count of non-finite ones; None when never logged (``None``
    is how ``metrics.jsonl`` stores a non-finite value)."""
    points: list[tuple[int, float]] = []
    bad, present = 0, False
    for i, row in enumerate(history):
        if key not in row:
            continue
        present = True
        value = row[key]
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
            raise TypeError(f"history row {i}: {key!r} must be a number or None, got {value!r}")
        if "step" not in row:
            raise KeyError(f"history row {i} has {key!r} but no 'step'")
        if value is None or not math.isfinite(float(value)):
            bad += 1
        else:
            points.append((int(row["step"]), float(value)))
    if not present:
        return None
    points.sort(key=lambda p: p[0])
    return Series(key, [p[0] for p in points], [p[1] for p in points], bad)


def y_limits(values: Sequence[float], panel: CurvePanel) -> tuple[float, float] | None:
    """The panel's y-range for ``values``: their range widened to at least ``min_span`` around its centre, shifted up
    to the floor when that would reach below it, plus a margin each side; the fixed limits when the panel has them."""
    if panel.fixed is not None:
        return panel.fixed
    if not values:
        return None
    lo, hi = min(values), max(values)
    span = max(hi - lo, panel.min_span)
    centre = (lo + hi) / 2
    lo, hi = centre - span / 2, centre + span / 2
    if panel.floor is not None and lo < panel.floor:
        lo, hi = panel.floor, panel.floor + span
    margin = MARGIN * span
    return lo - margin, hi + margin


def curve_panels(history: Sequence[Mapping[str, Any]],
                 panels: Sequence[CurvePanel] = CURVE_PANELS) -> list[PanelView]:
    """The panels to draw for ``history`` (those with a logged key, in order) and their y-limits."""
    out = []
    for panel in panels:
        logged = [s for s in (series(history, k) for k in panel.keys) if s is not None]
        if logged:
            out.append(PanelView(panel, logged, y_limits([v for s in logged for v in s.values], panel)))
    return out


def grid(n: int, columns: int = 3) -> tuple[int, int]:
    """(rows, columns) for ``n`` panels: up to ``columns`` a row, no empty row."""
    cols = max(1, min(n, columns))
    return max(1, math.ceil(n / cols)), cols


def curves_figure(history: Sequence[Mapping[str, Any]], *, title: str = "") -> Any:
    """The matplotlib ``Figure`` of :func:`curve_panels` (Agg canvas: no pyplot, no GUI, safe in a worker thread or
    on a headless node). One axes per panel; a history with nothing to draw gets one axes that says so."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    views = curve_panels(history)
    rows, cols = grid(len(views))
    fig = Figure(figsize=(5 * cols, 4.25 * rows), layout="constrained")
    FigureCanvasAgg(fig)
    if not views:
        ax = fig.subplots()
        ax.set_axis_off()
        ax.text(0.5, 0.5, "no curve metrics logged yet", ha="center", va="center", transform=ax.transAxes,
                color="0.4")
    axes = fig.subplots(rows, cols, squeeze=False).ravel() if views else []
    for ax, view in zip(axes, views):
        ax.set_title(view.title)
        ax.set_xlabel("step")
        ax.set_ylabel(view.panel.ylabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
        ax.ticklabel_format(axis="both", style="plain", useOffset=False)
        notes = []
        for s in view.series:
            if s.steps:
                ax.plot(s.steps, s.values, marker="o" if len(s.steps) < 30 else None, markersize=3, label=s.key)
            if s.non_finite:
                notes.append(f"{s.key}: {s.non_finite} non-finite value(s) skipped")
        if view.ylim is not None:
            ax.set_ylim(*view.ylim)
        if any(s.steps for s in view.series):
            ax.legend(loc="best", fontsize=8)
            ax.grid(alpha=0.3)
        else:
            ax.text(0.5, 0.5, f"{view.series[0].key}\nno finite values", ha="center", va="center",
                    transform=ax.transAxes, color="0.4")
        if notes:
            ax.text(0.02, 0.02, "\n".join(notes), transform=ax.transAxes, fontsize=7, color="#b03a2e", va="bottom")
    for ax in axes[len(views):]:
        ax.set_axis_off()
    if title:
        fig.suptitle(title)
    return fig


def plot_curves(history: Sequence[Mapping[str, Any]], out_png: str | Path, *, title: str = "") -> Path:
    """Write :func:`curves_figure` as a PNG (temp file + ``os.replace``: a viewer never sees half of it)."""
    buf = io.BytesIO()
    curves_figure(history, title=title).savefig(buf, format="png", dpi=100)
    return atomic_write(out_png, buf.getvalue())
