"""The curves PNG: one panel per curve the run logs (a recipe without KL gets no empty KL panel), y-axes that do not
magnify float noise into a trend (a minimum span per metric, plain tick labels), non-finite values counted, and no
pyplot / GUI backend."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from PIL import Image

from mmrlhf.trainer.curves import CURVE_PANELS, curve_panels, curves_figure, plot_curves, y_limits


def _lines(ax) -> int:
    """Points drawn in an axes (every line's)."""
    return sum(len(line.get_xdata()) for line in ax.get_lines())


def test_curves_draw_only_the_panels_the_run_logs(tmp_path):
    history = [{"step": s, "reward/mean": s / 10, "groups/with_variance_frac": 1 - s / 20} for s in range(1, 21)]
    fig = curves_figure(history, title="run")
    assert [ax.get_title() for ax in fig.axes] == ["reward", "groups with reward variance"]  # no KL, length, entropy
    assert [_lines(ax) for ax in fig.axes] == [20, 20]
    assert [v.title for v in curve_panels(history)] == ["reward", "groups with reward variance"]
    # the control: a run that logs its KL gets the KL panel, in the panels' order; the layout grows with them
    with_kl = [{**row, "kl/mean": 0.01 * row["step"]} for row in history]
    fig_kl = curves_figure(with_kl)
    assert [ax.get_title() for ax in fig_kl.axes] == ["reward", "KL to reference", "groups with reward variance"]
    assert _lines(fig_kl.axes[1]) == 20
    assert fig_kl.get_size_inches()[0] > fig.get_size_inches()[0]  # three columns instead of two
    assert [ax.get_title() for ax in curves_figure([*with_kl, {"step": 21, "policy/entropy": 1.0},
                                                    {"step": 21, "response_length/mean": 3.0}]).axes] == [
        "reward", "KL to reference", "response length", "policy entropy", "groups with reward variance", ""]
    out = plot_curves(history, tmp_path / "curves.png", title="run")
    assert out == tmp_path / "curves.png" and Image.open(out).size == (1000, 425)  # 2 panels of 5 x 4.25 in, 100 dpi


def test_a_nearly_constant_length_is_not_magnified_into_a_trend():
    # what a 2-token toy run logs: 2.000, then 1.992 when one sample of 256 stopped after one token
    history = [{"step": s, "response_length/mean": 2.0 - 0.008 * (s % 3 == 0), "reward/mean": 0.25 + 1e-4 * s}
               for s in range(1, 11)]
    fig = curves_figure(history)
    reward, length = fig.axes
    lo, hi = length.get_ylim()
    assert hi - lo >= 4.0 and lo >= -0.5 and lo <= 1.992 and hi >= 2.0  # a few tokens, never far below 0
    assert reward.get_ylim()[1] - reward.get_ylim()[0] >= 0.05  # a reward's sampling noise stays flat
    fig.canvas.draw()
    for ax in fig.axes:  # plain tick labels: no "+1.99" offset above the axis
        assert ax.yaxis.get_major_formatter().get_offset() == ""
        assert ax.xaxis.get_major_formatter().get_offset() == ""
    # a series that really moves keeps its own range (the minimum only widens, it never hides a change)
    moving = curve_panels([{"step": s, "response_length/mean": 10.0 * s} for s in range(1, 6)])
    lo, hi = moving[0].ylim
    assert lo < 10.0 and hi > 50.0 and hi - lo < 50.0
    # a length at 0 does not get an axis reaching far below 0
    assert curve_panels([{"step": 1, "response_length/mean": 0.0}])[0].ylim == pytest.approx((-0.2, 4.2))


def test_y_limits_follow_each_metric():
    length, groups = CURVE_PANELS[2], CURVE_PANELS[4]
    assert y_limits([2.0, 1.992], length) == pytest.approx((-0.2, 4.2))  # floor at 0, span 4, 5% margin
    assert y_limits([100.0, 100.5], length) == pytest.approx((98.05, 102.45))  # centred when far from the floor
    assert y_limits([0.3, 0.31], groups) == (-0.05, 1.05)  # a share keeps its whole range
    assert y_limits([], length) is None


def test_plot_curves_skips_non_finite_values_and_handles_empty_history(tmp_path):
    history = [{"step": s, "kl/mean": v} for s, v in
               enumerate([0.1, float("nan"), None, 0.2, float("inf"), 0.3])]
    history += [{"step": 0, "policy/entropy": float("nan")}, {"step": 1, "policy/entropy": None}]
    fig = curves_figure(history)
    kl, entropy = fig.axes
    assert (kl.get_title(), entropy.get_title()) == ("KL to reference", "policy entropy")
    assert _lines(kl) == 3 and _lines(entropy) == 0
    assert any("3 non-finite value(s) skipped" in t.get_text() for t in kl.texts)
    assert any("no finite values" in t.get_text() for t in entropy.texts)  # logged, never finite: said, not hidden
    empty = curves_figure([])
    assert any("no curve metrics logged" in t.get_text() for ax in empty.axes for t in ax.texts)
    assert Image.open(plot_curves([], tmp_path / "empty.png")).size[0] > 0
    with pytest.raises(TypeError, match="row 1.*'kl/mean'"):
        plot_curves([{"step": 0, "kl/mean": 1.0}, {"step": 1, "kl/mean": "high"}], tmp_path / "x.png")


def test_plot_curves_never_touches_pyplot_or_a_gui_backend(tmp_path):
    code = ("import sys\nfrom mmrlhf.trainer.curves import plot_curves\n"
            f"plot_curves([{{'step': 0, 'reward/mean': 1.0}}], {str(tmp_path / 'c.png')!r})\n"
            "assert 'matplotlib.pyplot' not in sys.modules\n")
    env = {**os.environ, "MPLBACKEND": "TkAgg"}  # a GUI backend that cannot start here
    env.pop("DISPLAY", None)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "c.png").exists()


