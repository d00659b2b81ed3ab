"""The fairness benchmark: the same workloads under the arms an operator
would pick instead of, or with, this limiter, side by side in one run.

``vllm-output-rate fairness [--scale small|gpu] [--scenario NAME ...]
[--arm NAME ...] --out DIR [--seed N]``

Every arm of a scenario runs the same workload (same seed, same arrivals,
same sizes) through vLLM's own scheduler in the what-if twin
(``tools.twin``: the real ``Scheduler``, its KV cache manager, the plugin's
limiter, virtual time, a fixed step time):

* ``fcfs``: upstream vLLM, the feature off (first come, first served);
* ``priority``: upstream vLLM with ``--scheduling-policy priority``, each
  user's tier mapped to a request priority (the better tier first);
* ``gateway``: upstream vLLM behind a per-user token limit at admission,
  an **emulation** of LiteLLM's proxy with a ``tpm_limit`` per key
  (``GatewayEmulation``: its documented and coded semantics, not LiteLLM
  itself);
* ``capped``: this project, each user's guaranteed rate as a plain limit;
* ``borrowing``: this project, the same rates with ``ceiling: unlimited``
  (guaranteed rate plus what nobody within its rate uses).

Scenarios (``SCENARIOS``; fixed seeds): ``flood`` (one user opens many
streams beside steady users; also run without the flood, the victims'
baseline), ``overload`` (VTC's: two users, one sending twice the other's
load, together above capacity), ``tiers`` (gold and free, the gold rate
four times the free), ``bursts`` (on/off users beside steady ones),
``clients`` (many heterogeneous clients, ServeGen-like), ``alone`` (one user
with many streams and nobody else: what borrowing gives back).

Scales: ``small`` (16 sequences, a handful of users) and ``gpu`` (1,024
sequences, 1,000 users), both with a 25 ms step. Per user and arm: output
tok/s against the guaranteed rate, TTFT p50/p99, inter-token spacing p99,
requests refused; per arm: throughput and the weighted Jain's index over
backlogged users. Written to ``--out``: ``fairness.json`` (every figure)
and ``fairness.md`` (the tables and the goals checked).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_output_rate.tools import fairness_engine as fe
from vllm_output_rate.tools.common.help_text import PlainHelpFormatter, description_and_epilog
from vllm_output_rate.tools.common.stats import quantile
from vllm_output_rate.tools.twin.workload import _poisson, gen_clients

ARMS = ("fcfs", "priority", "gateway", "capped", "borrowing")
NS = 1_000_000_000
#: this project's arms keep this many times the active sequences resident
#: (``--max-num-seqs 4R --max-num-active-seqs R``, as the README deploys it)
RESIDENT = 4
#: the busy window, where rates are read: from this second to the end of
#: the arrivals (a user's queue has built up; the drain after is left out)
WARMUP_S = 5
#: the step time of every run: 25 ms a step whatever it holds (a GPU's
#: decode step at the batch sizes here; the arms differ in what a step
#: holds, not in how long it takes)
STEP_S = 0.025
#: A user is backlogged in a whole second of the busy window when enough of
#: its requests were open (arrived, not finished) throughout it to take its
#: guaranteed rate (ceil(rate x step): a stream takes a token a step); its
#: rate held is read over those seconds, for users with at least this many
#: (a user whose requests all came late, or were done early, asked for its
#: rate only part of the window: over the whole window it would read low)
MIN_BACKLOGGED_S = 3


@dataclass(frozen=True)
class Scale:
    name: str
    max_num_seqs: int
    #: users of the multi-user scenarios
    users: int
    duration_s: float
    #: the step time the scenarios' rates are sized on (the twin's fixed
    #: step; a real engine's nominal one, ``fairness_engine``)
    step_s: float = STEP_S

    @property
    def capacity(self) -> float:
        """Output tok/s with every sequence decoding in every step."""
        return self.max_num_seqs / self.step_s


SCALES = {
    "small": Scale("small", 16, 6, 30.0),
    "gpu": Scale("gpu", 1024, 1000, 30.0),
}
#: ``--engine cpu``: a real CPU engine's R, users, arrivals and nominal step
ENGINE_SCALE = Scale("cpu", fe.R, fe.USERS, fe.DURATION_S, step_s=fe.STEP_S)


@dataclass
class Scenario:
    name: str
    description: str
    #: workload lines (``tools.twin.workload``), priorities not yet set
    lines: list[dict[str, Any]]
    #: user -> guaranteed rate (tok/s)
    rates: dict[str, float]
    #: user -> tier name (the priority arm's priority, the report's groups)
    tiers: dict[str, str]
    #: tier -> priority (lower first) for the priority arm
    priorities: dict[str, int] = field(default_factory=dict)
    #: the users left out for the baseline run (flood: the flooder)
    baseline_without: tuple[str, ...] = ()


# -- scenarios ---------------------------------------------------------------------


def _req(t: float, user: str, prompt: int, max_tokens: int) -> dict[str, Any]:
    return {"t": round(t, 6), "user": user, "prompt_tokens": prompt, "max_tokens": max_tokens}


def flood(scale: Scale, rng: random.Random) -> Scenario:
    """One user opens twice as many streams as the engine has sequences at
    once, beside steady users (Poisson arrivals, short answers) that stay
    within their rates."""
    n = scale.users - 1
    rate = 0.6 * scale.capacity / scale.users
    streams = 2 * scale.max_num_seqs
    lines = [_req(rng.uniform(0, 0.1), "flooder", 64, 512) for _ in range(streams)]
    per_user = 0.4 * rate / 64  # requests/s: 40% of the rate in 64-token answers
    for i in range(n):
        lines += [_req(t, f"steady-{i}", 64, 64)
                  for t in _poisson(rng, per_user, 0.0, scale.duration_s)]
    users = ["flooder"] + [f"steady-{i}" for i in range(n)]
    return Scenario("flood", flood.__doc__, lines, {u: rate for u in users},
                    {u: "flooder" if u == "flooder" else "steady" for u in users},
                    baseline_without=("flooder",))


def overload(scale: Scale, rng: random.Random) -> Scenario:
    """VTC's overload case: two users with the same guaranteed rate (0.3 of
    capacity each), one sending twice the other's load, together 1.5 times
    what the engine can do."""
    rate = 0.3 * scale.capacity
    lines = []
    for user, share in (("heavy", 2 / 3), ("light", 1 / 3)):
        per_s = 1.5 * scale.capacity * share / 128
        lines += [_req(t, user, 64, 128) for t in _poisson(rng, per_s, 0.0, scale.duration_s)]
    return Scenario("overload", overload.__doc__, lines, {"heavy": rate, "light": rate},
                    {"heavy": "heavy", "light": "light"})


def tiers(scale: Scale, rng: random.Random) -> Scenario:
    """Gold users (a fifth of them) with four times the free users' rate;
    every user asks for more than its rate, together 1.25 times capacity."""
    n_gold = max(1, scale.users // 5)
    n_free = scale.users - n_gold
    free = 0.7 * scale.capacity / (4 * n_gold + n_free)
    rates, tier_of, lines = {}, {}, []
    for tier, count, rate in (("gold", n_gold, 4 * free), ("free", n_free, free)):
        for i in range(count):
            user = f"{tier}-{i}"
            rates[user], tier_of[user] = rate, tier
            demand = 1.25 * scale.capacity * rate / (0.7 * scale.capacity)  # tok/s
            lines += [_req(t, user, 64, 128)
                      for t in _poisson(rng, demand / 128, 0.0, scale.duration_s)]
    return Scenario("tiers", tiers.__doc__, lines, rates, tier_of, {"gold": 0, "free": 1})


def bursts(scale: Scale, rng: random.Random) -> Scenario:
    """Half the users steady (within their rates), half on/off: 5 s on at
    four times capacity over all of them, 5 s off."""
    n = max(2, scale.users)
    rate = 0.9 * scale.capacity / n
    rates, tier_of, lines = {}, {}, []
    for i in range(n):
        kind = "steady" if i % 2 == 0 else "bursty"
        user = f"{kind}-{i // 2}"
        rates[user], tier_of[user] = rate, kind
        if kind == "steady":
            lines += [_req(t, user, 64, 64)
                      for t in _poisson(rng, 0.5 * rate / 64, 0.0, scale.duration_s)]
        else:
            on_rate = 4 * scale.capacity / (n / 2) / 128
            start = 0.0
            while start < scale.duration_s:
                lines += [_req(t, user, 64, 128) for t in _poisson(rng, on_rate, start, start + 5)]
                start += 10.0
    return Scenario("bursts", bursts.__doc__, lines, rates, tier_of)


def clients(scale: Scale, rng: random.Random) -> Scenario:
    """Many heterogeneous clients (ServeGen-like: log-normal arrival rates
    and lengths, ``twin workload clients``), together 1.2 times capacity;
    equal guaranteed rates."""
    n = scale.users
    args = argparse.Namespace(clients=n, rate=1.2 * scale.capacity / n / 128, duration=scale.duration_s,
                              prompt_tokens=64, max_tokens=128, cap=512)
    lines = gen_clients(rng, args)
    users = sorted({line["user"] for line in lines})
    rate = 0.9 * scale.capacity / n
    return Scenario("clients", clients.__doc__, lines, {u: rate for u in users},
                    {u: "client" for u in users})


def alone(scale: Scale, rng: random.Random) -> Scenario:
    """One user and nobody else: as many streams as the engine has
    sequences, a guaranteed rate of a tenth of capacity."""
    lines = [_req(rng.uniform(0, 0.1), "alone", 64, 400) for _ in range(scale.max_num_seqs)]
    return Scenario("alone", alone.__doc__, lines, {"alone": 0.1 * scale.capacity},
                    {"alone": "alone"})


SCENARIOS = {f.__name__: f for f in (flood, overload, tiers, bursts, clients, alone)}


# -- the gateway arm ---------------------------------------------------------------


class GatewayEmulation:
    """A per-user token limit at admission, as LiteLLM's proxy enforces a
    key's ``tpm_limit`` (``parallel_request_limiter_v3``, LiteLLM 1.106):
    fixed windows of 60 s opened by a user's first request; a request
    reserves its prompt tokens plus ``max_tokens`` when it is admitted and
    is refused (HTTP 429) when the window's count plus that would exceed the
    limit; when it finishes, the reservation is replaced by the tokens it
    really used. An emulation of those semantics in front of the twin, not
    LiteLLM itself."""

    WINDOW_NS = 60 * NS

    def __init__(self, tpm: dict[str, float]) -> None:
        self.tpm = tpm
        #: user -> [window start ns, tokens counted in it]
        self.windows: dict[str, list] = {}
        #: request id -> (user, window start, reserved) for requests in flight
        self.reserved: dict[str, tuple[str, int, int]] = {}

    def _window(self, user: str, now_ns: int) -> list:
        w = self.windows.get(user)
        if w is None or now_ns - w[0] >= self.WINDOW_NS:
            w = self.windows[user] = [now_ns, 0]
        return w

    def admit(self, req_id: str, user: str, prompt_tokens: int, max_tokens: int,
              now_ns: int) -> bool:
        w = self._window(user, now_ns)
        need = prompt_tokens + max_tokens
        if w[1] + need > self.tpm[user]:
            return False
        w[1] += need
        self.reserved[req_id] = (user, w[0], need)
        return True

    def finished(self, req_id: str, prompt_tokens: int, output_tokens: int, now_ns: int) -> None:
        user, start, need = self.reserved.pop(req_id)
        w = self.windows.get(user)
        if w is not None and w[0] == start:  # its window still open: true it up
            w[1] += prompt_tokens + output_tokens - need


# -- running the arms --------------------------------------------------------------


def limits_yaml(rates: dict[str, float], ceiling: bool) -> str:
    """A limits file: the most common rate as ``default``, the others listed."""
    counts: dict[float, int] = defaultdict(int)
    for r in rates.values():
        counts[r] += 1
    default = max(counts, key=lambda r: counts[r])

    def limit(r: float) -> str:
        return f"{{rate: {r:.6g}, ceiling: unlimited}}" if ceiling else f"{r:.6g}"

    lines = [f"default: {limit(default)}", "users:" if len(counts) > 1 else "users: {}"]
    lines += [f"  {u}: {limit(r)}" for u, r in rates.items() if r != default]
    return "\n".join(lines) + "\n"


def run_arm(scenario: Scenario, scale: Scale, arm: str, work: Path,
            lines: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """One arm of ``scenario``: the twin's summary plus the raw samples per
    user (TTFTs and spacings, ns) for the groups' quantiles."""
    from vllm_output_rate.tools.twin import Twin, TwinConfig

    work.mkdir(parents=True, exist_ok=True)
    lines = scenario.lines if lines is None else lines
    workload = work / "workload.jsonl"
    with open(workload, "w") as f:
        for line in lines:
            if arm == "priority" and scenario.priorities:
                line = {**line, "priority": scenario.priorities[scenario.tiers[line["user"]]]}
            f.write(json.dumps(line) + "\n")
    step = work / "step_time.json"
    step.write_text(json.dumps({"version": 1, "kind": "linear", "base_s": STEP_S,
                                "source": "hand", "note": "the fairness benchmark's fixed step"}))
    longest = max(line["prompt_tokens"] + line["max_tokens"] for line in lines)
    ours = arm in ("capped", "borrowing")
    argv = ["--workload", str(workload), "--out", str(work / "twin"), "--step-time", str(step),
            "--max-num-seqs", str(RESIDENT * scale.max_num_seqs if ours else scale.max_num_seqs),
            "--max-num-batched-tokens", str(max(2048, 2 * RESIDENT * scale.max_num_seqs)),
            "--max-model-len", str(max(1024, longest)), "--no-plots",
            # cut as the real engine's run is: what is left then is not the
            # busy window's (a capped flood would drain for hours)
            "--until", str(scale.duration_s + fe.GRACE_S)]
    admission = None
    if arm == "priority":
        argv += ["--scheduling-policy", "priority"]
    elif arm == "gateway":
        admission = GatewayEmulation({u: 60 * r for u, r in scenario.rates.items()})
    elif arm in ("capped", "borrowing"):
        # as the project is deployed (README): the same R sequences a step,
        # four times as many resident, so throttled streams hold no slot
        # another user's request needs
        argv += ["--max-num-active-seqs", str(scale.max_num_seqs)]
        limits = work / "limits.yaml"
        limits.write_text(limits_yaml(scenario.rates, ceiling=arm == "borrowing"))
        argv += ["--output-rate-limits-file", str(limits)]
    twin = Twin(TwinConfig.from_argv(argv, admission=admission))
    twin.stats.spans = {}
    summary = twin.run()
    samples = {u: (list(s.ttft_ns), list(s.itl_ns)) for u, s in twin.stats.users.items()}
    # a request without a first token at the cut: its wait so far, a TTFT
    # of at least that (censored, in the quantiles)
    for u, waits in twin.stats.unstarted_waits().items():
        samples.setdefault(u, ([], []))[0].extend(waits)
    # tokens per user in the busy window (after the warm-up, while arrivals last)
    def in_busy(series: dict[str, dict[int, int]]) -> dict[str, int]:
        return {u: sum(n for second, n in by_s.items() if WARMUP_S <= second < scale.duration_s)
                for u, by_s in series.items()}

    # each request's span (arrival to finish, s from the start; None: open
    # at the cut) and tokens per second: a user's rate while backlogged
    t0 = twin.stats.t0_ns
    spans: dict[str, list[tuple[float, float | None]]] = {
        u: [((a - t0) / NS, (b - t0) / NS) for a, b in done]
        for u, done in twin.stats.spans.items()}
    for u, arrival in twin.stats.unfinished():
        spans.setdefault(u, []).append(((arrival - t0) / NS, None))
    return {"summary": summary, "samples": samples,
            "busy_tokens": in_busy(twin.stats.tokens_by_s),
            "busy_borrowed": in_busy(twin.stats.borrowed_by_s),
            "spans": spans, "tokens_by_s": twin.stats.tokens_by_s}


