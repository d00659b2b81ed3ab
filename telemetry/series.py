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
from typing import Any

from vllm_output_rate.observers import PROMPT_DEFER_REASONS, EngineView
from vllm_output_rate.telemetry.histograms import Histogram, observe_by_label
from vllm_output_rate.telemetry.labels import OTHER, UserLabeler
from vllm_output_rate.telemetry.metrics import (
    DEFAULT_LIMIT_TOKENS_PER_SECOND,
    ENGINE_PROMPT_TOKENS_COMPUTED,
    ENGINE_PROMPT_TOKENS_DEFERRED,
    ENGINE_REQUESTS_SKIPPED,
    ENGINE_STEP_SECONDS,
    ENGINE_THROTTLED_PREEMPTED,
    ENGINE_TOKENS_BORROWED,
    ENGINE_TOKENS_CHARGED,
    ENGINE_TOKENS_REFUNDED,
    INTER_TOKEN_SECONDS,
    PROMPT_STEP_SECONDS,
    PROMPT_TOKENS_COMPUTED,
    PROMPT_TOKENS_DEFERRED,
    REQUESTS_SKIPPED,
    SCHEDULE_LIMITER_RATIO,
    SPACING_BUCKETS,
    TELEMETRY_DROPPED,
    THROTTLE_EPISODE_SECONDS,
    TOKENS_BORROWED,
    TOKENS_CHARGED,
    TOKENS_REFUNDED,
    USER_LIMIT_TOKENS_PER_SECOND,
    WAKE_LATENESS_SECONDS,
    Metric,
)

