"""What runs on the scheduler's thread: the hand-over of each event to the
worker, and the reads of the engine that must be made then.

The start of the data's path. The scheduler hands over plain data when a
request is added, once per step (``StepReport``), once per
``update_from_output`` (the engine outputs, for token timing), at aborts,
once per idle wait (``IdleWait``) and when limits are reloaded. Here each
is appended to an inbox (references to the step's own containers, not
changed after it) for its fold on the worker (``telemetry.folds``), with
what only this thread may read: which throttle episodes end and begin (a
few passes in C; a request pacing at its limit keeps one episode over its
pacing), the KV blocks and facts of the requests whose episode began (with
spans), and at export steps the inputs of the gauges and user states (KV
blocks of the throttled requests, live requests per user).

Nothing here touches an mmap, a lock or an exporter; if the worker falls
``INBOX_CAP`` events behind, this thread drains the inbox itself (bounded
memory, nothing lost). This is the engine's hot path: every attribute it
reads per step is the intake's own (the folds are bound once, here).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from itertools import compress, filterfalse, repeat
from operator import le
from typing import Any

from vllm_output_rate.observers import (
    EngineOutputs,
    EngineView,
    IdleWait,
    LimitsChange,
    OutputRateObserver,
    StepReport,
)
from vllm_output_rate.telemetry.clock import SYSTEM, Clock
from vllm_output_rate.telemetry.folds import Folds
from vllm_output_rate.telemetry.metrics import TELEMETRY_DROPPED
from vllm_output_rate.telemetry.records import EngineReads, Episodes, StepEpisodes

logger = logging.getLogger("vllm_output_rate.telemetry")

#: Events handed over and not yet folded before the scheduler's thread
#: folds them itself (the worker is late: keeps the inbox bounded).
INBOX_CAP = 4096


class Inbox:
    """Events handed over by the scheduler's thread (``_post``), folded by
    the worker (``drain``); ``sync`` folds each at once, on the caller's
    thread (the default without a worker thread)."""

    def __init__(self, sync: bool, counters: dict, flush: Callable[[], None] | None) -> None:
        self._inbox: deque[tuple[Callable[..., None], tuple]] = deque()
        self._sync = sync
        self._drain_lock = threading.Lock()
        self._fold_error_logged = False
        #: where a failing fold is counted
        self._counters = counters
        #: builds the spans the folds queued, at the end of each drain (a
        #: span recorder without a builder thread of its own)
        self._flush = flush

    def _post(self, fold: Callable[..., None], *args: Any) -> None:
        """Hand one event to the worker (one append): ``fold(*args)`` runs
        there, in order. Done at once when nothing defers (``defer`` off);
        drained here when the worker lags ``INBOX_CAP`` events behind."""
        if self._sync:
            fold(*args)
            return
        inbox = self._inbox
        inbox.append((fold, args))
        if len(inbox) >= INBOX_CAP:
            self.drain()  # (backpressure: the worker is late)

    def drain(self) -> None:
        """Fold every event handed over so far (the worker does this every
        ``DRAIN_INTERVAL_S``; exports, close and tests call it). A failing
        fold is counted (``telemetry_dropped{reason="fold_failed"}``) and
        logged once; the others go on."""
        inbox = self._inbox
        with self._drain_lock:
            while inbox:
                fold, args = inbox.popleft()
                try:
                    fold(*args)
                except Exception:
                    self._counters[TELEMETRY_DROPPED.key("fold_failed")] += 1
                    if not self._fold_error_logged:
                        self._fold_error_logged = True
                        logger.exception("output-rate telemetry: folding an event failed; "
                                         "further failures are only counted")
            if self._flush is not None:
                self._flush()


class Intake(Inbox, OutputRateObserver):
    """The observer's methods the scheduler calls, on its thread."""

    def __init__(self, view: EngineView, folds: Folds, sync: bool, log_outputs: bool,
                 clock: Clock = SYSTEM) -> None:
        spans = folds.spans
        super().__init__(sync, folds.series.counters,
                         spans.flush if spans is not None and not sync
                         and getattr(spans, "_builder", None) is None else None)
        self.view = view
        self._monotonic_ns = clock.monotonic_ns
        #: tracing.recorder.SpanRecorder when traces are on
        self.spans = spans
        #: the worker's fold of each kind of event (bound once)
        self._fold_step = folds.fold_step
        self._fold_outputs = folds.fold_outputs
        self._fold_aborted = folds.fold_aborted
        self._fold_idle_wait = folds.fold_idle_wait
        self._fold_limits = folds.fold_limits
        self._add_handle = folds.handles.handles.__setitem__
        self._fold_request = folds.fold_request
        #: the event log is on: it gets every output
        self._log_outputs = log_outputs
        #: request id -> first skipped step's ns, of open throttle episodes
        self._episodes: dict[str, int] = {}
        #: request id -> (KV blocks, facts) when its open episode began
        #: (with spans)
        self._open_held: dict[str, tuple] = {}
        #: the requests throttled in the last step
        self._thr_prev_list: list[str] = []
        #: the requests dispatched in the last step with an episode open,
        #: that step's time and its charges (request -> user): those not
        #: throttled in the next step end there
        self._cur: Any = ()
        self._cur_ns = 0
        self._cur_by: dict[str, str] = {}
        #: the time and charges of the step before that one: with async
        #: scheduling, the step whose outputs an update brings
        self._prev_ns = 0
        self._prev_by: dict[str, str] = {}
        #: the step of the last report seen (None: none yet)
        self._last_step: int | None = None
        #: the next step reads the engine for an export (the exporter sets it)
        self._export_due = True

    def on_request(self, request_id: str) -> None:
        """A request was added: a handle to read its user and facts by
        later, on the worker, even once it is gone; with the event log on,
        also when (its ``queued`` line)."""
        handle = self.view.request_handle(request_id)
        if handle is not None:
            if self._log_outputs:
                self._post(self._fold_request, request_id, handle, self._monotonic_ns())
            else:
                self._post(self._add_handle, request_id, handle)

    def on_step(self, record: StepReport) -> None:
        """Hand one ``StepReport`` over.

        Here only: the throttle episodes that end and begin, by a few passes
        in C over the step's lists. An episode begins when a request is
        throttled with none open; it stays open while the request is
        dispatched a token and throttled again in the next step (a user
        pacing at its limit: one episode over its pacing, not one per
        token), and ends when the request, dispatched in a step, is not
        throttled in the step after: at that dispatch's time. Also the KV
        blocks and facts of the requests whose episode is long enough for a
        span, and at an export step the reads of the engine that gauges and
        user states need (and the requests gone with an episode open).
        Everything else runs on the worker (``Folds.fold_step``), from
        references to the report's own containers (not changed after the
        step)."""
        episodes = self._episodes
        now = record.now_ns
        charged = record.charged
        throttled = record.throttled
        # (a request throttled now that was not in the step before, when
        # that step was seen: only those can be one dispatched then)
        seen = record.step - 1 == self._last_step
        ended: Any = ()
        starts: Any = ()
        end_ns = self._cur_ns
        ended_by = self._cur_by
        prev = self._cur
        # A steady step at the limit: the requests dispatched inside an
        # episode in the step before are exactly those throttled now and not
        # then (every user pacing: each throttled again after its token).
        # None of them ends its episode, and none opens one (each has one
        # open): the passes below are skipped.
        again = record.throttled_new
        steady = seen and (again == prev if prev else not again)
        if prev and not steady:
            again = record.throttled_new if seen else throttled
            if again:
                ended = list(filter(episodes.__contains__, filterfalse(set(again).__contains__, prev)))
            else:
                ended = list(filter(episodes.__contains__, prev))
            if ended:
                starts = list(map(episodes.pop, ended))
        # dispatched now with an episode open: it ends next step, unless
        # the request is throttled again then
        cur: Any = ()
        lent = record.borrowed
        if lent:  # (borrowing: a token lent is a dispatch as a charged one is)
            charged = {**charged, **lent}
        if episodes and charged:
            cur = list(filter(episodes.__contains__, charged))
        self._cur = cur
        self._prev_ns = end_ns
        self._prev_by = ended_by
        self._cur_ns = now
        self._cur_by = charged
        opened: Any = ()
        if steady:
            self._thr_prev_list = throttled if throttled else []
        elif throttled:
            # (the same requests throttled as in the step before, in the
            # same order: a heavily throttled engine; nothing opens)
            if throttled != self._thr_prev_list:
                # Only a request not throttled in the step before can be
                # without an episode open (one throttled then has one), when
                # that step was seen: else every throttled one is looked at.
                maybe = record.throttled_new if seen else throttled
                opened = list(filterfalse(episodes.__contains__, maybe))
                if opened:
                    episodes.update(dict.fromkeys(opened, now))
                    if self.spans is not None:
                        # the KV blocks it holds while it waits (a throttled
                        # request computes nothing: they stay) and its facts
                        view = self.view
                        self._open_held.update(
                            {r: (view.kv_blocks_held(r), view.request_facts(r)) for r in opened})
                self._thr_prev_list = throttled
        elif self._thr_prev_list:
            self._thr_prev_list = []
        self._last_step = record.step
        # Every throttled request has an episode open, and so has every one
        # in ``cur`` (dispatched, not throttled): when as many are open as
        # both, the requests with one open are exactly those (the worker
        # counts skips by episode then).
        every = len(throttled) + len(cur) == len(episodes)
        closed = None
        if ended:
            closed = Episodes(end_ns, ended, starts, ended_by,
                              None if self.spans is None else self._held(ended, starts, end_ns))
        reads = None
        if self._export_due:
            self._export_due = False
            reads = self._engine_reads(record.throttled)
        self._post(self._fold_step, record, StepEpisodes(closed, opened, cur, every), reads)

    def _held(self, ended: list[str], starts: list[int], end_ns: int) -> dict | None:
        """The KV blocks and facts, read when their episodes began, of the
        requests whose ended episode gets a span (long ones only)."""
        kept = list(map(self._open_held.pop, ended, repeat(None)))
        long = list(compress(zip(ended, kept),
                             map(le, starts, repeat(end_ns - self.spans.throttle_min_ns))))
        if not long:
            return None
        view = self.view
        return {r: (view.kv_blocks_held(r), view.request_facts(r)) if h is None else h
                for r, h in long}

    def _engine_reads(self, throttled: list[str]) -> EngineReads:
        """What gauges and user states need from the engine, read on the
        scheduler's thread (at export steps and when it goes idle): the KV
        blocks of each throttled request, live requests per user and their
        users' ready times, the requests gone with an episode open (aborts
        close theirs; this is the guard)."""
        view = self.view
        episodes = self._episodes
        gone = []
        if episodes:
            gone = [r for r in episodes if view.user_of(r) is None]
            for req_id in gone:
                del episodes[req_id]
                self._open_held.pop(req_id, None)
        requests = view.requests_by_user()
        return EngineReads(list(map(view.kv_blocks_held, throttled)), requests,
                           {user: view.ready_at_ns(user) for user in requests}, gone)

    def on_outputs(self, outputs: EngineOutputs) -> None:
        """The engine outputs of one ``update_from_output``: when, and
        whether anything is still running.

        The requests with a token and the few outputs that need a closer
        look (finished, or more than one token) are picked out here, by two
        passes in C over output objects that the update has just made: the
        same passes on the worker read them from another core's cache,
        several times slower (R=1024: ~40 us here, ~200 us there)."""
        running = self.view.has_running()
        cur = {o.request_id for eco in outputs.values() for o in eco.outputs if o.new_token_ids}
        special = [o for eco in outputs.values() for o in eco.outputs
                   if o.finish_reason is not None or len(o.new_token_ids) > 1]
        # A request that finished with an episode open (its last token was
        # dispatched inside it): the episode ends at that dispatch, now,
        # before the request's own spans are made. The dispatch is the last
        # step's, or with async scheduling the step before it (the last
        # step was scheduled while this update's tokens were in flight, and
        # may have throttled the request again: its stop was not known).
        closing = None
        episodes = self._episodes
        if episodes and special:
            done = [o.request_id for o in special
                    if o.finish_reason is not None and o.request_id in episodes]
            if done:
                starts = list(map(episodes.pop, done))
                end_ns, by_id = self._cur_ns, self._cur_by
                if done[0] not in by_id:  # (one update: the tokens of one step)
                    end_ns, by_id = self._prev_ns, self._prev_by
                closing = Episodes(end_ns, done, starts, by_id,
                                   None if self.spans is None else self._held(done, starts, end_ns))
        self._post(self._fold_outputs, cur, special, outputs if self._log_outputs else None,
                   self._monotonic_ns(), running, None if running else self._engine_reads([]),
                   closing)

    def on_aborted(self, aborted: list[tuple[str, str]], now: int) -> None:
        """Requests finished from outside the scheduler (client aborts): the
        throttle episodes open among them close."""
        episodes = self._episodes
        closed = None
        if episodes:
            ended = {r: episodes.pop(r) for r, _ in aborted if r in episodes}
            if ended:
                held = None
                if self._open_held:
                    # (the KV blocks they held while they waited, for their spans)
                    kept = self._open_held
                    held = {r: kept.pop(r) for r in ended if r in kept}
                closed = Episodes(now, list(ended), list(ended.values()), dict(aborted), held)
        running = self.view.has_running()
        self._post(self._fold_aborted, aborted, now, closed, running,
                   None if running else self._engine_reads([]))

    def on_idle_wait(self, wait: IdleWait) -> None:
        self._post(self._fold_idle_wait, wait)

    def on_limits(self, change: LimitsChange) -> None:
        self._post(self._fold_limits, change)
