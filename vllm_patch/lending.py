"""The scheduler's side of borrowing (``borrowing``: the ceilings and the
counters): who may borrow in a step and the room it lends. Mixed into
``scheduler.OutputRateSchedulerMixin``, whose attributes these methods read;
none of it runs without a limit that has a ceiling (the state's ``lender``
is None then). A step's room is the ledger's ``lending``
(``ledger.LendingBook``); the ceilings' books, the tokens lent and their
settling are the step's charges (``charges.CeilingCharges``).

A step lends what requests within their guaranteed rates leave of it. When
it begins (``_orl_begin_lending``), it keeps, for the waiting requests of
users with budget beyond what their resident requests take (as many of each
user's as that budget has tokens, in queue order), an active slot each,
their prompt's tokens of the token budget and their KV blocks; it lends
nothing when those do not fit (more of them than free resident or active
slots, or than the KV cache's free blocks). The borrowers are the requests
of users out of guaranteed budget: throttled decodes, prefill chunks whose
final chunk would sample, and the first few waiting requests of each such
user; they are ordered together by ``Lender.order`` (weighted by the
guaranteed rates) and the first take the active slots left
(``_orl_lend_tail``): the resident ones go after every other request in
``running``, where vLLM's FCFS preemption takes them first, a waiting one
chosen is admitted in the step. The charge point lends each a token where
its ceiling and the room of the step allow (``CeilingCharges.lend``,
``LendingBook.room``: the slots, tokens and KV blocks given and kept); a
waiting request of a user out of budget, to borrow or to have its prefill
computed ahead, is admitted only within that room and a free resident slot
(``_orl_admit_room``). A token lent but not dispatched is given back when
the step ends.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.request import RequestStatus

from vllm_output_rate.borrowing import Lender
from vllm_output_rate.charges import choose
from vllm_output_rate.config import OutputRateConfig
from vllm_output_rate.ordering import beyond_resident

Request = Any
_RUNNING = RequestStatus.RUNNING


def _prompt_left(request: Request) -> int:
    """The tokens a waiting request's prefill has still to compute (1 at least)."""
    return max(1, request.num_tokens - request.num_computed_tokens)


