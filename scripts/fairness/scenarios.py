"""The fairness benchmark's scales and scenarios: each scenario a workload
(lines of ``twin.workload``), the users' guaranteed rates and tiers,
deterministic given its seed."""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, field
from typing import Any

from vllm_output_rate.tools.fairness import engine as fe
from vllm_output_rate.tools.twin.step_time import StepTimeModel
from vllm_output_rate.tools.twin.workload import _poisson, gen_clients, long_prompt_lines

NS = 1_000_000_000
#: the step time of every run: 25 ms a step whatever it holds (a GPU's
#: decode step at the batch sizes here; the arms differ in what a step
#: holds, not in how long it takes)
STEP_S = 0.025


@dataclass(frozen=True)
class Scale:
    name: str
    max_num_seqs: int
    #: users of the multi-user scenarios
    users: int
    duration_s: float
    #: the step time the scenarios' rates are sized on (the twin's fixed
    #: step; a real engine's nominal one, ``fairness.engine``)
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
    #: the arms it runs by default (None: ``arms.ARMS``)
    arms: tuple[str, ...] | None = None
    #: the twin's step time (None: ``arms.FIXED_STEP``, 25 ms whatever the
    #: step holds)
    step_time: StepTimeModel | None = None
    #: engine options of every arm (``twin.engine_args`` names)
    engine: dict[str, Any] = field(default_factory=dict)
    #: user -> prompt budget (prompt tok/s) of the arms that take one
    #: (``capped-prompt``; ``gateway-input``: x 60 a minute)
    prompt_rates: dict[str, float] = field(default_factory=dict)
    #: the ``fcfs-threshold`` arm's ``--long-prefill-token-threshold``
    long_prefill_threshold: int = 0


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


@dataclass(frozen=True)
class LongPromptSizes:
    """The long-prompts scenario at one scale."""
    steady: int
    flooders: int
    #: the flooders' prompt (tokens) and requests a second each
    prompt: int
    per_s: float
    #: a prompt token's cost: the twin's step model (25 ms a step plus
    #: this per prefill token), and what the prompt budgets are sized on
    per_prefill_token_s: float
    #: the ``fcfs-threshold`` arm's threshold (tokens)
    threshold: int


#: issue 48's numbers at the small scale (four steady users, one flooder
#: sending a 3,800-token prompt four times a second, 20 us a prompt token);
#: ``gpu``: 64 copies of it (a 16-sequence slice each) on a GPU computing
#: prompts 64 times as fast (a prompt token's share of a step the same);
#: ``cpu``: the issue's real-engine case (three steady users, a 900-token
#: prompt ten times a second; the tiny model's prefill about 35 us a token,
#: the threshold scaled with the prompt)
LONG_PROMPTS = {
    "small": LongPromptSizes(4, 1, 3800, 4.0, 20e-6, 512),
    "gpu": LongPromptSizes(256, 64, 3800, 4.0, 20e-6 * 16 / 1024, 512),
    "cpu": LongPromptSizes(3, 1, 900, 10.0, 35e-6, 128),
}
#: the prompt budgets' share of step time (prompt_rate x a token's cost):
#: everyone's default, and the flooders' (all of them together: each
#: flooder's is this over their number)
PROMPT_SHARE_DEFAULT, PROMPT_SHARE_FLOODER = 0.4, 0.08
LONG_PROMPT_ARMS = ("fcfs", "fcfs-threshold", "priority", "gateway-input", "capped",
                    "capped-prompt")


def long_prompts(scale: Scale, rng: random.Random) -> Scenario:
    """Long prompts, short answers (issue 48): steady users sending a
    request every 2 s each (200-token prompts, 150 tokens out) beside a
    user that sends a long prompt with 20 tokens out several times a
    second from 2 s on; limits 100 and 5 tok/s; the twin's step 25 ms
    plus a prompt token's cost per prefill token."""
    size = LONG_PROMPTS[scale.name]
    # the limits at every scale: the steady users within theirs
    # (they ask for 75 tok/s each), the flooder far over its own
    steady_rate, flood_rate = 100.0, 5.0
    names = ["flooder"] if size.flooders == 1 else [f"flooder-{i}" for i in range(size.flooders)]
    lines = long_prompt_lines(rng, size.steady, 2.0, 200, 150, names, size.prompt, 20, size.per_s,
                              2.0, scale.duration_s)
    lines.sort(key=lambda line: line["t"])
    rates, tier_of, prompt_rates = {}, {}, {}
    for i in range(size.steady):
        user = f"steady-{i}"
        rates[user], tier_of[user] = steady_rate, "steady"
        prompt_rates[user] = PROMPT_SHARE_DEFAULT / size.per_prefill_token_s
    for user in names:
        rates[user], tier_of[user] = flood_rate, "flooder"
        prompt_rates[user] = PROMPT_SHARE_FLOODER / size.flooders / size.per_prefill_token_s
    return Scenario(
        "long_prompts", long_prompts.__doc__, lines, rates, tier_of, {"steady": 0, "flooder": 1},
        baseline_without=tuple(names), arms=LONG_PROMPT_ARMS,
        step_time=StepTimeModel(base_s=scale.step_s, per_prefill_token_s=size.per_prefill_token_s,
                                source="hand", note="the long-prompts scenario's step (issue 48)"),
        engine={"max_model_len": 4096 if size.prompt > 1000 else 1024,
                "max_num_batched_tokens": 8192, "enable_chunked_prefill": True},
        prompt_rates=prompt_rates, long_prefill_threshold=size.threshold)


SCENARIOS = {f.__name__: f for f in (flood, overload, tiers, bursts, clients, alone,
                                     long_prompts)}
