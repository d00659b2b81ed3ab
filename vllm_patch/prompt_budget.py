"""Prompt budgets: prompt tokens computed per second per user (issue 48).

A user's ``prompt_rate`` (its own, its tier's, or the default's:
``OutputRateConfig.prompt_rate_of``) is a GCRA of the same arithmetic and
burst as the output limit (``limiter.OutputRateLimiter``), charged in prompt
tokens when a prefill chunk is dispatched and given back at the step's
single refund point when it is not. Prefix-cache hits are free: the charge
point sees only the tokens a chunk computes.

- With chunked prefill a chunk is cut to what the budget allows now
  (``grant``): in any window of W seconds a user's prompts compute at most
  ``floor((W + burst) * prompt_rate) + 1`` tokens, the output limit's bound.
- Without it a prompt is computed whole or not at all (``grant_whole``): it
  goes when the user's budget is not in debt and takes the whole prompt at
  once, so the bound gains the largest prompt, less one:
  ``floor((W + burst) * prompt_rate) + max_prompt``.

Nothing is refused: a chunk the budget does not cover waits for it. The
grants of a step are taken from what each user could take when the step
first looked (``available``), given back at the refund point, and settled
on the budget once when the step ends (``settle``): the same as charging
and refunding each chunk at once.

With shared budgets (``--output-rate-shared-state``) a user's prompt budget
is fleet-wide: its limiter is leased beside the user's output rate
(``shared_limiter.SharedBudgetLimiter.second_budget``, the ``make`` of
``PromptBudgets``), so the fleet computes at most ``floor((W + H + B) *
prompt_rate) + 1`` prompt tokens of the user in any W seconds
(``fleet_math``). Only with chunked prefill: a prompt computed whole may
spend more than an engine holds (``check_shared``).

Pure logic: imports nothing from vLLM.
"""

from __future__ import annotations

from collections.abc import Callable
from fractions import Fraction
from typing import TYPE_CHECKING

from vllm_output_rate.limiter import BURST_NS, OutputRateLimiter

if TYPE_CHECKING:
    from vllm_output_rate.config import OutputRateConfig

#: Makes the prompt budgets' limiter from a default rate and the users' rates.
MakeLimiter = Callable[[Fraction, dict[str, Fraction]], OutputRateLimiter]


def check_shared(config: OutputRateConfig, chunked: bool) -> str | None:
    """What is wrong with prompt budgets in ``config`` on an engine with
    shared budgets (``chunked``: with chunked prefill), or None: without
    chunked prefill a prompt is computed whole, beyond what an engine holds
    of the fleet's budget, so they are refused there."""
    if config.shared_state is None or chunked or not config.prompt_budgets:
        return None
    return ("prompt budgets (prompt_rate) with shared budgets need chunked prefill "
            "(vLLM's default; --enable-chunked-prefill): a prompt computed whole would "
            "spend more of the fleet's budget than an engine holds")


def prompt_work(num_prompt_tokens: int, num_computed_tokens: int, num_new_tokens: int) -> int:
    """The prompt tokens a chunk of ``num_new_tokens`` from position
    ``num_computed_tokens`` computes: the part of it within the prompt (a
    resumed request recomputing its own output tokens is not charged for
    them; a decode step computes none)."""
    end = min(num_computed_tokens + num_new_tokens, num_prompt_tokens)
    return max(0, end - num_computed_tokens)


