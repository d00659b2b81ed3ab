"""The opt-in engine event log, as the engine core keeps it.

On the data's path beside the per-user books: the worker's folds
(``telemetry.folds``) queue plain tuples here (tokens per step, finished
requests, throttled requests at export steps, limit changes), bounded by
``EVENTS_QUEUE_CAP``; the exporter thread encodes them
(``telemetry.events``, which also documents the format) and appends them
to the log about once a second. A failing write or a full queue is
counted in ``telemetry_dropped_total``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from vllm_output_rate.observers import EngineView, LimitsChange
from vllm_output_rate.telemetry.clock import SYSTEM, Clock
from vllm_output_rate.telemetry.events import encode_event
from vllm_output_rate.telemetry.metrics import TELEMETRY_DROPPED

#: Event records queued between two exports before new ones are dropped.
EVENTS_QUEUE_CAP = 500_000


class EventLog:
    """The records queued for the event log, and their writer."""

    def __init__(self, path: str, view: EngineView, counters: dict,
                 user_of: Callable[[str], str | None], clock: Clock = SYSTEM) -> None:
        self.path = path
        self._clock = clock
        self.view = view
        self._counters = counters
        self._user_of = user_of
        self._queue: deque[tuple] = deque()
        #: request id -> [user, tokens so far]
        self.tokens: dict[str, list] = {}
        self._started = False
        #: the last throttled line queued was all zero
        self._idle = False
        #: an all-zero line was queued since the engine last ran a step
        self._idle_written = False
        #: consecutive exports that found the engine with nothing running
        self._idle_exports = 0

    def queue(self, event: tuple) -> None:
        events = self._queue
        if len(events) >= EVENTS_QUEUE_CAP:
            self._counters[TELEMETRY_DROPPED.key("events_queue_full")] += 1
        else:
            events.append(event)

    def outputs(self, outputs: dict[int, Any], now: int) -> None:
        """The records of one update: its tokens and finished requests."""
        step_tokens: list[tuple[str, str, int]] = []
        step_finished: list[tuple] = []
        for eco in outputs.values():
            for out in eco.outputs:
                self._output(step_tokens, step_finished, out, len(out.new_token_ids), now)
        if step_tokens:
            self.queue(("tokens", now, step_tokens))
        for event in step_finished:
            self.queue(event)

    def _output(self, step_tokens: list[tuple[str, str, int]],
                step_finished: list[tuple], out: Any, n: int, now: int) -> None:
        """The event log's view of one request's output."""
        req_id = out.request_id
        seen = self.tokens.get(req_id)
        if seen is None:
            user = self._user_of(req_id) or "__unknown__"
            seen = self.tokens[req_id] = [user, 0]
        if n:
            step_tokens.append((req_id, seen[0], n))
            seen[1] += n
        if out.finish_reason is not None:
            del self.tokens[req_id]
            step_finished.append(("finished", now, req_id, seen[0], str(out.finish_reason), seen[1]))

    def aborted(self, aborted: list[tuple[str, str]], now: int) -> None:
        """Requests finished from outside the scheduler."""
        for req_id, user in aborted:
            seen = self.tokens.pop(req_id, None)
            self.queue(("finished", now, req_id, user, "abort", seen[1] if seen else 0))

    def throttled(self, by_user: dict[str, list[int]], share: float) -> None:
        """At an export step: the throttled requests and KV blocks per user
        (once more with none, then quiet while none are)."""
        self._idle_written = False  # a step ran: the engine is busy
        if by_user or not self._idle:
            self._idle = not by_user
            self.queue(("throttled", self._clock.monotonic_ns(), {u: c[0] for u, c in by_user.items()},
                        {u: c[1] for u, c in by_user.items()}, share))

    def prompt(self, now: int, by_user: dict[str, int]) -> None:
        """One step's prompt tokens computed per user (the worker)."""
        self.queue(("prompt", now, by_user))

    def limits(self, change: LimitsChange) -> None:
        self.queue(("limits", change.now_ns, self._clock.time_ns(), {
            u: float(r) for u, r in change.user_rates.items()}, float(change.default_rate),
            change.digest, list(change.added), list(change.removed), list(change.changed)))

    def write(self, log_drop: Callable[[str, BaseException], None]) -> None:
        """Append the queued records to the event log (exporter thread); a
        failure is counted, and ``log_drop`` logs it (once)."""
        events = self._queue
        if not self._started:
            self._started = True
            view = self.view
            limits = view.limits()
            events.appendleft(("start", self._clock.monotonic_ns(), self._clock.time_ns(), {
                user: float(rate) for user, rate in limits.user_rates.items()
            }, float(limits.default_rate), bool(view.async_scheduling), prompt_limits(view)))
        self._idle_exports = 0 if self.view.has_running() else self._idle_exports + 1
        if self._idle_exports >= 2 and not self._idle_written:
            # The engine went idle: nothing throttled, stated once, after the
            # last step's events whatever the last export-due step said. Idle
            # at two exports in a row: the last step's outputs (queued after
            # `running` empties) are surely in the queue by then.
            self._idle = self._idle_written = True
            events.append(("throttled", self._clock.monotonic_ns(), {}, {}, 0.0))
        lines = []
        while events:
            lines.append(encode_event(events.popleft(), self.view.engine_index))
        if not lines:
            return
        try:
            with open(self.path, "a") as f:
                f.write("".join(lines))
        except Exception as exc:
            self._counters[TELEMETRY_DROPPED.key("events_write_failed")] += len(lines)
            log_drop(f"event log {self.path}", exc)


def prompt_limits(view: EngineView) -> dict[str, Any] | None:
    """The start line's prompt budgets (None: none): each listed user's
    (prompt tokens per second, None: not budgeted), the default's, and
    whether prompts are computed in chunks (the bound ``verify`` checks)."""
    limits = view.limits()
    if not limits.prompt_budgets:
        return None
    rate_of = limits.prompt_rate_of

    def value(rate: Any) -> float | None:
        return None if rate is None else float(rate)

    default = limits.default_prompt_rate
    return {"limits": {user: value(rate_of(user)) for user in limits.user_rates},
            "default": value(None if isinstance(default, str) else default),
            "chunked_prefill": bool(view.chunked_prefill)}
