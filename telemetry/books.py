"""The per-user books an export step keeps: tokens charged (and, with
borrowing, borrowed) per user over the last 10 s and 60 s, the throttled
requests and their KV blocks, and the user states ``GET
/output-rate/users/NAME`` shows.

On the data's path after the folds (``telemetry.folds``), at export steps
and when the engine goes idle, from the engine reads the scheduler's
thread made (``telemetry.intake``); read by the exporter
(``telemetry.export``). Also the labeler's activity: the tokens charged
per user since the last export, which decide the top-K labels.
"""

from __future__ import annotations

from collections import Counter, defaultdict, deque
from typing import Any

from vllm_output_rate.observers import EngineView
from vllm_output_rate.telemetry.clock import SYSTEM, Clock
from vllm_output_rate.telemetry.eventlog import EventLog
from vllm_output_rate.telemetry.labels import OTHER
from vllm_output_rate.telemetry.metrics import (
    ENGINE_THROTTLED_KV_BLOCKS,
    ENGINE_THROTTLED_REQUESTS,
    THROTTLED_KV_BLOCKS,
    THROTTLED_KV_CACHE_RATIO,
    THROTTLED_REQUESTS,
)
from vllm_output_rate.telemetry.series import Series

NS = 1_000_000_000
#: Most users whose state the snapshot carries for introspection.
USER_STATES_CAP = 1000


def ceiling_value(ceiling: Any) -> float | str | None:
    """A ceiling as plain data: tok/s, ``"unlimited"``, or None (the user
    does not borrow)."""
    return ceiling if ceiling is None or isinstance(ceiling, str) else float(ceiling)


def _slide(window: deque[tuple[int, dict[str, int]]], counts: Counter[str],
           now_ns: int) -> tuple[Counter[str], Counter[str]]:
    """One export step of a 60 s window of per-user counts: this interval's
    ``counts`` appended (the ``USER_STATES_CAP`` largest; nothing when
    empty), entries older than 60 s dropped; the sums over 10 s and 60 s."""
    if counts:
        if len(counts) > USER_STATES_CAP:
            counts = Counter(dict(counts.most_common(USER_STATES_CAP)))
        window.append((now_ns, dict(counts)))
    while window and now_ns - window[0][0] > 60 * NS:
        window.popleft()
    return _window_sums(window, now_ns)


def _window_sums(window: Any, now_ns: int) -> tuple[Counter[str], Counter[str]]:
    """Tokens charged (or borrowed) per user over the last 10 s and 60 s of ``window``."""
    charged_10: Counter[str] = Counter()
    charged_60: Counter[str] = Counter()
    for t, counts in window:
        age = now_ns - t
        if age <= 60 * NS:
            charged_60.update(counts)
            if age <= 10 * NS:
                charged_10.update(counts)
    return charged_10, charged_60


