"""The engine event log: its format, the encoder the engine core writes it
with, and the reader the verifier parses it with, side by side.

The engine core writes the log when ``OUTPUT_RATE_EVENTS`` names a file
(``telemetry.eventlog``: records are queued by the telemetry's worker as plain
tuples, encoded and appended by the exporter thread about once a second).
One JSON object per line, keys in this order; ``t_ns`` is the engine core's
monotonic clock in nanoseconds:

``start``, once, before the engine's first other line::

    {"kind": "start", "t_ns": int, "unix_ns": int (wall clock at t_ns),
     "engine": str, "limits": {user: tok/s}, "default_limit": tok/s,
     "async_scheduling": bool (the scheduler runs a step ahead of the
     outputs: a token shows two updates after its charge, not one),
     and with prompt budgets (a ``prompt_rate`` somewhere):
     "prompt_limits": {listed user: prompt tok/s, or null: not budgeted},
     "default_prompt_limit": prompt tok/s or null, "chunked_prefill": bool}

``prompt``, one per engine step that computed prompt tokens, stamped with
the step's dispatch (when the prompt budget charged them)::

    {"kind": "prompt", "t_ns": int, "tokens": {user: prompt tokens computed}}

``tokens``, one per engine step that produced output tokens, stamped when
the step's output was processed (tokens of one step share that moment)::

    {"kind": "tokens", "t_ns": int,
     "tokens": [[engine request id, user, tokens in this step], ...]}

``queued``, one per request, stamped when the scheduler received it from
the front end (vLLM's QUEUED moment: after the API server's own work, so a
request's first token less this is the engine's time to first token)::

    {"kind": "queued", "t_ns": int, "request_id": str, "user": str}

``finished``, one per request (``reason``: vLLM's finish reason, "abort"
for a request aborted from outside the scheduler)::

    {"kind": "finished", "t_ns": int, "request_id": str, "user": str,
     "reason": str, "output_tokens": int}

``throttled``, at the first step after each export (about once a second)
while requests are throttled and at the first such step with none, and an
all-empty line (share 0.0) when the engine goes idle::

    {"kind": "throttled", "t_ns": int, "requests": {user: n},
     "kv_blocks": {user: blocks held}, "kv_share": float}

``limits``, when reloaded limits were put in force (at that step boundary)::

    {"kind": "limits", "t_ns": int, "unix_ns": int, "limits": {user: tok/s},
     "default_limit": tok/s, "sha256": str, "added": [user], "removed": [user],
     "changed": [user]}

A reader may meet a half-written last line (the writer appends while it
reads); ``EngineLog`` skips it without counting it as bad.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

# --------------------------------------------------------------------------- writing


def encode_event(event: tuple, engine: str) -> str:
    """One queued record as its line of the log (with the newline).

    ``event``: ``("tokens", t_ns, [(request id, user, n), ...])``,
    ``("queued", t_ns, request id, user)``,
    ``("finished", t_ns, request id, user, reason, output tokens)``,
    ``("prompt", t_ns, {user: prompt tokens})``,
    ``("throttled", t_ns, {user: requests}, {user: kv blocks}, kv share)`` or
    ``("start", t_ns, unix_ns, {user: limit}, default limit, async scheduling,
    prompt budgets or None)`` or
    ``("limits", t_ns, unix_ns, {user: limit}, default limit, sha256, added,
    removed, changed)``; ``engine``:
    the engine's index, written in the start line."""
    kind, t_ns = event[0], event[1]
    if kind == "tokens":
        data: dict[str, Any] = {"kind": kind, "t_ns": t_ns, "tokens": event[2]}
    elif kind == "queued":
        data = {"kind": kind, "t_ns": t_ns, "request_id": event[2], "user": event[3]}
    elif kind == "finished":
        data = {"kind": kind, "t_ns": t_ns, "request_id": event[2], "user": event[3],
                "reason": event[4], "output_tokens": event[5]}
    elif kind == "throttled":
        data = {"kind": kind, "t_ns": t_ns, "requests": event[2], "kv_blocks": event[3],
                "kv_share": event[4]}
    elif kind == "limits":
        data = {"kind": kind, "t_ns": t_ns, "unix_ns": event[2], "limits": event[3],
                "default_limit": event[4], "sha256": event[5], "added": event[6],
                "removed": event[7], "changed": event[8]}
    elif kind == "prompt":
        data = {"kind": kind, "t_ns": t_ns, "tokens": event[2]}
    else:  # start
        data = {"kind": kind, "t_ns": t_ns, "unix_ns": event[2], "engine": engine,
                "limits": event[3], "default_limit": event[4], "async_scheduling": event[5]}
        prompts = event[6] if len(event) > 6 else None
        if prompts is not None:
            data.update(prompt_limits=prompts["limits"], default_prompt_limit=prompts["default"],
                        chunked_prefill=prompts["chunked_prefill"])
    return json.dumps(data) + "\n"


# --------------------------------------------------------------------------- reading


