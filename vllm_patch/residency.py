"""Resident slots for requests within budget: a user's throttled streams
never keep another user's request with budget out of the engine.

Throttled requests stay resident (``--max-num-seqs``: their KV blocks and
worker slot kept) and give their active slot away. A user asking for far
more than its rate piles up throttled streams, and once they fill every
resident slot, a request of another user with budget waits for one of them
to finish, which at that user's rate can take minutes (a displacement the
real CPU engine showed in the fairness benchmark's capped arm).

So when a step begins and the waiting requests of users with budget beyond
what their resident streams take (as many of each user's as that budget
has tokens, in queue order, at most the active slots the resident
requests with budget leave) outnumber the free resident slots, the step frees the difference
(``_orl_make_room``): it preempts, with vLLM's own ``_preempt_request``
(KV blocks freed, the request back at the head of ``waiting``, recomputed
when it is admitted again), resident requests of the users whose streams
most exceed their budget (users without budget in the step first), the
latest arrival first, never one with a token
in flight, never one of the streams its user's rate keeps busy (its rate x
the engine's step period, rounded up, at least one: a stream throttled
between its tokens is pacing, and preempted it would be recomputed and
preempt another in its turn), and under ``--scheduling-policy priority`` only of the waiting
request's priority or lower. With borrowing, a waiting request of a user who
may borrow is kept a slot too while its user holds less than its share of
the resident set (``--max-num-seqs`` split by guaranteed rate among the
users with requests), and preempts only for a user above its share: a
heavy borrower's backlog does not keep another borrower from its weighted
split of what is lent. Rotation reaches ``waiting`` too: a user's first
waiting request that never had a token, when its user has a token of budget
its resident streams would take all of, takes that token (a "turn",
``_orl_turn_due``) below its user's share, with a slot freed the same way,
only while the KV cache is at ease. With borrowing the step also keeps its
room and sets the token aside, of the guaranteed budget and of the
ceiling, from the user's resident streams, which would take it even as
borrowers: the request's when vLLM's waiting loop reaches it, its user's
again, uncharged, if the loop never does (``charges.CeilingCharges.settle``). A user's
second stream, coming after its first took the budget, so takes turns
with it instead of waiting for it to end (2.9 s for 60 tokens at 20 tok/s
in a full engine). The slots stay kept for those requests in the step: a
waiting request of a user without budget is admitted to compute its
prefill ahead only beside them (``_orl_resident_fits``). vLLM's waiting
loop then admits the requests with budget in its own order.

The admission hook lives here too (``_handle_blocked_waiting_request``,
hook 3 of ``internals``): a waiting request of a user with budget passes; one
of a user without budget is admitted to borrow (``lending``) or to compute
its prefill short of its last position (chunked prefill) beside the kept
slots, else skipped for the step. Without borrowing (with chunked
prefill, FCFS), a step begins by moving the waiting requests of users with
budget ahead of the others, in queue order (``_orl_budgeted_first``), as
``running`` is ordered: a flood's prompts, queued first and computed ahead,
no longer take the step's token budget from the prompts of users with
budget behind them (a flood of 2R streams at once kept other users' first
tokens back by up to 12 steps; with borrowing, ``lending`` keeps their
prompts' tokens).

Mixed into ``scheduler.OutputRateSchedulerMixin``, whose attributes these
methods read; the room is made only when more requests wait than resident
slots are free.
"""

from __future__ import annotations

import math
import time
from typing import Any

from vllm_output_rate.ordering import beyond_resident, last_token_in_flight

Request = Any


