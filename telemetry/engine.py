"""Engine-side telemetry: handed over on the scheduler's thread, folded and
exported off it.

Lives in the engine-core process: an ``OutputRateObserver`` (see
``vllm_output_rate.observers``), registered by ``telemetry.plugin``. The
scheduler hands over plain data when a request is added, once per step
(``StepReport``), once per ``update_from_output`` (the engine outputs, for
token timing), at aborts and once per idle wait (``IdleWait``). On the
scheduler's thread this module only appends each to an inbox (references
to the step's own containers, not changed after it) and makes the reads of
the engine that must be made then: which throttle episodes end and begin
(a few passes in C; a request pacing at its limit keeps one episode over
its pacing), the KV blocks and facts of the requests whose episode began
(with spans), and at export steps the inputs of the
gauges and user states (KV blocks of the throttled requests, live requests
per user). A worker thread of ours drains the inbox every
``DRAIN_INTERVAL_S`` and folds it, in order, into plain dicts of counters,
gauges and histogram buckets (users and facts of requests by a handle taken
when each was added: they may be gone from the engine by then), then
builds the spans (``tracing.spans``). Nothing here touches an mmap, a lock
or an exporter on the scheduler's thread; if the worker falls
``INBOX_CAP`` events behind, the scheduler's thread drains the inbox
itself (bounded memory, nothing lost). A fold that fails is counted in
``telemetry_dropped_total{reason="fold_failed"}`` and logged once.

The worker copies the dicts every ``interval_s`` and writes a JSON snapshot
atomically (temp file + rename) into the telemetry directory; ``telemetry.collector`` in the API-server process
turns the snapshots into Prometheus metrics on vLLM's own ``/metrics``. A
failing write is counted in ``telemetry_dropped_total`` and logged once.

Token timing: every output token becomes available in the engine when
``update_from_output`` returns; tokens of one step share that moment. The
spacing of a request's tokens is observed per request per step (a request
with k tokens in a step adds one spacing and k - 1 zeros), never per token
event.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import threading
import time
from collections import Counter, defaultdict, deque
from itertools import chain, compress, filterfalse, repeat
from operator import add, le, sub
from collections.abc import Callable
from typing import Any

import numpy as np

from vllm_output_rate.telemetry.events import encode_event
from vllm_output_rate.telemetry.labels import OTHER, UserLabeler
from vllm_output_rate.telemetry.metrics import BY_NAME, SPACING_BUCKETS, STORE_CALL_BUCKETS
from vllm_output_rate import settings
from vllm_output_rate.limits_watch import RESULTS as LIMITS_RESULTS

NS = 1_000_000_000
#: Most users whose state the snapshot carries for introspection.
USER_STATES_CAP = 1000
from vllm_output_rate.observers import (
    EngineView,
    IdleWait,
    LimitsChange,
    OutputRateObserver,
    StepReport,
)

logger = logging.getLogger("vllm_output_rate.telemetry")

#: Event records queued between two exports before new ones are dropped.
EVENTS_QUEUE_CAP = 500_000
EXPORT_INTERVAL_S = 1.0
#: How often the worker folds what the scheduler's thread handed over.
DRAIN_INTERVAL_S = 0.1
#: Events handed over and not yet folded before the scheduler's thread
#: folds them itself (the worker is late: keeps the inbox bounded).
INBOX_CAP = 4096
#: Steps' charges and skips kept for the next fold before one is forced (an
#: export is due every ``EXPORT_INTERVAL_S``; this bounds them if it is late).
PENDING_STEPS_CAP = 4096

Labels = tuple[str, ...]
#: Why a charged token was given back (see the scheduler's refund point).
REFUND_REASONS = ("not_scheduled", "preempted")


_THROTTLED_GAUGES = (
    "throttled_requests", "throttled_kv_blocks", "engine_throttled_requests",
    "engine_throttled_kv_blocks", "throttled_kv_cache_ratio",
)


class Histogram:
    """Bucket counts (non-cumulative), sum and count, in plain Python."""

    __slots__ = ("bounds", "counts", "sum", "count")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, n: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += n
        self.sum += value * n
        self.count += n

    def add(self, other: Histogram) -> None:
        """Fold ``other`` (same buckets) into this one."""
        self.counts = [a + b for a, b in zip(self.counts, list(other.counts))]
        self.sum += other.sum
        self.count += other.count

    def snapshot(self) -> list[Any]:
        return [list(self.counts), self.sum, self.count]


def _window_sums(window: Any, now_ns: int) -> tuple[Counter[str], Counter[str]]:
    """Tokens charged per user over the last 10 s and 60 s of ``window``."""
    charged_10: Counter[str] = Counter()
    charged_60: Counter[str] = Counter()
    for t, counts in window:
        age = now_ns - t
        if age <= 60 * NS:
            charged_60.update(counts)
            if age <= 10 * NS:
                charged_10.update(counts)
    return charged_10, charged_60


class EngineTelemetry(OutputRateObserver):
    """Per-step aggregation for one engine's scheduler, plus the exporter."""

    def __init__(self, view: EngineView, out_dir: str, interval_s: float = EXPORT_INTERVAL_S,
                 top_k: int | None = None, start_thread: bool = True,
                 spans: Any = None, events_path: str | None = None,
                 defer: bool | None = None) -> None:
        self.view = view
        #: tracing.spans.SpanRecorder when traces are on
        self.spans = spans
        #: events handed over by the scheduler's thread, folded by the worker
        #: (``drain``); ``defer`` off (the default without a thread) folds
        #: each at once, on the caller's thread
        self._inbox: deque[tuple[Callable[..., None], tuple]] = deque()
        self._sync = not (start_thread if defer is None else defer)
        #: a span recorder without a builder thread of its own builds what
        #: the worker queued at the end of each drain (while it is in cache)
        self._flush_spans = (spans is not None and not self._sync
                             and getattr(spans, "_builder", None) is None)
        self._drain_lock = threading.Lock()
        self._fold_error_logged = False
        #: request id -> its handle (``EngineView.request_handle``), from
        #: when it was added until it ends (the worker)
        self._handles: dict[str, Any] = {}
        #: the last step that sent the users with an episode open to the
        #: span recorder, for over-limit periods to end
        self._ticked = 0
        self.engine = view.engine_index
        self.model_name = view.model_name
        if top_k is None:
            top_k = settings.get("TOP_K_USERS")
        self.labeler = UserLabeler(pinned=view.user_rates, top_k=top_k)
        self.path = os.path.join(out_dir, f"engine-{self.engine}.json")
        self.interval_s = interval_s
        self.counters: dict[tuple[str, Labels], float] = defaultdict(float)
        self.gauges: dict[tuple[str, Labels], float] = {}
        self.histograms: dict[tuple[str, Labels], Histogram] = {}
        #: request id -> when its last token came, for requests that had
        #: none at the previous update (the others: ``_prev_now``)
        self._last_token_ns: dict[str, int] = {}
        #: tokens charged per user since the last export (labeler activity)
        self._activity: Counter[str] = Counter()
        #: user -> counter key (bounded; cleared when labels change)
        self._charged_keys: dict[str, tuple] = {}
        self._skipped_keys: dict[str, tuple] = {}
        #: What each step charged (request -> user) and throttled, kept as
        #: references to the step reports' own containers, run-length encoded
        #: ([the step's dict or list, how many steps in a row had it]): no work per
        #: user or per request in a step; folded into the counters at
        #: exports, aborts, when the engine goes idle and at close
        #: (``_fold``), or when ``PENDING_STEPS_CAP`` runs are pending.
        self._charge_runs: list[list[Any]] = []
        #: closed throttle episodes not yet in their histograms: (end ns,
        #: request ids, start ns of each, request id -> user, steps each
        #: was counted skipped in since the last fold)
        self._ended_runs: list[tuple[int, list[str], list[int], Any, list[int]]] = []
        #: the steps whose throttled requests were exactly those with an
        #: episode open, so far; request id -> that count when its episode
        #: began or was last folded (the requests with an episode open, as
        #: the scheduler's thread keeps them); the count at the last fold
        self._full_steps = 0
        self._bases: dict[str, int] = {}
        self._bases_at = 0
        #: the throttled lists of the other steps, since the last fold
        self._skip_lists: list[list[str]] = []
        #: the requests dispatched with an episode open in the steps that
        #: ``_full_steps`` counts (counted there, but not skipped), since
        #: the last fold
        self._inside_lists: list[list[str]] = []
        #: spacings of requests back after a pause, not yet in their
        #: histograms: (update ns, previous token ns of each, label of each)
        self._resume_runs: list[tuple[int, list[int], list[str | None]]] = []
        #: the requests throttled in the last step, and the users of the
        #: requests throttled since the last fold
        self._thr_prev_list: list[str] = []
        #: (the scheduler's thread) the requests dispatched in the last step
        #: with an episode open, that step's time and its charges
        #: (request -> user): those not throttled in the next step end there
        self._cur: Any = ()
        self._cur_ns = 0
        self._cur_by: dict[str, str] = {}
        #: the step of the last report seen (None: none yet)
        self._last_step: int | None = None
        self._thr_users: dict[str, str] = {}
        #: request ids that had tokens at the previous update, and when
        self._prev_ids: set[str] = set()
        #: those of them that had none at the update before (back after a
        #: throttle, or their first token): not yet counted in
        #: ``_prev_by_label``, so a request of a user pacing at its limit
        #: (one token, then throttled again) never is
        self._joining: set[str] = set()
        #: label -> how many of ``_prev_ids`` (less ``_joining``) carry it
        self._prev_by_label: dict[str, int] = {}
        self._prev_now = 0
        #: steady updates so far: how many, per spacing bucket, and their
        #: spacings' sum (ns); label -> those three when its histogram last
        #: took its steady share (labels with steady requests only)
        self._steady_n = 0
        self._steady_cum = [0] * (len(SPACING_BUCKETS) + 1)
        self._steady_ns = 0
        self._spacing_mark: dict[str, tuple[int, list[int], int]] = {}
        #: label -> its inter_token_seconds histogram (same objects as in
        #: self.histograms), and what evicted labels had observed
        self._spacing: dict[str, Histogram] = {}
        self._spacing_evicted = Histogram(SPACING_BUCKETS)
        #: store-call latencies of shared-budget mode (exporter thread only)
        self._store_call_hist: Histogram | None = None
        self._request_label: dict[str, str] = {}
        #: label -> its throttle_episode_seconds histogram (cleared when labels change)
        self._episode_hists: dict[str, Histogram] = {}
        #: request id -> first skipped step's ns, of open throttle episodes
        #: (the scheduler's thread)
        self._episodes: dict[str, int] = {}
        #: request id -> (KV blocks, facts) when its open episode began
        #: (with spans; the scheduler's thread)
        self._open_held: dict[str, tuple] = {}
        #: the opt-in event log: plain tuples queued here, written by the exporter
        self._events_path = events_path
        self._events: deque[tuple] | None = deque() if events_path else None
        #: request id -> [user, tokens so far], while the event log is on
        self._event_tokens: dict[str, list] = {}
        self._events_started = False
        #: the last throttled line queued was all zero
        self._events_idle = False
        #: an all-zero line was queued since the engine last ran a step
        self._events_idle_written = False
        #: consecutive exports that found the engine with nothing running
        self._idle_exports = 0
        self._num_blocks = view.num_kv_blocks
        #: user -> (throttled requests, their KV blocks) at the last export step
        self._thr_by_user: dict[str, tuple[int, int]] = {}
        #: (export step's ns, tokens charged per user in its interval), 60 s
        self._charged_window: deque[tuple[int, dict[str, int]]] = deque()
        #: tokens charged per user since the window's last entry
        self._window_activity: Counter[str] = Counter()
        #: per-user state for introspection (replaced whole), and when
        #: (scheduler clock ns, monotonic ns, unix s)
        self._user_states: dict[str, dict[str, Any]] = {}
        self._user_states_at = (0, 0, 0.0)
        #: the limits document in force, rebuilt when the digest changes
        self._limits_doc: tuple[str, dict[str, Any]] = ("", {})
        self._export_due = True
        self._drop_logged = False
        self._stop = threading.Event()
        # Limits and zero-valued series exist from the first export on.
        self._set_limits()
        for name in ("engine_tokens_charged", "engine_tokens_refunded", "engine_requests_skipped"):
            self.counters[(name, ())] += 0
        self.counters[("telemetry_dropped", ("export_failed",))] += 0
        self.counters[("telemetry_dropped", ("fold_failed",))] += 0
        if events_path:
            for reason in ("events_write_failed", "events_queue_full"):
                self.counters[("telemetry_dropped", (reason,))] += 0
        self._init_user_series(self.labeler.labelled_users().values())
        for name in ("wake_lateness_seconds", "schedule_limiter_ratio"):
            self._histogram(name, ())
        self._update_throttled_gauges([], [])
        self._thread = None
        if start_thread:
            self._thread = threading.Thread(target=self._run, name="output-rate-telemetry", daemon=True)
            self._thread.start()

    # -- helpers ------------------------------------------------------------

    def _histogram(self, name: str, labels: Labels) -> Histogram:
        key = (name, labels)
        hist = self.histograms.get(key)
        if hist is None:
            hist = self.histograms[key] = Histogram(BY_NAME[name].buckets)
        return hist

    def _init_user_series(self, labels: Any) -> None:
        """Configured users have their series from the start (rate() works)."""
        for label in labels:
            self.counters[("tokens_charged", (label,))] += 0
            self.counters[("requests_skipped", (label,))] += 0
            for reason in REFUND_REASONS:
                self.counters[("tokens_refunded", (label, reason))] += 0
            self._histogram("throttle_episode_seconds", (label,))

    def _set_limits(self) -> None:
        view = self.view
        self.gauges[("default_limit_tokens_per_second", ())] = float(view.default_rate)
        for user, label in self.labeler.labelled_users().items():
            self.gauges[("user_limit_tokens_per_second", (label,))] = float(view.rate_of(user))

    # -- the scheduler's thread: references, and what only it may read -----

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

    def on_request(self, request_id: str) -> None:
        """A request was added: a handle to read its user and facts by
        later, on the worker, even once it is gone."""
        handle = self.view.request_handle(request_id)
        if handle is not None:
            self._post(self._handles.__setitem__, request_id, handle)

    def on_step(self, record: StepReport) -> None:
        """Hand one ``StepReport`` over (the scheduler's thread).

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
        Everything else runs on the worker (``_fold_step``), from references
        to the report's own containers (not changed after the step)."""
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
        if prev:
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
        if episodes and charged:
            cur = list(filter(episodes.__contains__, charged))
        self._cur = cur
        self._cur_ns = now
        self._cur_by = charged
        opened: Any = ()
        if throttled:
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
        held = None
        spans = self.spans
        if spans is not None and ended:
            held = self._held(ended, starts, end_ns)
        reads = None
        if self._export_due:
            self._export_due = False
            reads = self._engine_reads(record.throttled)
        self._post(self._fold_step, record, ended, starts, end_ns, ended_by, opened, cur, every,
                   held, reads)

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

    def _engine_reads(self, throttled: list[str]) -> tuple:
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
        return (list(map(view.kv_blocks_held, throttled)), requests,
                {user: view.ready_at_ns(user) for user in requests}, gone)

    def on_outputs(self, outputs: dict[int, Any]) -> None:
        """The engine outputs of one ``update_from_output``: when, and
        whether anything is still running (the scheduler's thread).

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
        # before the request's own spans are made.
        closing = None
        episodes = self._episodes
        if episodes and special:
            done = [o.request_id for o in special
                    if o.finish_reason is not None and o.request_id in episodes]
            if done:
                starts = list(map(episodes.pop, done))
                end_ns = self._cur_ns
                closing = (done, starts, end_ns, self._cur_by,
                           None if self.spans is None else self._held(done, starts, end_ns))
        self._post(self._fold_outputs, cur, special, outputs if self._events is not None else None,
                   time.monotonic_ns(), running, None if running else self._engine_reads([]),
                   closing)

    # -- the worker: everything else, in the scheduler's order -----------------

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
                    self.counters[("telemetry_dropped", ("fold_failed",))] += 1
                    if not self._fold_error_logged:
                        self._fold_error_logged = True
                        logger.exception("output-rate telemetry: folding an event failed; "
                                         "further failures are only counted")
            if self._flush_spans:
                self.spans.flush()

    def _user_of(self, req_id: str) -> str | None:
        """A request's user, by the handle taken when it was added (it may
        be gone from the engine by now)."""
        handle = self._handles.get(req_id)
        if handle is None:
            return self.view.user_of(req_id)
        return self.view.handle_user(handle)

    def _facts_of(self, req_id: str) -> Any:
        handle = self._handles.get(req_id)
        if handle is None:
            return self.view.request_facts(req_id)
        return self.view.handle_facts(handle)

    def _fold_step(self, record: StepReport, ended: Any, starts: Any, end_ns: int,
                   ended_by: dict[str, str], opened: Any, cur: Any, every: bool,
                   held: Any, reads: tuple | None) -> None:
        """One step, on the worker: references to the report's containers
        kept for the next fold (``_fold``); what each user was charged,
        run-length encoded ([the step's dict, how many steps in a row had
        it]). Skips are counted by throttle episode: a step whose throttled
        requests and those dispatched inside an episode (``cur``) are
        exactly those with an episode open (``every``: most steps) only
        moves a step count on (and keeps ``cur``, subtracted at the fold),
        and an episode that ends (at ``end_ns``; ``ended_by``: the charges
        of the step it ended in) or a fold credits its request with the
        steps counted since it began; the other steps' throttled lists are
        counted request by request."""
        counters = self.counters
        charged = record.charged
        # The step's own request -> user dict of charges (net of refunds),
        # or one more step of the last one when equal (a steady engine:
        # most steps); counted per user at the fold, in C.
        if charged:
            runs = self._charge_runs
            if runs and runs[-1][0] == charged:
                runs[-1][1] += 1
            else:
                runs.append([charged, 1])
            counters[("engine_tokens_charged", ())] += len(charged)
        if record.refunded:
            labeler = self.labeler
            for _req_id, user, reason in record.refunded:
                counters[("tokens_refunded", (labeler.label(user), reason))] += 1
                counters[("engine_tokens_refunded", ())] += 1
        now = record.now_ns
        if ended:
            self._end_episodes(end_ns, ended, starts, ended_by)
        bases, full = self._bases, self._full_steps
        if opened:
            users = self._thr_users
            new = list(filterfalse(users.__contains__, opened))
            if new:
                user_of = self._user_of
                for req_id in new:
                    users[req_id] = user_of(req_id) or OTHER
            bases.update(dict.fromkeys(opened, full))
        throttled = record.throttled
        if every:
            self._full_steps = full + 1
            if cur:
                self._inside_lists.append(cur)
        elif throttled:
            self._skip_lists.append(throttled)
        if throttled:
            counters[("engine_requests_skipped", ())] += len(throttled)
        spans = self.spans
        if spans is not None:
            sweep = None
            if now - self._ticked >= spans.sweep_ns:  # users with an episode open
                self._ticked = now
                sweep = set(map(self._thr_users.get, bases))
            spans.on_step(record, ended, starts,
                          list(map(self._thr_users.__getitem__, opened)) if opened else (),
                          held, sweep, end_ns, ended_by)
        if record.limiter_share is not None:
            self.histograms[("schedule_limiter_ratio", ())].observe(record.limiter_share)
        if (len(self._charge_runs) + len(self._skip_lists) + len(self._ended_runs)
                + len(self._resume_runs) + len(self._inside_lists)) > PENDING_STEPS_CAP:
            self._fold()  # (exports are late: keep what is pending bounded)
        if reads is not None:
            # Gauges and label changes only when an export is coming: their
            # cost is per export interval, not per step.
            blocks, requests, ready, gone = reads
            self._fold(gone)
            self._update_throttled_gauges(throttled, blocks)
            self._update_user_states(now, requests, ready)
            self._rebalance()
            if spans is not None:
                spans.on_throttled_users(now, self._thr_by_user)

    def _end_episodes(self, end_ns: int, ended: list[str], starts: list[int],
                      by_id: dict[str, str]) -> None:
        """Throttle episodes of ``ended`` (begun at ``starts``) that ended at
        ``end_ns``; ``by_id``: request -> user for them. Their durations and
        skips (the steps counted since each began) go in at the next fold."""
        full = self._full_steps
        credits = list(map(sub, repeat(full, len(ended)), map(self._bases.pop, ended, repeat(full))))
        self._ended_runs.append((end_ns, ended, starts, by_id, credits))

    def _charge_fold(self, user: str, n: int) -> None:
        self.counters[self._user_key(self._charged_keys, "tokens_charged", user)] += n
        self._activity[user] += n
        self._window_activity[user] += n

    def _skip_fold(self, user: str, n: int) -> None:
        self.counters[self._user_key(self._skipped_keys, "requests_skipped", user)] += n

    def _fold(self, gone: list[str] | None = None) -> None:
        """Bring every user's charged and skipped counters (and activity),
        the throttle episodes' histograms and the spacing histograms up to
        date: at exports, aborts, when the engine goes idle, at close (the
        worker). ``gone``: requests that left the engine with an episode
        open (their episodes end here); given at export steps, after which
        only the users of requests with an episode open stay known."""
        runs, self._charge_runs = self._charge_runs, []
        if runs:
            # (the users of every charge of the steps seen once: counted in
            # C; a run of equal steps: its step's counts times its length)
            charged: Counter[str] = Counter(
                chain.from_iterable(by_id.values() for by_id, k in runs if k == 1))
            for by_id, k in runs:
                if k > 1:
                    for user, n in Counter(by_id.values()).items():
                        charged[user] += n * k
            for user, n in charged.items():
                self._charge_fold(user, n)
        users, bases, full = self._thr_users, self._bases, self._full_steps
        user_of = users.get
        skipped: Counter[str | None] = Counter()
        if gone:
            for req_id in gone:
                base = bases.pop(req_id, None)
                if base is not None and full > base:
                    skipped[user_of(req_id)] += full - base
        # the steps counted since the last fold, for every episode open
        if bases and self._bases_at != full:
            for req_id, base in bases.items():
                if full > base:
                    skipped[user_of(req_id)] += full - base
            self._bases = dict.fromkeys(bases, full)
        self._bases_at = full
        if self._ended_runs:  # (per episode, in C and numpy: a user's credits summed)
            ended_users: list[str | None] = []
            ended_credits: list[int] = []
            for _now, ended, _starts, _by_id, credits in self._ended_runs:
                ended_users.extend(map(user_of, ended))
                ended_credits.extend(credits)
            skipped.update(_sums_by_key(ended_users, ended_credits))
        lists, self._skip_lists = self._skip_lists, []
        if lists:
            # (the other steps: counted in C per request, then per user)
            for req_id, n in Counter(chain.from_iterable(lists)).items():
                skipped[user_of(req_id)] += n
        inside, self._inside_lists = self._inside_lists, []
        if inside:
            # steps counted that dispatched a request inside its episode
            for req_id, n in Counter(chain.from_iterable(inside)).items():
                skipped[user_of(req_id)] -= n
        for user, n in skipped.items():
            if n:
                self._skip_fold(user or OTHER, n)
        if gone is not None and len(users) > len(self._bases):
            # only the requests in an open episode stay known
            self._thr_users = {r: users[r] for r in self._bases if r in users}
        ended, self._ended_runs = self._ended_runs, []
        if ended:
            self._observe_episodes(ended)
        resumes, self._resume_runs = self._resume_runs, []
        if resumes:
            labels: list[str | None] = []
            spacings: list[int] = []
            for now, prevs, labs in resumes:  # (per update; lists made in C)
                labels.extend(labs)
                spacings.extend(map(sub, repeat(now, len(prevs)), prevs))
            _observe_by_label(labels, spacings, lambda name: self._spacing_hist(name or OTHER))
        for label, k in self._prev_by_label.items():
            self._fold_spacing(label, k)

    def _observe_episodes(self, ended: list[tuple[int, list[str], list[int], Any, Any]]) -> None:
        """Closed throttle episodes into their users' histograms."""
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
                hist = hists[name] = self._histogram("throttle_episode_seconds", (name,))
            return hist

        _observe_by_label(list(map(labels.__getitem__, users)), took, hist_of)

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

    def on_aborted(self, aborted: list[tuple[str, str]], now: int) -> None:
        """Requests finished from outside the scheduler (client aborts): the
        throttle episodes open among them close (the scheduler's thread)."""
        episodes = self._episodes
        ended = {}
        held = None
        if episodes:
            ended = {r: episodes.pop(r) for r, _ in aborted if r in episodes}
            if ended and self._open_held:
                # (the KV blocks they held while they waited, for their spans)
                kept = self._open_held
                held = {r: kept.pop(r) for r in ended if r in kept}
        running = self.view.has_running()
        self._post(self._fold_aborted, aborted, now, ended, running,
                   None if running else self._engine_reads([]), held)

    def _fold_aborted(self, aborted: list[tuple[str, str]], now: int, ended: dict[str, int],
                      running: bool, reads: tuple | None, held: dict | None = None) -> None:
        if ended:
            self._end_episodes(now, list(ended), list(ended.values()), dict(aborted))
        # The engine may go idle now, with no step to fold counts at.
        self._fold(None if reads is None else reads[3])
        if reads is not None:
            self._update_user_states(now, reads[1], reads[2])
        facts = None
        if self.spans is not None:
            facts = [self._facts_of(req_id) for req_id, _ in aborted]
        for req_id, user in aborted:
            self._handles.pop(req_id, None)
            self._last_token_ns.pop(req_id, None)
            if req_id in self._prev_ids:
                if req_id in self._joining:
                    self._joining.discard(req_id)
                else:
                    self._label_count(req_id, -1)
                self._prev_ids.discard(req_id)
            self._request_label.pop(req_id, None)
            if self._events is not None:
                seen = self._event_tokens.pop(req_id, None)
                self._queue_event(("finished", now, req_id, user,
                                   "abort", seen[1] if seen else 0))
        if self.spans is not None:
            self.spans.on_aborted(aborted, now, ended, facts, held)
            if not running:
                self.spans.on_idle(now)

    def _queue_event(self, event: tuple) -> None:
        events = self._events
        if len(events) >= EVENTS_QUEUE_CAP:
            self.counters[("telemetry_dropped", ("events_queue_full",))] += 1
        else:
            events.append(event)

    def _update_throttled_gauges(self, throttled: list[str], held: list[int]) -> None:
        """``held``: the KV blocks of each throttled request (read on the
        scheduler's thread)."""
        users = self._thr_users
        requests: dict[str, int] = defaultdict(int)
        blocks: dict[str, int] = defaultdict(int)
        total_blocks = 0
        by_user: dict[str, list[int]] = {}
        for req_id, n in zip(throttled, held):
            user = users.get(req_id, OTHER)
            label = self.labeler.label(user)
            requests[label] += 1
            blocks[label] += n
            total_blocks += n
            counts = by_user.get(user)
            if counts is None:
                counts = by_user[user] = [0, 0]
            counts[0] += 1
            counts[1] += n
        self._thr_by_user = {u: (c[0], c[1]) for u, c in by_user.items()}
        for key in [k for k in self.gauges if k[0] in ("throttled_requests", "throttled_kv_blocks")]:
            del self.gauges[key]
        for label in set(requests) | set(self.labeler.labelled_users().values()):
            self.gauges[("throttled_requests", (label,))] = requests.get(label, 0)
            self.gauges[("throttled_kv_blocks", (label,))] = blocks.get(label, 0)
        self.gauges[("engine_throttled_requests", ())] = len(throttled)
        self.gauges[("engine_throttled_kv_blocks", ())] = total_blocks
        self.gauges[("throttled_kv_cache_ratio", ())] = total_blocks / self._num_blocks
        if self._events is not None:
            self._events_idle_written = False  # a step ran: the engine is busy
        if self._events is not None and (throttled or not self._events_idle):
            self._events_idle = not throttled
            self._queue_event(("throttled", time.monotonic_ns(),
                               {u: c[0] for u, c in by_user.items()},
                               {u: c[1] for u, c in by_user.items()},
                               total_blocks / self._num_blocks))

    def _update_user_states(self, now_ns: int, requests: Any, ready_at: dict[str, int]) -> None:
        """What ``GET /output-rate/users/NAME`` shows, per user (the worker:
        at each export step and when the engine goes idle; ``requests`` and
        the live users' ``ready_at`` read on the scheduler's thread): tokens
        charged over the last 10 s and 60 s (in export intervals of about a
        second), requests running, waiting and throttled, KV blocks held
        while throttled, when the budget is next ready. At most
        ``USER_STATES_CAP`` users (live requests first, then the most
        charged)."""
        activity, self._window_activity = self._window_activity, Counter()
        if len(activity) > USER_STATES_CAP:
            activity = Counter(dict(activity.most_common(USER_STATES_CAP)))
        window = self._charged_window
        window.append((now_ns, dict(activity)))
        while window and now_ns - window[0][0] > 60 * NS:
            window.popleft()
        charged_10, charged_60 = _window_sums(window, now_ns)
        view = self.view
        throttled = self._thr_by_user if requests else {}
        users = list(requests)
        if len(users) < USER_STATES_CAP:
            users += [u for u, _ in charged_60.most_common(USER_STATES_CAP - len(users))
                      if u not in requests]
        states = {}
        for user in users[:USER_STATES_CAP]:
            running, waiting = requests.get(user, (0, 0))
            n_thr, blocks = throttled.get(user, (0, 0))
            ready = ready_at.get(user)
            if ready is None:  # (not live: its limiter state, read now)
                ready = view.ready_at_ns(user)
            states[user] = {
                "limit": float(view.rate_of(user)),
                "charged_10s": charged_10.get(user, 0),
                "charged_60s": charged_60.get(user, 0),
                "running": running,
                "waiting": waiting,
                "throttled": n_thr,
                "throttled_kv_blocks": blocks,
                "ready_in_s": max(0.0, (ready - now_ns) / NS) if ready else 0.0,
            }
        self._user_states = states
        self._user_states_at = (now_ns, time.monotonic_ns(), time.time())

    def _idle_user_states(self) -> dict[str, dict[str, Any]]:
        """The user states of an idle engine, as of now (exporter thread):
        no step runs to update them, so the charged windows slide here."""
        now_ns, mono, _ = self._user_states_at
        now_ns += time.monotonic_ns() - mono
        try:
            window = list(self._charged_window)
        except RuntimeError:  # appended to right now: the engine is not idle
            return self._user_states
        charged_10, charged_60 = _window_sums(window, now_ns)
        states = {}
        for user, state in self._user_states.items():
            ready_in = max(0.0, state["ready_in_s"] - (now_ns - self._user_states_at[0]) / NS)
            states[user] = {**state, "charged_10s": charged_10.get(user, 0),
                            "charged_60s": charged_60.get(user, 0), "running": 0,
                            "throttled": 0, "throttled_kv_blocks": 0, "ready_in_s": ready_in}
        return states

    def _rebalance(self) -> None:
        activity, self._activity = self._activity, Counter()
        for user, n in activity.items():
            self.labeler.observe(user, n)
        added, evicted = self.labeler.rebalance()
        if not evicted and not added:
            return
        self._drop_labels(set(evicted))  # (the overflow bucket is never evicted)

    def _drop_labels(self, gone: set[str]) -> None:
        """End the series of users that lost their label; their future
        counts go to ``__other__``."""
        for key in list(self.counters):
            name, labels = key
            if labels and labels[0] in gone and name in ("tokens_charged", "tokens_refunded", "requests_skipped"):
                del self.counters[key]
        for key in list(self.histograms):
            if key[1] and key[1][0] in gone:
                hist = self.histograms.pop(key)
                if key[0] == "inter_token_seconds":
                    self._spacing.pop(key[1][0], None)
                    self._spacing_evicted.add(hist)
        for key in list(self.gauges):
            if key[1] and key[1][0] in gone:
                del self.gauges[key]
        self._set_limits()
        self._charged_keys.clear()
        self._skipped_keys.clear()
        self._episode_hists.clear()
        # Requests keep the label of their first token until labels change.
        user_of, labels = self._user_of, self._request_label
        for req_id in list(labels):
            user = user_of(req_id)
            if user is not None:
                labels[req_id] = self.labeler.label(user)
        self._prev_by_label = dict(Counter(labels.get(r) or OTHER
                                           for r in self._prev_ids - self._joining))
        self._spacing_mark = {label: self._steady_now() for label in self._prev_by_label}

    def on_limits(self, change: LimitsChange) -> None:
        self._post(self._fold_limits, change)

    def _fold_limits(self, change: LimitsChange) -> None:
        """Reloaded limits: pin the listed users' labels, give the new ones
        their series at zero, set the limit gauges, log the change."""
        self._fold()  # the counts so far, under the labels they had
        # (a label a newly pinned user takes from an unpinned one with the
        # same sanitized id goes on as the pinned user's series)
        self.labeler.set_pinned(change.user_rates)
        for key in [k for k in self.gauges if k[0] == "user_limit_tokens_per_second"]:
            del self.gauges[key]
        self._drop_labels(set())  # limit gauges, label caches, request labels
        self._init_user_series(self.labeler.pinned.values())
        if self._events is not None:
            self._queue_event(("limits", change.now_ns, time.time_ns(), {
                u: float(r) for u, r in change.user_rates.items()}, float(change.default_rate),
                change.digest, list(change.added), list(change.removed), list(change.changed)))
        if self.spans is not None:
            self.spans.on_limits(change)

    def _fold_outputs(self, cur: set[str], special: list[Any], outputs: dict[int, Any] | None,
                      now: int, running: bool, reads: tuple | None,
                      closing: tuple | None = None) -> None:
        """Token timing from the outputs of one ``update_from_output`` (the
        worker; ``cur``: the requests with a token, ``special``: the outputs
        finished or with more than one token, ``outputs``: all of them when
        the event log is on; ``now``: when it returned, ``running``: whether
        anything was still running then, and if not, ``reads`` of the engine;
        ``closing``: the throttle episodes of requests that finished with one
        open, ended here before their spans are made).

        One spacing per request per step into the per-user histogram (the
        all-users histogram is folded from those at export). Most requests
        with a token now also had one at the previous update (steady): their
        spacing is the same for all of them, so nothing is done per steady
        request. This update's spacing goes into one cumulative histogram of
        steady updates, and each label's histogram takes its steady requests'
        share (their count times what the cumulative gained) when that count
        changes and at folds. Only requests that start, pause, resume after a
        throttle, or finish take the per-request path, and a request joins
        the steady counts only at its second token in a row: one that is
        throttled again after one token (a user pacing at its limit) costs
        its resume spacing and two dict updates, nothing per label.
        """
        spans = self.spans
        labels = self._request_label
        if closing is not None:  # episodes of requests that finished inside one
            ended, starts, end_ns, by_id, held = closing
            self._end_episodes(end_ns, ended, starts, by_id)
            if spans is not None:
                spans.on_ended(end_ns, ended, starts, by_id, held)
        if outputs is not None:
            self._events_for(outputs, now)
        prev_ids, prev_now = self._prev_ids, self._prev_now
        last = self._last_token_ns
        # Label counts of the requests that had a token at the last two
        # updates, kept up to date from the ones that pause, start and finish:
        # with those that join now, they are the steady requests' counts.
        joining = self._joining
        paused = prev_ids - cur
        if paused:
            # had a token last time, none now
            last.update(dict.fromkeys(paused, prev_now))
            for req_id in paused - joining if joining else paused:
                self._label_count(req_id, -1)
        if joining:
            for req_id in joining & cur:  # a second token in a row: steady
                self._label_count(req_id, 1)
        if self._prev_by_label:  # some request is steady
            gap = now - prev_now
            self._steady_cum[bisect.bisect_left(SPACING_BUCKETS, gap * 1e-9)] += 1
            self._steady_ns += gap
            self._steady_n += 1
        # Back after a pause (their last token's time is known): the resume
        # spacings go to the histograms at the next fold, with the labels
        # the requests have now (lists made in C). First tokens: a label.
        resumed = cur - prev_ids
        back: list[str] = []
        prevs: list[int] = []
        first: Any = ()
        if resumed:
            if last:
                back = list(resumed & last.keys())
                if back:
                    prevs = list(map(last.pop, back))
                    self._resume_runs.append((now, prevs, list(map(labels.get, back))))
            if len(back) < len(resumed):
                first = resumed.difference(back) if back else resumed
                user_of, label = self._user_of, self.labeler.label
                for req_id in first:
                    user = user_of(req_id)
                    if user is not None:
                        labels[req_id] = label(user)
        zeros: list[tuple[str, int]] = []
        ends: list[tuple[str, str]] = []
        finished = None
        for out in special:
            req_id = out.request_id
            extra = len(out.new_token_ids) - 1
            if extra > 0:  # tokens of one step share its moment: zeros
                hist = self._spacing_hist(labels.get(req_id, OTHER))
                hist.counts[0] += extra
                hist.count += extra
                zeros.append((req_id, extra))
            if out.finish_reason is not None:
                if finished is None:
                    finished = set()
                finished.add(req_id)
                if req_id in cur and req_id not in resumed:
                    self._label_count(req_id, -1)
                last.pop(req_id, None)
                labels.pop(req_id, None)
                ends.append((req_id, str(out.finish_reason)))
        if spans is not None:
            facts = self._facts_of
            spans.on_outputs(now, paused, back, prevs, list(first), [facts(r) for r in first],
                             zeros, ends)
        if finished:
            handles = self._handles
            for req_id in finished:
                handles.pop(req_id, None)
        self._prev_ids = cur - finished if finished else cur
        self._joining = resumed - finished if finished else resumed
        self._prev_now = now
        if finished and not running:
            self._fold(reads[3])  # going idle: no step may come to fold at
            self._update_user_states(now, reads[1], reads[2])
            if spans is not None:
                spans.on_idle(now)

    def _label_count(self, req_id: str, delta: int) -> None:
        """``req_id`` joins (1) or leaves (-1) the requests that had a token
        at the last update, in the per-label counts (the label's histogram
        first takes its steady share up to now)."""
        label = self._request_label.get(req_id) or OTHER
        by_label = self._prev_by_label
        k = by_label.get(label, 0)
        if k:
            self._fold_spacing(label, k)
        k += delta
        if k:
            by_label[label] = k
            if k == delta:  # the label's first steady request: from now on
                self._spacing_mark[label] = self._steady_now()
        else:
            del by_label[label]
            del self._spacing_mark[label]

    def _fold_spacing(self, label: str, k: int) -> None:
        """``label``'s ``k`` steady requests each observed every steady
        update since its mark: add that to its histogram, mark now."""
        n, cum, total_ns = self._spacing_mark[label]
        if n == self._steady_n:
            return
        hist = self._spacing_hist(label)
        hist.counts = [c + k * (x - y) for c, x, y in zip(hist.counts, self._steady_cum, cum)]
        hist.sum += k * (self._steady_ns - total_ns) * 1e-9
        hist.count += k * (self._steady_n - n)
        self._spacing_mark[label] = self._steady_now()

    def _steady_now(self) -> tuple[int, list[int], int]:
        """A mark of the steady updates so far (their count, a copy of the
        cumulative buckets, their spacings' sum)."""
        return self._steady_n, self._steady_cum.copy(), self._steady_ns

    def _spacing_hist(self, label: str) -> Histogram:
        hist = self._spacing.get(label)
        if hist is None:
            hist = self._spacing[label] = self._histogram("inter_token_seconds", (label,))
        return hist

    def _events_for(self, outputs: dict[int, Any], now: int) -> None:
        """The event log's records of one update (only when it is on)."""
        step_tokens: list[tuple[str, str, int]] = []
        step_finished: list[tuple] = []
        for eco in outputs.values():
            for out in eco.outputs:
                self._event_outputs(step_tokens, step_finished, out, len(out.new_token_ids), now)
        if step_tokens:
            self._queue_event(("tokens", now, step_tokens))
        for event in step_finished:
            self._queue_event(event)

    def _event_outputs(self, step_tokens: list[tuple[str, str, int]],
                       step_finished: list[tuple], out: Any, n: int, now: int) -> None:
        """The event log's view of one request's output (only when it is on)."""
        req_id = out.request_id
        seen = self._event_tokens.get(req_id)
        if seen is None:
            user = self._user_of(req_id) or "__unknown__"
            seen = self._event_tokens[req_id] = [user, 0]
        if n:
            step_tokens.append((req_id, seen[0], n))
            seen[1] += n
        if out.finish_reason is not None:
            del self._event_tokens[req_id]
            step_finished.append(("finished", now, req_id, seen[0], str(out.finish_reason), seen[1]))

    def state_sizes(self) -> dict[str, int]:
        """Entries held in each per-request and per-user container (plain
        numbers; for the reliability runner's churn and soak checks): the
        per-request ones are empty when nothing is live, the per-user ones
        stay within the label cap and ``USER_STATES_CAP``."""
        return {
            "requests.last_token": len(self._last_token_ns),
            "requests.throttled": len(self._thr_users),
            "requests.previous": len(self._prev_ids),
            "requests.label": len(self._request_label),
            "requests.episodes": len(self._episodes),
            "requests.episodes_held": len(self._open_held),
            "requests.events": len(self._event_tokens),
            "requests.handles": len(self._handles),
            "users.activity": len(self._activity) + len(self._window_activity),
            "users.counter_keys": len(self._charged_keys) + len(self._skipped_keys),
            "steps.pending": (len(self._charge_runs) + len(self._skip_lists) + len(self._ended_runs)
                              + len(self._resume_runs) + len(self._inside_lists)),
            "requests.episodes_folded": len(self._bases),
            "events.inbox": len(self._inbox),
            "users.states": len(self._user_states) + len(self._thr_by_user),
            "users.window": sum(len(d) for _, d in self._charged_window),
            "labels": len(self.labeler.labelled_users()),
            "series": len(self.counters) + len(self.gauges) + len(self.histograms),
            "limiter.users": self.view.limiter_users(),
        }

    def on_idle_wait(self, wait: IdleWait) -> None:
        self._post(self._fold_idle_wait, wait)

    def _fold_idle_wait(self, wait: IdleWait) -> None:
        if self.spans is not None:
            self.spans.on_idle_wait(wait)
        self._histogram("idle_wait_seconds", (wait.reason,)).observe(
            (wait.woke_ns - wait.started_ns) / 1e9
        )
        lateness = wait.lateness_ns
        if lateness is not None and wait.reason == "timeout":
            self.histograms[("wake_lateness_seconds", ())].observe(max(lateness, 0) / 1e9)

    # -- the exporter thread ----------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """A JSON-able copy of everything (safe from another thread): what
        was handed over so far is folded first."""
        self.drain()
        counters = self.counters.copy()
        drops = getattr(self.spans, "drops", None)
        if drops is not None:
            for reason, n in list(drops.counts.items()):
                counters[("telemetry_dropped", (reason,))] = n
        gauges = self.gauges.copy()
        idle = not self.view.has_running()
        if idle:
            # No step runs on an idle engine: nothing can be throttled.
            for key in gauges:
                if key[0] in _THROTTLED_GAUGES:
                    gauges[key] = 0
        status = self.view.limits_status()
        if status is not None:
            for result in LIMITS_RESULTS:
                counters[("limits_reloads", (result,))] = status.results.get(result, 0)
            gauges[("limits_loaded_timestamp_seconds", ())] = status.loaded_unix
            gauges[("limits_info", (status.digest, status.source))] = 1
            if self._limits_doc[0] != status.digest:
                self._limits_doc = (status.digest, self.view.limits_document())
            doc = self._limits_doc[1]
            # The limits loaded are in force from the next step on: an idle
            # engine shows them at once (its gauges follow too).
            gauges[("default_limit_tokens_per_second", ())] = doc["default"]
            for user, label in self.labeler.labelled_users().items():
                gauges[("user_limit_tokens_per_second", (label,))] = doc["users"].get(
                    user, doc["default"])
            limits = {"source": status.source, "sha256": status.digest,
                      "loaded_unix": status.loaded_unix, "reloads": dict(status.results),
                      "last_error": status.last_error, **self._limits_doc[1]}
        else:
            limits = None
        shared = self.view.shared_state_stats()
        if shared is not None:
            self._fold_shared_state(shared, counters, gauges)
        histograms = self.histograms.copy()
        if self._store_call_hist is not None:
            histograms[("shared_store_call_seconds", ())] = self._store_call_hist
        total = Histogram(SPACING_BUCKETS)
        total.add(self._spacing_evicted)
        for hist in list(self._spacing.values()):
            total.add(hist)
        histograms[("engine_inter_token_seconds", ())] = total
        try:  # len() of containers the scheduler's thread may be resizing
            for container, n in self.state_sizes().items():
                gauges[("state_entries", (container,))] = n
        except RuntimeError:  # (a dict changed size during iteration: next export)
            pass
        written = time.time()
        gauges[("telemetry_snapshot_timestamp_seconds", ())] = written
        return {
            "engine": self.engine,
            "model_name": self.model_name,
            "written_unix": written,
            "counters": [[n, list(l), v] for (n, l), v in counters.items()],
            "gauges": [[n, list(l), v] for (n, l), v in gauges.items()],
            "histograms": [[n, list(l), *h.snapshot()] for (n, l), h in histograms.items()],
            "limits": limits,
            "users": {"as_of_unix": written if idle else self._user_states_at[2],
                      "states": self._idle_user_states() if idle else self._user_states},
        }

    def _fold_shared_state(self, shared: dict[str, Any], counters: dict, gauges: dict) -> None:
        """The lease machinery's numbers (exporter thread; shared-budget mode)."""
        for name, key in (("shared_tokens_leased", "leased"), ("shared_tokens_spent", "spent"),
                          ("shared_tokens_expired", "expired"),
                          ("shared_tokens_unleased", "unleased"),
                          ("shared_store_fallback_seconds", "fallback_seconds"),
                          ("shared_store_resets", "resets")):
            counters[(name, ())] = shared[key]
        counters[("shared_store_calls", ("ok",))] = shared["calls"] - shared["failed_calls"]
        counters[("shared_store_calls", ("failed",))] = shared["failed_calls"]
        gauges[("shared_store_fallback", ())] = shared["fallback"]
        gauges[("shared_live_engines", ())] = shared["live_engines"]
        # Only this thread touches it (not self.histograms: the scheduler's).
        hist = self._store_call_hist
        if hist is None:
            hist = self._store_call_hist = Histogram(STORE_CALL_BUCKETS)
        for seconds in shared["call_seconds"]:
            hist.observe(seconds)

    def _write_events(self) -> None:
        """Append the queued event records to the event log (exporter thread)."""
        events = self._events
        if not self._events_started:
            self._events_started = True
            view = self.view
            events.appendleft(("start", time.monotonic_ns(), time.time_ns(), {
                user: float(view.rate_of(user)) for user in view.user_rates
            }, float(view.default_rate), bool(view.async_scheduling)))
        self._idle_exports = 0 if self.view.has_running() else self._idle_exports + 1
        if self._idle_exports >= 2 and not self._events_idle_written:
            # The engine went idle: nothing throttled, stated once, after the
            # last step's events whatever the last export-due step said. Idle
            # at two exports in a row: the last step's outputs (queued after
            # `running` empties) are surely in the queue by then.
            self._events_idle = self._events_idle_written = True
            events.append(("throttled", time.monotonic_ns(), {}, {}, 0.0))
        lines = []
        while events:
            lines.append(encode_event(events.popleft(), self.engine))
        if not lines:
            return
        try:
            with open(self._events_path, "a") as f:
                f.write("".join(lines))
        except Exception as exc:
            self.counters[("telemetry_dropped", ("events_write_failed",))] += len(lines)
            self._log_drop_once(f"event log {self._events_path}", exc)

    def _log_drop_once(self, what: str, exc: BaseException) -> None:
        if not self._drop_logged:
            self._drop_logged = True
            logger.warning("output-rate telemetry: writing %s failed (%s); "
                           "further failures are only counted", what, exc)

    def export(self) -> bool:
        """Write one snapshot; on failure count a drop and log once."""
        if self._events is not None:
            self._write_events()
        try:
            data = json.dumps(self.snapshot())
            tmp = f"{self.path}.tmp"
            with open(tmp, "w") as f:
                f.write(data)
            os.replace(tmp, self.path)
            return True
        except Exception as exc:  # never let telemetry hurt the engine
            self.counters[("telemetry_dropped", ("export_failed",))] += 1
            self._log_drop_once(f"the snapshot {self.path}", exc)
            return False
        finally:
            self._export_due = True

    def _run(self) -> None:
        next_export = time.monotonic() + self.interval_s
        while not self._stop.wait(DRAIN_INTERVAL_S):
            self.drain()
            if time.monotonic() >= next_export:
                next_export += self.interval_s
                self.export()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        self.drain()
        self._fold()
        if self.spans is not None:
            self.spans.shutdown()
        self.export()


