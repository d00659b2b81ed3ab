"""Borrowing's planners (``borrowing``: the ceilings and the counters): the
room a step keeps and lends, who may borrow in it, and the admission of a
waiting borrower. Functions of the running and waiting requests, the step's
ledger and the engine's capacity (``ledger.OutputRateState``); none of it
runs without a limit that has a ceiling (the state's ``lender`` is None
then). A step's room is the ledger's ``lending`` (``ledger.LendingBook``,
the plan ``plan_lending`` returns); the ceilings' books, the tokens lent
and their settling are the step's charges (``charges.CeilingCharges``).

A step lends what requests within their guaranteed rates leave of it. When
it begins (``plan_lending``), it keeps, for the waiting requests of users
with budget beyond what their resident requests take (as many of each
user's as that budget has tokens, in queue order), an active slot each,
their prompt's tokens of the token budget and their KV blocks; it lends
nothing when those do not fit (more of them than free resident or active
slots, or than the KV cache's free blocks). The borrowers are the requests
of users out of guaranteed budget: throttled decodes, prefill chunks whose
final chunk would sample, and the first few waiting requests of each such
user; they are ordered together by ``Lender.order`` (weighted by the
guaranteed rates) and the first take the active slots left
(``plan_lend_tail``): the resident ones go after every other request in
``running``, where vLLM's FCFS preemption takes them first, a waiting one
chosen is admitted in the step. The charge point lends each a token where
its ceiling and the room of the step allow (``CeilingCharges.lend``,
``LendingBook.room``: the slots, tokens and KV blocks given and kept); a
waiting request of a user out of budget, to borrow or to have its prefill
computed ahead, is admitted only within that room and a free resident slot
(``admit_room``). A token lent but not dispatched is given back when the
step ends.

Just in time (no ceiling, chunked prefill, prompts not computed ahead) a
step keeps the same tokens (``plan_jit_room``, the same loop as
``plan_lending``'s: ``keep_budgeted``), from the prefill chunks of users out
of output budget, which vLLM's loop reaches before the waiting requests:
such a chunk is cut to the tokens not kept, and a waiting request of such a
user admitted only while some are left (``jit_room``).
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from vllm.v1.request import RequestStatus

from vllm_output_rate.charges import RoomCharges
from vllm_output_rate.ledger import LendingBook
from vllm_output_rate.ordering import beyond_resident

if TYPE_CHECKING:
    from vllm_output_rate.ledger import OutputRateState, StepLedger
    from vllm_output_rate.planners import RunningOrder

Request = Any
_RUNNING = RequestStatus.RUNNING


def prompt_left(request: Request) -> int:
    """The tokens a waiting request's prefill has still to compute (1 at least)."""
    return max(1, request.num_tokens - request.num_computed_tokens)


def keep(book: LendingBook, request: Request, st: OutputRateState) -> None:
    """Keep room in this step for a waiting request (with budget, taking its
    user's turn, or chosen to borrow): borrowers are not given its active
    slot, its prompt's tokens or their KV blocks."""
    need = prompt_left(request)
    book.keep(request.request_id, need, st.blocks_for(need))


def plan_lending(waiting: Any, running: list[Request], st: OutputRateState,
                 step: StepLedger) -> LendingBook:
    """A step begins: its room, kept for the waiting requests of users with
    budget, and the waiting requests that may borrow (the module)."""
    book = LendingBook(st.base_active, st.token_budget, st.kv_fits)
    if not waiting:
        return book
    room = min(st.max_running - len(running), st.base_active)
    may, slots = st.lender.may_borrow, st.base_active
    candidates = book.waiting_borrowers
    not_lent: set[str] = set()  # (out of budget from the first, may not borrow)
    for request, n, first in keep_budgeted(book, waiting, running, st, step, room):
        user = request.output_rate_user
        if first and not may(user):
            not_lent.add(user)  # neither kept nor lent to
        elif n > -slots and len(candidates) < room and user not in not_lent:
            candidates.append(request)  # (its first few only)
    if book.kept_blocks > st.free_blocks():
        # the KV cache cannot take them all: lent tokens (more blocks held
        # by borrowers) would keep them waiting longer
        book.lends = False
    return book


def keep_budgeted(book: LendingBook, waiting: Any, running: list[Request], st: OutputRateState,
                  step: StepLedger, room: int) -> Iterator[tuple[Request, int, bool]]:
    """Keep room in ``book`` for the waiting requests of users with budget
    beyond their resident streams (``ordering.beyond_resident``, in queue
    order) while they fit in ``room`` active slots (more of them: the book
    lends nothing, and keeps no more); yields the others as met."""
    for request, n, first in beyond_resident(waiting, step.charges.left,
                                             step.streams_of(running)):
        if n <= 0:
            yield request, n, first
        elif book.kept_slots >= room:
            # more of them than free slots: lending would keep one
            # waiting (borrowers resident or active in its place)
            book.lends = False
            return
        else:
            keep(book, request, st)


def plan_jit_room(waiting: Any, running: list[Request], st: OutputRateState,
                  step: StepLedger) -> None:
    """Just in time (chunked prefill, no lender, not ahead), a step begins
    (after residency): the tokens of the prompts of waiting requests with
    budget are kept (``keep_budgeted``) from the prefill chunks of users out
    of output budget (``jit_room``), and the step's charges count every
    token given (``charges.RoomCharges``). Nothing when none is kept."""
    if not waiting or st.lender is not None or st.prefill_ahead or not st.chunked:
        return
    book = LendingBook(st.base_active, st.token_budget, st.kv_fits)
    room = min(st.max_running - len(running), st.base_active)
    for _ in keep_budgeted(book, waiting, running, st, step, room):
        if not st.priority:
            break  # (FCFS: residency put those with budget first, ``budgeted_first``)
    if book.kept_tokens:
        step.jit_room = book
        step.charges = RoomCharges(step.charges, book)


