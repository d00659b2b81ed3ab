"""End to end: one user's limit held across two real vLLM CPU engines that
share their budgets through a real ``redis-server`` (Debian's, started here
on a free loopback port), measured engine-side from both engines' event
logs; then the store stopped mid-run and started again empty."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import threading
import time
from fractions import Fraction

import httpx
import pytest

from harness import (REPO, fleet_engines, rate_while_stepping, scrape_until, spend_rate,
                     start_all, tiny_model)
from vllm_output_rate.fleet_math import fleet_bound
from vllm_output_rate.limiter import NS_PER_S
from vllm_output_rate.shared_settings import HORIZON_S, LOOKAHEAD_S
from vllm_output_rate.telemetry.events import EngineLog, fleet_spends
from vllm_output_rate.tools.common.client import http_limits, Server, metric_value, scrape_metrics, stream_chat
from vllm_output_rate.tools.fleet_sim import worst_window_excess
from vllm_output_rate.tools.redis_server import RedisServer, redis_server_binary

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(redis_server_binary() is None, reason="redis-server not installed")]

LIMIT_A = 20
LIMIT_B = 40
#: user-c: a guaranteed rate and a ceiling, both fleet-wide
RATE_C, CEILING_C = 5, 15
#: engine-side stamps are taken when a step's output is processed, charges
#: when it was dispatched: one step of slack per engine
STEP_SLACK = 2


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("shared")
    redis = RedisServer(nice=10).start()
    events = [tmp / f"events-{i}.jsonl" for i in range(2)]
    limits = tmp / "limits.yaml"
    limits.write_text(f"default: {LIMIT_A}\nusers:\n  user-b: {LIMIT_B}\n  warm-up: 100000\n"
                      f"  user-c: {{rate: {RATE_C}, ceiling: {CEILING_C}}}\n")
    engines = fleet_engines("e2e-shared", lambda i: [
        "--max-num-seqs", "16", "--max-model-len", "1024",
        "--output-rate-limits-file", str(limits),
        "--output-rate-shared-state", redis.url], events)
    errors = start_all(engines)
    try:
        assert not errors, errors
        # A fresh CPU engine compiles each new batch shape on first use (a
        # stall of up to a second): meet the shapes of the tests first.
        for streams in range(1, 7):
            run_streams(engines, [(i, "warm-up", streams, 4) for i in range(2)])
        yield redis, engines, events
    finally:
        for e in engines:
            e.stop()
        redis.close()


def run_streams(engines, plan, during=None):
    """plan: [(engine index, user, streams, max_tokens)]; ``during`` runs in
    a thread while the streams go."""
    async def run():
        async with httpx.AsyncClient(limits=http_limits(None), timeout=httpx.Timeout(300.0)) as client:
            jobs = [stream_chat(client, engines[i].base_url, "tiny", user, tokens)
                    for i, user, streams, tokens in plan for _ in range(streams)]
            return await asyncio.gather(*jobs)

    side = threading.Thread(target=during) if during else None
    if side:
        side.start()
    results = asyncio.run(run())
    if side:
        side.join()
    assert [r.error for r in results if r.error] == []
    assert all(r.completion_tokens == r.max_tokens for r in results)
    return results


def fleet_tokens(events, user, since_ns=0):
    """(t_ns, tokens) of ``user`` over both engines' logs, in time order."""
    return fleet_spends((EngineLog.read(p) for p in events), user, since_ns)


def per_engine_tokens(events, user, since_ns=0):
    return [sum(n for _, n in EngineLog.read(p).user_spends(user, since_ns)) for p in events]


def wait_for_events(events, user, tokens, since_ns, timeout_s=30.0):
    """Until both engines' event logs hold ``tokens`` of ``user`` (the
    exporter appends about once a second)."""
    deadline = time.monotonic() + timeout_s
    while sum(n for _, n in fleet_tokens(events, user, since_ns)) < tokens \
            and time.monotonic() < deadline:
        time.sleep(0.5)


