"""Bounded ``user`` label values for per-user metrics.

Pure logic: imports nothing from vLLM or Prometheus.

A per-user label on an engine that anyone can send requests to is a
cardinality bomb: a million distinct user ids would be a million series. The
``user`` label therefore takes at most ``len(pinned) + top_k + 1`` values:

* every *pinned* user (those with a configured limit) keeps its own label;
* the ``top_k`` most active other users (output tokens charged and prompt
  tokens computed, decayed per rebalance) get their own label;
* everybody else is ``__other__``.

While fewer than ``top_k`` unpinned users hold a label, a new user gets one
at its first observation (no wait for the next rebalance), so a small
deployment sees every user under its own name from its first token.

Activity of unlabelled users is tracked with the space-saving heavy-hitter
algorithm in at most ``4 * top_k`` entries, so memory stays bounded whatever
the number of distinct ids. What a label shows of a user is the policy of
``--output-rate-user-label`` (``vllm_output_rate.user_label``, given as
``public``): the id, its salted hash, or nothing (``off``: every user is
``__other__``, no per-user series at all). Label values are sanitized: control and other non-printable characters
become ``_`` and values are cut to ``max_len`` characters (a cut value gets a
short hash suffix so that two long ids do not merge silently).

The hot path is ``label(user)``: one dict lookup. ``observe()`` is meant to be
called once per user per step with that step's token count, and
``rebalance()`` off the hot path (at export time).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable

OTHER = "__other__"


def sanitize(user: str, max_len: int = 64) -> str:
    """A safe label value for ``user``: printable, at most ``max_len`` chars."""
    clean = user if user.isprintable() else "".join(
        c if c.isprintable() else "_" for c in user
    )
    if len(clean) > max_len:
        digest = hashlib.blake2s(user.encode("utf-8", "surrogatepass"), digest_size=4).hexdigest()
        clean = f"{clean[: max_len - 9]}~{digest}"
    return clean or "_"


class UserLabeler:
    """Maps user ids to a bounded set of label values."""

    def __init__(
        self,
        pinned: Iterable[str] = (),
        top_k: int = 100,
        max_len: int = 64,
        decay: float = 0.5,
        public: Callable[[str], str | None] | None = None,
    ) -> None:
        if top_k < 0:
            raise ValueError(f"top_k must not be negative, got {top_k}")
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"decay must be within [0, 1], got {decay}")
        self.top_k = top_k
        self.max_len = max_len
        self.decay = decay
        self.capacity = max(4 * top_k, 16)
        #: what may be shown of a user (None: nothing, it stays __other__)
        self.public = public
        #: the policy shows no one (``off``): asked once with a probe id
        self.off = public is not None and public("") is None
        self.pinned = self._values(pinned)
        #: user -> label value, for every user with a label of its own
        self._labels: dict[str, str] = dict(self.pinned)
        #: unpinned users -> decayed activity (space-saving counters)
        self._activity: dict[str, float] = {}
        #: unpinned users labelled by observe() since the last rebalance
        self._promoted: list[str] = []
        self._unpinned_labels = 0

    def value(self, user: str) -> str | None:
        """The label value ``user`` would have (None: none under the policy)."""
        shown = user if self.public is None else self.public(user)
        return None if shown is None else sanitize(shown, self.max_len)

    def _values(self, users: Iterable[str]) -> dict[str, str]:
        out = {}
        for user in users:
            value = self.value(user)
            if value is not None:
                out[user] = value
        return out

    def label(self, user: str) -> str:
        """The label value of ``user`` now: its own, or ``__other__``."""
        return self._labels.get(user, OTHER)

    def labelled_users(self) -> dict[str, str]:
        """user -> label value of every user with a label of its own."""
        return dict(self._labels)

    def set_pinned(self, users: Iterable[str]) -> list[str]:
        """Pin ``users`` instead (reloaded limits). Users no longer pinned
        keep their label as unpinned ones (``rebalance`` evicts the idle);
        an unpinned user whose label a newly pinned one needs loses it.
        Returns the users that lost their label."""
        new = self._values(users)
        lost = []
        wanted = {value: u for u, value in new.items()}
        for user, value in list(self._labels.items()):
            owner = wanted.get(value)
            if owner is not None and owner != user and user not in new:
                del self._labels[user]
                lost.append(user)
        self.pinned = new
        self._labels.update(new)
        for user in new:
            self._activity.pop(user, None)
        self._unpinned_labels = len(self._labels) - len(self.pinned)
        return lost

    def observe(self, user: str, tokens: float) -> None:
        """Count ``tokens`` of activity for ``user`` (bounded memory)."""
        if user in self.pinned or tokens <= 0 or self.off:
            return
        self.promote(user)
        activity = self._activity
        if user in activity:
            activity[user] += tokens
        elif len(activity) < self.capacity:
            activity[user] = tokens
        else:
            # space-saving: the new user takes over the smallest counter
            victim = min(activity, key=activity.__getitem__)
            floor = activity.pop(victim)
            activity[user] = floor + tokens

    def promote(self, user: str) -> str:
        """Give ``user`` a label at once when a top-K seat is free; returns
        its label now (its own, or ``__other__``)."""
        label = self._labels.get(user)
        if label is not None:
            return label
        if self._unpinned_labels < self.top_k and not self.off:
            value = self.value(user)
            if value is not None and value != OTHER and value not in self._labels.values():
                self._labels[user] = value
                self._unpinned_labels += 1
                self._promoted.append(user)
                return value
        return OTHER

    def rebalance(self) -> tuple[list[str], list[str]]:
        """Give the ``top_k`` most active unpinned users their own label.

        Returns ``(added, evicted)`` users, so that the exporter can remove
        the series of evicted users. Decays activity for the next round.
        """
        ranked = sorted(self._activity.items(), key=lambda kv: (-kv[1], kv[0]))
        top = {u for u, a in ranked[: self.top_k] if a > 0}
        current = {u for u in self._labels if u not in self.pinned}
        evicted = sorted(current - top)
        promoted = [u for u in self._promoted if u in top]
        self._promoted = []
        added = sorted(top - current)
        for user in evicted:
            del self._labels[user]
        taken = set(self._labels.values())
        for user in added:
            value = self.value(user)
            if value is None or value in taken or value == OTHER:
                # Two ids that sanitize alike (or spoof the overflow bucket)
                # must not share a series: keep the newcomer in __other__.
                continue
            self._labels[user] = value
            taken.add(value)
        self._unpinned_labels = len(self._labels) - len(self.pinned)
        added = sorted(set(added) | set(promoted))
        if self.decay < 1.0:
            for user in list(self._activity):
                value = self._activity[user] * self.decay
                if value < 1e-3:
                    del self._activity[user]
                else:
                    self._activity[user] = value
        return added, evicted
