"""The run's analysis: the client's records matched to the engine's own
events (vLLM wraps the client's ``X-Request-Id`` in its engine request id),
per request and per user, and the per-user figures the checks read."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from vllm_output_rate import settings
from vllm_output_rate.telemetry.events import EngineLog
from vllm_output_rate.tools.common.stats import quantile
from vllm_output_rate.tools.loadgen.run import RequestRecord, RunRecord
from vllm_output_rate.tools.loadgen.scenario import Scenario
from vllm_output_rate.tools.verify.gcra import gcra_worst_window

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


def base_request_id(engine_id: str) -> str:
    """The client's X-Request-Id inside vLLM's engine request id."""
    if engine_id.startswith(ENGINE_ID_PREFIX):
        engine_id = engine_id[len(ENGINE_ID_PREFIX):]
    head, sep, tail = engine_id.rpartition("-")
    return head if sep and len(tail) == 8 else engine_id


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
