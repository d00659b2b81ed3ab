"""Throttle episodes and over-limit periods: the books kept of them and
their spans, ``output_rate.throttle`` (a request's longest episode) and
``output_rate.over_limit`` (a user's period).

On the data's path: the recorder (``recorder``) replays the episode events
of each step here, on the span builder's thread (``ThrottleSpans.
replay_step``, ``replay_ended``, ``sweep``); a period's span is made when it
ends, a request's throttle span when the request ends (``end_request``,
called by ``generation``, which puts the request's episode counts into its
generation span).
"""

from __future__ import annotations

from array import array
from collections import Counter, defaultdict, deque
from functools import partial
from itertools import chain, compress, repeat
from operator import le, lt
from typing import Any

from vllm_output_rate.config import UNLIMITED
from vllm_output_rate.observers import EngineView, RequestFacts, StepReport
from vllm_output_rate.telemetry.records import Episodes
from vllm_output_rate.tracing.attributes import (
    GEN_AI_REQUEST_ID,
    external_request_id,
    identity_attributes,
    quantile,
    shown_id,
    spacing_us,
)
from vllm_output_rate.tracing.emit import SpanEmitter
from vllm_output_rate.tracing.series import MAX_SERIES, SpacingSeries

#: A user's over-limit period ends when no step refused it for this long
#: after its budget returned (or when the engine goes idle).
PERIOD_QUIET_S = 1.0
#: How often (scheduler clock) the span builder looks for periods to end.
PERIOD_SWEEP_NS = 200_000_000
#: A request's throttle episode durations kept before a sweep folds them
#: into its count, total and longest (bounds them per live request).
THROTTLE_FOLD_AT = 64
#: Steps' charges logged before they are counted (when nothing reads them
#: sooner: a period that opens or ends, a trim of the books).
CHARGE_LOG_CAP = 256
#: Sweeps between two trims of the span builder's per-user and per-request
#: books.
BOOKS_EVERY = 10


class _Period:
    """One user's over-limit period (the span builder only).

    What is counted per step (tokens charged, episode durations, when the
    last episode ended) is kept per user in the throttle books, counted in
    C; the period holds where they stood when it began."""

    __slots__ = ("user", "start_ns", "tokens_before", "episodes_cut", "cut_ns", "cut_max_ns",
                 "max_requests", "max_blocks", "borrowed_before", "ceiling_steps")

    def __init__(self, user: str, start_ns: int, tokens_before: int) -> None:
        self.user = user
        self.start_ns = start_ns
        #: the user's tokens charged up to the step its first episode began
        self.tokens_before = tokens_before
        #: throttle episodes ended in the period past the ``MAX_SERIES``
        #: whose durations are kept: counted, their total and longest
        self.episodes_cut = 0
        self.cut_ns = 0
        self.cut_max_ns = 0
        #: most throttled requests and KV blocks they held (at exports)
        self.max_requests = 0
        self.max_blocks = 0
        #: tokens lent to the user up to then (borrowing), and the steps of
        #: the period in which its ceiling refused it
        self.borrowed_before = 0
        self.ceiling_steps = 0


