"""The users' alerts: a user above what the limiter can allow (a limiter
bug or a user served by two engines) and a user throttled almost all the
time; with their promtool cases."""

from __future__ import annotations

from typing import Any

from vllm_output_rate.dashboards.alert import MODEL, R1, R2, Alert, fires, quiet, series
from vllm_output_rate.dashboards.config import Config
from vllm_output_rate.dashboards.expressions import (
    over_limit_expr,
    over_limit_factor,
    throttled_share_expr,
)


def alerts(c: Config) -> list[Alert]:
    at = c.where()
    w = c.over["window"]
    return [
        Alert(
            "OutputRateUserOverLimit",
            over_limit_expr(c),
            c.over["for"], c.severity("over_limit"),
            "User {{ $labels.user }} gets more output tokens than its limit on model "
            "{{ $labels.model_name }}" + at,
            "User {{ $labels.user }} on model {{ $labels.model_name }}" + at + " was charged "
            "{{ $value | humanizePercentage }} of its configured output-token limit over the last "
            f"{w}, summed over {c.per_group()}; the limiter allows at most about "
            f"{100 * over_limit_factor(c):.1f}% plus one token. Either the limiter is broken or the "
            "user is served by more than one engine (each engine has its own budget). Tokens "
            "borrowed above a guaranteed rate (a limit with a ceiling) are not charged and never "
            "count here: see the runbook's 'A user is above its rate'."),
        Alert(
            "OutputRateUserThrottledContinuously",
            f"{throttled_share_expr(c)} > {c.long['share']}",
            c.long["for"], c.severity("throttled_long"),
            "User {{ $labels.user }} is throttled almost all the time on model "
            "{{ $labels.model_name }}" + at,
            "User {{ $labels.user }} on model {{ $labels.model_name }}" + at + " had throttled requests "
            f"{{{{ $value | humanizePercentage }}}} of the last {c.long['window']} (alert above "
            f"{100 * c.long['share']:.0f}%): its demand stays above its limit. Its requests wait "
            "holding KV cache; raise its limit (tier) or ask it to send less."),
    ]


def cases(c: Config) -> list[dict[str, Any]]:
    """One engine, or two of one replica."""
    user_limit = "user_limit_tokens_per_second"
    over = "OutputRateUserOverLimit"
    cont = "OutputRateUserThrottledContinuously"
    return [
        {
            "name": "over limit: one user served by two engines gets twice its limit",
            "interval": "1m",
            "input_series": [
                # 20 tok/s = 1200 tokens a minute on each engine
                series("tokens_charged", "0+1200x30", user="user-a", engine="0"),
                series("tokens_charged", "0+1200x30", user="user-a", engine="1"),
                series(user_limit, "20x30", user="user-a", engine="0"),
                series(user_limit, "20x30", user="user-a", engine="1"),
            ],
            "alert_rule_test": [
                quiet(over, "4m"),  # not yet for 5m
                fires(c, over, "15m", {"severity": "critical", "model_name": MODEL, "user": "user-a"},
                    "User user-a gets more output tokens than its limit on model tiny",
                    "User user-a on model tiny was charged 200% of its configured "
                    "output-token limit over the last 5m, summed over the engines of one instance; "
                    "the limiter allows at most about 105.7% plus one token. Either "
                    "the limiter is broken or the user is served by more than one "
                    "engine (each engine has its own budget). Tokens borrowed above a "
                    "guaranteed rate (a limit with a ceiling) are not charged and never "
                    "count here: see the runbook's 'A user is above its rate'."),
            ],
        },
        {
            "name": "over limit: users at, or just under the bound above, their limit do not fire",
            "interval": "1m",
            "input_series": [
                # exactly at the limit (a throttled user): 20 tok/s
                series("tokens_charged", "0+1200x30", user="user-a"),
                series(user_limit, "20x30", user="user-a"),
                # 5% above (rate() extrapolation, snapshot timing): inside the slack
                series("tokens_charged", "0+63x30", user="user-slow"),
                series(user_limit, "1x30", user="user-slow"),
                # the overflow label has no limit of its own: never compared
                series("tokens_charged", "0+60000x30", user="__other__"),
            ],
            "alert_rule_test": [quiet(over, "20m")],
            "promql_expr_test": [{
                "expr": 'model_user:vllm_output_rate_tokens_charged_per_limit:ratio_rate5m{user="user-a"}',
                "eval_time": "20m",
                "exp_samples": [{"labels": f'model_user:vllm_output_rate_tokens_charged_per_limit:ratio_rate5m{{model_name="{MODEL}",user="user-a"}}',
                                 "value": 1}],
            }],
        },
        {
            "name": "throttled continuously: a user throttled the whole time",
            "interval": "1m",
            "input_series": [
                series("throttled_requests", "3x60", user="user-a"),
                series("throttled_requests", "0x60", user="user-b"),
            ],
            "alert_rule_test": [
                fires(c, cont, "50m", {"severity": "info", "model_name": MODEL, "user": "user-a"},
                    "User user-a is throttled almost all the time on model tiny",
                    "User user-a on model tiny had throttled requests 100% of the "
                    "last 30m (alert above 90%): its demand stays above its limit. "
                    "Its requests wait holding KV cache; raise its limit (tier) or "
                    "ask it to send less."),
            ],
        },
        {
            "name": "throttled continuously: half the time, or only since a few minutes, does not fire",
            "interval": "1m",
            "input_series": [
                series("throttled_requests", " ".join(["2 0"] * 30), user="user-a"),
                # a new user throttled from its first minute: 15 of the last 30 minutes
                series("throttled_requests", "_x40 4x15", user="user-new"),
            ],
            "alert_rule_test": [quiet(cont, "55m")],
        },
    ]


