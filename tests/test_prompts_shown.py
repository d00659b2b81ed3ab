"""A user's prompt work, shown (issue 48 item 3): what the real vLLM
scheduler reports of it, step by step, in virtual time.

- Every user's prompt tokens computed are reported per step (budgeted or
  not), prefix-cache hits not among them, a chunk not dispatched not
  counted: over a run they add up to the prompts' lengths.
- A prompt put off is reported once per request and reason: by its user's
  prompt budget (``prompt_rate``), or just in time (its user out of output
  budget), with the tokens it had left to compute; with
  ``--output-rate-prefill-ahead`` nothing is put off just in time.
- The step's make-up (tokens and requests scheduled) is vLLM's own.
"""

from __future__ import annotations

import pytest

from harness import Driver, VirtualClock, make_request, make_scheduler, observe_steps

MODES = [False, True]


def limits(default, prompt_rates=None, prefill_ahead=False, **users):
    lim = {"default_user_output_tokens_per_second": default,
           "user_output_tokens_per_second": users}
    if prompt_rates:
        lim["prompt_rates"] = {u: str(r) for u, r in prompt_rates.items()}
    if prefill_ahead:
        lim["prefill_ahead"] = True
    return lim


def setup(lim, is_async=False, **kw):
    clock = VirtualClock()
    sched = make_scheduler(lim, clock=clock, async_scheduling=is_async, **kw)
    reports = []
    observe_steps(sched, reports.append)
    return sched, Driver(sched, clock, step_ms=10.0, is_async=is_async), reports


def computed(reports, user):
    return sum(r.prompt_tokens.get(user, 0) for r in reports)


def deferred(reports):
    return [d for r in reports for d in r.prompt_deferred]


@pytest.mark.parametrize("is_async", MODES)
def test_every_users_prompt_tokens_are_reported_once(is_async):
    """No prompt budget anywhere: each user's prompt tokens computed add up
    to its prompts' lengths (chunks of 256 tokens, several steps each), the
    step's scheduled tokens are vLLM's, and nothing is put off."""
    sched, drv, reports = setup(limits(1000), is_async, max_num_batched_tokens=256,
                                max_num_seqs=8)
    a = [make_request("a", prompt_len=700, max_tokens=3) for _ in range(2)]
    b = make_request("b", prompt_len=90, max_tokens=3)
    drv.add(*a, b)
    drv.run_until_done()
    assert computed(reports, "a") == 1400 and computed(reports, "b") == 90
    assert max(r.prompt_tokens.get("a", 0) for r in reports) <= 256  # per step, per chunk
    outs = {id(o): o for o in drv.outputs}
    assert [r.scheduled_tokens for r in reports if r.scheduled_tokens] == [
        o.total_num_scheduled_tokens for o in outs.values() if o.total_num_scheduled_tokens]
    done = [req_id for r in reports for req_id, (_u, _n, last) in r.prompt_chunks.items() if last]
    assert sorted(done) == sorted(x.request_id for x in (*a, b))  # each prompt ends once
    assert deferred(reports) == []


def test_prefix_cache_hits_are_not_prompt_work():
    """The same 640-token prompt twice: the second computes only its last
    block's tokens at most."""
    sched, drv, reports = setup(limits(1000))
    tokens = [(i * 7) % 900 + 10 for i in range(640)]
    drv.add(make_request("p", prompt=list(tokens), max_tokens=2))
    drv.run_until_done()
    assert computed(reports, "p") == 640
    drv.add(make_request("p", prompt=list(tokens), max_tokens=2))
    drv.run_until_done()
    assert 0 < computed(reports, "p") - 640 <= 16


@pytest.mark.parametrize("is_async", MODES)
def test_a_prompt_put_off_by_its_budget_is_reported_once(is_async):
    """p at 2,000 prompt tokens/s sends three 900-token prompts: each one
    put off is reported once, with what it had left; all computed in the
    end."""
    sched, drv, reports = setup(limits(1000, prompt_rates={"p": 2000}, p=1000), is_async,
                                max_num_seqs=8)
    prompts = [make_request("p", prompt_len=900, max_tokens=2) for _ in range(3)]
    drv.add(*prompts)
    drv.run_until_done()
    put_off = deferred(reports)
    assert {(u, why) for _r, u, why, _n in put_off} == {("p", "prompt_budget")}
    ids = [r for r, *_ in put_off]
    assert len(ids) == len(set(ids)) >= 2  # once a request; the first fits the burst in part
    assert all(0 < n <= 900 for *_x, n in put_off)
    assert computed(reports, "p") == 2700


@pytest.mark.parametrize("is_async", MODES)
@pytest.mark.parametrize("ahead", [False, True])
def test_a_prompt_put_off_just_in_time_is_reported_once(is_async, ahead):
    """a (1 tok/s) spent its burst; its next 300-token prompt waits for its
    budget just in time, reported once however many steps it waits; with
    prefill ahead it is computed at once and nothing is put off."""
    sched, drv, reports = setup(limits(1000, prefill_ahead=ahead, a=1), is_async)
    drv.add(make_request("a", prompt_len=8, max_tokens=3))
    drv.run(2)
    second = make_request("a", prompt_len=300, max_tokens=2)
    drv.add(second, make_request("b", prompt_len=300, max_tokens=20))
    drv.run(30)
    put_off = [d for d in deferred(reports) if d[0] == second.request_id]
    if ahead:
        assert put_off == [] and computed(reports, "a") >= 8 + 299
    else:
        assert put_off == [(second.request_id, "a", "just_in_time", 300)]
        assert computed(reports, "a") == 8  # nothing of it computed yet
    drv.run_until_done()
    assert computed(reports, "a") == 308 and computed(reports, "b") == 300
