"""Each request's spacing series: the engine-side gaps between its tokens,
kept per ``update_from_output`` for its generation span.

First of the span builder's books on the data's path: the recorder
(``recorder``) replays each update here (``SpacingSeries.update``, on the
span builder's thread); the throttle books (``throttle``) read a request's
token count from it, and when the request ends its series goes into its
generation span (``generation``).

Steady requests (a token now and at the previous update) cost nothing per
request: every update appends its spacing to one timeline (``_gaps``), and
a request holds an open *run* (the update it became steady from). A run's
spacings are copied out of the timeline as one slice when the request
pauses, takes several tokens in one update, finishes, or every
``TRIM_EVERY`` updates when it passes the cap.
"""

from __future__ import annotations

from array import array
from collections import deque
from itertools import repeat
from operator import floordiv, sub
from typing import Any

from vllm_output_rate.telemetry.records import TokenUpdate
from vllm_output_rate.tracing.attributes import spacing_us

MAX_SERIES = 2048
#: Steady runs are not checked against the cap per update; every this many
#: updates (and at finish) longer series are cut back to ``MAX_SERIES``, the
#: rest counted, and the timeline is cut to the oldest open run.
TRIM_EVERY = 256


def series_attribute(spacings_us: array) -> list[int]:
    """The spacing series as the span attribute holds it: a list of whole
    microseconds, at most ``MAX_SERIES``."""
    return spacings_us[:MAX_SERIES].tolist()


def series_truncated(spacings_us: array) -> bool:
    """Whether the series reached the cap (the attribute may lack some)."""
    return len(spacings_us) >= MAX_SERIES


class SpacingSeries:
    """The spacing series of the requests with tokens, until they end."""

    def __init__(self) -> None:
        #: request id -> its spacings (whole us) copied out so far
        self._series: dict[str, array] = {}
        #: request id -> spacings past MAX_SERIES (counted, not kept)
        self._overflow: dict[str, int] = {}
        #: request id -> the update its open run of steady tokens began at
        self._runs: dict[str, int] = {}
        #: the timeline: spacing (us) of each update from the one before,
        #: for the updates from the oldest open run on; ``_index`` numbers
        #: the last update
        self._gaps = array("I")
        self._index = -1
        self._last_ns: int | None = None

    def on_update(self, now_ns: int) -> None:
        """An ``update_from_output`` at ``now_ns`` (before its requests)."""
        if self._last_ns is not None:
            self._gaps.append(spacing_us(now_ns - self._last_ns))
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
        # (a run begun at the update before a cut with none open starts
        # one before the timeline: nothing to cut then)
        del self._gaps[:max(oldest - base, 0)]

    def on_paused(self, req_ids: Any) -> None:
        """``req_ids`` had a token at the previous update and none now."""
        end = self._index - 1
        for req_id in req_ids:
            self._close_run(req_id, end)

    def on_tokens(self, req_id: str, n: int, prev_ns: int | None, now_ns: int) -> None:
        """``n`` tokens of ``req_id`` became available at ``now_ns``; its
        previous token at ``prev_ns`` (None: these are its first). Called by
        the recorder for the requests that had no token at the
        previous update; from here on the request is steady (a run)."""
        s = self._series.get(req_id)
        if s is None:
            s = self._series[req_id] = array("I")
        if prev_ns is not None:
            s.append(spacing_us(now_ns - prev_ns))
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

    def spacings(self, req_id: str) -> int:
        """Spacings recorded for ``req_id`` so far (kept, cut and in its run)."""
        start = self._runs.get(req_id)
        return (len(self._series[req_id]) + self._overflow.get(req_id, 0)
                + (self._index - start if start is not None else 0))

    def tokens_so_far(self, req_id: str) -> int:
        """``req_id``'s tokens so far by its series (0: none yet)."""
        if req_id not in self._series:
            return 0
        return self.spacings(req_id) + 1

    def update(self, timing: TokenUpdate) -> None:
        """One ``update_from_output`` replayed, its token timing as the
        metrics worked it out (``telemetry.records.TokenUpdate``): which
        runs end (``left``) and begin (``joined``) is theirs too."""
        now, back, prevs = timing.now, timing.back, timing.prevs
        self.on_update(now)
        # Requests back after a pause (or with their first token) at the
        # previous update begin a run from there only if they did not pause
        # again (a user pacing at its limit: one token, then throttled):
        # until then they have no run, and pausing again costs nothing.
        if timing.left:
            self.on_paused(timing.left)
        if timing.joined:
            self._runs.update(dict.fromkeys(timing.joined, self._index - 1))
        series = self._series
        if back:  # (in C: requests back after a pause)
            if not all(map(series.__contains__, back)):
                # (they had a first token: never, unless cut short)
                series.update({req_id: array("I") for req_id in back if req_id not in series})
            # each one's spacing (whole us within uint32, as spacing_us)
            # onto its series; cut to the cap every TRIM_EVERY updates
            gaps = map(min, map(floordiv, map(sub, repeat(now, len(prevs)), prevs), repeat(1000)),
                       repeat(0xFFFFFFFF))
            deque(map(array.append, map(series.__getitem__, back), gaps), maxlen=0)
        for req_id in timing.first:
            s = series.get(req_id)
            if s is None:
                series[req_id] = array("I")
            elif len(s) > MAX_SERIES + TRIM_EVERY:
                self._trim(req_id)
        for req_id, k in timing.zeros:
            self.on_zeros(req_id, k)

    def close(self, req_id: str) -> tuple[array, int]:
        """``req_id`` ended: its series (cut to the cap) and its token count;
        it is forgotten here."""
        had_tokens = req_id in self._series
        if had_tokens:
            self._close_run(req_id, self._index)
        self._trim(req_id)
        s = self._series.pop(req_id, array("I"))
        tokens = len(s) + 1 + self._overflow.pop(req_id, 0) if had_tokens else 0
        return s, tokens