class ThrottleSpans:
    """The throttle books of the span builder: episodes per request,
    over-limit periods per user, and their spans on ``emitter``.

    ``series``: the requests' spacing series, for the tokens charged to a
    request whose episode ended after it left the engine."""

    def __init__(self, emitter: SpanEmitter, view: EngineView, series: SpacingSeries) -> None:
        self.emitter = emitter
        self.view = view
        self.series = series
        #: user -> its open over-limit period
        self._periods: dict[str, _Period] = {}
        #: request id -> the durations (ns) of its throttle episodes ended
        #: lately (appended in C), and [count, total ns, longest] of those
        #: folded (at sweeps, once there are ``THROTTLE_FOLD_AT``; at its end):
        #: for its generation span
        self._throttle_ns: defaultdict[str, array] = defaultdict(partial(array, "q"))
        self._throttle_books: dict[str, list[int]] = {}
        #: request id -> its longest throttle episode of at least the
        #: minimum so far: (start, end, outcome, KV blocks, facts, preempted,
        #: tokens charged), made into a span when the request ends
        self._longest: dict[str, tuple] = {}
        #: throttled requests preempted since their episode began
        self._preempted: set[str] = set()
        #: users with an open period -> when the last throttle episode of
        #: their requests ended (its start, until one did), the durations
        #: (ns) of those ended in the period (at most ``MAX_SERIES``)
        self._last_end: dict[str | None, int] = {}
        self._episode_ns: defaultdict[str | None, list[int]] = defaultdict(list)
        #: user -> tokens charged (users with an open period, and those
        #: charged since the last sweep)
        self._charged: Counter[str] = Counter()
        #: the steps' charges (request -> user) not yet counted in
        #: ``_charged``: counted together when it is read (``_tokens``)
        self._charge_log: list[dict[str, str]] = []
        #: the same for tokens lent (borrowing only)
        self._borrowed: Counter[str] = Counter()
        #: the last step's time (scheduler clock), the period sweeps so far
        self._now = 0
        self._sweeps = 0

    # -- replayed per step ------------------------------------------------

    def replay_step(self, record: StepReport, opened_users: list[str], ended: Episodes | None,
                    sweep: set[str | None] | None) -> None:
        """A step's episode events: the step's report (its charges,
        preemptions, loans and users held at their ceilings), and what
        ``SpanRecorder.on_step`` tells of the other arguments."""
        now = self._now = record.now_ns
        periods = self._periods
        charged, borrowed = record.charged, record.borrowed
        at_ceiling, preempted = record.at_ceiling, record.preempted_throttled
        if charged:  # tokens per user: counted in C when next read (``_tokens``)
            log = self._charge_log
            log.append(charged)
            if len(log) >= CHARGE_LOG_CAP:
                self._tokens()
        if borrowed:
            self._borrowed.update(borrowed.values())
        if opened_users:
            # a user with no open period opens one (its tokens from the
            # next step on); the others' are open (found in C)
            new = set(opened_users).difference(periods)
            if new:
                tokens, lent, last_end = self._tokens(), self._borrowed, self._last_end
                for user in new:
                    period = periods[user] = _Period(user, now, tokens[user])
                    period.borrowed_before = lent[user]
                    last_end[user] = now
        if at_ceiling:  # held at the ceiling in this step
            for user in at_ceiling:
                period = periods.get(user)
                if period is not None:
                    period.ceiling_steps += 1
        if preempted:
            self._preempted.update(preempted)
        if ended is not None:
            self.replay_ended(ended)
        if sweep is not None:
            self.sweep(now, sweep)

    def replay_ended(self, ended: Episodes) -> None:
        """Throttle episodes that ended (``ended.held``: those long enough
        for a span)."""
        end_ns, req_ids = ended.end_ns, ended.req_ids
        self._now = max(self._now, end_ns)
        self.book_episodes(ended)
        held = ended.held
        if held:  # the episodes long enough for a span: the longest of each
            start_of = dict(zip(req_ids, ended.starts))
            for req_id, (blocks, facts) in held.items():
                self.keep_longest(req_id, start_of[req_id], end_ns, "dispatched", blocks, facts)
        if self._preempted:
            self._preempted.difference_update(req_ids)

    def book_episodes(self, ended: Episodes) -> None:
        """Throttle episodes that ended, with the durations and users their
        record holds (the metrics read the same): onto their requests' and
        (periods being open) their users' lists, and when their users' last
        one ended (in C)."""
        took = ended.took()
        by_request = self._throttle_ns
        deque(map(array.append, map(by_request.__getitem__, ended.req_ids), took), maxlen=0)
        if self._periods:
            users = ended.user_list()
            lists = self._episode_ns
            deque(map(list.append, map(lists.__getitem__, users), took), maxlen=0)
            self._last_end.update(dict.fromkeys(users, ended.end_ns))

    def replay_throttled_users(self, now: int, by_user: dict[str, tuple[int, int]]) -> None:
        """At an export step: user -> (throttled requests, their KV blocks)."""
        periods = self._periods
        for user, (requests, blocks) in by_user.items():
            period = periods.get(user)
            if period is not None:
                period.max_requests = max(period.max_requests, requests)
                period.max_blocks = max(period.max_blocks, blocks)

    def _tokens(self) -> Counter[str]:
        """user -> tokens charged (``_charged``), the logged steps counted
        in first (one pass in C)."""
        log = self._charge_log
        if log:
            self._charge_log = []
            self._charged.update(chain.from_iterable(map(dict.values, log)))
        return self._charged

    # -- over-limit periods ---------------------------------------------------

    def sweep(self, now: int, open_users: Any = (), idle: bool = False) -> None:
        """End the periods of users with no throttle episode open
        (``open_users``: those with one) whose last one ended
        ``PERIOD_QUIET_S`` ago or more (all of them when the engine is idle
        or shuts down): a period ends when its user's last episode did
        (found in C, not user by user)."""
        self._now = max(self._now, now)
        periods, last_end = self._periods, self._last_end
        if idle:
            ending = list(periods)
        else:
            quiet = compress(last_end.keys(),
                             map(le, last_end.values(), repeat(now - int(PERIOD_QUIET_S * 1e9))))
            ending = [user for user in quiet if user not in open_users and user in periods]
        lists = self._episode_ns
        charged = self._tokens() if ending else self._charged
        for user in ending:
            period = periods.pop(user)
            end = min(last_end.pop(user, now), now)
            self._build_period(period, max(end, period.start_ns),
                               charged[user] - period.tokens_before, lists.pop(user, []))
        self._sweeps += 1
        if self._sweeps % BOOKS_EVERY == 0 or idle:
            self._trim_books()

    def end_periods(self) -> None:
        """Every open period ends (at shutdown)."""
        self.sweep(self._now, idle=True)

    def _trim_books(self) -> None:
        """Keep the books to the open periods and the requests' episode
        lists short (every ``BOOKS_EVERY`` sweeps: their cost is per user
        and per request, not per step)."""
        periods, lists = self._periods, self._episode_ns
        for user in list(compress(lists.keys(), map(lt, repeat(MAX_SERIES), map(len, lists.values())))):
            took = lists[user]
            period = periods.get(user)
            if period is not None:
                cut = took[MAX_SERIES:]
                period.episodes_cut += len(cut)
                period.cut_ns += sum(cut)
                period.cut_max_ns = max(period.cut_max_ns, max(cut))
            del took[MAX_SERIES:]
        if len(lists) > len(periods):
            for user in lists.keys() - periods.keys():
                del lists[user]
        last_end = self._last_end
        if len(last_end) > len(periods):
            for user in last_end.keys() - periods.keys():
                del last_end[user]
        if len(self._tokens()) > 2 * len(periods) + 64:
            tokens = self._charged
            self._charged = Counter({user: tokens[user] for user in periods})
        if len(self._borrowed) > 2 * len(periods) + 64:
            lent = self._borrowed
            self._borrowed = Counter({user: lent[user] for user in periods})
        by_request = self._throttle_ns
        for req_id in list(compress(by_request.keys(), map(le, repeat(THROTTLE_FOLD_AT),
                                                           map(len, by_request.values())))):
            self._fold_throttle(req_id, by_request[req_id])

    def _build_period(self, period: _Period, end_ns: int, tokens: int, took: list[int]) -> None:
        ordered = sorted(took)
        longest = max(ordered[-1] if ordered else 0, period.cut_max_ns)
        seconds = max(end_ns - period.start_ns, 1) / 1e9
        try:
            limits = self.view.limits()
            limit = float(limits.rate_of(period.user))
            ceiling = limits.ceiling_of(period.user) if limits.borrowing else None
        except Exception:  # (a view read from this thread must not stop the builder)
            limit, ceiling = 0.0, None
        attributes = {
            "output_rate.limit_tokens_per_second": limit,
            "output_rate.tokens_charged": tokens,
            "output_rate.tokens_per_second": round(tokens / seconds, 3),
            "output_rate.throttle_episodes": len(took) + period.episodes_cut,
            "output_rate.throttle_p50_us": spacing_us(quantile(ordered, 0.5)),
            "output_rate.throttle_p90_us": spacing_us(quantile(ordered, 0.9)),
            "output_rate.throttle_p99_us": spacing_us(quantile(ordered, 0.99)),
            "output_rate.throttle_max_us": spacing_us(longest),
            "output_rate.throttled_us": spacing_us(sum(ordered) + period.cut_ns),
            "output_rate.throttled_requests_max": period.max_requests,
            "output_rate.throttled_kv_blocks_max": period.max_blocks,
        }
        if ceiling is not None:
            # a guaranteed rate and a ceiling: over its rate it borrowed
            # what others left ("rate": held by its guaranteed rate and no
            # capacity to lend), or its ceiling refused it ("ceiling")
            if ceiling == UNLIMITED:
                attributes["output_rate.ceiling_unlimited"] = True
            else:
                attributes["output_rate.ceiling_tokens_per_second"] = float(ceiling)
            attributes["output_rate.tokens_borrowed"] = (self._borrowed[period.user]
                                                          - period.borrowed_before)
            attributes["output_rate.steps_at_ceiling"] = period.ceiling_steps
            attributes["output_rate.held_at"] = "ceiling" if period.ceiling_steps else "rate"
        shown = shown_id(period.user)
        if shown is not None:
            attributes["output_rate.user"] = shown
        self.emitter.span("output_rate.over_limit", period.start_ns, end_ns, attributes)

    # -- a request's episodes -------------------------------------------------

    def _fold_throttle(self, req_id: str, took: array) -> list[int]:
        """Fold ``req_id``'s recent episode durations into its books."""
        books = self._throttle_books.get(req_id)
        if books is None:
            books = self._throttle_books[req_id] = [0, 0, 0]
        if took:
            books[0] += len(took)
            books[1] += sum(took)
            books[2] = max(books[2], max(took))
            del took[:]
        return books

    def keep_longest(self, req_id: str, start_ns: int, end_ns: int, outcome: str, blocks: int,
                     facts: RequestFacts | None) -> None:
        """Keep this episode (at least the minimum long) for the request's
        throttle span if it is its longest so far."""
        kept = self._longest.get(req_id)
        if kept is None or end_ns - start_ns > kept[1] - kept[0]:
            self._longest[req_id] = (start_ns, end_ns, outcome, blocks, facts,
                                     req_id in self._preempted,
                                     self._tokens_charged(req_id))

    def _tokens_charged(self, req_id: str) -> int:
        """Tokens charged to the request so far: its output tokens (the
        episode ended at a dispatch whose step came before this replay)."""
        tokens = self.view.num_output_tokens(req_id)
        if tokens is None:
            return self.series.tokens_so_far(req_id)
        return tokens

    def end_request(self, req_id: str) -> list[int] | None:
        """``req_id`` ended: the span of its longest episode, if one was
        kept; returns [count, total ns, longest ns] of its episodes (None:
        it had none), and forgets it."""
        throttle = None
        took = self._throttle_ns.pop(req_id, None)
        if took is not None or req_id in self._throttle_books:
            throttle = self._fold_throttle(req_id, took if took is not None else array("q"))
            del self._throttle_books[req_id]
        self._preempted.discard(req_id)
        longest = self._longest.pop(req_id, None)
        if longest is not None:
            self._build_throttle(req_id, *longest)
        return throttle

    def _build_throttle(self, req_id: str, start_ns: int, end_ns: int, outcome: str,
                        blocks: int, facts: RequestFacts | None, preempted: bool,
                        tokens: int) -> None:
        """The span of a request's longest throttle episode (at least
        ``OUTPUT_RATE_TRACE_THROTTLE_MIN_S``), in the request's trace;
        ``blocks``: the KV blocks it held when the episode ended; ``facts``:
        those kept with the episode."""
        emitter = self.emitter
        attributes = {
            GEN_AI_REQUEST_ID: external_request_id(req_id, emitter.randomized_ids),
            "output_rate.request_id": req_id,
            "output_rate.tokens_charged": tokens,
            "output_rate.held_kv": blocks > 0,
            "output_rate.kv_blocks": blocks,
            "output_rate.preempted": preempted,
            "output_rate.outcome": outcome,
        }
        if facts is not None:
            attributes["output_rate.priority"] = facts.priority
        identity_attributes(facts, attributes)
        emitter.span("output_rate.throttle", start_ns, end_ns, attributes,
                     context=emitter.parent_context(facts))
