"""Per-user GCRA (Generic Cell Rate Algorithm) output-token limiter.

Pure logic: imports nothing from vLLM. The scheduler asks it, once per
sampling step of a request, whether the request's user may have one more
output token now.

One state per user: the theoretical arrival time (TAT) of the next token.
A token is allowed at ``now`` when ``TAT - now <= burst``; on allow
``TAT = max(TAT, now) + 1/rate``. A refused call changes nothing.

All times of a user are stored multiplied by that user's rate, written as a
fraction ``num/den`` tokens per second: a time of ``t`` ns is stored as
``t * num`` and "advance by 1/rate seconds" becomes "add ``den * 1e9``".
Everything is integer arithmetic, so fractional limits such as 0.5 tok/s
are exact and nothing drifts however long a user stays throttled.

Bound: in any window of W seconds a user gets at most
``floor((W + burst) * rate) + 1`` tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from fractions import Fraction

NS_PER_S = 1_000_000_000
#: The burst a user may run ahead of its even spacing. It must cover at
#: least one engine step, or budget accrued between two steps expires.
BURST_NS = 100_000_000

Clock = Callable[[], int]


def monotonic_clock() -> int:
    """The default clock: monotonic nanoseconds."""
    return time.monotonic_ns()


class _UserState:
    """GCRA state of one user, in rate-scaled units. ``num``, ``step`` and
    ``burst`` depend on the rate only: users of one rate share the very
    same int objects (``OutputRateLimiter._scales``), so that charging many
    users in one step reads a few hot objects and only each one's ``tat``."""

    __slots__ = ("num", "step", "burst", "tat")

    def __init__(self, scales: tuple[int, int, int], tat: int) -> None:
        self.num, self.step, self.burst = scales
        self.tat = tat


def take_from(st: _UserState, now_ns: int) -> bool:
    """The GCRA's one step on a user's state (``OutputRateLimiter.state_of``):
    take one token at ``now_ns`` if ``TAT - now <= burst`` (then ``TAT =
    max(TAT, now) + 1/rate``); a refusal leaves the state as it was. The
    only place the arithmetic is written: ``try_take`` looks the state up
    and calls it, the scheduler's charge point calls it on the state it keeps
    on the request (no lookup by user: a module function, no method)."""
    now = now_ns * st.num
    tat = st.tat
    if tat - now > st.burst:
        return False
    st.tat = (tat if tat > now else now) + st.step
    return True