def _ns_edges(bounds: tuple[float, ...]) -> tuple[int, ...]:
    """Integer edges ``t`` with ``bisect_right(t, v) == bisect_left(bounds,
    v * 1e-9)`` for every integer ``v`` (ns): the smallest ``v`` each bound
    is below."""
    edges = []
    for bound in bounds:
        v = int(bound * 1e9) - 2
        while not bound < v * 1e-9:
            v += 1
        edges.append(v)
    return tuple(edges)


_EDGES: dict[tuple[float, ...], Any] = {}


def _key_index(keys: list[Any]) -> tuple[dict[Any, int], Any]:
    """The distinct keys in order, each with its position (a dict pass in
    C, then one per distinct key), and each key's position as an array."""
    index: dict[Any, int] = {key: i for i, key in enumerate(dict.fromkeys(keys))}
    return index, np.fromiter(map(index.__getitem__, keys), dtype=np.int64, count=len(keys))


def _sums_by_key(keys: list[Any], values: list[int]) -> dict[Any, int]:
    """key -> the sum of ``values[i]`` over the ``i`` where ``keys[i]`` is
    that key (integers; numpy over the batch, one Python pass per key)."""
    if not keys:
        return {}
    index, which = _key_index(keys)
    sums = np.bincount(which, weights=np.fromiter(values, dtype=np.int64, count=len(values)),
                       minlength=len(index))
    return dict(zip(index, np.rint(sums).astype(np.int64).tolist()))


