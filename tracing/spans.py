"""OpenTelemetry spans of the limiter, from the engine-core process.

Built from the same plain data the metrics use (``StepReport`` per step,
``IdleWait`` per idle wait, the engine outputs per ``update_from_output``;
see ``vllm_output_rate.observers``), driven by ``telemetry.engine``,
whose worker thread (off the scheduler's thread) appends plain data per
step and per update (references to the step's own containers, lists made
in C) to a bounded queue and, at the end of each of its drains, replays
them in order (the spacing series, throttle episodes per request,
over-limit periods per user) and makes the SDK spans (``flush``; a
recorder made with ``background=True`` has a builder thread of its own
that does it every ``BUILD_INTERVAL_S``; and at shutdown), handing them to
a ``BatchSpanProcessor``, whose queue and exporter thread export them. A full queue drops entries and a failing
exporter loses spans, both counted (``TraceDrops``, exported as
``vllm_output_rate_telemetry_dropped_total``) and logged once, never
blocking. Building and exporting a span costs the process some tens of
microseconds of CPU (BENCHMARKS.md): a request gets a throttle span only
for its longest episode of ``OUTPUT_RATE_TRACE_THROTTLE_MIN_S`` (default
1 s) or more, and the user one span per over-limit period; the standard
``OTEL_TRACES_SAMPLER`` thins all spans. A throttle episode runs from the
first step a request was skipped for lack of budget to its last dispatch
before a step that did not skip it: a request pacing at its limit (a
token, then skipped again) has one over its pacing, not one per token.

Spans:
- ``output_rate.over_limit``: one per over-limit period of a user, from the
  start of the first throttle episode of one of its requests (skipped for
  lack of budget) to the end of the last, once none was
  open for ``PERIOD_QUIET_S`` after that (or the engine went idle): user,
  limit, tokens charged and their rate, its requests' throttle episodes
  (count, total, p50 / p90 / p99 / max in whole microseconds), most
  throttled requests and KV blocks (sampled at exports). Kept from
  episode events (a few per episode, appends in C), never from every
  refused user in every step.
- ``output_rate.throttle``: at most one per request, for its longest
  throttle episode when that lasted ``OUTPUT_RATE_TRACE_THROTTLE_MIN_S``
  (default 1 s; 0: every throttled request) or longer, made when the request
  ends: from the first step it was skipped for lack of budget to its last
  dispatch before a step that did not skip it (or its abort): user,
  request id, priority, tokens charged by then, KV blocks held while it
  waited (when the episode began), preempted meanwhile, outcome.
- ``output_rate.step``: only for steps in which a token was refunded or a
  user refused (not for every step): charged / refunded counts and one event
  per refund with its reason.
- ``output_rate.idle_wait``: every idle wait of the engine loop: planned
  timeout, ready time waited for, lateness, what woke it.
- ``output_rate.generation``: one per finished request: token count,
  engine-side spacing p50 / p90 / p99 / max, the spacing series itself,
  ``output_rate.spacing_series_us``: an integer array of whole microseconds,
  at most ``MAX_SERIES`` values (an attribute, not one event per token: span
  events are capped at 128; integers are not cut by
  ``OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT``, which cuts strings only), and its
  throttle episodes (every one: count, total and longest).

A request's throttle and generation spans belong to its own trace: when it
came with a valid W3C ``traceparent`` (carried to the engine by the API
server's middleware whenever these traces are on, ``OTEL_*`` variables
alone included; vLLM passes its own ``trace_headers`` only with
``--otlp-traces-endpoint``, and those win), they are children of that span,
beside vLLM's own ``llm_request`` span when vLLM traces too, and follow its sampling
decision (the SDK's default sampler is parent-based; ``OTEL_TRACES_SAMPLER``
changes that); without one they start a trace of their own.

Attributes follow the OpenTelemetry GenAI conventions where one exists, with
the names vLLM's own request span uses (``vllm.tracing.SpanAttributes``):
``gen_ai.request.id`` (the request id the client and vLLM's ``llm_request``
span know, i.e. the engine's id without the random suffix vLLM adds),
``gen_ai.response.model``, ``gen_ai.usage.output_tokens``,
``gen_ai.response.finish_reasons``, and ``user.id`` when the API server
vouched for the user (a gateway's header or an API key); everything else is
under ``output_rate.`` (``output_rate.request_id`` is the engine's own id, as
in the event log; ``output_rate.user`` whose budget the request spends, also
when the request body named it).
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from array import array
from collections import Counter, defaultdict, deque
from functools import partial
from itertools import chain, compress, repeat
from operator import floordiv, le, lt, sub
from collections.abc import Callable
from typing import Any

from vllm_output_rate import settings
from vllm_output_rate.config import ANONYMOUS_USER, UNLISTED_USER
from vllm_output_rate.observers import EngineView, IdleWait, RequestFacts, StepReport

MAX_SERIES = 2048
#: The scheduler's thread queues spans as plain data; a thread of ours builds
#: them into SDK spans (and hands them to the batch processor) this often.
BUILD_INTERVAL_S = 0.2
#: Steady runs are not checked against the cap per update; every this many
#: updates (and at finish) longer series are cut back to ``MAX_SERIES``, the
#: rest counted, and the timeline is cut to the oldest open run.
TRIM_EVERY = 256
#: One ``output_rate.step`` span per this many steps that only refused users
#: (steps with refunds always get one). Default 50.
STEP_SAMPLE_ENV = settings.name("TRACE_REFUSAL_STEP_EVERY")
#: A file path: spans appended there as JSON lines (offline use).
TRACES_FILE_ENV = settings.name("TRACES_FILE")
#: Throttle episodes shorter than this many seconds get no span (they are
#: still in the episode histogram). Default 0: a span for every episode. A
#: user at its limit with several streams has one short episode per token.
THROTTLE_MIN_ENV = settings.name("TRACE_THROTTLE_MIN_S")
_TRACER_NAME = "vllm_output_rate"
#: A user's over-limit period ends when no step refused it for this long
#: after its budget returned (or when the engine goes idle).
PERIOD_QUIET_S = 1.0
#: How often (scheduler clock) the span builder looks for periods to end.
PERIOD_SWEEP_NS = 200_000_000
#: A request's throttle episode durations kept before a sweep folds them
#: into its count, total and longest (bounds them per live request).
THROTTLE_FOLD_AT = 64
#: Sweeps between two trims of the span builder's per-user and per-request
#: books.
BOOKS_EVERY = 10

# Attribute names of the OpenTelemetry GenAI conventions, as vLLM's own
# request span spells them (``vllm.tracing.SpanAttributes``; not imported:
# the span builder must not need vLLM's tracing module).
GEN_AI_REQUEST_ID = "gen_ai.request.id"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
USER_ID = "user.id"
#: where the API server took a trusted user from
TRUSTED_SOURCES = ("header", "api_key")
#: users that are not a person's id (the anonymous user, the shared budget of
#: unlisted users): never a ``user.id``
_PLACEHOLDER_USERS = (ANONYMOUS_USER, UNLISTED_USER)
#: vLLM makes the engine's request id from the client's: ``f"{id}-{8 hex}"``
#: (``InputProcessor.assign_request_id``) unless this is set
_NO_RANDOM_ID_ENV = "VLLM_DISABLE_REQUEST_ID_RANDOMIZATION"
_RANDOM_SUFFIX = re.compile(r"-[0-9a-f]{8}\Z")
#: parsed trace contexts kept by the span builder (cleared when full)
_MAX_CONTEXTS = 4096

logger = logging.getLogger("vllm_output_rate.tracing")


def _spacing_us(ns: int) -> int:
    """A spacing in the series' unit: whole microseconds, within uint32."""
    return min(ns // 1000, 0xFFFFFFFF)


def _env_flag(name: str) -> bool:
    """A 0/1 variable as vLLM reads its own (anything else: off)."""
    try:
        return bool(int(os.environ.get(name, "0")))
    except ValueError:
        return False


def _epoch_offset_ns() -> int:
    """Monotonic ns -> epoch ns, for span timestamps."""
    return time.time_ns() - time.monotonic_ns()


def series_attribute(spacings_us: array) -> list[int]:
    """The spacing series as the span attribute holds it: a list of whole
    microseconds, at most ``MAX_SERIES``."""
    return spacings_us[:MAX_SERIES].tolist()


def external_request_id(engine_id: str, randomized: bool = True) -> str:
    """The request id vLLM's API server and its ``llm_request`` span use
    (``gen_ai.request.id``), from the engine's: vLLM appends ``-`` and 8 hex
    digits to the client's id unless ``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION``
    is set (``randomized`` False). (The children of an ``n`` > 1 request keep
    the ``{index}_`` prefix vLLM gives them.)"""
    if randomized:
        return _RANDOM_SUFFIX.sub("", engine_id)
    return engine_id


def _identity_attributes(facts: RequestFacts | None, attributes: dict[str, Any]) -> None:
    """``output_rate.user`` (whose budget the request spends), and ``user.id``
    and ``output_rate.identity_source`` only when the API server vouched for
    the user (a client's own claim in the body is no identity)."""
    if facts is None:
        return
    attributes["output_rate.user"] = facts.user
    source = facts.identity_source
    if source in TRUSTED_SOURCES:
        attributes["output_rate.identity_source"] = source
        who = facts.identity or facts.user  # the caller, not a shared budget
        if who not in _PLACEHOLDER_USERS:
            attributes[USER_ID] = who


def _quantile(sorted_values: list[int], q: float) -> int:
    """The sample nearest to rank q x (n - 1) of already sorted integers (0
    when empty). Not the tools' interpolating quantile
    (``vllm_output_rate.tools.stats.quantile``) on purpose: a span attribute
    is an integer number of microseconds and must be a spacing that occurred,
    and the engine side does not import the tools."""
    if not sorted_values:
        return 0
    index = min(len(sorted_values) - 1, max(0, int(round(q * (len(sorted_values) - 1)))))
    return sorted_values[index]


class _Period:
    """One user's over-limit period (the span builder only).

    What is counted per step (tokens charged, episode durations, when the
    last episode ended) is kept per user in the recorder's own books,
    counted in C; the period holds where they stood when it began."""

    __slots__ = ("user", "start_ns", "tokens_before", "episodes_cut", "cut_ns", "cut_max_ns",
                 "max_requests", "max_blocks")

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


class SpanRecorder:
    """Turns the limiter's plain data into spans on ``tracer``.

    ``clock_offset_ns`` maps the scheduler's monotonic clock to epoch ns.
    """

    def __init__(self, tracer: Any, view: EngineView, clock_offset_ns: int | None = None,
                 background: bool = True) -> None:
        self.tracer = tracer
        self.view = view
        self.offset = _epoch_offset_ns() if clock_offset_ns is None else clock_offset_ns
        #: TraceDrops of the provider's processor (the engine sets its own)
        self.drops = TraceDrops(max_queue_from_env())
        #: the TracerProvider (flushed and shut down with the engine)
        self.provider: Any = None
        #: (the span builder only, from here to ``_who``:)
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
        #: the last step's time (scheduler clock), the period sweeps so far
        self._now = 0
        self._sweeps = 0
        #: how often ``telemetry.folds`` sends the users with a throttle
        #: episode open (for over-limit periods to end)
        self.sweep_ns = PERIOD_SWEEP_NS
        #: request id -> spacings past MAX_SERIES (counted, not kept)
        self._overflow: dict[str, int] = {}
        #: refusal-only steps get one step span in this many (refund steps: always)
        self.step_sample_every = settings.get_or_default("TRACE_REFUSAL_STEP_EVERY")
        #: episodes shorter than this (ns) get no span
        self.throttle_min_ns = int(settings.get_or_default("TRACE_THROTTLE_MIN_S") * 1e9)
        self._refusal_steps = 0
        self._series: dict[str, array] = {}
        #: request id -> the update its open run of steady tokens began at
        self._runs: dict[str, int] = {}
        #: request id -> the update it came back at after a pause: its run
        #: begins there if it has a token at the next update too
        self._joining_runs: dict[str, int] = {}
        #: the timeline: spacing (us) of each update from the one before,
        #: for the updates from the oldest open run on; ``_index`` numbers
        #: the last update
        self._gaps = array("I")
        self._index = -1
        self._last_ns: int | None = None
        #: request id -> its RequestFacts (user, priority, trace headers,
        #: identity source), from its first token or throttle episode to its end
        self._who: dict[str, RequestFacts] = {}
        #: (traceparent, tracestate) -> the parsed parent context, or None
        #: when invalid; only the span builder touches it
        self._contexts: dict[tuple[str, str | None], Any] = {}
        self._propagator: Any = None
        #: whether vLLM appended its random suffix to the client's request id
        self._randomized_ids = not _env_flag(_NO_RANDOM_ID_ENV)
        #: spans to build: (builder, args) queued by the telemetry's worker as
        #: plain data, built into SDK spans by a thread of our own (or flush())
        self._pending: deque[tuple[Callable[..., None], tuple]] = deque()
        self._build_error_logged = False
        self._build_lock = threading.Lock()
        self._stop = threading.Event()
        self._builder: threading.Thread | None = None
        if background:
            self._builder = threading.Thread(target=self._run, name="output-rate-span-builder",
                                             daemon=True)
            self._builder.start()

    def _span(self, name: str, start_ns: int, end_ns: int, attributes: dict[str, Any],
              links: Any = None, context: Any = None) -> None:
        span = self.tracer.start_span(name, context=context, start_time=start_ns + self.offset,
                                      attributes=attributes, links=links)
        span.end(end_time=max(end_ns, start_ns) + self.offset)

    def _parent_context(self, facts: RequestFacts | None) -> Any:
        """The OpenTelemetry context of the request's ``traceparent`` (the
        span builder's thread), or None: no header, or not a valid one (the
        span then starts a trace of its own). Parsed once per distinct
        header, as vLLM parses it (``TraceContextTextMapPropagator``)."""
        headers = None if facts is None else facts.trace_headers
        if not headers:
            return None
        traceparent = headers.get("traceparent")
        if not traceparent:
            return None
        key = (traceparent, headers.get("tracestate"))
        contexts = self._contexts
        if key in contexts:
            return contexts[key]
        from opentelemetry import trace

        if self._propagator is None:
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )

            self._propagator = TraceContextTextMapPropagator()
        context = self._propagator.extract(headers)
        if not trace.get_current_span(context).get_span_context().is_valid:
            context = None
        if len(contexts) >= _MAX_CONTEXTS:
            contexts.clear()
        contexts[key] = context
        return context

    # -- building spans, off the scheduler's thread -------------------------

    def _queue(self, build: Callable[..., None], *args: Any) -> None:
        """Queue a span's plain data (the scheduler's thread: one append)."""
        pending = self._pending
        if len(pending) >= self.drops.max_queue:
            self.drops.drop("trace_queue_full", 1)
        else:
            pending.append((build, args))

    def flush(self) -> None:
        """Build every queued span now (the telemetry's worker at the end of
        each drain, or the builder thread of a ``background`` recorder every
        ``BUILD_INTERVAL_S``; shutdown and tests call it)."""
        pending = self._pending
        # (the scheduler's thread never takes this lock: it only appends)
        with self._build_lock:  # when flush() returns, what it saw is built
            while pending:
                build, args = pending.popleft()
                try:
                    build(*args)
                except Exception:  # a broken span must not stop the others
                    self.drops.drop("trace_export_failed", 1)
                    if not self._build_error_logged:
                        self._build_error_logged = True
                        logger.exception("output-rate traces: building a span failed; "
                                         "further failures are only counted")

    def _run(self) -> None:
        while not self._stop.wait(BUILD_INTERVAL_S):
            self.flush()

    # -- per step ---------------------------------------------------------

    def on_step(self, record: StepReport, ended: Any = (), starts: Any = (),
                opened_users: Any = (),
                held: dict[str, tuple[int, RequestFacts | None]] | None = None,
                sweep: set[str | None] | None = None, end_ns: int | None = None,
                ended_by: dict[str, str] | None = None) -> None:
        """Per step (``telemetry.folds``, on the worker: at most two appends).
        ``ended``: the ids of requests whose throttle episode ended (at
        ``end_ns``, the step they were last dispatched in, whose charges
        are ``ended_by``; default: this step), and ``starts`` when their
        episodes began; ``opened_users``: the users of the episodes that
        began in this step; ``held``: the KV blocks and facts, read in the
        step, of the ended requests whose episode is at least
        ``throttle_min_ns`` long; ``sweep`` (every ``sweep_ns``): the users
        with an episode open, for periods to end."""
        now = record.now_ns
        if ended or opened_users or record.refused or record.preempted_throttled or sweep is not None:
            self._queue_replay(self._replay_step, now, opened_users,
                               ended, starts, record.charged, record.preempted_throttled, held,
                               sweep, now if end_ns is None else end_ns,
                               record.charged if ended_by is None else ended_by)
        if record.refunded or (record.refused and self._sample_refusal()):
            self._queue(self._build_step, now, record.step, len(record.charged), record.refunded,
                        len(record.throttled), list(record.refused))

    def on_ended(self, end_ns: int, ended: list[str], starts: list[int], by_id: dict[str, str],
                 held: dict[str, tuple[int, RequestFacts | None]] | None) -> None:
        """Throttle episodes that ended outside a step: of requests that
        finished with one open (their last token dispatched inside it), at
        ``end_ns``; ``by_id``: request -> user for them."""
        self._queue_replay(self._replay_ended, end_ns, ended, starts, by_id, held)

    def _queue_replay(self, replay: Callable[..., None], *args: Any) -> None:
        """Queue what the span builder keeps books of (series,
        episodes, periods): dropped and counted only when the queue is
        full, like a span."""
        pending = self._pending
        if len(pending) >= self.drops.max_queue:
            self.drops.drop("trace_queue_full", 1)
        else:
            pending.append((replay, args))

    # -- the span builder: throttle episodes and over-limit periods --------

    def _replay_step(self, now: int, opened_users: list[str],
                     ended: list[str], starts: list[int], charged: dict[str, str],
                     preempted: list[str],
                     held: dict[str, tuple[int, RequestFacts | None]] | None,
                     sweep: set[str | None] | None, end_ns: int,
                     ended_by: dict[str, str]) -> None:
        self._now = now
        periods = self._periods
        if charged:  # tokens per user: the users of the step's charges, counted in C
            self._charged.update(charged.values())
        if opened_users:
            # a user with no open period opens one (its tokens from the
            # next step on); the others' are open (found in C)
            new = set(opened_users).difference(periods)
            if new:
                tokens, last_end = self._charged, self._last_end
                for user in new:
                    periods[user] = _Period(user, now, tokens[user])
                    last_end[user] = now
        if preempted:
            self._preempted.update(preempted)
        if ended:
            self._replay_ended(end_ns, ended, starts, ended_by, held)
        if sweep is not None:
            self._sweep(now, sweep)

    def _replay_ended(self, end_ns: int, ended: list[str], starts: list[int],
                      by_id: dict[str, str],
                      held: dict[str, tuple[int, RequestFacts | None]] | None) -> None:
        self._now = max(self._now, end_ns)
        self._book_episodes(end_ns, ended, list(map(sub, repeat(end_ns, len(starts)), starts)),
                            by_id.get)
        if held:  # the episodes long enough for a span: the longest of each
            start_of = dict(zip(ended, starts))
            for req_id, (blocks, facts) in held.items():
                self._keep_longest(req_id, start_of[req_id], end_ns, "dispatched", blocks, facts)
        if self._preempted:
            self._preempted.difference_update(ended)

    def _book_episodes(self, now: int, req_ids: list[str], took: list[int],
                       user_of: Callable[[str], str | None]) -> None:
        """Throttle episodes of ``req_ids`` that ended at ``now`` after
        ``took`` ns each: onto their requests' and (periods being open) their
        users' lists, and when their users' last one ended (in C)."""
        by_request = self._throttle_ns
        deque(map(array.append, map(by_request.__getitem__, req_ids), took), maxlen=0)
        if self._periods:
            users = list(map(user_of, req_ids))
            lists = self._episode_ns
            deque(map(list.append, map(lists.__getitem__, users), took), maxlen=0)
            self._last_end.update(dict.fromkeys(users, now))

    def _sweep(self, now: int, open_users: Any = (), idle: bool = False) -> None:
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
        for user in ending:
            period = periods.pop(user)
            end = min(last_end.pop(user, now), now)
            self._build_period(period, max(end, period.start_ns),
                               self._charged[user] - period.tokens_before, lists.pop(user, []))
        self._sweeps += 1
        if self._sweeps % BOOKS_EVERY == 0 or idle:
            self._trim_books()

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
        if len(self._charged) > 2 * len(periods) + 64:
            tokens = self._charged
            self._charged = Counter({user: tokens[user] for user in periods})
        by_request = self._throttle_ns
        for req_id in list(compress(by_request.keys(), map(le, repeat(THROTTLE_FOLD_AT),
                                                           map(len, by_request.values())))):
            self._fold_throttle(req_id, by_request[req_id])

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

    def on_throttled_users(self, now: int, by_user: dict[str, tuple[int, int]]) -> None:
        """At an export step: user -> (throttled requests, their KV blocks)."""
        if by_user:
            self._queue_replay(self._replay_throttled_users, now, by_user)

    def _replay_throttled_users(self, now: int, by_user: dict[str, tuple[int, int]]) -> None:
        periods = self._periods
        for user, (requests, blocks) in by_user.items():
            period = periods.get(user)
            if period is not None:
                period.max_requests = max(period.max_requests, requests)
                period.max_blocks = max(period.max_blocks, blocks)

    def on_idle(self, now: int) -> None:
        """The engine has nothing running: every open period ends."""
        self._queue_replay(self._sweep, now, (), True)

    def _build_period(self, period: _Period, end_ns: int, tokens: int, took: list[int]) -> None:
        ordered = sorted(took)
        longest = max(ordered[-1] if ordered else 0, period.cut_max_ns)
        seconds = max(end_ns - period.start_ns, 1) / 1e9
        try:
            limit = float(self.view.rate_of(period.user))
        except Exception:  # (a view read from this thread must not stop the builder)
            limit = 0.0
        attributes = {
            "output_rate.user": period.user,
            "output_rate.limit_tokens_per_second": limit,
            "output_rate.tokens_charged": tokens,
            "output_rate.tokens_per_second": round(tokens / seconds, 3),
            "output_rate.throttle_episodes": len(took) + period.episodes_cut,
            "output_rate.throttle_p50_us": _spacing_us(_quantile(ordered, 0.5)),
            "output_rate.throttle_p90_us": _spacing_us(_quantile(ordered, 0.9)),
            "output_rate.throttle_p99_us": _spacing_us(_quantile(ordered, 0.99)),
            "output_rate.throttle_max_us": _spacing_us(longest),
            "output_rate.throttled_us": _spacing_us(sum(ordered) + period.cut_ns),
            "output_rate.throttled_requests_max": period.max_requests,
            "output_rate.throttled_kv_blocks_max": period.max_blocks,
        }
        self._span("output_rate.over_limit", period.start_ns, end_ns, attributes)

    def _build_step(self, now: int, step: int, charged: int, refunded: list[tuple[str, str, str]],
                    throttled: int, refused: list[str]) -> None:
        span = self.tracer.start_span("output_rate.step", start_time=now + self.offset, attributes={
            "output_rate.step": step,
            "output_rate.charged": charged,
            "output_rate.refunded": len(refunded),
            "output_rate.throttled": throttled,
            "output_rate.refused_users": sorted(refused)[:32],
            "output_rate.refusal_steps_per_span": 1 if refunded else self.step_sample_every,
        })
        for req_id, user, reason in refunded:
            span.add_event("refund", attributes={
                "output_rate.request_id": req_id, "output_rate.user": user,
                "output_rate.reason": reason})
        span.end(end_time=now + self.offset)

    def _sample_refusal(self) -> bool:
        self._refusal_steps += 1
        return self._refusal_steps % self.step_sample_every == 1 or self.step_sample_every == 1

    def _keep_longest(self, req_id: str, start_ns: int, end_ns: int, outcome: str, blocks: int,
                      facts: RequestFacts | None) -> None:
        """Keep this episode (at least the minimum long) for the request's
        throttle span if it is its longest so far."""
        kept = self._longest.get(req_id)
        if kept is None or end_ns - start_ns > kept[1] - kept[0]:
            self._longest[req_id] = (start_ns, end_ns, outcome, blocks, facts,
                                     req_id in self._preempted,
                                     self._tokens_charged(req_id))

    def _build_throttle(self, req_id: str, start_ns: int, end_ns: int, outcome: str,
                        blocks: int, facts: RequestFacts | None, preempted: bool,
                        tokens: int) -> None:
        """The span of a request's longest throttle episode (at least
        ``OUTPUT_RATE_TRACE_THROTTLE_MIN_S``), in the request's trace;
        ``blocks``: the KV blocks it held when the episode ended."""
        facts = self._who.get(req_id) or facts
        attributes = {
            GEN_AI_REQUEST_ID: external_request_id(req_id, self._randomized_ids),
            "output_rate.request_id": req_id,
            "output_rate.tokens_charged": tokens,
            "output_rate.held_kv": blocks > 0,
            "output_rate.kv_blocks": blocks,
            "output_rate.preempted": preempted,
            "output_rate.outcome": outcome,
        }
        if facts is not None:
            attributes["output_rate.priority"] = facts.priority
        _identity_attributes(facts, attributes)
        self._span("output_rate.throttle", start_ns, end_ns, attributes,
                   context=self._parent_context(facts))

    def _tokens_charged(self, req_id: str) -> int:
        """Tokens charged to the request so far: its output tokens (the
        episode ended at a dispatch whose step came before this replay)."""
        tokens = self.view.num_output_tokens(req_id)
        if tokens is None:
            if req_id not in self._series:
                return 0
            return self._spacings(req_id) + 1
        return tokens

    # -- per update_from_output -------------------------------------------
    #
    # Steady requests (a token now and at the previous update) cost nothing
    # per request: every update appends its spacing to one timeline
    # (``_gaps``), and a request holds an open *run* (the update it became
    # steady from). A run's spacings are copied out of the timeline as one
    # slice when the request pauses, takes several tokens in one update,
    # finishes, or every ``TRIM_EVERY`` updates when it passes the cap.

    def on_update(self, now_ns: int) -> None:
        """An ``update_from_output`` at ``now_ns`` (before its requests)."""
        if self._last_ns is not None:
            self._gaps.append(_spacing_us(now_ns - self._last_ns))
        else:
            self._gaps.append(0)
        self._last_ns = now_ns
        self._index += 1
        if self._index % TRIM_EVERY == 0:
            self._trim_all()

    def _close_run(self, req_id: str, end: int) -> None:
        """Copy ``req_id``'s run of steady spacings up to update ``end``
        (inclusive) into its series and end the run."""
        start = self._runs.pop(req_id, None)
        if start is not None and end > start:
            base = self._index - len(self._gaps) + 1
            self._series[req_id].extend(self._gaps[start + 1 - base:end + 1 - base])

    def _trim_all(self) -> None:
        """Cut the series that passed the cap, and the timeline to the
        oldest open run (so both stay bounded however long requests run)."""
        index, runs = self._index, self._runs
        # (runs are known to cover the previous update; this one has just begun)
        for req_id, start in list(runs.items()):
            if len(self._series[req_id]) + index - 1 - start > MAX_SERIES:
                self._close_run(req_id, index - 1)
                runs[req_id] = index - 1
        for req_id in [r for r, values in self._series.items() if len(values) > MAX_SERIES]:
            self._trim(req_id)
        oldest = min(runs.values(), default=index)
        base = index - len(self._gaps) + 1
        del self._gaps[:oldest - base]

    def on_paused(self, req_ids: Any) -> None:
        """``req_ids`` had a token at the previous update and none now."""
        end = self._index - 1
        for req_id in req_ids:
            self._close_run(req_id, end)

    def on_tokens(self, req_id: str, n: int, prev_ns: int | None, now_ns: int) -> None:
        """``n`` tokens of ``req_id`` became available at ``now_ns``; its
        previous token at ``prev_ns`` (None: these are its first). Called by
        ``telemetry.engine`` for the requests that had no token at the
        previous update; from here on the request is steady (a run)."""
        s = self._series.get(req_id)
        if s is None:
            s = self._series[req_id] = array("I")
        if prev_ns is not None:
            s.append(_spacing_us(now_ns - prev_ns))
        if n > 1:
            s.extend([0] * (n - 1))
        if len(s) > MAX_SERIES + TRIM_EVERY:  # (a request that is seldom steady)
            self._trim(req_id)
        self._runs[req_id] = self._index

    def _trim(self, req_id: str) -> None:
        """Cut ``req_id``'s series to ``MAX_SERIES``, counting what is cut."""
        values = self._series.get(req_id)
        if values is not None and len(values) > MAX_SERIES:
            self._overflow[req_id] = self._overflow.get(req_id, 0) + len(values) - MAX_SERIES
            del values[MAX_SERIES:]

    def on_zeros(self, req_id: str, k: int) -> None:
        """``k`` more tokens of ``req_id`` at the moment of its last one
        (after this update's spacing, if it was steady)."""
        s = self._series.get(req_id)
        if s is not None:
            if req_id in self._runs:
                self._close_run(req_id, self._index)
                self._runs[req_id] = self._index
            s.extend([0] * k)
            if len(s) > MAX_SERIES + TRIM_EVERY:
                self._trim(req_id)

    def _spacings(self, req_id: str) -> int:
        """Spacings recorded for ``req_id`` so far (kept, cut and in its run)."""
        start = self._runs.get(req_id)
        return (len(self._series[req_id]) + self._overflow.get(req_id, 0)
                + (self._index - start if start is not None else 0))

    def on_outputs(self, now: int, paused: Any, back: list[str], prevs: list[int],
                   first: list[str], first_facts: list[RequestFacts | None],
                   zeros: list[tuple[str, int]], finished: list[tuple[str, str]]) -> None:
        """One ``update_from_output`` (the scheduler's thread: one append):
        the requests that had a token at the previous update and none now
        (``paused``), those back after a pause with when their last token
        came (``back``, ``prevs``), those with their first tokens and their
        facts (read now, while the request is there), extra tokens in this
        update (``zeros``), and those finished with their reason."""
        self._queue_replay(self._replay_outputs, now, paused, back, prevs, first, first_facts,
                           zeros, finished)

    def _replay_outputs(self, now: int, paused: Any, back: list[str], prevs: list[int],
                        first: list[str], first_facts: list[RequestFacts | None],
                        zeros: list[tuple[str, int]], finished: list[tuple[str, str]]) -> None:
        self.on_update(now)
        # Requests back after a pause at the previous update begin a run
        # only if they did not pause again (a user pacing at its limit: one
        # token, then throttled): until then their run is empty, and kept
        # apart so that pausing again costs nothing.
        joining = self._joining_runs
        if paused:
            self.on_paused(paused - joining.keys() if joining else paused)
        if joining:
            runs = self._runs
            for req_id in joining.keys() - paused if paused else joining:
                runs[req_id] = joining[req_id]
        if back:  # (on_tokens in C: requests back after a pause)
            series = self._series
            missing = set(back).difference(series)
            if missing:  # (they had a first token: never, unless cut short)
                series.update({req_id: array("I") for req_id in missing})
            # each one's spacing (whole us within uint32, as _spacing_us)
            # onto its series; cut to the cap every TRIM_EVERY updates
            gaps = map(min, map(floordiv, map(sub, repeat(now, len(prevs)), prevs), repeat(1000)),
                       repeat(0xFFFFFFFF))
            deque(map(array.append, map(series.__getitem__, back), gaps), maxlen=0)
            self._joining_runs = dict.fromkeys(back, self._index)
        elif joining:
            self._joining_runs = {}
        for req_id, facts in zip(first, first_facts):
            if facts is not None:
                self._who[req_id] = facts
            self.on_tokens(req_id, 1, None, now)
        for req_id, k in zeros:
            self.on_zeros(req_id, k)
        for req_id, reason in finished:
            self._finish(req_id, reason, now)

    def on_aborted(self, aborted: list[tuple[str, str]], now: int,
                   ended: dict[str, int] | None = None,
                   facts: list[RequestFacts | None] | None = None,
                   held: dict[str, tuple[int, RequestFacts | None]] | None = None) -> None:
        """Requests finished from outside (client aborts), as (request id,
        user), and the start of the open throttle episodes among them: their
        generation spans are emitted (one append; ``facts`` of each, read
        from the engine now when not given; ``held``: the KV blocks of those
        with an episode open, read when it began)."""
        if facts is None:
            view = self.view
            facts = [view.request_facts(req_id) for req_id, _ in aborted]
        self._queue_replay(self._replay_aborted, aborted, facts, ended or {}, now, held or {})

    def _replay_aborted(self, aborted: list[tuple[str, str]], facts: list[RequestFacts | None],
                        ended: dict[str, int], now: int,
                        held: dict[str, tuple[int, RequestFacts | None]] | None = None) -> None:
        if ended:
            closed = [req_id for req_id, _ in aborted if req_id in ended]
            self._book_episodes(now, closed, [now - ended[r] for r in closed], dict(aborted).get)
        for (req_id, _user), known in zip(aborted, facts):
            start = ended.get(req_id)
            if start is not None and now - start >= self.throttle_min_ns:
                blocks = held[req_id][0] if held and req_id in held else 0
                self._keep_longest(req_id, start, now, "aborted", blocks, known)
            self._finish(req_id, "abort", now, known)

    def _finish(self, req_id: str, reason: str, now: int,
                facts: RequestFacts | None = None) -> None:
        known = self._who.pop(req_id, None)
        if known is not None:
            facts = known
        had_tokens = req_id in self._series
        if had_tokens:
            self._close_run(req_id, self._index)
        self._trim(req_id)
        s = self._series.pop(req_id, array("I"))
        tokens = len(s) + 1 + self._overflow.pop(req_id, 0) if had_tokens else 0
        self._joining_runs.pop(req_id, None)
        throttle = None
        took = self._throttle_ns.pop(req_id, None)
        if took is not None or req_id in self._throttle_books:
            throttle = self._fold_throttle(req_id, took if took is not None else array("q"))
            del self._throttle_books[req_id]
        self._preempted.discard(req_id)
        longest = self._longest.pop(req_id, None)
        if longest is not None:
            self._build_throttle(req_id, *longest)
        self._build_generation(req_id, reason, now, s, tokens, facts, throttle)

    def _build_generation(self, req_id: str, reason: str, now: int, s: array, tokens: int,
                          facts: RequestFacts | None, throttle: list[int] | None = None) -> None:
        ordered = sorted(s)
        attributes = {
            GEN_AI_REQUEST_ID: external_request_id(req_id, self._randomized_ids),
            GEN_AI_RESPONSE_MODEL: self.view.model_name,
            GEN_AI_USAGE_OUTPUT_TOKENS: tokens,
            GEN_AI_RESPONSE_FINISH_REASONS: [reason],
            "output_rate.request_id": req_id,
            # charged at dispatch, one per token: equal to the tokens with
            # synchronous scheduling (async may charge one more, refunded
            # only if the request is not dispatched again)
            "output_rate.tokens_charged": tokens,
            "output_rate.spacing_p50_us": _quantile(ordered, 0.5),
            "output_rate.spacing_p90_us": _quantile(ordered, 0.9),
            "output_rate.spacing_p99_us": _quantile(ordered, 0.99),
            "output_rate.spacing_max_us": ordered[-1] if ordered else 0,
            "output_rate.spacing_series_us": series_attribute(s),
            "output_rate.spacing_series_truncated": len(s) >= MAX_SERIES,
            # where it waited for its user's budget: throttle episodes that
            # ended with a dispatch (or its abort), their total and longest
            "output_rate.throttle_episodes": throttle[0] if throttle else 0,
            "output_rate.throttled_us": throttle[1] // 1000 if throttle else 0,
            "output_rate.throttle_max_us": throttle[2] // 1000 if throttle else 0,
        }
        _identity_attributes(facts, attributes)
        start = now - sum(s) * 1000
        self._span("output_rate.generation", start, now, attributes,
                   context=self._parent_context(facts))

    # -- per idle wait --------------------------------------------------------

    def shutdown(self, timeout_s: float = 2.0) -> None:
        """Flush what is queued, waiting at most ``timeout_s``: an
        unreachable endpoint must not hold the engine's shutdown (the SDK
        would wait for its export retries)."""
        self._stop.set()
        provider = self.provider

        def run() -> None:
            try:
                self.flush()
                with self._build_lock:  # every open period ends here
                    self._sweep(self._now, idle=True)
                if provider is not None:
                    provider.shutdown()
            except Exception:  # never let telemetry hurt the engine's shutdown
                logger.exception("output-rate traces: shutdown failed")

        thread = threading.Thread(target=run, name="output-rate-trace-shutdown", daemon=True)
        thread.start()
        thread.join(timeout_s)

    def on_idle_wait(self, wait: IdleWait) -> None:
        self._queue(self._build_idle_wait, wait)

    def on_limits(self, change: Any) -> None:
        """New limits in force (``observers.LimitsChange``): one span, at
        the step boundary where they took effect."""
        self._queue(self._build_limits, change)

    def _build_limits(self, change: Any) -> None:
        cap = 64  # user ids listed in the span (the counts are exact)
        self._span("output_rate.limits_reload", change.now_ns, change.now_ns, {
            "output_rate.limits.sha256": change.digest,
            "output_rate.limits.previous_sha256": change.old_digest,
            "output_rate.limits.default_tokens_per_second": float(change.default_rate),
            "output_rate.limits.previous_default_tokens_per_second":
                float(change.old_default_rate),
            "output_rate.limits.users": len(change.user_rates),
            "output_rate.limits.users_added": len(change.added),
            "output_rate.limits.users_removed": len(change.removed),
            "output_rate.limits.users_changed": len(change.changed),
            "output_rate.limits.added": list(change.added[:cap]),
            "output_rate.limits.removed": list(change.removed[:cap]),
            "output_rate.limits.changed": list(change.changed[:cap]),
        })

    def _build_idle_wait(self, wait: Any) -> None:
        attributes = {
            "output_rate.planned_timeout_s": wait.planned_s,
            "output_rate.reason": wait.reason,
        }
        if wait.target_ns is not None:
            attributes["output_rate.ready_at_unix_ns"] = wait.target_ns + self.offset
            attributes["output_rate.lateness_ns"] = wait.lateness_ns
        self._span("output_rate.idle_wait", wait.started_ns, wait.woke_ns, attributes)


