"""The metrics' token spacing hands the spans' spacing series what it worked
out of each update (``TokenUpdate``: who paused, who left and joined the
steady requests, who came back and when their last token came): fed that
way, over any pattern of tokens, pauses, several tokens in one update,
finishes and aborts, with the timeline cut often and series capped, each
request's series is the spacings of its own tokens (the first of them, up
to the cap) and its token count exact; and the metrics' spacing histogram
holds every spacing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import vllm_output_rate.tracing.series as series_mod
from vllm_output_rate.telemetry.histograms import Histogram
from vllm_output_rate.telemetry.metrics import SPACING_BUCKETS
from vllm_output_rate.telemetry.spacing import TokenSpacing
from vllm_output_rate.tracing.attributes import spacing_us
from vllm_output_rate.tracing.series import SpacingSeries

REQUESTS = 5
#: per update and request: tokens (0: none), finished after them, aborted
#: before the update
_cell = st.tuples(st.sampled_from([0, 0, 1, 1, 1, 2]), st.booleans(), st.booleans())
_updates = st.lists(st.tuples(st.integers(1, 5_000_000), st.lists(_cell, min_size=REQUESTS,
                                                                    max_size=REQUESTS)),
                    min_size=1, max_size=40)


@pytest.fixture
def small_caps(monkeypatch):
    """Series capped at 6 spacings, the timeline cut every 3 updates."""
    monkeypatch.setattr(series_mod, "MAX_SERIES", 6)
    monkeypatch.setattr(series_mod, "TRIM_EVERY", 3)


def _run(updates):
    hists: dict[str, Histogram] = {}

    def spacing_hist(label: str) -> Histogram:
        return hists.setdefault(label, Histogram(SPACING_BUCKETS))

    metrics = TokenSpacing(spacing_hist, lambda user: user, lambda req_id: "u-" + req_id)
    spans = SpacingSeries()
    truth: dict[str, list[int]] = {}  # request -> its spacings (us)
    last: dict[str, int] = {}  # request -> when its last token came
    done: set[str] = set()
    closed: dict[str, tuple[list[int], int]] = {}
    now = 1_000_000_000
    for gap, cells in updates:
        now += gap
        aborted = [f"r{i}" for i, (_, _, abort) in enumerate(cells)
                   if abort and f"r{i}" not in done and f"r{i}" in last]
        if aborted:
            metrics.forget(aborted)
            for req_id in aborted:
                done.add(req_id)
                s, tokens = spans.close(req_id)
                closed[req_id] = (s.tolist(), tokens)
        cur: set[str] = set()
        special = []
        for i, (tokens, finish, _) in enumerate(cells):
            req_id = f"r{i}"
            if req_id in done or not tokens:
                continue
            cur.add(req_id)
            spacings = truth.setdefault(req_id, [])
            if req_id in last:
                spacings.append(spacing_us(now - last[req_id]))
            spacings.extend([0] * (tokens - 1))
            last[req_id] = now
            if finish or tokens > 1:
                special.append(SimpleNamespace(request_id=req_id, new_token_ids=[7] * tokens,
                                               finish_reason="length" if finish else None))
            if finish:
                done.add(req_id)
        timing = metrics.update(cur, special, now)
        spans.update(timing)
        for req_id, _reason in timing.ends:
            s, tokens = spans.close(req_id)
            closed[req_id] = (s.tolist(), tokens)
    metrics.fold()
    return truth, closed, spans, hists


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(updates=_updates)
# a run begun at the update before a cut with no run open (the timeline's
# cut then must not reach past its start)
@example(updates=[(1, [(0, False, False)] * REQUESTS)] * 2
         + [(1, [(0, False, False), (1, False, False)] + [(0, False, False)] * 3)] * 4
         + [(1, [(0, False, False), (1, True, False)] + [(0, False, False)] * 3)])
def test_series_are_each_requests_own_spacings(small_caps, updates):
    truth, closed, spans, hists = _run(updates)
    cap = series_mod.MAX_SERIES
    for req_id, (s, tokens) in closed.items():
        assert s == truth[req_id][:cap], req_id
        assert tokens == len(truth[req_id]) + 1
    # the requests still running: their series so far, and nothing kept for
    # the ended ones
    for req_id, spacings in truth.items():
        if req_id not in closed:
            assert spans.spacings(req_id) == len(spacings)
            s, tokens = spans.close(req_id)
            assert s.tolist() == spacings[:cap] and tokens == len(spacings) + 1
    assert not spans._series and not spans._runs and not spans._overflow
    # the metrics saw every spacing (zeros included), in the right buckets
    every = [v for spacings in truth.values() for v in spacings]
    assert sum(h.count for h in hists.values()) == len(every)
