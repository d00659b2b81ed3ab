"""A user's prompts under the real vLLM scheduler (issue 48), in virtual time.

- Just in time (the default without borrowing): the prompt of a user with
  no output budget is not computed (no prefill, no KV) until its user may
  sample; ``--output-rate-prefill-ahead`` computes it ahead, short of its
  first token, as before.
- Prompt budgets (``prompt_rate``): each prefill chunk is cut to its user's
  budget (chunked prefill) or waits whole (without); the prompt tokens
  computed hold the bound in every window; prefix-cache hits are free; the
  other users' requests are admitted and decoded as before.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.v1.request import RequestStatus

from harness import Driver, VirtualClock, make_request, make_scheduler, observe_steps
from vllm_output_rate.limiter import BURST_NS, NS_PER_S

MODES = [False, True]


def limits(default, prompt=None, prefill_ahead=False, prompt_rates=None, **users):
    lim = {"default_user_output_tokens_per_second": default,
           "user_output_tokens_per_second": users}
    if prompt is not None:
        lim["default_prompt_rate"] = str(prompt)
    if prompt_rates:
        lim["prompt_rates"] = {u: str(r) for u, r in prompt_rates.items()}
    if prefill_ahead:
        lim["prefill_ahead"] = True
    return lim


def setup(lim, is_async=False, step_ms=10.0, **kw):
    clock = VirtualClock()
    sched = make_scheduler(lim, clock=clock, async_scheduling=is_async, **kw)
    return sched, Driver(sched, clock, step_ms=step_ms, is_async=is_async), clock


def prefill_scheduled(drv, req_ids) -> int:
    """Tokens vLLM scheduled for ``req_ids`` over the driver's steps."""
    return sum(n for out in drv.outputs for r, n in out.num_scheduled_tokens.items()
               if r in req_ids)


# -- just in time ---------------------------------------------------------------


@pytest.mark.parametrize("is_async", MODES)
@pytest.mark.parametrize("ahead", [False, True])
def test_a_throttled_users_prompt_waits_for_its_budget(is_async, ahead):
    """User a (1 tok/s) has spent its budget; its next request's 300-token
    prompt is not computed, nor given KV, while a has none: just in time.
    With prefill ahead it is computed at once, short of its first token."""
    sched, drv, clock = setup(limits(1000, prefill_ahead=ahead, a=1), is_async)
    first = make_request("a", prompt_len=8, max_tokens=3)
    drv.add(first)
    drv.run(2)  # a's only token of its burst
    second = make_request("a", prompt_len=300, max_tokens=2)
    other = make_request("b", prompt_len=300, max_tokens=20)
    drv.add(second, other)
    drv.run(21)  # 0.21 s: a has no budget yet
    if ahead:
        assert second.num_computed_tokens == 299 and second.status == RequestStatus.RUNNING
    else:
        assert second.num_computed_tokens == 0 and second.status == RequestStatus.WAITING
        assert second not in sched.running  # no KV blocks, no slot
    assert drv.count(other.request_id) == 20  # b was never held up
    drv.run_until_done()
    assert drv.count(second.request_id) == 2 and drv.count(first.request_id) == 3


@pytest.mark.parametrize("is_async", MODES)
def test_a_flood_of_prompts_of_a_throttled_user_is_not_computed_ahead(is_async):
    """User f (2 tok/s) sends eight 400-token prompts with 2 tokens out
    each, beside user b decoding: just in time, f's prompt work over 2 s
    is at most the prompts its budget lets sample (its burst and 2 tok/s,
    a prompt each, and the one in progress); ahead, all eight at once."""
    reports = []
    for ahead in (False, True):
        sched, drv, clock = setup(limits(1000, prefill_ahead=ahead, f=2), is_async,
                                  max_num_seqs=16)
        flood = [make_request("f", prompt_len=400, max_tokens=2) for _ in range(8)]
        b = make_request("b", prompt_len=16, max_tokens=150)
        drv.add(b, *flood)
        drv.run(200)  # 2 s
        reports.append((prefill_scheduled(drv, {r.request_id for r in flood}),
                        drv.count(b.request_id)))
    (jit, b_jit), (ahead, b_ahead) = reports
    # f samples at most 1 + 2 x 2 tokens in 2 s: at most as many prompts started
    # (each 400 tokens), and the one the step after begins
    assert jit <= (1 + 2 * 2 + 1) * 400, jit
    assert ahead >= 8 * 399, ahead
    assert b_jit == b_ahead == 150


