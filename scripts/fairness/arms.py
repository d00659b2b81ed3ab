"""The fairness benchmark's arms: each one a twin run built in memory
(``twin.TwinConfig``: the scenario's workload, the arm's engine options and
limits, a fixed step time), or on a real engine (``engine_runner``,
``fairness.engine``); the gateway arm's admission (``GatewayEmulation``)."""

from __future__ import annotations

import random
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from vllm_output_rate.tools.fairness import engine as fe
from vllm_output_rate.tools.fairness.figures import WARMUP_S, figures
from vllm_output_rate.tools.fairness.scenarios import NS, SCENARIOS, STEP_S, Scale, Scenario
from vllm_output_rate.tools.twin.step_time import StepTimeModel

ARMS = ("fcfs", "priority", "gateway", "capped", "borrowing")
#: arms that only scenarios naming them run (``Scenario.arms``): upstream
#: with ``--long-prefill-token-threshold``, the gateway counting prompt
#: tokens (LiteLLM's ``token_rate_limit_type: input``), this project
#: capped with prompt budgets (``prompt_rate``)
MORE_ARMS = ("fcfs-threshold", "gateway-input", "capped-prompt")
#: this project's arms
OURS = ("capped", "borrowing", "capped-prompt")
#: this project's arms keep this many times the active sequences resident
#: (``--max-num-seqs 4R --max-num-active-seqs R``, as the README deploys it)
RESIDENT = 4
#: every twin arm's step time: ``STEP_S`` whatever the step holds
FIXED_STEP = StepTimeModel(base_s=STEP_S, source="hand",
                           note="the fairness benchmark's fixed step")


# -- the gateway arm ---------------------------------------------------------------


class GatewayEmulation:
    """A per-user token limit at admission, as LiteLLM's proxy enforces a
    key's ``tpm_limit`` (``parallel_request_limiter_v3``, LiteLLM 1.106):
    fixed windows of 60 s opened by a user's first request; a request
    reserves its prompt tokens plus ``max_tokens`` when it is admitted and
    is refused (HTTP 429) when the window's count plus that would exceed the
    limit; when it finishes, the reservation is replaced by the tokens it
    really used. An emulation of those semantics in front of the twin, not
    LiteLLM itself.

    ``count="input"``: LiteLLM's ``token_rate_limit_type: input`` (its
    docs: TPM limits count only prompt tokens; enforced as the total is,
    reserved before the call and reconciled after): a request reserves its
    prompt tokens alone, which is also what it used."""

    WINDOW_NS = 60 * NS

    def __init__(self, tpm: dict[str, float], count: str = "total") -> None:
        if count not in ("total", "input"):
            raise ValueError(f"count: 'total' or 'input', not {count!r}")
        self.tpm = tpm
        self.count = count
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
        need = prompt_tokens + (max_tokens if self.count == "total" else 0)
        if w[1] + need > self.tpm[user]:
            return False
        w[1] += need
        self.reserved[req_id] = (user, w[0], need)
        return True

    def finished(self, req_id: str, prompt_tokens: int, output_tokens: int, now_ns: int) -> None:
        user, start, need = self.reserved.pop(req_id)
        w = self.windows.get(user)
        if w is not None and w[0] == start:  # its window still open: true it up
            used = prompt_tokens + (output_tokens if self.count == "total" else 0)
            w[1] += used - need


# -- running the arms --------------------------------------------------------------


def limits_yaml(rates: dict[str, float], ceiling: bool,
                prompt_rates: dict[str, float] | None = None) -> str:
    """A limits file: the most common rate (with ``prompt_rates``: rate and
    prompt budget) as ``default``, the others listed."""
    of = {u: (r, (prompt_rates or {}).get(u)) for u, r in rates.items()}
    counts: dict[tuple, int] = defaultdict(int)
    for key in of.values():
        counts[key] += 1
    default = max(counts, key=lambda k: counts[k])

    def limit(key: tuple) -> str:
        r, p = key
        if p is not None:
            return f"{{rate: {r:.6g}, prompt_rate: {p:.6g}}}"
        return f"{{rate: {r:.6g}, ceiling: unlimited}}" if ceiling else f"{r:.6g}"

    lines = [f"default: {limit(default)}", "users:" if len(counts) > 1 else "users: {}"]
    lines += [f"  {u}: {limit(k)}" for u, k in of.items() if k != default]
    return "\n".join(lines) + "\n"