def _observe_by_label(labels: list[str | None], values_ns: list[int],
                      hist_of: Callable[[Any], Histogram]) -> None:
    """Observe ``values_ns[i]`` (ns) in the histogram of ``labels[i]``: the
    buckets found and counted per (label, bucket) by numpy over the whole
    batch (a fold's thousands of values), then a loop per label."""
    if not values_ns:
        return
    bounds = hist_of(labels[0]).bounds
    edges = _EDGES.get(bounds)
    if edges is None:
        edges = _EDGES[bounds] = np.asarray(_ns_edges(bounds), dtype=np.int64)
    n = len(values_ns)
    values = np.fromiter(values_ns, dtype=np.int64, count=n)
    index, which = _key_index(labels)
    width = len(edges) + 1
    counts = np.bincount(which * width + np.searchsorted(edges, values, side="right"),
                         minlength=len(index) * width).reshape(len(index), width)
    sums = np.bincount(which, weights=values, minlength=len(index)).tolist()
    totals = counts.sum(axis=1).tolist()
    rows = counts.tolist()  # (plain ints: no numpy scalar per bucket)
    for label, i in index.items():
        hist = hist_of(label)
        hist.counts = list(map(add, hist.counts, rows[i]))
        hist.count += totals[i]
        hist.sum += sums[i] * 1e-9


