"""What the steps leave for the next fold: the charges, the skips and the
throttle episodes, kept as cheaply as a step allows.

Between the worker's step folds (``telemetry.folds``) and the per-user
series (``telemetry.series``): a step only appends references to its
report's own containers (run-length encoded when equal to the last one)
and moves a step count on; the fold (``ThrottleBook.take_*``) counts them
per user, in C and numpy, at exports, aborts, when the engine goes idle
and at close.

Skips are counted by throttle episode: a step whose throttled requests and
those dispatched inside an episode (``cur``) are exactly those with an
episode open (``every``: most steps) only moves ``full_steps`` on (and
keeps ``cur``, subtracted at the fold); an episode that ends, or a fold,
credits its request with the steps counted since it began (``bases``). The
other steps' throttled lists are counted request by request.
"""

from __future__ import annotations

from collections import Counter
from itertools import chain, filterfalse, repeat
from operator import sub
from collections.abc import Callable
from typing import Any, NamedTuple

from vllm_output_rate.telemetry.histograms import sums_by_key
from vllm_output_rate.telemetry.labels import OTHER
from vllm_output_rate.telemetry.records import Episodes, StepEpisodes


class EndedRun(NamedTuple):
    """Throttle episodes that ended together, not yet in their histograms."""

    episodes: Episodes
    #: the steps each was counted skipped in since the last fold
    credits: list[int]


class ThrottleBook:
    """Charges, skips and throttle episodes not yet in the counters."""

    def __init__(self) -> None:
        #: What each step charged (request -> user), kept as references to
        #: the step reports' own dicts, run-length encoded ([the step's
        #: dict, how many steps in a row had it]): no work per user or per
        #: request in a step.
        self._charge_runs: list[list[Any]] = []
        #: closed throttle episodes not yet in their histograms
        self.ended_runs: list[EndedRun] = []
        #: the steps whose throttled requests were exactly those with an
        #: episode open, so far; request id -> that count when its episode
        #: began or was last folded (the requests with an episode open, as
        #: the scheduler's thread keeps them); the count at the last fold
        self.full_steps = 0
        self.bases: dict[str, int] = {}
        self._bases_at = 0
        #: the throttled lists of the other steps, since the last fold
        self._skip_lists: list[list[str]] = []
        #: the requests dispatched with an episode open in the steps that
        #: ``full_steps`` counts (counted there, but not skipped), since
        #: the last fold
        self._inside_lists: list[list[str]] = []
        #: request id -> user, of the requests throttled since the last fold
        self.thr_users: dict[str, str] = {}

    def add_step(self, charged: dict[str, str], throttled: list[str], episodes: StepEpisodes,
                 user_of: Callable[[str], str | None]) -> None:
        """One step's charges (the step's own request -> user dict, or one
        more step of the last one when equal: a steady engine), its
        throttle ``episodes`` (those that ended in it, at the last step's
        dispatch, and those that began) and its skips."""
        if charged:
            runs = self._charge_runs
            if runs and runs[-1][0] == charged:
                runs[-1][1] += 1
            else:
                runs.append([charged, 1])
        if episodes.ended is not None:
            self.end_episodes(episodes.ended)
        bases, full = self.bases, self.full_steps
        opened = episodes.opened
        if opened:
            users = self.thr_users
            new = list(filterfalse(users.__contains__, opened))
            if new:
                for req_id in new:
                    users[req_id] = user_of(req_id) or OTHER
            bases.update(dict.fromkeys(opened, full))
        if episodes.every:
            self.full_steps = full + 1
            if episodes.inside:
                self._inside_lists.append(episodes.inside)
        elif throttled:
            self._skip_lists.append(throttled)

    def end_episodes(self, ended: Episodes) -> None:
        """Throttle episodes that ended: their durations and skips (the
        steps counted since each began) go in at the next fold."""
        full = self.full_steps
        req_ids = ended.req_ids
        credits = list(map(sub, repeat(full, len(req_ids)),
                           map(self.bases.pop, req_ids, repeat(full))))
        self.ended_runs.append(EndedRun(ended, credits))

    def pending(self) -> int:
        """Runs and lists kept for the next fold."""
        return (len(self._charge_runs) + len(self._skip_lists) + len(self.ended_runs)
                + len(self._inside_lists))

    def take_charged(self) -> Counter[str]:
        """Tokens charged per user since the last fold (the users of every
        charge of the steps seen once: counted in C; a run of equal steps:
        its step's counts times its length)."""
        runs, self._charge_runs = self._charge_runs, []
        charged: Counter[str] = Counter()
        if runs:
            charged.update(chain.from_iterable(by_id.values() for by_id, k in runs if k == 1))
            for by_id, k in runs:
                if k > 1:
                    for user, n in Counter(by_id.values()).items():
                        charged[user] += n * k
        return charged

    def take_skipped(self, gone: list[str] | None) -> Counter[str | None]:
        """Steps skipped per user since the last fold. ``gone``: requests
        that left the engine with an episode open (their episodes end
        here); given at export steps, after which only the users of
        requests with an episode open stay known."""
        users, bases, full = self.thr_users, self.bases, self.full_steps
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
            self.bases = dict.fromkeys(bases, full)
        self._bases_at = full
        if self.ended_runs:  # (per episode, in C and numpy: a user's credits summed)
            ended_users: list[str | None] = []
            ended_credits: list[int] = []
            for run in self.ended_runs:
                ended_users.extend(map(user_of, run.episodes.req_ids))
                ended_credits.extend(run.credits)
            skipped.update(sums_by_key(ended_users, ended_credits))
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
        if gone is not None and len(users) > len(self.bases):
            # only the requests in an open episode stay known
            self.thr_users = {r: users[r] for r in self.bases if r in users}
        return skipped

    def take_ended(self) -> list[EndedRun]:
        """The closed episodes since the last fold (for their histograms)."""
        ended, self.ended_runs = self.ended_runs, []
        return ended