def backlogged_seconds(spans: list[tuple[float, float | None]], need: int, lo: int,
                       hi: int) -> list[int]:
    """The whole seconds ``s``, ``lo <= s < hi``, throughout which at least
    ``need`` of the ``[start, end)`` spans (seconds; end None: never) were
    open (the count after every change at one moment: a span ending as
    another starts leaves it as it was)."""
    changes: dict[float, int] = defaultdict(int)
    for a, b in spans:
        changes[a] += 1
        if b is not None:
            changes[b] -= 1
    points = sorted(changes.items())
    out, count, i = [], 0, 0
    for s in range(lo, hi):
        while i < len(points) and points[i][0] <= s:
            count += points[i][1]
            i += 1
        low = count
        while i < len(points) and points[i][0] < s + 1:
            count += points[i][1]
            i += 1
            low = min(low, count)
        if low >= need:
            out.append(s)
    return out


def held_while_backlogged(scenario: Scenario, scale: Scale, result: dict[str, Any]
                          ) -> dict[str, float]:
    """Per user with at least ``MIN_BACKLOGGED_S`` backlogged seconds in
    the busy window: its tokens in them over its guaranteed rate times
    their number (1.0: it held its rate whenever it asked for it)."""
    out = {}
    for user, spans in result.get("spans", {}).items():
        rate = scenario.rates.get(user)
        if not rate:
            continue
        need = max(1, math.ceil(rate * scale.step_s - 1e-9))
        secs = backlogged_seconds(spans, need, WARMUP_S, int(scale.duration_s))
        if len(secs) >= MIN_BACKLOGGED_S:
            by_s = result["tokens_by_s"].get(user, {})
            out[user] = sum(by_s.get(s, 0) for s in secs) / (rate * len(secs))
    return out