@dataclass
class EngineLog:
    """The engine's event log, parsed. Times are engine-core monotonic ns;
    ``starts``, ``finished`` and ``throttled`` keep each line's dict as read."""

    starts: list[dict[str, Any]] = field(default_factory=list)
    #: (t_ns, [(engine request id, user, n tokens)]) per engine step, in order
    steps: list[tuple[int, list[tuple[str, str, int]]]] = field(default_factory=list)
    #: (t_ns, {user: prompt tokens computed}) per engine step that computed some
    prompts: list[tuple[int, dict[str, int]]] = field(default_factory=list)
    #: request id -> (t_ns, user) when the scheduler received it
    queued: dict[str, tuple[int, str]] = field(default_factory=dict)
    finished: dict[str, dict[str, Any]] = field(default_factory=dict)
    throttled: list[dict[str, Any]] = field(default_factory=list)
    #: limit changes in force from ``t_ns`` on, in order
    limit_changes: list[dict[str, Any]] = field(default_factory=list)
    #: line numbers that were not valid events (a half-written last line is not counted)
    bad_lines: list[int] = field(default_factory=list)
    #: the steps' times, once asked for (``dispatch_lower_bounds``)
    _stamps: list[int] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def from_lines(cls, lines: Iterable[str]) -> EngineLog:
        log = cls()
        lines = list(lines)
        for i, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                ev = json.loads(line)
                kind = ev["kind"]
                if kind == "tokens":
                    log.steps.append((int(ev["t_ns"]),
                                      [(str(r), str(u), int(n)) for r, u, n in ev["tokens"]]))
                elif kind == "prompt":
                    log.prompts.append((int(ev["t_ns"]),
                                        {str(u): int(n) for u, n in ev["tokens"].items()}))
                elif kind == "queued":
                    log.queued[str(ev["request_id"])] = (int(ev["t_ns"]), str(ev["user"]))
                elif kind == "finished":
                    log.finished[str(ev["request_id"])] = ev
                elif kind == "throttled":
                    int(ev["t_ns"])
                    log.throttled.append(ev)
                elif kind == "limits":
                    int(ev["t_ns"])
                    dict(ev["limits"])
                    log.limit_changes.append(ev)
                elif kind == "start":
                    int(ev["t_ns"])
                    log.starts.append(ev)
            except (ValueError, KeyError, TypeError):
                if i != len(lines):  # the writer may be half-way through the last line
                    log.bad_lines.append(i)
        log.steps.sort(key=lambda s: s[0])
        log.prompts.sort(key=lambda s: s[0])
        log.throttled.sort(key=lambda e: e["t_ns"])
        log.limit_changes.sort(key=lambda e: e["t_ns"])
        return log

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> EngineLog:
        with open(path, errors="replace") as f:
            return cls.from_lines(f.read().split("\n"))

    def user_spends(self, user: str, since_ns: int = 0) -> list[tuple[int, int]]:
        """(t_ns, tokens) of ``user``'s steps from ``since_ns`` on, in time
        order: the tokens of one step summed."""
        return [(t, n) for t, tokens in self.steps if t >= since_ns
                for n in [sum(k for _, u, k in tokens if u == user)] if n]

    def user_prompt_spends(self, user: str, since_ns: int = 0,
                           until_ns: int | None = None) -> list[tuple[int, int]]:
        """(t_ns, prompt tokens) of ``user``'s steps that computed some of
        its prompts, from ``since_ns`` to ``until_ns``, in time order."""
        return [(t, by_user[user]) for t, by_user in self.prompts
                if t >= since_ns and (until_ns is None or t <= until_ns) and by_user.get(user)]

    def all_user_spends(self, since_ns: int = 0) -> dict[str, list[tuple[int, int]]]:
        """``user_spends`` of every user, in one pass over the log."""
        out: dict[str, list[tuple[int, int]]] = {}
        for t, tokens in self.steps:
            if t < since_ns:
                continue
            step: dict[str, int] = {}
            for _, user, k in tokens:
                step[user] = step.get(user, 0) + k
            for user, n in step.items():
                if n:
                    out.setdefault(user, []).append((t, n))
        return out

    def first_tokens(self, since_ns: int = 0) -> dict[str, int]:
        """request id -> the time of its first token (from ``since_ns`` on)."""
        out: dict[str, int] = {}
        for t, tokens in self.steps:
            if t >= since_ns:
                for req_id, _, k in tokens:
                    if k and req_id not in out:
                        out[req_id] = t
        return out

    def engine_ttfts_ns(self, user: str, since_ns: int = 0) -> dict[str, int]:
        """request id -> its engine-side time to first token (queued at the
        scheduler to the step that sampled its first token), for ``user``'s
        requests queued from ``since_ns`` on that have a first token."""
        firsts = self.first_tokens(since_ns)
        return {r: firsts[r] - t for r, (t, u) in self.queued.items()
                if u == user and t >= since_ns and r in firsts}

    def dispatch_lower_bounds(self, times: Iterable[int], lag: int = 1) -> list[int]:
        """Per output time in ``times``, the earliest moment its step can
        have been dispatched: the engine's output ``lag`` steps before (a
        synchronously scheduling engine dispatches a step after the previous
        step's output was processed; async scheduling runs one step ahead,
        ``lag=2``). The limiter charges at dispatch, the log stamps when the
        output is processed: ``lag`` steps of slack, as ``verify`` allows."""
        import bisect

        stamps = self._stamps
        if stamps is None or len(stamps) != len(self.steps):
            stamps = self._stamps = [t for t, _ in self.steps]
        out = []
        for t in times:
            i = bisect.bisect_left(stamps, t) - lag
            out.append(stamps[i] if i >= 0 else -(1 << 62))
        return out


def fleet_spends(logs: Iterable[EngineLog], user: str, since_ns: int = 0) -> list[tuple[int, int]]:
    """(t_ns, tokens) of ``user`` over several engines' logs on one machine
    (their monotonic clocks are the same clock), in time order."""
    return sorted(s for log in logs for s in log.user_spends(user, since_ns))
