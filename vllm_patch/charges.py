"""How a step charges its users: one small protocol (``Charges``), three
variants, chosen once when the limiter and the lender are set (at start-up,
and again when reloaded limits start or stop borrowing: ``choose``) and made
new with each step's ledger (``ledger.StepLedger.charges``).

* ``DirectCharges``: the plain limiter without borrowing. Its GCRA runs on
  the user's state kept on the request (``limiter.take_from``: no lookup by
  user at the charge point), a refund gives the token back at once, and
  there is nothing to settle.
* ``SettledCharges``: any other limiter (shared budgets), and the plain one
  under ``CeilingCharges``. Each user's budget is asked once per step
  (``allow``, and ``allow_start`` as found), taken from and given back in
  the step, and the net charge of each user settled once when it ends
  (``OutputRateLimiter.settle``: the same as one ``try_take`` per charge and
  one ``refund`` per give-back).
* ``CeilingCharges``: borrowing (a limit with a ceiling), over a settled
  one. A user's tokens in a step are its budget and its ceiling's, the
  smaller (``left``); every token it takes, guaranteed or lent
  (``lend``, within the step's room, ``ledger.LendingBook``), is off its
  ceiling; a waiting request taking its user's turn has a token of both set
  aside (``set_aside``); the ceilings and the borrowing counters are
  settled when the step ends (``borrowing.Lender.settle``).

Just in time (no ceiling), a step that keeps the prompts' tokens of waiting
requests with budget wraps its charges in ``RoomCharges``: the same charges,
and every token given counted against the kept room (``lending.plan_jit_room``).

The scheduler calls the protocol at the charge point (``take``, ``lend``,
``give``), wherever a user's tokens left are read (``left``), at the
refund point (``refund``) and when the step ends (``settle``).

Pure logic: imports nothing from vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from vllm_output_rate.borrowing import NO_CEILING
from vllm_output_rate.limiter import OutputRateLimiter, take_from

if TYPE_CHECKING:
    from vllm_output_rate.borrowing import Lender
    from vllm_output_rate.ledger import OutputRateState, StepLedger
    from vllm_output_rate.observers import StepReport

Request = Any


class Charges(Protocol):
    """One step's charges (see the module)."""

    #: whether ``give`` keeps books (a lending step's room): the charge
    #: point calls it only then (a call per request a step saved otherwise)
    gives: ClassVar[bool]

    def left(self, user: str) -> int:
        """How many tokens ``user`` may still take in this step."""

    def take(self, request: Request, user: str) -> bool:
        """Charge ``user`` one token for ``request`` now, if it has one left."""

    def lend(self, request: Request, user: str, n: int) -> bool:
        """Lend ``request`` (of ``user``, out of budget) this step's token,
        its ``n`` tokens fitting the step's room (borrowing only)."""

    def give(self, request: Request, n: int) -> None:
        """The charge point gave ``request`` ``n`` tokens of the step (its
        room, with borrowing)."""

    def refund(self, user: str) -> None:
        """Give back a token charged in this step and not dispatched."""

    def settle(self, report: StepReport, scheduled: dict[str, int]) -> None:
        """The step ends (``scheduled``: vLLM's ``num_scheduled_tokens``):
        put its net charges on the limiter (and the ceilings)."""


def choose(st: OutputRateState, limiter: OutputRateLimiter, lender: Lender | None) -> None:
    """Set the state's limiter and lender, and the charges they make."""
    st.limiter, st.lender = limiter, lender
    if lender is not None:
        st.charges = CeilingCharges
    elif type(limiter) is OutputRateLimiter:
        st.charges = DirectCharges
    else:
        st.charges = SettledCharges


class DirectCharges:
    """The plain limiter, charged token by token (see the module)."""

    __slots__ = ("limiter", "now")
    gives: ClassVar[bool] = False

    def __init__(self, st: OutputRateState, step: StepLedger) -> None:
        self.limiter = st.limiter
        self.now = step.now

    def left(self, user: str) -> int:
        return self.limiter.available(user, self.now)

    def take(self, request: Request, user: str) -> bool:
        # the GCRA on the user's state kept on the request: no lookup by
        # user (what costs here is memory the step has not touched yet)
        state = request.output_rate_state
        if state is None:
            state = request.output_rate_state = self.limiter.state_of(user, self.now)
        return take_from(state, self.now)

    def lend(self, request: Request, user: str, n: int) -> bool:
        return False

    def give(self, request: Request, n: int) -> None:
        pass

    def refund(self, user: str) -> None:
        self.limiter.refund(user)

    def settle(self, report: StepReport, scheduled: dict[str, int]) -> None:
        pass  # (charged as the step went)


class SettledCharges:
    """Each user's budget asked once per step, settled once (see the module)."""

    __slots__ = ("limiter", "now", "allow", "allow_start")
    gives: ClassVar[bool] = False

    def __init__(self, st: OutputRateState, step: StepLedger) -> None:
        self.limiter = st.limiter
        self.now = step.now
        #: user -> tokens it may still take in this step, and what it could
        #: take at the step's start
        self.allow: dict[str, int] = {}
        self.allow_start: dict[str, int] = {}

    def left(self, user: str) -> int:
        left = self.allow.get(user)
        if left is None:  # first look at this user in this step
            left = self.limiter.available(user, self.now)
            self.allow[user] = self.allow_start[user] = left
        return left

    def take(self, request: Request, user: str) -> bool:
        if self.left(user) <= 0:
            return False
        self.allow[user] -= 1
        return True

    def lend(self, request: Request, user: str, n: int) -> bool:
        return False

    def give(self, request: Request, n: int) -> None:
        pass

    def refund(self, user: str) -> None:
        self.allow[user] += 1

    def settle(self, report: StepReport, scheduled: dict[str, int]) -> None:
        # the net charge of each user, taken at the step's clock reading
        allow = self.allow
        taken = {user: n for user, start in self.allow_start.items()
                 if (n := start - allow[user]) > 0}
        report.charged_by_user = taken
        self.limiter.settle(self.now, taken)


