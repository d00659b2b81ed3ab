"""End to end: a limit changed live on the real vLLM CPU engine.

user-a streams at 20 tok/s from a limits file (the pooled engine's, see
tests/engine_pool.py: every count here is a difference, every token and
change one since the test began); the file is rewritten to 40
mid-run, then broken, then changed to 10 in a way polling cannot see (same
size, same modification time) and SIGHUP is sent to the serving process.
Every figure is read engine-side from the engine's event log: when each
change was put in force (monotonic ns, the same clock as this process's)
and which tokens user-a got when.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import threading
import time
from fractions import Fraction

import httpx
import pytest

from harness import REPO, limit_integral, rate_while_stepping, rewrite_unseen, scrape_until, tiny_model
from vllm_output_rate.limiter import BURST_NS, NS_PER_S
from vllm_output_rate.telemetry.events import EngineLog
from vllm_output_rate.tools.common.client import http_limits, metric_value, scrape_metrics, stream_chat

pytestmark = pytest.mark.e2e



def write_limits(path, limit_a):
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(f"default: 100000\nusers:\n  user-a: {limit_a}\n")
    os.replace(tmp, path)


class Load:
    """Four endless streams of user-a in a thread, until ``stop()``."""

    def __init__(self, base_url):
        self.base_url, self.stop_event = base_url, threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self.results = []

    async def _main(self):
        async with httpx.AsyncClient(limits=http_limits(None), timeout=httpx.Timeout(600.0)) as client:
            tasks = [asyncio.create_task(stream_chat(client, self.base_url, "tiny", "user-a", 900))
                     for _ in range(4)]
            await asyncio.to_thread(self.stop_event.wait)
            for task in tasks:
                task.cancel()
            self.results = await asyncio.gather(*tasks, return_exceptions=True)

    def start(self):
        self.thread.start()
        return self

    def stop(self):
        self.stop_event.set()
        self.thread.join(timeout=30)


def test_a_limit_changes_live_and_the_bound_holds_across_changes(engines):
    # the pool's tiny engine (tests/engine_pool.py): its limits file is ours
    # for this test; everything is read as a difference or since `begin`
    server = engines.get("tiny", default=100000, users={"user-a": 20})
    limits, events = server.limits_path, server.events_path
    # the pool returns once these limits are in force with no reload pending
    reload_counts = ("loaded", "unchanged", "invalid")
    s0 = scrape_metrics(server.base_url)
    before = [metric_value(s0, "vllm_output_rate_limits_reloads_total", result=r)
              for r in (*reload_counts, "unreadable")]
    log_offset = server.log_size()
    begin = time.monotonic_ns()
    load = Load(server.base_url).start()
    time.sleep(4)
    # (before, after) each change was made: the engine's change falls
    # between the first and a second after the last (a stall of this
    # process while it writes counts for it, not against the engine)
    written = {40: [time.monotonic_ns()]}
    write_limits(limits, 40)
    written[40].append(time.monotonic_ns())
    time.sleep(4)
    limits.write_text("default: 100000\nusers:\n  user-a: [40]\n")  # not a limit
    time.sleep(1.5)
    write_limits(limits, 40)  # what is in force already: "unchanged"
    time.sleep(1.0)
    # 10 in place of 40: same size; the modification time put back
    rewrite_unseen(limits, "user-a: 40", "user-a: 10")
    time.sleep(1.0)  # polling sees nothing ...
    written[10] = [time.monotonic_ns()]
    os.kill(server.proc.pid, signal.SIGHUP)  # ... SIGHUP to the serving process does
    written[10].append(time.monotonic_ns())
    time.sleep(4)
    load.stop()
    assert httpx.get(f"{server.base_url}/health", timeout=5).status_code == 200
    want = [b + d for b, d in zip(before, (2, 1, 1))]
    samples = scrape_until(server.base_url, lambda s: [
        metric_value(s, "vllm_output_rate_limits_reloads_total", result=r)
        for r in reload_counts] == want)
    log_text = server.log_text_since(log_offset)

    reloads = {r: metric_value(samples, "vllm_output_rate_limits_reloads_total", result=r) - b
               for r, b in zip((*reload_counts, "unreadable"), before)}
    print("\nreloads:", reloads)
    # 40 (polled), 40 again after the broken file (same content as in force:
    # unchanged), 10 (SIGHUP); the broken file once, logged once
    assert reloads["loaded"] == 2 and reloads["invalid"] == 1 and reloads["unreadable"] == 0
    assert reloads["unchanged"] == 1
    assert log_text.count("was changed but is not valid") == 1

    log = EngineLog.read(events)
    # this test's changes (the pool's limits, loaded while the engine was
    # idle, went in force at the load's first step: "from the next step on")
    changes = [(c["t_ns"], c["limits"]["user-a"]) for c in log.limit_changes
               if c["t_ns"] >= written[40][0]]
    assert [limit for _, limit in changes] == [40.0, 10.0]
    for t_ns, limit in changes:
        before, after = written[int(limit)]
        delay = (t_ns - after) / 1e9
        print(f"limit {limit:g} in force {delay * 1e3:.0f} ms after the change "
              f"(made in {(after - before) / 1e6:.0f} ms)")
        assert before <= t_ns and delay <= 1.0
    times = sorted(t for t, toks in log.steps if t >= begin for _, user, n in toks
                   if user == "user-a" for _ in range(n))
    start_ns = min(begin, times[0])
    schedule = [(start_ns, Fraction(20))] + [(t, Fraction(limit)) for t, limit in changes]
    end_ns = times[-1]

    # the rate of each phase, from a second after the change to the next
    # one, over the time the engine was stepping (user-a is its only user:
    # a gap between steps longer than a token's spacing is the machine's;
    # 3.7 tok/s at a limit of 10 was seen once, first to last, on a loaded
    # machine); the exact rates are test_live_limits', in virtual time
    bounds = [t for t, _ in schedule[1:]] + [end_ns]
    first_token = times[0]
    for (begin, limit), end in zip(schedule, bounds):
        lo = max(begin, first_token) + (NS_PER_S if begin != start_ns else 0)
        phase = [(t, 1) for t in times if lo <= t < end]
        rate = len(phase) / ((end - lo) / 1e9)
        stepping = rate_while_stepping([(lo, 0), *phase], sorted([lo, *(t for t, _ in log.steps)]),
                                       float(limit))
        print(f"limit {float(limit):g}: {rate:.2f} tok/s engine-side, {stepping:.2f} while stepping")
        assert stepping >= 0.85 * float(limit) - 1 / ((end - lo) / 1e9)

    # the piecewise bound in every window, from the earliest moment the
    # window's first token can have been charged (the log stamps a token when
    # its output is processed, the limiter charges it at dispatch: the step
    # before's output, however long the loaded machine made that step)

    peak = max(r for _, r in schedule)
    slack = peak * Fraction(BURST_NS, NS_PER_S)
    charged_from = log.dispatch_lower_bounds(times)
    worst = 0.0
    for i in range(len(times)):
        for j in range(i, min(len(times), i + 200)):
            a, b = max(charged_from[i], start_ns), times[j]
            bound = limit_integral(schedule, a, b) + slack + 1
            worst = max(worst, (j - i + 1) / float(bound))
            assert j - i + 1 <= math.floor(bound), (a, b)
    print(f"worst window: {worst:.2f} of the piecewise bound")