class TraceDrops:
    """Spans that never reached the exporter's far end, by reason.

    ``trace_queue_full``: more spans waiting than a queue holds
    (``OTEL_BSP_MAX_QUEUE_SIZE``, default 2048): the recorder's queue of
    spans to build, or the batch processor's queue of spans to export; the
    span is dropped before the SDK sees it (the SDK would log a warning per
    span). ``trace_export_failed``: the exporter reported failure or raised
    (an unreachable OTLP endpoint, say), or a span could not be built. Each
    reason is logged once; the counts go to
    ``vllm_output_rate_telemetry_dropped_total``.

    ``pending`` is a deque whose append and popleft are atomic; counts are
    written by several threads (scheduler, span builder, exporter), only
    when something is dropped, under a lock.
    """

    def __init__(self, max_queue: int) -> None:
        self.max_queue = max_queue
        self.pending: deque[None] = deque()
        self.counts: dict[str, int] = {"trace_queue_full": 0, "trace_export_failed": 0}
        self._logged: set[str] = set()
        self._lock = threading.Lock()

    def drop(self, reason: str, n: int, detail: str = "") -> None:
        with self._lock:  # (only on the drop path, never per token)
            self.counts[reason] += n
            first = reason not in self._logged
            self._logged.add(reason)
        if first:
            logger.warning("output-rate traces: %d span(s) dropped (%s)%s; further drops are "
                           "only counted in vllm_output_rate_telemetry_dropped_total",
                           n, reason, f": {detail}" if detail else "")