class PromptBudgets:
    """The prompt budgets of one engine's users, from one configuration."""

    def __init__(self, config: OutputRateConfig, burst_ns: int = BURST_NS,
                 make: MakeLimiter | None = None) -> None:
        self.burst_ns = burst_ns
        self.config = config
        self._limiter = (make or self._plain)(*self._rates(config))
        #: user -> budgeted or not, for the configuration in force
        self._budgeted: dict[str, bool] = {}
        #: the step's grants: user -> prompt tokens it may still take, and
        #: what it could take when the step first looked (``settle``)
        self._left: dict[str, int] = {}
        self._start: dict[str, int] = {}
        self._step_ns: int | None = None

    def _plain(self, default: Fraction, rates: dict[str, Fraction]) -> OutputRateLimiter:
        return OutputRateLimiter(default, rates, self.burst_ns)

    @staticmethod
    def _rates(config: OutputRateConfig) -> tuple[Fraction, dict[str, Fraction]]:
        default = config.default_prompt_rate
        default = default if isinstance(default, Fraction) else None
        rates = {u: r for u in config.user_rates
                 if (r := config.prompt_rate_of(u)) is not None}
        # (users without a budget never reach the limiter: its default then
        # only has to be a rate)
        return default if default is not None else Fraction(1), rates

    def budgeted(self, user: str) -> bool:
        """Whether ``user``'s prompts are budgeted."""
        known = self._budgeted.get(user)
        if known is None:
            if len(self._budgeted) > 65536:  # user ids are unbounded: forget, then ask again
                self._budgeted.clear()
            known = self._budgeted[user] = self.config.prompt_rate_of(user) is not None
        return known

    def rate_of(self, user: str) -> Fraction | None:
        return self.config.prompt_rate_of(user)

    def available(self, user: str, now_ns: int) -> int:
        """Prompt tokens ``user`` may compute at ``now_ns`` (a large number
        for a user without a budget), less what this step granted it."""
        if not self.budgeted(user):
            return 1 << 62
        if now_ns != self._step_ns:
            self.settle(now_ns)  # (a step that ended without ``settle``)
        left = self._left.get(user)
        if left is None:  # the step's first look at this user
            left = self._left[user] = self._start[user] = self._limiter.available(user, now_ns)
        return left if left > 0 else 0

    def grant(self, user: str, now_ns: int, want: int) -> int:
        """Chunked prefill: take up to ``want`` prompt tokens now; how many."""
        if want <= 0 or not self.budgeted(user):
            return max(want, 0)
        n = min(want, self.available(user, now_ns))
        self._left[user] -= n
        return n

    def grant_whole(self, user: str, now_ns: int, want: int) -> bool:
        """Without chunked prefill: the whole ``want`` now (the budget may go
        into debt by it) if the budget is not in debt, else nothing."""
        if want <= 0 or not self.budgeted(user):
            return True
        if self.available(user, now_ns) < 1:
            return False
        self._left[user] -= want
        return True

    def refund(self, user: str, n: int) -> None:
        """Give back ``n`` prompt tokens granted in this step and not computed."""
        if n > 0 and self.budgeted(user) and user in self._left:
            self._left[user] += n

    def settle(self, now_ns: int) -> None:
        """The step ends (or the next one begins at ``now_ns``): its net
        grants put on the budgets, at the step's clock reading."""
        left, start = self._left, self._start
        if start:
            taken = {u: n for u, s in start.items() if (n := s - left[u]) > 0}
            if taken:
                self._limiter.settle(self._step_ns, taken)
            left.clear()
            start.clear()
        self._step_ns = now_ns

    def finish_step(self, charged: dict[str, tuple[str, int]], waits: dict[str, int],
                    now_ns: int, scheduled: dict[str, int]) -> None:
        """A step's refund point (``core``): what was granted to a chunk not
        dispatched goes back (``charged``: request id -> (user, tokens)
        granted; ``scheduled``: vLLM's ``num_scheduled_tokens``), the net
        grants are settled (``settle``); users put off learn when to come
        again (``waits``: user -> that time, filled in here)."""
        for req_id, (user, n) in charged.items():
            if req_id not in scheduled:
                self.refund(user, n)
        self.settle(now_ns)
        for user in list(waits):
            at = waits[user] = self.ready_at_ns(user)
            if at <= now_ns:
                # its budget is there: a chunk it cut went no further for
                # another reason (just in time, its output budget), whose
                # own time wakes the engine
                del waits[user]

    def eta_ns(self, user: str, now_ns: int, n: int) -> int:
        """How long (ns) from ``now_ns`` until ``user``'s budget has granted
        ``n`` more prompt tokens (0: now, or no budget)."""
        if n <= 0 or not self.budgeted(user):
            return 0
        short = n - self.available(user, now_ns)
        if short <= 0:
            return 0
        rate = self.config.prompt_rate_of(user)
        return -(-short * rate.denominator * 1_000_000_000 // rate.numerator)

    def ready_at_ns(self, user: str) -> int:
        """The earliest time ``user`` may compute a prompt token (0: now).
        Changes nothing (the telemetry's worker reads it too)."""
        return self._limiter.ready_at_ns(user) if self.rate_of(user) is not None else 0

    def set_config(self, config: OutputRateConfig, now_ns: int) -> None:
        """Put reloaded limits in force (at a step boundary): each user keeps
        its debt in tokens (``OutputRateLimiter.set_limits``)."""
        self.settle(now_ns)
        self._limiter.set_limits(*self._rates(config), now_ns)
        self.config = config
        self._budgeted.clear()

    def close(self) -> None:
        """Prompt budgets stop (reloaded limits): a fleet-wide limiter
        leaves its lease thread."""
        close = getattr(self._limiter, "close", None)
        if close is not None:
            close()

    def cleanup_idle_users(self, now_ns: int) -> list[str]:
        return self._limiter.cleanup_idle_users(now_ns)

    def __len__(self) -> int:
        return len(self._limiter)
