#!/usr/bin/env python
"""Pictures of the key dashboard panels without Grafana.

Queries a Prometheus that scraped the engine(s) for the dashboards' own
expressions (per-user engine-side token spacing, output rate vs limit,
throttled requests holding KV) over a time range, and writes PNG charts and
a short Markdown summary:

    python -m vllm_output_rate.tools.prom_pictures --prometheus http://127.0.0.1:9090 --last 15m --out report/
    python -m vllm_output_rate.tools.prom_pictures --prometheus URL --start 2026-11-30T14:00:00Z \\
        --end 2026-11-30T14:20:00Z --user 'user-a|user-b' --out report/

Writes ``spacing.png``, ``rate_vs_limit.png``, ``throttled_kv.png`` and
``summary.md`` into ``--out``.

For a run that no Prometheus watched, ``LocalPrometheus`` starts one on
loopback that scrapes one server every second; ``vllm-output-rate verify
--model DIR --pictures OUT`` uses it (``make pictures`` regenerates the
README's pictures, ``docs/img/``, that way).
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx

from vllm_output_rate.dashboards import generate
from vllm_output_rate.dashboards.config import Config
from vllm_output_rate.dashboards.expressions import over_limit_factor
from vllm_output_rate.dashboards.thresholds import seconds
from vllm_output_rate.dashboards.promql import render
from vllm_output_rate.tools.common.client import wait_ready

Series = dict[str, list[tuple[float, float]]]

def parse_time(text: str) -> float:
    """Unix seconds or ISO 8601 (a trailing Z means UTC)."""
    try:
        return float(text)
    except ValueError:
        stamp = datetime.fromisoformat(text.replace("Z", "+00:00"))
        if stamp.tzinfo is None:
            stamp = stamp.replace(tzinfo=timezone.utc)
        return stamp.timestamp()


class Prom:
    def __init__(self, url: str, variables: dict[str, str], rate_interval: str) -> None:
        self.url = url.rstrip("/")
        self.variables = variables
        self.rate_interval = rate_interval
        self.client = httpx.Client(timeout=60)

    def _get(self, path: str, **params: Any) -> list[dict[str, Any]]:
        resp = self.client.get(f"{self.url}/api/v1/{path}", params=params)
        body = resp.json()
        if body.get("status") != "success":
            raise RuntimeError(f"{params.get('query')}: {body.get('error', body)}")
        return body["data"]["result"]

    def expr(self, expr: str, range_s: float = 0) -> str:
        return render(expr, self.variables, rate_interval=self.rate_interval,
                      range_=f"{max(int(range_s), 1)}s")

    def range(self, expr: str, start: float, end: float, step: str, label: str = "user") -> Series:
        out: Series = {}
        for s in self._get("query_range", query=self.expr(expr), start=start, end=end, step=step):
            key = s["metric"].get(label, "")
            points = [(float(t), float(v)) for t, v in s["values"]]
            out.setdefault(key, []).extend(p for p in points if not math.isnan(p[1]))
        return {k: sorted(v) for k, v in out.items() if v}

    def instant(self, expr: str, at: float, label: str = "user", range_s: float = 0) -> dict[str, float]:
        out = {}
        for s in self._get("query", query=self.expr(expr, range_s), time=at):
            value = float(s["value"][1])
            if not math.isnan(value):
                out[s["metric"].get(label, "")] = value
        return out


def _xs(points: list[tuple[float, float]], t0: float) -> tuple[list[float], list[float]]:
    return [t - t0 for t, _ in points], [v for _, v in points]


#: A limit this many times above the highest rate any user reached is read as
#: "unlimited" (a placeholder such as the built-in scenario's 100000 tok/s):
#: its line would stretch the log axes over decades, so it is not drawn.
UNLIMITED_FACTOR = 100


def unlimited_users(rate: Series, limit: Series, factor: float = UNLIMITED_FACTOR) -> set[str]:
    """The users whose limit is infinite or over ``factor`` times the highest
    rate of any user in the range (no line of theirs on a log axis)."""
    top = max((v for points in rate.values() for _, v in points), default=0.0)
    out = set()
    for user, points in limit.items():
        low = min(v for _, v in points)
        if not math.isfinite(low) or (top > 0 and low > factor * top):
            out.add(user)
    return out


def with_traffic(rate: Series) -> list[str]:
    """The users whose rate was above 0 at some point, sorted."""
    return sorted(u for u, points in rate.items() if any(v > 0 for _, v in points))


def fetch(prom: Prom, start: float, end: float, step: str, config: Config) -> dict[str, Any]:
    """The series the pictures draw, by name (see ``draw``)."""
    panels = generate.key_panels(config)
    spacing = panels["spacing"]
    # the dashboard's quantiles; its 1/limit line is replaced by streams/limit:
    # each of a user's n streams gets limit/n tok/s, so its tokens come n/limit
    # apart; n (the streams between two tokens, on average over the rate
    # window) is the spacing time accumulated per second
    quantiles = {t.legend.split()[-1]: prom.range(t.expr, start, end, step)
                 for t in spacing.targets if not t.legend.endswith("1/limit")}
    rate_panel = panels["rate"]
    share_panel = panels["kv_share"]
    return {
        "window_s": seconds(prom.rate_interval), "end": end,
        "spacing": quantiles,
        "streams": prom.range(f"sum by (user) (rate({config.sel('inter_token_seconds', '_sum')}"
                              "[$__rate_interval]))", start, end, step),
        "rate": prom.range(rate_panel.targets[0].expr, start, end, step),
        "limit": prom.range(rate_panel.targets[1].expr, start, end, step),
        "throttled": prom.range(panels["throttled"].targets[0].expr, start, end, step),
        "blocks": prom.range(panels["kv_blocks"].targets[0].expr, start, end, step),
        "share": prom.range(share_panel.targets[0].expr, start, end, step, label="engine"),
        "usage": prom.range(share_panel.targets[1].expr, start, end, step, label="engine"),
    }


def _active_spans(times: list[float], window: float, end: float) -> list[tuple[float, float]]:
    """The spans in which a whole rate window saw a user's tokens, from the
    times its quantiles have points: each run of points starts at most a scrape
    after the first token and lasts a window past the last one (at the
    range's end, the user may still be active)."""
    times = sorted(set(times))
    if not times:
        return []
    step = min((b - a for a, b in zip(times, times[1:])), default=window)
    runs, first = [], times[0]
    for prev, t in zip(times, [*times[1:], math.inf]):
        if t - prev > 1.5 * step:
            last = prev - window if prev < end - step else end
            if first + window <= last:
                runs.append((first + window, last))
            first = t
    return runs


def spacing_line(data: dict[str, Any], user: str) -> list[tuple[float, float]]:
    """``user``'s streams/limit where a whole rate window lies in its activity:
    there the spacing accumulated per second (``streams``) is its count of
    streams between two tokens, averaged over the window (at the edges the
    window also holds idle time, which would pull the count down)."""
    window, limit = data["window_s"], dict(data["limit"].get(user, []))
    spans = _active_spans([t for series in data["spacing"].values() for t, _ in series.get(user, [])],
                          window, data["end"])
    return [(t, n / limit[t]) for t, n in data["streams"].get(user, [])
            if limit.get(t) and any(lo <= t <= hi for lo, hi in spans)]


def _limit_text(user: str, limit: Series, unlimited: set[str]) -> str:
    if user in unlimited:
        return f"unlimited: limit {max(v for _, v in limit[user]):g} tok/s not drawn"
    if user in limit:
        return f"limit {max(v for _, v in limit[user]):g} tok/s"
    return "no limit scraped"


def spacing_figure(data: dict[str, Any], start: float, xlabel: str) -> Any:
    """One panel per user with spacing data: its quantiles and, for a limited
    user, streams/limit (each stream's spacing when the user is throttled)."""
    import matplotlib.pyplot as plt

    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    quantiles, limit = data["spacing"], data["limit"]
    unlimited = unlimited_users(data["rate"], limit)
    users = sorted({u for series in quantiles.values() for u in series})
    n = max(len(users), 1)
    cols = min(n, 2)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(7 * cols, 3.6 * rows), squeeze=False)
    for i, user in enumerate(users):
        ax = axes[i // cols][i % cols]
        for j, (name, series) in enumerate(quantiles.items()):
            if user in series:
                ax.plot(*_xs(series[user], start), label=name, color=colors[j % len(colors)])
        line = [] if user in unlimited else spacing_line(data, user)
        if line:
            ax.plot(*_xs(line, start), linestyle="--", color="red", linewidth=2,
                    label="streams/limit (throttled stream's spacing)")
        ax.set_yscale("log")
        ax.set_title(f"engine-side inter-token spacing: {user} ({_limit_text(user, limit, unlimited)})",
                     fontsize=10)
        ax.set_ylabel("seconds")
        ax.set_xlabel(xlabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    for k in range(len(users), rows * cols):
        axes[k // cols][k % cols].axis("off")
    fig.tight_layout()
    return fig


def rate_figure(data: dict[str, Any], start: float, xlabel: str) -> Any:
    """Each user's rate with its limit dashed; users without traffic and the
    lines of unlimited users left out, the legend beside the axes."""
    import matplotlib.pyplot as plt

    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    rate, limit = data["rate"], data["limit"]
    unlimited = unlimited_users(rate, limit)
    fig, ax = plt.subplots(figsize=(11, 4.5))
    for i, user in enumerate(with_traffic(rate)):
        color = colors[i % len(colors)]
        ax.plot(*_xs(rate[user], start), color=color,
                label=f"{user} tok/s" + (" (unlimited)" if user in unlimited else ""))
        if user in limit and user not in unlimited:
            ax.plot(*_xs(limit[user], start), color=color, linestyle="--", linewidth=2,
                    label=f"{user} limit")
    ax.set_yscale("log")
    ax.set_title("output tokens/s per user (charged, engine-side) vs configured limit (dashed)")
    ax.set_ylabel("tokens / s")
    ax.set_xlabel(xlabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    return fig


def throttled_figure(data: dict[str, Any], start: float, xlabel: str) -> Any:
    """Throttled requests and their KV blocks per user, the KV cache's share."""
    import matplotlib.pyplot as plt

    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, axes = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    for ax, series, title, unit in (
            (axes[0], data["throttled"], "throttled requests per user (resident, holding KV)", "requests"),
            (axes[1], data["blocks"], "KV blocks held by throttled requests, per user", "blocks")):
        for i, user in enumerate(sorted(series)):
            ax.plot(*_xs(series[user], start), color=colors[i % len(colors)], label=user)
        ax.set_title(title)
        ax.set_ylabel(unit)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    for engine, points in sorted(data["share"].items()):
        axes[2].plot(*_xs(points, start), label=f"held by throttled requests, engine {engine}")
    for engine, points in sorted(data["usage"].items()):
        axes[2].plot(*_xs(points, start), linestyle="--", label=f"vLLM KV usage, engine {engine}")
    axes[2].set_title("share of the KV cache")
    axes[2].set_ylabel("share (0..1)")
    axes[2].set_xlabel(xlabel)
    axes[2].grid(True, alpha=0.3)
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    return fig


#: The charts and the functions that draw them from ``fetch``'s data.
FIGURES = {"spacing.png": spacing_figure, "rate_vs_limit.png": rate_figure,
           "throttled_kv.png": throttled_figure}
#: The charts ``draw`` writes.
PICTURES = tuple(FIGURES)


def draw(prom: Prom, start: float, end: float, step: str, out: Path, config: Config) -> dict[str, Any]:
    """Query ``prom`` and write ``PICTURES`` into ``out``; the data drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = fetch(prom, start, end, step, config)
    when = datetime.fromtimestamp(start, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    for name, figure in FIGURES.items():
        fig = figure(data, start, f"seconds since {when}")
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
    return data


def _fmt(value: float | None, digits: int = 3) -> str:
    if value is None or math.isnan(value):
        return "-"
    return f"{value:.{digits}g}"


def summary(prom: Prom, start: float, end: float, data: dict[str, Any], config: Config) -> str:
    """Per user over the whole range: limit, rate, spacing quantiles, throttling."""
    span = end - start
    spacing = config.sel("inter_token_seconds", "_bucket")
    exact_q = {q: prom.instant(f"histogram_quantile({q}, sum by (user, le) (increase({spacing}[$__range])))",
                               end, range_s=span) for q in (0.5, 0.99)}
    tokens = prom.instant(f"sum by (user) (increase({config.sel('tokens_charged')}[$__range]))",
                          end, range_s=span)
    rate, limit = data["rate"], data["limit"]
    unlimited = unlimited_users(rate, limit)
    users = sorted({*with_traffic(rate), *(u for u, n in tokens.items() if n)})
    factor = over_limit_factor(config)
    lines = [
        "# Output-rate pictures",
        "",
        f"Prometheus `{prom.url}`, {datetime.fromtimestamp(start, timezone.utc):%Y-%m-%d %H:%M:%S} to "
        f"{datetime.fromtimestamp(end, timezone.utc):%H:%M:%S} UTC ({span:.0f} s); filters "
        + ", ".join(f"`{k}=~\"{v}\"`" for k, v in prom.variables.items())
        + f"; rates over {prom.rate_interval}.",
        "",
        "Charts: `spacing.png` (engine-side inter-token spacing per user, dashed: streams/limit), "
        "`rate_vs_limit.png` (output tokens/s vs limit), `throttled_kv.png` (throttled requests, "
        "their KV blocks, share of the KV cache).",
        "",
        "| user | limit tok/s | tokens (≈) | mean tok/s | max tok/s | max rate/limit | spacing p50 | spacing p99 | time throttled | max throttled req. | max KV blocks |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    over = []
    for user in users:
        lim = max((v for _, v in limit.get(user, [])), default=None)
        rates = [v for _, v in rate.get(user, [])]
        ratio = max(rates) / lim if rates and lim else None
        if ratio is not None and ratio > factor:
            over.append(user)
        thr = [v for _, v in data["throttled"].get(user, [])]
        lines.append("| " + " | ".join([
            user, _fmt(lim) + (" (unlimited)" if user in unlimited else ""), f"{tokens[user]:.0f}" if user in tokens else "-", _fmt(tokens.get(user, 0) / span if span else None),
            _fmt(max(rates, default=None)), f"{100 * ratio:.0f}%" if ratio is not None else "-",
            _fmt(exact_q[0.5].get(user)) + " s" if user in exact_q[0.5] else "-",
            _fmt(exact_q[0.99].get(user)) + " s" if user in exact_q[0.99] else "-",
            f"{100 * sum(v > 0 for v in thr) / len(thr):.0f}%" if thr else "-",
            _fmt(max(thr, default=None)),
            _fmt(max((v for _, v in data["blocks"].get(user, [])), default=None)),
        ]) + " |")
    share = max((v for points in data["share"].values() for _, v in points), default=None)
    usage = max((v for points in data["usage"].values() for _, v in points), default=None)
    lines += [
        "",
        f"- Max share of the KV cache held by throttled requests: {_fmt(share)} "
        f"(vLLM's own KV usage peaked at {_fmt(usage)}).",
        f"- Users whose {prom.rate_interval} rate exceeded {100 * factor:.1f}% of their limit: "
        + (", ".join(over) if over else "none") + " (the over-limit alert judges over "
        f"{config.over['window']} and allows one token more).",
        "- Tokens are Prometheus' increase() over the range (extrapolated to its edges, so "
        "approximate); rates are over the rate window, limits the highest configured.",
        "- Spacing quantiles are exact over the whole range (from the engine-side histogram); "
        "a throttled user with n active streams spaces each stream's tokens about n/limit apart.",
        "",
    ]
    return "\n".join(lines)


class LocalPrometheus:
    """A Prometheus on loopback (``prometheus`` on PATH: ``make tools``)
    scraping one target (``host:port``) every second, its data in
    ``workdir``; a context manager."""

    def __init__(self, workdir: Path, target: str) -> None:
        from vllm_output_rate.tools.common.client import free_port

        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = self.workdir / "prometheus.yml"
        self.config.write_text(
            "global: {scrape_interval: 1s, scrape_timeout: 1s, evaluation_interval: 1s}\n"
            f"scrape_configs: [{{job_name: vllm, static_configs: [{{targets: ['{target}']}}]}}]\n")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 60.0) -> LocalPrometheus:
        log = open(self.workdir / "prometheus.log", "wb")
        self.proc = subprocess.Popen(
            ["prometheus", f"--config.file={self.config}",
             f"--storage.tsdb.path={self.workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        if wait_ready(self.proc, f"{self.url}/-/ready", timeout_s, 0.5):
            return self
        if self.proc.poll() is not None:
            raise RuntimeError(f"prometheus exited; log: {self.workdir / 'prometheus.log'}")
        self.stop()
        raise TimeoutError("prometheus not ready")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> LocalPrometheus:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def pictures(prometheus: str, start: float, end: float, out: Path, rate_interval: str = "15s",
             user: str = ".*") -> str:
    """Draw the key panels and write ``summary.md`` into ``out``; the summary."""
    out.mkdir(parents=True, exist_ok=True)
    step = f"{max((end - start) / 300, 1):.0f}s"
    prom = Prom(prometheus, {"model_name": ".*", "engine": ".*", "user": user}, rate_interval)
    config = Config.load()
    text = summary(prom, start, end, draw(prom, start, end, step, out, config), config)
    (out / "summary.md").write_text(text)
    return text


def shrink_png(path: Path, colors: int = 64) -> None:
    """Rewrite a chart as a palette PNG (a few times smaller, same look)."""
    from PIL import Image

    with Image.open(path) as image:
        small = image.convert("RGB").quantize(colors=colors, method=Image.Quantize.MEDIANCUT)
    small.save(path, optimize=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--prometheus", required=True, help="Prometheus base URL")
    parser.add_argument("--start", help="unix seconds or ISO 8601")
    parser.add_argument("--end", help="unix seconds or ISO 8601 (default: now)")
    parser.add_argument("--last", help="instead of --start: the last N (e.g. 15m, 1h)")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--model-name", default=".*", help="regex on model_name")
    parser.add_argument("--engine", default=".*", help="regex on engine")
    parser.add_argument("--user", default=".*", help="regex on user")
    parser.add_argument("--step", default=None, help="query resolution (default: range / 300)")
    parser.add_argument("--rate-interval", default="1m",
                        help="rate() window (Grafana's $__rate_interval; at least 4 scrape intervals)")
    args = parser.parse_args(argv)

    end = parse_time(args.end) if args.end else time.time()
    if args.last:
        start = end - seconds(args.last)
    elif args.start:
        start = parse_time(args.start)
    else:
        parser.error("give --start or --last")
    if start >= end:
        parser.error("the range is empty")
    step = args.step or f"{max((end - start) / 300, 1):.0f}s"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prom = Prom(args.prometheus, {"model_name": args.model_name, "engine": args.engine, "user": args.user},
                args.rate_interval)
    config = Config.load()
    data = draw(prom, start, end, step, out, config)
    text = summary(prom, start, end, data, config)
    (out / "summary.md").write_text(text)
    print(text)
    print(f"wrote {', '.join(sorted(p.name for p in out.iterdir()))} in {out}{os.sep}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