@pytest.mark.parametrize("is_async", MODES)
@pytest.mark.parametrize("prompt", [30, 47, 70])
def test_just_in_time_never_gives_more_than_the_steps_token_budget(is_async, prompt):
    """A token budget (``--max-num-batched-tokens 24``) smaller than the
    prompt: user a's second request, sent once a's burst is spent, waits,
    and is admitted when a's budget returns in time for its prompt; the
    charge
    point may then find the first chunk early, and gives that chunk, never
    the rest of the prompt (vLLM asserts the step's sum against its token
    budget: the engine would stop)."""
    sched, drv, clock = setup(limits(1000, a=10), is_async, max_num_seqs=8,
                              max_num_batched_tokens=24)
    first = make_request("a", prompt_len=8, max_tokens=2)
    second = make_request("a", prompt_len=prompt, max_tokens=3)
    drv.add(first)
    drv.run(2)  # a's burst spent, its first request done
    drv.add(second)
    drv.run_until_done()
    assert max(sum(out.num_scheduled_tokens.values()) for out in drv.outputs) <= 24
    assert drv.count(first.request_id) == 2 and drv.count(second.request_id) == 3


@pytest.mark.parametrize("is_async", MODES)
def test_a_prompt_computed_just_in_time_leaves_the_step_to_users_with_budget(is_async):
    """Issue 48 at GPU scale: user f (1 tok/s) has spent its burst; its
    2,000-token prompt is being computed just in time in chunks of the
    whole token budget (256) when user b's 100-token prompt arrives. The
    step keeps b's prompt's tokens: f's chunk is cut to the room left
    (and f's prefill takes a step more), b is computed whole and samples
    its first token in its first step (it waited for the token budget).
    User c decodes beside them all along: its token counts as given too
    (the charge point's common case for a decode included)."""
    sched, drv, clock = setup(limits(1000, f=1), is_async, max_num_seqs=8,
                              max_num_batched_tokens=256, max_model_len=4096)
    first = make_request("f", prompt_len=8, max_tokens=3)
    c = make_request("c", prompt_len=8, max_tokens=1000)
    drv.add(c, first)
    drv.run(2)  # f's burst spent
    long = make_request("f", prompt_len=2000, max_tokens=2)
    drv.add(long)
    for _ in range(500):  # until its prompt is being computed, in time for its token
        # (after the two tokens of ``first``: f has no budget while it is)
        drv.step()
        if long.num_computed_tokens >= 512:
            break
    assert long.status == RequestStatus.RUNNING and long.num_computed_tokens < 1000
    assert drv.count(long.request_id) == 0
    assert sched.output_rate.step.charges.left("f") <= 0
    b = make_request("b", prompt_len=100, max_tokens=4)
    drv.add(b)
    out = drv.step()
    assert out.num_scheduled_tokens.get(b.request_id) == 100
    assert out.num_scheduled_tokens[c.request_id] == 1
    assert out.num_scheduled_tokens[long.request_id] == 155  # the room b's prompt and c left
    # (its prompt tokens reported, and charged to a prompt budget if it had one)
    assert sched.output_rate.last_step.prompt_chunks[long.request_id] == ("f", 155, False)
    at = drv.steps
    drv.flush()
    assert [s for s, _ in drv.tokens[b.request_id]] == [at]  # its first token, in that step
    drv.run_until_done()
    assert drv.count(long.request_id) == 2 and drv.count(b.request_id) == 4