class ResidencyMixin:
    """Resident slots kept for requests within budget (see the module)."""

    def _orl_budgeted_first(self) -> None:
        """A step begins (no borrowing, chunked prefill, FCFS): the waiting
        requests of users with budget beyond their resident streams (as
        many of each user's as that budget has tokens) go ahead of the
        others, each part in queue order; ``waiting`` is changed only when
        one of them waits behind another."""
        first: list[Request] = []
        rest: list[Request] = []
        left = self.output_rate.step.charges.left
        for request, n, _ in beyond_resident(self.waiting, left, self._orl_streams()):
            (first if n > 0 else rest).append(request)
        if first and rest and first[-1] is not self.waiting[len(first) - 1]:
            self.waiting.clear()
            self.waiting.extend(first + rest)

    def _orl_track_period(self, now: int) -> None:
        """A step begins at ``now``: the step period, a moving average over
        the steps that began with requests running (an idle engine's wait
        is no period), for how many streams a user's rate keeps busy."""
        st = self.output_rate
        prev = st.prev_now
        if prev is not None and self.running and now > prev:
            period = st.period_ns
            dt = now - prev
            st.period_ns = dt if period is None else (7 * period + dt) // 8
        st.prev_now = now

    def _orl_make_room(self) -> None:
        """A step begins: keep resident slots for the waiting requests of
        users with budget, preempting throttled ones when none are free."""
        st = self.output_rate
        step = st.step
        waiting = self.waiting
        running = self.running
        if waiting and st.chunked and st.lender is None and not st.priority:
            self._orl_budgeted_first()
        free = self.max_num_running_reqs - len(running)
        if not waiting:
            return
        left = step.charges.left
        resident = self._orl_streams()
        turn_due = self._orl_turn_due
        if free >= len(waiting):  # every waiting request has a slot: nothing to keep
            if resident:  # but a user's first waiting one may take its turn
                turns = []
                for request, n, first in beyond_resident(waiting, left, resident):
                    if first:
                        streams = resident.get(request.output_rate_user, 0)
                        if turn_due(request, n + streams, streams):
                            turns.append(request)
                if turns:
                    self._orl_give_turns(turns)
            return
        # the active slots left beside the resident requests with budget (a
        # request kept beyond them would wait for an active slot anyway)
        most = st.base_active
        budgets = self._orl_budgets()
        for user, n in resident.items():
            most -= min(n, max(budgets[user], 0))
        if most <= 0:
            return
        # each user's share of the resident set (by guaranteed rate, among
        # the users with requests), which a user who may borrow is kept
        # slots up to, and a user's first waiting request takes its turn
        # below it (``_orl_turn_due``)
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
                turn = turn_due(request, n + streams, streams)
            if n <= 0:
                if not turn and (lender is None or not lender.may_borrow(user)):
                    continue
                if share is None:
                    share = self._orl_resident_shares(resident)
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
            return
        short = len(kept) - free
        if short > 0:
            # the first kept ones (vLLM admits in queue order)
            freed = self._orl_evict(kept[:short], resident, share, below_share)
            short -= freed
        step.resident_kept = len(kept) - max(short, 0)
        step.kept_ids = {r.request_id for r in kept}
        if turns:  # those with a resident slot now (the first kept ones have them)
            slotted = {id(r) for r in kept[:step.resident_kept]}
            self._orl_give_turns([r for r in turns if id(r) in slotted])

    def _orl_turn_due(self, request: Request, budget: int, resident: int) -> bool:
        """Whether ``request``, its user's first in ``waiting``, takes its
        user's next token ahead of the user's resident streams (rotation
        across the resident set): it never had a token, and its user has a
        token of budget that its resident streams would take all of.
        Without this a user's second stream, coming after the first took
        the budget, waits for the first to end whenever the resident or the
        active slots are full (2.9 s for 60 tokens at 20 tok/s)."""
        # (only while the step cannot run out of KV blocks: a turn would
        # otherwise preempt a stream, its user's own maybe, for its blocks)
        return 0 < budget <= resident and not request.output_rate_served_ns \
            and request.num_output_tokens == 0 and self.output_rate.kv_fits(len(self.running))

    def _orl_give_turns(self, requests: list[Request]) -> None:
        """These waiting requests, each with a resident slot in this step,
        take their users' next token: their users' resident streams are
        a token short in the running order (``_orl_order_running``), and
        with borrowing the step keeps their room (``_orl_keep``) and sets
        the token aside (``charges.CeilingCharges.set_aside``)."""
        step = self.output_rate.step
        step.turns = {r.output_rate_user for r in requests}
        book = step.lending
        if book is not None:
            # (the running order reads the budgets from before, less the turn)
            self._orl_budgets()
            set_aside = step.charges.set_aside
            for request in requests:
                self._orl_keep(request)
                set_aside(request.request_id, request.output_rate_user)
            turns = step.turn_ids
            # (not among the waiting borrowers)
            book.waiting_borrowers = [r for r in book.waiting_borrowers
                                      if r.request_id not in turns]

    def _orl_resident_shares(self, resident: dict[str, int]) -> dict[str, float]:
        """Each user's share of the resident slots, in proportion to its
        guaranteed rate, among the users with requests resident or waiting."""
        rate_of = self.output_rate_limiter.rate_of
        users = set(resident)
        users.update(r.output_rate_user for r in self.waiting)
        weights = {u: float(rate_of(u)) for u in users}
        total = sum(weights.values()) or 1.0
        slots = self.max_num_running_reqs
        return {u: slots * w / total for u, w in weights.items()}

    def _orl_evict(self, for_requests: list[Request], resident: dict[str, int],
                   share: dict[str, float] | None = None, below_share: set[str] = frozenset()
                   ) -> int:
        """Preempt up to one resident request per ``for_requests`` entry
        (see the module; for a request kept below its user's share of the
        resident set, only of a user above its share); returns how many
        were preempted, each taken off ``resident`` (the step's count,
        ``_orl_streams``)."""
        budgets = self._orl_budgets()
        sustained = self._orl_sustained
        excess = {user: n - max(budgets[user], sustained(user)) for user, n in resident.items()}
        excess = {user: n for user, n in excess.items() if n > 0}
        if not excess:
            return 0
        holds = dict(resident)
        st = self.output_rate
        priority = st.priority
        in_flight = st.is_async
        can_be_freed = self._request_blocks_can_be_freed
        record = st.step.report
        # those that may go for any request (in ``running``'s order; what
        # each test reads is the request's own, unchanged by another's
        # preemption): looked at once, not once per victim
        pool = [r for r in self.running
                if r.output_rate_user in excess
                and not (in_flight and last_token_in_flight(r))
                and can_be_freed(r)]
        freed = 0
        for request in for_requests:
            above = share if request.request_id in below_share else None
            # for a request kept below its share: only of a user above its
            # share and without budget in this step (borrowers never
            # displace a request within its guaranteed rate)
            candidates = [
                r for r in pool
                if excess[r.output_rate_user] > 0
                and r.output_rate_user != request.output_rate_user
                and (above is None or (holds[r.output_rate_user] > above.get(r.output_rate_user, 0)
                                       and budgets[r.output_rate_user] <= 0))
                and (not priority or r.priority >= request.priority)]
            if not candidates:
                break
            # (a user without budget in this step first: one with budget
            # keeps its streams while another's can go)
            victim = max(candidates, key=lambda r: (budgets[r.output_rate_user] <= 0,
                                                    excess[r.output_rate_user],
                                                    r.priority, r.arrival_time))
            pool.remove(victim)
            self.running.remove(victim)
            self._preempt_request(victim, time.monotonic())
            user = victim.output_rate_user
            excess[user] -= 1
            holds[user] -= 1
            resident[user] -= 1  # (the step's count of ``running``)
            if not resident[user]:
                del resident[user]
            record.preempted_throttled.append(victim.request_id)
            record.preempted_for_slot += 1
            freed += 1
        return freed

    def _orl_sustained(self, user: str) -> int:
        """How many streams ``user``'s rate keeps busy: its rate x the
        engine's step period, rounded up, at least one. A user's streams up
        to that many are not preempted for a slot, whatever its budget in
        this step: a stream throttled for a step or two between tokens is
        pacing, not piling up (preempted, it would be recomputed and
        preempt another in its turn)."""
        period = self.output_rate.period_ns
        if period is None:
            return 1
        return max(1, math.ceil(float(self.output_rate_limiter.rate_of(user)) * period / 1e9))

    def _orl_take_kept(self, request: Request, any_slot: bool = False) -> bool:
        """vLLM's waiting loop admits ``request``: the slot kept for it (or,
        ``any_slot``, one kept slot) is taken. Whether one was kept for it."""
        step = self.output_rate.step
        mine = request.request_id in step.kept_ids
        if mine:
            step.kept_ids.discard(request.request_id)
        if (mine or any_slot) and step.resident_kept:
            step.resident_kept -= 1
        return mine

    # -- admission (hook 3 of ``internals``) --------------------------------

    def _handle_blocked_waiting_request(self, request: Request) -> bool:
        if not super()._handle_blocked_waiting_request(request):
            return False
        st = self.output_rate
        step = st.step
        if step.block_admission:
            # We preempted a throttled request in this step; like vLLM after
            # its own preemptions, admit nothing new in this step.
            return False
        user = request.output_rate_user
        charges = step.charges
        if step.turn_ids:
            charges.put_back(request.request_id)  # its turn: the token set aside for it
        if charges.left(user) > 0:
            self._orl_take_kept(request, any_slot=True)
            return True
        # out of budget: to borrow, or to compute its prefill ahead, in a
        # slot kept for it (to borrow), or beside the kept ones
        # (beside the resident slots kept for requests with budget)
        if self._orl_take_kept(request) or self._orl_resident_fits(step.resident_kept):
            if st.lender is not None and self._orl_admit_borrower(request):
                return True
            step.refused[user] = 0
            if st.chunked and self._can_hold_prefill(request) and (
                    st.lender is None or self._orl_admit_room(request)):
                return True
        else:
            step.refused[user] = 0
        step.report.waiting_skipped += 1
        return False

    def _can_hold_prefill(self, request: Request) -> bool:
        """Whether this waiting request's prefill surely has a position to
        compute short of its last one, whatever its prefix-cache hit (hits
        are whole blocks of at most ``num_tokens - 1`` tokens)."""
        if request.num_tokens - 1 - request.num_computed_tokens <= 0:
            return False
        return not (
            self.output_rate.prefix_caching
            and request.num_computed_tokens == 0
            and (request.num_tokens - 1) % self.block_size == 0
        )
