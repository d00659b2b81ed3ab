"""The worker's folds: each event the scheduler's thread handed over
(``telemetry.intake``), turned into aggregates, in the scheduler's order.

Next on the data's path after the intake: the worker drains the inbox
every ``DRAIN_INTERVAL_S`` (``telemetry.engine``) and runs one fold per
event: a step (charges, refunds, skips and throttle episodes, kept by
``telemetry.throttle`` for the next full fold), the outputs of an update
(token timing, ``telemetry.spacing``; the event log's records), aborts,
idle waits and reloaded limits. Users and facts of requests are read by a
handle taken when each was added (they may be gone from the engine by
then). The full fold (``Folds.fold``) brings every user's counters, the
episodes' and the spacing histograms up to date (``telemetry.series``), at
exports, aborts, when the engine goes idle and at close; export steps also
update the per-user books (``telemetry.books``) and the labels. The spans
(``tracing.recorder``) are fed from the same plain data, the throttle
episodes as the same records (``telemetry.records.Episodes``).
"""

from __future__ import annotations

from collections import Counter

from collections.abc import Iterable
from typing import Any

from vllm_output_rate.observers import EngineView, IdleWait, LimitsChange, StepReport
from vllm_output_rate.telemetry.books import UserBooks
from vllm_output_rate.telemetry.eventlog import EventLog
from vllm_output_rate.telemetry.labels import OTHER
from vllm_output_rate.telemetry.metrics import (
    ENGINE_REQUESTS_SKIPPED,
    ENGINE_THROTTLED_PREEMPTED,
    ENGINE_TOKENS_BORROWED,
    ENGINE_TOKENS_CHARGED,
    ENGINE_TOKENS_REFUNDED,
    IDLE_WAIT_SECONDS,
    SCHEDULE_LIMITER_RATIO,
    TOKENS_REFUNDED,
    USER_LIMIT_TOKENS_PER_SECOND,
    WAKE_LATENESS_SECONDS,
)
from vllm_output_rate.telemetry.prompt_work import PromptWork, StepCost, step_cost_from_settings
from vllm_output_rate.telemetry.records import EngineReads, Episodes, StepEpisodes
from vllm_output_rate.telemetry.series import Series
from vllm_output_rate.telemetry.spacing import TokenSpacing
from vllm_output_rate.telemetry.throttle import ThrottleBook

#: Steps' charges and skips kept for the next fold before one is forced (an
#: export is due every ``EXPORT_INTERVAL_S``; this bounds them if it is late).
PENDING_STEPS_CAP = 4096
#: the keys of the engine-wide series a step adds to
_CHARGED = ENGINE_TOKENS_CHARGED.key()
_BORROWED = ENGINE_TOKENS_BORROWED.key()
_REFUNDED = ENGINE_TOKENS_REFUNDED.key()
_SKIPPED = ENGINE_REQUESTS_SKIPPED.key()
_PREEMPTED_FOR_SLOT = ENGINE_THROTTLED_PREEMPTED.key("resident_slot")
_PREEMPTED_FOR_KV = ENGINE_THROTTLED_PREEMPTED.key("kv_cache")
_LIMITER_SHARE = SCHEDULE_LIMITER_RATIO.key()
_LATENESS = WAKE_LATENESS_SECONDS.key()


class RequestHandles:
    """request id -> its handle (``EngineView.request_handle``), from when
    it was added until it ends: its user and facts, read on the worker."""

    def __init__(self, view: EngineView) -> None:
        self.view = view
        self.handles: dict[str, Any] = {}

    def user_of(self, req_id: str) -> str | None:
        """A request's user, by the handle taken when it was added (it may
        be gone from the engine by now)."""
        handle = self.handles.get(req_id)
        if handle is None:
            return self.view.user_of(req_id)
        return self.view.handle_user(handle)

    def facts_of(self, req_id: str) -> Any:
        handle = self.handles.get(req_id)
        if handle is None:
            return self.view.request_facts(req_id)
        return self.view.handle_facts(handle)

    def forget(self, req_ids: Iterable[str]) -> None:
        pop = self.handles.pop
        for req_id in req_ids:
            pop(req_id, None)


