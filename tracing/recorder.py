"""The span recorder: the telemetry's worker (``telemetry.folds``) queues
plain data here, and the span builder's thread hands it to the builders.

On the data's path: the telemetry's worker (off the scheduler's thread)
calls ``on_step``, ``on_outputs``, ``on_aborted``, ... with plain data per
step and per update (references to the step's own containers, lists made
in C); each call is at most a couple of appends to one bounded queue.
``flush`` (the telemetry's worker at the end of each of its drains; a
recorder made with ``background=True`` has a builder thread of its own that
does it every ``BUILD_INTERVAL_S``; and at shutdown) replays the queue in
order into the builders' books and spans: the spacing series
(``series``), throttle episodes and over-limit periods (``throttle``),
deferred prefills (``prefill``: their books kept on the worker),
generation spans (``generation``), step, idle-wait and limits-reload spans
(``steps``), all made on one emitter (``emit``). A full queue drops entries
and a broken entry is skipped, both counted (``drops.TraceDrops``) and
logged once, never blocking.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from vllm_output_rate import settings
from vllm_output_rate.observers import EngineView, IdleWait, RequestFacts, StepReport
from vllm_output_rate.telemetry.records import Episodes, TokenUpdate
from vllm_output_rate.tracing.drops import TraceDrops, max_queue_from_env
from vllm_output_rate.tracing.emit import SpanEmitter
from vllm_output_rate.tracing.generation import GenerationSpans
from vllm_output_rate.tracing.prefill import PrefillSpans
from vllm_output_rate.tracing.series import SpacingSeries
from vllm_output_rate.tracing.steps import StepSpans
from vllm_output_rate.tracing.throttle import PERIOD_SWEEP_NS, ThrottleSpans

#: The scheduler's thread queues spans as plain data; a thread of ours builds
#: them into SDK spans (and hands them to the batch processor) this often.
BUILD_INTERVAL_S = 0.2
#: One ``output_rate.step`` span per this many steps that only refused users
#: (steps with refunds always get one). Default 50.
STEP_SAMPLE_ENV = settings.name("TRACE_REFUSAL_STEP_EVERY")
#: Throttle episodes shorter than this many seconds get no span (they are
#: still in the episode histogram). Default 0: a span for every episode. A
#: user at its limit with several streams has one short episode per token.
THROTTLE_MIN_ENV = settings.name("TRACE_THROTTLE_MIN_S")

logger = logging.getLogger("vllm_output_rate.tracing")


class SpanRecorder:
    """Turns the limiter's plain data into spans on ``tracer``.

    ``clock_offset_ns`` maps the scheduler's monotonic clock to epoch ns.
    """

    def __init__(self, tracer: Any, view: EngineView, clock_offset_ns: int | None = None,
                 background: bool = True) -> None:
        self.view = view
        #: TraceDrops of the provider's processor (the engine sets its own)
        self.drops = TraceDrops(max_queue_from_env())
        #: the TracerProvider (flushed and shut down with the engine)
        self.provider: Any = None
        #: how often ``telemetry.folds`` sends the users with a throttle
        #: episode open (for over-limit periods to end)
        self.sweep_ns = PERIOD_SWEEP_NS
        #: episodes shorter than this (ns) get no span
        self.throttle_min_ns = int(settings.get_or_default("TRACE_THROTTLE_MIN_S") * 1e9)
        #: refusal-only steps get one step span in this many (refund steps: always)
        self.step_sample_every = settings.get_or_default("TRACE_REFUSAL_STEP_EVERY")
        self._refusal_steps = 0
        # the span builders (only the span builder's thread touches them)
        emitter = SpanEmitter(tracer, clock_offset_ns)
        series = SpacingSeries()
        self.throttle = ThrottleSpans(emitter, view, series)
        self.generation = GenerationSpans(emitter, view, series, self.throttle)
        self.steps = StepSpans(emitter, self.step_sample_every)
        #: deferred prefills: books on the telemetry's worker, spans built here
        self.prefill = PrefillSpans(emitter, view)
        # what is queued per step and per update, bound once
        self._replay_step = self.throttle.replay_step
        self._replay_outputs = self.generation.replay_outputs
        self._build_step = self.steps.build_step
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

    # -- the queue, and building spans off the scheduler's thread ------------

    def _queue(self, build: Callable[..., None], *args: Any) -> None:
        """Queue a span's plain data, or what the span builder keeps books
        of (series, episodes, periods): one append; dropped and counted only
        when the queue is full."""
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
                    self.throttle.end_periods()
                if provider is not None:
                    provider.shutdown()
            except Exception:  # never let telemetry hurt the engine's shutdown
                logger.exception("output-rate traces: shutdown failed")

        thread = threading.Thread(target=run, name="output-rate-trace-shutdown", daemon=True)
        thread.start()
        thread.join(timeout_s)

    # -- per step: throttle episodes, over-limit periods, step spans ---------

    def on_step(self, record: StepReport, ended: Episodes | None = None,
                opened_users: Any = (), sweep: set[str | None] | None = None,
                facts_of: Callable[[str], RequestFacts | None] | None = None) -> None:
        """Per step (``telemetry.folds``, on the worker: at most two appends).
        ``ended``: the throttle episodes that ended in the step (at the
        dispatch of the step before, see ``telemetry.records.Episodes``);
        ``opened_users``: the users of the episodes that began in this step;
        ``sweep`` (every ``sweep_ns``): the users with an episode open, for
        periods to end; ``facts_of``: a request's facts by id (deferred
        prefills' spans)."""
        if ended is not None or opened_users or record.refused or record.preempted_throttled \
                or sweep is not None or record.borrowed or record.at_ceiling:
            self._queue(self._replay_step, record, opened_users, ended, sweep)
        if record.refunded or (record.refused and self._sample_refusal()):
            self._queue(self._build_step, record)
        if record.prompt_deferred or (record.prompt_chunks and self.prefill.open):
            self._queue_prefill(self.prefill.on_step(record, facts_of, self.throttle_min_ns))

    def _queue_prefill(self, closed: list[tuple]) -> None:
        build = self.prefill.build
        for span in closed:
            self._queue(build, *span)

    def _sample_refusal(self) -> bool:
        self._refusal_steps += 1
        return self._refusal_steps % self.step_sample_every == 1 or self.step_sample_every == 1

    def on_ended(self, ended: Episodes) -> None:
        """Throttle episodes that ended outside a step: of requests that
        finished with one open (their last token dispatched inside it)."""
        self._queue(self.throttle.replay_ended, ended)

    def on_throttled_users(self, now: int, by_user: dict[str, tuple[int, int]]) -> None:
        """At an export step: user -> (throttled requests, their KV blocks)."""
        if by_user:
            self._queue(self.throttle.replay_throttled_users, now, by_user)

    def on_idle(self, now: int) -> None:
        """The engine has nothing running: every open period ends."""
        self._queue(self.throttle.sweep, now, (), True)

    # -- per update_from_output: spacing series, generation spans -------------

    def on_outputs(self, timing: TokenUpdate, first_facts: list[RequestFacts | None]) -> None:
        """One ``update_from_output`` (``telemetry.folds``, on the worker:
        one append): its token timing as the metrics worked it out
        (``telemetry.records.TokenUpdate``), and the facts of the requests
        with their first tokens (read by their handles); the prefill spans
        of the requests that finished with their prompt put off."""
        self._queue(self._replay_outputs, timing, first_facts)
        if timing.ends and self.prefill.open:
            self._queue_prefill(self.prefill.on_ended(timing.ends, timing.now, "finished",
                                                      min_ns=self.throttle_min_ns))

    def on_aborted(self, aborted: list[tuple[str, str]], now: int,
                   ended: Episodes | None = None,
                   facts: list[RequestFacts | None] | None = None) -> None:
        """Requests finished from outside (client aborts), as (request id,
        user), and the throttle episodes open among them, ended now (with
        the KV blocks each held, read when it began): their generation
        spans are emitted (one append; ``facts`` of each, read from the
        engine now when not given)."""
        if facts is None:
            view = self.view
            facts = [view.request_facts(req_id) for req_id, _ in aborted]
        self._queue(self._replay_aborted, aborted, facts, ended, now)
        if self.prefill.open:
            self._queue_prefill(self.prefill.on_ended(aborted, now, "aborted", facts,
                                                      self.throttle_min_ns))

    def _replay_aborted(self, aborted: list[tuple[str, str]], facts: list[RequestFacts | None],
                        ended: Episodes | None, now: int) -> None:
        """The aborted requests' open episodes end (the throttle books),
        then the requests (their generation spans)."""
        throttle, finish = self.throttle, self.generation.finish
        start_of: dict[str, int] = {}
        held = None
        if ended is not None:
            throttle.book_episodes(ended)
            start_of = dict(zip(ended.req_ids, ended.starts))
            held = ended.held
        for (req_id, _user), known in zip(aborted, facts):
            start = start_of.get(req_id)
            if start is not None and now - start >= self.throttle_min_ns:
                blocks = held[req_id][0] if held and req_id in held else 0
                throttle.keep_longest(req_id, start, now, "aborted", blocks, known)
            finish(req_id, "abort", now, known)

    # -- per idle wait, per limits change ---------------------------------------

    def on_idle_wait(self, wait: IdleWait) -> None:
        self._queue(self.steps.build_idle_wait, wait)

    def on_limits(self, change: Any) -> None:
        """New limits in force (``observers.LimitsChange``): one span, at
        the step boundary where they took effect."""
        self._queue(self.steps.build_limits, change)