def test_one_users_limit_holds_across_two_engines(fleet):
    redis, engines, events = fleet
    start = time.monotonic_ns()
    before = [scrape_metrics(e.base_url) for e in engines]
    # user-a: four streams, two on each engine; user-b beside it, one on each
    # (about 20 s: a stall of an engine's step loop on this 2-core machine,
    # up to half a second, costs its share of the rate in that window)
    run_streams(engines, [(0, "user-a", 2, 100), (1, "user-a", 2, 100),
                          (0, "user-b", 1, 400), (1, "user-b", 1, 400)])
    wait_for_events(events, "user-a", 400, start)
    wait_for_events(events, "user-b", 800, start)
    for user, limit in (("user-a", LIMIT_A), ("user-b", LIMIT_B)):
        spends = fleet_tokens(events, user, start)
        assert sum(n for _, n in spends) == {"user-a": 400, "user-b": 800}[user]
        fleet_rate = spend_rate(spends)
        # the fleet's steps: a gap in which neither engine stepped, beyond
        # one token's spacing at the limit, is the machine's
        steps = sorted(t for p in events for t, _ in EngineLog.read(p).steps if t >= start)
        stepping = rate_while_stepping(spends, steps, limit)
        print(f"\n{user}: fleet engine-side rate {fleet_rate:.2f} tok/s (limit {limit}), "
              f"{stepping:.2f} while the fleet was stepping, "
              f"per engine {per_engine_tokens(events, user, start)}")
        # the upper side is the fleet bound below; the lower: most of the
        # limit. A stall of an engine's step loop on a 2-core machine leaves
        # its leases unspent (93.9-100.1% measured, the low one on a loaded
        # CI machine; 31.98 tok/s of 40 first to last with three test
        # workers on two cores): how much is the machine's, not the
        # limiter's, so the floor here, over the time the fleet was
        # stepping, only catches leases lost wholesale; the exact lower side
        # is held in virtual time in test_shared_state_fleet and
        # test_shared_state_schedulers (>= 0.97)
        assert stepping >= 0.8 * limit, (user, stepping, fleet_rate)
        excess, window = worst_window_excess(spends, Fraction(limit), HORIZON_S, LOOKAHEAD_S,
                                             STEP_SLACK)
        assert excess <= 0, (user, excess, window)
        # both engines served the user: the budget was shared, not split
        assert min(per_engine_tokens(events, user, start)) > 0
    # the lease machinery's own counters: every metric of shared-budget mode
    from vllm_output_rate.telemetry.metrics import METRICS

    for engine, earlier in zip(engines, before):
        samples = scrape_metrics(engine.base_url)
        names = {n for n, _ in samples}
        missing = [m.full_name for m in METRICS if m.only_in == "shared_state" and not any(
            n == m.full_name or n.startswith(m.full_name + "_") for n in names)]
        assert missing == []
        print("leases:", {k: metric_value(samples, f"vllm_output_rate_shared_tokens_{k}_total")
                          - metric_value(earlier, f"vllm_output_rate_shared_tokens_{k}_total")
                          for k in ("leased", "spent", "expired")})
        assert metric_value(samples, "vllm_output_rate_shared_tokens_leased_total") > 0
        assert metric_value(samples, "vllm_output_rate_shared_tokens_spent_total") > 0
        assert metric_value(samples, "vllm_output_rate_shared_store_calls_total", result="ok") > 0
        assert metric_value(samples, "vllm_output_rate_shared_store_fallback") == 0
        assert metric_value(samples, "vllm_output_rate_shared_live_engines") == 2
        assert metric_value(samples, "vllm_output_rate_shared_store_call_seconds_count") > 0