def fleet_cases(c: Config) -> list[dict[str, Any]]:
    """Two replicas (the alert names the one that breaks the rule)."""
    user_limit = "user_limit_tokens_per_second"
    over = "OutputRateUserOverLimit"
    cont = "OutputRateUserThrottledContinuously"
    ratio = "model_user:vllm_output_rate_tokens_charged_per_limit:ratio_rate5m"
    at_limit_share = [  # user-a at 0.9 of its 20 tok/s (1080 tokens a minute) on both replicas
        s for r in (R1, R2)
        for s in (series("tokens_charged", "0+1080x30", user="user-a", instance=r),
                  series(user_limit, "20x30", user="user-a", instance=r))]
    return [
        {
            "name": "fleet, over limit: a user at 0.9x its limit on each of two replicas does not fire",
            "interval": "1m",
            "input_series": at_limit_share,
            "alert_rule_test": [quiet(over, "20m")],
            "promql_expr_test": [{
                "expr": f'{ratio}{{user="user-a"}}',
                "eval_time": "20m",
                "exp_samples": [
                    {"labels": f'{ratio}{{instance="{r}",model_name="{MODEL}",user="user-a"}}', "value": 0.9}
                    for r in (R1, R2)],
            }],
        },
        {
            "name": "fleet, over limit: a user over its limit on one replica fires for that replica",
            "interval": "1m",
            "input_series": [
                *at_limit_share,
                # user-b: 30 tok/s on replica 1, 10 tok/s on replica 2, limit 20 on both
                series("tokens_charged", "0+1800x30", user="user-b", instance=R1),
                series("tokens_charged", "0+600x30", user="user-b", instance=R2),
                series(user_limit, "20x30", user="user-b", instance=R1),
                series(user_limit, "20x30", user="user-b", instance=R2),
            ],
            "alert_rule_test": [
                quiet(over, "4m"),  # not yet for 5m
                fires(c, over, "15m", {"severity": "critical", "model_name": MODEL, "user": "user-b",
                                     "instance": R1},
                    f"User user-b gets more output tokens than its limit on model tiny on instance {R1}",
                    f"User user-b on model tiny on instance {R1} was charged 150% of its "
                    "configured output-token limit over the last 5m, summed over the "
                    "engines of one instance; the limiter allows at most about 105.7% "
                    "plus one token. Either the limiter is broken or the user is served "
                    "by more than one engine (each engine has its own budget). Tokens "
                    "borrowed above a guaranteed rate (a limit with a ceiling) are not "
                    "charged and never count here: see the runbook's 'A user is above its "
                    "rate'."),
            ],
        },
        {
            "name": "fleet, throttled continuously: throttled the whole time on one replica fires for it",
            "interval": "1m",
            "input_series": [
                series("throttled_requests", "3x60", user="user-a", instance=R1),
                series("throttled_requests", "0x60", user="user-a", instance=R2),
            ],
            "alert_rule_test": [
                fires(c, cont, "50m", {"severity": "info", "model_name": MODEL, "user": "user-a",
                                     "instance": R1},
                    f"User user-a is throttled almost all the time on model tiny on instance {R1}",
                    f"User user-a on model tiny on instance {R1} had throttled requests 100% "
                    "of the last 30m (alert above 90%): its demand stays above its limit. "
                    "Its requests wait holding KV cache; raise its limit (tier) or ask it "
                    "to send less."),
            ],
        },
        {
            "name": "fleet, throttled continuously: half the time on each of two replicas does not fire",
            "interval": "1m",
            "input_series": [
                # replica 1 in the even minutes, replica 2 in the odd ones
                series("throttled_requests", " ".join(["2 0"] * 30), user="user-a", instance=R1),
                series("throttled_requests", " ".join(["0 2"] * 30), user="user-a", instance=R2),
            ],
            "alert_rule_test": [quiet(cont, "55m")],
        },
    ]
