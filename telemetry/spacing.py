"""Token timing: the spacing of each request's tokens, per user label.

Fed by the worker's output fold (``telemetry.folds``) once per
``update_from_output``, written into the per-label ``inter_token_seconds``
histograms of ``telemetry.series``. Every output token becomes available
in the engine when ``update_from_output`` returns; tokens of one step
share that moment. The spacing of a request's tokens is observed per
request per step (a request with k tokens in a step adds one spacing and
k - 1 zeros), never per token event.

Most requests with a token now also had one at the previous update
(steady): their spacing is the same for all of them, so nothing is done
per steady request. Each update's spacing goes into one cumulative
histogram of steady updates, and each label's histogram takes its steady
requests' share (their count times what the cumulative gained) when that
count changes and at folds. Only requests that start, pause, resume after
a throttle, or finish take the per-request path, and a request joins the
steady counts only at its second token in a row: one that is throttled
again after one token (a user pacing at its limit) costs its resume
spacing and two dict updates, nothing per label. An update where just
that happens (every request back at the previous update pauses again,
every steady one goes on: users pacing at their limits) finds it out by
two set passes instead of four, and pops the resumed requests' last
tokens without first intersecting them with the paused ones.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable
from itertools import compress, repeat
from operator import is_not, sub
from typing import Any

from vllm_output_rate.telemetry.histograms import Histogram, observe_by_label
from vllm_output_rate.telemetry.labels import OTHER
from vllm_output_rate.telemetry.metrics import SPACING_BUCKETS
from vllm_output_rate.telemetry.records import TokenUpdate


class TokenSpacing:
    """Per-request token timing and the steady requests' counts per label."""

    #: whether an update of users pacing at their limits takes the short
    #: way (False: every update the general way; the tests compare them)
    pacing_shortcut = True

    def __init__(self, spacing_hist: Callable[[str], Histogram], label: Callable[[str], str],
                 user_of: Callable[[str], str | None]) -> None:
        #: label -> its spacing histogram (``Series.spacing_hist``); a
        #: user's label; a request's user (by its handle)
        self._spacing_hist = spacing_hist
        self._label = label
        self._user_of = user_of
        #: request id -> when its last token came, for requests that had
        #: none at the previous update (the others: ``_prev_now``)
        self.last_token_ns: dict[str, int] = {}
        #: request id -> the label of its first token (until labels change)
        self.request_label: dict[str, str] = {}
        #: request ids that had tokens at the previous update, and when
        self.prev_ids: set[str] = set()
        self._prev_now = 0
        #: those of them that had none at the update before (back after a
        #: throttle, or their first token): not yet counted in
        #: ``prev_by_label``, so a request of a user pacing at its limit
        #: (one token, then throttled again) never is
        self.joining: set[str] = set()
        #: label -> how many of ``prev_ids`` (less ``joining``) carry it
        self.prev_by_label: dict[str, int] = {}
        #: steady updates so far: how many, per spacing bucket, and their
        #: spacings' sum (ns); label -> those three when its histogram last
        #: took its steady share (labels with steady requests only)
        self._steady_n = 0
        self._steady_cum = [0] * (len(SPACING_BUCKETS) + 1)
        self._steady_ns = 0
        self._spacing_mark: dict[str, tuple[int, list[int], int]] = {}
        #: spacings of requests back after a pause, not yet in their
        #: histograms: (update ns, previous token ns of each, label of each)
        self.resume_runs: list[tuple[int, list[int], list[str | None]]] = []

    def update(self, cur: set[str], special: list[Any], now: int) -> TokenUpdate:
        """One update's timing (``cur``: the requests with a token,
        ``special``: the outputs finished or with more than one token,
        ``now``: when it returned), as the spans read it too."""
        labels = self.request_label
        prev_ids, prev_now = self.prev_ids, self._prev_now
        last = self.last_token_ns
        # Label counts of the requests that had a token at the last two
        # updates, kept up to date from the ones that pause, start and finish:
        # with those that join now, they are the steady requests' counts.
        joining = self.joining
        resumed = cur - prev_ids
        joined: Any = ()
        if (joining and self.pacing_shortcut
                and len(cur) - len(resumed) == len(prev_ids) - len(joining)
                and joining.isdisjoint(cur)):
            # Users pacing at their limits: every request that was back at
            # the previous update pauses again, every steady one goes on
            # (none of the first has a token, and as many of the others as
            # are steady have one): no run ends or begins, no label count
            # changes, and the ones pausing are ``joining`` itself.
            paused = joining
            left: Any = ()
            last.update(dict.fromkeys(paused, prev_now))
        else:
            paused = left = prev_ids - cur
            if paused:
                # had a token last time, none now
                last.update(dict.fromkeys(paused, prev_now))
                if joining:
                    left = paused - joining
                for req_id in left:
                    self._label_count(req_id, -1)
            if joining:
                joined = joining & cur
                for req_id in joined:  # a second token in a row: steady
                    self._label_count(req_id, 1)
        if self.prev_by_label:  # some request is steady
            gap = now - prev_now
            self._steady_cum[bisect.bisect_left(SPACING_BUCKETS, gap * 1e-9)] += 1
            self._steady_ns += gap
            self._steady_n += 1
        # Back after a pause (their last token's time is known): the resume
        # spacings go to the histograms at the next fold, with the labels
        # the requests have now (lists made in C). First tokens: a label.
        back: list[str] = []
        prevs: list[int] = []
        first: list[str] = []
        if resumed:
            if last:
                # (each one's last token, popped: None for a first token)
                had = len(last)
                prevs = list(map(last.pop, resumed, repeat(None)))
                if had - len(last) == len(resumed):
                    back = list(resumed)  # (the same order as ``prevs``)
                else:
                    back = list(compress(resumed, map(is_not, prevs, repeat(None))))
                    prevs = [p for p in prevs if p is not None]
                if back:
                    self.resume_runs.append((now, prevs, list(map(labels.get, back))))
            if len(back) < len(resumed):
                first = list(resumed.difference(back) if back else resumed)
                user_of, label = self._user_of, self._label
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
        self.prev_ids = cur - finished if finished else cur
        self.joining = resumed - finished if finished else resumed
        self._prev_now = now
        return TokenUpdate(now, paused, left, joined, back, prevs, first, zeros, ends, finished)

    def forget(self, req_ids: list[str]) -> None:
        """Requests finished from outside the scheduler (aborts)."""
        for req_id in req_ids:
            self.last_token_ns.pop(req_id, None)
            if req_id in self.prev_ids:
                if req_id in self.joining:
                    self.joining.discard(req_id)
                else:
                    self._label_count(req_id, -1)
                self.prev_ids.discard(req_id)
            self.request_label.pop(req_id, None)

    def _label_count(self, req_id: str, delta: int) -> None:
        """``req_id`` joins (1) or leaves (-1) the requests that had a token
        at the last update, in the per-label counts (the label's histogram
        first takes its steady share up to now)."""
        label = self.request_label.get(req_id) or OTHER
        by_label = self.prev_by_label
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

    def fold(self) -> None:
        """The resume spacings and every label's steady share into the
        histograms (the worker's full fold)."""
        resumes, self.resume_runs = self.resume_runs, []
        if resumes:
            labels: list[str | None] = []
            spacings: list[int] = []
            for now, prevs, labs in resumes:  # (per update; lists made in C)
                labels.extend(labs)
                spacings.extend(map(sub, repeat(now, len(prevs)), prevs))
            spacing_hist = self._spacing_hist
            observe_by_label(labels, spacings, lambda name: spacing_hist(name or OTHER))
        for label, k in self.prev_by_label.items():
            self._fold_spacing(label, k)

    def relabel(self) -> None:
        """Labels changed: requests take their user's label now (until
        the next change, they keep the label of their first token), and
        the steady counts follow."""
        user_of, labels, label = self._user_of, self.request_label, self._label
        for req_id in list(labels):
            user = user_of(req_id)
            if user is not None:
                labels[req_id] = label(user)
        self.prev_by_label = dict(Counter(labels.get(r) or OTHER
                                          for r in self.prev_ids - self.joining))
        self._spacing_mark = {name: self._steady_now() for name in self.prev_by_label}
