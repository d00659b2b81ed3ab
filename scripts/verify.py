"""Engine-side ITL verification: run a scenario, then check the engine's own
per-token timestamps against the limits.

``vllm-output-rate verify [--server URL --events FILE | --model DIR]
[--scenario FILE] [--report DIR]``

With ``--model`` it starts ``vllm-output-rate serve`` on that model with the
scenario's limits and server flags, turns on the engine event log
(``OUTPUT_RATE_EVENTS``), runs the scenario, stops the server. With
``--server`` the server must already write its event log to ``--events``.
Then, from the engine-side events (``tokens`` per step, ``finished`` per
request, ``throttled`` about once a second, ``start``) and vLLM's
``/metrics``, it checks per user:

* ``gcra_bound``: in every window between two token events, tokens <=
  floor((W + burst) x limit) + 1 with the limiter's burst
  (``vllm_output_rate.limiter.BURST_NS``; see "Step slack" in the report);
* ``rate``: the achieved rate >= ``rate_min_ratio`` x limit while the user's
  demand exceeded it (while at least one of its requests was generating);
* ``spacing``: the per-stream spacing p50 within ``spacing_tolerance`` of
  streams / limit (streams counted at each moment);
* ``complete``: every non-cancelled response complete, ``completion_tokens``
  = the engine's token count = the engine's ``output_tokens``;
* ``freed``: cancelled requests finished in the engine, nothing throttled,
  running, waiting or holding KV after the run;
* ``resumed``: the user was throttled, every request came back and finished,
  no request stalled;
* ``charged``: the engine charged at least what it produced;
* ``unlimited``: an unlimited user's spacing p50 beside the limited load at
  most ``unlimited_max_ratio`` x its p50 alone;
* ``limits``, ``events``, ``prefix_cache``: the run tested what it claims.

Writes ``report.md`` and PNG plots into the report directory; exit 0 only
when every check holds, 1 when one fails, 2 when the run could not be made.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

from vllm_output_rate import settings
from vllm_output_rate.limiter import BURST_NS, NS_PER_S
from vllm_output_rate.telemetry.events import EngineLog
from vllm_output_rate.telemetry.metrics import series_name
from vllm_output_rate.tools.loadgen import (
    RequestRecord,
    RunRecord,
    Scenario,
    ScenarioError,
    load_scenario,
    run_with_progress,
)
from vllm_output_rate.tools.common.stats import quantile

#: Environment variable of the engine core naming its event log (JSON lines).
EVENTS_ENV = settings.name("EVENTS")
#: vLLM 0.32 builds the engine request id of a chat completion as
#: "chatcmpl-<X-Request-Id>-<8 hex>".
ENGINE_ID_PREFIX = "chatcmpl-"
#: A request may stall between two tokens at most this many times its
#: expected spacing (streams / limit), plus the scenario's
#: ``checks.stall_extra_s`` (1 s unless it says otherwise).
STALL_FACTOR = 4.0
#: An unlimited user's limit must be this many times above its achieved rate.
UNLIMITED_HEADROOM = 10.0


# --------------------------------------------------------------------------- engine request ids


def base_request_id(engine_id: str) -> str:
    """The client's X-Request-Id inside vLLM's engine request id."""
    if engine_id.startswith(ENGINE_ID_PREFIX):
        engine_id = engine_id[len(ENGINE_ID_PREFIX):]
    head, sep, tail = engine_id.rpartition("-")
    return head if sep and len(tail) == 8 else engine_id


# --------------------------------------------------------------------------- analysis


@dataclass
class ReqData:
    rec: RequestRecord
    engine_ids: list[str] = field(default_factory=list)
    #: (t_ns, n tokens) per engine step that produced tokens for it
    tokens: list[tuple[int, int]] = field(default_factory=list)
    finished: dict[str, Any] | None = None

    @property
    def engine_count(self) -> int:
        return sum(n for _, n in self.tokens)

    @property
    def first_ns(self) -> int | None:
        return self.tokens[0][0] if self.tokens else None

    @property
    def last_ns(self) -> int | None:
        return self.tokens[-1][0] if self.tokens else None

    @property
    def cancelled(self) -> bool:
        """The client closed the stream before the answer ended."""
        return self.rec.cancelled

    def spacings_ns(self) -> list[tuple[int, int]]:
        """(time of the later token, gap) between consecutive token events;
        a step with k tokens adds one gap and k - 1 zeros."""
        out = []
        for (t0, _), (t1, n1) in zip(self.tokens, self.tokens[1:]):
            out.append((t1, t1 - t0))
            out.extend((t1, 0) for _ in range(n1 - 1))
        return out


@dataclass
class Metrics:
    """Scrapes of /metrics: before the run, after it, and after the idle probe."""

    before: dict | None = None
    after: dict | None = None
    final: dict | None = None
    error: str | None = None


@dataclass
class Analysis:
    scenario: Scenario
    run: RunRecord
    log: EngineLog
    metrics: Metrics = field(default_factory=Metrics)
    #: engine steps a dispatch may precede the previous output by (1 sync, 2 async)
    lag: int = 1
    reqs: dict[str, ReqData] = field(default_factory=dict)
    unmatched_engine_ids: int = 0

    def __post_init__(self) -> None:
        by_rid = {r.rid: ReqData(r) for r in self.run.requests}
        for t_ns, toks in self.log.steps:
            for eid, _user, n in toks:
                rd = by_rid.get(base_request_id(eid))
                if rd is None:
                    continue
                if eid not in rd.engine_ids:
                    rd.engine_ids.append(eid)
                rd.tokens.append((t_ns, n))
        for eid, ev in self.log.finished.items():
            rd = by_rid.get(base_request_id(eid))
            if rd is not None:
                rd.finished = ev
                if eid not in rd.engine_ids:
                    rd.engine_ids.append(eid)
        self.reqs = by_rid

    # -- selections

    def user_reqs(self, user: str, phase: str | None = None) -> list[ReqData]:
        return [rd for rd in self.reqs.values()
                if rd.rec.user == user and (phase is None or rd.rec.phase == phase)]

    def users_in_run(self) -> list[str]:
        seen: dict[str, None] = {}
        for r in self.run.requests:
            seen.setdefault(r.user, None)
        return list(seen)

    def user_events(self, user: str, phase: str | None = None) -> list[tuple[int, int]]:
        """(t_ns, tokens) of the user's steps, tokens of one step summed."""
        agg: dict[int, int] = defaultdict(int)
        for rd in self.user_reqs(user, phase):
            for t, n in rd.tokens:
                agg[t] += n
        return sorted(agg.items())

    def run_window_ns(self) -> tuple[int, int] | None:
        ts = [t for rd in self.reqs.values() for t, _ in rd.tokens]
        ts += [int(rd.finished["t_ns"]) for rd in self.reqs.values() if rd.finished]
        return (min(ts), max(ts)) if ts else None

    def start_event(self) -> dict[str, Any] | None:
        """The start line of the engine that served this run."""
        window = self.run_window_ns()
        if not self.log.starts:
            return None
        if window is None:
            return self.log.starts[-1]
        before = [s for s in self.log.starts if int(s["t_ns"]) <= window[0]]
        return before[-1] if before else self.log.starts[0]

    def limits_in_force(self) -> dict[str, Any] | None:
        """The start line of the engine that served this run, its limits
        replaced by the last live change (a reloaded limits file) that
        engine made after its start line (which states the limits of its
        moment) and before the run's first event: what the engine enforced
        when the run began."""
        start = self.start_event()
        window = self.run_window_ns()
        if start is None or window is None:
            return start
        t0 = int(start["t_ns"])
        later = [int(s["t_ns"]) for s in self.log.starts if int(s["t_ns"]) > t0]
        t1 = min([window[0] + 1, *later])
        changes = [c for c in self.log.limit_changes if t0 < int(c["t_ns"]) < t1]
        if not changes:
            return start
        last = changes[-1]
        return {**start, "limits": last["limits"], "default_limit": last.get("default_limit")}

    def limit_changes_in_run(self) -> list[dict[str, Any]]:
        """Live limit changes put in force while this run's requests ran."""
        window = self.run_window_ns()
        if window is None:
            return []
        return [c for c in self.log.limit_changes if window[0] < int(c["t_ns"]) <= window[1]]

    def alive_count(self, user: str, t_ns: int) -> int:
        """The user's requests generating at ``t_ns`` (first token <= t <= last token)."""
        return sum(1 for rd in self.user_reqs(user)
                   if rd.tokens and rd.first_ns <= t_ns <= rd.last_ns)


