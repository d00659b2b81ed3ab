"""The scheduler's side of borrowing (``borrowing``: the ceilings and the
counters): who may borrow in a step, the ceilings' books of the step, and
their settling when it ends. Mixed into ``scheduler.OutputRateSchedulerMixin``,
whose attributes these methods read; none of it runs without a limit that
has a ceiling (``_orl_lender`` is None then).

A step lends only when nobody within its guaranteed rate waits to be
admitted (``schedule``); its borrowers are the requests of users out of
guaranteed budget (throttled decodes, and prefill chunks whose final chunk
would sample), ordered by ``Lender.order`` and put after every other request
in ``running``: they take only what is left of the active slots and the
token budget, and vLLM's FCFS preemption takes them first. The charge point
lends them a token where its ceiling allows (``_orl_borrow``); a token
lent but not dispatched is given back when the step ends.
"""

from __future__ import annotations

from typing import Any

from vllm_output_rate.borrowing import NO_CEILING, Lender
from vllm_output_rate.config import OutputRateConfig
from vllm_output_rate.observers import StepReport

Request = Any


class LendingMixin:
    """Borrowing in the output-rate scheduler (see the module)."""

    def _orl_set_lender(self, config: OutputRateConfig, now: int) -> None:
        """Reloaded limits: borrowing starts, stops or takes new ceilings."""
        if not config.borrowing:
            self._orl_lender = None
            self._orl_lent_tail = 0  # (no step orders borrowers any more)
        elif self._orl_lender is None:
            self._orl_lender = Lender(config)
        else:
            self._orl_lender.set_limits(config, now)

    def _orl_begin_lending(self) -> None:
        """A step begins: its ceilings' books, and whether it lends (only
        when nobody within its guaranteed rate waits to be admitted)."""
        #: user -> tokens its ceiling still allows in this step, and at its
        #: start; user -> tokens lent in this step
        self._orl_ceil_left: dict[str, int] = {}
        self._orl_ceil_start: dict[str, int] = {}
        self._orl_borrowed: dict[str, int] = {}
        #: users whose ceiling refused them in this step
        self._orl_at_ceiling: set[str] = set()
        self._orl_lent_tail = 0
        left = self._orl_left
        self._orl_lending = not any(left(r.output_rate_user) > 0 for r in self.waiting)

    def _orl_lend_tail(self, ready: list[Request], throttled: list[Request],
                       budget: dict[str, int]) -> tuple[list[Request], list[Request]]:
        """``running`` ordered for a lending step: ``ready``, ``throttled``,
        then the borrowers (throttled requests, and prefill chunks out of
        budget whose final chunk may borrow the first token); the two lists
        without the borrowers."""
        prefilling = [r for r in ready if r.is_prefill_chunk and budget[r.output_rate_user] <= 0]
        borrowers = self._orl_borrowers(throttled + prefilling)
        if borrowers:
            ids = {id(r) for r in borrowers}
            ready = [r for r in ready if id(r) not in ids]
            throttled = [r for r in throttled if id(r) not in ids]
        self.running[:] = ready + throttled + borrowers
        self._orl_lent_tail = len(borrowers)
        return ready, throttled

    def _orl_admit_borrower(self, request: Request) -> bool:
        """Whether a waiting request out of guaranteed budget is admitted to
        borrow in this step (then flagged for the charge point)."""
        user = request.output_rate_user
        if self._orl_lending and self._orl_lender.may_borrow(user):
            if self._orl_ceiling_left(user) > 0:
                request.output_rate_borrow_step = self._orl_step_no
                return True
            self._orl_at_ceiling.add(user)
        return False

    def _orl_borrowers(self, throttled: list[Request]) -> list[Request]:
        """Those of ``throttled`` that may borrow in this step, in lending
        order (``borrowing.Lender.order``), flagged for the charge point."""
        lender = self._orl_lender
        may = lender.may_borrow
        ceil = self._orl_ceiling_left
        may_borrow = [r for r in throttled if may(r.output_rate_user)]
        borrowers = lender.order([r for r in may_borrow if ceil(r.output_rate_user) > 0])
        if len(borrowers) < len(may_borrow):  # the others' ceilings are spent
            self._orl_at_ceiling.update(r.output_rate_user for r in may_borrow
                                        if self._orl_ceil_left[r.output_rate_user] <= 0)
        step = self._orl_step_no
        for request in borrowers:  # the charge point may lend to these
            request.output_rate_borrow_step = step
        return borrowers

    def _orl_lent_now(self, request: Request) -> bool:
        """``request`` may borrow in this step (lent tokens, not charged)."""
        return request.output_rate_borrow_step == self._orl_step_no

    def _orl_lend(self, request: Request, user: str, running: bool, num_new_tokens: int) -> bool:
        """The charge point, for a request out of guaranteed budget: lend it
        this step's token if it may borrow in the step, a running one only
        with KV room, and its ceiling allows."""
        return (self._orl_lent_now(request)
                and (not running or self._orl_kv_room(num_new_tokens))
                and self._orl_borrow(user))

    def _orl_kv_room(self, num_new_tokens: int) -> bool:
        """Whether the KV cache has the blocks a running borrower's tokens
        could need (one more than they fill, per KV cache group) without a
        preemption: a lent token never costs anyone else their blocks (a
        failed allocation would have vLLM preempt the tail with FCFS, and
        by priority and arrival, a request already scheduled maybe, with
        PRIORITY)."""
        need = self._orl_groups * (-(-num_new_tokens // self.block_size) + 1)
        return self._orl_free_blocks() >= need

    def _orl_ceiling_left(self, user: str) -> int:
        """How many tokens ``user``'s ceiling still allows in this step."""
        left = self._orl_ceil_left.get(user)
        if left is None:
            left = self._orl_lender.available(user, self._orl_now)
            self._orl_ceil_left[user] = self._orl_ceil_start[user] = left
        return left

    def _orl_borrow(self, user: str) -> bool:
        """Lend ``user`` one token of this step, if its ceiling allows."""
        if self._orl_ceiling_left(user) <= 0:
            self._orl_at_ceiling.add(user)
            return False
        self._orl_ceil_left[user] -= 1
        self._orl_borrowed[user] = self._orl_borrowed.get(user, 0) + 1
        return True

    def _orl_settle_ceilings(self, record: StepReport, scheduled: dict[str, int]) -> None:
        """Give back what was lent but not dispatched, and put the step's
        tokens on the ceilings and the borrowing counters."""
        borrowed, ceil_left, lent = record.borrowed, self._orl_ceil_left, self._orl_borrowed
        if self._orl_at_ceiling:
            record.at_ceiling = list(self._orl_at_ceiling)
        for req_id in [r for r in borrowed if r not in scheduled]:
            user = borrowed.pop(req_id)
            ceil_left[user] += 1
            lent[user] -= 1
        for req_id, user, _ in record.refunded:
            if user in ceil_left:  # a guaranteed token given back
                ceil_left[user] += 1
        spent = {user: start - ceil_left[user] for user, start in self._orl_ceil_start.items()
                 if start < NO_CEILING and start > ceil_left[user]}
        self._orl_lender.settle(self._orl_now, spent, lent)