# -- prompt budgets ---------------------------------------------------------------


def _prompt_grants(sched, drv, steps, user):
    """(now_ns, prompt tokens) of ``user`` per step, from the step reports."""
    grants = []
    observe_steps(sched, lambda r: grants.append((r.now_ns, r.prompt_tokens.get(user, 0))))
    drv.run(steps)
    return grants


@pytest.mark.parametrize("is_async", MODES)
def test_a_prompt_budget_cuts_chunks_and_holds_the_bound(is_async):
    """p's prompts at 2,000 tokens/s (10 ms steps): each chunk cut to what
    its budget allows; in every window W at most floor((W + burst) x 2000)
    + 1 prompt tokens; b (no budget of prompts beyond the default's) is
    served as before; the prompts complete."""
    rate = 2000
    lim = limits(1000, prompt_rates={"p": rate}, p=1000)
    sched, drv, clock = setup(lim, is_async, max_num_seqs=16)
    prompts = [make_request("p", prompt_len=900, max_tokens=2) for _ in range(4)]
    b = make_request("b", prompt_len=900, max_tokens=40)
    drv.add(*prompts, b)
    grants = _prompt_grants(sched, drv, 250, "p")
    computed = sum(n for _, n in grants)
    assert computed == 4 * 900  # all computed, none twice (refunds included)
    grants = [g for g in grants if g[1]]
    burst = Fraction(BURST_NS, NS_PER_S)
    for i in range(len(grants)):
        total = 0
        for j in range(i, len(grants)):
            total += grants[j][1]
            window = Fraction(grants[j][0] - grants[i][0], NS_PER_S)
            assert total <= math.floor((window + burst) * rate) + 1, (i, j, total)
    # the four prompts took about 3,600 / 2,000 s: not computed in one step
    span_s = (grants[-1][0] - grants[0][0]) / NS_PER_S
    assert span_s >= (4 * 900 - rate * float(burst) - 1) / rate - 0.011
    assert drv.count(b.request_id) == 40  # b's prompt and tokens were not held up
    assert all(drv.count(r.request_id) == 2 for r in prompts)


def test_prefix_cache_hits_are_free():
    """Two requests with the same 640-token prompt: the second computes only
    what the cache did not hold (its last block at most)."""
    lim = limits(1000, prompt=100000)
    sched, drv, clock = setup(lim)
    tokens = [(i * 7) % 900 + 10 for i in range(640)]
    one = make_request("p", prompt=list(tokens), max_tokens=2)
    drv.add(one)
    grants = _prompt_grants(sched, drv, 5, "p")
    assert sum(n for _, n in grants) == 640
    two = make_request("p", prompt=list(tokens), max_tokens=2)
    drv.add(two)
    drv.run(5)  # (the same observer goes on counting)
    assert two.num_computed_tokens > 640  # its prompt computed and a token sampled
    assert sum(n for _, n in grants) - 640 <= 16  # only past the cached blocks


def test_without_chunked_prefill_a_prompt_goes_whole_or_waits():
    """No chunked prefill, 500 prompt tokens/s: a 400-token prompt goes whole
    (the budget into debt by it); the next waits out the debt, whole; b
    (another user, its own budget) is admitted meanwhile."""
    lim = limits(1000, prompt=500)
    sched, drv, clock = setup(lim, enable_chunked_prefill=False)
    a1, a2 = (make_request("a", prompt_len=400, max_tokens=2) for _ in range(2))
    b = make_request("b", prompt_len=100, max_tokens=2)
    drv.add(a1, a2, b)
    grants = _prompt_grants(sched, drv, 120, "a")
    steps_with = [(t, n) for t, n in grants if n]
    assert [n for _, n in steps_with] == [400, 400]  # whole, never cut
    gap_s = (steps_with[1][0] - steps_with[0][0]) / NS_PER_S
    assert gap_s >= 400 / 500 - 0.1 - 0.011  # the debt, less the burst
    assert drv.count(b.request_id) == 2