class UserBooks:
    """Per-user activity, charged windows, throttled requests and states."""

    def __init__(self, view: EngineView, series: Series, events: EventLog | None,
                 clock: Clock = SYSTEM) -> None:
        self.view = view
        self._clock = clock
        self._series = series
        self._events = events
        self._num_blocks = view.num_kv_blocks
        #: tokens charged per user since the last export (labeler activity)
        self.activity: Counter[str] = Counter()
        #: tokens charged per user since the window's last entry
        self.window_activity: Counter[str] = Counter()
        #: tokens borrowed per user since the window's last entry (borrowing only)
        self.window_borrowed: Counter[str] = Counter()
        #: (export step's ns, tokens charged per user in its interval), 60 s
        #: (intervals with some)
        self._charged_window: deque[tuple[int, dict[str, int]]] = deque()
        #: the same for tokens borrowed (entries only in intervals with some)
        self._borrowed_window: deque[tuple[int, dict[str, int]]] = deque()
        #: user -> (throttled requests, their KV blocks) at the last export step
        self.thr_by_user: dict[str, tuple[int, int]] = {}
        #: per-user state for introspection (replaced whole), and when
        #: (scheduler clock ns, monotonic ns, unix s)
        self.user_states: dict[str, dict[str, Any]] = {}
        self.user_states_at = (0, 0, 0.0)
        self.update_throttled([], [], {})

    def take_activity(self) -> Counter[str]:
        """The tokens charged per user since the last call (for labels)."""
        activity, self.activity = self.activity, Counter()
        return activity

    def update_throttled(self, throttled: list[str], held: list[int],
                         users: dict[str, str]) -> None:
        """The throttled gauges of an export step. ``held``: the KV blocks
        of each throttled request (read on the scheduler's thread);
        ``users``: request id -> user of the throttled requests."""
        labeler, gauges = self._series.labeler, self._series.gauges
        requests: dict[str, int] = defaultdict(int)
        blocks: dict[str, int] = defaultdict(int)
        total_blocks = 0
        by_user: dict[str, list[int]] = {}
        for req_id, n in zip(throttled, held):
            user = users.get(req_id, OTHER)
            label = labeler.label(user)
            requests[label] += 1
            blocks[label] += n
            total_blocks += n
            counts = by_user.get(user)
            if counts is None:
                counts = by_user[user] = [0, 0]
            counts[0] += 1
            counts[1] += n
        self.thr_by_user = {u: (c[0], c[1]) for u, c in by_user.items()}
        per_user = (THROTTLED_REQUESTS.name, THROTTLED_KV_BLOCKS.name)
        for key in [k for k in gauges if k[0] in per_user]:
            del gauges[key]
        for label in set(requests) | set(labeler.labelled_users().values()):
            gauges[THROTTLED_REQUESTS.key(label)] = requests.get(label, 0)
            gauges[THROTTLED_KV_BLOCKS.key(label)] = blocks.get(label, 0)
        share = total_blocks / self._num_blocks
        gauges[ENGINE_THROTTLED_REQUESTS.key()] = len(throttled)
        gauges[ENGINE_THROTTLED_KV_BLOCKS.key()] = total_blocks
        gauges[THROTTLED_KV_CACHE_RATIO.key()] = share
        if self._events is not None:
            self._events.throttled(by_user, share)

    def update_user_states(self, now_ns: int, requests: Any, ready_at: dict[str, int]) -> None:
        """What ``GET /output-rate/users/NAME`` shows, per user (the worker:
        at each export step and when the engine goes idle; ``requests`` and
        the live users' ``ready_at`` read on the scheduler's thread): tokens
        charged over the last 10 s and 60 s (in export intervals of about a
        second), requests running, waiting and throttled, KV blocks held
        while throttled, when the budget is next ready. At most
        ``USER_STATES_CAP`` users (live requests first, then the most
        charged)."""
        activity, self.window_activity = self.window_activity, Counter()
        charged_10, charged_60 = _slide(self._charged_window, activity, now_ns)
        lent, self.window_borrowed = self.window_borrowed, Counter()
        borrowed_10, borrowed_60 = _slide(self._borrowed_window, lent, now_ns)
        view = self.view
        throttled = self.thr_by_user if requests else {}
        users = list(requests)
        if len(users) < USER_STATES_CAP:
            users += [u for u, _ in charged_60.most_common(USER_STATES_CAP - len(users))
                      if u not in requests]
        states = {}
        limits = view.limits()
        rate_of = limits.rate_of
        ceiling_of = limits.ceiling_of if limits.borrowing else None
        prompt_rate_of = limits.prompt_rate_of if limits.prompt_budgets else None
        for user in users[:USER_STATES_CAP]:
            running, waiting = requests.get(user, (0, 0))
            n_thr, blocks = throttled.get(user, (0, 0))
            ready = ready_at.get(user)
            if ready is None:  # (not live: its limiter state, read now)
                ready = view.ready_at_ns(user)
            states[user] = {
                "limit": float(rate_of(user)),
                "charged_10s": charged_10.get(user, 0),
                "charged_60s": charged_60.get(user, 0),
                "running": running,
                "waiting": waiting,
                "throttled": n_thr,
                "throttled_kv_blocks": blocks,
                "ready_in_s": max(0.0, (ready - now_ns) / NS) if ready else 0.0,
            }
            if ceiling_of is not None:
                states[user].update(ceiling=ceiling_value(ceiling_of(user)),
                                    borrowed_10s=borrowed_10.get(user, 0),
                                    borrowed_60s=borrowed_60.get(user, 0))
            if prompt_rate_of is not None:  # (prompt budgets: the second policy)
                prompt_ready = view.prompt_ready_at_ns(user)
                states[user].update(
                    prompt_rate=ceiling_value(prompt_rate_of(user)),
                    prompt_ready_in_s=max(0.0, (prompt_ready - now_ns) / NS) if prompt_ready else 0.0)
        self.user_states = states
        self.user_states_at = (now_ns, self._clock.monotonic_ns(), self._clock.time())

    def idle_user_states(self) -> dict[str, dict[str, Any]]:
        """The user states of an idle engine, as of now (exporter thread):
        no step runs to update them, so the charged windows slide here."""
        now_ns, mono, _ = self.user_states_at
        now_ns += self._clock.monotonic_ns() - mono
        try:
            window = list(self._charged_window)
            lent = list(self._borrowed_window)
        except RuntimeError:  # appended to right now: the engine is not idle
            return self.user_states
        charged_10, charged_60 = _window_sums(window, now_ns)
        borrowed_10, borrowed_60 = _window_sums(lent, now_ns)
        states = {}
        for user, state in self.user_states.items():
            ready_in = max(0.0, state["ready_in_s"] - (now_ns - self.user_states_at[0]) / NS)
            states[user] = {**state, "charged_10s": charged_10.get(user, 0),
                            "charged_60s": charged_60.get(user, 0), "running": 0,
                            "throttled": 0, "throttled_kv_blocks": 0, "ready_in_s": ready_in}
            if "borrowed_10s" in state:
                states[user].update(borrowed_10s=borrowed_10.get(user, 0),
                                    borrowed_60s=borrowed_60.get(user, 0))
            if "prompt_ready_in_s" in state:
                states[user]["prompt_ready_in_s"] = max(
                    0.0, state["prompt_ready_in_s"] - (now_ns - self.user_states_at[0]) / NS)
        return states

    def sizes(self) -> tuple[int, int, int]:
        """Users held: activity, states, charged window (``state_sizes``)."""
        return (len(self.activity) + len(self.window_activity) + len(self.window_borrowed),
                len(self.user_states) + len(self.thr_by_user),
                sum(len(d) for _, d in self._charged_window)
                + sum(len(d) for _, d in self._borrowed_window))
