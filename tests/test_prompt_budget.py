"""Prompt budgets (``prompt_budget``): who is budgeted, the prompt work of a
chunk, grants cut to the budget (chunked prefill) or whole (without), the
refund, reloads; the bound in every window by property tests."""

from __future__ import annotations

import math
from fractions import Fraction

from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_output_rate.config import OutputRateConfig, parse_limits_document
from vllm_output_rate.limiter import BURST_NS, NS_PER_S
from vllm_output_rate.prompt_budget import PromptBudgets, prompt_work

T0 = 5 * NS_PER_S
BURST = Fraction(BURST_NS, NS_PER_S)

FILE = b"""\
default: {rate: 100, prompt_rate: 2000}
tiers: {free: {rate: 5, prompt_rate: 500}}
users: {rag-co: {rate: 50, prompt_rate: 4000}, bob: free, eve: {rate: 3, prompt_rate: unlimited}}
"""


def budgets(text: bytes = FILE) -> PromptBudgets:
    return PromptBudgets(parse_limits_document(text, "limits.yaml"))


def test_the_prompt_work_of_a_chunk():
    assert prompt_work(100, 0, 40) == 40  # a first chunk
    assert prompt_work(100, 80, 20) == 20  # the last, which samples
    assert prompt_work(100, 100, 1) == 0  # a decode step
    assert prompt_work(100, 60, 50) == 40  # a resumed request: its outputs are free
    assert prompt_work(100, 120, 5) == 0


def test_who_is_budgeted_and_at_what_rate():
    b = budgets()
    assert [b.budgeted(u) for u in ("rag-co", "bob", "eve", "zed")] == [True, True, False, True]
    assert [b.rate_of(u) for u in ("rag-co", "bob", "zed")] == [4000, 500, 2000]
    assert b.grant("eve", T0, 10**6) == 10**6 and b.grant_whole("eve", T0, 10**6)
    none = PromptBudgets(OutputRateConfig(Fraction(20)))
    assert not none.budgeted("anyone") and none.grant("anyone", T0, 5000) == 5000


def test_a_grant_is_cut_to_the_burst_then_to_the_rate():
    b = budgets()
    # 4000/s with a 0.1 s burst: 401 at once, then 4000/s
    assert b.grant("rag-co", T0, 3800) == 401
    assert b.grant("rag-co", T0, 3800) == 0
    assert b.grant("rag-co", T0 + NS_PER_S // 40, 3800) == 100  # 25 ms later
    assert b.ready_at_ns("rag-co") > T0


def test_a_refund_gives_the_tokens_back():
    b = budgets()
    assert b.grant("bob", T0, 1000) == 51  # 500/s: 50 + 1
    b.refund("bob", 51)
    assert b.grant("bob", T0, 1000) == 51


def test_without_chunks_a_prompt_goes_whole_then_the_next_waits_out_the_debt():
    b = budgets()
    assert b.grant_whole("bob", T0, 3800)  # 500/s: 7.6 s of debt
    assert not b.grant_whole("bob", T0 + 7 * NS_PER_S, 10)
    assert b.grant_whole("bob", T0 + 8 * NS_PER_S, 10)


def test_a_reload_keeps_the_debt_in_tokens_and_new_rates_apply():
    b = budgets()
    assert b.grant_whole("bob", T0, 1000)  # 2 s of debt at 500/s
    b.set_config(parse_limits_document(FILE.replace(b"prompt_rate: 500", b"prompt_rate: 1000"),
                                       "limits.yaml"), T0)
    assert b.rate_of("bob") == 1000
    # 1000 tokens of debt at 1000/s: ready one second on, less the burst
    assert b.grant("bob", T0 + NS_PER_S - BURST_NS - 1, 10) == 0
    assert b.grant("bob", T0 + NS_PER_S - BURST_NS, 10) == 1
    b.set_config(parse_limits_document(FILE.replace(b"bob: free", b"bob: {rate: 5}"),
                                       "limits.yaml"), T0)
    assert b.rate_of("bob") == 2000  # no own prompt_rate: the default's


rates = st.fractions(min_value=Fraction(1, 2), max_value=Fraction(20000)).map(
    lambda f: f.limit_denominator(1000))
steps = st.lists(st.tuples(st.integers(0, NS_PER_S // 2), st.integers(1, 5000)),
                 min_size=1, max_size=60)


def _worst(grants: list[tuple[int, int]], rate: Fraction, extra: int) -> None:
    """Every window [t_i, t_j] of ``grants`` (ns, tokens) within the bound."""
    grants = [g for g in grants if g[1] > 0]
    for i in range(len(grants)):
        total = 0
        for j in range(i, len(grants)):
            total += grants[j][1]
            window = Fraction(grants[j][0] - grants[i][0], NS_PER_S)
            assert total <= math.floor((window + BURST) * rate) + extra, (i, j, total)


@settings(max_examples=150, deadline=None)
@given(rate=rates, steps=steps)
def test_chunked_grants_hold_the_output_limits_bound(rate, steps):
    """Chunks cut to the budget: in every window, at most
    floor((W + burst) * rate) + 1 prompt tokens, as the output limit."""
    b = PromptBudgets(OutputRateConfig(Fraction(20), default_prompt_rate=rate))
    t, grants = T0, []
    for gap, want in steps:
        t += gap
        grants.append((t, b.grant("u", t, want)))
    _worst(grants, rate, 1)


@settings(max_examples=150, deadline=None)
@given(rate=rates, steps=steps)
def test_whole_prompts_hold_the_bound_plus_the_largest_prompt(rate, steps):
    """Without chunks: at most floor((W + burst) * rate) + the largest prompt."""
    b = PromptBudgets(OutputRateConfig(Fraction(20), default_prompt_rate=rate))
    t, grants = T0, []
    for gap, want in steps:
        t += gap
        grants.append((t, want if b.grant_whole("u", t, want) else 0))
    _worst(grants, rate, max(w for _, w in steps))


@settings(max_examples=100, deadline=None)
@given(rate=rates, steps=steps)
def test_a_refunded_grant_changes_nothing_later(rate, steps):
    """Granting then refunding in the same instant leaves the budget as it was."""
    a = PromptBudgets(OutputRateConfig(Fraction(20), default_prompt_rate=rate))
    b = PromptBudgets(OutputRateConfig(Fraction(20), default_prompt_rate=rate))
    t = T0
    for k, (gap, want) in enumerate(steps):
        t += gap
        if k % 3 == 0:
            b.refund("u", b.grant("u", t, want))
        assert a.grant("u", t, want) == b.grant("u", t, want)