def jit_room(step: StepLedger, request: Request, n: int) -> int:
    """Just in time: the tokens of ``n`` a prefill chunk of ``request`` may
    take when its user is out of output budget, the step's tokens not given
    nor kept for the prompts of waiting requests with budget
    (``plan_jit_room``; 0: put off); ``n`` when nothing is kept or its user
    has budget."""
    book = step.jit_room
    if book is None or n <= 0 or step.charges.left(request.output_rate_user) > 0:
        return n
    return max(0, min(n, book.tokens_left(request.request_id)))


@dataclass(slots=True, eq=False)
class LendTail:
    """``running`` ordered for a lending step (``plan_lend_tail``)."""

    #: the running order's two parts without the borrowers, then the resident borrowers
    ready: list[Request]
    throttled: list[Request]
    borrowers: list[Request]
    #: every borrower chosen, resident or waiting (the charge point may lend to these)
    chosen: list[Request]
    #: users found at their ceiling, in the order found
    at_ceiling: list[str]


def plan_lend_tail(order: RunningOrder, st: OutputRateState, step: StepLedger) -> LendTail:
    """The borrowers of a lending step (throttled requests, prefill chunks
    out of budget whose final chunk may borrow the first token, and the
    waiting ones) that take the active slots and tokens left: ``ready``,
    ``throttled``, then the resident borrowers."""
    ready, throttled, budget = order.ready, order.throttled, order.budget
    prefilling = [r for r in ready if r.is_prefill_chunk and budget[r.output_rate_user] <= 0]
    # those with positions to compute short of the last take an active
    # slot lent or not (the charge point computes their prefill ahead)
    ahead = {id(r) for r in prefilling if r.num_tokens - 1 - r.num_computed_tokens > 0}
    # the slots and tokens left beside the guaranteed requests, those
    # computing ahead and those kept for waiting ones, to the first
    # borrowers in lending order, resident or waiting (a waiting one chosen
    # is admitted in this step, its prompt's tokens and its active slot
    # kept for it; one computing ahead takes no other slot)
    book = step.lending
    slots = st.base_active - (len(ready) - len(prefilling)) - len(ahead) - book.kept_slots
    tokens = st.token_budget - book.kept_tokens - sum(
        r.num_tokens - r.num_computed_tokens if r.is_prefill_chunk else 1 for r in ready)
    at_ceiling: list[str] = []
    chosen = []
    for request in borrowers_of(throttled + prefilling + book.waiting_borrowers, st, step,
                                at_ceiling):
        if id(request) in ahead:
            chosen.append(request)
            continue
        need = 1 if request.status == _RUNNING else prompt_left(request)
        if slots > 0 and tokens >= need:
            chosen.append(request)
            slots -= 1
            tokens -= need
    borrowers = [r for r in chosen if r.status == _RUNNING]
    if borrowers:
        ids = {id(r) for r in borrowers}
        ready = [r for r in ready if id(r) not in ids]
        throttled = [r for r in throttled if id(r) not in ids]
    return LendTail(ready, throttled, borrowers, chosen, at_ceiling)


def borrowers_of(requests: list[Request], st: OutputRateState, step: StepLedger,
                 at_ceiling: list[str]) -> list[Request]:
    """Those of ``requests`` that may borrow in this step (their ceilings
    allow), in lending order (``borrowing.Lender.order``); the users of the
    others whose ceilings are spent are added to ``at_ceiling``."""
    lender = st.lender
    may = lender.may_borrow
    ceil = step.charges.ceiling_left
    may_borrow = [r for r in requests if may(r.output_rate_user)]
    borrowers = lender.order([r for r in may_borrow if ceil(r.output_rate_user) > 0])
    if len(borrowers) < len(may_borrow):  # the others' ceilings are spent
        at_ceiling.extend(r.output_rate_user for r in may_borrow
                          if ceil(r.output_rate_user) <= 0)
    return borrowers


def admit_room(request: Request, n_running: int, st: OutputRateState, step: StepLedger) -> bool:
    """Whether a waiting request out of guaranteed budget may be admitted in
    this step: room for its prompt (``LendingBook.room``), and a resident
    slot beside those kept for other waiting requests (of ``n_running``)."""
    book = step.lending
    return (st.resident_fits(n_running, book.kept_slots - (request.request_id in book.kept))
            and book.room(prompt_left(request), request.request_id))


def admit_borrower(request: Request, n_running: int, st: OutputRateState,
                   step: StepLedger) -> bool:
    """Whether a waiting request out of guaranteed budget is admitted to
    borrow in this step (then flagged for the charge point)."""
    book = step.lending
    user = request.output_rate_user
    if not (book.lends and st.lender.may_borrow(user)
            and admit_room(request, n_running, st, step)):
        return False
    if book.chose:  # chosen in lending order, or not in this step
        return step.lent_now(request)
    charges = step.charges
    if charges.ceiling_left(user) > 0:
        request.output_rate_borrow_step = step.no
        return True
    charges.at_ceiling.add(user)
    return False
