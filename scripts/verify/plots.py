"""The verification's plots (matplotlib, PNG): the per-user token
timeline, the spacing CDF per user, throttled requests and KV blocks over
the run."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from vllm_output_rate.tools.verify.analysis import Analysis, UserStats, phase_spacing_ms

def _t0(a: Analysis) -> int:
    w = a.run_window_ns()
    return w[0] if w else 0


def plot_timeline(a: Analysis, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig = timeline_figure(a)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def timeline_figure(a: Analysis) -> Any:
    """Each user's cumulative engine-side tokens with its limit's slope, the
    phases shaded and named in a legend above the panels."""
    import matplotlib.pyplot as plt

    t0 = _t0(a)
    users = [u for u in a.users_in_run() if a.user_events(u)]
    fig, axes = plt.subplots(len(users), 1, figsize=(9, 2.3 * max(len(users), 1) + 1.0),
                             sharex=True, squeeze=False)
    phases = _phase_ranges(a)
    # one shade per phase, named in a legend of its own under the title (names
    # written on the axes would sit under the per-user legend and on each other)
    palette = ["tab:orange", "tab:green", "tab:purple", "tab:olive", "tab:cyan", "tab:brown"]
    shades = dict(zip(phases, palette * len(phases)))
    for ax, user in zip(axes[:, 0], users):
        xs, ys, total = [], [], 0
        for t, n in a.user_events(user):
            total += n
            xs.append((t - t0) / 1e9)
            ys.append(total)
        limit = a.scenario.users.get(user)
        ax.step(xs, ys, where="post", label="engine-side tokens")
        if limit is not None:
            ax.plot([xs[0], xs[-1]], [ys[0], ys[0] + float(limit) * (xs[-1] - xs[0])], "k:",
                    linewidth=1, label=f"limit slope {float(limit):g} tok/s")
        for name, rng in phases.items():
            ax.axvspan((rng[0] - t0) / 1e9, (rng[1] - t0) / 1e9, alpha=0.12, color=shades[name],
                       linewidth=0)
        ax.set_ylabel("tokens")
        ax.set_title(f"{user} ({'unlimited' if limit is None else f'{float(limit):g} tok/s'})",
                     fontsize=9, loc="left")
        ax.legend(fontsize=7, loc="lower right")  # rising curves leave it free
    if phases:
        handles = [plt.Rectangle((0, 0), 1, 1, color=shades[n], alpha=0.3) for n in phases]
        fig.legend(handles, [f"{n} {(r[0] - t0) / 1e9:.1f}-{(r[1] - t0) / 1e9:.1f} s"
                             for n, r in phases.items()],
                   title="phases (shaded)", title_fontsize=8, fontsize=8, ncol=len(phases),
                   loc="upper center", bbox_to_anchor=(0.5, 0.96), frameon=False)
    axes[-1, 0].set_xlabel("engine time since the run's first token (s)")
    fig.suptitle("Cumulative output tokens per user, engine-side", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.93 if phases else 1))
    return fig


def _phase_ranges(a: Analysis) -> dict[str, tuple[int, int]]:
    out: dict[str, tuple[int, int]] = {}
    for rd in a.reqs.values():
        if not rd.tokens:
            continue
        lo, hi = out.get(rd.rec.phase, (rd.first_ns, rd.last_ns))
        out[rd.rec.phase] = (min(lo, rd.first_ns), max(hi, rd.last_ns))
    return out


#: same-step tokens have spacing 0: drawn at this value on the log axis
ZERO_SHOWN_AT_MS = 0.1


def plot_spacing_cdf(a: Analysis, stats: dict[str, UserStats], path: Path) -> None:
    import matplotlib.pyplot as plt

    users = [u for u in a.users_in_run() if a.user_events(u)]
    fig, axes = plt.subplots(1, max(len(users), 1), figsize=(4.2 * max(len(users), 1), 3.8),
                             squeeze=False)
    for ax, user in zip(axes[0], users):
        st = stats[user]
        events = a.user_events(user)
        user_gaps = [(t1 - t0) / 1e6 for (t0, _), (t1, _) in zip(events, events[1:])]
        user_gaps += [0.0] * sum(n - 1 for _, n in events)
        curves: list[tuple[str, list[float]]] = []
        if st.limit is None and a.scenario.checks.baseline_phase:
            c = a.scenario.checks
            curves.append((f"per stream, {c.baseline_phase}", phase_spacing_ms(a, user, c.baseline_phase)))
            curves.append((f"per stream, {c.compare_phase}", phase_spacing_ms(a, user, c.compare_phase)))
        else:
            curves.append(("per stream", [g / 1e6 for rd in a.user_reqs(user) for _, g in rd.spacings_ns()]))
        curves.append(("user (all streams)", user_gaps))
        for label, vals in curves:
            if vals:
                s = sorted(max(v, ZERO_SHOWN_AT_MS) for v in vals)
                ax.step(s, [(i + 1) / len(s) for i in range(len(s))], where="post", label=label)
        if st.limit is not None:
            ax.axvline(1e3 / float(st.limit), color="k", linestyle="--", linewidth=1,
                       label=f"1/limit = {1e3 / float(st.limit):.1f} ms")
            if not math.isnan(st.expected_ms):
                ax.axvline(st.expected_ms, color="r", linestyle=":", linewidth=1,
                           label=f"streams/limit p50 = {st.expected_ms:.0f} ms")
        ax.set_xscale("log")
        ax.set_xlabel(f"engine-side spacing (ms; 0 shown at {ZERO_SHOWN_AT_MS:g})")
        ax.set_ylabel("CDF")
        ax.set_title(f"{user} ({'unlimited' if st.limit is None else f'{float(st.limit):g} tok/s'})",
                     fontsize=10)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_throttled(a: Analysis, path: Path) -> None:
    import matplotlib.pyplot as plt

    t0 = _t0(a)
    window = a.run_window_ns()
    evs = [e for e in a.log.throttled
           if window is None or window[0] - 2e9 <= int(e["t_ns"]) <= window[1] + 10e9]
    fig, ax = plt.subplots(figsize=(9, 3.8))
    users = sorted({u for e in evs for u in (e.get("kv_blocks") or {})} |
                   {u for e in evs for u in (e.get("requests") or {})})
    xs = [(int(e["t_ns"]) - t0) / 1e9 for e in evs]
    for user in users:
        ax.step(xs, [(e.get("kv_blocks") or {}).get(user, 0) for e in evs], where="post",
                label=f"{user}: KV blocks")
        ax.step(xs, [(e.get("requests") or {}).get(user, 0) for e in evs], where="post",
                linestyle=":", label=f"{user}: requests")
    ax.set_xlabel("engine time since the run's first token (s)")
    ax.set_ylabel("held by throttled requests")
    ax2 = ax.twinx()
    ax2.plot(xs, [100 * float(e.get("kv_share", 0.0)) for e in evs], color="grey", linewidth=0.8,
             label="KV share %")
    ax2.set_ylabel("share of the KV cache (%)")
    ax.set_title("Throttled requests and the KV they hold (engine, about once a second)")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