def _counting_processor(exporter: Any, drops: TraceDrops) -> Any:
    """A BatchSpanProcessor behind a bounded, counted queue, exporting
    through ``exporter`` with failures counted."""
    from opentelemetry.sdk.trace import SpanProcessor
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    class CountingExporter(SpanExporter):
        def export(self, spans: Any) -> Any:
            for _ in spans:
                try:
                    drops.pending.popleft()
                except IndexError:
                    break
            try:
                result = exporter.export(spans)
            except Exception as exc:  # a broken exporter must not stop the thread
                drops.drop("trace_export_failed", len(spans), f"{type(exc).__name__}: {exc}")
                return SpanExportResult.FAILURE
            if result is not SpanExportResult.SUCCESS:
                drops.drop("trace_export_failed", len(spans), str(result))
            return result

        def shutdown(self) -> None:
            exporter.shutdown()

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return exporter.force_flush(timeout_millis)

    batch = BatchSpanProcessor(CountingExporter(), max_queue_size=drops.max_queue,
                               max_export_batch_size=min(512, drops.max_queue))

    class BoundedProcessor(SpanProcessor):
        def on_start(self, span: Any, parent_context: Any = None) -> None:
            pass

        def on_end(self, span: Any) -> None:
            if len(drops.pending) >= drops.max_queue:
                drops.drop("trace_queue_full", 1)
                return
            drops.pending.append(None)
            batch.on_end(span)

        def shutdown(self) -> None:
            batch.shutdown()

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return batch.force_flush(timeout_millis)

    return BoundedProcessor()