class Folds:
    """One fold per kind of event, and the full fold."""

    def __init__(self, spans: Any, series: Series, handles: RequestHandles, books: UserBooks,
                 events: EventLog | None, step_cost: StepCost | None = None) -> None:
        #: tracing.recorder.SpanRecorder when traces are on
        self.spans = spans
        #: what the steps leave for the next fold, and the token timing
        self.book = ThrottleBook()
        self.spacing = TokenSpacing(series.spacing_hist, series.labeler.label, handles.user_of)
        #: where the folds write: the series, the per-user books, the event log
        self.series = series
        self.books = books
        self.events = events
        self.handles = handles
        self._user_of = handles.user_of
        #: each user's prompt work and its share of step time
        self.prompt_work = PromptWork(series, books, step_cost or step_cost_from_settings(),
                                      events)
        #: the last step that sent the users with an episode open to the
        #: span recorder, for over-limit periods to end
        self._ticked = 0

    def pending(self) -> int:
        """Runs and lists kept for the next full fold."""
        return self.book.pending() + len(self.spacing.resume_runs)

    def fold_step(self, record: StepReport, episodes: StepEpisodes,
                  reads: EngineReads | None) -> None:
        """One step: its charges, skips and ``episodes`` kept for the next
        fold (``ThrottleBook.add_step``), the engine's counters, its spans;
        at an export step (``reads`` of the engine) a full fold, the gauges,
        the user states and the labels."""
        counters = self.series.counters
        charged = record.charged
        throttled = record.throttled
        book = self.book
        book.add_step(charged, throttled, episodes, self._user_of)
        self.prompt_work.fold_step(record)
        if charged:
            counters[_CHARGED] += len(charged)
        if record.borrowed:  # (borrowing only: a limit with a ceiling)
            counters[_BORROWED] += len(record.borrowed)
            lent = self.books.window_borrowed
            for user, n in Counter(record.borrowed.values()).items():
                self.series.borrow(user, n)
                lent[user] += n
        if record.refunded:
            labeler = self.series.labeler
            for _req_id, user, reason in record.refunded:
                counters[TOKENS_REFUNDED.key(labeler.label(user), reason)] += 1
                counters[_REFUNDED] += 1
        now = record.now_ns
        if throttled:
            counters[_SKIPPED] += len(throttled)
        if record.preempted_throttled:
            slot = record.preempted_for_slot
            counters[_PREEMPTED_FOR_SLOT] += slot
            counters[_PREEMPTED_FOR_KV] += (
                len(record.preempted_throttled) - slot)
        spans = self.spans
        if spans is not None:
            users = book.thr_users
            sweep = None
            if now - self._ticked >= spans.sweep_ns:  # users with an episode open
                self._ticked = now
                sweep = set(map(users.get, book.bases))
            opened = episodes.opened
            spans.on_step(record, episodes.ended,
                          list(map(users.__getitem__, opened)) if opened else (), sweep,
                          self.handles.facts_of)
        if record.limiter_share is not None:
            self.series.histograms[_LIMITER_SHARE].observe(record.limiter_share)
        if self.pending() > PENDING_STEPS_CAP:
            self.fold()  # (exports are late: keep what is pending bounded)
        if reads is not None:
            # Gauges and label changes only when an export is coming: their
            # cost is per export interval, not per step.
            self.fold(reads.gone)
            self.books.update_throttled(throttled, reads.blocks, book.thr_users)
            self.books.update_user_states(now, reads.requests, reads.ready_at)
            self.rebalance()
            if spans is not None:
                spans.on_throttled_users(now, self.books.thr_by_user)

    def fold(self, gone: list[str] | None = None) -> None:
        """Bring every user's charged and skipped counters (and activity),
        the throttle episodes' histograms and the spacing histograms up to
        date. ``gone``: requests that left the engine with an episode open
        (their episodes end here); given at export steps."""
        book = self.book
        charged = book.take_charged()
        if charged:
            charge, books = self.series.charge, self.books
            activity, window = books.activity, books.window_activity
            for user, n in charged.items():
                charge(user, n)
                activity[user] += n
                window[user] += n
        skip = self.series.skip
        for user, n in book.take_skipped(gone).items():
            if n:
                skip(user or OTHER, n)
        ended = book.take_ended()
        if ended:
            self.series.observe_episodes(ended)
        self.spacing.fold()

    def fold_request(self, req_id: str, handle: Any, now: int) -> None:
        """A request added while the event log is on: its handle, and its
        ``queued`` line."""
        self.handles.handles[req_id] = handle
        self.events.queue(("queued", now, req_id, self.handles.view.handle_user(handle)))

    def fold_outputs(self, cur: set[str], special: list[Any], outputs: dict[int, Any] | None,
                     now: int, running: bool, reads: EngineReads | None,
                     closing: Episodes | None = None) -> None:
        """Token timing from the outputs of one ``update_from_output``
        (``cur``: the requests with a token, ``special``: the outputs
        finished or with more than one token, ``outputs``: all of them when
        the event log is on; ``now``: when it returned, ``running``: whether
        anything was still running then, and if not, ``reads`` of the
        engine; ``closing``: the throttle episodes of requests that finished
        with one open, ended here before their spans are made)."""
        spans = self.spans
        if closing is not None:  # episodes of requests that finished inside one
            self.book.end_episodes(closing)
            if spans is not None:
                spans.on_ended(closing)
        if outputs is not None:
            self.events.outputs(outputs, now)
        timing = self.spacing.update(cur, special, now)
        if spans is not None:
            spans.on_outputs(timing, list(map(self.handles.facts_of, timing.first)))
        finished = timing.finished
        if finished:
            self.handles.forget(finished)
            if not running:
                self._going_idle(now, reads)

    def _going_idle(self, now: int, reads: EngineReads) -> None:
        """Nothing runs any more: no step may come to fold at."""
        self.prompt_work.idle(now)
        self.fold(reads.gone)
        self.books.update_user_states(now, reads.requests, reads.ready_at)
        if self.spans is not None:
            self.spans.on_idle(now)

    def fold_aborted(self, aborted: list[tuple[str, str]], now: int, ended: Episodes | None,
                     running: bool, reads: EngineReads | None) -> None:
        """Requests finished from outside the scheduler (client aborts);
        ``ended``: the throttle episodes open among them, ended now."""
        if ended is not None:
            self.book.end_episodes(ended)
        # The engine may go idle now, with no step to fold counts at.
        if not running:
            self.prompt_work.idle()
        self.fold(None if reads is None else reads.gone)
        if reads is not None:
            self.books.update_user_states(now, reads.requests, reads.ready_at)
        spans = self.spans
        facts = None
        if spans is not None:
            facts = [self.handles.facts_of(req_id) for req_id, _ in aborted]
        req_ids = [req_id for req_id, _ in aborted]
        self.handles.forget(req_ids)
        self.spacing.forget(req_ids)
        if self.events is not None:
            self.events.aborted(aborted, now)
        if spans is not None:
            spans.on_aborted(aborted, now, ended, facts)
            if not running:
                spans.on_idle(now)

    def fold_idle_wait(self, wait: IdleWait) -> None:
        self.prompt_work.idle(wait.started_ns)
        if self.spans is not None:
            self.spans.on_idle_wait(wait)
        self.series.histogram(IDLE_WAIT_SECONDS, (wait.reason,)).observe(
            (wait.woke_ns - wait.started_ns) / 1e9
        )
        lateness = wait.lateness_ns
        if lateness is not None and wait.reason == "timeout":
            self.series.histograms[_LATENESS].observe(max(lateness, 0) / 1e9)

    def fold_limits(self, change: LimitsChange) -> None:
        """Reloaded limits: pin the listed users' labels, give the new ones
        their series at zero, set the limit gauges, log the change."""
        self.fold()  # the counts so far, under the labels they had
        # (a label a newly pinned user takes from an unpinned one with the
        # same sanitized id goes on as the pinned user's series)
        series = self.series
        series.labeler.set_pinned(change.user_rates)
        gauges = series.gauges
        for key in [k for k in gauges if k[0] == USER_LIMIT_TOKENS_PER_SECOND.name]:
            del gauges[key]
        self.drop_labels(set())  # limit gauges, label caches, request labels
        series.init_user_series(series.labeler.pinned.values())
        if self.events is not None:
            self.events.limits(change)
        if self.spans is not None:
            self.spans.on_limits(change)

    def rebalance(self) -> None:
        """The labels follow the tokens charged since the last export."""
        labeler = self.series.labeler
        for user, n in self.books.take_activity().items():
            labeler.observe(user, n)
        added, evicted = labeler.rebalance()
        if not evicted and not added:
            return
        self.drop_labels(set(evicted))  # (the overflow bucket is never evicted)

    def drop_labels(self, gone: set[str]) -> None:
        """End the series of users that lost their label (their future
        counts go to ``__other__``); requests take their user's label."""
        self.series.drop_labels(gone)
        self.spacing.relabel()
