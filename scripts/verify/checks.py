"""The checks of a run, each per user or for the run (the package's
docstring lists them), from its ``analysis.Analysis``."""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

from vllm_output_rate.telemetry.metrics import series_name
from vllm_output_rate.tools.common.stats import quantile
from vllm_output_rate.tools.verify.gcra import gcra_worst_window
from vllm_output_rate.tools.verify.analysis import (
    EVENTS_ENV,
    STALL_FACTOR,
    UNLIMITED_HEADROOM,
    Analysis,
    Check,
    ReqData,
    UserStats,
    _frac,
    phase_spacing_ms,
    user_stats,
)

#: telemetry_dropped reasons that mean the event log has gaps
EVENT_DROP_REASONS = ("events_queue_full", "events_write_failed")


def check_events(a: Analysis) -> list[Check]:
    details = []
    if not a.log.starts:
        details.append("no start line: the engine did not write its event log "
                       f"(is {EVENTS_ENV} set in the server's environment and telemetry on?)")
    sent = [rd for rd in a.reqs.values() if rd.rec.sent]
    unseen = [rd for rd in sent if not rd.tokens and rd.finished is None]
    # cancelled by the client before the engine's scheduler had it (its
    # front end still handling it): nothing to log, nothing held (``freed``
    # checks the engine's gauges after the run); any other silent request
    # is one the event log lost
    early = [rd.rec.rid for rd in unseen if before_engine(rd)]
    silent = [rd.rec.rid for rd in unseen if rd.rec.rid not in early]
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
    ok = not details
    if early:
        details.append(f"(not a failure) {len(early)} request(s) cancelled by the client before "
                       "the engine's scheduler had them: " + ", ".join(early[:8]))
    return [Check("events", "all", ok,
                  f"{len(a.log.steps)} engine steps with tokens, {n_tok} tokens of {len(sent)} "
                  f"requests of this run, {sum(rd.finished is not None for rd in sent)} "
                  "of them finished", details)]


def before_engine(rd: Any) -> bool:
    """A request the client cancelled with no token received and that the
    engine's event log never names (a request the scheduler had and lost
    to a client's cancel is logged ``finished``, reason abort)."""
    return rd.cancelled and not rd.rec.chunks and not rd.tokens and rd.finished is None


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


def check_prompt_bound(a: Analysis) -> list[Check]:
    """The prompt budget's bound, like the output limit's, for each user of
    the run whose served limits carry a ``prompt_rate`` (the engine's start
    line): in every window between two steps that computed its prompts
    (stamped at dispatch, where the budget charges), prompt tokens <=
    floor((W + burst) x prompt_rate) + 1 with chunked prefill, + its
    largest prompt instead of 1 without (a prompt goes whole)."""
    start = a.start_event()
    if not start or start.get("prompt_limits") is None:
        return []
    window = a.run_window_ns()
    since = int(start["t_ns"])
    until = None if window is None else window[1]
    changes = [int(c["t_ns"]) for c in a.log.limit_changes
               if since < int(c["t_ns"]) <= (window[0] if window else since)]
    since = max([since, *changes])  # (the limits in force when the run began)
    chunked = bool(start.get("chunked_prefill", True))
    listed = start["prompt_limits"]
    out = []
    for user in a.users_in_run():
        rate = listed[user] if user in listed else start.get("default_prompt_limit")
        if rate is None:
            continue
        events = a.log.user_prompt_spends(user, since, until)
        if not events:
            out.append(Check("prompt_bound", user, False, "no prompt tokens computed for this "
                             "user in the engine log (no prompt lines: an engine too old?)"))
            continue
        largest = max([rd.rec.prompt_tokens for rd in a.user_reqs(user)] + [1])
        extra = 1 if chunked else largest
        g = gcra_worst_window(events, _frac(rate), extra=extra)
        ok = g["excess"] <= 0
        out.append(Check(
            "prompt_bound", user, ok,
            f"prompt_rate {float(rate):g} tok/s, {'chunked prefill' if chunked else 'whole prompts'}: "
            f"{g['windows']} windows; worst: {g['tokens']} prompt tokens in {g['window_s']:.3f} s, "
            f"bound {g['bound']} (floor((W + burst) x rate) + {extra})"
            + ("" if ok else f" -> {g['violations']} window(s) over the bound")))
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
        if rd.finished is None and not before_engine(rd):
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
              + check_prompt_bound(a) + check_rate(a, stats) + check_spacing(a, stats) + check_complete(a)
              + check_resumed(a, stats) + check_freed(a) + check_charged(a)
              + check_unlimited(a) + check_prefix_cache(a))
    return checks, stats