def arm_limits(scenario: Scenario, arm: str) -> str | None:
    """The limits file of one of this project's arms (None: not one)."""
    if arm not in OURS:
        return None
    return limits_yaml(scenario.rates, ceiling=arm == "borrowing",
                       prompt_rates=scenario.prompt_rates if arm == "capped-prompt" else None)


def run_arm(scenario: Scenario, scale: Scale, arm: str, work: Path,
            lines: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """One arm of ``scenario`` in the twin, its config built here: the twin's
    summary plus the raw samples per user (TTFTs and spacings, ns) for the
    groups' quantiles."""
    from vllm_output_rate.tools.twin import Twin, TwinConfig, TwinLimits, engine_args
    from vllm_output_rate.tools.twin.workload import workload_of_lines

    lines = scenario.lines if lines is None else lines
    if arm == "priority" and scenario.priorities:
        lines = [{**line, "priority": scenario.priorities[scenario.tiers[line["user"]]]}
                 for line in lines]
    longest = max(line["prompt_tokens"] + line["max_tokens"] for line in lines)
    ours = arm in OURS
    engine: dict[str, Any] = {
        "max_num_seqs": RESIDENT * scale.max_num_seqs if ours else scale.max_num_seqs,
        "max_num_batched_tokens": max(2048, 2 * RESIDENT * scale.max_num_seqs),
        "max_model_len": max(1024, longest), **scenario.engine}
    admission, limits = None, TwinLimits()
    if arm == "priority":
        engine["scheduling_policy"] = "priority"
    elif arm == "fcfs-threshold":
        engine["long_prefill_token_threshold"] = scenario.long_prefill_threshold
    elif arm == "gateway":
        admission = GatewayEmulation({u: 60 * r for u, r in scenario.rates.items()})
    elif arm == "gateway-input":
        admission = GatewayEmulation({u: 60 * p for u, p in scenario.prompt_rates.items()},
                                     count="input")
    elif ours:
        # as the project is deployed (README): the same R sequences a step,
        # four times as many resident, so throttled streams hold no slot
        # another user's request needs
        engine["max_num_active_seqs"] = scale.max_num_seqs
        limits = TwinLimits(limits_text=arm_limits(scenario, arm))
    twin = Twin(TwinConfig(
        workload=workload_of_lines(lines), out=work / "twin", engine=engine_args(**engine),
        limits=limits, step_time=scenario.step_time or FIXED_STEP, plots=False,
        admission=admission,
        # cut as the real engine's run is: what is left then is not the
        # busy window's (a capped flood would drain for hours)
        until_s=scale.duration_s + fe.GRACE_S))
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


def engine_runner(model: str, litellm: str | None) -> Any:
    """``run_arm``'s counterpart on a real CPU engine (``fairness.engine``)."""
    vocab = fe.model_vocab(model)

    def run(scenario: Scenario, scale: Scale, arm: str, work: Path,
            lines: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        return fe.run_arm(
            scenario.lines if lines is None else lines, arm, work, model=model, vocab=vocab,
            litellm=litellm,
            rates=scenario.prompt_rates if arm == "gateway-input" else scenario.rates,
            priority={u: scenario.priorities[t] for u, t in scenario.tiers.items()
                      if t in scenario.priorities},
            limits_text=arm_limits(scenario, arm), r=scale.max_num_seqs,
            duration_s=scale.duration_s, warmup_s=WARMUP_S,
            threshold=scenario.long_prefill_threshold)

    return run


def arms_of(scenario: Scenario, asked: list[str] | None) -> list[str]:
    """The arms ``scenario`` runs: those asked for that it has (its own,
    ``Scenario.arms``, or ``ARMS``), all of them when none were asked."""
    own = list(scenario.arms or ARMS)
    return own if asked is None else [a for a in asked if a in own]


def run_scenario(name: str, scale: Scale, arms: list[str] | None, out: Path, seed: int,
                 progress: Any = print, runner: Any = None) -> dict[str, Any]:
    scenario = SCENARIOS[name](scale, random.Random(seed))
    arms = arms_of(scenario, arms)
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