def jain(xs: list[float]) -> float | None:
    """Jain's index of ``xs``: 1 when all equal, 1/n when one has it all."""
    xs = [x for x in xs if x is not None]
    if not xs or not any(xs):
        return None
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs))


def demand(lines: list[dict[str, Any]], duration_s: float) -> dict[str, float]:
    """Output tok/s each user asks for over the arrivals' span."""
    out: dict[str, float] = defaultdict(float)
    for line in lines:
        out[line["user"]] += line["max_tokens"] / duration_s
    return dict(out)


def water_fill(total: float, caps: dict[str, float], weights: dict[str, float]) -> dict[str, float]:
    """``total`` shared in proportion to ``weights``, none above its cap,
    what a capped one leaves shared again among the others (max-min fair)."""
    share = {u: 0.0 for u in caps}
    open_ = {u for u, c in caps.items() if c > 0}
    left = total
    while open_ and left > 1e-9:
        w = sum(weights[u] for u in open_)
        step = {u: left * weights[u] / w for u in open_}
        left = 0.0
        for u in list(open_):
            room = caps[u] - share[u]
            if step[u] >= room:
                share[u] = caps[u]
                left += step[u] - room
                open_.discard(u)
            else:
                share[u] += step[u]
    return share


def figures(scenario: Scenario, scale: Scale, result: dict[str, Any],
            lines: list[dict[str, Any]]) -> dict[str, Any]:
    """Per group of users (tier) and for the arm."""
    summary, samples = result["summary"], result["samples"]
    users = summary["users"]
    virtual_s = summary["run"]["virtual_s"]
    asked = demand(lines, scale.duration_s)
    requests: dict[str, int] = defaultdict(int)
    for line in lines:
        requests[line["user"]] += 1
    busy_s = scale.duration_s - WARMUP_S
    busy = {u: result["busy_tokens"].get(u, 0) / busy_s for u in asked}
    held_by_user = held_while_backlogged(scenario, scale, result)
    groups: dict[str, list[str]] = defaultdict(list)
    for user in asked:
        groups[scenario.tiers[user]].append(user)
    out_groups = {}
    for group, members in sorted(groups.items()):
        ttft = [x for u in members for x in samples.get(u, ([], []))[0]]
        itl = [x for u in members for x in samples.get(u, ([], []))[1]]
        rates = [busy[u] for u in members]
        held = [held_by_user[u] for u in members if u in held_by_user]
        limit = scenario.rates[members[0]]
        out_groups[group] = {
            "users": len(members),
            "limit_tok_s": round(limit, 3),
            "rate_tok_s_median": round(quantile(rates, 0.5), 3) if rates else None,
            "rate_over_limit_min": round(min(rates) / limit, 4) if rates else None,
            # users backlogged for at least MIN_BACKLOGGED_S whole seconds,
            # the least rate held over them / the guaranteed rate
            "backlogged": len(held),
            "held_while_backlogged_min": round(min(held), 4) if held else None,
            "output_tokens": sum(users.get(u, {}).get("output_tokens", 0) for u in members),
            "borrowed_tokens": sum(users.get(u, {}).get("borrowed_tokens", 0) for u in members),
            "requests": sum(requests[u] for u in members),
            "refused": sum(users.get(u, {}).get("refused", 0) for u in members),
            "unstarted": sum(users.get(u, {}).get("unstarted", 0) for u in members),
            "ttft_s": _p50_p99_s(ttft),
            "itl_p99_s": round(quantile(itl, 0.99) / NS, 4) if itl else None,
        }
        if "engine_ttft" in result:  # the real engine, this project's arms
            eng = [x for u in members for x in result["engine_ttft"].get(u, ())]
            out_groups[group]["ttft_engine_s"] = _p50_p99_s(eng)
    total = sum(u["output_tokens"] for u in users.values())
    # weighted Jain's index over the backlogged users (asking for at least
    # 1.5 times their guaranteed rate): each one's busy-window tok/s over its
    # rate
    backlogged = [u for u, d in asked.items() if d >= 1.5 * scenario.rates[u]]
    # the busy window's borrowed tokens of the backlogged users against the
    # weighted max-min fair split of them (each capped at what it asked for
    # beyond its rate): 1 when split as VTC's counters do
    borrowed = {u: result["busy_borrowed"].get(u, 0) / busy_s for u in asked}
    excess = {u: max(0.0, asked[u] - scenario.rates[u]) for u in asked}
    among = {u: excess[u] for u in backlogged}
    fair = water_fill(sum(borrowed[u] for u in backlogged), among, scenario.rates)
    borrowers = [u for u in backlogged if fair[u] > 0]
    return {
        "groups": out_groups,
        "throughput_tok_s": round(total / virtual_s, 2) if virtual_s else None,
        "virtual_s": virtual_s, "wall_s": summary["run"]["wall_s"],
        "jain_weighted": _round(jain([busy[u] / scenario.rates[u] for u in backlogged])),
        "jain_borrowed": _round(jain([borrowed[u] / fair[u] for u in borrowers])
                                if len(borrowers) > 1 and sum(borrowed.values()) else None),
        "backlogged_users": len(backlogged),
    }


