"""The throttled requests a step held back, kept for the next step: while
none of their users has budget, the next step takes them as they are.

A step holds its throttled tail out of ``running`` while vLLM schedules
(``core._orl_hold_back``) and puts it back at the end of ``running``
after. In the next step the same requests sit at the tail of ``running``
(vLLM appends what it admits before they are put back, and removes what
finishes or is preempted); when they are still all there, in the same
order, the step began right after, and none of their users has budget yet
(the earliest of their users' ready times is still ahead: no token was
charged to those users since, so their ready times are those worked out
when the last step ended), the step's plans come out the same for them as
last time: each of their users has no budget (``left`` is 0 before its
ready time), so every request of theirs is throttled again, in the same
order (the rotation sorts a user's streams by the time each was last
served, which for these has not changed), and each is refused and held
back again, none of them newly throttled. So the step reads them as one
list (a comparison of pointers in C), not request by request: their
users' streams and budgets are taken from the last step, the running
order is planned over the other requests only (``front``), and the marks
of a throttled request (its id in the step's report, its user refused
with the ready time known) are copied as lists; the step that last
throttled each one is written on the requests only when the run of such
steps ends (``release``).

Only where nothing else can change a held user's budget between steps:
the plain limiter charged directly (``charges.DirectCharges``), without
borrowing, prompt budgets or the PRIORITY policy; and only while no user
has requests both held and among the others (such a user's requests are
planned with the others). Anything else (a request of theirs finished,
aborted or preempted, limits reloaded, the KV cache short of room for the
step, a step in between without a held tail) takes the full path.

Pure logic: imports nothing from vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm_output_rate.ordering import streams_by_user

Request = Any


@dataclass(slots=True, eq=False)
class HeldTail:
    """The requests the last step held back, as the next step may take them."""

    #: the requests held back (in ``running``'s order: its tail since) and
    #: the step that held them
    requests: list[Request] = field(default_factory=list)
    step: int = -1
    #: their request ids, and their users' counts of them
    ids: list[str] = field(default_factory=list)
    users: dict[str, int] = field(default_factory=dict)
    #: user -> when its budget is next ready (ns), filled in when the step
    #: ends (None until then), and the earliest of them
    ready: dict[str, int] | None = None
    wake: int = 0
    #: requests throttled in every step up to ``through`` whose
    #: ``output_rate_throttled_step`` is not written yet (``release``)
    unmarked: list[Request] = field(default_factory=list)
    through: int = -1

    def resume(self, running: list[Request], step: Any) -> list[Request] | None:
        """At a step's start: the tail of ``running`` held back in the last
        step, when this step may take it as it is (see the module), with
        the step's streams and budgets counted (``step``: its
        ``ledger.StepLedger``; theirs from the last step, the others' now);
        None otherwise (and the run ends here)."""
        requests = self.requests
        n = len(requests)
        if (not n or step.no != self.step + 1 or self.ready is None or step.now >= self.wake
                or len(running) < n
                or running[-n:] != requests):  # (identical objects: pointers compared)
            self.release()
            return None
        front = streams_by_user(running[:-n])
        users = self.users
        if not users.keys().isdisjoint(front):
            self.release()
            return None
        streams = dict(users)
        streams.update(front)
        step.streams = streams
        left = step.charges.left
        budgets = dict.fromkeys(users, 0)
        budgets.update({user: left(user) for user in front})
        step.budgets = budgets
        return requests

    def intact(self, running: list[Request]) -> bool:
        """The held tail is still the tail of ``running`` (residency may
        have preempted one of them for a slot)."""
        n = len(self.requests)
        return len(running) >= n and running[-n:] == self.requests

    def hold(self, step: int, front: list[Request], front_ids: list[str],
             tail: list[Request] | None, eligible: bool) -> None:
        """The step ``step`` held back ``front`` (marked one by one, ids
        ``front_ids``) and, taken as it was, the last step's ``tail``
        (None: the full path). ``eligible``: the next step may take them
        as they are (see the module)."""
        if not eligible:
            self.release()
            self.requests = []
            return
        if tail is None:
            self.release()
            self.requests = front
            self.ids = front_ids
            self.users = streams_by_user(front)
            self.ready = None
        else:
            # the tail's requests were throttled in this step too: their
            # mark is written when the run ends
            self.unmarked = tail
            self.through = step
            if front:
                self.requests = front + tail
                self.ids = front_ids + self.ids
                users = self.users = dict(self.users)
                for request in front:
                    user = request.output_rate_user
                    users[user] = users.get(user, 0) + 1
                self.ready = None
            else:
                self.requests = tail
        self.step = step

    def ended(self, refused: dict[str, int]) -> None:
        """The step ended (``refused``: user -> its ready time, every user
        refused in it): the held users' ready times, when new."""
        if self.ready is None and self.requests:
            ready = self.ready = {user: refused[user] for user in self.users}
            self.wake = min(ready.values())

    def release(self) -> None:
        """The run of steps that took the tail as it was ends: the step
        that last throttled each of its requests written on them."""
        unmarked = self.unmarked
        if unmarked:
            through = self.through
            for request in unmarked:
                request.output_rate_throttled_step = through
            self.unmarked = []
