"""The metrics' token spacing takes a short way through an update of users
pacing at their limits (every request back at the previous update pauses
again, every steady one goes on) and pops the resumed requests' last tokens
without intersecting them first: over any drain of updates (tokens,
pauses, several tokens in one update, finishes, aborts, label changes),
each update's record (``TokenUpdate``) holds what the general way gives,
the histograms hold the same counts and the same float sums (bit for bit),
and the state left is the same."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_output_rate.telemetry.histograms import Histogram
from vllm_output_rate.telemetry.metrics import SPACING_BUCKETS
from vllm_output_rate.telemetry.spacing import TokenSpacing

REQUESTS = 8
#: per update and request: tokens (0: none), finished after them, aborted
#: before the update; mostly the pattern of users pacing at their limits
_cell = st.tuples(st.sampled_from([0, 0, 0, 1, 1, 2]), st.integers(0, 30).map(lambda n: n == 0),
                  st.integers(0, 40).map(lambda n: n == 0))
_drain = st.lists(
    st.tuples(st.integers(1, 400_000_000), st.lists(_cell, min_size=REQUESTS, max_size=REQUESTS),
              st.integers(0, 25).map(lambda n: n == 0)),  # labels change after it
    min_size=1, max_size=60)
#: requests that are steady throughout, and the rest pacing: one token, then
#: a pause of some updates (the shortcut's pattern, with finishes and aborts)
_paced = st.lists(st.tuples(st.integers(1, 3_000_000), st.integers(0, 6),
                            st.lists(st.integers(1, 4), min_size=REQUESTS, max_size=REQUESTS)),
                  min_size=1, max_size=8)


def _spacing(shortcut: bool, users: dict[str, str]):
    hists: dict[str, Histogram] = {}

    def spacing_hist(label: str) -> Histogram:
        return hists.setdefault(label, Histogram(SPACING_BUCKETS))

    spacing = TokenSpacing(spacing_hist, lambda user: user, users.get)
    spacing.pacing_shortcut = shortcut
    return spacing, hists


def _record(timing) -> tuple:
    return (timing.now, set(timing.paused), set(timing.left), set(timing.joined),
            dict(zip(timing.back, timing.prevs)), len(timing.back), timing.first, timing.zeros,
            timing.ends, timing.finished)


def _state(spacing: TokenSpacing, hists: dict[str, Histogram]) -> tuple:
    return ({k: (h.counts, h.sum, h.count) for k, h in hists.items()}, spacing.last_token_ns,
            spacing.request_label, spacing.prev_ids, spacing.joining, spacing.prev_by_label,
            spacing.resume_runs and [(n, dict(zip(b, p))) for n, b, p in spacing.resume_runs])


def _replay(updates: list[tuple[int, set[str], list, list[str], bool]], shortcut: bool):
    users = {f"r{i}": f"user-{i % 3}" for i in range(REQUESTS)}
    spacing, hists = _spacing(shortcut, users)
    records = []
    for now, cur, special, aborted, relabel in updates:
        if aborted:
            spacing.forget(aborted)
        records.append(_record(spacing.update(set(cur), special, now)))
        if relabel:
            users.update((r, u + "-x") for r, u in list(users.items()))
            spacing.relabel()
        if len(records) % 7 == 0:
            spacing.fold()  # (a full fold now and then, as at exports)
    spacing.fold()
    return records, _state(spacing, hists)


def _updates_of(drain) -> list:
    now = 1_000_000_000
    done: set[str] = set()
    seen: set[str] = set()
    updates = []
    for gap, cells, relabel in drain:
        now += gap
        aborted = [f"r{i}" for i, (_, _, abort) in enumerate(cells)
                   if abort and f"r{i}" in seen and f"r{i}" not in done]
        done.update(aborted)
        live = {f"r{i}": (tokens, finish) for i, (tokens, finish, _) in enumerate(cells)
                if tokens and f"r{i}" not in done}
        seen.update(live)
        done.update(req_id for req_id, (_, finish) in live.items() if finish)
        special = [SimpleNamespace(request_id=req_id, new_token_ids=[7] * tokens,
                                   finish_reason="stop" if finish else None)
                   for req_id, (tokens, finish) in live.items() if finish or tokens > 1]
        cur = set(live)
        updates.append((now, cur, special, aborted, relabel))
    return updates


def _paced_updates(runs) -> list:
    """Request 0 and 1 steady, the others one token every ``period`` updates."""
    drain = []
    for gap, finish_at, periods in runs:
        for step in range(12):
            cells = []
            for i, period in enumerate(periods):
                tokens = 1 if i < 2 or (step + i) % (period + 1) == 0 else 0
                cells.append((tokens, step == finish_at and i == 2 + step % 3, False))
            drain.append((gap, cells, False))
    return _updates_of(drain)


def _same(updates) -> None:
    general, general_state = _replay(updates, shortcut=False)
    short, short_state = _replay(updates, shortcut=True)
    for i, (a, b) in enumerate(zip(general, short)):
        assert a == b, i
    assert general_state == short_state


@settings(max_examples=300, deadline=None)
@given(drain=_drain)
def test_shortcut_equals_the_general_way(drain):
    _same(_updates_of(drain))


@settings(max_examples=200, deadline=None)
@given(runs=_paced)
def test_shortcut_equals_the_general_way_pacing(runs):
    _same(_paced_updates(runs))


def test_pacing_takes_the_shortcut():
    """Users pacing at their limits: the requests pausing are the very set
    that was back at the previous update (the short way was taken)."""
    spacing, _ = _spacing(True, {f"r{i}": "u" for i in range(REQUESTS)})
    now = 1_000_000_000
    shortcuts = 0
    for step in range(40):
        now += 1_000_000
        cur = {"r0", "r1"} | {f"r{i}" for i in range(2, REQUESTS) if (step + i) % 3 == 0}
        joining = spacing.joining
        timing = spacing.update(cur, [], now)
        shortcuts += timing.paused is joining and bool(joining)
        if step >= 2:  # (r0 and r1 joined the steady ones at the second)
            assert not timing.left and not timing.joined
    assert shortcuts >= 30