def _p50_p99_s(samples_ns: list[int]) -> dict[str, float | None]:
    """p50 and p99 of ns samples, in seconds (None without samples)."""
    return {q: (round(quantile(samples_ns, p) / NS, 4) if samples_ns else None)
            for q, p in (("p50", 0.5), ("p99", 0.99))}


def _round(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(x, digits)


def engine_runner(model: str, litellm: str | None) -> Any:
    """``run_arm``'s counterpart on a real CPU engine (``fairness_engine``)."""
    vocab = fe.model_vocab(model)

    def run(scenario: Scenario, scale: Scale, arm: str, work: Path,
            lines: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        ours = arm in ("capped", "borrowing")
        return fe.run_arm(
            scenario.lines if lines is None else lines, arm, work, model=model, vocab=vocab,
            litellm=litellm, rates=scenario.rates,
            priority={u: scenario.priorities[t] for u, t in scenario.tiers.items()
                      if t in scenario.priorities},
            limits_text=limits_yaml(scenario.rates, ceiling=arm == "borrowing") if ours else None,
            r=scale.max_num_seqs, duration_s=scale.duration_s, warmup_s=WARMUP_S)

    return run


def run_scenario(name: str, scale: Scale, arms: list[str], out: Path, seed: int,
                 progress: Any = print, runner: Any = None) -> dict[str, Any]:
    scenario = SCENARIOS[name](scale, random.Random(seed))
    result: dict[str, Any] = {"description": " ".join(scenario.description.split()),
                              "requests": len(scenario.lines), "users": len(scenario.rates),
                              "arms": {}, "baseline": {}}
    for arm in arms:
        t0 = time.perf_counter()
        run = (runner or run_arm)(scenario, scale, arm, out / name / arm)
        result["arms"][arm] = figures(scenario, scale, run, scenario.lines)
        if "errors" in run:
            result["arms"][arm]["errors"] = run["errors"]
        progress(f"{scale.name}/{name}/{arm}: {time.perf_counter() - t0:.1f} s")
    if scenario.baseline_without:
        kept = [line for line in scenario.lines if line["user"] not in scenario.baseline_without]
        for arm in arms:
            run = (runner or run_arm)(scenario, scale, arm, out / name / f"{arm}-baseline", kept)
            result["baseline"][arm] = figures(scenario, scale, run, kept)
            progress(f"{scale.name}/{name}/{arm} without {', '.join(scenario.baseline_without)}")
    return result


# -- goals ---------------------------------------------------------------------------


def goals(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's goals, each with its figure and whether it is met."""
    out = []

    def add(name: str, value: float | None, target: str, met: bool | None) -> None:
        out.append({"goal": name, "value": value, "target": target, "met": met})

    a = results.get("alone", {}).get("arms", {})
    if "borrowing" in a and "fcfs" in a:
        ratio = a["borrowing"]["throughput_tok_s"] / a["fcfs"]["throughput_tok_s"]
        add("alone: borrowing throughput / feature off", round(ratio, 4), ">= 0.95", ratio >= 0.95)
    for name in ("tiers", "overload"):
        arms = results.get(name, {}).get("arms", {})
        b, c = arms.get("borrowing"), arms.get("capped")
        if not b or not c:
            continue
        held = [g["held_while_backlogged_min"] for g in b["groups"].values()
                if g["held_while_backlogged_min"] is not None]
        goal = f"{name}: borrowing, least user's rate while backlogged / its guaranteed rate"
        if held:
            kept = min(held)
            add(goal, kept, ">= 0.99", kept >= 0.99)
        else:  # every request served as it came: the guarantee never bound
            add(goal, None, ">= 0.99", True)
        for group, g in b["groups"].items():
            cg = c["groups"][group]
            for label, bv, cv in (("TTFT p99", g["ttft_s"]["p99"], cg["ttft_s"]["p99"]),
                                  ("spacing p99", g["itl_p99_s"], cg["itl_p99_s"])):
                if bv is None or cv is None:
                    continue
                ratio = bv / cv if cv else (1.0 if bv == cv else math.inf)
                add(f"{name}/{group}: borrowing {label} / capped", round(ratio, 4), "<= 1.10",
                    ratio <= 1.10)
        if b["jain_borrowed"] is not None:
            add(f"{name}: borrowed split, weighted Jain's index", b["jain_borrowed"], ">= 0.95",
                b["jain_borrowed"] >= 0.95)
    fl = results.get("flood", {})
    for arm in ("capped", "borrowing"):
        with_flood = fl.get("arms", {}).get(arm, {}).get("groups", {}).get("steady")
        without = fl.get("baseline", {}).get(arm, {}).get("groups", {}).get("steady")
        if with_flood and without and without["ttft_s"]["p99"]:
            ratio = with_flood["ttft_s"]["p99"] / without["ttft_s"]["p99"]
            add(f"flood: {arm}, victims' TTFT p99 / without the flood", round(ratio, 4),
                "<= 1.2", ratio <= 1.2)
        # the real engine: the same, engine-side (the scheduler receiving it
        # to the first token's step), without the API server's work
        eng = (with_flood or {}).get("ttft_engine_s", {}).get("p99")
        eng0 = (without or {}).get("ttft_engine_s", {}).get("p99")
        if eng is not None and eng0:
            add(f"flood: {arm}, victims' TTFT p99 engine-side / without the flood",
                round(eng / eng0, 4), "<= 1.2", eng / eng0 <= 1.2)
    return out


# -- the report --------------------------------------------------------------------


def _f(x: Any, scale: float = 1.0, digits: int = 1) -> str:
    return "–" if x is None else f"{x * scale:.{digits}f}"


def render(results: dict[str, Any], scale: Scale, command: str) -> str:
    if results.get("engine") == "cpu":
        head = (f"## The real CPU engine: {scale.max_num_seqs} sequences, rates sized on a "
                f"nominal {scale.step_s * 1e3:g} ms step ({scale.capacity:,.0f} tok/s), "
                f"{scale.duration_s:g} s of arrivals (client-side times; throughput over the "
                f"run to {fe.GRACE_S:g} s after the arrivals)")
    else:
        head = (f"## Scale `{scale.name}`: {scale.max_num_seqs} sequences, a {scale.step_s * 1e3:g} ms "
                f"step ({scale.capacity:,.0f} tok/s at most), {scale.duration_s:g} s of arrivals")
    lines = [head, "", f"`{command}`", ""]
    for name, res in results["scenarios"].items():
        lines += [f"### {name}", "", res["description"],
                  f"({res['requests']:,} requests, {res['users']:,} users)", "",
                  "| arm | group | users | rate/limit (median) | least rate/limit while backlogged (users) "
                  "| TTFT p50 ms | TTFT p99 ms | spacing p99 ms | borrowed | refused "
                  "| not started |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for arm, fig in res["arms"].items():
            for group, g in fig["groups"].items():
                med = g["rate_tok_s_median"]
                lines.append(
                    f"| {arm} | {group} | {g['users']} | "
                    f"{_f(None if med is None else med / g['limit_tok_s'], digits=2)} | "
                    f"{_f(g['held_while_backlogged_min'], digits=2)} ({g['backlogged']}) | "
                    f"{_f(g['ttft_s']['p50'], 1e3)} | "
                    f"{_f(g['ttft_s']['p99'], 1e3)} | {_f(g['itl_p99_s'], 1e3)} | "
                    f"{g['borrowed_tokens']:,} | {g['refused']:,}/{g['requests']:,} | "
                    f"{g.get('unstarted', 0):,} |")
        lines += ["", "| arm | throughput tok/s | weighted Jain (backlogged) | Jain of borrowed / fair "
                      "| virtual s | wall s |", "|---|---:|---:|---:|---:|---:|"]
        for arm, fig in res["arms"].items():
            lines.append(f"| {arm} | {fig['throughput_tok_s']:,.0f} | {_f(fig['jain_weighted'], digits=3)} "
                         f"| {_f(fig['jain_borrowed'], digits=3)} | {fig['virtual_s']:.1f} "
                         f"| {fig['wall_s']:.1f} |")
        engine_side = [(arm, group, g) for arm, fig in [*res["arms"].items(), *(
            (f"{a} without the flood", f) for a, f in res["baseline"].items())]
            for group, g in fig["groups"].items() if g.get("ttft_engine_s")]
        if engine_side:
            lines += ["", "TTFT engine-side (this project's arms: from the scheduler receiving "
                      "the request to the step that sampled its first token, in the engine's "
                      "event log):", "",
                      "| arm | group | TTFT p50 ms | TTFT p99 ms |", "|---|---|---:|---:|"]
            lines += [f"| {arm} | {group} | {_f(g['ttft_engine_s']['p50'], 1e3)} | "
                      f"{_f(g['ttft_engine_s']['p99'], 1e3)} |" for arm, group, g in engine_side]
        if res["baseline"]:
            lines += ["", "Without the flood (the victims' baseline):", "",
                      "| arm | steady TTFT p50 ms | steady TTFT p99 ms | spacing p99 ms |",
                      "|---|---:|---:|---:|"]
            for arm, fig in res["baseline"].items():
                g = fig["groups"].get("steady", {})
                lines.append(f"| {arm} | {_f(g.get('ttft_s', {}).get('p50'), 1e3)} | "
                             f"{_f(g.get('ttft_s', {}).get('p99'), 1e3)} | "
                             f"{_f(g.get('itl_p99_s'), 1e3)} |")
        lines.append("")
    lines += ["### Goals", "", "| goal | value | target | met |", "|---|---:|---|---|"]
    for g in results["goals"]:
        value = "– (no user backlogged)" if g["value"] is None else g["value"]
        lines.append(f"| {g['goal']} | {value} | {g['target']} | "
                     f"{'yes' if g['met'] else 'no'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    description, epilog = description_and_epilog(__doc__)
    parser = argparse.ArgumentParser(prog="vllm-output-rate fairness", description=description,
                                     formatter_class=PlainHelpFormatter, epilog=epilog)
    parser.add_argument("--scale", choices=list(SCALES), default="small")
    parser.add_argument("--scenario", action="append", choices=list(SCENARIOS),
                        help="repeat for several (default: all)")
    parser.add_argument("--arm", action="append", choices=list(ARMS),
                        help="repeat for several (default: all)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine", choices=("twin", "cpu"), default="twin",
                        help="twin: vLLM's scheduler in virtual time (the default); cpu: a real "
                        "vLLM CPU engine per arm through the OpenAI API, the gateway arm the "
                        "real LiteLLM proxy (tools.fairness_engine; --scale is its own)")
    parser.add_argument("--model", help="--engine cpu: the model directory (default: the "
                        "tiny model, generated locally)")
    parser.add_argument("--litellm", help="--engine cpu: the litellm command of an environment "
                        "with litellm[proxy] (default: litellm on PATH; without one the gateway "
                        "arm is refused)")
    args = parser.parse_args(argv)
    scale = SCALES[args.scale]
    if args.engine == "cpu":
        scale = ENGINE_SCALE
    arms = args.arm or list(ARMS)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "vllm-output-rate fairness " + " ".join(
        a for a in (argv if argv is not None else sys.argv[1:]) if a != args.out and a != "--out")
    results: dict[str, Any] = {"scale": scale.__dict__ | {"capacity_tok_s": scale.capacity},
                               "engine": args.engine, "seed": args.seed, "arms": arms,
                               "scenarios": {}}
    progress = lambda m: print(m, file=sys.stderr)  # noqa: E731
    for name in args.scenario or list(SCENARIOS):
        runner = None
        if args.engine == "cpu":
            from vllm_output_rate.tools.common.tiny_model import ensure_tiny_model

            litellm = fe.find_litellm(args.litellm)
            if "gateway" in arms and litellm is None:
                parser.error("--arm gateway on --engine cpu needs --litellm (no litellm on PATH)")
            runner = engine_runner(args.model or str(ensure_tiny_model()), litellm)
        results["scenarios"][name] = run_scenario(name, scale, arms, out, args.seed,
                                                  progress=progress, runner=runner)
    results["goals"] = goals(results["scenarios"])
    (out / "fairness.json").write_text(json.dumps(results, indent=1) + "\n")
    text = render(results, scale, command.strip())
    (out / "fairness.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