class OutputRateLimiter:
    """Output tokens per second per user, shared by all of a user's requests.

    The limiter only keeps the books. Who asks first and what happens to a
    refused request is the scheduler's business.
    """

    def __init__(
        self,
        default_rate: Fraction,
        user_rates: Mapping[str, Fraction] | None = None,
        burst_ns: int = BURST_NS,
    ) -> None:
        if default_rate <= 0:
            raise ValueError(f"default rate must be positive, got {default_rate}")
        if burst_ns < 0:
            raise ValueError(f"burst must not be negative, got {burst_ns}")
        self.default_rate = Fraction(default_rate)
        self.user_rates = {u: Fraction(r) for u, r in (user_rates or {}).items()}
        self.burst_ns = burst_ns
        self._users: dict[str, _UserState] = {}
        #: rate -> (num, step, burst) of its users' states (one per rate in
        #: force: the configured limits, so bounded by the config)
        self._scales: dict[Fraction, tuple[int, int, int]] = {}

    # -- queries ---------------------------------------------------------

    def rate_of(self, user: str) -> Fraction:
        """The configured limit of ``user`` in tokens per second."""
        return self.user_rates.get(user, self.default_rate)

    def __len__(self) -> int:
        """Number of users with live state."""
        return len(self._users)

    def __contains__(self, user: str) -> bool:
        return user in self._users

    def tat_ns(self, user: str) -> int | None:
        """The user's theoretical arrival time in ns (rounded up), or None."""
        st = self._users.get(user)
        return None if st is None else -(-st.tat // st.num)

    def ready_at_ns(self, user: str) -> int:
        """Earliest time at which ``try_take(user)`` can succeed.

        ``TAT - burst`` rounded up, so that waiting until it never wakes too
        early. 0 for a user without state (ready at once).
        """
        st = self._users.get(user)
        if st is None:
            return 0
        return -(-(st.tat - st.burst) // st.num)

    def available(self, user: str, now_ns: int) -> int:
        """How many ``try_take`` calls at ``now_ns`` would succeed in a row."""
        st = self._users.get(user)
        if st is None:
            rate = self.rate_of(user)
            return self.burst_ns * rate.numerator // (rate.denominator * NS_PER_S) + 1
        now = now_ns * st.num
        tat = st.tat if st.tat > now else now
        slack = st.burst - (tat - now)
        return slack // st.step + 1 if slack >= 0 else 0

    # -- updates ---------------------------------------------------------

    def state_of(self, user: str, now_ns: int) -> _UserState:
        """The user's state object, made at ``now_ns`` if it has none (a
        new state changes nothing observable: it is an idle user's). It is
        the user's until ``set_limits`` changes its rate or
        ``cleanup_idle_users`` drops it; the scheduler keeps it on the
        user's requests (``take_from``) and forgets it then."""
        st = self._users.get(user)
        return self._new_state(user, now_ns) if st is None else st

    def try_take(self, user: str, now_ns: int) -> bool:
        """Take one token for ``user`` at ``now_ns`` if the budget allows."""
        st = self._users.get(user)
        if st is None:
            st = self._new_state(user, now_ns)
        return take_from(st, now_ns)

    def take(self, user: str, now_ns: int, n: int) -> None:
        """Take ``n`` tokens at ``now_ns`` at once (``n <= available(...)``).

        The same as ``n`` successful ``try_take`` calls at ``now_ns``.
        """
        if n <= 0:
            return
        st = self._users.get(user)
        if st is None:
            st = self._new_state(user, now_ns)
        now = now_ns * st.num
        st.tat = (st.tat if st.tat > now else now) + n * st.step

    def settle(self, now_ns: int, taken: Mapping[str, int]) -> None:
        """``take(user, now_ns, n)`` for every ``user, n`` in ``taken``: a
        step's net charges in one call (the scheduler settles any limiter
        but this plain one so; this one it charges token by token, with
        ``try_take`` inlined in its charge hook)."""
        users = self._users
        for user, n in taken.items():
            if n <= 0:
                continue
            st = users.get(user)
            if st is None:
                st = self._new_state(user, now_ns)
            now = now_ns * st.num
            st.tat = (st.tat if st.tat > now else now) + n * st.step

    def refund(self, user: str, n: int = 1) -> None:
        """Give back ``n`` tokens taken at once or by ``try_take`` (TAT -=
        n/rate)."""
        st = self._users.get(user)
        if st is not None:
            st.tat -= n * st.step

    def set_limits(
        self,
        default_rate: Fraction,
        user_rates: Mapping[str, Fraction] | None,
        now_ns: int,
    ) -> list[str]:
        """Put new limits in force at ``now_ns`` (a step boundary).

        A user with live state keeps its debt counted in tokens: ``(TAT -
        now) * rate`` is the same before and after (rounded up, never in the
        user's favour), so a user who was ahead of its old limit by ``d``
        tokens is ahead of the new one by ``d`` tokens. In any window
        ``[a, b]`` around the change at ``t`` the user then gets at most
        ``old * (t - a) + new * (b - t + burst) + 1`` tokens: what the old
        limit allows up to the change, the new one after it, plus one.
        Returns the users with live state whose limit changed.
        """
        if default_rate <= 0:
            raise ValueError(f"default rate must be positive, got {default_rate}")
        self.default_rate = Fraction(default_rate)
        self.user_rates = {u: Fraction(r) for u, r in (user_rates or {}).items()}
        self._scales = {}
        changed: list[str] = []
        for user, st in self._users.items():
            rate = self.rate_of(user)
            step = rate.denominator * NS_PER_S
            if rate.numerator == st.num and step == st.step:
                continue
            changed.append(user)
            debt = st.tat - now_ns * st.num  # old rate-scaled units
            new = _UserState(self._scales_of(rate), now_ns * rate.numerator)
            if debt > 0:
                # debt / st.step tokens, in the new units: * step, rounded up
                new.tat += -(-debt * step // st.step)
            self._users[user] = new
        return changed

    def cleanup_idle_users(self, now_ns: int) -> list[str]:
        """Drop users whose TAT is not ahead of ``now_ns``.

        Such a user behaves exactly like a new one (``max(TAT, now) = now``),
        so dropping it changes nothing observable. Returns the dropped users.
        """
        idle = [u for u, st in self._users.items() if st.tat <= now_ns * st.num]
        for user in idle:
            del self._users[user]
        return idle

    def _scales_of(self, rate: Fraction) -> tuple[int, int, int]:
        scales = self._scales.get(rate)
        if scales is None:
            scales = self._scales[rate] = (
                rate.numerator, rate.denominator * NS_PER_S, self.burst_ns * rate.numerator)
        return scales

    def _new_state(self, user: str, now_ns: int) -> _UserState:
        rate = self.rate_of(user)
        st = _UserState(self._scales_of(rate), now_ns * rate.numerator)
        self._users[user] = st
        return st
