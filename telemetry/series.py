"""The per-user series: counters, gauges and histograms keyed by (metric
name, labels), with the bounded ``user`` label (pinned + top-K +
``__other__``, see ``telemetry.labels``).

Where the folds (``telemetry.folds``) write and the exporter
(``telemetry.export``) reads: a user's charged and skipped counters by a
key cached per user (at most the label cap of users: a flood of distinct
ids cannot grow it), the per-label spacing and throttle-episode
histograms, the limit gauges, and the series ended when a user loses its
label (its future counts go to the overflow bucket).
"""

from __future__ import annotations

from collections import defaultdict
from operator import sub
from itertools import repeat
from typing import Any

from vllm_output_rate.observers import EngineView
from vllm_output_rate.telemetry.histograms import Histogram, observe_by_label
from vllm_output_rate.telemetry.labels import OTHER, UserLabeler
from vllm_output_rate.telemetry.metrics import BY_NAME, SPACING_BUCKETS

Labels = tuple[str, ...]
#: Why a charged token was given back (see the scheduler's refund point).
REFUND_REASONS = ("not_scheduled", "preempted")
#: Why a request out of budget was preempted (``StepReport.preempted_throttled``).
PREEMPT_REASONS = ("kv_cache", "resident_slot")
#: The counters of a user that end when it loses its label.
_USER_COUNTERS = ("tokens_charged", "tokens_refunded", "requests_skipped", "tokens_borrowed")


class Series:
    """Every series one engine exports, and the user label of each."""

    def __init__(self, view: EngineView, labeler: UserLabeler, events_on: bool) -> None:
        self.view = view
        self.labeler = labeler
        self.counters: dict[tuple[str, Labels], float] = defaultdict(float)
        self.gauges: dict[tuple[str, Labels], float] = {}
        self.histograms: dict[tuple[str, Labels], Histogram] = {}
        #: user -> counter key (bounded; cleared when labels change)
        self._charged_keys: dict[str, tuple] = {}
        self._skipped_keys: dict[str, tuple] = {}
        self._borrowed_keys: dict[str, tuple] = {}
        #: label -> its throttle_episode_seconds histogram (cleared when labels change)
        self._episode_hists: dict[str, Histogram] = {}
        #: label -> its inter_token_seconds histogram (same objects as in
        #: ``histograms``), and what evicted labels had observed
        self.spacing: dict[str, Histogram] = {}
        self.spacing_evicted = Histogram(SPACING_BUCKETS)
        # Limits and zero-valued series exist from the first export on.
        self.set_limits()
        counters = self.counters
        for name in ("engine_tokens_charged", "engine_tokens_refunded", "engine_requests_skipped"):
            counters[(name, ())] += 0
        if view.limits().borrowing:
            counters[("engine_tokens_borrowed", ())] += 0
        for reason in PREEMPT_REASONS:
            counters[("engine_throttled_preempted", (reason,))] += 0
        counters[("telemetry_dropped", ("export_failed",))] += 0
        counters[("telemetry_dropped", ("fold_failed",))] += 0
        if events_on:
            for reason in ("events_write_failed", "events_queue_full"):
                counters[("telemetry_dropped", (reason,))] += 0
        self.init_user_series(labeler.labelled_users().values())
        for name in ("wake_lateness_seconds", "schedule_limiter_ratio"):
            self.histogram(name, ())

    def histogram(self, name: str, labels: Labels) -> Histogram:
        key = (name, labels)
        hist = self.histograms.get(key)
        if hist is None:
            hist = self.histograms[key] = Histogram(BY_NAME[name].buckets)
        return hist

    def init_user_series(self, labels: Any) -> None:
        """Configured users have their series from the start (rate() works)."""
        for label in labels:
            self.counters[("tokens_charged", (label,))] += 0
            self.counters[("requests_skipped", (label,))] += 0
            for reason in REFUND_REASONS:
                self.counters[("tokens_refunded", (label, reason))] += 0
            self.histogram("throttle_episode_seconds", (label,))

    def set_limits(self) -> None:
        limits = self.view.limits()
        self.gauges[("default_limit_tokens_per_second", ())] = float(limits.default_rate)
        for user, label in self.labeler.labelled_users().items():
            self.gauges[("user_limit_tokens_per_second", (label,))] = float(limits.rate_of(user))

    def _user_key(self, cache: dict[str, tuple], name: str, user: str) -> tuple:
        """The counter key of ``user`` for ``name``, cached until labels
        change; the cache holds at most ``labeler.capacity`` users, so a
        flood of distinct ids cannot grow it."""
        key = cache.get(user)
        if key is None:
            key = (name, (self.labeler.promote(user),))
            if len(cache) < self.labeler.capacity:
                cache[user] = key
        return key

    def charge(self, user: str, n: int) -> None:
        self.counters[self._user_key(self._charged_keys, "tokens_charged", user)] += n

    def borrow(self, user: str, n: int) -> None:
        self.counters[self._user_key(self._borrowed_keys, "tokens_borrowed", user)] += n

    def skip(self, user: str, n: int) -> None:
        self.counters[self._user_key(self._skipped_keys, "requests_skipped", user)] += n

    def spacing_hist(self, label: str) -> Histogram:
        hist = self.spacing.get(label)
        if hist is None:
            hist = self.spacing[label] = self.histogram("inter_token_seconds", (label,))
        return hist

    def observe_episodes(self, ended: list[tuple[int, list[str], list[int], Any, Any]]) -> None:
        """Closed throttle episodes (as ``telemetry.throttle`` keeps them)
        into their users' histograms."""
        users: list[str | None] = []
        took: list[int] = []
        for end_ns, req_ids, starts, by_id, _credits in ended:  # (per step; lists made in C)
            users.extend(map(by_id.get, req_ids))
            took.extend(map(sub, repeat(end_ns, len(starts)), starts))
        label = self.labeler.label
        labels = {user: label(user or OTHER) for user in set(users)}
        hists = self._episode_hists

        def hist_of(name: str) -> Histogram:
            hist = hists.get(name)
            if hist is None:
                hist = hists[name] = self.histogram("throttle_episode_seconds", (name,))
            return hist

        observe_by_label(list(map(labels.__getitem__, users)), took, hist_of)

    def drop_labels(self, gone: set[str]) -> None:
        """End the series of users that lost their label; their future
        counts go to ``__other__``."""
        for key in list(self.counters):
            name, labels = key
            if labels and labels[0] in gone and name in _USER_COUNTERS:
                del self.counters[key]
        for key in list(self.histograms):
            if key[1] and key[1][0] in gone:
                hist = self.histograms.pop(key)
                if key[0] == "inter_token_seconds":
                    self.spacing.pop(key[1][0], None)
                    self.spacing_evicted.add(hist)
        for key in list(self.gauges):
            if key[1] and key[1][0] in gone:
                del self.gauges[key]
        self.set_limits()
        self._charged_keys.clear()
        self._skipped_keys.clear()
        self._borrowed_keys.clear()
        self._episode_hists.clear()

    def key_count(self) -> int:
        """Users in the counter-key caches (for ``state_sizes``)."""
        return len(self._charged_keys) + len(self._skipped_keys) + len(self._borrowed_keys)
