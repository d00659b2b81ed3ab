"""A step's planners: pure functions of the running and waiting requests,
the step's ledger (``ledger.StepLedger``: its charges, the streams and
budgets it counted) and the engine's capacity and settings
(``ledger.OutputRateState``), each returning a plan that ``schedule()``
applies before vLLM schedules. Borrowing's planners are in ``lending``.

Residency (``plan_residency``): resident slots for requests within budget,
so a user's throttled streams never keep another user's request with
budget out of the engine. Throttled requests stay resident
(``--max-num-seqs``: their KV blocks and worker slot kept) and give their
active slot away. A user asking for far more than its rate piles up
throttled streams, and once they fill every resident slot, a request of
another user with budget waits for one of them to finish, which at that
user's rate can take minutes (a displacement the real CPU engine showed in
the fairness benchmark's capped arm). So when the waiting requests of users
with budget beyond what their resident streams take (as many of each user's
as that budget has tokens, in queue order, at most the active slots the
resident requests with budget leave) outnumber the free resident slots, the
plan frees the difference: it names resident requests to preempt (with
vLLM's own ``_preempt_request``: KV blocks freed, the request back at the
head of ``waiting``, recomputed when it is admitted again) of the users
whose streams most exceed their budget (users without budget in the step
first), the latest arrival first, never one with a token in flight, never
one of the streams its user's rate keeps busy (its rate x the engine's step
period, rounded up, at least one: a stream throttled between its tokens is
pacing, and preempted it would be recomputed and preempt another in its
turn), and under ``--scheduling-policy priority`` only of the waiting
request's priority or lower. With borrowing, a waiting request of a user
who may borrow is kept a slot too while its user holds less than its share
of the resident set (``--max-num-seqs`` split by guaranteed rate among the
users with requests), and preempts only for a user above its share: a heavy
borrower's backlog does not keep another borrower from its weighted split
of what is lent. Rotation reaches ``waiting`` too: a user's first waiting
request that never had a token, when its user has a token of budget its
resident streams would take all of, takes that token (a "turn",
``turn_due``) below its user's share, with a slot freed the same way, only
while the KV cache is at ease (with borrowing the step also keeps its room
and sets the token aside, ``charges.CeilingCharges.set_aside``). A user's
second stream, coming after its first took the budget, so takes turns with
it instead of waiting for it to end (2.9 s for 60 tokens at 20 tok/s in a
full engine). The kept slots stay kept for those requests in the step: a
waiting request of a user without budget is admitted to compute its prefill
ahead only beside them. Without borrowing (with chunked prefill, FCFS), the
plan also moves the waiting requests of users with budget ahead of the
others, in queue order (``budgeted_first``), as ``running`` is ordered: a
flood's prompts, queued first and computed ahead, no longer take the step's
token budget from the prompts of users with budget behind them (a flood of
2R streams at once kept other users' first tokens back by up to 12 steps;
with borrowing, ``lending`` keeps their prompts' tokens).

The running order (``plan_running_order``): rotate each user's streams so
the one served longest ago goes first, move requests whose user has no
budget (less a waiting request's turn) behind the others, and, when the
active cap binds, put the users who waited longest first.

Pure logic: imports nothing from vLLM.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm_output_rate.ordering import (
    beyond_resident,
    last_token_in_flight,
    longest_waiting_first,
    rotated,
)

if TYPE_CHECKING:
    from vllm_output_rate.ledger import OutputRateState, StepLedger

Request = Any


# -- residency -------------------------------------------------------------------


@dataclass(slots=True, eq=False)
class ResidencyPlan:
    """What residency does before vLLM schedules (``plan_residency``)."""

    #: ``waiting`` with the requests of users with budget first (None: as it is)
    waiting: list[Request] | None = None
    #: resident requests to preempt for a slot, in order
    evict: list[Request] = field(default_factory=list)
    #: resident slots kept for waiting requests, and their ids
    kept: int = 0
    kept_ids: set[str] = field(default_factory=frozenset)
    #: waiting requests that take their users' next token (each with a slot)
    turns: list[Request] = field(default_factory=list)


def plan_residency(running: list[Request], waiting: Any, st: OutputRateState,
                   step: StepLedger, rate_of: Callable[[str], Any],
                   can_be_freed: Callable[[Request], bool]) -> ResidencyPlan:
    """The resident slots kept for waiting requests in this step, the
    preemptions that free them, and the turns (see the module)."""
    plan = ResidencyPlan()
    left = step.charges.left
    if waiting and st.chunked and st.lender is None and not st.priority:
        plan.waiting = budgeted_first(waiting, left, step.streams_of(running))
        if plan.waiting is not None:
            waiting = plan.waiting
    free = st.max_running - len(running)
    if not waiting:
        return plan
    resident = step.streams_of(running)
    if free >= len(waiting):  # every waiting request has a slot: nothing to keep
        if resident:  # but a user's first waiting one may take its turn
            for request, n, first in beyond_resident(waiting, left, resident):
                if first:
                    streams = resident.get(request.output_rate_user, 0)
                    if turn_due(request, n + streams, streams, st, running):
                        plan.turns.append(request)
        return plan
    # the active slots left beside the resident requests with budget (a
    # request kept beyond them would wait for an active slot anyway)
    most = st.base_active
    budgets = step.budgets_of(running)
    for user, n in resident.items():
        most -= min(n, max(budgets[user], 0))
    if most <= 0:
        return plan
    # each user's share of the resident set (by guaranteed rate, among the
    # users with requests), which a user who may borrow is kept slots up
    # to, and a user's first waiting request takes its turn below it
    lender = st.lender
    share = None
    holds = dict(resident)
    kept: list[Request] = []
    below_share: set[str] = set()
    turns: list[Request] = []
    for request, n, first in beyond_resident(waiting, left, resident):
        user = request.output_rate_user
        turn = False
        if first:
            streams = resident.get(user, 0)
            turn = turn_due(request, n + streams, streams, st, running)
        if n <= 0:
            if not turn and (lender is None or not lender.may_borrow(user)):
                continue
            if share is None:
                share = resident_shares(resident, waiting, rate_of, st.max_running)
            if holds.get(user, 0) + 1 > share.get(user, 0):
                continue
            below_share.add(request.request_id)
            if turn:
                turns.append(request)
        kept.append(request)
        holds[user] = holds.get(user, 0) + 1
        if len(kept) >= most:
            break
    if not kept:
        return plan
    short = len(kept) - free
    if short > 0:
        # the first kept ones (vLLM admits in queue order)
        plan.evict = evictions(kept[:short], running, resident, budgets, st, rate_of,
                               can_be_freed, share, below_share)
        short -= len(plan.evict)
    plan.kept = len(kept) - max(short, 0)
    plan.kept_ids = {r.request_id for r in kept}
    if turns:  # those with a resident slot now (the first kept ones have them)
        slotted = {id(r) for r in kept[:plan.kept]}
        plan.turns = [r for r in turns if id(r) in slotted]
    return plan


def budgeted_first(waiting: Any, left: Callable[[str], int],
                   resident: dict[str, int]) -> list[Request] | None:
    """``waiting`` with the requests of users with budget beyond their
    resident streams (as many of each user's as that budget has tokens)
    ahead of the others, each part in queue order; None when none of them
    waits behind another."""
    first: list[Request] = []
    rest: list[Request] = []
    for request, n, _ in beyond_resident(waiting, left, resident):
        (first if n > 0 else rest).append(request)
    if first and rest and first[-1] is not waiting[len(first) - 1]:
        return first + rest
    return None


def turn_due(request: Request, budget: int, resident: int, st: OutputRateState,
             running: list[Request]) -> bool:
    """Whether ``request``, its user's first in ``waiting``, takes its
    user's next token ahead of the user's resident streams (rotation across
    the resident set): it never had a token, and its user has a token of
    budget that its resident streams would take all of. Without this a
    user's second stream, coming after the first took the budget, waits for
    the first to end whenever the resident or the active slots are full
    (2.9 s for 60 tokens at 20 tok/s)."""
    # (only while the step cannot run out of KV blocks: a turn would
    # otherwise preempt a stream, its user's own maybe, for its blocks)
    return 0 < budget <= resident and not request.output_rate_served_ns \
        and request.num_output_tokens == 0 and st.kv_fits(len(running)) \
        and samples_now(request, st)


def samples_now(request: Request, st: OutputRateState) -> bool:
    """Whether ``request``'s prompt can be computed whole in this step (the
    step's token budget, its user's prompt budget), so that a turn gives it
    a token now: a turn to a longer prompt would keep the token from its
    user's streams for the steps its prompt takes (it comes in just in
    time instead: ``residency``)."""
    rest = request.num_tokens - request.num_computed_tokens
    if st.chunked and rest > st.token_budget:
        return False
    prompts = st.prompts
    return prompts is None or prompts.available(request.output_rate_user, st.step.now) >= rest


def resident_shares(resident: dict[str, int], waiting: Any, rate_of: Callable[[str], Any],
                    slots: int) -> dict[str, float]:
    """Each user's share of the ``slots`` resident slots, in proportion to
    its guaranteed rate, among the users with requests resident or waiting."""
    users = set(resident)
    users.update(r.output_rate_user for r in waiting)
    weights = {u: float(rate_of(u)) for u in users}
    total = sum(weights.values()) or 1.0
    return {u: slots * w / total for u, w in weights.items()}


def sustained(rate: Any, period_ns: int | None) -> int:
    """How many streams a user's ``rate`` keeps busy: the rate x the
    engine's step period, rounded up, at least one. A user's streams up to
    that many are not preempted for a slot, whatever its budget in this
    step: a stream throttled for a step or two between tokens is pacing,
    not piling up (preempted, it would be recomputed and preempt another in
    its turn)."""
    if period_ns is None:
        return 1
    return max(1, math.ceil(float(rate) * period_ns / 1e9))


def evictions(for_requests: list[Request], running: list[Request], resident: dict[str, int],
              budgets: dict[str, int], st: OutputRateState, rate_of: Callable[[str], Any],
              can_be_freed: Callable[[Request], bool], share: dict[str, float] | None = None,
              below_share: set[str] = frozenset()) -> list[Request]:
    """Up to one resident request to preempt per ``for_requests`` entry, in
    order (see the module; for a request kept below its user's share of the
    resident set, only of a user above its share)."""
    period = st.period_ns
    excess = {user: n - max(budgets[user], sustained(rate_of(user), period))
              for user, n in resident.items()}
    excess = {user: n for user, n in excess.items() if n > 0}
    if not excess:
        return []
    holds = dict(resident)
    priority = st.priority
    in_flight = st.is_async
    # those that may go for any request (in ``running``'s order; what each
    # test reads is the request's own, unchanged by another's preemption):
    # looked at once, not once per victim
    pool = [r for r in running
            if r.output_rate_user in excess
            and not (in_flight and last_token_in_flight(r))
            and can_be_freed(r)]
    victims: list[Request] = []
    for request in for_requests:
        above = share if request.request_id in below_share else None
        # for a request kept below its share: only of a user above its share
        # and without budget in this step (borrowers never displace a
        # request within its guaranteed rate)
        candidates = [
            r for r in pool
            if excess[r.output_rate_user] > 0
            and r.output_rate_user != request.output_rate_user
            and (above is None or (holds[r.output_rate_user] > above.get(r.output_rate_user, 0)
                                   and budgets[r.output_rate_user] <= 0))
            and (not priority or r.priority >= request.priority)]
        if not candidates:
            break
        # (a user without budget in this step first: one with budget keeps
        # its streams while another's can go)
        victim = max(candidates, key=lambda r: (budgets[r.output_rate_user] <= 0,
                                                excess[r.output_rate_user],
                                                r.priority, r.arrival_time))
        pool.remove(victim)
        victims.append(victim)
        user = victim.output_rate_user
        excess[user] -= 1
        holds[user] -= 1
    return victims


# -- the running order -----------------------------------------------------------------


@dataclass(slots=True, eq=False)
class RunningOrder:
    """``running`` ordered for the step (``plan_running_order``)."""

    #: requests that may take a token, in order, and the throttled ones
    ready: list[Request]
    throttled: list[Request]
    #: each user's budget left after ``ready`` (and its turn) took theirs
    budget: dict[str, int]
    #: whether some user has fewer tokens than running streams
    short: bool


def plan_running_order(running: list[Request], st: OutputRateState,
                       step: StepLedger) -> RunningOrder | None:
    """Rotate, move users without budget back, longest-waiting user first.

    Only when it matters: when some user has fewer tokens than running
    streams, or when more requests could run than the active cap. None
    when neither holds (``running`` stays as it is)."""
    streams = step.streams_of(running)
    budget = dict(step.budgets_of(running))  # (taken from as requests are ordered)
    for user in step.turns:
        budget[user] -= 1
    short = any(budget[user] < n for user, n in streams.items())
    cap_binds = len(running) > st.base_active
    if not short and not cap_binds:
        return None
    ordered = rotated(running) if short else running
    ready: list[Request] = []
    throttled: list[Request] = []
    in_flight = st.is_async
    for request in ordered:
        user = request.output_rate_user
        if request.is_prefill_chunk:
            ready.append(request)
        elif in_flight and last_token_in_flight(request):
            ready.append(request)  # takes no budget, is not throttled
        elif budget[user] > 0:
            budget[user] -= 1
            ready.append(request)
        else:
            throttled.append(request)
    if len(ready) > st.base_active:
        ready = longest_waiting_first(ready, running)
    return RunningOrder(ready, throttled, budget, short)