def test_a_ceiling_holds_across_two_engines_each_lending_its_idle_capacity(fleet):
    """user-c (``{rate: 5, ceiling: 15}``) alone, two streams on each
    engine: each engine lends it its own idle capacity, up to the tokens it
    holds of the ceiling's fleet-wide lease. The fleet serves it near its
    ceiling, not two ceilings (30 tok/s, as two engines each with the
    ceiling of their own would), and well past its guaranteed rate; the
    ceiling's fleet bound holds in every window (``docs/fleet.md``: of the
    rate's form). Exactly in virtual time: ``test_fleet_budgets``."""
    redis, engines, events = fleet
    start = time.monotonic_ns()
    before = [scrape_metrics(e.base_url) for e in engines]
    run_streams(engines, [(0, "user-c", 2, 40), (1, "user-c", 2, 40)])
    wait_for_events(events, "user-c", 160, start)
    spends = fleet_tokens(events, "user-c", start)
    assert sum(n for _, n in spends) == 160
    steps = sorted(t for p in events for t, _ in EngineLog.read(p).steps if t >= start)
    stepping = rate_while_stepping(spends, steps, CEILING_C)
    borrowed = [metric_value(scrape_metrics(e.base_url), "vllm_output_rate_tokens_borrowed_total",
                             user="user-c")
                - metric_value(b, "vllm_output_rate_tokens_borrowed_total", user="user-c")
                for e, b in zip(engines, before)]
    excess, window = worst_window_excess(spends, Fraction(CEILING_C), HORIZON_S, LOOKAHEAD_S,
                                         STEP_SLACK)
    print(f"\nuser-c: fleet {spend_rate(spends):.2f} tok/s first to last, {stepping:.2f} while "
          f"stepping (rate {RATE_C}, ceiling {CEILING_C}); borrowed per engine {borrowed}; "
          f"worst window {excess:+d} tokens against the ceiling's fleet bound")
    assert excess <= 0, (excess, window)
    assert all(n > 0 for n in borrowed), borrowed  # each engine lent its own capacity
    # past its guaranteed rate (the machine's stalls only lower this side)
    assert stepping >= 2 * RATE_C, stepping


class StallWatch:
    """How late this process's threads wake (a 50 ms sleep, over and over),
    while a scenario runs: a test process that got no CPU or no GIL for
    seconds cannot have run its side of the scenario on time."""

    def __init__(self) -> None:
        self.worst_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            time.sleep(0.05)
            self.worst_s = max(self.worst_s, time.monotonic() - t0 - 0.05)

    def __enter__(self) -> StallWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def outage_run(redis, engines, events):
    """user-a's four streams over both engines, the store killed 3 s in and
    started again empty 5 s later. Returns (start, marks, spends, the
    engines' log sizes before, the worst stall of this process)."""
    marks = {}

    def outage():
        time.sleep(3.0)
        marks["down"] = time.monotonic_ns()
        redis.kill()  # a crash
        marks["killed"] = time.monotonic_ns()
        time.sleep(5.0)
        marks["restart"] = time.monotonic_ns()
        redis.start()  # empty: its data is lost
        marks["up"] = time.monotonic_ns()

    start = time.monotonic_ns()
    log_sizes = [engine.log_path.stat().st_size for engine in engines]
    with StallWatch() as watch:
        run_streams(engines, [(0, "user-a", 2, 100), (1, "user-a", 2, 100)], during=outage)
    wait_for_events(events, "user-a", 400, start)
    return start, marks, fleet_tokens(events, "user-a", start), log_sizes, watch.worst_s


