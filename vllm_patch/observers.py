"""The observer contract: how the engine side reports what the limiter did.

The scheduler and the engine loop know nothing of telemetry or tracing. They
report five things, as plain data, to whatever observers were registered:

* a request added (its id: an observer that defers its work takes a
  handle to read its user and facts by later, ``EngineView.request_handle``),
* a step (``StepReport``: ids, users, counts; no vLLM objects),
* the engine outputs of each ``update_from_output`` (token timing),
* requests finished from outside the scheduler (client aborts),
* an idle wait of the engine loop (``IdleWait``).

An observer reads the engine only through an ``EngineView`` (implemented in
``internals``, where every vLLM internal read is named). Observers register
themselves with ``register_observer`` (telemetry does, from its own
``vllm.general_plugins`` entry point); the scheduler creates them with
``create_observer`` when it starts. Registration is idempotent by name.

Everything an observer does on the scheduler's thread is on the engine's hot
path: fold into plain data, export elsewhere.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, Sequence

if TYPE_CHECKING:
    from vllm_output_rate.config import OutputRateConfig

logger = logging.getLogger("vllm_output_rate")


#: Why a request's prompt was put off (``StepReport.prompt_deferred``): its
#: user's prompt budget (``prompt_rate``), or its user's output budget (just
#: in time: not computed before its first token may be sampled; without
#: chunked prefill a whole prompt waits for it).
PROMPT_DEFER_REASONS = ("prompt_budget", "just_in_time")


@dataclass(slots=True)
class StepReport:
    """What the limiter did in one ``schedule()`` call. Plain data."""

    step: int
    now_ns: int
    #: request id -> user, for every token charged (and kept) in this step
    charged: dict[str, str] = field(default_factory=dict)
    #: (request id, user, reason) for every token given back
    refunded: list[tuple[str, str, str]] = field(default_factory=list)
    #: request id -> user, for every token lent in this step (over the
    #: user's guaranteed rate, under its ceiling: not in ``charged``)
    borrowed: dict[str, str] = field(default_factory=dict)
    #: users whose ceiling refused them a token in this lending step (out
    #: of guaranteed budget, their ceiling spent: held at the ceiling)
    at_ceiling: list[str] = field(default_factory=list)
    #: ids of running requests skipped because their user had no budget
    throttled: list[str] = field(default_factory=list)
    #: those of ``throttled`` that were not throttled in the step before
    #: (the others were: a user pacing at its limit changes only a few)
    throttled_new: list[str] = field(default_factory=list)
    #: users refused in this step -> when their budget returns (ns)
    refused: dict[str, int] = field(default_factory=dict)
    #: final prefill chunks held one position short for lack of budget
    prefill_held: int = 0
    #: waiting requests left waiting for lack of budget
    waiting_skipped: int = 0
    #: prefill chunks not computed in this step because their user had no
    #: output budget (just in time: ``--output-rate-prefill-ahead`` off)
    prefill_deferred: int = 0
    #: request id -> (user, prompt tokens computed, whether its prompt is
    #: all computed with them), for every prefill chunk dispatched in this
    #: step (prefix-cache hits are not computed: not counted)
    prompt_chunks: dict[str, tuple[str, int, bool]] = field(default_factory=dict)
    #: (request id, user, reason, prompt tokens it had left to compute) of
    #: each request whose prompt was first put off in this step for that
    #: reason (``PROMPT_DEFER_REASONS``: once per request and reason)
    prompt_deferred: list[tuple[str, str, str, int]] = field(default_factory=list)
    #: tokens and requests vLLM scheduled in this step (set only when an
    #: observer is registered): the step's make-up, for the step-time split
    scheduled_tokens: int = 0
    scheduled_requests: int = 0
    #: running requests left out because the active cap was full
    cap_deferred: int = 0
    #: ids of throttled requests (or borrowers, which go first) preempted in
    #: place of a request with budget: for KV blocks (``--scheduling-policy
    #: priority``), or for a resident slot (``residency``; also counted in
    #: ``preempted_for_slot``)
    preempted_throttled: list[str] = field(default_factory=list)
    #: of ``preempted_throttled``, those preempted for a resident slot
    preempted_for_slot: int = 0
    #: of ``throttled``, those held out of vLLM's loop for the whole step
    #: (the others were refused at the charge point)
    held_back: int = 0
    #: share of this schedule() call spent in the limiter's step-level code
    #: (ordering, settling; not the per-request charge hook); set only when
    #: an observer is registered
    limiter_share: float | None = None
    #: set by the scheduler when it settled net charges with the limiter
    #: (shared budgets); otherwise counted from ``charged`` when first read
    _charged_by_user: dict[str, int] | None = None

    @property
    def charged_by_user(self) -> dict[str, int]:
        """user -> tokens charged and kept in this step (net of refunds;
        users asked but not charged are absent). Counted when first read,
        so that the scheduler's thread does no per-user work for it: an
        observer reads it from its own thread, after the step."""
        by_user = self._charged_by_user
        if by_user is None:
            by_user = self._charged_by_user = dict(Counter(self.charged.values()))
        return by_user

    @charged_by_user.setter
    def charged_by_user(self, value: dict[str, int]) -> None:
        self._charged_by_user = value

    @property
    def prompt_tokens(self) -> dict[str, int]:
        """user -> prompt tokens computed in this step (every user, budgeted
        or not; counted when read, off the scheduler's thread)."""
        by_user: dict[str, int] = {}
        for user, n, _done in self.prompt_chunks.values():
            by_user[user] = by_user.get(user, 0) + n
        return by_user


@dataclass(slots=True)
class IdleWait:
    """One idle wait of the engine loop. Plain data."""

    #: the timeout asked for, in seconds
    planned_s: float
    #: the ready_at it waited for (monotonic ns), if any
    target_ns: int | None
    started_ns: int
    woke_ns: int
    #: "timeout", or the kind of message that woke it ("ADD", "ABORT", ...)
    reason: str

    @property
    def lateness_ns(self) -> int | None:
        """How late the loop woke relative to the ready time it waited for."""
        return None if self.target_ns is None else self.woke_ns - self.target_ns


@dataclass(frozen=True)
class LimitsStatus:
    """Where the limits in force come from, and how reloading went. Plain
    data, replaced whole (read by an observer's own thread at export)."""

    #: the limits file, or "command line"
    source: str
    #: SHA-256 (hex) of the limits file's content, or of the options' form
    digest: str
    #: when this configuration was loaded (Unix seconds)
    loaded_unix: float
    #: reload result -> count ("loaded", "unchanged", "invalid", "unreadable")
    results: Mapping[str, int]
    #: why the last look at the file failed, if it did (no secrets)
    last_error: str | None = None


@dataclass(frozen=True)
class LimitsChange:
    """New limits put in force at a step boundary. Plain data."""

    now_ns: int
    #: the previous and the new digest
    old_digest: str
    digest: str
    default_rate: Fraction
    old_default_rate: Fraction
    #: user -> limit, for every listed user now
    user_rates: Mapping[str, Fraction]
    added: tuple[str, ...]
    removed: tuple[str, ...]
    changed: tuple[str, ...]


class RequestFacts(NamedTuple):
    """What an observer may know of one live request (a tuple: made for
    every throttle episode that begins while spans are on, so it must be
    cheap)."""

    request_id: str
    user: str
    priority: int
    num_output_tokens: int
    #: the trace context headers the request came with (W3C ``traceparent``,
    #: ``tracestate``), if any: a plain dict of its own (a copy), from vLLM's
    #: ``trace_headers`` or carried by our API server
    trace_headers: dict[str, str] | None
    #: where the API server took the user from ("header", "api_key"), or
    #: None: the request body named it (not authenticated)
    identity_source: str | None = None
    #: who the request says it is (``user`` is whose budget it spends:
    #: ``__unlisted__`` for every unlisted id in "shared" mode)
    identity: str | None = None


class OutputLike(Protocol):
    """What an observer reads of one request's output in an update (vLLM's
    ``EngineCoreOutput``, a msgspec struct made by ``update_from_output``)."""

    request_id: str
    new_token_ids: list[int]
    #: None while the request runs; vLLM's ``FinishReason`` when it ended
    finish_reason: Any


class OutputsLike(Protocol):
    """One client's outputs of an update (vLLM's ``EngineCoreOutputs``)."""

    outputs: Sequence[OutputLike]


#: What ``update_from_output`` returns: client index -> its outputs.
EngineOutputs = dict[int, OutputsLike]


class EngineView(ABC):
    """Read-only access to the engine an observer watches. Implemented over
    vLLM's scheduler in ``internals.SchedulerView``; every read costs a dict
    lookup or two, so call it for requests that changed, not per token."""

    #: vLLM's ``model_name`` label (the first served model name)
    model_name: str
    #: vLLM's ``engine`` label (the data-parallel index)
    engine_index: str
    #: KV cache blocks of the engine (at least 1)
    num_kv_blocks: int
    #: ``--otlp-traces-endpoint``, if given
    otlp_traces_endpoint: str | None
    #: whether the scheduler runs a step ahead of the outputs (vLLM's
    #: ``AsyncScheduler``): a token is charged two updates before it shows
    async_scheduling: bool = False
    #: whether prompts are computed in chunks (vLLM's chunked prefill): a
    #: prompt budget then cuts a chunk, else it takes a prompt whole
    chunked_prefill: bool = True

    @abstractmethod
    def limits(self) -> OutputRateConfig:
        """The engine's limits: those in force, or those just loaded from
        the limits file (in force from the next step; an idle engine runs no
        step until a request comes). A whole value, never changed in place:
        ``limits().rate_of(user)`` is a user's limit (tokens per second)."""

    @abstractmethod
    def limits_status(self) -> LimitsStatus:
        """The limits' source, digest and reload counts (any thread)."""

    @abstractmethod
    def user_of(self, request_id: str) -> str | None:
        """The user of a live request; None once it is gone."""

    @abstractmethod
    def request_facts(self, request_id: str) -> RequestFacts | None:
        """Facts of a live request; None once it is gone."""

    def request_handle(self, request_id: str) -> Any:
        """An opaque handle of a live request (None once it is gone) that
        ``handle_user`` and ``handle_facts`` read later, from any thread,
        even after the request left the engine (an observer that defers its
        work takes one when the request is added). The default is the id."""
        return request_id

    def handle_user(self, handle: Any) -> str | None:
        """The user of a request by its handle (see ``request_handle``)."""
        return self.user_of(handle)

    def handle_facts(self, handle: Any) -> RequestFacts | None:
        """Facts of a request by its handle (see ``request_handle``)."""
        return self.request_facts(handle)

    @abstractmethod
    def num_output_tokens(self, request_id: str) -> int | None:
        """Output tokens of a live request so far; None once it is gone."""

    @abstractmethod
    def kv_blocks_held(self, request_id: str) -> int:
        """KV blocks the request holds now, over all KV cache groups."""

    @abstractmethod
    def has_running(self) -> bool:
        """Whether any request is running (resident) in the scheduler."""

    def requests_by_user(self) -> Mapping[str, tuple[int, int]]:
        """user -> (running, waiting) live requests. O(requests): call it
        once per export, on the scheduler's thread."""
        return {}

    def ready_at_ns(self, user: str) -> int:
        """When the user's budget next allows a token (monotonic ns; 0: now)."""
        return 0

    def prompt_ready_at_ns(self, user: str) -> int:
        """When the user's prompt budget next allows a prompt token
        (monotonic ns; 0: now, or no prompt budget). Any thread."""
        return 0

    def limiter_stats(self) -> dict[str, Any]:
        """The limiter's own counters (any thread, one reader): ``users``,
        the users with live state; in shared-budget mode also ``shared``,
        the lease machinery's (``leased``, ``spent``, ``expired``,
        ``unleased`` (tokens), ``calls``, ``failed_calls``, ``fallback`` (1
        in fallback), ``fallback_seconds``, ``fallback_episodes``,
        ``resets``, ``live_engines``, ``partitioned`` (1 in fallback cut
        off, the store keeping this engine's share), ``partitions``, and
        ``call_seconds``: the store calls' latencies since the last read)."""
        return {"users": 0}


class OutputRateObserver(ABC):
    """Receives what the limiter and the engine loop report. The ``on_*``
    methods run on the scheduler's thread, in the engine's hot path."""

    def on_request(self, request_id: str) -> None:
        """A request was added to the scheduler (once per request). The
        default does nothing."""

    @abstractmethod
    def on_step(self, step: StepReport) -> None:
        """After every ``schedule()``, with what the limiter did in it."""

    @abstractmethod
    def on_outputs(self, outputs: EngineOutputs) -> None:
        """After every ``update_from_output()``, with the engine outputs it
        returned (vLLM's ``EngineCoreOutputs`` per client: the serializable
        structs the front-end receives; an observer reads only what
        ``OutputsLike`` and ``OutputLike`` name)."""

    @abstractmethod
    def on_aborted(self, aborted: list[tuple[str, str]], now_ns: int) -> None:
        """Requests finished from outside the scheduler (client aborts), as
        (request id, user)."""

    @abstractmethod
    def on_idle_wait(self, wait: IdleWait) -> None:
        """After each idle wait of the engine loop."""

    @abstractmethod
    def close(self) -> None:
        """The scheduler shuts down: flush and stop (may block briefly)."""

    def on_limits(self, change: LimitsChange) -> None:
        """New limits are in force from this step on (a reloaded limits
        file). Rare; the default does nothing."""


class _FanOut(OutputRateObserver):
    """Several observers as one (the scheduler calls one object)."""

    def __init__(self, observers: list[OutputRateObserver]) -> None:
        self.observers = observers

    def on_request(self, request_id: str) -> None:
        for observer in self.observers:
            observer.on_request(request_id)

    def on_step(self, step: StepReport) -> None:
        for observer in self.observers:
            observer.on_step(step)

    def on_outputs(self, outputs: EngineOutputs) -> None:
        for observer in self.observers:
            observer.on_outputs(outputs)

    def on_aborted(self, aborted: list[tuple[str, str]], now_ns: int) -> None:
        for observer in self.observers:
            observer.on_aborted(aborted, now_ns)

    def on_idle_wait(self, wait: IdleWait) -> None:
        for observer in self.observers:
            observer.on_idle_wait(wait)

    def on_limits(self, change: LimitsChange) -> None:
        for observer in self.observers:
            observer.on_limits(change)

    def close(self) -> None:
        for observer in self.observers:
            observer.close()


#: An observer's factory: called once per scheduler; None means "not now"
#: (switched off, or could not start: it logs why).
ObserverFactory = Callable[[EngineView], "OutputRateObserver | None"]
#: Called in the process that turns the feature on (the API server, or the
#: ``LLM`` process), before the engine core starts, with the ``VllmConfig``.
PrepareHook = Callable[[Any], None]


@dataclass(frozen=True)
class _Registration:
    factory: ObserverFactory
    prepare: PrepareHook | None


_registry: dict[str, _Registration] = {}


def register_observer(name: str, factory: ObserverFactory,
                      prepare: PrepareHook | None = None) -> None:
    """Register (or replace) the observer called ``name``. Idempotent."""
    _registry[name] = _Registration(factory, prepare)


def prepare_observers(vllm_config: Any) -> None:
    """Run every registered ``prepare`` hook (the feature was just turned on
    in this process). A failing hook is logged; the limiter goes on."""
    for name, registration in list(_registry.items()):
        if registration.prepare is None:
            continue
        try:
            registration.prepare(vllm_config)
        except Exception:
            logger.exception("output-rate observer %r could not prepare; "
                             "the limiter runs without it", name)


def create_observer(view: EngineView) -> OutputRateObserver | None:
    """One object for the scheduler to call: None (nothing registered or
    nothing started), the single observer, or a fan-out of several."""
    made: list[OutputRateObserver] = []
    for name, registration in list(_registry.items()):
        try:
            observer = registration.factory(view)
        except Exception:
            logger.exception("output-rate observer %r could not start; "
                             "the limiter runs without it", name)
            continue
        if observer is not None:
            made.append(observer)
    if not made:
        return None
    return made[0] if len(made) == 1 else _FanOut(made)