@pytest.mark.parametrize("is_async", MODES)
def test_a_long_prompt_users_output_budget_is_used_while_its_prompts_are_computed(is_async):
    """Issue 48's flooder: user f at 5 tok/s with a prompt budget of 4,000
    tokens/s queues 3,800-token prompts with 20 tokens out each, beside b.
    A prompt takes about a second of f's prompt budget, longer than a
    turn can wait: no turn keeps f's token from its running request while
    a prompt is computed, and the next prompt is computed just in time for
    the token after those f's running request may still take. f samples
    at least 0.95 of its rate while backlogged (it sampled 0.2 before: a
    token a prompt). A step that puts a prompt off leaves the engine a
    wake time ahead of it, never behind (an idle engine would spin)."""
    lim = limits(1000, prompt_rates={"f": 4000}, f=5)
    sched, drv, clock = setup(lim, is_async, step_ms=25.0, max_num_seqs=64,
                              max_num_active_seqs=16, max_num_batched_tokens=8192,
                              max_model_len=4096)
    flood = [make_request("f", prompt_len=3800, max_tokens=20) for _ in range(12)]
    b = make_request("b", prompt_len=16, max_tokens=100)
    start = clock()
    drv.add(b, *flood)
    idle = 0
    for _ in range(400):  # 10 s
        out = drv.step()
        if not out.num_scheduled_tokens:
            idle += 1
            step_now = sched.output_rate.step.now
            wake = sched.output_rate_wake_target_ns()
            assert wake is not None and wake > step_now
    drv.flush()
    assert idle  # (the wake times were checked)
    times = [t for r in flood for _, t in drv.tokens.get(r.request_id, ())]
    assert len(times) < 12 * 20  # still backlogged at the end
    # from 2 s (its first prompt took about a second of its prompt budget) to 10 s
    got = sum(1 for t in times if start + 2 * NS_PER_S <= t < start + 10 * NS_PER_S)
    assert got >= 0.95 * 5 * 8, got
    assert drv.count(b.request_id) == 100


# -- random workloads ---------------------------------------------------------------


@settings(max_examples=24, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**16), is_async=st.booleans(), ahead=st.booleans(),
       prompt_rate=st.sampled_from([None, 60, 400]), budget=st.sampled_from([24, 64, 2048]),
       chunked=st.booleans())
def test_random_prompt_mixes_keep_vllms_step_invariants_and_finish(seed, is_async, ahead,
                                                                   prompt_rate, budget, chunked):
    """Users at random output and prompt rates send prompts of random
    lengths (shorter and longer than the step's token budget) at random
    times: every step stays within vLLM's token budget and its running cap
    (vLLM asserts both), every request ends with all its tokens."""
    import random

    rng = random.Random(seed)
    # without chunked prefill vLLM wants the whole sequence within the budget
    max_len = 160 if chunked else min(budget, 172) - 12
    model_len = max(172, budget) if chunked else budget
    lim = limits(1000, prompt=None, prefill_ahead=ahead,
                 prompt_rates={"a": prompt_rate} if prompt_rate else None,
                 a=rng.choice([5, 20]), b=rng.choice([10, 50]))
    sched, drv, clock = setup(lim, is_async, max_num_seqs=6, max_num_batched_tokens=budget,
                              enable_chunked_prefill=chunked, max_model_len=model_len)
    reqs = []
    for step in range(150):
        if rng.random() < 0.15:
            user = rng.choice("abc")
            req = make_request(user, prompt_len=rng.randint(4, max_len), max_tokens=rng.randint(1, 12))
            reqs.append(req)
            drv.add(req)
        drv.run(1)
    drv.run_until_done()
    for out in drv.outputs:
        assert sum(out.num_scheduled_tokens.values()) <= budget
        assert len(out.num_scheduled_tokens) <= 6
    assert all(drv.count(r.request_id) == r.max_tokens for r in reqs)