class LendingMixin:
    """Borrowing in the output-rate scheduler (see the module)."""

    def _orl_set_lender(self, config: OutputRateConfig, now: int) -> None:
        """Reloaded limits: borrowing starts, stops or takes new ceilings."""
        st = self.output_rate
        lender = st.lender
        if not config.borrowing:
            lender = None
        elif lender is None:
            lender = Lender(config)
        else:
            lender.set_limits(config, now)
        choose(st, st.limiter, lender)

    def _orl_begin_lending(self) -> None:
        """A step begins: its ceilings' books, and the room it keeps for the
        waiting requests of users with budget (the module)."""
        st = self.output_rate
        book = st.step.lending  # (made with the step's charges)
        if not self.waiting:
            return
        room = min(self.max_num_running_reqs - len(self.running), st.base_active)
        kept = book.kept
        may, slots = st.lender.may_borrow, st.base_active
        candidates = book.waiting_borrowers
        not_lent: set[str] = set()  # (out of budget from the first, may not borrow)
        for request, n, first in beyond_resident(self.waiting, st.step.charges.left,
                                                self._orl_streams()):
            if n > 0:
                if len(kept) >= room:
                    # more of them than free slots: lending would keep one
                    # waiting (borrowers resident or active in its place)
                    book.lends = False
                    break
                need = _prompt_left(request)
                blocks = st.blocks_for(need)
                kept[request.request_id] = (need, blocks)
                book.kept_tokens += need
                book.kept_blocks += blocks
                continue
            user = request.output_rate_user
            if first and not may(user):
                not_lent.add(user)  # neither kept nor lent to
            elif n > -slots and len(candidates) < room and user not in not_lent:
                candidates.append(request)  # (its first few only)
        book.kept_slots = len(kept)
        if book.kept_blocks > st.free_blocks():
            # the KV cache cannot take them all: lent tokens (more blocks
            # held by borrowers) would keep them waiting longer
            book.lends = False

    def _orl_keep(self, request: Request) -> None:
        """Keep room in this step for a waiting request taking its user's
        turn (``residency``), as for one with budget: borrowers are not
        given its active slot, tokens or KV blocks."""
        book = self.output_rate.step.lending
        if request.request_id in book.kept:
            return
        need = _prompt_left(request)
        blocks = self.output_rate.blocks_for(need)
        book.kept[request.request_id] = (need, blocks)
        book.kept_slots += 1
        book.kept_tokens += need
        book.kept_blocks += blocks

    def _orl_admit_room(self, request: Request) -> bool:
        """Whether a waiting request out of guaranteed budget may be
        admitted in this step: room for its prompt (``LendingBook.room``),
        and a resident slot beside those kept for other waiting requests."""
        book = self.output_rate.step.lending
        return (self._orl_resident_fits(book.kept_slots - (request.request_id in book.kept))
                and book.room(_prompt_left(request), request.request_id))

    def _orl_lend_tail(self, ready: list[Request], throttled: list[Request],
                       budget: dict[str, int]) -> tuple[list[Request], list[Request]]:
        """``running`` ordered for a lending step: ``ready``, ``throttled``,
        then the borrowers (throttled requests, and prefill chunks out of
        budget whose final chunk may borrow the first token); the two lists
        without the borrowers."""
        prefilling = [r for r in ready if r.is_prefill_chunk and budget[r.output_rate_user] <= 0]
        # those with positions to compute short of the last take an active
        # slot lent or not (the charge point computes their prefill ahead)
        ahead = {id(r) for r in prefilling if r.num_tokens - 1 - r.num_computed_tokens > 0}
        # the slots and tokens left beside the guaranteed requests, those
        # computing ahead and those kept for waiting ones, to the first
        # borrowers in lending order, resident or waiting (a waiting one
        # chosen is admitted in this step, its prompt's tokens and its
        # active slot kept for it; one computing ahead takes no other slot)
        st = self.output_rate
        step = st.step
        book = step.lending
        slots = (st.base_active - (len(ready) - len(prefilling)) - len(ahead)
                 - book.kept_slots)
        tokens = self.max_num_scheduled_tokens - book.kept_tokens - sum(
            r.num_tokens - r.num_computed_tokens if r.is_prefill_chunk else 1 for r in ready)
        chosen = []
        for request in self._orl_borrowers(throttled + prefilling + book.waiting_borrowers):
            if id(request) in ahead:
                chosen.append(request)
                continue
            need = 1 if request.status == _RUNNING else _prompt_left(request)
            if slots > 0 and tokens >= need:
                chosen.append(request)
                slots -= 1
                tokens -= need
                if request.status != _RUNNING:
                    # its room kept as for a waiting request with budget (a
                    # waiting request admitted before it to compute its
                    # prefill ahead took its active slot, and it waited a
                    # step: the flood's victims at GPU scale, 1.44x their
                    # no-flood TTFT p99)
                    self._orl_keep(request)
        book.chose = True
        for request in chosen:  # the charge point may lend to these
            request.output_rate_borrow_step = step.no
        borrowers = [r for r in chosen if r.status == _RUNNING]
        if borrowers:
            ids = {id(r) for r in borrowers}
            ready = [r for r in ready if id(r) not in ids]
            throttled = [r for r in throttled if id(r) not in ids]
        self.running[:] = ready + throttled + borrowers
        step.lent_tail = len(borrowers)
        return ready, throttled

    def _orl_admit_borrower(self, request: Request) -> bool:
        """Whether a waiting request out of guaranteed budget is admitted to
        borrow in this step (then flagged for the charge point)."""
        st = self.output_rate
        step = st.step
        book = step.lending
        user = request.output_rate_user
        if not (book.lends and st.lender.may_borrow(user)
                and self._orl_admit_room(request)):
            return False
        if book.chose:  # chosen in lending order, or not in this step
            return self._orl_lent_now(request)
        charges = step.charges
        if charges.ceiling_left(user) > 0:
            request.output_rate_borrow_step = step.no
            return True
        charges.at_ceiling.add(user)
        return False

    def _orl_borrowers(self, throttled: list[Request]) -> list[Request]:
        """Those of ``throttled`` that may borrow in this step (their
        ceilings allow), in lending order (``borrowing.Lender.order``)."""
        st = self.output_rate
        lender = st.lender
        may = lender.may_borrow
        charges = st.step.charges
        ceil = charges.ceiling_left
        may_borrow = [r for r in throttled if may(r.output_rate_user)]
        borrowers = lender.order([r for r in may_borrow if ceil(r.output_rate_user) > 0])
        if len(borrowers) < len(may_borrow):  # the others' ceilings are spent
            charges.at_ceiling.update(r.output_rate_user for r in may_borrow
                                      if charges.ceil_left[r.output_rate_user] <= 0)
        return borrowers

    def _orl_lent_now(self, request: Request) -> bool:
        """``request`` may borrow in this step (lent tokens, not charged)."""
        return request.output_rate_borrow_step == self.output_rate.step_no