def test_store_stopped_mid_run_then_back_empty(fleet):
    redis, engines, events = fleet
    for attempt in (1, 2):
        start, marks, spends, log_sizes, stall_s = outage_run(redis, engines, events)
        timing = {k: round((v - start) / NS_PER_S, 2) for k, v in marks.items()}
        if spends:
            timing["first token"] = round((spends[0][0] - start) / NS_PER_S, 2)
            timing["last token"] = round((spends[-1][0] - start) / NS_PER_S, 2)
        print(f"\ntiming (s from start): {timing}; this process's worst stall {stall_s:.2f} s")
        # The premise: the outage fell inside the run (about 20 s of
        # streams at the fleet's 20 tok/s, the store back at about 8 s).
        # Once (CI, late in the suite) every token came before the kill:
        # this process's thread that kills the store had run late by the
        # whole run. Then the scenario did not happen, and runs again (a
        # limiter that let the streams finish early fails both attempts).
        if spends and marks["up"] + 3 * NS_PER_S <= spends[-1][0]:
            break
        print(f"attempt {attempt}: the outage did not fall inside the run (the store back "
              f"at {timing['up']} s, the last token at {timing.get('last token')} s)")
    else:
        pytest.fail(f"twice the outage did not fall inside the run: {timing}, "
                    f"this process's worst stall {stall_s:.2f} s")
    assert sum(n for _, n in spends) == 400
    # both engines kept serving during the outage, each at its fallback share
    # (20 / 2 engines last seen sharing user-a): the fleet at about 20
    # stamped outside the outage: from a second after the kill returned to
    # the moment before the restart began
    lo, hi = marks["killed"] + NS_PER_S, marks["restart"]
    during = [s for s in spends if lo <= s[0] < hi]
    fleet_rate = sum(n for _, n in during) / ((hi - lo) / NS_PER_S)
    print(f"\nuser-a during the outage: {fleet_rate:.2f} tok/s over both engines, "
          f"per engine {per_engine_tokens(events, 'user-a', lo)}")
    # at most the two fallback shares (a fleet of 20), and most of it: each
    # engine at its share over the time it was stepping (two engines share
    # two cores here, beside the test; with a busy process beside them the
    # fleet made 13 tok/s over the outage once, first to last)
    assert fleet_rate <= fleet_bound((hi - lo) / NS_PER_S, LIMIT_A, 0.1, 0) / (
        (hi - lo) / NS_PER_S) + 2 / ((hi - lo) / NS_PER_S)
    for path in events:
        log = EngineLog.read(path)
        mine = [(t, n) for t, ts in log.steps if lo <= t < hi for _, u, n in ts if u == "user-a"]
        share = sum(n for _, n in mine) / ((hi - lo) / NS_PER_S)
        stepping = rate_while_stepping([(lo, 0), *mine], sorted([lo, *(t for t, _ in log.steps)]),
                                       LIMIT_A / 2)
        print(f"an engine's share during the outage: {share:.2f} tok/s, {stepping:.2f} while stepping")
        assert share <= (LIMIT_A / 2) * 1.05 + 2 / ((hi - lo) / NS_PER_S), share
        assert stepping >= 0.8 * LIMIT_A / 2, (share, stepping)
    # after it: shared again, and the bound held across the outage and the reset
    after = [s for s in spends if s[0] >= marks["up"] + NS_PER_S]
    steps = sorted(t for p in events for t, _ in EngineLog.read(p).steps
                   if t >= marks["up"] + NS_PER_S)
    stepping_after = rate_while_stepping(after, steps, LIMIT_A)
    print(f"user-a after it: {spend_rate(after):.2f} tok/s, {stepping_after:.2f} while the "
          f"fleet was stepping")
    assert len(after) >= 20, timing  # the run went on well past the restart
    # (the lower side as in the test above, over the time the fleet was
    # stepping: first to last, 17.6-19.9 tok/s were measured here with
    # another process busy on the two cores, and 14.7 once in a clean
    # clone's make test, this process stalled 2.56 s; over-charging just
    # after the reset is by design; the exact lower side after a store came
    # back empty is test_shared_state_fleet's and test_shared_state_schedulers',
    # in virtual time)
    assert stepping_after >= 0.8 * LIMIT_A, (timing, spend_rate(after), stepping_after)
    excess, window = worst_window_excess(spends, Fraction(LIMIT_A), HORIZON_S, LOOKAHEAD_S,
                                         STEP_SLACK)
    assert excess <= 0, (excess, window)
    for engine in engines:
        samples = scrape_metrics(engine.base_url)
        assert metric_value(samples, "vllm_output_rate_shared_store_calls_total", result="failed") > 0
        assert metric_value(samples, "vllm_output_rate_shared_store_fallback_seconds_total") > 2
        assert metric_value(samples, "vllm_output_rate_shared_tokens_unleased_total") > 0
        assert metric_value(samples, "vllm_output_rate_shared_store_fallback") == 0
    down, back = "is unreachable", "answers again; shared budgets resumed"
    for engine, size in zip(engines, log_sizes):
        # (the gauge above is back at 0; the line saying so may reach the
        # log file a moment later on a loaded machine: read until it has)
        deadline = time.monotonic() + 30.0
        while True:
            with open(engine.log_path, "rb") as f:
                f.seek(size)
                log = f.read().decode(errors="replace")
            if log.rfind(back) > log.rfind(down) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        # one line per episode, naming the store without secrets, and each
        # episode ends with a line of its own: the lines alternate. The
        # outage is one episode; on a loaded machine a store call that timed
        # out is one of its own (three workers on two cores: eight such
        # episodes of an engine in one run, "Timeout reading from" the
        # store started at nice 10), so their number is the machine's
        # (one such episode may straddle where the log is read from, or its end)
        lines = re.findall(rf"shared state: the store at \S+ ({down}|{back})", log)
        seen = lines[1:] if lines[:1] == [back] else lines
        seen = seen[:-1] if seen[-1:] == [down] else seen
        assert seen and seen == [down, back] * (len(seen) // 2), lines


def _engine_core(server):
    import psutil

    for child in psutil.Process(server.proc.pid).children(recursive=True):
        if "EngineCore" in " ".join(child.cmdline()) or "EngineCore" in child.name():
            return child
    raise AssertionError("no engine-core process found")


def test_an_orphaned_engine_core_ends_and_gives_its_share_back(fleet):
    """Engine 1's API server alone is killed (SIGKILL) while user-a streams
    on both engines: its engine core sees its parent gone, aborts its
    requests, leaves the store and exits; engine 0's user-a gets the whole
    limit back. (vLLM's engine core does not watch its API server: without
    the plugin's watch it lived on, leasing, and engine 0's user-a stayed at
    half its limit.) Last of the fleet's tests: engine 1 is gone after it."""
    import psutil

    redis, engines, events = fleet
    core = _engine_core(engines[1])
    log_size = engines[1].log_path.stat().st_size
    start = time.monotonic_ns()
    marks = {}

    def kill_api_server():
        wait_for_events(events[1:], "user-a", 10, start)  # engine 1 serves user-a
        marks["killed"] = time.monotonic_ns()
        os.kill(engines[1].proc.pid, signal.SIGKILL)
        try:
            core.wait(timeout=120)
        except psutil.TimeoutExpired:
            core.kill()  # no orphan left behind by a failing test
            raise
        finally:
            marks["gone"] = time.monotonic_ns()

    async def run():
        async with httpx.AsyncClient(limits=http_limits(None), timeout=httpx.Timeout(300.0)) as client:
            jobs = [stream_chat(client, engines[i].base_url, "tiny", "user-a", tokens)
                    for i, tokens in ((0, 200), (0, 200), (1, 400), (1, 400))]
            return await asyncio.gather(*jobs)

    side = threading.Thread(target=kill_api_server)
    side.start()
    results = asyncio.run(run())
    side.join()
    assert "gone" in marks and not core.is_running()
    gone_s = (marks["gone"] - marks["killed"]) / NS_PER_S
    # engine 0's streams completed; engine 1's were cut (their server died)
    assert [r.completion_tokens for r in results[:2]] == [200, 200]
    assert all(r.error or r.completion_tokens < 400 for r in results[2:])
    with open(engines[1].log_path, "rb") as f:
        f.seek(log_size)
        log = f.read().decode(errors="replace")
    assert "parent process" in log and "is gone; shutting the engine core down" in log
    assert "aborting in-flight requests" in log  # vLLM's own shutdown, in abort mode
    assert re.search(r"left the store at \S+ \(\d+ users\)", log), log[-3000:]
    # engine 0's user-a after the orphan left: the whole limit, over the time
    # engine 0 was stepping (half of it if the orphan still leased)
    wait_for_events(events[:1], "user-a", 400, start)
    log0 = EngineLog.read(events[0])
    after = [(t, n) for t, n in log0.user_spends("user-a", marks["gone"])]
    steps = sorted(t for t, _ in log0.steps if t >= marks["gone"])
    stepping = rate_while_stepping(after, steps, LIMIT_A)
    print(f"\nthe orphaned engine core exited {gone_s:.2f} s after its API server was killed; "
          f"engine 0's user-a then {spend_rate(after):.2f} tok/s, {stepping:.2f} while stepping "
          f"({sum(n for _, n in after)} tokens)")
    assert sum(n for _, n in after) >= 40, marks  # the run went on well past the exit
    assert stepping >= 0.8 * LIMIT_A, (stepping, spend_rate(after))


@pytest.mark.long
def test_data_parallel_ranks_share_one_budget(tmp_path):
    """``--data-parallel-size 2`` with the store: each rank's engine core is
    one engine of the fleet (vLLM's own front end spreads the streams). One
    API server (vLLM starts one per rank by default; several API servers
    are test_e2e_api_servers'): a process fewer to start on two cores.
    In ``make test-all``: two ranks start five processes (about a minute
    alone, three beside the suite's other engines); ``make test`` has the
    ranks' naming and sharing with two real schedulers
    (test_shared_state_schedulers' ``test_two_real_schedulers_share_one_users_budget``)."""
    redis = RedisServer(nice=10).start()
    server = Server(tiny_model(), [
        "--max-num-seqs", "8", "--max-model-len", "1024", "--data-parallel-size", "2",
        "--api-server-count", "1",
        "--default-user-output-tokens-per-second", str(LIMIT_A),
        "--output-rate-shared-state", redis.url],
        REPO / ".cache" / "logs" / "e2e-shared-dp.log",
        # two ranks, two cores: vLLM places them (a test worker's own core
        # binding, tests/conftest.py, would put both on one)
        extra_env={"OUTPUT_RATE_TELEMETRY": "1", "VLLM_CPU_OMP_THREADS_BIND": "auto"})
    try:
        server.start()
        results = run_streams([server], [(0, "user-a", 4, 50)])
        samples = scrape_until(server.base_url, lambda s: metric_value(
            s, "vllm_output_rate_tokens_charged_total", user="user-a") >= 200)
    finally:
        server.stop()
        redis.close()
    # the window from sending the first request to the last chunk holds the
    # engines' span however late chunks reach this process
    span = max(r.last for r in results) - min(r.started for r in results)
    client_rate = (200 - 1) / span
    charged = {engine: metric_value(samples, "vllm_output_rate_tokens_charged_total",
                                    user="user-a", engine=engine) for engine in ("0", "1")}
    print(f"\nuser-a over two data-parallel ranks: {client_rate:.2f} tok/s client-side, "
          f"charged per rank {charged}")
    assert all(n > 0 for n in charged.values()), charged  # both ranks served it
    assert sum(charged.values()) >= 200
    # within the fleet bound (the exact sharing is test_shared_state_schedulers', two
    # real schedulers on one virtual clock)
    assert 200 <= fleet_bound(span, LIMIT_A, HORIZON_S, LOOKAHEAD_S) + STEP_SLACK
    assert metric_value(samples, "vllm_output_rate_shared_live_engines", engine="0") == 2