def tracer_provider_from_env(otlp_endpoint: str | None = None,
                             drops: TraceDrops | None = None) -> Any | None:
    """A TracerProvider from the standard ``OTEL_*`` variables or vLLM's
    ``--otlp-traces-endpoint``; None when tracing is not asked for.

    ``OTEL_TRACES_EXPORTER``: a comma-separated list of ``otlp`` (the default
    when an endpoint is set), ``console`` and ``none``;
    ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` / ``OTEL_EXPORTER_OTLP_PROTOCOL``:
    ``grpc`` (default) or ``http/protobuf``. The endpoint variables keep
    their OpenTelemetry meaning, read by the SDK's exporter itself:
    ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is the traces URL as given,
    ``OTEL_EXPORTER_OTLP_ENDPOINT`` a base URL (over HTTP the exporter adds
    ``/v1/traces``). vLLM's ``--otlp-traces-endpoint`` is a traces endpoint,
    as vLLM uses it. The resource is the SDK's (``OTEL_RESOURCE_ATTRIBUTES``,
    ``OTEL_SERVICE_NAME``), with ``service.name`` ``vllm-output-rate`` and
    ``service.version`` this package's version where they set none.
    For offline use, ``OUTPUT_RATE_TRACES_FILE``: append the spans to
    that file in OTLP/JSON, one export request per line, as the
    Collector's ``otlpjsonfile`` receiver reads them (instead of the
    console or an OTLP endpoint; ``OTEL_TRACES_EXPORTER=none`` still turns
    traces off).
    """
    if not settings.traces_requested(otlp_endpoint):
        return None
    names = settings.trace_exporter_names()
    path = settings.get("TRACES_FILE") or ""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    provider = TracerProvider(resource=_resource())
    exporters: list[Any] = []
    if path:
        exporters.append(OtlpJsonFileExporter(path))
    else:
        for name in names or ["otlp"]:
            if name == "console":
                exporters.append(ConsoleSpanExporter())
            elif name == "otlp":
                exporters.append(_otlp_exporter(otlp_endpoint))
            else:
                logger.warning("OTEL_TRACES_EXPORTER: %r is not an exporter of "
                               "vllm-output-rate (otlp, console, none); ignored", name)
        if not exporters:
            return None
    exporter = exporters[0] if len(exporters) == 1 else _FanOutExporter(exporters)
    if drops is None:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    else:
        provider.add_span_processor(_counting_processor(exporter, drops))
    return provider