def attach(view: EngineView) -> EngineTelemetry | None:
    """The observer factory (registered by ``telemetry.plugin``): telemetry
    for one scheduler, when the serving process set a snapshot directory and
    telemetry is on. Anything that fails here turns telemetry off with a
    logged reason; the limiter runs on."""
    try:
        out_dir = settings.get("TELEMETRY_DIR")
        if not out_dir or not settings.get("TELEMETRY"):
            return None
        os.makedirs(out_dir, exist_ok=True)
        return EngineTelemetry(view, out_dir, spans=_span_recorder(view),
                               events_path=settings.get("EVENTS"))
    except Exception:
        logger.exception("output-rate telemetry could not start; the limiter runs without it")
        return None


def _span_recorder(view: EngineView) -> Any:
    """Traces when asked for (``OTEL_*`` or ``--otlp-traces-endpoint``)."""
    try:
        from vllm_output_rate.tracing.drops import TraceDrops, max_queue_from_env
        from vllm_output_rate.tracing.provider import tracer_from, tracer_provider_from_env
        from vllm_output_rate.tracing.recorder import SpanRecorder

        drops = TraceDrops(max_queue_from_env())
        provider = tracer_provider_from_env(view.otlp_traces_endpoint, drops)
        if provider is None:
            return None
        # (no builder thread: the telemetry's worker builds the spans)
        recorder = SpanRecorder(tracer_from(provider), view, background=False)
        recorder.drops = drops
        recorder.provider = provider
        return recorder
    except Exception:
        logger.exception("output-rate traces could not start; metrics continue without them")
        return None