Labels = tuple[str, ...]
#: Why a charged token was given back (see the scheduler's refund point).
REFUND_REASONS = ("not_scheduled", "preempted")
#: Why a request out of budget was preempted (``StepReport.preempted_throttled``).
PREEMPT_REASONS = ("kv_cache", "resident_slot")
#: The counters of a user that end when it loses its label.
_USER_COUNTERS = tuple(m.name for m in (TOKENS_CHARGED, TOKENS_REFUNDED, REQUESTS_SKIPPED,
                                          TOKENS_BORROWED, PROMPT_TOKENS_COMPUTED,
                                          PROMPT_TOKENS_DEFERRED, PROMPT_STEP_SECONDS))


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
        self._prompt_keys: dict[str, tuple] = {}
        self._prompt_seconds_keys: dict[str, tuple] = {}
        #: label -> its throttle_episode_seconds histogram (cleared when labels change)
        self._episode_hists: dict[str, Histogram] = {}
        #: label -> its inter_token_seconds histogram (same objects as in
        #: ``histograms``), and what evicted labels had observed
        self.spacing: dict[str, Histogram] = {}
        self.spacing_evicted = Histogram(SPACING_BUCKETS)
        # Limits and zero-valued series exist from the first export on.
        self.set_limits()
        counters = self.counters
        for metric in (ENGINE_TOKENS_CHARGED, ENGINE_TOKENS_REFUNDED, ENGINE_REQUESTS_SKIPPED,
                       ENGINE_PROMPT_TOKENS_COMPUTED, ENGINE_STEP_SECONDS):
            counters[metric.key()] += 0
        for reason in PROMPT_DEFER_REASONS:
            counters[ENGINE_PROMPT_TOKENS_DEFERRED.key(reason)] += 0
        if view.limits().borrowing:
            counters[ENGINE_TOKENS_BORROWED.key()] += 0
        for reason in PREEMPT_REASONS:
            counters[ENGINE_THROTTLED_PREEMPTED.key(reason)] += 0
        counters[TELEMETRY_DROPPED.key("export_failed")] += 0
        counters[TELEMETRY_DROPPED.key("fold_failed")] += 0
        if events_on:
            for reason in ("events_write_failed", "events_queue_full"):
                counters[TELEMETRY_DROPPED.key(reason)] += 0
        self.init_user_series(labeler.labelled_users().values())
        for metric in (WAKE_LATENESS_SECONDS, SCHEDULE_LIMITER_RATIO):
            self.histogram(metric, ())

    def histogram(self, metric: Metric, labels: Labels) -> Histogram:
        key = metric.key(*labels)
        hist = self.histograms.get(key)
        if hist is None:
            hist = self.histograms[key] = Histogram(metric.buckets)
        return hist

    def init_user_series(self, labels: Any) -> None:
        """Configured users have their series from the start (rate() works)."""
        for label in labels:
            self.counters[TOKENS_CHARGED.key(label)] += 0
            self.counters[REQUESTS_SKIPPED.key(label)] += 0
            for reason in REFUND_REASONS:
                self.counters[TOKENS_REFUNDED.key(label, reason)] += 0
            self.counters[PROMPT_TOKENS_COMPUTED.key(label)] += 0
            self.counters[PROMPT_STEP_SECONDS.key(label)] += 0
            for reason in PROMPT_DEFER_REASONS:
                self.counters[PROMPT_TOKENS_DEFERRED.key(label, reason)] += 0
            self.histogram(THROTTLE_EPISODE_SECONDS, (label,))

    def set_limits(self) -> None:
        limits = self.view.limits()
        self.gauges[DEFAULT_LIMIT_TOKENS_PER_SECOND.key()] = float(limits.default_rate)
        for user, label in self.labeler.labelled_users().items():
            self.gauges[USER_LIMIT_TOKENS_PER_SECOND.key(label)] = float(limits.rate_of(user))

    def _user_key(self, cache: dict[str, tuple], metric: Metric, user: str) -> tuple:
        """The counter key of ``user`` for ``name``, cached until labels
        change; the cache holds at most ``labeler.capacity`` users, so a
        flood of distinct ids cannot grow it."""
        key = cache.get(user)
        if key is None:
            key = metric.key(self.labeler.promote(user))
            if len(cache) < self.labeler.capacity:
                cache[user] = key
        return key

    def charge(self, user: str, n: int) -> None:
        self.counters[self._user_key(self._charged_keys, TOKENS_CHARGED, user)] += n

    def borrow(self, user: str, n: int) -> None:
        self.counters[self._user_key(self._borrowed_keys, TOKENS_BORROWED, user)] += n

    def prompt_computed(self, user: str, n: int) -> None:
        self.counters[self._user_key(self._prompt_keys, PROMPT_TOKENS_COMPUTED, user)] += n

    def prompt_seconds(self, user: str, seconds: float) -> None:
        self.counters[self._user_key(self._prompt_seconds_keys, PROMPT_STEP_SECONDS, user)] += seconds

    def skip(self, user: str, n: int) -> None:
        self.counters[self._user_key(self._skipped_keys, REQUESTS_SKIPPED, user)] += n

    def spacing_hist(self, label: str) -> Histogram:
        hist = self.spacing.get(label)
        if hist is None:
            hist = self.spacing[label] = self.histogram(INTER_TOKEN_SECONDS, (label,))
        return hist

    def observe_episodes(self, ended: list[Any]) -> None:
        """Closed throttle episodes (``telemetry.throttle``'s ``EndedRun``)
        into their users' histograms: each one's duration and user as its
        record holds them (the spans read the same)."""
        users: list[str | None] = []
        took: list[int] = []
        for run in ended:  # (per step; lists made in C)
            episodes = run.episodes
            users.extend(episodes.user_list())
            took.extend(episodes.took())
        label = self.labeler.label
        labels = {user: label(user or OTHER) for user in set(users)}
        hists = self._episode_hists

        def hist_of(name: str) -> Histogram:
            hist = hists.get(name)
            if hist is None:
                hist = hists[name] = self.histogram(THROTTLE_EPISODE_SECONDS, (name,))
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
                if key[0] == INTER_TOKEN_SECONDS.name:
                    self.spacing.pop(key[1][0], None)
                    self.spacing_evicted.add(hist)
        for key in list(self.gauges):
            if key[1] and key[1][0] in gone:
                del self.gauges[key]
        self.set_limits()
        self._charged_keys.clear()
        self._skipped_keys.clear()
        self._borrowed_keys.clear()
        self._prompt_keys.clear()
        self._prompt_seconds_keys.clear()
        self._episode_hists.clear()

    def key_count(self) -> int:
        """Users in the counter-key caches (for ``state_sizes``)."""
        return (len(self._charged_keys) + len(self._skipped_keys) + len(self._borrowed_keys)
                + len(self._prompt_keys) + len(self._prompt_seconds_keys))
