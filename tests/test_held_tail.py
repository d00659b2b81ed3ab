"""The held tail taken as it is (``vllm_output_rate.held``): a step whose
throttled requests are those the last step held back, their users still
without budget, reads them as one list. It must decide exactly what the
full path decides: two real vLLM schedulers on one fake clock, fed the same
requests, aborts and limits, one of them never taking the tail as it is,
report the same steps (charges, throttled, newly throttled, refused users
and their ready times, held back), schedule the same tokens and keep
``running`` in the same order, step after step.
"""

from __future__ import annotations

import random

import pytest
from vllm.v1.request import RequestStatus

from harness import Driver, VirtualClock, make_request, make_scheduler
from vllm_output_rate.held import HeldTail

MODES = [pytest.param(False, id="sync"), pytest.param(True, id="async")]


def _pair(lim, is_async, **kw):
    """Two schedulers on their own fake clocks, stepped alike."""
    out = []
    for _ in range(2):
        clock = VirtualClock()
        sched = make_scheduler(lim, clock=clock, async_scheduling=is_async, **kw)
        out.append((sched, Driver(sched, clock, is_async=is_async)))
    return out


def _report(sched):
    step = sched.output_rate.last_step
    return (dict(step.charged), list(step.throttled), list(step.throttled_new),
            dict(step.refused), step.held_back, [r.request_id for r in sched.running])


@pytest.mark.parametrize("is_async", MODES)
@pytest.mark.parametrize("seed", [1, 2])
def test_the_tail_taken_as_it_is_decides_as_the_full_path(monkeypatch, is_async, seed):
    rng = random.Random(seed)
    users = [f"u{i}" for i in range(12)]
    # most users pace at a few tokens a second (10 ms steps: throttled most
    # steps), some are refused every step after their first tokens, two
    # never bind
    rates = {u: rng.choice(["0.01", "3", "7", "15"]) for u in users[2:]}
    lim = {"default_user_output_tokens_per_second": 100000,
           "user_output_tokens_per_second": rates}
    (fast, drv_fast), (full, drv_full) = _pair(lim, is_async, max_num_seqs=48,
                                               max_num_batched_tokens=512)
    taken = []
    resume = HeldTail.resume

    def counted(self, running, step):
        tail = resume(self, running, step)
        if self is fast.output_rate.held_tail:
            taken.append(tail is not None)
        return tail

    def never(self, running, step):
        self.release()
        return None

    monkeypatch.setattr(HeldTail, "resume", lambda self, running, step: (
        counted(self, running, step) if self is fast.output_rate.held_tail
        else never(self, running, step)))
    n = 0
    for step_no in range(400):
        if step_no % 40 == 0:  # new requests now and then, several a user
            for _ in range(rng.randint(4, 14)):
                user, prompt, most = rng.choice(users), rng.randint(4, 40), rng.randint(5, 300)
                n += 1
                for drv in (drv_fast, drv_full):
                    drv.add(make_request(user, prompt_len=prompt, max_tokens=most,
                                         req_id=f"r{n}"))
        if step_no % 57 == 30:  # an abort: a throttled request of the held tail, maybe
            live = sorted(r.request_id for r in fast.running)
            if live:
                victim = rng.choice(live)
                for sched in (fast, full):
                    sched.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
        a, b = drv_fast.step(), drv_full.step()
        assert a.num_scheduled_tokens == b.num_scheduled_tokens, step_no
        assert _report(fast) == _report(full), step_no
    # (the fast path was taken, and left: aborts, users back in budget)
    assert sum(taken) > 50 and not all(taken)
    assert drv_fast.tokens == drv_full.tokens
    # the step that last throttled each request, written when the run ends
    fast.output_rate.held_tail.release()
    assert ({r.request_id: r.output_rate_throttled_step for r in fast.requests.values()}
            == {r.request_id: r.output_rate_throttled_step for r in full.requests.values()})
