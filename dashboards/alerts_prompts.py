"""The prompts' alert: one user's prompt work taking much of an engine's
step time while other users are served (``thresholds.yaml``
``prompt_share``; docs/prompts.md); with its promtool cases."""

from __future__ import annotations

from typing import Any

from vllm_output_rate.dashboards.alert import MODEL, R1, R2, Alert, fires, quiet, series
from vllm_output_rate.dashboards.config import Config
from vllm_output_rate.dashboards.expressions import others_tokens_expr, prompt_share_expr

NAME = "OutputRateUserPromptsDominateSteps"


def alerts(c: Config) -> list[Alert]:
    p = c["prompt_share"]
    at = c.where()
    engine = "engine {{ $labels.engine }} of model {{ $labels.model_name }}" + at
    on = f"on ({c.by('model_name', 'engine', 'user')})"
    return [Alert(
        NAME,
        f"({prompt_share_expr(c)}) > {p['share']:g} and {on}"
        f" ({others_tokens_expr(c)}) >= {p['min_others_tokens_per_second']:g}",
        p["for"], c.severity("prompt_share"),
        "User {{ $labels.user }}'s prompts take much of the step time of " + engine,
        "User {{ $labels.user }}'s prompt work took {{ $value | humanizePercentage }} of the "
        f"step time of {engine} over the last {p['window']} (alert above "
        f"{100 * p['share']:.0f}%) while other users were served: every request in those steps "
        "waited for its prompts. Give the user a prompt budget (prompt_rate in the limits file) "
        "or a lower one; the users dashboard's 'Who makes the steps long' panel shows the "
        "others. The share is each step's measured time split by the step-time model "
        "(OUTPUT_RATE_STEP_TIME, else a built-in estimate).")]


def _engine(prompt: dict[str, str], others: float = 400, **labels: str) -> list[dict[str, str]]:
    """One busy engine (60 step seconds a minute) and its users' prompt
    seconds per minute (``prompt``: user -> per-minute increase); each
    prompting user charged 5 tok/s, the others ``others`` tok/s."""
    out = [series("engine_step_seconds", "0+60x30", **labels),
           series("engine_tokens_charged", f"0+{60 * (others + 5 * len(prompt)):g}x30", **labels)]
    for user, per_minute in prompt.items():
        out.append(series("prompt_step_seconds", f"0+{per_minute}x30", user=user, **labels))
        out.append(series("tokens_charged", "0+300x30", user=user, **labels))
    return out


def _description(share: str, where: str = "") -> str:
    return (f"User user-f's prompt work took {share} of the step time of engine 0 of model tiny"
            f"{where} over the last 5m (alert above 10%) while other users were served: every "
            "request in those steps waited for its prompts. Give the user a prompt budget "
            "(prompt_rate in the limits file) or a lower one; the users dashboard's 'Who makes "
            "the steps long' panel shows the others. The share is each step's measured time "
            "split by the step-time model (OUTPUT_RATE_STEP_TIME, else a built-in estimate).")


def cases(c: Config) -> list[dict[str, Any]]:
    summary = "User user-f's prompts take much of the step time of engine 0 of model tiny"
    return [
        {
            "name": "prompts dominate steps: a user's prompts take 60% of the step time",
            "interval": "1m",
            "input_series": _engine({"user-f": "36", "user-a": "3"}),
            "alert_rule_test": [
                quiet(NAME, "4m"),  # not yet for 5m
                fires(c, NAME, "15m", {"severity": "warning", "model_name": MODEL,
                                       "engine": "0", "user": "user-f"},
                      summary, _description("60%")),
            ],
        },
        {
            "name": "prompts dominate steps: 5%, a user alone, or the overflow label do not fire",
            "interval": "1m",
            "input_series": [
                *_engine({"user-f": "3"}),
                # alone on its engine: its own steps slow nobody
                *_engine({"user-alone": "54"}, others=0, engine="1"),
                # the label-cap overflow is many users
                *_engine({"__other__": "54"}, engine="2"),
            ],
            "alert_rule_test": [quiet(NAME, "20m")],
        },
    ]


def fleet_cases(c: Config) -> list[dict[str, Any]]:
    """Two replicas: the alert names the one whose steps the user's prompts fill."""
    return [
        {
            "name": "fleet, prompts dominate steps: 60% on one replica fires for that replica",
            "interval": "1m",
            "input_series": [*_engine({"user-f": "36"}, instance=R1),
                             *_engine({"user-f": "3"}, instance=R2)],
            "alert_rule_test": [
                fires(c, NAME, "15m", {"severity": "warning", "model_name": MODEL, "engine": "0",
                                       "user": "user-f", "instance": R1},
                      "User user-f's prompts take much of the step time of engine 0 of model "
                      f"tiny on instance {R1}", _description("60%", f" on instance {R1}")),
            ],
        },
        {
            "name": "fleet, prompts dominate steps: 5% on each of two replicas does not fire",
            "interval": "1m",
            "input_series": [*_engine({"user-f": "3"}, instance=R1),
                             *_engine({"user-f": "3"}, instance=R2)],
            "alert_rule_test": [quiet(NAME, "20m")],
        },
    ]
