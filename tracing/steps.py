"""Spans of the engine loop, each from one event and no books:
``output_rate.step`` (a step with refunds, or a sampled step that only
refused users), ``output_rate.idle_wait`` (an idle wait of the engine loop)
and ``output_rate.limits_reload`` (new limits in force).

On the data's path: the recorder (``recorder``) queues the event's plain
data on the scheduler's thread; the span builder's thread makes the span
here, on the emitter (``emit``).
"""

from __future__ import annotations

from itertools import filterfalse
from typing import Any

from vllm_output_rate import user_label
from vllm_output_rate.observers import IdleWait, StepReport
from vllm_output_rate.tracing.attributes import shown_id, shown_ids
from vllm_output_rate.tracing.emit import SpanEmitter

#: Users whose shown ids the step spans keep (beyond: worked out afresh).
SHOWN_CAP = 8192


class StepSpans:
    """Makes the step, idle-wait and limits-reload spans on ``emitter``;
    ``steps_per_span``: one refusal-only step in this many gets a span
    (the recorder samples them; the span says so)."""

    def __init__(self, emitter: SpanEmitter, steps_per_span: int) -> None:
        self.emitter = emitter
        self.steps_per_span = steps_per_span
        #: user -> its id as spans show it (None: not shown), under the
        #: label policy it was worked out with: a steady engine refuses the
        #: same users step after step (a hashed id is an HMAC each)
        self._shown: dict[str, str | None] = {}
        self._policy: Any = None

    def shown_refused(self, refused: list[str]) -> list[str]:
        """The refused users' ids as spans show them, sorted, the first 32."""
        policy = user_label.current()
        shown = self._shown
        if policy is not self._policy or len(shown) > SHOWN_CAP:
            self._policy = policy
            shown = self._shown = {}
        new = list(filterfalse(shown.__contains__, refused))
        if new:
            shown.update(zip(new, map(policy.public_id, new)))
        return sorted([s for s in map(shown.__getitem__, refused) if s is not None])[:32]

    def build_step(self, record: StepReport) -> None:
        """A step (its report): charged / refunded counts and one event per
        refund with its reason."""
        emitter = self.emitter
        now, refunded = record.now_ns, record.refunded
        attributes = {
            "output_rate.step": record.step,
            "output_rate.charged": len(record.charged),
            "output_rate.refunded": len(refunded),
            "output_rate.throttled": len(record.throttled),
            "output_rate.refused_users": self.shown_refused(list(record.refused)),
            "output_rate.refusal_steps_per_span": 1 if refunded else self.steps_per_span,
        }
        span = emitter.tracer.start_span("output_rate.step", start_time=now + emitter.offset,
                                         attributes=attributes)
        for req_id, user, reason in refunded:
            event = {"output_rate.request_id": req_id, "output_rate.reason": reason}
            shown = shown_id(user)
            if shown is not None:
                event["output_rate.user"] = shown
            span.add_event("refund", attributes=event)
        span.end(end_time=now + emitter.offset)

    def build_idle_wait(self, wait: IdleWait) -> None:
        """An idle wait: planned timeout, ready time waited for, lateness,
        what woke it."""
        attributes = {
            "output_rate.planned_timeout_s": wait.planned_s,
            "output_rate.reason": wait.reason,
        }
        if wait.target_ns is not None:
            attributes["output_rate.ready_at_unix_ns"] = wait.target_ns + self.emitter.offset
            attributes["output_rate.lateness_ns"] = wait.lateness_ns
        self.emitter.span("output_rate.idle_wait", wait.started_ns, wait.woke_ns, attributes)

    def build_limits(self, change: Any) -> None:
        """New limits in force (``observers.LimitsChange``), at the step
        boundary where they took effect."""
        cap = 64  # user ids listed in the span (the counts are exact)
        self.emitter.span("output_rate.limits_reload", change.now_ns, change.now_ns, {
            "output_rate.limits.sha256": change.digest,
            "output_rate.limits.previous_sha256": change.old_digest,
            "output_rate.limits.default_tokens_per_second": float(change.default_rate),
            "output_rate.limits.previous_default_tokens_per_second":
                float(change.old_default_rate),
            "output_rate.limits.users": len(change.user_rates),
            "output_rate.limits.users_added": len(change.added),
            "output_rate.limits.users_removed": len(change.removed),
            "output_rate.limits.users_changed": len(change.changed),
            "output_rate.limits.added": shown_ids(change.added[:cap]),
            "output_rate.limits.removed": shown_ids(change.removed[:cap]),
            "output_rate.limits.changed": shown_ids(change.changed[:cap]),
        })
