"""The pictures' drawing (``prom_pictures``' charts, verify's timeline) on
synthetic data: no empty panel, no limit line of an unlimited user on a log
axis, the spacing line at streams/limit, the phase names clear of every
panel and legend."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from vllm_output_rate.tools import prom_pictures as pp  # noqa: E402
from vllm_output_rate.tools.verify.analysis import Analysis
from vllm_output_rate.tools.verify.plots import timeline_figure  # noqa: E402

WINDOW = 15.0
T0 = 1_000.0
SENTINEL = 100_000.0  # an "unlimited" user's limit, as the built-in scenario sets it


def series(lo: float, hi: float, value: float | None = None, fn=None) -> list[tuple[float, float]]:
    return [(T0 + t, fn(t) if fn else value) for t in range(int(lo), int(hi) + 1)]


def data(gap: tuple[float, float] | None = None) -> dict:
    """user-a: 4 streams at 20 tok/s from 10 s to 60 s (so 4/20 = 0.2 s apart,
    its quantiles lasting a window past its last token); user-c: unlimited;
    __anonymous__: a limit and no traffic."""
    def a(lo, hi, v):
        if gap is None:
            return series(lo, hi, v)
        return series(lo, gap[0], v) + series(gap[1], hi, v)

    p50 = a(11, 60 + WINDOW, 0.2)
    return {
        "window_s": WINDOW, "end": T0 + 120,
        "spacing": {"p50": {"user-a": p50, "user-c": series(5, 40, 0.004)},
                    "p90": {"user-a": a(11, 60 + WINDOW, 0.3), "user-c": series(5, 40, 0.01)},
                    "p99": {"user-a": a(11, 60 + WINDOW, 0.4), "user-c": series(5, 40, 0.03)}},
        # the spacing accumulated per second: 4 streams, ramping over the window at the edges
        "streams": {"user-a": a(11, 60 + WINDOW, 4.0), "user-c": series(5, 40, 1.0)},
        "rate": {"user-a": a(11, 60 + WINDOW, 20.0), "user-c": series(5, 40, 100.0),
                 "__anonymous__": series(0, 120, 0.0)},
        "limit": {"user-a": series(0, 120, 20.0), "user-c": series(0, 120, SENTINEL),
                  "__anonymous__": series(0, 120, SENTINEL)},
        "throttled": {"user-a": a(11, 60, 3.0)}, "blocks": {"user-a": a(11, 60, 6.0)},
        "share": {"0": series(0, 120, 0.01)}, "usage": {"0": series(0, 120, 0.02)},
    }


def visible_axes(fig) -> list:
    return [ax for ax in fig.axes if ax.axison]


def test_the_unlimited_placeholder_is_told_from_a_limit():
    d = data()
    assert pp.unlimited_users(d["rate"], d["limit"]) == {"user-c", "__anonymous__"}
    # a limit within reach of the rates is a limit, however high
    near = {"user-c": series(0, 120, 5_000.0)}
    assert pp.unlimited_users(d["rate"], near) == set()
    assert pp.unlimited_users(d["rate"], {"x": [(T0, float("inf"))]}) == {"x"}


def test_the_spacing_chart_has_a_panel_per_user_with_tokens_and_the_streams_over_limit_line():
    fig = pp.spacing_figure(data(), T0, "s")
    try:
        axes = visible_axes(fig)
        titles = [ax.get_title() for ax in axes]
        assert len(axes) == 2 and not any("__anonymous__" in t for t in titles), titles
        assert all(ax.get_lines() for ax in axes)  # no empty panel
        by_user = {t.split(": ")[1].split(" ")[0]: ax for t, ax in zip(titles, axes)}
        dashed = [ln for ln in by_user["user-a"].get_lines() if ln.get_linestyle() == "--"]
        assert len(dashed) == 1 and dashed[0].get_label().startswith("streams/limit")
        xs, ys = dashed[0].get_data()
        assert list(ys) == pytest.approx([4 / 20] * len(ys))  # not 1/limit: 4 streams share the limit
        # only where a whole window saw the user's tokens: not at its edges
        assert min(xs) == 11 + WINDOW and max(xs) == 60
        # the unlimited user: no limit line, its placeholder off the log axis
        assert [ln.get_linestyle() for ln in by_user["user-c"].get_lines()] == ["-"] * 3
        assert "unlimited" in by_user["user-c"].get_title()
        for ax in axes:
            assert ax.get_yscale() == "log"
            assert ax.get_ylim()[0] > 1 / SENTINEL * 10
    finally:
        plt.close(fig)


def test_the_spacing_line_skips_a_gap_in_the_users_activity():
    line = pp.spacing_line(data(gap=(30, 45)), "user-a")
    xs = [t - T0 for t, _ in line]
    assert xs and all(11 + WINDOW <= x <= 30 - WINDOW or 45 + WINDOW <= x <= 60 for x in xs)
    assert 45 + WINDOW in xs and 60 in xs


def test_the_rate_chart_draws_finite_limits_only():
    fig = pp.rate_figure(data(), T0, "s")
    try:
        (ax,) = visible_axes(fig)
        labels = [ln.get_label() for ln in ax.get_lines()]
        assert labels == ["user-a tok/s", "user-a limit", "user-c tok/s (unlimited)"]
        assert ax.get_yscale() == "log" and ax.get_ylim()[1] < SENTINEL / 10
        legend = ax.get_legend()
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        assert not legend.get_window_extent(renderer).overlaps(ax.get_window_extent(renderer))
    finally:
        plt.close(fig)


def test_the_throttled_chart_has_no_empty_panel():
    fig = pp.throttled_figure(data(), T0, "s")
    try:
        assert len(visible_axes(fig)) == 3 and all(ax.get_lines() for ax in visible_axes(fig))
    finally:
        plt.close(fig)


def test_the_timeline_names_its_phases_clear_of_the_panels():
    from test_verify import simulate

    fig = timeline_figure(Analysis(*simulate()))
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        (phases,) = fig.legends
        names = [t.get_text().split()[0] for t in phases.get_texts()]
        assert names == ["baseline", "mixed"]
        box = phases.get_window_extent(renderer)
        for ax in fig.axes:
            assert not ax.texts  # no names written on the panels
            assert not box.overlaps(ax.get_window_extent(renderer))
            assert not box.overlaps(ax.title.get_window_extent(renderer))
        assert not box.overlaps(fig._suptitle.get_window_extent(renderer))
    finally:
        plt.close(fig)
