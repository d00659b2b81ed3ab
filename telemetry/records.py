"""The records the telemetry's stages hand each other along the data's path.

- ``Episodes``: throttle episodes that ended together, worked out once by
  the intake (``telemetry.intake``, the scheduler's thread) at a step, at a
  request's finish or at an abort; the metric folds (``telemetry.throttle``,
  ``telemetry.series``) and the span builder (``tracing.throttle``) read the
  same record, durations and users included;
- ``StepEpisodes``: what the intake worked out of one step's episodes, for
  the worker's step fold (``telemetry.folds``);
- ``TokenUpdate``: one update's token timing, worked out once by the
  metrics' token spacing (``telemetry.spacing``) and read by the spans'
  spacing series and generation spans (``tracing.series``,
  ``tracing.generation``);
- ``EngineReads``: the reads of the engine that only the scheduler's thread
  may make, at export steps and when the engine goes idle.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import repeat
from operator import sub
from typing import Any, NamedTuple


@dataclass(slots=True, eq=False)
class Episodes:
    """Throttle episodes of ``req_ids`` (begun at ``starts``) that ended at
    ``end_ns``: the dispatch after which the request was not throttled
    again, the request's finish inside one, or its abort."""

    end_ns: int
    req_ids: list[str]
    starts: list[int]
    #: request id -> user, holding at least these requests (the charges of
    #: the step they were last dispatched in, or the aborted requests)
    users: Mapping[str, str]
    #: request id -> (KV blocks, facts) for the spans: at a dispatch, of the
    #: episodes long enough for one (read when each began, or now); at an
    #: abort, those kept when each began (None: spans off, or none)
    held: dict[str, tuple[int, Any]] | None = None
    _took: list[int] | None = field(default=None, repr=False)
    _user_list: list[str | None] | None = field(default=None, repr=False)

    def took(self) -> list[int]:
        """Each episode's duration (ns), worked out once for the metrics
        and the spans (in C)."""
        took = self._took
        if took is None:
            took = self._took = list(map(sub, repeat(self.end_ns, len(self.starts)),
                                         self.starts))
        return took

    def user_list(self) -> list[str | None]:
        """Each episode's user (None: not known), worked out once (in C)."""
        users = self._user_list
        if users is None:
            users = self._user_list = list(map(self.users.get, self.req_ids))
        return users


class StepEpisodes(NamedTuple):
    """One step's throttle episodes, as the intake worked them out."""

    #: the episodes that ended in this step (at the last step's dispatch), or None
    ended: Episodes | None
    #: requests whose episode began in this step
    opened: Any
    #: requests dispatched in this step with an episode open (it ends next
    #: step unless they are throttled again then)
    inside: Any
    #: the step's throttled requests and ``inside`` are exactly those with
    #: an episode open (the worker counts skips by episode then)
    every: bool


class TokenUpdate(NamedTuple):
    """One ``update_from_output``'s token timing (``TokenSpacing.update``)."""

    #: when the update returned (ns)
    now: int
    #: requests that had a token at the previous update and none now
    paused: Any
    #: of those, the ones that had one at the update before too (steady
    #: until now: their run of steady tokens ends)
    left: Any
    #: requests back (or with their first token) at the previous update
    #: with a token now too: steady from the previous update on
    joined: Any
    #: requests back after a pause, and when each one's last token came
    back: list[str]
    prevs: list[int]
    #: requests with their first tokens
    first: list[str]
    #: (request, extra tokens in this update beyond its first)
    zeros: list[tuple[str, int]]
    #: (request, finish reason) of those that finished, and their ids
    ends: list[tuple[str, str]]
    finished: set[str] | None


class EngineReads(NamedTuple):
    """What the gauges and user states need from the engine, read on the
    scheduler's thread."""

    #: the KV blocks of each throttled request, in the step's order
    blocks: list[int]
    #: user -> (running, waiting) requests, of the users with live requests
    requests: Any
    #: user -> when its budget is next ready (ns), of those users
    ready_at: dict[str, int]
    #: requests gone from the engine with an episode open (closed here)
    gone: list[str]