@dataclass
class Check:
    name: str
    subject: str
    ok: bool
    summary: str
    details: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.name}[{self.subject}]"


def _frac(rate: Any) -> Fraction:
    return rate if isinstance(rate, Fraction) else Fraction(str(rate))


def gcra_worst_window(events: list[tuple[int, int]], rate: Fraction,
                      starts: list[int] | None = None, burst_ns: int = BURST_NS) -> dict[str, Any]:
    """The window with the largest excess over floor((W + burst) x rate) + 1.

    ``events``: (t_ns, tokens) sorted by time, one per step. A window runs from
    event i to event j (both included); its length W is t_j - starts[i] where
    ``starts[i]`` is the earliest moment event i's step can have been
    dispatched (t_i itself for the strict bound). Exact integer arithmetic.
    """
    import numpy as np

    if not events:
        return {"excess": -1, "violations": 0, "windows": 0}
    t = np.array([e[0] for e in events], dtype=np.int64)
    n = np.array([e[1] for e in events], dtype=np.int64)
    s = t if starts is None else np.array(starts, dtype=np.int64)
    s = np.minimum(s, t)
    cum = np.concatenate(([0], np.cumsum(n)))
    num, den = rate.numerator, rate.denominator * 1_000_000_000
    worst: dict[str, Any] = {"excess": None, "violations": 0, "windows": 0}
    big = num * (int(t[-1] - s.min()) + burst_ns) >= (1 << 62)
    for i in range(len(t)):
        w = t[i:] - s[i]
        tokens = cum[i + 1:] - cum[i]
        if big:
            bound = np.array([(int(x) + burst_ns) * num // den + 1 for x in w], dtype=object)
            excess = np.array(tokens, dtype=object) - bound
        else:
            bound = (w + burst_ns) * num // den + 1
            excess = tokens - bound
        k = int(np.argmax(excess))
        worst["windows"] += len(w)
        bad = int(np.count_nonzero(excess > 0))
        worst["violations"] += bad
        if worst["excess"] is None or excess[k] > worst["excess"]:
            worst.update(excess=int(excess[k]), tokens=int(tokens[k]), bound=int(bound[k]),
                         window_s=int(t[i + k] - t[i]) / 1e9, from_ns=int(t[i]),
                         to_ns=int(t[i + k]), slack_s=int(t[i] - s[i]) / 1e9)
    return worst


def gcra_max_excess(events: list[tuple[int, int]], rate: Fraction, starts: list[int] | None = None,
                    burst_ns: int = BURST_NS) -> tuple[Fraction, tuple[int, int]]:
    """The largest ``tokens - (W + burst) x rate - 1`` over every window of
    ``events`` (as in ``gcra_worst_window``: event i to event j, W = t_j -
    starts[i]), and its (i, j), in one pass: for soak-length runs.

    Tokens are whole numbers, so a window holds at most ``floor((W + burst)
    x rate) + 1`` of them exactly when this excess is <= 0 (``C - 1 <=
    floor(x)`` iff ``C - 1 <= x``): the same verdict as
    ``gcra_worst_window``, exact (integer arithmetic), in O(n). Empty:
    (-1, (0, 0))."""
    if not events:
        return Fraction(-1), (0, 0)
    num, den = rate.numerator, rate.denominator * NS_PER_S
    # excess(i, j) x den = (den C_j - num t_j) + (num s_i - den C_{i-1}) - num burst - den,
    # with C the running token count: the best i for each j is a running maximum
    best: int | None = None
    where = (0, 0)
    lead = lead_i = None
    before = 0  # C_{i-1}
    for k, (t, n) in enumerate(events):
        s = t if starts is None else min(starts[k], t)
        here = num * s - den * before
        if lead is None or here > lead:
            lead, lead_i = here, k
        before += n
        value = den * before - num * t + lead
        if best is None or value > best:
            best, where = value, (lead_i, k)
    return Fraction(best - num * burst_ns - den, den), where


def demand_segments(reqs: list[ReqData]) -> list[tuple[int, int]]:
    """Union of the requests' [first token, last token] intervals."""
    spans = sorted((rd.first_ns, rd.last_ns) for rd in reqs if rd.tokens)
    out: list[list[int]] = []
    for a, b in spans:
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


@dataclass
class UserStats:
    user: str
    limit: Fraction | None
    requests: int
    tokens: int
    demand_s: float
    rate: float
    #: per-stream spacing p50 (ms) and the expected streams / limit (ms) at those moments
    spacing_p50_ms: float
    expected_ms: float
    normalized_p50: float
    user_spacing_p50_ms: float
    max_streams: int
    gcra: dict[str, Any] = field(default_factory=dict)
    gcra_strict: dict[str, Any] = field(default_factory=dict)


def user_stats(a: Analysis, user: str) -> UserStats:
    limit = a.scenario.users.get(user)
    reqs = [rd for rd in a.user_reqs(user) if rd.tokens]
    events = a.user_events(user)
    segs = demand_segments(reqs)
    tokens = sum(n for _, n in events)
    demand_ns = sum(b - a_ for a_, b in segs)
    in_demand = sum(n for t, n in events if any(a_ <= t <= b for a_, b in segs))
    rate = (in_demand - len(segs)) / (demand_ns / 1e9) if demand_ns > 0 else 0.0
    normalized, raw, expected = [], [], []
    max_streams = 0
    alive_cache: dict[int, int] = {}
    for rd in reqs:
        for t1, gap in rd.spacings_ns():
            mid = t1 - gap // 2
            if mid not in alive_cache:
                alive_cache[mid] = a.alive_count(user, mid)
            k = max(alive_cache[mid], 1)
            max_streams = max(max_streams, k)
            raw.append(gap / 1e6)
            if limit is not None:
                exp_ms = k / float(limit) * 1e3
                expected.append(exp_ms)
                normalized.append(gap / 1e6 / exp_ms)
    user_gaps = [(t1 - t0) / 1e6 for (t0, _), (t1, _) in zip(events, events[1:])]
    user_gaps += [0.0] * sum(n - 1 for _, n in events)
    st = UserStats(user, limit, len(a.user_reqs(user)), tokens, demand_ns / 1e9, rate,
                   quantile(raw, 0.5), quantile(expected, 0.5), quantile(normalized, 0.5),
                   quantile(user_gaps, 0.5), max_streams)
    if limit is not None:
        st.gcra = gcra_worst_window(events, limit, a.log.dispatch_lower_bounds((t for t, _ in events), a.lag))
        st.gcra_strict = gcra_worst_window(events, limit)
    return st


def phase_spacing_ms(a: Analysis, user: str, phase: str) -> list[float]:
    return [gap / 1e6 for rd in a.user_reqs(user, phase) for _, gap in rd.spacings_ns()]


# --------------------------------------------------------------------------- checks


#: telemetry_dropped reasons that mean the event log has gaps
EVENT_DROP_REASONS = ("events_queue_full", "events_write_failed")


def check_events(a: Analysis) -> list[Check]:
    details = []
    if not a.log.starts:
        details.append("no start line: the engine did not write its event log "
                       f"(is {EVENTS_ENV} set in the server's environment and telemetry on?)")
    sent = [rd for rd in a.reqs.values() if rd.rec.sent]
    silent = [rd.rec.rid for rd in sent if not rd.tokens and rd.finished is None]
    if silent:
        details.append(f"{len(silent)} request(s) with no engine event at all: "
                       + ", ".join(silent[:8]))
    m = a.metrics
    if m.before is not None and m.after is not None:
        dropped = series_name("telemetry_dropped")
        for reason in EVENT_DROP_REASONS:
            n = (_metric(m.after, dropped, reason=reason) or 0.0) \
                - (_metric(m.before, dropped, reason=reason) or 0.0)
            if n > 0:
                details.append(f"the engine dropped {n:.0f} event(s) ({reason}): the log is incomplete")
    if a.log.bad_lines:
        details.append(f"{len(a.log.bad_lines)} unreadable line(s), e.g. line {a.log.bad_lines[0]}")
    n_tok = sum(rd.engine_count for rd in a.reqs.values())
    return [Check("events", "all", not details,
                  f"{len(a.log.steps)} engine steps with tokens, {n_tok} tokens of {len(sent)} "
                  f"requests of this run, {sum(rd.finished is not None for rd in sent)} "
                  "of them finished", details)]


def engine_limit(start: dict[str, Any], user: str) -> Fraction | None:
    limits = start.get("limits") or {}
    value = limits.get(user, start.get("default_limit"))
    return None if value is None else _frac(value)


def check_limits(a: Analysis, stats: dict[str, UserStats]) -> list[Check]:
    start = a.limits_in_force()
    changed = a.limit_changes_in_run()
    window = a.run_window_ns()
    out = []
    for user in a.users_in_run():
        expected = a.scenario.users.get(user)
        got = engine_limit(start, user) if start else None
        moved = [c for c in changed if engine_limit({**start, **c}, user) != got] if start else []
        if got is None:
            out.append(Check("limits", user, False, "the engine reported no limits"))
        elif moved:
            out.append(Check("limits", user, False, "the engine's limit changed during the run: "
                             + ", ".join(f"{float(engine_limit({**start, **c}, user)):g} tok/s at "
                                         f"+{(int(c['t_ns']) - window[0]) / 1e9:.1f} s"
                                         for c in moved)
                             + f" (was {float(got):g}); the scenario's checks assume one limit"))
        elif expected is not None:
            out.append(Check("limits", user, got == expected,
                             f"engine limit {float(got):g} tok/s, expected {float(expected):g}"))
        else:
            rate = stats[user].rate if user in stats else 0.0
            ok = float(got) >= UNLIMITED_HEADROOM * max(rate, 1.0)
            out.append(Check("limits", user, ok,
                             f"unlimited: engine limit {float(got):g} tok/s, "
                             f"{UNLIMITED_HEADROOM:g}x above its achieved {rate:.0f} tok/s"
                             + ("" if ok else " does NOT hold")))
    return out


def check_gcra(a: Analysis, stats: dict[str, UserStats]) -> list[Check]:
    out = []
    for user, st in stats.items():
        if st.limit is None:
            continue
        g = st.gcra
        if not g or g.get("excess") is None or g["windows"] == 0:
            out.append(Check("gcra_bound", user, False, "no token events for this user"))
            continue
        ok = g["excess"] <= 0
        summary = (f"{g['windows']} windows; worst: {g['tokens']} tokens in {g['window_s']:.3f} s "
                   f"(+{g['slack_s'] * 1e3:.1f} ms step slack), bound {g['bound']}"
                   + ("" if ok else f" -> {g['violations']} window(s) over the bound"))
        details = []
        s = st.gcra_strict
        if s and s.get("violations"):
            details.append(f"without step slack: {s['violations']} window(s) over, worst by "
                           f"{s['excess']} token(s) ({s['tokens']} in {s['window_s']:.3f} s)")
        out.append(Check("gcra_bound", user, ok, summary, details))
    return out


def check_rate(a: Analysis, stats: dict[str, UserStats]) -> list[Check]:
    ratio = a.scenario.checks.rate_min_ratio
    out = []
    for user, st in stats.items():
        if st.limit is None:
            continue
        lim = float(st.limit)
        ok = st.demand_s > 0 and st.rate >= ratio * lim
        out.append(Check("rate", user, ok,
                         f"{st.rate:.2f} tok/s over {st.demand_s:.1f} s of demand = "
                         f"{st.rate / lim:.3f} x limit {lim:g} (need >= {ratio:g})"))
    return out


def check_spacing(a: Analysis, stats: dict[str, UserStats]) -> list[Check]:
    tol = a.scenario.checks.spacing_tolerance
    out = []
    for user, st in stats.items():
        if st.limit is None:
            continue
        ok = not math.isnan(st.normalized_p50) and abs(st.normalized_p50 - 1) <= tol
        out.append(Check("spacing", user, ok,
                         f"per-stream spacing p50 {st.spacing_p50_ms:.1f} ms, streams/limit "
                         f"{st.expected_ms:.1f} ms; p50 of spacing/(streams/limit) = "
                         f"{st.normalized_p50:.3f} (need 1 +- {tol:g})"))
    return out


def _request_problems(rd: ReqData) -> list[str]:
    r = rd.rec
    fin = rd.finished
    probs = []
    if r.error:
        return [f"client error: {r.error}"]
    if fin is None:
        probs.append("no finished event in the engine")
    if r.cancelled:
        if fin is not None and fin.get("output_tokens") is not None \
                and int(fin["output_tokens"]) < r.completion_tokens:
            probs.append(f"engine finished with {fin['output_tokens']} tokens, "
                         f"client saw {r.completion_tokens}")
        return probs
    if r.finish_reason is None:
        probs.append("stream ended without a finish reason")
    if fin is not None and fin.get("reason") == "abort":
        probs.append("aborted in the engine")
    if r.completion_tokens != rd.engine_count:
        probs.append(f"completion_tokens {r.completion_tokens} != engine tokens {rd.engine_count}")
    if fin is not None and fin.get("output_tokens") is not None \
            and int(fin["output_tokens"]) != r.completion_tokens:
        probs.append(f"completion_tokens {r.completion_tokens} != engine output_tokens "
                     f"{fin['output_tokens']}")
    if r.ignore_eos:
        if r.completion_tokens != r.max_tokens or r.finish_reason not in (None, "length"):
            probs.append(f"{r.completion_tokens}/{r.max_tokens} tokens, finish "
                         f"{r.finish_reason!r} (ignore_eos: expected all, 'length')")
    elif r.finish_reason not in (None, "stop", "length") or r.completion_tokens > r.max_tokens:
        probs.append(f"{r.completion_tokens}/{r.max_tokens} tokens, finish {r.finish_reason!r}")
    return probs


def check_complete(a: Analysis) -> list[Check]:
    out = []
    for user in a.users_in_run():
        reqs = a.user_reqs(user)
        bad = [(rd.rec.rid, p) for rd in reqs for p in _request_problems(rd)]
        done = [rd for rd in reqs if not rd.cancelled]
        out.append(Check("complete", user, not bad,
                         f"{len(done)} answers ({sum(rd.rec.completion_tokens for rd in done)} "
                         f"tokens) complete, counts match the engine; "
                         f"{len(reqs) - len(done)} cancelled by the client"
                         if not bad else f"{len({rid for rid, _ in bad})} request(s) not complete",
                         [f"{rid}: {p}" for rid, p in bad[:20]]))
    return out


def _metric(samples: dict | None, name: str, **labels: str) -> float | None:
    if samples is None:
        return None
    from vllm_output_rate.tools.common.client import metric_value

    if not any(n == name for n, _ in samples):
        return None
    return metric_value(samples, name, **labels)


#: gauges that must be back at 0 once the run is over
IDLE_GAUGES = (series_name("engine_throttled_requests"), series_name("engine_throttled_kv_blocks"),
               "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


def check_freed(a: Analysis) -> list[Check]:
    details = []
    cancelled = [rd for rd in a.reqs.values() if rd.cancelled]
    for rd in cancelled:
        if rd.finished is None:
            details.append(f"{rd.rec.rid}: cancelled by the client, never finished in the engine")
    window = a.run_window_ns()
    last = a.log.throttled[-1] if a.log.throttled else None
    if last is None:
        details.append("no throttled-state line in the engine log")
    elif window is not None and int(last["t_ns"]) < window[1]:
        details.append("no throttled-state line after the run's last event")
    elif sum((last.get("requests") or {}).values()) or sum((last.get("kv_blocks") or {}).values()):
        details.append(f"engine still reports throttled requests/KV after the run: "
                       f"{last.get('requests')} / {last.get('kv_blocks')}")
    final = a.metrics.final
    if final is None:
        details.append(f"/metrics after the run unavailable: {a.metrics.error or 'not scraped'}")
    else:
        for name in IDLE_GAUGES:
            v = _metric(final, name)
            if v is None:
                details.append(f"{name} missing from /metrics")
            elif abs(v) > 1e-9:
                details.append(f"{name} = {v:g} after the run (expected 0)")
    return [Check("freed", "all", not details,
                  f"{len(cancelled)} cancelled request(s) finished in the engine; after the run "
                  "nothing throttled, running, waiting or holding KV" if not details
                  else "resources left behind after the run", details)]


def check_resumed(a: Analysis, stats: dict[str, UserStats]) -> list[Check]:
    out = []
    for user, st in stats.items():
        if st.limit is None:
            continue
        details = []
        seen_throttled = any((ev.get("requests") or {}).get(user, 0) > 0 for ev in a.log.throttled)
        skipped = None
        if a.metrics.before is not None and a.metrics.after is not None:
            skipped_name = series_name("requests_skipped")
            b = _metric(a.metrics.before, skipped_name, user=user) or 0.0
            e = _metric(a.metrics.after, skipped_name, user=user)
            skipped = None if e is None else e - b
        if not seen_throttled and not skipped:
            details.append("the user was never throttled: the run did not exercise the limit")
        expected_s = max(st.max_streams, 1) / float(st.limit)
        stall_ns = int((STALL_FACTOR * expected_s + a.scenario.checks.stall_extra_s) * 1e9)
        worst = (0, "")
        for rd in a.user_reqs(user):
            if not rd.cancelled and (rd.finished is None or rd.finished.get("reason") == "abort"):
                details.append(f"{rd.rec.rid}: did not finish (throttled, never resumed?)")
            for _, gap in rd.spacings_ns():
                if gap > worst[0]:
                    worst = (gap, rd.rec.rid)
        if worst[0] > stall_ns:
            details.append(f"{worst[1]}: stalled {worst[0] / 1e9:.2f} s between two tokens "
                           f"(allowed {stall_ns / 1e9:.2f} s)")
        out.append(Check("resumed", user, not details,
                         f"throttled ({'skipped %d request-steps' % skipped if skipped else 'seen in the engine log'}); "
                         f"every request resumed; longest gap {worst[0] / 1e9:.2f} s "
                         f"<= {stall_ns / 1e9:.2f} s" if not details else "throttled requests not resumed",
                         details))
    return out


def check_charged(a: Analysis) -> list[Check]:
    if a.metrics.before is None or a.metrics.after is None:
        return [Check("charged", "all", False,
                      f"/metrics unavailable: {a.metrics.error or 'not scraped'}")]
    out = []
    charged_name = series_name("tokens_charged")
    for user in a.users_in_run():
        produced = sum(rd.engine_count for rd in a.user_reqs(user))
        after = _metric(a.metrics.after, charged_name, user=user)
        if after is None:
            out.append(Check("charged", user, False, f"{charged_name} missing"))
            continue
        before = _metric(a.metrics.before, charged_name, user=user) or 0.0
        charged = after - before
        n_req = len(a.user_reqs(user))
        ok = produced <= charged <= produced + n_req
        out.append(Check("charged", user, ok,
                         f"charged {charged:.0f}, produced {produced} (need produced <= charged "
                         f"<= produced + {n_req} requests: one over-charged step each at most)"))
    return out


def check_unlimited(a: Analysis) -> list[Check]:
    c = a.scenario.checks
    if c.baseline_phase is None:
        return []
    out = []
    for user in a.scenario.unlimited_users():
        base = phase_spacing_ms(a, user, c.baseline_phase)
        comp = phase_spacing_ms(a, user, c.compare_phase)
        if not base or not comp:
            out.append(Check("unlimited", user, False,
                             f"no spacing samples in phase {c.baseline_phase!r} or {c.compare_phase!r}"))
            continue
        b50, c50 = quantile(base, 0.5), quantile(comp, 0.5)
        ratio = c50 / b50 if b50 > 0 else float("inf")
        ok = ratio <= c.unlimited_max_ratio
        out.append(Check("unlimited", user, ok,
                         f"spacing p50 alone {b50:.2f} ms, beside the limited users {c50:.2f} ms: "
                         f"ratio {ratio:.2f} (need <= {c.unlimited_max_ratio:g}); p90 "
                         f"{quantile(base, 0.9):.2f} -> {quantile(comp, 0.9):.2f} ms"))
    return out


def check_prefix_cache(a: Analysis) -> list[Check]:
    used = {r.prompt for r in a.run.requests}
    if not any(a.scenario.prompts[p].prefix for p in used if p in a.scenario.prompts):
        return []
    if a.metrics.before is None or a.metrics.after is None:
        return [Check("prefix_cache", "all", False, "/metrics unavailable")]
    hits = (_metric(a.metrics.after, "vllm:prefix_cache_hits_total") or 0.0) \
        - (_metric(a.metrics.before, "vllm:prefix_cache_hits_total") or 0.0)
    return [Check("prefix_cache", "all", hits > 0,
                  f"{hits:.0f} prompt tokens served from the prefix cache "
                  "(the scenario's shared prefixes hit)")]


def run_checks(a: Analysis) -> tuple[list[Check], dict[str, UserStats]]:
    stats = {u: user_stats(a, u) for u in a.users_in_run()}
    checks = (check_events(a) + check_limits(a, stats) + check_gcra(a, stats)
              + check_rate(a, stats) + check_spacing(a, stats) + check_complete(a)
              + check_resumed(a, stats) + check_freed(a) + check_charged(a)
              + check_unlimited(a) + check_prefix_cache(a))
    return checks, stats


# --------------------------------------------------------------------------- plots


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


# --------------------------------------------------------------------------- report


PLOTS = {"timeline.png": "Per-user token timeline", "spacing_cdf.png": "Spacing CDF per user",
         "throttled_kv.png": "Throttled requests and KV over time"}


def write_report(a: Analysis, checks: list[Check], stats: dict[str, UserStats], out_dir: Path,
                 notes: list[str] = ()) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    plots_ok = []
    for name, fn in (("timeline.png", plot_timeline),
                     ("spacing_cdf.png", lambda a_, p: plot_spacing_cdf(a_, stats, p)),
                     ("throttled_kv.png", plot_throttled)):
        try:
            import matplotlib

            matplotlib.use("Agg")
            fn(a, out_dir / name)
            plots_ok.append(name)
        except Exception as exc:  # a plot must not hide the verdict
            notes = [*notes, f"plot {name} failed: {type(exc).__name__}: {exc}"]
    ok = all(c.ok for c in checks)
    sc = a.scenario
    start = a.limits_in_force() or {}
    lines = [f"# Engine-side ITL verification: {'PASS' if ok else 'FAIL'}", "",
             f"Scenario `{sc.name}` ({sc.path}), run `{a.run.run_id}` against {a.run.base_url}; "
             f"{len(a.run.requests)} requests in {len(sc.phases)} phase(s)"
             + (" (the run hit its timeout)" if a.run.timed_out else "") + ".",
             f"Engine limits: default {start.get('default_limit')}, overrides "
             f"`{json.dumps(start.get('limits'))}`; expected: "
             + ", ".join(f"{u} {'unlimited' if r is None else f'{float(r):g}'}"
                         for u, r in sc.users.items()) + ".", ""]
    failed = [c for c in checks if not c.ok]
    if failed:
        lines += ["Failed: " + ", ".join(f"`{c.label}`" for c in failed), ""]
    lines += ["## Checks", "", "| check | result | measured |", "|---|---|---|"]
    for c in checks:
        lines.append(f"| `{c.label}` | {'pass' if c.ok else '**FAIL**'} | {c.summary} |")
        for d in c.details:
            lines.append(f"|  | | {d} |")
    lines += ["", "## Per user (engine-side)", "",
              "| user | limit tok/s | requests | tokens | demand s | rate tok/s | rate/limit | "
              "stream spacing p50 ms | streams/limit ms | user spacing p50 ms | worst window |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for user, st in stats.items():
        lim = "unlimited" if st.limit is None else f"{float(st.limit):g}"
        ratio = "" if st.limit is None else f"{st.rate / float(st.limit):.3f}"
        g = st.gcra
        worst = (f"{g['tokens']} tok in {g['window_s']:.2f} s (bound {g['bound']})"
                 if g.get("tokens") is not None else "")
        exp = "" if math.isnan(st.expected_ms) else f"{st.expected_ms:.1f}"
        lines.append(f"| {user} | {lim} | {st.requests} | {st.tokens} | {st.demand_s:.1f} | "
                     f"{st.rate:.2f} | {ratio} | {st.spacing_p50_ms:.2f} | {exp} | "
                     f"{st.user_spacing_p50_ms:.2f} | {worst} |")
    lines += ["", "## Requests", "",
              "| phase | user | requests | prompt | max_tokens | tokens | finish | cancelled | errors |",
              "|---|---|---|---|---|---|---|---|---|"]
    groups: dict[tuple, list[RequestRecord]] = defaultdict(list)
    for r in a.run.requests:
        groups[(r.phase, r.user, r.prompt, r.max_tokens)].append(r)
    for (phase, user, prompt, mt), rs in groups.items():
        fins = sorted({str(r.finish_reason) for r in rs})
        lines.append(f"| {phase} | {user} | {len(rs)} | {prompt} | {mt} | "
                     f"{'/'.join(str(r.completion_tokens) for r in rs)} | {', '.join(fins)} | "
                     f"{sum(r.cancelled for r in rs)} | {sum(r.error is not None for r in rs)} |")
    lines += ["", "## Plots", ""]
    lines += [f"![{PLOTS[p]}]({p})" for p in plots_ok]
    lines += ["", "## Method", "",
              "Every figure above comes from the engine core's own event log "
              f"(`{EVENTS_ENV}`): one `tokens` line per engine step with the step's output "
              "tokens per request, stamped when the step's output was processed; `finished` per "
              "request; the throttled state about once a second. Client-side times are not used "
              "for any check (HTTP buffering blurs them).", "",
              f"- **GCRA bound**: for every pair of token events i <= j of a user (both "
              f"included), tokens <= floor((W + {BURST_NS / 1e9:g} s) x limit) + 1, exact integer arithmetic. "
              f"*Step slack*: the limiter charges when a step is dispatched, the event is stamped "
              f"when its output is processed, so a token's stamp lags its charge by its step's "
              f"duration, which varies (a step with a long prefill takes longer). W is therefore "
              f"measured from the engine output {a.lag} step(s) before event i (the earliest "
              f"moment event i's step can have been dispatched: "
              f"{'synchronous scheduling dispatches a step after the previous output' if a.lag == 1 else 'async scheduling dispatches one step ahead'}) "
              f"to event j: exactly one engine step of slack, never a fixed time. The same check "
              f"without slack is reported in the details when it differs.",
              f"- **Rate**: demand exceeds the limit while at least one request of the user is "
              f"generating (from its first to its last token; one stream alone runs far above "
              f"every limit here, see the unlimited user's spacing). Rate = (tokens - segments) / "
              f"total length of the union of those intervals; need >= {sc.checks.rate_min_ratio:g} "
              f"x limit.",
              f"- **Spacing**: each gap between consecutive tokens of one request, divided by "
              f"k / limit with k the user's requests generating at the gap's midpoint; the p50 of "
              f"that ratio must be within {sc.checks.spacing_tolerance:g} of 1.",
              f"- **Unlimited users**: engine-side per-request spacing p50 in phase "
              f"`{sc.checks.compare_phase}` (beside the limited users) over phase "
              f"`{sc.checks.baseline_phase}` (alone) must be <= {sc.checks.unlimited_max_ratio:g}. "
              f"The tolerance is a ratio, not equality: a CPU step gets slower with every sequence "
              f"and every prefill in the batch, and the limited users still get their budget, so "
              f"some of the unlimited user's steps carry their tokens too; the median is robust to "
              f"the occasional long-prompt prefill step. Without the limiter the limited users' "
              f"streams would be in every step at full speed.",
              "- **Complete**: every request the client did not cancel: a finish reason, no "
              "error, `completion_tokens` = tokens in the engine's events = the engine's "
              "`output_tokens`; `ignore_eos` answers have all `max_tokens`.",
              f"- **Freed**: every cancelled request has a `finished` event; after the run the "
              f"last throttled-state line is all zero and {', '.join(IDLE_GAUGES)} are 0 on "
              f"/metrics. vLLM publishes its scheduler gauges with a step's output, so an abort "
              f"handled while the engine is idle can leave them stale: the verifier sends one "
              f"1-token probe request after the run and scrapes after it (a request left "
              f"behind would still show as running then).",
              f"- **Resumed**: the user was throttled (requests skipped on /metrics or in the "
              f"engine log), every request it did not cancel finished, and no request waited "
              f"longer than {STALL_FACTOR:g} x streams/limit + {sc.checks.stall_extra_s:g} s between two "
              f"tokens.",
              f"- **Charged**: the engine charged ({series_name('tokens_charged')}, delta over the "
              "run) at least the tokens it produced, and at most one extra token per request "
              "(allowed over-charge: a step dispatched before a cancel or after a stop).", ""]
    if notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines))
    (out_dir / "checks.json").write_text(json.dumps(
        [{"check": c.label, "ok": c.ok, "summary": c.summary, "details": c.details} for c in checks],
        indent=1))
    return path


def print_summary(checks: list[Check], stats: dict[str, UserStats], a: Analysis) -> None:
    for user, st in stats.items():
        if st.limit is not None:
            print(f"{user}: limit {float(st.limit):g} tok/s, engine-side rate {st.rate:.2f} "
                  f"({st.rate / float(st.limit):.3f} x), stream spacing p50 "
                  f"{st.spacing_p50_ms:.1f} ms vs streams/limit {st.expected_ms:.1f} ms")
        else:
            print(f"{user}: unlimited, engine-side rate {st.rate:.1f} tok/s, "
                  f"stream spacing p50 {st.spacing_p50_ms:.2f} ms")
    for c in checks:
        print(f"  {'ok  ' if c.ok else 'FAIL'} {c.label}: {c.summary}")
        if not c.ok:
            for d in c.details[:5]:
                print(f"         {d}")


# --------------------------------------------------------------------------- running


def _scrape(base_url: str) -> tuple[dict | None, str | None]:
    from vllm_output_rate.tools.common.client import scrape_metrics

    try:
        return scrape_metrics(base_url), None
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}"


def _probe(base_url: str, model: str) -> None:
    import httpx

    try:
        httpx.post(f"{base_url}/v1/completions",
                   json={"model": model, "prompt": "probe", "max_tokens": 1}, timeout=30)
    except httpx.HTTPError:
        pass


def _wait_for_engine_log(path: Path, run: RunRecord, timeout_s: float = 20.0) -> EngineLog:
    """Read the log until every sent request has finished in it and an idle
    throttled-state line came after the last of them (the engine writes about
    once a second)."""
    deadline = time.monotonic() + timeout_s
    wanted = {r.rid for r in run.requests if r.sent}
    log = EngineLog()
    while True:
        if path.exists():
            log = EngineLog.read(path)
            done = {base_request_id(eid) for eid in log.finished}
            last_fin = max((int(e["t_ns"]) for eid, e in log.finished.items()
                            if base_request_id(eid) in wanted), default=None)
            idle_after = last_fin is not None and any(
                int(e["t_ns"]) > last_fin and not sum((e.get("requests") or {}).values())
                for e in log.throttled[-3:])
            if wanted <= done and idle_after:
                return log
        if time.monotonic() > deadline:
            return log
        time.sleep(0.5)


def is_async(scenario: Scenario, start: dict[str, Any] | None) -> bool:
    """Whether the engine ran async scheduling: its event log's start line
    says so; a log without the field (an older engine's) is read by the
    scenario's flags (a guess: vLLM's CPU platform turns
    ``--async-scheduling`` off unless the project's setting forces it)."""
    if start and "async_scheduling" in start:
        return bool(start["async_scheduling"])
    env = dict(scenario.server.env)
    return "--async-scheduling" in scenario.server.args or \
        settings.get("FORCE_ASYNC_SCHEDULING", env)


def verify_run(scenario: Scenario, base_url: str, events_path: Path, report_dir: Path,
               show_progress: bool = True, notes: list[str] = ()) -> int:
    """Run the scenario against a live server, check, report; the exit code."""
    before, err = _scrape(base_url)
    run = run_with_progress(base_url, scenario, show_progress)
    report_dir.mkdir(parents=True, exist_ok=True)
    (report_dir / "run.json").write_text(json.dumps(run.to_json()))
    time.sleep(2.5)  # the engine exports its telemetry about once a second
    after, err2 = _scrape(base_url)
    _probe(base_url, scenario.model_name)
    # a server that is gone writes nothing more: do not wait long for it
    log = _wait_for_engine_log(events_path, run, 20.0 if after is not None else 3.0)
    final, err3 = _scrape(base_url)
    metrics = Metrics(before, after, final, err or err2 or err3)
    return analyze_and_report(scenario, run, log, metrics, report_dir, notes)


def analyze_and_report(scenario: Scenario, run: RunRecord, log: EngineLog, metrics: Metrics,
                       report_dir: Path, notes: list[str] = ()) -> int:
    a = Analysis(scenario, run, log, metrics)
    a.lag = 2 if is_async(scenario, a.start_event()) else 1
    checks, stats = run_checks(a)
    path = write_report(a, checks, stats, report_dir, list(notes))
    print_summary(checks, stats, a)
    ok = all(c.ok for c in checks)
    print(f"verify: {'PASS' if ok else 'FAIL'}; report: {path}")
    return 0 if ok else 1


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="vllm-output-rate verify",
        description="Engine-side ITL verification: run a scenario, check per-user spacing, "
                    "rate and completeness from the engine's own timestamps.")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--server", help="base URL of a running server (needs --events)")
    where.add_argument("--model", help="start a server on this model directory for the run")
    parser.add_argument("--events", help=f"the event log the running server's engine writes "
                                         f"(its {EVENTS_ENV}); with --server")
    parser.add_argument("--scenario", help="scenario file (YAML or JSON); default: built-in")
    parser.add_argument("--report", default="verify-report", help="report directory")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--pictures", metavar="DIR",
                        help="with --model: also let a Prometheus on loopback scrape the server "
                             "every second (`prometheus` on PATH: make tools) and write what an "
                             "operator sees into DIR: the key dashboard panels (spacing.png, "
                             "rate_vs_limit.png, throttled_kv.png, summary.md, as "
                             "vllm_output_rate.tools.prom_pictures draws them) and the report's "
                             "timeline.png, as small palette PNGs (make pictures: docs/img)")
    args = parser.parse_args(argv)
    if args.pictures and not args.model:
        parser.error("--pictures needs --model (with --server, point "
                     "vllm_output_rate.tools.prom_pictures at the Prometheus that scrapes it)")
    try:
        scenario = load_scenario(args.scenario)
    except ScenarioError as exc:
        print(f"vllm-output-rate verify: {exc}", file=sys.stderr)
        return 2
    report = Path(args.report)
    report.mkdir(parents=True, exist_ok=True)
    if args.server:
        if not args.events:
            parser.error("--server needs --events: the engine event log that server writes")
        return verify_run(scenario, args.server.rstrip("/"), Path(args.events), report,
                          not args.no_progress)

    from vllm_output_rate.tools.common.client import Server

    events = report / "engine-events.jsonl"
    events.unlink(missing_ok=True)
    env = {**settings.child_env(EVENTS=events.resolve(), TELEMETRY=True),
           **dict(scenario.server.env)}
    server_args = [*scenario.server_args(), "--served-model-name", scenario.model_name]
    server = Server(args.model, server_args, report / "server.log", extra_env=env)
    print(f"starting the server on {args.model} (log: {server.log_path})", file=sys.stderr)
    try:
        server.start()
    except (RuntimeError, TimeoutError) as exc:
        print(f"vllm-output-rate verify: {exc}", file=sys.stderr)
        return 2
    prometheus = None
    try:
        if args.pictures:
            from vllm_output_rate.tools.prom_pictures import LocalPrometheus

            prometheus = LocalPrometheus(report / "prometheus",
                                         server.base_url.split("://", 1)[1]).start()
        started = time.time()
        code = verify_run(scenario, server.base_url, events, report, not args.no_progress,
                          [f"server started by verify: `{' '.join(server_args)}`"])
        if prometheus is not None:
            time.sleep(3)  # the last scrapes
            write_pictures(prometheus.url, started, time.time(), report, Path(args.pictures))
        return code
    except (RuntimeError, TimeoutError) as exc:
        print(f"vllm-output-rate verify: {exc}", file=sys.stderr)
        return 2
    finally:
        if prometheus is not None:
            prometheus.stop()
        server.stop()


def write_pictures(prometheus: str, start: float, end: float, report: Path, out: Path) -> None:
    """The key dashboard panels from ``prometheus`` over the run, and the
    report's timeline, into ``out`` as small PNGs."""
    import shutil

    from vllm_output_rate.tools import prom_pictures

    prom_pictures.pictures(prometheus, start, end, out)
    if (report / "timeline.png").exists():
        shutil.copyfile(report / "timeline.png", out / "timeline.png")
    for name in ("timeline.png", *prom_pictures.PICTURES):
        if (out / name).exists():
            prom_pictures.shrink_png(out / name)
    print(f"verify: pictures in {out}: {', '.join(sorted(p.name for p in out.iterdir()))}")


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