class CeilingCharges(SettledCharges):
    """Guaranteed budgets settled once per step, under each user's ceiling,
    and tokens lent within the step's room (see the module)."""

    __slots__ = ("lender", "step", "ceil_left", "ceil_start", "lent", "at_ceiling")
    gives: ClassVar[bool] = True

    def __init__(self, st: OutputRateState, step: StepLedger) -> None:
        super().__init__(st, step)
        self.lender = st.lender
        #: (its ``lending``: the step's room, ``lending.plan_lending``; the
        #: charge point gives from it and lends within it)
        self.step = step
        #: user -> tokens its ceiling still allows in this step, and at its start
        self.ceil_left: dict[str, int] = {}
        self.ceil_start: dict[str, int] = {}
        #: user -> tokens lent in this step
        self.lent: dict[str, int] = {}
        #: users whose ceiling refused them in this step
        self.at_ceiling: set[str] = set()

    def ceiling_left(self, user: str) -> int:
        """How many tokens ``user``'s ceiling still allows in this step."""
        left = self.ceil_left.get(user)
        if left is None:
            left = self.lender.available(user, self.now)
            self.ceil_left[user] = self.ceil_start[user] = left
        return left

    def left(self, user: str) -> int:
        return min(SettledCharges.left(self, user), self.ceiling_left(user))

    def take(self, request: Request, user: str) -> bool:
        if self.left(user) <= 0:
            return False
        self.allow[user] -= 1
        self.ceil_left[user] -= 1
        return True

    def lend(self, request: Request, user: str, n: int) -> bool:
        """This step's token to a request out of guaranteed budget, if it may
        borrow in the step (``lending``), the step has room for it (slots,
        tokens, KV blocks) and its ceiling allows (a waiting one was checked
        at admission the same way)."""
        return (self.step.lent_now(request)
                and self.step.lending.room(n, request.request_id)
                and self.borrow(user))

    def borrow(self, user: str) -> bool:
        """Lend ``user`` one token of this step, if its ceiling allows."""
        if self.ceiling_left(user) <= 0:
            self.at_ceiling.add(user)
            return False
        self.ceil_left[user] -= 1
        self.lent[user] = self.lent.get(user, 0) + 1
        return True

    def give(self, request: Request, n: int) -> None:
        self.step.lending.give(request.request_id, n)

    def refund(self, user: str) -> None:
        self.allow[user] += 1
        if user in self.ceil_left:  # a guaranteed token given back
            self.ceil_left[user] += 1

    def set_aside(self, req_id: str, user: str) -> None:
        """A waiting request taking its user's turn (``residency``): a token
        of its user's budget and ceiling set aside for it, which its user's
        resident streams would take first even as borrowers."""
        self.left(user)
        self.allow[user] -= 1
        self.ceil_left[user] -= 1
        self.step.turn_ids[req_id] = user

    def put_back(self, req_id: str) -> None:
        """vLLM's waiting loop reaches a request taking its user's turn (or
        the step ends first): the token set aside for it is its user's again."""
        user = self.step.turn_ids.pop(req_id, None)
        if user is not None:
            self.allow[user] += 1
            self.ceil_left[user] += 1

    def settle(self, report: StepReport, scheduled: dict[str, int]) -> None:
        """Tokens set aside for turns vLLM's waiting loop never reached go
        back uncharged, lent ones not dispatched are given back; every token
        goes on its user's ceiling, lent ones on the borrowing counters; then
        the guaranteed budgets are settled."""
        for req_id in list(self.step.turn_ids):
            self.put_back(req_id)
        borrowed, ceil_left, lent = report.borrowed, self.ceil_left, self.lent
        if self.at_ceiling:
            report.at_ceiling = list(self.at_ceiling)
        for req_id in [r for r in borrowed if r not in scheduled]:
            user = borrowed.pop(req_id)
            ceil_left[user] += 1
            lent[user] -= 1
        spent = {user: start - ceil_left[user] for user, start in self.ceil_start.items()
                 if start < NO_CEILING and start > ceil_left[user]}
        self.lender.settle(self.now, spent, lent)
        SettledCharges.settle(self, report, scheduled)


class RoomCharges:
    """Just in time, a step that keeps tokens for the prompts of waiting
    requests with budget (``lending.plan_jit_room``): the step's charges
    (``inner``, its methods as they are) and every token the charge point
    gives off the kept room's book (``ledger.LendingBook``), so that a
    prefill chunk of a user out of output budget takes only the room not
    kept (``lending.jit_room``)."""

    __slots__ = ("left", "take", "lend", "refund", "settle", "book")
    gives: ClassVar[bool] = True

    def __init__(self, inner: Charges, book: Any) -> None:
        self.left, self.take, self.lend = inner.left, inner.take, inner.lend
        self.refund, self.settle = inner.refund, inner.settle
        self.book = book

    def give(self, request: Request, n: int) -> None:
        self.book.give(request.request_id, n)
