"""Borrowing's limits: the pairs of a guaranteed rate and a ceiling in the
limits file (refused naming the key when wrong, taken with shared budgets),
and a pair changed live, in force at the next step of the real vLLM
``Scheduler`` / ``AsyncScheduler`` on a virtual clock (see harness).

A limit ``{rate: R, ceiling: C}`` gives a user R for sure and up to C of the
capacity nobody within its guaranteed rate uses; the ceiling is a second
GCRA. These tests read what the scheduler dispatched from its step reports
(``charged``: guaranteed tokens, ``borrowed``: lent ones; borrowing_setup).
"""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction

import pytest

from borrowing_setup import MODES, check_bound, rate, tokens
from harness import Driver, VirtualClock, make_request, make_scheduler, observe_steps
from vllm_output_rate.config import (
    UNLIMITED,
    OutputRateConfig,
    OutputRateConfigError,
    parse_limits_document,
)


# -- the limits file ------------------------------------------------------------


def test_pairs_in_the_limits_file(tmp_path):
    text = ("default: {rate: 5, ceiling: 20}\n"
            "tiers: {gold: {rate: 200, ceiling: 800}, free: {rate: 5, ceiling: unlimited}}\n"
            "users: {alice: gold, bob: free, carol: {rate: 10, ceiling: 30}, dave: 7}\n")
    config = parse_limits_document(text.encode(), "limits.yaml")
    assert config.rate_of("alice") == 200 and config.ceiling_of("alice") == 800
    assert config.ceiling_of("bob") == UNLIMITED
    assert config.ceiling_of("carol") == 30
    assert config.ceiling_of("dave") is None  # a plain rate: guaranteed and ceiling at once
    assert config.ceiling_of("someone") == 20 and config.rate_of("someone") == 5
    assert config.tier_ceilings == {"gold": 800, "free": UNLIMITED}
    again = OutputRateConfig.from_dict(config.to_dict())
    assert again == config and again.borrowing
    plain = parse_limits_document(b"default: 5\nusers: {a: 7}\n", "limits.yaml")
    assert not plain.borrowing and "ceilings" not in plain.to_dict()


@pytest.mark.parametrize("text, match", [
    ("default: {rate: 5, ceiling: 2}\n", r"limits.yaml:1: default: ceiling 2 is below the rate 5"),
    ("default: 5\nusers: {a: {rate: 5, ceil: 9}}\n", r"users.a: expected a limit or"),
    ("default: 5\nusers: {a: {ceiling: 9}}\n", r"users.a: expected a limit or"),
    ("default: 5\nusers: {a: {rate: 5, ceiling: lots}}\n", r"users.a.ceiling"),
    ("default: 5\nusers: {a: {rate: -1, ceiling: 9}}\n", r"users.a.rate"),
])
def test_bad_pairs_are_refused_naming_the_key(text, match):
    with pytest.raises(OutputRateConfigError, match=match):
        parse_limits_document(text.encode(), "limits.yaml")


def test_borrowing_is_taken_with_shared_budgets():
    config = OutputRateConfig(Fraction(5), default_ceiling=UNLIMITED,
                              shared_state="redis://127.0.0.1:1/0")
    assert config.borrowing and config.ceiling_of("anyone") == UNLIMITED


def test_a_pair_reloaded_with_shared_budgets_is_taken_and_what_the_engine_refuses_counted(tmp_path):
    """A limits file changed live to hold a pair, on an engine with shared
    budgets: taken (the ceiling is a fleet-wide budget). What the engine
    says it cannot serve (its ``refuse``: prompt budgets without chunked
    prefill) is refused like any invalid file (counted once, logged, what
    is in force stays), never an exception in the watcher's thread."""
    from vllm_output_rate.limits_watch import LimitsWatcher
    from vllm_output_rate.prompt_budget import check_shared

    path = tmp_path / "limits.yaml"
    path.write_text("default: 5\nusers: {a: 10}\n")
    config = replace(parse_limits_document(path.read_bytes(), str(path)),
                     shared_state="redis://127.0.0.1:1/0")
    watcher = LimitsWatcher(config, start_thread=False, refuse=lambda c: check_shared(c, False))
    path.write_text("default: 5\nusers: {a: {rate: 10, ceiling: unlimited}}\n")
    assert watcher.check() == "loaded"
    paired = watcher.current
    assert paired.borrowing and paired.shared_state == config.shared_state
    path.write_text("default: 5\nusers: {a: {rate: 10, prompt_rate: 400}}\n")
    assert watcher.check() == "invalid"
    assert watcher.check() is None
    assert "need chunked prefill" in watcher.last_error
    assert watcher.current is paired and watcher.results["invalid"] == 1
    path.write_text("default: 5\nusers: {a: 20}\n")
    assert watcher.check() == "loaded"
    assert watcher.current.rate_of("a") == 20 and watcher.current.shared_state == config.shared_state


# -- a live change ----------------------------------------------------------------


@pytest.mark.parametrize("is_async", MODES)
def test_a_pair_changed_live_is_in_force_at_the_next_step(tmp_path, monkeypatch, is_async):
    import os

    from vllm_output_rate.charges import CeilingCharges, DirectCharges
    from vllm_output_rate.config import load_limits_file
    from vllm_output_rate.ledger import OutputRateState

    monkeypatch.setattr(OutputRateState, "watch_thread", False)
    path = tmp_path / "limits.yaml"

    def write(text):
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)

    write("default: 1000\nusers: {a: {rate: 5, ceiling: unlimited}}\n")
    clock = VirtualClock()
    sched = make_scheduler(load_limits_file(str(path)).to_dict(), clock=clock,
                           async_scheduling=is_async)
    steps = []
    observe_steps(sched, steps.append)
    drv = Driver(sched, clock, step_ms=10.0, is_async=is_async)
    drv.add(*[make_request("a", max_tokens=5000) for _ in range(4)])
    watcher = sched.output_rate.watcher

    def phase(text, n=300):
        if text is not None:
            write(text)
            assert watcher.check() == "loaded"
        start = clock()
        drv.run(n)
        return tokens(steps, "a", since=start + 2 * 10_000_000)

    assert rate(phase(None)) == pytest.approx(400, rel=0.02)
    capped = phase("default: 1000\nusers: {a: {rate: 5, ceiling: 50}}\n")
    check_bound(capped, 50)
    assert rate(capped) >= 0.98 * 50
    plain = phase("default: 1000\nusers: {a: 5}\n", 600)
    assert not tokens(steps, "a", ("borrowed",), since=plain[0][0])
    check_bound(plain, 5)
    assert sched.output_rate.lender is None
    # the charges chosen again: borrowing stopped, the plain limiter charges directly
    assert type(sched.output_rate.step.charges) is DirectCharges
    # the plain steps held the throttled streams back and put each back once
    assert sorted(map(id, sched.running)) == sorted(set(map(id, sched.running)))
    assert len(sched.running) == 4
    again = phase("default: 1000\nusers: {a: {rate: 5, ceiling: unlimited}}\n")
    assert rate(again) == pytest.approx(400, rel=0.02)
    assert type(sched.output_rate.step.charges) is CeilingCharges
    # straight from every stream borrowing to none: the throttled streams
    # are held back and put back once each
    check_bound(phase("default: 1000\nusers: {a: 5}\n", 100), 5)
    assert sorted(map(id, sched.running)) == sorted(set(map(id, sched.running)))
    assert len(sched.running) == 4