def _resource() -> Any:
    """The SDK's resource from the environment, with our name and version
    where the environment gives none."""
    from importlib import metadata

    from opentelemetry.sdk.resources import SERVICE_NAME, SERVICE_VERSION, Resource

    detected = Resource.create()
    ours: dict[str, str] = {}
    if str(detected.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        ours[SERVICE_NAME] = "vllm-output-rate"
    if SERVICE_VERSION not in detected.attributes:
        try:
            ours[SERVICE_VERSION] = metadata.version("vllm-output-rate")
        except metadata.PackageNotFoundError:  # pragma: no cover - not installed
            pass
    return detected.merge(Resource(ours)) if ours else detected


def _otlp_exporter(traces_endpoint: str | None) -> Any:
    import os

    protocol = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc")
    if protocol.startswith("http"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    # Only vLLM's flag is passed: the exporter reads the OTEL_* endpoints
    # itself, and adds the signal path to a base URL where the spec says so.
    return OTLPSpanExporter(endpoint=traces_endpoint) if traces_endpoint else OTLPSpanExporter()


class _FanOutExporter:
    """Several exporters as one (``OTEL_TRACES_EXPORTER=otlp,console``): each
    gets every batch; the batch failed if any of them failed."""

    def __init__(self, exporters: list[Any]) -> None:
        self.exporters = exporters

    def export(self, spans: Any) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        ok = True
        for exporter in self.exporters:
            try:
                ok &= exporter.export(spans) is SpanExportResult.SUCCESS
            except Exception:
                ok = False
        return SpanExportResult.SUCCESS if ok else SpanExportResult.FAILURE

    def shutdown(self) -> None:
        for exporter in self.exporters:
            exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return all(exporter.force_flush(timeout_millis) for exporter in self.exporters)


#: the fields of OTLP's trace messages that hold a trace or span id (bytes):
#: hex strings in OTLP/JSON, not protobuf JSON's base64
_OTLP_ID_FIELDS = ("traceId", "spanId", "parentSpanId")


def otlp_json(spans: Any) -> str:
    """``spans`` (SDK ReadableSpans) as one ``ExportTraceServiceRequest`` in
    OTLP/JSON, as the OpenTelemetry protocol specifies it (and the
    Collector's ``otlpjsonfile`` receiver and file exporter use it, one
    request per line): the SDK's own protobuf encoding (the one its OTLP
    exporters send) in protobuf's JSON mapping, field names lowerCamelCase,
    enums as integers, 64-bit integers as strings, and trace and span ids
    (also of links) as hex strings. No newline in it."""
    import json

    from google.protobuf import json_format
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    message = json_format.MessageToDict(encode_spans(spans), use_integers_for_enums=True)
    for resource_spans in message.get("resourceSpans", ()):
        for scope_spans in resource_spans.get("scopeSpans", ()):
            for span in scope_spans.get("spans", ()):
                _hex_ids(span)
                for link in span.get("links", ()):
                    _hex_ids(link)
    return json.dumps(message, separators=(",", ":"))


def _hex_ids(obj: dict[str, Any]) -> None:
    import base64

    for field in _OTLP_ID_FIELDS:
        value = obj.get(field)
        if value:
            obj[field] = base64.b64decode(value).hex()


class OtlpJsonFileExporter:
    """Spans appended to a file in OTLP/JSON: one ``ExportTraceServiceRequest``
    per line (a batch per line, ``otlp_json``), each line written with one
    ``write`` on a file opened for appending (engines of several processes
    may share the file). A file that cannot be written fails the export
    (counted as ``trace_export_failed`` by the processor)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def export(self, spans: Any) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        if not spans:
            return SpanExportResult.SUCCESS
        data = (otlp_json(spans) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def max_queue_from_env() -> int:
    """``OTEL_BSP_MAX_QUEUE_SIZE`` (default 2048), as the SDK reads it."""
    import os

    try:
        return max(int(os.environ.get("OTEL_BSP_MAX_QUEUE_SIZE", "2048")), 1)
    except ValueError:
        return 2048


def tracer_from(provider: Any) -> Any:
    return provider.get_tracer(_TRACER_NAME)
