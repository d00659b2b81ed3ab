"""The what-if twin's plots (matplotlib, PNG): per-user rate over virtual
time, TTFT CDF per user, KV blocks held by throttled requests over time;
for ``twin run`` one of each, for ``twin compare`` the configurations side
by side (one column each, shared axes).

Drawn from ``TwinStats.timeline()``: per user tok/s and mean KV blocks held
throttled per virtual second, and its TTFTs. With many users the
``MAX_USERS - 1`` with the most tokens are drawn and the rest summed as
``others`` (rates, KV) or pooled (TTFT).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

MAX_USERS = 8
#: A rate timeline's points at most: longer runs are drawn as means over
#: several seconds.
MAX_POINTS = 60


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def top_users(timelines: list[dict[str, Any]]) -> list[str]:
    """The users drawn by name: the most tokens over all runs."""
    totals: dict[str, float] = {}
    for tl in timelines:
        for user, series in tl["rate"].items():
            totals[user] = totals.get(user, 0.0) + sum(series)
        for user in tl["ttft_s"]:
            totals.setdefault(user, 0.0)
    ranked = sorted(totals, key=lambda u: (-totals[u], u))
    return sorted(ranked if len(ranked) <= MAX_USERS else ranked[:MAX_USERS - 1])


def _grouped(series: dict[str, list[float]], users: list[str]) -> dict[str, list[float]]:
    out = {u: series[u] for u in users if u in series}
    rest = [s for u, s in series.items() if u not in users]
    if rest:
        n = max(map(len, rest))
        out["others"] = [sum(s[i] for s in rest if i < len(s)) for i in range(n)]
    return out


def _colors(users: list[str]) -> dict[str, Any]:
    plt = _pyplot()
    cmap = plt.get_cmap("tab10")
    return {u: cmap(i % 10) for i, u in enumerate([*users, "others"])}


def _binned(series: list[float], k: int) -> list[float]:
    """Means over ``k`` buckets (a long run's rates read as a trend)."""
    return [sum(series[i:i + k]) / len(series[i:i + k]) for i in range(0, len(series), k)]


def draw_rate(ax: Any, tl: dict[str, Any], users: list[str], colors: dict[str, Any]) -> None:
    grouped = _grouped(tl["rate"], users)
    longest = max(map(len, grouped.values()), default=0)
    k = max(1, -(-longest // MAX_POINTS))
    for user, series in grouped.items():
        ys = _binned(series, k)
        xs = [(i + 0.5) * k * tl["bucket_s"] for i in range(len(ys))]
        ax.plot(xs, ys, label=user, color=colors[user], linewidth=1.2)
    ax.set_xlabel("virtual time (s)")
    ax.set_ylabel(f"output tok/s (mean over {k * tl['bucket_s']:g} s)")
    ax.grid(alpha=0.3)


def draw_ttft_cdf(ax: Any, tl: dict[str, Any], users: list[str], colors: dict[str, Any]) -> None:
    groups: dict[str, list[float]] = {}
    for user, values in tl["ttft_s"].items():
        groups.setdefault(user if user in users else "others", []).extend(values)
    for user in [*users, "others"]:
        values = sorted(groups.get(user) or [])
        if not values:
            continue
        ys = [(i + 1) / len(values) for i in range(len(values))]
        ax.step([v * 1e3 for v in values], ys, where="post", label=user, color=colors[user])
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms, log)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)


def draw_kv(ax: Any, tl: dict[str, Any], users: list[str], colors: dict[str, Any]) -> None:
    grouped = _grouped(tl["kv_throttled"], users)
    if grouped:
        n = max(map(len, grouped.values()))
        xs = [(i + 0.5) * tl["bucket_s"] for i in range(n)]
        names = list(grouped)
        ax.stackplot(xs, [grouped[u] + [0.0] * (n - len(grouped[u])) for u in names],
                     labels=names, colors=[colors[u] for u in names], alpha=0.8)
    ax.set_xlabel("virtual time (s)")
    ax.set_ylabel("KV blocks held throttled (mean)")
    ax.grid(alpha=0.3)


def _save(fig: Any, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    _pyplot().close(fig)
    return path.name


def run_plots(tl: dict[str, Any], out: Path) -> dict[str, str]:
    """The three plots of a run in ``out``; name -> file name."""
    plt = _pyplot()
    users = top_users([tl])
    colors = _colors(users)
    files = {}
    for key, draw, title in (("rate", draw_rate, "Per-user output rate"),
                             ("ttft", draw_ttft_cdf, "TTFT CDF per user"),
                             ("kv_throttled", draw_kv, "KV blocks held by throttled requests")):
        if key == "kv_throttled" and not tl["kv_throttled"]:
            continue
        fig, ax = plt.subplots(figsize=(8, 4))
        draw(ax, tl, users, colors)
        ax.set_title(title)
        ax.legend(fontsize=7, loc="best")
        files[key] = _save(fig, out / f"plot-{key}.png")
    return files


def compare_plots(names: list[str], timelines: list[dict[str, Any]], out: Path) -> dict[str, str]:
    """Per-user rate timelines and TTFT CDFs of each configuration side by
    side (one column each, shared axes) in ``out``."""
    plt = _pyplot()
    users = top_users(timelines)
    colors = _colors(users)
    files = {}
    n = len(names)
    for key, draw, title in (("rate", draw_rate, "rate"), ("ttft", draw_ttft_cdf, "TTFT CDF")):
        fig, axes = plt.subplots(1, n, figsize=(4.5 * n, 3.8), sharex=True, sharey=True,
                                 squeeze=False)
        for ax, name, tl in zip(axes[0], names, timelines):
            draw(ax, tl, users, colors)
            ax.set_title(f"{name}: {title}")
        axes[0][-1].legend(fontsize=7, loc="best")
        files[key] = _save(fig, out / f"compare-{key}.png")
    return files
